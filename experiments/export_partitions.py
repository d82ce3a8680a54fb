"""Write each client's share of the federated split into its own folder, for real SuperNodes.

    python experiments/export_partitions.py --out /data/fcl --num-clients 3 --num-tasks 3 --seed 0

gives ``/data/fcl/client-0``, ``client-1``, ... Copy ``client-k`` to the machine of client k
and start its SuperNode with ``--node-config "data-dir='/data/fcl/client-k'"``: that SuperNode
then holds and reads only its own samples (all tasks), never another client's. Each folder holds

* ``meta.json``: format, the split settings it was cut with (dataset, seed, num-tasks,
  first-task-classes, num-clients, beta, image-size), its partition id, the task class ranges
  and the dataset's shape (number of classes, image shape);
* ``task-<t>.npz``: ``images`` (untransformed, as the dataset stores them) and ``labels``
  (class-order positions) of the client's training samples of task t, in the split's order --
  so a run on exported folders computes exactly what the simulation computes;
* ``test.npz``: the client's held-out samples (its share of the test set, all tasks) for federated
  evaluation (``evaluation = federated``: the clients' shares partition the test set);
* ``images/`` (ImageNet-R only): copies of the client's image files.

The flags are the run-config flags of ``experiments/sim.py`` that define the split; the run
must later use the same values (the client checks and refuses a mismatch).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from clients.node_data import FORMAT, META_FILE, SPLIT_KEYS, TEST_FILE
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import DatasetError, FederatedSplit, LabelledDataset


def raw_items(dataset: LabelledDataset) -> np.ndarray | list[str]:
    """The untransformed stored items of a view (array rows or file paths), in view order.

    Reads the view's shared storage: exporting must copy the bytes as stored, not the
    transformed tensors, so that the client applies the same transforms as the simulation.
    """
    storage = dataset._storage
    if storage.kind == "paths":
        return [storage.images[int(j)] for j in dataset.indices]
    return np.ascontiguousarray(np.asarray(storage.images)[dataset.indices])


def export_client(split: FederatedSplit, cfg: RunConfig, client: int, folder: Path) -> dict[str, int]:
    """Write client ``client``'s training samples of every task into ``folder``."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    kind = split.bundle.train.storage_kind
    counts = {}

    def write(file: str, data: LabelledDataset, prefix: str) -> None:
        images = raw_items(data)
        if kind == "paths":  # copy the files; store paths relative to the folder
            rel = []
            for i, src in enumerate(images):
                name = Path("images") / f"{prefix}-{i:06d}{Path(src).suffix.lower()}"
                (folder / name).parent.mkdir(exist_ok=True)
                shutil.copyfile(src, folder / name)
                rel.append(str(name))
            images = np.asarray(rel, dtype=str)
        np.savez(folder / file, images=images, labels=np.asarray(data.targets, dtype=np.int64))

    for t in range(split.num_tasks):
        data = split.client_train(t, client)
        write(f"task-{t}.npz", data, f"t{t}")
        counts[f"task-{t}"] = len(data)
    test = split.client_test(split.num_tasks - 1, client)
    write(TEST_FILE, test, "test")
    counts["test"] = len(test)
    settings = cfg.to_mapping()
    meta = {
        "format": FORMAT,
        **{k: settings[k] for k in SPLIT_KEYS},
        "partition-id": client,
        "num-classes": split.bundle.num_classes,
        "image-shape": list(split.bundle.image_shape),
        "tasks": [[r.start, r.stop] for r in split.tasks],
        "storage": kind,
        "samples": counts,
    }
    (folder / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return counts


def export_partitions(cfg: RunConfig, out: Path) -> list[Path]:
    """One folder per client under ``out``; returns their paths."""
    from fcl_flower.runtime import federated_split

    split = federated_split(cfg)
    folders = []
    for k in range(cfg.num_clients):
        folder = Path(out).expanduser().resolve() / f"client-{k}"
        export_client(split, cfg, k, folder)
        folders.append(folder)
    return folders


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", required=True, help="Folder that receives client-0, client-1, ...")
    wanted = set(SPLIT_KEYS) | {"data-root", "download"}
    for knob in RunConfig.knobs():
        key = RunConfig.key(knob.name)
        if key not in wanted:
            continue
        kwargs = {"default": knob.default, "help": knob.metadata["help"], "dest": knob.name}
        if isinstance(knob.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = type(knob.default)
            if knob.metadata.get("choices"):
                kwargs["choices"] = knob.metadata["choices"]
        parser.add_argument("--" + key, **kwargs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.__dict__.pop("out")
    try:
        cfg = RunConfig(**vars(args)).validated()
        folders = export_partitions(cfg, Path(out))
    except (ConfigError, DatasetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for folder in folders:
        meta = json.loads((folder / META_FILE).read_text())
        train = sum(v for k, v in meta["samples"].items() if k != "test")
        print(f"{folder}: {train} training and {meta['samples']['test']} held-out samples ({meta['samples']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
