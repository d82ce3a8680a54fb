"""``joint``, the analytic upper bound: the same backbone and random features as STSA, but the
ridge is solved on all seen data pooled on the server (no statistics round after stage 1)."""

from __future__ import annotations

from typing import Any

import torch

from fcl_flower.analytic import StatisticsAccumulator, random_features
from fcl_flower.analytic.ridge import RidgeState, product_rounding_bound
from fcl_flower.config import RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.protocol import StatsRes, UploadError
from fcl_flower.results import ResultsRecorder
from fcl_flower.runtime import iter_features
from strategies.analytic import AnalyticStrategy, solve_dense
from strategies.base import Accepted, RoundPlan


class JointStrategy(AnalyticStrategy):
    stats_phase = None

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        self.ridge = RidgeState.empty(self.rf_dim, split.num_classes)

    def read_stats(self, plan: RoundPlan, client: str, reply: StatsRes) -> Any:
        raise UploadError("joint has no statistics round")

    def aggregate_stats(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        raise RuntimeError("joint has no statistics round")

    def solve(self, task: int) -> tuple[torch.Tensor, dict[str, Any]]:
        classes = self.split.tasks[task]
        accumulator = StatisticsAccumulator(self.rf_dim, len(classes), with_gram=True)
        pooled = self.split.task_train(task, eval_transform=True)
        for features, y in iter_features(self.model, pooled, self.cfg, self.device):
            accumulator.update(random_features(features, self.projection, self.cfg.feature_clip), y - classes.start)
        stats = accumulator.result()
        assert stats.gram is not None
        # the server's own float64 product: PSD up to its rounding
        bound = product_rounding_bound(stats.num_samples, float(stats.gram.diagonal().sum()))
        self.ridge.add(classes, stats.gram, stats.class_sums, stats.num_samples, bound)
        weights, extra = solve_dense(self.ridge, self.num_seen(task), self.cfg)
        return weights, {**extra, "pooled": True}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "ridge": self.ridge.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ridge = self.restore_ridge(state)

    def check_restored(self, completed: int) -> None:
        super().check_restored(completed)
        self.check_restored_ridge(self.ridge, completed, sum_of_checked_uploads=False)
