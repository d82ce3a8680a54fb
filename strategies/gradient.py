"""Gradient-trained strategies: FedAvg on task 1, then one method-specific phase per later task.

``finetune`` is the lower bound: later tasks are learned by plain FedAvg fine-tuning of the
whole model on the new classes only, so forgetting shows. ``lwf`` and ``ewc`` differ only in the
client loss (the phase name routes to it); the server side is the same weighted average.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from flwr.app import RecordDict

from fcl_flower.averaging import average_states
from fcl_flower.models import load_trainable_state, trainable_state
from fcl_flower.runtime import predict_logits
from fcl_flower.wire import UploadError, from_record, read_tensor
from strategies.base import Reply, RoundPlan, StagedStrategy


class FedAvgStrategy(StagedStrategy):
    """Local SGD + sample-weighted FedAvg of the trainable state, task after task."""

    name: ClassVar[str] = "finetune"
    later_phase: ClassVar[str] = "fedavg"  # client handler used after task 1

    def plan_stage(self, task: int) -> list[RoundPlan]:
        if task == 0:
            return self.train_plans(task, "fedavg", self.cfg.stage1_rounds)
        return self.train_plans(task, self.later_phase, self.cfg.rounds_per_task)

    def parse_reply(self, plan: RoundPlan, content: RecordDict) -> dict:
        if "arrays" not in content.array_records:
            raise UploadError("reply has no 'arrays' record")
        expected = trainable_state(self.model)
        received = from_record(content.array_records["arrays"])
        if set(received) != set(expected):
            raise UploadError("model state keys differ from the global model's")
        record = content.array_records["arrays"]
        return {
            key: read_tensor(record, key, shape=tuple(value.shape))
            for key, value in expected.items()
        }

    def aggregate_round(self, plan: RoundPlan, replies: list[Reply]) -> None:
        weights = [r.num_examples if self.cfg.weighted_fedavg else 1.0 for r in replies]
        if sum(weights) == 0:
            weights = [1.0] * len(replies)
        load_trainable_state(self.model, average_states([r.payload for r in replies], weights))

    def predict_seen(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        preds, labels = predict_logits(self.model, self.split.seen_test(task), self.cfg,
                                       self.device, self.num_seen(task))
        return preds.numpy(), labels.numpy()

    def end_stage(self, task: int) -> dict[str, Any]:
        if task == 0 and self.cfg.stage1_rounds == 0:
            return {"note": "stage1-rounds = 0: the seeded backbone was not trained"}
        return {}


class FinetuneStrategy(FedAvgStrategy):
    name = "finetune"
