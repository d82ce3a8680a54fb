"""What a client handler works with: the typed instruction, this node's own data, the model.

Settings travel inside every message (the instruction's run config), not in
``context.run_config``: that keeps a client correct under `flwr run`, under the in-process
simulation (which has an empty run config) and on a real SuperNode alike. The only thing a
client learns from its own node is where its own data is (a partition id or its own folder:
clients/node_data.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from flwr.app import Context

from clients.node_data import DatasetShape, NodeData, OwnSplit, PartitionData, node_data
from fcl_flower.config import RunConfig
from fcl_flower.data import FederatedSplit, LabelledDataset
from fcl_flower.models import IncrementalClassifier, load_trainable_state, trainable_state, trainable_tensors
from fcl_flower.protocol import EvaluateIns, StatsIns, StatsRes, TrainIns, TrainRes
from fcl_flower.tensors import state_record, state_views, tensor_layout


@dataclass
class ClientJob:
    """Everything a client handler needs for one round."""

    ins: TrainIns | StatsIns | EvaluateIns
    data: NodeData  # this node's own samples only (clients/node_data.py)
    model: IncrementalClassifier  # the global model the server sent
    device: torch.device
    context: Context

    @property
    def cfg(self) -> RunConfig:
        return self.ins.config

    @property
    def task(self) -> int:
        return self.ins.header.task

    @property
    def server_round(self) -> int:
        return self.ins.header.server_round

    @property
    def partition(self) -> int:
        return self.data.partition

    @property
    def num_seen(self) -> int:
        return self.ins.num_seen

    @property
    def lr(self) -> float:
        return self.ins.lr if isinstance(self.ins, TrainIns) else self.cfg.lr

    @property
    def task_classes(self) -> range:
        return self.data.tasks[self.task]

    @property
    def split(self) -> FederatedSplit | OwnSplit:
        """The federated split; on a node with only its own data (a folder), a view that serves
        the task layout and this client's own partition and raises for anything else."""
        if isinstance(self.data, PartitionData):
            return self.data.split
        return OwnSplit(self.data)

    def local_data(self, *, eval_transform: bool) -> LabelledDataset:
        """Only this client's own partition of the current task."""
        return self.data.train(self.task, eval_transform=eval_transform)

    def round_seed(self) -> int:
        """Shuffling differs per client and round but is reproducible for a given run seed."""
        return (self.cfg.seed * 100_003 + self.server_round) * 1_009 + self.partition

    def train_reply(self, num_examples: int, loss: float, **reports: Any) -> TrainRes:
        """The trained model's trainable state, back to the server."""
        return TrainRes(
            self.ins.header,
            self.partition,
            int(num_examples),
            model=state_record(trainable_state(self.model)),
            loss=float(loss),
            **reports,
        )

    def stats_reply(self, num_examples: int, **fields: Any) -> StatsRes:
        return StatsRes(self.ins.header, self.partition, int(num_examples), **fields)


@lru_cache(maxsize=2)
def _cached_model(cfg: RunConfig, shape: DatasetShape) -> IncrementalClassifier:
    from fcl_flower.runtime import build_model_for_shape

    return build_model_for_shape(cfg, shape.num_classes, shape.image_shape)


def make_job(ins: TrainIns | StatsIns | EvaluateIns, context: Context) -> ClientJob:
    from fcl_flower.runtime import resolve_device

    data = node_data(context.node_config, ins.config)
    model = _cached_model(ins.config, data.shape)
    if len(ins.model):
        # copied into the model: views suffice; split by this model's own layout
        load_trainable_state(model, state_views(ins.model, tensor_layout(trainable_tensors(model))))
    return ClientJob(ins=ins, data=data, model=model, device=resolve_device(ins.config), context=context)
