"""STSA: sum exact client statistics over clients and stages, solve the joint ridge in closed form.

Server state is G_{1:t} (M × M) and C_{1:t} (M × all classes) in float64 plus a sample count
(:class:`~fcl_flower.analytic.ridge.RidgeState`): nothing per client, nothing that grows with the
number of clients. After each stage the ridge classifier W_t = (G_{1:t} + γI)⁻¹ C_{1:t} is
re-solved for every seen class (docs/methods/stsa.md §2.5–2.7), which equals centralised ridge
on all data seen so far.

Components: :class:`~strategies.backfill.Backfill` (statistics of a missed stage arrive later and
simply add), :class:`~strategies.secure.SecureRounds` with ``secure-aggregation`` (uploads are
pairwise-masked ring elements: the server reads only their sum over the round's participants,
which is all Eq. 2 needs). With ``min-class-count`` the clients leave out classes they hold too
few samples of (fcl_flower/privacy/disclosure.py) and say how many samples they withheld.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from fcl_flower.analytic import packed_length, unpack_upper
from fcl_flower.analytic.ridge import RidgeState
from fcl_flower.config import RunConfig
from fcl_flower.data import FederatedSplit
from fcl_flower.privacy.secagg import unmask_sum
from fcl_flower.protocol import Instruction, StatsIns, StatsRes
from fcl_flower.protocol.payloads import MaskedStsaStats, StsaStats
from fcl_flower.results import ResultsRecorder
from strategies.analytic import AnalyticStrategy, solve_dense
from strategies.backfill import Backfill
from strategies.base import Accepted, RoundPlan
from strategies.secure import SecureRounds

Stats = StsaStats | MaskedStsaStats


class STSAStrategy(AnalyticStrategy):
    stats_phase = "stsa-stats"

    def __init__(self, cfg: RunConfig, split: FederatedSplit, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        self.ridge = RidgeState.empty(self.rf_dim, split.bundle.num_classes)
        self.backfill: Backfill[Stats] = Backfill(cfg.num_clients)
        self.secure = SecureRounds(cfg) if cfg.secure_aggregation else None

    # ---------------------------------------------------------------- rounds
    def customise(self, plan: RoundPlan, ins: Instruction) -> Instruction:
        if isinstance(ins, StatsIns):
            return dataclasses.replace(ins, backfill=self.backfill.request())
        return ins

    def run_round(self, grid: Grid, plan: RoundPlan, timeout: float) -> list[Message]:
        if self.secure is not None and plan.phase == self.stats_phase:
            return self.secure.run(self, grid, plan, timeout)
        return super().run_round(grid, plan, timeout)

    def masked(self) -> bool:
        """Whether the replies being read are masked (a secure statistics attempt is under way)."""
        return self.secure is not None and self.secure.current is not None

    # ---------------------------------------------------------------- replies
    def read_payload(self, task: int, record: ArrayRecord) -> Stats:
        shapes = {"packed": packed_length(self.rf_dim), "dim": self.rf_dim, "classes": len(self.split.tasks[task])}
        return MaskedStsaStats.read(record, **shapes) if self.masked() else StsaStats.read(record, **shapes)

    def read_stats(self, plan: RoundPlan, client: str, reply: StatsRes) -> Any:
        return {
            "stats": self.read_payload(plan.task, reply.arrays),
            "late": self.backfill.read(client, reply, self.read_payload, secure=self.masked()),
        }

    def aggregate_stats(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        if self.masked():  # a masked sum opens only with every participant's upload
            assert self.secure is not None and self.secure.current is not None
            if len(replies) != len(self.secure.current.participants):
                raise RuntimeError(
                    f"secure round: {len(replies)} accepted uploads for "
                    f"{len(self.secure.current.participants)} participants"
                )
        on_time = [Accepted(r.client, r.num_examples, r.payload["stats"]) for r in replies]
        self.add_statistics(plan.task, on_time)
        self.backfill.fold(replies, lambda r: r.payload["late"], self.add_statistics, lambda task: None)
        self.backfill.note_missing(plan.task, {r.client for r in replies})

    def add_statistics(self, task: int, replies: list[Accepted[Stats]]) -> None:
        """Spatial aggregation (Eq. 2) over ``replies``, then temporal (Eq. 4): late ones simply add."""
        gram = unpack_upper(self.sum_over_clients(r.payload.gram_packed for r in replies), self.rf_dim)
        sums = self.sum_over_clients(r.payload.class_sums for r in replies)
        self.ridge.add(self.split.tasks[task], gram, sums, sum(r.num_examples for r in replies))

    def sum_over_clients(self, arrays: Iterable[Any]) -> torch.Tensor:
        """Σ_k of one statistic in float64: plain, or by opening the masked sum."""
        if self.masked():
            return torch.from_numpy(unmask_sum(arrays, self.cfg.secagg_fraction_bits))
        items = list(arrays)
        total = torch.zeros_like(items[0], dtype=torch.float64)
        for item in items:
            total += item  # summed in float64
        return total

    # ---------------------------------------------------------------- solve
    def solve(self, task: int) -> tuple[torch.Tensor, dict[str, Any]]:
        weights, extra = solve_dense(self.ridge, self.num_seen(task), self.cfg)
        if self.cfg.secure_aggregation:
            extra["secure_aggregation"] = True
        return weights, {**extra, **self.backfill.extras()}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "ridge": self.ridge.state_dict(),
            "missing": self.backfill.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ridge = RidgeState.from_state(state["ridge"])
        self.backfill.load_state_dict(state.get("missing", {}))
