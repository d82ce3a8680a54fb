"""The small base of the gradient-trained methods: local SGD every task, FedAvg-style aggregation.

Task 1 runs ``stage1-rounds`` rounds of ``first_phase``, every later task ``rounds-per-task``
rounds of ``later_phase`` (per-round cosine learning rate, ``local-epochs`` local epochs). The
global model is evaluated by its own logits over the seen classes. Siblings: finetune, lwf, ewc,
joint-gradient, lga, stamp.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from fcl_flower.config import RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.protocol import Reply
from fcl_flower.results import ResultsRecorder
from fcl_flower.runtime import predict_logits
from strategies.base import Accepted, RoundPlan, StagedStrategy
from strategies.fedavg import Aggregation, FedAvg


class GradientStrategy(StagedStrategy):
    first_phase: ClassVar[str] = "fedavg"
    later_phase: ClassVar[str] = "fedavg"

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        self.fedavg = FedAvg(self.model, cfg.weighted_fedavg, Aggregation.from_config(cfg))

    def stage_rounds(self, task: int) -> int:
        return self.cfg.stage1_rounds if task == 0 else self.cfg.rounds_per_task

    def plan_stage(self, task: int) -> list[RoundPlan]:
        phase = self.first_phase if task == 0 else self.later_phase
        return self.train_plans(task, phase, self.stage_rounds(task))

    def read_reply(self, plan: RoundPlan, reply: Reply) -> Any:
        return self.fedavg.read(reply)

    def aggregate_round(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        self.fedavg.aggregate([r.payload for r in replies], [r.num_examples for r in replies])

    def predict_seen(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        preds, labels = predict_logits(
            self.model, self.split.seen_test(task), self.cfg, self.device, self.num_seen(task)
        )
        return preds.numpy(), labels.numpy()

    def end_stage(self, task: int) -> dict[str, Any]:
        if task == 0 and self.cfg.stage1_rounds == 0:
            return {"note": "stage1-rounds = 0: the seeded backbone was not trained"}
        return {}
