"""Turn one Flower message into what a client handler needs, and a reply back into a message.

Settings travel inside every message (the ConfigRecord "config"), not in ``context.run_config``:
that keeps a client correct under `flwr run`, under the in-process simulation (which has an
empty run config) and on a real SuperNode alike. The only thing a client learns from its own
node is *which* partition of the data is its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fcl_flower.config import RunConfig
from fcl_flower.data import FederatedSplit, LabelledDataset
from fcl_flower.models import IncrementalClassifier, load_trainable_state
from fcl_flower.runtime import build_model, federated_split, resolve_device
from fcl_flower.wire import from_record, to_record

ROUND_KEYS = ("phase", "task", "round-lr", "num-seen-classes", "server-round")


class NodeConfigError(ValueError):
    """The SuperNode was started without telling it which partition is its own."""


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
    split: FederatedSplit
    model: IncrementalClassifier
    device: torch.device
    context: Context

    def local_data(self, *, eval_transform: bool) -> LabelledDataset:
        """Only this client's own partition of the current task."""
        return self.split.client_train(self.task, self.partition, eval_transform=eval_transform)

    @property
    def task_classes(self) -> range:
        return self.split.tasks[self.task]


def partition_of(context: Context, num_clients: int) -> int:
    """This node's partition id, from its node config (simulation or ``--node-config``)."""
    node_config = context.node_config
    if "partition-id" not in node_config:
        raise NodeConfigError(
            "node config lacks 'partition-id': start the SuperNode with "
            "--node-config \"partition-id=<k> num-partitions=<K>\""
        )
    partition = int(node_config["partition-id"])
    declared = node_config.get("num-partitions")
    if declared is not None and int(declared) != num_clients:
        raise NodeConfigError(f"node has num-partitions={declared} but the run has num-clients={num_clients}")
    if not 0 <= partition < num_clients:
        raise NodeConfigError(f"partition-id {partition} outside 0..{num_clients - 1}")
    return partition


@lru_cache(maxsize=2)
def _cached_model(cfg: RunConfig) -> IncrementalClassifier:
    return build_model(cfg, federated_split(cfg))


def parse_job(message: Message, context: Context) -> ClientJob:
    settings = dict(message.content.config_records["config"])
    round_config = {k: settings.pop(k) for k in list(settings) if k not in _run_keys()}
    cfg = RunConfig.from_mapping(settings)
    split = federated_split(cfg)
    model = _cached_model(cfg)
    if "arrays" in message.content.array_records:
        load_trainable_state(model, from_record(message.content.array_records["arrays"]))
    return ClientJob(
        cfg=cfg,
        phase=str(round_config["phase"]),
        task=int(round_config["task"]),
        partition=partition_of(context, cfg.num_clients),
        lr=float(round_config.get("round-lr", cfg.lr)),
        num_seen=int(round_config["num-seen-classes"]),
        round_config=round_config,
        split=split,
        model=model,
        device=resolve_device(cfg),
        context=context,
    )


@lru_cache(maxsize=1)
def _run_keys() -> frozenset[str]:
    return frozenset(RunConfig().to_mapping())


def make_reply(message: Message, job: ClientJob, arrays: dict[str, torch.Tensor], num_examples: int,
               metrics: dict[str, int | float] | None = None) -> Message:
    """Reply with named arrays plus the metrics every strategy needs to identify the upload."""
    content = RecordDict({
        "arrays": to_record(arrays),
        "metrics": MetricRecord({"partition-id": job.partition, "num-examples": int(num_examples),
                                 **(metrics or {})}),
    })
    return Message(content=content, reply_to=message)


def config_record(values: dict[str, Any]) -> ConfigRecord:
    return ConfigRecord(values)
