"""A SuperNode that brings its own images (``dataset = custom``): the :class:`NodeData` of a site.

The run config holds the federation's class list (``class-names`` or a ``task-plan`` file) and
the image size; each SuperNode's node config says where its images are and which client it is::

    flower-supernode ... --node-config "data-dir='/srv/images' partition-id=2"

============================  ==========================================================================
``data-dir``                  the site's folder: image folders, a manifest or a ``datasets`` folder
                              (fcl_flower/data/own.py describes the layouts). Required.
``partition-id``              this site's client id, ``0..num-clients-1``. Required, and distinct per site: the
                              server maps each SuperNode to the client id it claims at first contact and
                              refuses two nodes that claim the same id (strategies/nodes.py).
``data-format``               ``auto`` (by the folder's content), ``imagefolder``, ``manifest`` or ``hf``.
``manifest``                  a manifest file other than ``<data-dir>/manifest.csv`` / ``manifest.json``.
``test-fraction``             share of each class held out for federated evaluation when the folder gives no
                              held-out split (default 0.2; drawn with the run seed and the class name).
``augment``                   training augmentation: ``auto``, ``crop-flip``, ``crop`` or ``none``
                              (fcl_flower/data/transforms.py, ``own_transforms``).
``max-image-pixels``          the largest image decoded, in pixels (default 40000000, ``MAX_PIXELS`` of
                              fcl_flower/data/own.py); a larger one is refused naming the file.
``files-outside-data-dir``    ``true``: manifest rows and linked files may lie outside ``data-dir``
                              (default ``false``: refused naming the row or file).
============================  ==========================================================================

Answering ``query.info`` reads only the node config, so a site with a bad folder is still known
by its client id: its first round that needs the images fails with one line naming the file in
the site's own log, and the server records that client as left out of the stage with one generic
line (clients/app.py: no path or file-system error of a site reaches the server).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.node_data import DatasetShape, NodeConfigError, partition_of
from fcl_flower.config import RunConfig
from fcl_flower.data import DatasetError, LabelledDataset, TaskPlan
from fcl_flower.data.own import DEFAULT_TEST_FRACTION, MAX_PIXELS, OwnData, OwnSettings, load_own

#: The node-config keys a site with its own images reads (module doc).
OWN_KEYS = (
    "data-dir",
    "partition-id",
    "data-format",
    "manifest",
    "test-fraction",
    "augment",
    "max-image-pixels",
    "files-outside-data-dir",
)
START_HINT = "--node-config \"data-dir='<folder of images>' partition-id=<k>\" (k: this site's client id)"


@dataclass(frozen=True)
class OwnNodeData:
    """One site's images as the client handlers see them (the :class:`NodeData` protocol). The
    folder is indexed on first use of ``train``/``test`` and cached per process."""

    folder: Path
    partition: int
    plan: TaskPlan
    settings: OwnSettings

    @property
    def tasks(self) -> list[range]:
        return list(self.plan.tasks)

    @property
    def shape(self) -> DatasetShape:
        return DatasetShape(self.plan.dataset, self.plan.num_classes, self.plan.image_shape)

    @property
    def data(self) -> OwnData:
        return load_own(self.folder, self.plan, self.settings)

    def train(self, task: int, *, eval_transform: bool) -> LabelledDataset:
        return self.data.train(task, eval_transform=eval_transform)

    def test(self, upto_task: int) -> LabelledDataset:
        return self.data.test(upto_task)


def own_settings(node_config: Mapping[str, Any], cfg: RunConfig) -> OwnSettings:
    """How this site reads its folder, from its node config (keys in the module doc)."""
    try:
        fraction = node_config.get("test-fraction", DEFAULT_TEST_FRACTION)
        if isinstance(fraction, bool):
            raise ValueError
        return OwnSettings(
            data_format=str(node_config.get("data-format", "auto")),
            manifest=str(node_config.get("manifest", "")),
            test_fraction=float(fraction),
            augment=str(node_config.get("augment", "auto")),
            seed=cfg.seed,
            max_pixels=node_config.get("max-image-pixels", MAX_PIXELS),
            files_outside=node_config.get("files-outside-data-dir", False),
        )
    except (TypeError, ValueError) as err:  # DatasetError is a ValueError
        detail = str(err) if isinstance(err, DatasetError) else "test-fraction must be a number in [0, 1)"
        raise NodeConfigError(f"node config: {detail}") from None


def own_node_data(node_config: Mapping[str, Any], cfg: RunConfig) -> OwnNodeData:
    """This site's data under ``dataset = custom``; refuses a node config without its folder or id."""
    from fcl_flower.runtime import task_plan

    node_config = getattr(node_config, "node_config", node_config)  # a flwr Context works too
    if "data-dir" not in node_config:
        raise NodeConfigError(f"dataset 'custom': this SuperNode names no image folder; start it with {START_HINT}")
    if "partition-id" not in node_config:
        raise NodeConfigError(
            "dataset 'custom': this SuperNode has no partition-id; every site needs its own client id "
            f"0..{cfg.num_clients - 1} (the server refuses two sites claiming one id): start it with {START_HINT}"
        )
    if cfg.partition == "task-pool":
        raise NodeConfigError("dataset 'custom' follows the plan's tasks; partition 'task-pool' needs a public dataset")
    partition = partition_of(node_config, cfg.num_clients)
    settings = own_settings(node_config, cfg)
    plan = task_plan(cfg)
    folder = Path(str(node_config["data-dir"])).expanduser()
    return OwnNodeData(folder, partition, plan, settings)
