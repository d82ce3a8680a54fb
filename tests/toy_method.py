"""A toy method added the way ARCHITECTURE.md says: one registry entry (in the test), one strategy,
one client handler, its math. Nearest class mean on the random features: clients upload class sums
and counts of the task (the STSA-E payload with one dummy client), the server keeps their sums and
classifies by cosine to the class means."""

from __future__ import annotations

from typing import Any

import torch

from clients.job import ClientJob
from clients.statistics import local_task_features
from fcl_flower.analytic import StatisticsAccumulator
from fcl_flower.config import RunConfig
from fcl_flower.data import FederatedSplit
from fcl_flower.protocol import StatsRes
from fcl_flower.protocol.payloads import StsaEStats
from fcl_flower.results import ResultsRecorder
from strategies.analytic import AnalyticStrategy
from strategies.base import Accepted, RoundPlan


def class_means(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The math: column c of the classifier is the mean random feature of class c."""
    return sums / counts.clamp_min(1.0)


class ToyStrategy(AnalyticStrategy):
    stats_phase = "toy-stats"

    def __init__(self, cfg: RunConfig, split: FederatedSplit, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        self.sums = torch.zeros(self.rf_dim, split.bundle.num_classes, dtype=torch.float64)
        self.counts = torch.zeros(split.bundle.num_classes, dtype=torch.float64)

    def read_stats(self, plan: RoundPlan, client: str, reply: StatsRes) -> StsaEStats:
        return StsaEStats.read(reply.arrays, dummies=1, dim=self.rf_dim, classes=len(self.split.tasks[plan.task]))

    def aggregate_stats(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        classes = self.split.tasks[plan.task]
        for r in replies:
            self.sums[:, classes.start : classes.stop] += r.payload.class_sums[0]
            self.counts[classes.start : classes.stop] += r.payload.counts[0]

    def solve(self, task: int) -> tuple[torch.Tensor, dict[str, Any]]:
        seen = self.num_seen(task)
        return class_means(self.sums[:, :seen], self.counts[:seen]), {"num_samples": int(self.counts.sum())}


def handle_toy(job: ClientJob) -> StatsRes:
    phi, labels = local_task_features(job)
    accumulator = StatisticsAccumulator(phi.shape[1], len(job.task_classes), with_gram=False)
    if len(labels):
        accumulator.update(phi, labels)
    stats = accumulator.result()
    payload = StsaEStats(stats.class_sums.unsqueeze(0), stats.counts.to(torch.float64).unsqueeze(0))
    return job.stats_reply(stats.num_samples, arrays=payload.to_record(job.cfg.wire_dtype))
