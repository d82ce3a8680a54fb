"""STSA, STSA-E and the joint upper bound: FedAvg on task 1, then one statistics round per stage.

Server state is G_{1:t} (M × M) and C_{1:t} (M × all classes) in float64 plus a sample count:
nothing per client, nothing that grows with the number of clients. After each stage the ridge
classifier W_t = (G_{1:t} + γI)⁻¹ C_{1:t} is re-solved for every seen class (spec §2.5–2.7).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import RecordDict

from fcl_flower.analytic import (
    StatisticsAccumulator,
    estimate_gram,
    packed_length,
    predict,
    random_features,
    random_projection,
    select_ridge_gcv,
    solve_ridge,
    unpack_upper,
)
from fcl_flower.runtime import iter_features
from fcl_flower.wire import UploadError, read_tensor
from strategies.base import Reply, RoundPlan
from strategies.gradient import FedAvgStrategy


class AnalyticStrategy(FedAvgStrategy):
    """STSA: sum exact client statistics, solve the joint ridge in closed form."""

    name: ClassVar[str] = "stsa"
    stats_phase: ClassVar[str] = "stsa-stats"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        feature_dim = self.model.backbone.feature_dim
        self.projection = random_projection(feature_dim, self.cfg.rf_dim, seed=self.cfg.seed)
        self.rf_dim = feature_dim if self.projection is None else self.projection.shape[1]
        total_classes = self.split.bundle.num_classes
        self.gram = torch.zeros(self.rf_dim, self.rf_dim, dtype=torch.float64)
        self.class_sums = torch.zeros(self.rf_dim, total_classes, dtype=torch.float64)
        self.num_samples = 0
        self.weights: torch.Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "gram": self.gram, "class_sums": self.class_sums,
                "num_samples": self.num_samples, "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.gram, self.class_sums = state["gram"], state["class_sums"]
        self.num_samples, self.weights = state["num_samples"], state["weights"]
        self.model.eval()

    # ---------------------------------------------------------------- schedule
    def plan_stage(self, task: int) -> list[RoundPlan]:
        stage1 = self.train_plans(task, "fedavg", self.cfg.stage1_rounds) if task == 0 else []
        return stage1 + [RoundPlan(task, self.stats_phase)]

    # ---------------------------------------------------------------- replies
    def parse_reply(self, plan: RoundPlan, content: RecordDict) -> Any:
        if plan.phase == "fedavg":
            return super().parse_reply(plan, content)
        if "arrays" not in content.array_records:
            raise UploadError("reply has no 'arrays' record")
        return self.parse_stats(plan, content.array_records["arrays"])

    def parse_stats(self, plan: RoundPlan, record: Any) -> dict[str, torch.Tensor]:
        classes = len(self.split.tasks[plan.task])
        return {
            "gram": unpack_upper(
                read_tensor(record, "gram-packed", shape=(packed_length(self.rf_dim),), floating=True)
                .to(torch.float64), self.rf_dim),
            "class-sums": read_tensor(record, "class-sums", shape=(self.rf_dim, classes), floating=True)
            .to(torch.float64),
        }

    def aggregate_round(self, plan: RoundPlan, replies: list[Reply]) -> None:
        if plan.phase == "fedavg":
            super().aggregate_round(plan, replies)
            return
        self.add_stage_statistics(plan.task, *self.stage_statistics(plan, replies))

    def stage_statistics(self, plan: RoundPlan, replies: list[Reply]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Spatial aggregation (Eq. 2): sums over the clients of this stage."""
        gram = sum((r.payload["gram"] for r in replies), torch.zeros_like(self.gram))
        sums = sum(r.payload["class-sums"] for r in replies)
        return gram, sums, sum(r.num_examples for r in replies)

    def add_stage_statistics(self, task: int, gram: torch.Tensor, class_sums: torch.Tensor, n: int) -> None:
        """Temporal aggregation (Eq. 4): G grows by G_t, the task's class columns receive C_t."""
        classes = self.split.tasks[task]
        self.gram += gram
        self.class_sums[:, classes.start:classes.stop] += class_sums
        self.num_samples += n

    # ---------------------------------------------------------------- solve + evaluate
    def end_stage(self, task: int) -> dict[str, Any]:
        self.model.eval()  # frozen from here on: no later round trains it (keys stay the same
        # on both sides, so the broadcast state still matches the clients' models)
        seen = self.num_seen(task)
        sums = self.class_sums[:, :seen]
        extra: dict[str, Any] = {"num_samples": self.num_samples}
        gamma = self.cfg.ridge_value()
        if gamma is None:
            gamma, table = select_ridge_gcv(self.gram, sums, self.num_samples, float(self.num_samples))
            extra["gcv"] = {"grid_min": table[0].gamma, "grid_max": table[-1].gamma}
        extra["ridge"] = gamma
        self.weights = solve_ridge(self.gram, sums, gamma)
        return extra

    def test_features(self, task: int) -> tuple[torch.Tensor, torch.Tensor]:
        phis, labels = [], []
        for features, y in iter_features(self.model, self.split.seen_test(task), self.cfg, self.device):
            phis.append(random_features(features, self.projection))
            labels.append(y)
        return torch.cat(phis), torch.cat(labels)

    def predict_seen(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        assert self.weights is not None, "end_stage solves before evaluation"
        phi, labels = self.test_features(task)
        return predict(phi, self.weights, self.cfg.head).numpy(), labels.numpy()


class STSAEStrategy(AnalyticStrategy):
    """STSA-E: clients upload class sums and counts only; the server estimates G (Eq. 9)."""

    name = "stsa-e"
    stats_phase = "stsa-e-stats"

    def parse_stats(self, plan: RoundPlan, record: Any) -> dict[str, torch.Tensor]:
        classes = len(self.split.tasks[plan.task])
        dummies = self.cfg.dummy_clients
        counts = read_tensor(record, "counts", shape=(dummies, classes), nonnegative=True).to(torch.float64)
        if not torch.equal(counts, counts.round()):
            raise UploadError("array 'counts' has non-integer entries")
        return {
            "class-sums": read_tensor(record, "class-sums", shape=(dummies, self.rf_dim, classes),
                                      floating=True).to(torch.float64),
            "counts": counts,
        }

    def validate_reply(self, plan: RoundPlan, reply: Reply) -> None:
        if plan.phase != "fedavg" and int(reply.payload["counts"].sum()) != reply.num_examples:
            raise UploadError("counts do not add up to num-examples")

    def stage_statistics(self, plan: RoundPlan, replies: list[Reply]) -> tuple[torch.Tensor, torch.Tensor, int]:
        sums = torch.cat([r.payload["class-sums"] for r in replies])  # (K·K_D, M, c_t)
        counts = torch.cat([r.payload["counts"] for r in replies])  # (K·K_D, c_t)
        gram = estimate_gram(sums, counts, k_mode=self.cfg.k_mode)
        return gram, sums.sum(dim=0), int(counts.sum())


class JointStrategy(AnalyticStrategy):
    """Upper bound: the same backbone and features, but ridge on all seen data pooled centrally."""

    name = "joint"

    def plan_stage(self, task: int) -> list[RoundPlan]:
        return self.train_plans(task, "fedavg", self.cfg.stage1_rounds) if task == 0 else []

    def end_stage(self, task: int) -> dict[str, Any]:
        self.model.eval()
        classes = self.split.tasks[task]
        accumulator = StatisticsAccumulator(self.rf_dim, len(classes), with_gram=True)
        pooled = self.split.task_train(task, eval_transform=True)
        for features, y in iter_features(self.model, pooled, self.cfg, self.device):
            accumulator.update(random_features(features, self.projection), y - classes.start)
        stats = accumulator.result()
        self.add_stage_statistics(task, stats.gram, stats.class_sums, stats.num_samples)
        return {**super().end_stage(task), "pooled": True}
