"""Turn one Flower message into what a client handler needs, and a reply back into a message.

Settings travel inside every message (the ConfigRecord "config"), not in ``context.run_config``:
that keeps a client correct under `flwr run`, under the in-process simulation (which has an
empty run config) and on a real SuperNode alike. The only thing a client learns from its own
node is where its own data is (a partition id or its own folder: clients/node_data.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from clients.node_data import (
    DatasetShape,
    NodeConfigError,
    NodeData,
    OwnSplit,
    PartitionData,
    node_data,
    partition_of,
)
from fcl_flower.config import RunConfig
from fcl_flower.data import FederatedSplit, LabelledDataset
from fcl_flower.models import IncrementalClassifier, load_trainable_state
from fcl_flower.runtime import build_model_for_shape, resolve_device
from fcl_flower.wire import from_record, to_record

ROUND_KEYS = ("phase", "task", "round-lr", "num-seen-classes", "server-round")
__all__ = ["ClientJob", "NodeConfigError", "make_reply", "parse_job", "partition_of"]


@dataclass
class ClientJob:
    """Everything a client handler needs for one round."""

    cfg: RunConfig
    phase: str
    task: int
    partition: int
    lr: float
    num_seen: int
    round_config: dict[str, Any]
    data: NodeData  # this node's own samples only (clients/node_data.py)
    model: IncrementalClassifier
    device: torch.device
    context: Context

    def local_data(self, *, eval_transform: bool) -> LabelledDataset:
        """Only this client's own partition of the current task."""
        return self.data.train(self.task, eval_transform=eval_transform)

    @property
    def task_classes(self) -> range:
        return self.data.tasks[self.task]

    @property
    def split(self) -> FederatedSplit | OwnSplit:
        """The federated split; on a node with only its own folder (data-dir), a view that serves
        the task layout and this client's own partition and raises for anything else."""
        return self.data.split if isinstance(self.data, PartitionData) else OwnSplit(self.data)


@lru_cache(maxsize=2)
def _cached_model(cfg: RunConfig, shape: DatasetShape) -> IncrementalClassifier:
    return build_model_for_shape(cfg, shape.num_classes, shape.image_shape)


def parse_job(message: Message, context: Context) -> ClientJob:
    settings = dict(message.content.config_records["config"])
    round_config = {k: settings.pop(k) for k in list(settings) if k not in _run_keys()}
    cfg = RunConfig.from_mapping(settings)
    data = node_data(context.node_config, cfg)
    model = _cached_model(cfg, data.shape)
    if "arrays" in message.content.array_records:
        load_trainable_state(model, from_record(message.content.array_records["arrays"]))
    return ClientJob(
        cfg=cfg,
        phase=str(round_config["phase"]),
        task=int(round_config["task"]),
        partition=data.partition,
        lr=float(round_config.get("round-lr", cfg.lr)),
        num_seen=int(round_config["num-seen-classes"]),
        round_config=round_config,
        data=data,
        model=model,
        device=resolve_device(cfg),
        context=context,
    )


@lru_cache(maxsize=1)
def _run_keys() -> frozenset[str]:
    return frozenset(RunConfig().to_mapping())


def make_reply(message: Message, job: ClientJob, arrays: dict[str, torch.Tensor] | ArrayRecord, num_examples: int,
               metrics: dict[str, int | float] | None = None,
               extra_records: dict[str, ArrayRecord] | None = None) -> Message:
    """Reply with named arrays (record "arrays", plus any ``extra_records``) and the metrics every
    strategy needs to identify the upload."""
    content = RecordDict({
        "arrays": arrays if isinstance(arrays, ArrayRecord) else to_record(arrays),
        **(extra_records or {}),
        "metrics": MetricRecord({"partition-id": job.partition, "num-examples": int(num_examples),
                                 **(metrics or {})}),
    })
    return Message(content=content, reply_to=message)


def config_record(values: dict[str, Any]) -> ConfigRecord:
    return ConfigRecord(values)
