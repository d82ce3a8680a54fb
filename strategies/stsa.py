"""STSA: sum exact client statistics over clients and stages, solve the joint ridge in closed form.

Server state is G_{1:t} (M × M) and C_{1:t} (M × all classes) in float64 plus a sample count
(:class:`~fcl_flower.analytic.ridge.RidgeState`): nothing per client, nothing that grows with the
number of clients. After each stage the ridge classifier W_t = (G_{1:t} + γI)⁻¹ C_{1:t} is
re-solved for every seen class (docs/methods/stsa.md §2.5–2.7), which equals centralised ridge
on all data seen so far.

Untrusted uploads. Every upload (G, C, class counts) is checked before it is added
(fcl_flower/analytic/checks.py: the statistics of *some* dataset, magnitudes that cannot overflow,
the feature norm bound); a failing upload is rejected alone, with its reason.

Components: :class:`~strategies.backfill.Backfill` (statistics of a missed stage arrive later and
simply add) and, with ``secure-aggregation``, :class:`~strategies.secure.SecureRounds`: uploads are
masked ring elements and the server opens only their sum over the round's survivors, which gets
the same checks; a late client's statistics then ride inside its next regular masked upload
(added to G, and to the columns of the owed task's classes) in a round where at least
``secagg-min-clients`` participants owe that task, so no opened sum is one client's. With
``min-class-count`` the clients leave out classes they hold too few samples of.

Noise (strategies/analytic.py): the checks allow for one client's noise on a plain upload, and
for the noise of the opened sum (|U3| shares) on a secure one; with noisy counts the number of
samples is the rounded sum of the noisy counts; the solve projects G onto the PSD cone. An
opened sum is one release of every survivor's data (k tasks of it when it carries k − 1 owed
ones), with noise std √|U3| times a client's share.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from fcl_flower.analytic import packed_length, unpack_upper
from fcl_flower.analytic.checks import StatisticsRejected, check_counts, check_gram_statistics, wire_epsilon
from fcl_flower.analytic.ridge import RidgeState
from fcl_flower.config import RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.privacy.noise import secure_share
from fcl_flower.privacy.secagg import unmask_sum
from fcl_flower.protocol import Instruction, StatsIns, StatsRes, UploadError
from fcl_flower.protocol.payloads import MaskedStsaStats, StsaStats
from fcl_flower.results import ResultsRecorder
from strategies.accounting import client_name
from strategies.analytic import AnalyticStrategy, noisy_total, solve_dense, upload_checks
from strategies.backfill import Backfill
from strategies.base import Accepted, RoundPlan, StageFailed
from strategies.secure import SecureRounds

MASKED_NAMES = ("gram-packed", "class-sums", "counts")


class STSAStrategy(AnalyticStrategy):
    stats_phase = "stsa-stats"

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        self.ridge = RidgeState.empty(self.rf_dim, split.num_classes)
        self.backfill: Backfill[StsaStats] = Backfill(cfg.num_clients)
        self.secure = SecureRounds(cfg) if cfg.secure_aggregation else None
        self._request: dict[int, tuple[int, ...]] = {}  # the backfill request of the round in progress

    # ---------------------------------------------------------------- rounds
    def customise(self, plan: RoundPlan, ins: Instruction) -> Instruction:
        if isinstance(ins, StatsIns):
            self._request = self.backfill.request()
            return dataclasses.replace(ins, backfill=self._request)
        return ins

    def run_round(self, grid: Grid, plan: RoundPlan, timeout: float) -> list[Message]:
        if self.secure is not None and plan.phase == self.stats_phase:
            return self.secure.run(self, grid, plan, timeout)
        return super().run_round(grid, plan, timeout)

    def masked(self) -> bool:
        """Whether the replies being read are masked (a secure statistics round is under way)."""
        return self.secure is not None and self.secure.current is not None

    def secure_columns(self, task: int) -> list[int]:
        """The tasks whose classes a masked upload carries: this one, then the included owed ones."""
        assert self.secure is not None and self.secure.current is not None
        return [task, *self.secure.current.backfill_tasks(self._request, self.cfg.secagg_min_clients)]

    # ---------------------------------------------------------------- replies
    def check(self, stats: StsaStats, num_examples: int) -> None:
        """The upload is the statistics of some dataset of ``num_examples`` samples (see module doc)."""
        noise = self.noise_levels()
        with upload_checks():
            check_counts(stats.counts, num_examples, noise=noise.counts if noise else 0.0)
            check_gram_statistics(
                unpack_upper(stats.gram_packed.to(torch.float64), self.rf_dim),
                stats.class_sums,
                stats.counts,
                relative_tolerance=wire_epsilon(stats.gram_packed.dtype),
                noise=noise,
                **self.feature_bounds,
            )

    def read_plain(self, task: int, record: ArrayRecord) -> StsaStats:
        shapes = {"packed": packed_length(self.rf_dim), "dim": self.rf_dim, "classes": len(self.split.tasks[task])}
        return StsaStats.read(record, **shapes, noisy_counts=self.counts_noised)

    def read_stats(self, plan: RoundPlan, client: str, reply: StatsRes) -> Any:
        if self.masked():
            classes = sum(len(self.split.tasks[t]) for t in self.secure_columns(plan.task))
            stats = MaskedStsaStats.read(
                reply.arrays, packed=packed_length(self.rf_dim), dim=self.rf_dim, classes=classes
            )
            if reply.backfill:
                raise UploadError("a masked upload carries its late statistics inside, not as records")
            return {"masked": stats}
        plain = self.read_plain(plan.task, reply.arrays)
        self.check(plain, reply.num_examples)
        late = self.backfill.read(client, reply, self.read_plain)
        for task, (payload, count) in late.items():
            try:
                self.check(payload, count)
            except UploadError as err:
                raise UploadError(f"record 'backfill-{task}': {err}") from None
        return {"stats": plain, "late": late}

    def aggregate_stats(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        if self.masked():
            self.aggregate_masked(plan, replies)
            return
        self.add_statistics(plan.task, [Accepted(r.client, r.num_examples, r.payload["stats"]) for r in replies])
        self.backfill.fold(replies, lambda r: r.payload["late"], self.add_statistics, lambda task: None)
        self.backfill.note_missing(plan.task, {r.client for r in replies})

    def add_statistics(self, task: int, replies: list[Accepted[StsaStats]]) -> None:
        """Spatial aggregation (Eq. 2) over ``replies``, then temporal (Eq. 4): late ones simply add."""
        gram = torch.zeros(packed_length(self.rf_dim), dtype=torch.float64)
        sums = torch.zeros(self.rf_dim, len(self.split.tasks[task]), dtype=torch.float64)
        for r in replies:  # summed in float64
            gram += r.payload.gram_packed
            sums += r.payload.class_sums
        if self.counts_noised:
            samples = noisy_total(r.payload.counts for r in replies)
        else:
            samples = sum(r.num_examples for r in replies)
        self.ridge.add(self.split.tasks[task], unpack_upper(gram, self.rf_dim), sums, samples)
        self.note_sums_noise(self.split.tasks[task], len(replies))

    def aggregate_masked(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        """Open Σ over the survivors, check it like one upload, add it column block by column block."""
        assert self.secure is not None and self.secure.opening is not None
        opening = self.secure.opening
        survivors = {r.client for r in replies}
        opened = {}
        for name in MASKED_NAMES:
            uploads = [getattr(r.payload["masked"], name.replace("-", "_")) for r in replies]
            opened[name] = torch.from_numpy(
                unmask_sum(
                    uploads,
                    name,
                    opening.seeds,
                    opening.dropped_keys,
                    opening.s_publics,
                    opening.context,
                    self.cfg.secagg_fraction_bits,
                )
            )
        # Integer counts are exact in fixed point, so their opened sum is exactly integral: a
        # garbage upload is caught here (and a rounding would let random counts through). Noised
        # counts are not integral; the withheld count, never noised, still is.
        noisy = self.counts_noised
        counts, withheld = opened["counts"][:-1], float(opened["counts"][-1])
        gram = unpack_upper(opened["gram-packed"], self.rf_dim)
        sums = opened["class-sums"].reshape(self.rf_dim, -1)
        column, tasks = 0, self.secure_columns(plan.task)
        share = secure_share(self.cfg, self.secure.current.threshold) if self.secure.current is not None else 1.0
        factor = share * len(replies) ** 0.5  # the opened sum's noise: |U3| shares
        for r in replies:  # one release of each survivor's data: the current task and the late ones it owed
            owed = [t for t in tasks[1:] if t in self.backfill.missing.get(r.client, [])]
            self.record_release([r.client], plan.task, factor / (1 + len(owed)))
        noise = self.noise_levels(factor)
        try:
            if noisy:
                check_counts(counts, 0, noise=noise.counts if noise else 0.0)
                check_counts(opened["counts"][-1:], int(withheld))
            else:
                check_counts(opened["counts"], int(opened["counts"].sum()))
            check_gram_statistics(
                gram,
                sums,
                counts,
                relative_tolerance=wire_epsilon(torch.float64),
                absolute_tolerance=len(replies) * 2.0 ** -(self.cfg.secagg_fraction_bits + 1),
                noise=noise,
                **self.feature_bounds,
            )
        except StatisticsRejected as err:
            raise StageFailed(f"the opened secure sum fails its checks: {err}") from None
        for position, task in enumerate(tasks):
            width = len(self.split.tasks[task])
            block = slice(column, column + width)
            samples = noisy_total([counts[block]]) if noisy else int(counts[block].sum())
            self.ridge.add(self.split.tasks[task], gram if position == 0 else None, sums[:, block], samples)
            self.note_sums_noise(self.split.tasks[task], factor * factor)
            column += width
        if withheld:
            self._withheld["all clients (masked sum)"] = self._withheld.get("all clients (masked sum)", 0) + int(
                withheld
            )
        for task in tasks[1:]:  # the owing survivors' late statistics are in
            for client, owed in list(self.backfill.missing.items()):
                if task in owed and client in survivors:
                    self.backfill.strike(client, task)
        self.backfill.note_missing(plan.task, survivors)

    # ---------------------------------------------------------------- solve
    def solve(self, task: int) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.noise is not None:
            weights, extra = self.solve_noisy(self.ridge, task)
        else:
            weights, extra = solve_dense(self.ridge, self.num_seen(task), self.cfg)
        if self.cfg.secure_aggregation:
            extra["secure_aggregation"] = True
        return weights, {**extra, **self.backfill.extras()}

    def stage_failed(self, task: int, reason: str) -> dict[str, Any]:
        """Nobody's statistics of the stage are in: every client owes them (backfill, later)."""
        extra = super().stage_failed(task, reason)
        for client in range(self.cfg.num_clients):
            owed = self.backfill.missing.setdefault(client_name(client), [])
            if task not in owed:
                owed.append(task)
        return {**extra, **self.backfill.extras()}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ridge": self.ridge.state_dict(), "missing": self.backfill.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ridge = RidgeState.from_state(state["ridge"])
        self.backfill.load_state_dict(state.get("missing", {}))
