"""Fed-LwF (Li & Hoiem 2016, federated as in TARGET/LANDER): FedAvg + distillation from the
previous task's global model.

``finetune``'s schedule (see :mod:`strategies.gradient`); from task 2 on, clients apply the
cross-entropy to the new task's classes only, as the TARGET/LANDER code does (clients/lwf.py),
and add ``lwf-alpha · KD`` (temperature ``lwf-temperature``) towards the *teacher*, the global
model at the end of the previous task. The server keeps the teacher and sends it with every
round of the task (:attr:`TrainIns.teacher`), so clients stay stateless.

Hyper-parameters (the STSA paper names the baseline but gives no values; its code takes them
from the TARGET/LANDER code): T = 2, KD weight 3.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.models import trainable_state
from fcl_flower.protocol import Instruction, TrainIns
from fcl_flower.results import ResultsRecorder
from fcl_flower.tensors import tensor_record
from strategies.base import RoundPlan
from strategies.gradient import GradientStrategy


class LwFStrategy(GradientStrategy):
    later_phase = "lwf"

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        if cfg.lwf_alpha < 0:
            raise ConfigError(f"lwf-alpha must be >= 0 (got {cfg.lwf_alpha})")
        if cfg.lwf_temperature <= 0:
            raise ConfigError(f"lwf-temperature must be > 0 (got {cfg.lwf_temperature})")
        self.teacher: dict[str, torch.Tensor] | None = None

    def end_stage(self, task: int) -> dict[str, Any]:
        extra = super().end_stage(task)
        self.teacher = trainable_state(self.model)  # the teacher of the next task
        return extra

    def customise(self, plan: RoundPlan, ins: Instruction) -> Instruction:
        if plan.phase != self.later_phase:
            return ins
        if self.teacher is None:
            raise RuntimeError("LwF round planned before any task ended: no teacher")
        assert isinstance(ins, TrainIns)
        return dataclasses.replace(ins, teacher=tensor_record(self.teacher))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "teacher": self.teacher}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.teacher = state["teacher"]
