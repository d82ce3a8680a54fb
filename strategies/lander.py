"""LANDER (Tran et al., "Text-Enhanced Data-free Approach for Federated Class-Incremental
Learning", CVPR 2024) as a Flower strategy.

LANDER is TARGET's scheme -- a server-side generator distilled from the global model after each
task, clients distilling the previous model on its synthetic images -- organised around
*label-text-embedding (LTE) anchors*:

* the model has an anchor head (``IncrementalClassifier.anchor``) mapping features into the
  LTE space; clients keep each sample's anchor embedding within radius ``lander-radius`` of its
  class's LTE (the bounding loss), from task 1 on;
* the generator makes images *from* the LTE of the classes it is asked for (plus noisy layers),
  with learnable data statistics, and its images must land near their anchors too;
* clients of later tasks weigh the current task's losses and the distillation (logits and anchor
  embeddings of the teacher on the synthetic images) by LANDER's task-adaptive weights.

The LTE come from a pretrained text encoder on the server (:mod:`strategies.anchors`, with a
documented offline fallback) and travel in every message (``TrainIns.anchors``). As in the
LANDER code, each task ends with the global model of the round whose clients reported the
lowest total training loss (the model they started from), not necessarily the last one.

Results extras: ``anchors`` (where the LTE came from, first stage), ``selected_round`` and
``synthesis`` (as TARGET's; strategies/target.py). Departures: docs/method_notes_target_lander.md §3.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from flwr.app import ArrayRecord

from fcl_flower.config import RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.models import load_trainable_state, trainable_state
from fcl_flower.protocol import Instruction, TrainIns, TrainRes
from fcl_flower.results import ResultsRecorder
from fcl_flower.tensors import tensor_record
from strategies.anchors import class_names, label_text_embeddings
from strategies.base import Accepted, RoundPlan
from strategies.generator import DataFreeReplay
from strategies.gradient import GradientStrategy


class LANDERStrategy(GradientStrategy):
    first_phase = "lander"
    later_phase = "lander"

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        names = class_names(cfg, split.plan)
        self.anchors, self.anchor_source = label_text_embeddings(names, cfg.text_encoder, self.method.anchor_dim)
        self.replay = DataFreeReplay(cfg, split.image_shape, "lander", self.device, anchors=self.anchors)
        self.teacher: dict[str, torch.Tensor] | None = None
        self._anchor_record = tensor_record({"anchors": self.anchors})
        self._records: tuple[ArrayRecord, ArrayRecord] | None = None
        self._best: tuple[float, int, dict[str, torch.Tensor]] | None = None  # (loss, round, model)

    def customise(self, plan: RoundPlan, ins: Instruction) -> Instruction:
        assert isinstance(ins, TrainIns)
        if plan.task == 0:
            return dataclasses.replace(ins, anchors=self._anchor_record)
        if self.teacher is None:
            raise RuntimeError("LANDER round of a later task planned before any task ended: no teacher")
        if self._records is None:
            self._records = (tensor_record(self.teacher), self.replay.record())
        teacher, synthetic = self._records
        return dataclasses.replace(ins, anchors=self._anchor_record, teacher=teacher, synthetic=synthetic)

    def aggregate_round(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        """FedAvg, after noting the model the clients started from if they trained to the lowest
        total loss of the task so far ([CODE-L] keeps that model as the task's result)."""
        losses = [r.num_examples * r.reply.loss for r in replies if isinstance(r.reply, TrainRes)]
        total = math.fsum(losses)
        if self._best is None or total < self._best[0]:
            self._best = (total, plan.index + 1, trainable_state(self.model))
        super().aggregate_round(plan, replies)

    def end_stage(self, task: int) -> dict[str, Any]:
        extra = super().end_stage(task)
        if task == 0:
            extra["anchors"] = self.anchor_source
        if self._best is not None:
            load_trainable_state(self.model, self._best[2])
            extra["selected_round"] = self._best[1]
            self._best = None
        if task < self.num_tasks - 1:
            self.teacher = trainable_state(self.model)
            extra["synthesis"] = self.replay.synthesize(self.model, self.num_seen(task), task).log
            self._records = None
        return extra

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "teacher": self.teacher, "replay": self.replay.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.teacher = state["teacher"]
        self.replay.load_state_dict(state["replay"])
        self._records = None
