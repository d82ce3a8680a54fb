"""Where a client finds its own training data: the node config of its SuperNode.

Two ways to point a SuperNode at its data (``flower-supernode --node-config "..."``):

* ``data-dir=<folder>`` -- a folder holding *only this client's* training samples, written by
  ``experiments/export_partitions.py`` (one folder per client, one ``task-<t>.npz`` per task).
  The client opens nothing else: no dataset download, no other client's samples. This is the
  deployment mode.
* ``partition-id=<k> num-partitions=<K>`` -- the client derives its partition from the public
  dataset with the run's seed and keeps only partition ``k``. Convenient for simulations and
  demos on public benchmarks, where every machine has the dataset anyway; the process does load
  the whole public training set to cut out its share. The dataset's folder is the node's own
  (node config ``data-root``, else ``$FCL_DATA_ROOT``, else ``~/.cache/fcl-flower/data``),
  never the run config's ``data-root``: a client opens no path the server names.

Under ``dataset = custom`` each site brings its own images instead: ``data-dir`` names a folder of
image folders, a manifest or a Hugging Face ``datasets`` folder, and ``partition-id`` the site's
client id (clients/own_data.py; recipe in docs/own_data.md).

Either way a client handler sees one interface, :class:`NodeData`: the task layout, the shape
of the model's input and output, and ``train(task)`` -- its own samples of that task. A message
that only needs to know which client this node serves (``query.info`` and the key, share and
unmask steps of a secure round) asks :func:`node_partition`, which reads the node config and a
client folder's ``meta.json`` and opens no samples (and imports no torch, issue 32).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fcl_flower.config import RunConfig
from fcl_flower.data.array_cache import CACHE_DIR, cached_arrays, source_key
from fcl_flower.data.paper_partitions import PROTOCOL_ARGS

if TYPE_CHECKING:  # the datasets import torch: a message that only asks which client this is does not
    from fcl_flower.data import FederatedSplit, LabelledDataset
    from fcl_flower.data.labelled import Transform

FORMAT = "fcl-flower-client-data/1"
META_FILE = "meta.json"
TEST_FILE = "test.npz"
# Run-config keys that decide which samples a client holds and what their labels mean. A client
# folder exported under other values would silently train on a different split.
SPLIT_KEYS = (
    "dataset",
    "seed",
    "num-tasks",
    "first-task-classes",
    "num-clients",
    "beta",
    "image-size",
    *(RunConfig.key(arg) for arg in PROTOCOL_ARGS),
)


#: node config: the folder of the public datasets on this node (``partition-id`` mode)
DATA_ROOT_KEY = "data-root"


class NodeConfigError(ValueError):
    """The SuperNode's node config does not say (correctly) where its own data is."""


@dataclass(frozen=True)
class DatasetShape:
    """What a model needs to know about a dataset without seeing it."""

    name: str
    num_classes: int
    image_shape: tuple[int, int, int]


class NodeData(Protocol):
    """One client's view of the federated data: its own training samples and nothing else."""

    @property
    def partition(self) -> int: ...

    @property
    def tasks(self) -> list[range]: ...

    @property
    def shape(self) -> DatasetShape: ...

    def train(self, task: int, *, eval_transform: bool) -> LabelledDataset:
        """This client's training samples of ``task`` (eval transforms for statistics)."""
        ...

    def test(self, upto_task: int) -> LabelledDataset:
        """This client's held-out samples of every class of tasks ``0..upto_task`` (eval
        transforms): what it scores the global model on under federated evaluation."""
        ...


# ---------------------------------------------------------------------------- partition spec
@dataclass(frozen=True)
class PartitionData:
    """Partition ``partition`` of the seeded federated split of a public dataset."""

    split: FederatedSplit
    partition: int

    @property
    def tasks(self) -> list[range]:
        return self.split.tasks

    @property
    def shape(self) -> DatasetShape:
        bundle = self.split.bundle
        c, h, w = bundle.image_shape
        return DatasetShape(bundle.name, bundle.num_classes, (c, h, w))

    def train(self, task: int, *, eval_transform: bool) -> LabelledDataset:
        return self.split.client_train(task, self.partition, eval_transform=eval_transform)

    def test(self, upto_task: int) -> LabelledDataset:
        return self.split.client_test(upto_task, self.partition)


