"""Fed-EWC (Kirkpatrick et al. 2017): FedAvg + a Fisher-weighted penalty; the Fisher is aggregated
over clients.

``finetune``'s schedule, plus, after the last training round of every task but the last, one
``ewc-stats`` round in which clients upload the diagonal Fisher of the global model on their
data of that task (counted in the stage's upload bytes). The server takes the sample-weighted
mean, folds it into a class-count-weighted running average over tasks, and from then on sends
Fisher + anchor (the end-of-task global model) with every training round; clients add
``ewc-lambda/2 · Σ F (θ − θ*)²``. Math: :mod:`fcl_flower.fcl.ewc`.

Hyper-parameters: λ = 1000 with each client's Fisher clamped at 1e-4 (TARGET/LANDER code).
Differences from that code: the Fisher is that of the *global* model, aggregated over clients
on the server (the code keeps one per client, of its local model), computed in eval mode
without augmentation; the penalty acts on the model being trained.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.fcl.ewc import aggregate_fishers, merge_task_fishers, trainable_parameters
from fcl_flower.protocol import Instruction, Reply, StatsRes, TrainIns, UploadError
from fcl_flower.protocol.payloads import read_fisher
from fcl_flower.results import ResultsRecorder
from fcl_flower.tensors import cast_for_wire, tensor_record
from strategies.base import Accepted, RoundPlan
from strategies.fedavg import fedavg_weights
from strategies.gradient import GradientStrategy

FISHER_PHASE = "ewc-stats"


class EWCStrategy(GradientStrategy):
    later_phase = "ewc"

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        if cfg.ewc_lambda < 0:
            raise ConfigError(f"ewc-lambda must be >= 0 (got {cfg.ewc_lambda})")
        if cfg.ewc_fisher_max < 0:
            raise ConfigError(f"ewc-fisher-max must be >= 0 (got {cfg.ewc_fisher_max})")
        self.fisher: dict[str, torch.Tensor] | None = None  # float64, running average over tasks
        self.anchor: dict[str, torch.Tensor] | None = None  # θ*: global parameters at the last task end

    def plan_stage(self, task: int) -> list[RoundPlan]:
        plans = super().plan_stage(task)
        if task < self.num_tasks - 1:  # the last task's Fisher would never be used
            plans.append(self.round_plan(task, FISHER_PHASE))
        return plans

    def read_reply(self, plan: RoundPlan, reply: Reply) -> Any:
        if plan.phase != FISHER_PHASE:
            return super().read_reply(plan, reply)
        if not isinstance(reply, StatsRes):
            raise UploadError("expected a statistics reply")
        return read_fisher(reply.arrays, trainable_parameters(self.model))

    def aggregate_round(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        if plan.phase != FISHER_PHASE:
            super().aggregate_round(plan, replies)
            return
        weights = fedavg_weights([r.num_examples for r in replies], weighted=True)
        task_fisher = aggregate_fishers([r.payload for r in replies], weights)
        previous = self.split.classes_through(plan.task - 1) if plan.task > 0 else 0  # task pool: per client
        self.fisher = merge_task_fishers(self.fisher, task_fisher, previous, self.split.classes_through(plan.task))
        self.anchor = {k: p.detach().cpu().clone() for k, p in trainable_parameters(self.model).items()}

    def customise(self, plan: RoundPlan, ins: Instruction) -> Instruction:
        if plan.phase != self.later_phase:
            return ins
        if self.fisher is None or self.anchor is None:
            raise RuntimeError("EWC round planned before any Fisher was aggregated")
        assert isinstance(ins, TrainIns)
        fisher = tensor_record({k: cast_for_wire(v, self.cfg.wire_dtype) for k, v in self.fisher.items()})
        return dataclasses.replace(ins, ewc_fisher=fisher, ewc_anchor=tensor_record(self.anchor))

    def end_stage(self, task: int) -> dict[str, Any]:
        extra = super().end_stage(task)
        if self.fisher is not None:
            values = torch.cat([v.flatten() for v in self.fisher.values()])
            extra["fisher"] = {"mean": float(values.mean()), "max": float(values.max())}
        return extra

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "fisher": self.fisher, "anchor": self.anchor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.fisher, self.anchor = state["fisher"], state["anchor"]
