"""TARGET (Zhang et al., "TARGET: Federated Class-Continual Learning via Exemplar-Free
Distillation", ICCV 2023) as a Flower strategy.

Task 1 is plain FedAvg (clients: cross-entropy on the task's classes). After every task but the
last, the server keeps the global model as the *teacher* of the next task and trains a
generator against it, data-free (:class:`strategies.generator.DataFreeReplay`, flavour
``target``): the synthetic pool stands in for the old classes' data. Every round of a later task
sends the global model, the teacher (``TrainIns.teacher``) and the pool
(``TrainIns.synthetic``, 8-bit images, no labels); clients minimise the cross-entropy on their
new classes plus ``kd-weight`` x KD of the teacher's old-class outputs on the synthetic images
(clients/target.py). Aggregation is sample-weighted FedAvg.

Results extras per stage (but the last): ``synthesis`` -- per synthesis round the generator's
objective at its first and last iteration, the terms of the last iteration, the student's mean
KD loss per round, the pool size and the percentage of the pool the teacher classifies as the
class it was generated for. Every departure from the paper and the code:
docs/method_notes_target_lander.md §2.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from flwr.app import ArrayRecord

from fcl_flower.config import RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.models import trainable_state
from fcl_flower.protocol import Instruction, TrainIns
from fcl_flower.results import ResultsRecorder
from fcl_flower.tensors import tensor_record
from strategies.base import RoundPlan
from strategies.generator import DataFreeReplay
from strategies.gradient import GradientStrategy


class TARGETStrategy(GradientStrategy):
    later_phase = "target"

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        self.replay = DataFreeReplay(cfg, split.image_shape, "target", self.device)
        self.teacher: dict[str, torch.Tensor] | None = None
        self._records: tuple[ArrayRecord, ArrayRecord] | None = None

    def end_stage(self, task: int) -> dict[str, Any]:
        extra = super().end_stage(task)
        if task < self.num_tasks - 1:  # the codes generate for the next task only
            self.teacher = trainable_state(self.model)
            extra["synthesis"] = self.replay.synthesize(self.model, self.num_seen(task), task).log
            self._records = None
        return extra

    def customise(self, plan: RoundPlan, ins: Instruction) -> Instruction:
        if plan.phase != self.later_phase:
            return ins
        if self.teacher is None:
            raise RuntimeError("TARGET round of a later task planned before any task ended: no teacher")
        if self._records is None:
            self._records = (tensor_record(self.teacher), self.replay.record())
        assert isinstance(ins, TrainIns)
        teacher, synthetic = self._records
        return dataclasses.replace(ins, teacher=teacher, synthetic=synthetic)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "teacher": self.teacher, "replay": self.replay.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.teacher = state["teacher"]
        self.replay.load_state_dict(state["replay"])
        self._records = None