def partition_of(node_config: Mapping[str, Any], num_clients: int) -> int:
    """The partition id a node config names, checked against the run's number of clients."""
    node_config = getattr(node_config, "node_config", node_config)  # a flwr Context works too
    if "partition-id" not in node_config:
        raise NodeConfigError(
            "node config names no data: start the SuperNode with --node-config "
            '"data-dir=\'<client folder>\'" or "partition-id=<k> num-partitions=<K>"'
        )
    partition = _as_int(node_config["partition-id"], "partition-id")
    declared = node_config.get("num-partitions")
    if declared is not None and _as_int(declared, "num-partitions") != num_clients:
        raise NodeConfigError(f"node has num-partitions={declared} but the run has num-clients={num_clients}")
    if not 0 <= partition < num_clients:
        raise NodeConfigError(f"partition-id {partition} outside 0..{num_clients - 1}")
    return partition


# ---------------------------------------------------------------------------- own folder
@dataclass(frozen=True)
class FolderData:
    """A client folder written by ``experiments/export_partitions.py``: only this client's data."""

    folder: Path
    partition: int
    tasks: list[range]
    shape: DatasetShape
    meta: dict[str, Any]
    _train: tuple[LabelledDataset, ...]
    _eval_transform: Transform | None
    _test: LabelledDataset | None = None  # test.npz: this client's held-out samples, all tasks

    def train(self, task: int, *, eval_transform: bool) -> LabelledDataset:
        if not 0 <= task < len(self._train):
            raise NodeConfigError(f"task {task} not in the client folder {self.folder} (it has {len(self._train)})")
        data = self._train[task]
        return data.with_transform(self._eval_transform) if eval_transform else data

    def test(self, upto_task: int) -> LabelledDataset:
        if self._test is None:
            raise NodeConfigError(
                f"client folder {self.folder} has no test.npz (held-out data for federated evaluation); "
                "re-export it with experiments/export_partitions.py"
            )
        if not 0 <= upto_task < len(self.tasks):
            raise NodeConfigError(f"task {upto_task} not in the client folder {self.folder}")
        seen = self.tasks[upto_task].stop
        return self._test.subset(np.flatnonzero(self._test.targets < seen))

    def check_matches(self, cfg: RunConfig) -> None:
        """Refuse a run whose split settings differ from those the folder was exported with."""
        _check_meta(self.folder, self.meta, cfg)


def _check_meta(folder: Path, meta: Mapping[str, Any], cfg: RunConfig) -> None:
    wanted, defaults = cfg.to_mapping(), RunConfig().to_mapping()
    exported = {k: meta.get(k, defaults[k]) for k in SPLIT_KEYS}  # older folders lack newer keys
    changed = [f"{k} (folder {exported[k]!r}, run {wanted[k]!r})" for k in SPLIT_KEYS if exported[k] != wanted[k]]
    if changed:
        raise NodeConfigError(
            f"client folder {folder} was exported for another split: {', '.join(changed)}; "
            "re-run experiments/export_partitions.py with the run's settings"
        )


class OwnSplit:
    """The part of the :class:`FederatedSplit` interface a node with only its own folder can
    serve: the task layout and its *own* partition. Anything that needs other clients' data or
    the test set raises, naming what is missing."""

    def __init__(self, data: NodeData) -> None:
        self._data = data
        self._where = str(getattr(data, "folder", "its own data"))
        self.tasks = data.tasks
        self.num_tasks = len(data.tasks)

    def client_train(self, task: int, client: int, *, eval_transform: bool = False) -> LabelledDataset:
        if client != self._data.partition:
            raise NodeConfigError(
                f"client {client}'s data is not on this node (it holds partition {self._data.partition} only)"
            )
        return self._data.train(task, eval_transform=eval_transform)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # copy/pickle probes, and _data before __init__ ran
            raise AttributeError(name)
        raise NodeConfigError(
            f"split.{name} needs the whole dataset, but this node holds only its own folder {self._where}"
        )


def load_folder(folder: str | Path) -> FolderData:
    """Open a client folder (cached per process: clients are called once per round)."""
    path = Path(folder).expanduser().resolve()
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise NodeConfigError(f"data-dir {path} has no {META_FILE}; write it with experiments/export_partitions.py")
    return _load_folder(str(path), meta_path.stat().st_mtime_ns)


def _read_meta(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise NodeConfigError(f"cannot read {folder / META_FILE}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise NodeConfigError(f"{folder / META_FILE} is not a client folder of format {FORMAT}")
    return meta


@lru_cache(maxsize=4)
def _load_folder(path: str, _mtime: int) -> FolderData:
    from fcl_flower.data import LabelledDataset

    folder = Path(path)
    meta = _read_meta(folder)
    try:
        c, h, w = (int(v) for v in meta["image-shape"])
        shape = DatasetShape(str(meta["dataset"]), int(meta["num-classes"]), (c, h, w))
        tasks = [range(int(a), int(b)) for a, b in meta["tasks"]]
        partition, image_size, storage = int(meta["partition-id"]), int(meta["image-size"]), meta["storage"]
    except (KeyError, TypeError, ValueError) as exc:
        raise NodeConfigError(
            f"{folder / META_FILE} is incomplete or malformed ({type(exc).__name__}: {exc})"
        ) from None
    train_tf, eval_tf = transforms_for(shape.name, image_size or None)
    per_task = []
    for t, r in enumerate(tasks):
        file = folder / f"task-{t}.npz"
        images, labels = _read_arrays(file)
        if labels.size and (labels.min() < r.start or labels.max() >= r.stop):
            raise NodeConfigError(f"{file} has labels outside task {t}'s classes {r.start}..{r.stop - 1}")
        if storage == "paths":  # image files copied next to the arrays
            images = [str(folder / str(p)) for p in images]
        per_task.append(LabelledDataset(images, labels.astype(np.int64), train_tf))
    test = None
    if (folder / TEST_FILE).is_file():
        images, labels = _read_arrays(folder / TEST_FILE)
        if storage == "paths":
            images = [str(folder / str(p)) for p in images]
        test = LabelledDataset(images, labels.astype(np.int64), eval_tf)
    return FolderData(folder, partition, tasks, shape, meta, tuple(per_task), eval_tf, test)


def _read_arrays(file: Path) -> tuple[Any, np.ndarray]:
    """``images`` and ``labels`` of ``file``, through the folder's array cache: the first process
    unpacks the ``.npz`` into memory-mapped ``.npy`` files (``<folder>/.fcl-cache``, keyed by
    the file's content), every later one maps them (fcl_flower/data/array_cache.py)."""

    def unpack() -> dict[str, np.ndarray]:
        try:
            with np.load(file, allow_pickle=False) as arrays:
                return {"images": arrays["images"], "labels": arrays["labels"]}
        except (OSError, KeyError, ValueError) as exc:
            raise NodeConfigError(f"cannot read {file}: {exc}") from None

    cache = file.parent / CACHE_DIR
    try:
        key = source_key(cache, file.stem, [file])
    except OSError as exc:
        raise NodeConfigError(f"cannot read {file}: {exc}") from None
    arrays = cached_arrays(cache, file.stem, key, unpack)
    return arrays["images"], arrays["labels"]


def transforms_for(dataset: str, image_size: int | None) -> tuple[Transform | None, Transform | None]:
    """(train, eval) transforms of ``dataset`` -- the same choice as fcl_flower.data.registry,
    made without loading the dataset (a client folder holds untransformed images)."""
    from fcl_flower.data import transforms as T
    from fcl_flower.data.registry import IMAGENET_R_DEFAULT_SIZE, canonical_name

    name = canonical_name(dataset)
    if name in ("digits", "synthetic"):
        tf = T.tensor_resize(image_size) if image_size is not None else None
        return tf, tf
    if name == "cifar100":
        return T.cifar_transforms() if image_size is None else T.vit_transforms(image_size)
    if name == "tiny-imagenet":
        if image_size is None:
            return T.tiny_imagenet_transforms()
        return T.vit_transforms(image_size, T.TINY_IMAGENET_MEAN, T.TINY_IMAGENET_STD)
    return T.vit_transforms(image_size or IMAGENET_R_DEFAULT_SIZE, T.IMAGENET_MEAN, T.IMAGENET_STD)


# ---------------------------------------------------------------------------- entry point
def node_partition(node_config: Mapping[str, Any], cfg: RunConfig) -> int:
    """Which client (partition) this node serves, with :func:`node_data`'s checks of the node
    config and of a client folder's ``meta.json`` against the run, but without opening a sample
    (no dataset, no torch): what ``query.info`` and the key, share and unmask steps of a secure
    round answer with. A custom dataset (its site's own images) goes through :func:`node_data`."""
    node_config = getattr(node_config, "node_config", node_config)  # a flwr Context works too
    if cfg.dataset == "custom":
        return node_data(node_config, cfg).partition
    if "data-dir" not in node_config:
        return partition_of(node_config, cfg.num_clients)
    folder = Path(str(node_config["data-dir"])).expanduser().resolve()
    if not (folder / META_FILE).is_file():
        raise NodeConfigError(f"data-dir {folder} has no {META_FILE}; write it with experiments/export_partitions.py")
    meta = _read_meta(folder)
    _check_meta(folder, meta, cfg)
    try:
        partition = int(meta["partition-id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise NodeConfigError(
            f"{folder / META_FILE} is incomplete or malformed ({type(exc).__name__}: {exc})"
        ) from None
    if "partition-id" in node_config and partition_of(node_config, cfg.num_clients) != partition:
        raise NodeConfigError(
            f"node config says partition-id={node_config['partition-id']} but {folder} holds partition {partition}"
        )
    return partition


def node_data(node_config: Mapping[str, Any], cfg: RunConfig) -> NodeData:
    """This node's data, from its node config: its own images under ``dataset = custom``, else
    ``data-dir`` if given, else the partition spec."""
    if cfg.dataset == "custom":
        from clients.own_data import own_node_data

        return own_node_data(node_config, cfg)
    if "data-dir" in node_config:
        data = load_folder(str(node_config["data-dir"]))
        data.check_matches(cfg)
        if "partition-id" in node_config and partition_of(node_config, cfg.num_clients) != data.partition:
            raise NodeConfigError(
                f"node config says partition-id={node_config['partition-id']} but {data.folder} "
                f"holds partition {data.partition}"
            )
        return data
    from fcl_flower.runtime import federated_split

    local = cfg.replace(data_root=client_data_root(node_config))  # never the server's data-root
    return PartitionData(federated_split(local), partition_of(node_config, cfg.num_clients))


def client_data_root(node_config: Mapping[str, Any]) -> str:
    """Where this node finds (or downloads) a public dataset: its node config's ``data-root``,
    else ``$FCL_DATA_ROOT`` of its own process, else the default cache folder; never the run
    config's ``data-root``, a path the server names (``experiments/sim.py`` sets
    ``$FCL_DATA_ROOT`` for the simulated clients it starts on its own machine)."""
    from fcl_flower.data.registry import default_root

    node_config = getattr(node_config, "node_config", node_config)  # a flwr Context works too
    root = node_config.get(DATA_ROOT_KEY)
    if root is not None and (not isinstance(root, str) or not root.strip()):
        raise NodeConfigError(f"node config {DATA_ROOT_KEY} must be a folder (got {root!r})")
    return str(Path(root).expanduser().resolve()) if root else str(default_root())


def _as_int(value: Any, key: str) -> int:
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise NodeConfigError(f"node config {key} must be an integer (got {value!r})") from None
