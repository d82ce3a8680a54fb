"""STSA: sum exact client statistics over clients and stages, solve the joint ridge in closed form.

Server state is G_{1:t} (M × M) and C_{1:t} (M × all classes) in float64 plus a sample count
(:class:`~fcl_flower.analytic.ridge.RidgeState`): nothing per client, nothing that grows with the
number of clients. After each stage the ridge classifier W_t = (G_{1:t} + γI)⁻¹ C_{1:t} is
re-solved for every seen class (docs/methods/stsa.md §2.5–2.7), which equals centralised ridge
on all data seen so far.

Untrusted uploads. Every upload (G, C, class counts) is checked before it is added
(fcl_flower/analytic/checks.py: the statistics of *some* dataset, magnitudes that cannot overflow,
the feature norm bound); a failing upload is rejected alone, with its reason. A factor upload
(``stats-form factor``: F = O[Φ Y], FᵀF = J) is PSD by construction: it is checked without a
factorisation and without making its G (:func:`~fcl_flower.analytic.checks.screen_factor_statistics`
reads G's signs only); its C is added, its rows are stacked, and G gets one product of a round's
stacked rows (:class:`TaskSum`). While every upload of the run is a factor and their rows number at
most M/2, the server also keeps those rows in memory (never in a checkpoint) and solves with a
fixed γ through the N × N kernel (:mod:`fcl_flower.analytic.kernel`: the same W, N³ instead of M³).

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
import math
import time
from collections.abc import Iterable, Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from fcl_flower import restore as fields
from fcl_flower.analytic import packed_length
from fcl_flower.analytic.bisect import find_culprit
from fcl_flower.analytic.checks import (
    NOT_PSD,
    StatisticsRejected,
    check_counts,
    check_packed_statistics,
    gram_check_epsilon,
    negative_bound,
    screen_factor_statistics,
    screen_packed_statistics,
    wire_epsilon,
)
from fcl_flower.analytic.kernel import FactorStack
from fcl_flower.analytic.packing import diagonal_of_packed, gram_packed_
from fcl_flower.analytic.ridge import RidgeState, product_rounding_bound, sum_rounding_bound
from fcl_flower.analytic.unlearning import replace_upload
from fcl_flower.config import RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.privacy.noise import secure_share
from fcl_flower.privacy.secagg import add_ring, unmask_sum
from fcl_flower.privacy.secure_fedavg import OpenedSumRejected
from fcl_flower.protocol import Header, Instruction, Reply, StatsIns, StatsRes, UploadError
from fcl_flower.protocol.payloads import ForgetStats, MaskedStsaStats, StsaFactorStats, StsaStats
from fcl_flower.restore import RestoreError
from fcl_flower.results import ResultsRecorder
from fcl_flower.state_io import StateError, load_state, save_state
from fcl_flower.tensors import WIRE_DTYPES
from strategies.accounting import client_name, client_order
from strategies.analytic import (
    FEDAVG_PHASE,
    noisy_total,
    ridge_extras,
    rounded_count,
    solve_dense,
    upload_checks,
)
from strategies.backfill import Backfill
from strategies.base import Accepted, RoundFailed, RoundFold, RoundPlan, StageFailed
from strategies.forgetting import ForgetRounds, SiteForgetFold, site_of
from strategies.loop import RunFailed
from strategies.secure import MAX_ATTEMPTS, RestartSecureRound, SecureRounds, following_secure_round
from strategies.secure_fedavg import MaskedFedAvg
from strategies.secure_unlearning import SecureForgetFold, read_masked_removal
from strategies.spool import UploadSpool
from strategies.stream import InOrder
from strategies.unlearning import ForgetRefused, as_upload, verified_removal

MASKED_NAMES = ("gram-packed", "class-sums", "counts")
FORGET_PHASE = "stsa-forget"  # the forget round between stages (docs/unlearning.md)


def fresh_certificate() -> dict[str, Any]:
    """The stage's record of its sums' certificates (``extra.sum_certificate``)."""
    return {"factorisations": 0, "seconds": 0.0, "culprits": []}


def factor_of(stats: StsaStats | StsaFactorStats) -> torch.Tensor | None:
    """The factor an upload carries (None for a Gram upload)."""
    return stats.factor if isinstance(stats, StsaFactorStats) else None


@dataclasses.dataclass(frozen=True)
class Upload:
    """One accepted upload in a round's running sum, kept (in the round's spool) until the sum is
    certified: ``bound`` None where only the O(M²) screen ran (the stage's certificate decides)."""

    client: str
    num_examples: int
    handle: int
    factor: torch.Tensor | None
    bound: float | None


NO_GRAM = torch.empty(0, dtype=torch.float64)  # the G of a checked factor upload: never made alone (TaskSum)


class TaskSum:
    """Running Σ_k of one task's uploads: packed G, class sums and counts in float64, n, and (for
    noisy counts) the running sum of the counts and the number of uploads whose noise went in; with
    factor uploads also the factors themselves (for the kernel solve), up to ``max_rows`` rows
    (None once one upload came without a factor or the cap is passed). With a ``spool`` every
    upload is kept until :meth:`STSAStrategy.certify_round` has certified the sum (a factor upload
    as its class sums and counts: its factor is kept anyway).

    A factor upload's G is never made on its own (issue 30): its feature rows F_Φ are stacked as
    they come, and G gets the sum of the stacked rows' products by one product
    (``packing.gram_packed_``: one block of rows at a time) whenever G is read or M/2 rows wait,
    with its negative rounding clamped to 0 where the features are ReLU (``clamp``, as the factor
    check clamps one upload's, :func:`~fcl_flower.analytic.factor.factor_packed_gram`). The same
    uploads added in the same order, G read only once they are all in (as the server does), make
    the same numbers. What this adds to the sum's certified bound:
    the product's rounding and that of the clamp, each at most γ_N tr(Φ_stackᵀΦ_stack) for its
    N rows (:func:`~fcl_flower.analytic.ridge.product_rounding_bound`), and one float64 addition."""

    def __init__(
        self, dim: int, classes: int, max_rows: int = 0, spool: UploadSpool | None = None, clamp: bool = False
    ) -> None:
        self.dim = dim
        self._gram = torch.zeros(packed_length(dim), dtype=torch.float64)
        self.sums = torch.zeros(dim, classes, dtype=torch.float64)
        self.counts = torch.zeros(classes, dtype=torch.float64)
        self.count = 0
        self.noisy_count = 0.0  # Σ of the (noisy) counts, in the order noisy_total adds them
        self.uploads = 0
        self.negative_bound = 0.0  # Σ of the uploads' certified λ_min(G_k) >= -β_k (their checks)
        self.screened = 0  # uploads without a certificate of their own (the stage certificate decides)
        self.max_rows = max_rows
        self.factors: list[torch.Tensor] | None = [] if max_rows > 0 else None
        self.spool = spool
        self.clamp = clamp
        self.kept: list[Upload] = []
        self._stacked: list[torch.Tensor] = []  # factor rows F_Φ (float64) whose product G still lacks
        self._stacked_rows = 0
        self._stacked_trace = 0.0
        self.stacked_bound = 0.0  # what the products of stacked factor rows added to negative_bound

    @property
    def gram(self) -> torch.Tensor:
        """The packed float64 G of every upload added so far."""
        self._flush()
        return self._gram

    def add(
        self,
        client: str,
        stats: StsaStats,
        num_examples: int,
        factor: torch.Tensor | None = None,
        negative_bound: float | None = math.inf,
    ) -> None:
        """Add one checked upload: ``stats`` (for a factor upload, its G unused) and, for a factor
        upload, its ``factor``."""
        exact = None if factor is None else factor.to(torch.float64, copy=True)
        if exact is None:
            # summed in float64, with that addition's rounding (NumPy adds a float32 upload in one
            # pass, the same numbers as torch's mixed-dtype add at a third of its time)
            np.add(self._gram.numpy(), stats.gram_packed.numpy(), out=self._gram.numpy())
        else:
            rows = exact[:, : self.dim]
            self._stacked.append(rows)
            self._stacked_rows += int(rows.shape[0])
            self._stacked_trace += float((rows * rows).sum())
            if self._stacked_rows >= max(self.dim // 2, 1):
                self._flush()
        if negative_bound is None:
            self.screened += 1
        else:
            trace = float(diagonal_of_packed(self._gram, self.dim).sum()) + self._stacked_trace
            self.negative_bound += negative_bound + sum_rounding_bound(trace)
        self.sums += stats.class_sums
        self.counts += stats.counts
        self.count += num_examples
        self.noisy_count += float(stats.counts.to(torch.float64).sum())
        self.uploads += 1
        if self.factors is not None:
            rows_so_far = sum(int(f.shape[0]) for f in self.factors)
            if exact is None or rows_so_far + int(exact.shape[0]) > self.max_rows:
                self.factors = None  # this round's sums can no longer be stacked: G solves
            else:
                self.factors.append(exact)
        if self.spool is not None:
            kept = (
                (stats.class_sums, stats.counts)
                if exact is not None
                else (stats.gram_packed, stats.class_sums, stats.counts)
            )
            self.kept.append(Upload(client, num_examples, self.spool.put(kept), factor, negative_bound))

    def _flush(self) -> None:
        """G += the product of the stacked factor rows (see the class doc)."""
        if not self._stacked:
            return
        gram_packed_(self._gram.numpy(), torch.cat(self._stacked), accumulate=True, clamp=self.clamp)
        trace = float(diagonal_of_packed(self._gram, self.dim).sum())
        products = 2.0 * product_rounding_bound(self._stacked_rows, self._stacked_trace)
        self.stacked_bound += products
        self.negative_bound += products + sum_rounding_bound(trace)
        self._stacked, self._stacked_rows, self._stacked_trace = [], 0, 0.0

    def stats_of(self, upload: Upload) -> StsaStats:
        assert self.spool is not None
        kept = self.spool.get(upload.handle)
        if len(kept) == 2:  # a factor upload: its G comes from its factor when it is added again
            return StsaStats(NO_GRAM, *kept)
        gram, sums, counts = kept
        return StsaStats(gram, sums, counts)

    def rebuilt(self, uploads: list[Upload], fresh: TaskSum) -> TaskSum:
        """``fresh`` (empty) with ``uploads`` (kept by this sum) added again in their order: the
        same numbers as a round that only ever had them."""
        for upload in uploads:
            fresh.add(upload.client, self.stats_of(upload), upload.num_examples, upload.factor, upload.bound)
        return fresh

    def into(self, strategy: STSAStrategy, classes: range) -> None:
        """Add the sums to the ridge state; with noisy counts the number of samples is their rounded
        sum (:func:`~strategies.analytic.noisy_total`), and the sums' noise is noted for GCV."""
        assert not self.screened, "a sum of screened uploads goes into the ridge state only once certified"
        samples = rounded_count(self.noisy_count) if strategy.counts_noised else self.count
        gram = self.gram  # made whole first: its last product adds to the bound
        strategy.ridge.add_packed(classes, gram, self.sums, samples, self.negative_bound)
        strategy.note_sums_noise(classes, self.uploads)
        strategy.stack_factors(classes, self.factors)


class PlainFold:
    """A plain statistics round, streamed: every accepted upload (and the late statistics it
    carries) is added to the round's running sums at once (:meth:`STSAStrategy.add_statistics`)
    and kept in the round's spool; at the end each task's sum is certified once
    (:meth:`STSAStrategy.certify_round`: a failing sum is bisected to its culprits, whose whole
    replies are then left out) and the sums go into the ridge state in the order the backfill fold
    always used (this task, then the late ones by task), so the numbers equal those of summing the
    sorted list."""

    def __init__(self, strategy: STSAStrategy, plan: RoundPlan) -> None:
        self.strategy, self.plan = strategy, plan
        strategy.open_sums(plan.task)
        self.late: dict[int, list[str]] = {}  # task -> the clients whose late statistics came in
        self.clients: set[str] = set()

    def add(self, item: Accepted[Any]) -> None:
        strategy = self.strategy
        stats, factor, bound = item.payload["stats"]
        strategy.add_statistics(self.plan.task, [Accepted(item.client, item.num_examples, stats)], factor, bound)
        strategy.commit(item.client, self.plan.task, stats, item.num_examples, factor)
        for task, (payload, count) in item.payload["late"].items():
            late, late_factor, late_bound = payload
            strategy.add_statistics(task, [Accepted(item.client, count, late)], late_factor, late_bound)
            strategy.commit(item.client, task, late, count, late_factor)
            self.late.setdefault(task, []).append(item.client)
        self.clients.add(item.client)

    def drop(self, client: str) -> None:
        """``client``'s reply is left out after all (its upload made a sum fail its certificate)."""
        self.clients.discard(client)
        self.strategy.commitments.drop(client, self.plan.task)
        for task, clients in self.late.items():
            if client in clients:
                self.strategy.commitments.drop(client, task)
        for clients in self.late.values():
            if client in clients:
                clients.remove(client)

    def finish(self) -> None:
        strategy = self.strategy
        try:
            try:
                strategy.certify_round(self)
            except BaseException:  # the round's sums never reach the ridge state: nothing to commit to
                for client in self.clients:
                    strategy.commitments.drop(client, self.plan.task)
                for task, clients in self.late.items():
                    for client in clients:
                        strategy.commitments.drop(client, task)
                raise
            strategy.close_sums(self.plan.task)
            for task, clients in sorted(self.late.items()):  # as Backfill.fold adds them
                strategy.close_sums(task)
                for client in clients:
                    strategy.backfill.strike(client, task)
        finally:
            strategy.close_spool()
        strategy.backfill.note_missing(self.plan.task, self.clients)


class MaskedFold:
    """A secure statistics round, streamed: masked uploads are summed in the ring (mod 2⁶⁴, exact and
    order-free) as they arrive; the sum is opened once the unmask step has rebuilt the secrets."""

    def __init__(self, strategy: STSAStrategy, plan: RoundPlan) -> None:
        self.strategy, self.plan = strategy, plan
        self.sums: dict[str, np.ndarray] = {}
        self.clients: set[str] = set()

    def add(self, item: Accepted[Any]) -> None:
        masked = item.payload["masked"]
        for name in MASKED_NAMES:
            add_ring(self.sums, name, getattr(masked, name.replace("-", "_")))
        self.clients.add(item.client)

    def finish(self) -> None:
        self.strategy.open_masked(self.plan, self.sums, self.clients)


class ForgetFold(SiteForgetFold):
    """A forget round (docs/unlearning.md): each site's removal is checked against the server's
    commitments and applied, or refused with its reason; then the ridge is solved again and the
    removals are recorded (results.json ``unlearning``). Besides the named sites (wholly), every
    site's own requests (samples, classes) are applied."""

    def apply(self, item: Accepted[Any]) -> None:
        strategy, payload = self.strategy, item.payload
        if site_of(item.client) in strategy._forget_sites:
            uploads = {t: (stats, int(stats.counts.sum())) for t, stats in payload.added.items()}
            strategy.forget_client(item.client, uploads, what="client", requested_by="server operator")
            strategy.withdraw(item.client)
            return
        for task, stats in sorted(payload.added.items()):
            kept = payload.kept.get(task)
            strategy.forget(
                item.client,
                task,
                stats,
                int(stats.counts.sum()),
                kept,
                int(kept.counts.sum()) if kept is not None else 0,
                what="samples" if kept is not None else "stage",
                requested_by="site",
            )


OPENED_SUM = "secagg-opened"  # the run folder's copy of the last opened secure sum (for an honest resume)


class STSAStrategy(ForgetRounds):
    stats_phase = "stsa-stats"
    forget_phase = FORGET_PHASE

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        self.ridge = RidgeState.empty(self.rf_dim, split.num_classes)
        self.backfill: Backfill[StsaStats | StsaFactorStats] = Backfill(cfg.num_clients)
        self.secure = SecureRounds(cfg) if cfg.secure_aggregation else None
        # stage-1 FedAvg under secure aggregation: masked uploads, only each round's sum is opened
        self.masked_fedavg = MaskedFedAvg(self.model, cfg.weighted_fedavg) if cfg.secure_aggregation else None
        self._train_blame: dict[str, list[str]] = {}  # who the stage's FedAvg rounds named, with the evidence
        self._request: dict[int, tuple[int, ...]] = {}  # the backfill request of the round in progress
        self._round_sums: dict[int, TaskSum] = {}  # running sums per task of the plain round in progress
        self._spool: UploadSpool | None = None  # the plain round's uploads, until its sums are certified
        self._certificate = fresh_certificate()  # the stage's certificates of sums (solve's extras)
        self._in_ridge: set[int] = set()  # tasks whose own stage's statistics went into the ridge state
        self._resumed_opening: dict[str, Any] | None = None  # a secure sum opened before an interruption
        self._round_args: tuple[Grid, float] | None = None  # the grid and timeout of the round in progress
        # per class, the samples the opened secure sums added (what a secure removal may take out at most)
        self.secure_class_counts = torch.zeros(split.num_classes, dtype=torch.float64)
        # every factor upload's rows, for the N x N kernel solve while N <= M / 2 (None: G solves)
        self.stack = (
            FactorStack.empty(self.rf_dim, split.num_classes, self.rf_dim // 2) if cfg.stats_form == "factor" else None
        )

    # ---------------------------------------------------------------- rounds
    def customise(self, plan: RoundPlan, ins: Instruction) -> Instruction:
        if isinstance(ins, StatsIns) and plan.phase == FORGET_PHASE:
            return dataclasses.replace(ins, forget=self._forget_sites)
        if isinstance(ins, StatsIns):
            self._request = self.backfill.request()
            return dataclasses.replace(ins, backfill=self._request)
        return ins

    def run_round(self, grid: Grid, plan: RoundPlan, timeout: float) -> Iterable[Message]:
        self._round_args = (grid, timeout)
        self._resumed_opening = self.saved_opening(plan)
        if self._resumed_opening is not None:
            return []  # the sum was opened before the interruption: nobody is asked again
        if self.secure is not None and plan.phase in (self.stats_phase, FEDAVG_PHASE, FORGET_PHASE):
            return InOrder(self.secure.run(self, grid, plan, timeout))
        return super().run_round(grid, plan, timeout)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.secure is None or self._require_plan().phase != FEDAVG_PHASE:
            return self._aggregate(server_round, replies)
        # a stage-1 FedAvg round under secure aggregation: one that cannot open leaves the model as
        # it was (as a plain training round without replies does); the next round has fresh keys
        try:
            return self._aggregate(server_round, replies)
        except OpenedSumRejected as err:
            reason = f"round {server_round}: the opened secure FedAvg sum fails its checks: {err}"
            if self.cfg.secagg_failed_sum == "stop":
                raise RunFailed(f"{reason} (secagg-failed-sum=stop)") from None
            raise RoundFailed(reason) from None
        except StageFailed as err:
            raise RoundFailed(f"round {server_round}: {err}") from None
        finally:  # what was revealed for a FedAvg round says nothing about who owes statistics
            self.secure.revealed = set()
            for name, items in self.secure.blame.items():  # named in the stage's secagg_blame
                self._train_blame.setdefault(name, []).extend(f"round {server_round}: {item}" for item in items)
            self.secure.blame = {}

    def read_train(self, reply: Reply) -> Any:
        """Under secure aggregation every stage-1 reply must be masked: a clear state is refused."""
        return self.fedavg.read(reply) if self.masked_fedavg is None else self.masked_fedavg.read(reply)

    def train_fold(self, plan: RoundPlan) -> RoundFold | None:
        return None if self.masked_fedavg is None else self.masked_fedavg.fold(self.open_ring_sums)

    def open_ring_sums(self, sums: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Σ over the survivors of each named masked array (fcl_flower.privacy.secagg.unmask_sum)."""
        assert self.secure is not None and self.secure.opening is not None
        opening, bits = self.secure.opening, self.cfg.secagg_fraction_bits
        return {
            name: unmask_sum(
                [ring], name, opening.seeds, opening.dropped_keys, opening.s_publics, opening.context, bits
            )
            for name, ring in sums.items()
        }

    def _aggregate(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        saved, self._resumed_opening = self._resumed_opening, None
        if saved is None:
            while True:
                try:
                    return super().aggregate_train(server_round, replies)
                except RestartSecureRound as restart:
                    if restart.attempt >= MAX_ATTEMPTS or self.secure is None or self._round_args is None:
                        raise StageFailed(f"{restart}; the attempts are used up") from None
                    log(WARNING, "round %d: %s (attempt %d)", server_round, restart, restart.attempt + 1)
                    grid, timeout = self._round_args
                    plan = self._require_plan()
                    replies = InOrder(self.secure.run(self, grid, plan, timeout, restart.attempt))
        plan = self._require_plan()
        survivors = set(saved["survivors"])
        assert self.secure is not None
        self.secure.revealed = set(survivors)  # if the sum fails its checks now, it is still never re-opened
        log(
            INFO,
            "[stage %d] the secure sum opened before the interruption is taken from %s; nobody is asked again",
            plan.task + 1,
            self.checkpoints.folder / f"{OPENED_SUM}.json",
        )
        self.accounting.contributed(server_round, sorted(survivors, key=client_order))
        self.fold_opened(plan, saved["sums"], survivors, list(saved["tasks"]), int(saved["threshold"]))
        return self.global_arrays(), MetricRecord({"num-clients": len(survivors), "num-examples": 0})

    def masked(self) -> bool:
        """Whether the replies being read are masked (a secure statistics round is under way)."""
        return self.secure is not None and self.secure.current is not None

    def next_secure_round(self, plan: RoundPlan) -> Header | None:
        """Keys ahead (strategies/secure.py): the secure round after ``plan``'s, as its key step's header."""
        return following_secure_round(self, plan, (self.stats_phase, FEDAVG_PHASE))

    def secure_columns(self, task: int) -> list[int]:
        """The tasks whose classes a masked upload carries: this one, then the included owed ones."""
        assert self.secure is not None and self.secure.current is not None
        return [task, *self.secure.current.backfill_tasks(self._request, self.cfg.secagg_min_clients)]

    # ---------------------------------------------------------------- replies
    def check(self, stats: StsaStats | StsaFactorStats, num_examples: int) -> tuple[StsaStats, float | None]:
        """The upload is the statistics of some dataset of ``num_examples`` samples (see module doc);
        a factor upload comes back as the Gram statistics it stands for, with what the check
        certifies of its G (λ_min ≥ −β, :func:`~fcl_flower.analytic.checks.negative_bound`). The
        rounding allowed is the run's wire dtype's (``check-tolerance``), whatever dtype came: a
        float32 upload in a float64 run gets no more room than a float64 one."""
        noise = self.noise_levels()
        wire = WIRE_DTYPES[self.cfg.wire_dtype]
        if isinstance(stats, StsaFactorStats):
            with upload_checks():
                check_counts(stats.counts, num_examples)
                screen = screen_factor_statistics(
                    stats.factor,
                    stats.counts,
                    num_examples,
                    dim=self.rf_dim,
                    relative_tolerance=wire_epsilon(wire),
                    **self.feature_bounds,
                )
            # FᵀF is PSD but for the server's float64 product; the factor check's changes to it (label
            # block, clamped rounding) stay within the Gram check's slack (its doc). G itself is made
            # once for the round's stacked factors (TaskSum), which adds that product's rounding.
            diagonal = screen.diagonal
            slack = 4.0 * (self.rf_dim + int(stats.counts.numel())) * wire_epsilon(wire)
            rows = int(stats.factor.shape[0])
            rounding = product_rounding_bound(rows, float(diagonal.sum()) + float(stats.counts.sum()))
            return StsaStats(NO_GRAM, screen.class_sums, stats.counts), negative_bound(diagonal, slack) + rounding
        with upload_checks():
            check_counts(stats.counts, num_examples, noise=noise.counts if noise else 0.0)
            screen_packed_statistics(
                stats.gram_packed,
                stats.class_sums,
                stats.counts,
                relative_tolerance=gram_check_epsilon(wire, self.cfg.check_tolerance),
                noise=noise,
                **self.feature_bounds,
            )
        return stats, None  # the PSD test runs once, on the stage's sum (certify_round)

    def read_plain(self, task: int, record: ArrayRecord) -> StsaStats | StsaFactorStats:
        classes = len(self.split.tasks[task])
        if StsaFactorStats.matches(record):
            if self.cfg.stats_form != "factor":
                raise UploadError("a factor upload, but this run takes Gram uploads (stats-form gram)")
            return StsaFactorStats.read(record, dim=self.rf_dim, classes=classes)
        shapes = {"packed": packed_length(self.rf_dim), "dim": self.rf_dim, "classes": classes}
        # every upload read here is screened before it is used (check: screen_packed_statistics)
        return StsaStats.read(record, **shapes, noisy_counts=self.counts_noised, screened=True)

    def read_stats(self, plan: RoundPlan, client: str, reply: StatsRes) -> Any:
        if plan.phase == FORGET_PHASE and self.masked():  # a secure forget round (strategies/secure_unlearning.py)
            return read_masked_removal(self, plan, reply)
        if reply.secagg is not None and reply.secagg.leaving:
            raise UploadError("a statistics upload that says it is a removal: only a forget round takes one")
        if plan.phase == FORGET_PHASE:
            done = {t: len(self.split.tasks[t]) for t in range(plan.task + 1)}
            return ForgetStats.read(reply.arrays, packed=packed_length(self.rf_dim), dim=self.rf_dim, classes_of=done)
        if self.masked():
            classes = sum(len(self.split.tasks[t]) for t in self.secure_columns(plan.task))
            stats = MaskedStsaStats.read(
                reply.arrays, packed=packed_length(self.rf_dim), dim=self.rf_dim, classes=classes
            )
            if reply.backfill:
                raise UploadError("a masked upload carries its late statistics inside, not as records")
            return {"masked": stats}
        timed = self.accounting.timed
        with timed("parse"):
            plain = self.read_plain(plan.task, reply.arrays)
        with timed("check"):
            checked = self.checked(plain, reply.num_examples)
        with timed("parse"):
            late = self.backfill.read(client, reply, self.read_plain)
        checked_late = {}
        for task, (payload, count) in late.items():
            try:
                with timed("check"):
                    checked_late[task] = (self.checked(payload, count), count)
            except UploadError as err:
                raise UploadError(f"record 'backfill-{task}': {err}") from None
        return {"stats": checked, "late": checked_late}

    def stats_fold(self, plan: RoundPlan) -> RoundFold:
        """Each accepted upload is added to running sums at once and dropped (client order)."""
        if plan.phase == FORGET_PHASE:
            return SecureForgetFold(self, plan) if self.secure is not None else ForgetFold(self, plan)
        secure = self.secure is not None and plan.phase == self.stats_phase  # as run_round decides
        return MaskedFold(self, plan) if secure or self.masked() else PlainFold(self, plan)

    def aggregate_stats(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        fold = self.stats_fold(plan)
        for r in replies:
            fold.add(r)
        fold.finish()

    def task_sum(self, task: int) -> TaskSum:
        """Empty running sums of ``task``'s statistics (keeping factors while the stack takes them,
        and every upload in the round's spool until the sum is certified)."""
        room = self.stack.max_rows - self.stack.rows if self.stack is not None else 0
        clamp = bool(self.feature_bounds["nonnegative"])
        return TaskSum(self.rf_dim, len(self.split.tasks[task]), room, self._spool, clamp)

    def open_sums(self, task: int) -> None:
        """Start a round's running sums (those of a failed round are dropped): ``task``'s at once."""
        self.close_spool()
        self._spool = UploadSpool()
        self._round_sums = {task: self.task_sum(task)}

    def close_spool(self) -> None:
        """Drop the round's kept uploads (the round is closed, or failed)."""
        if self._spool is not None:
            self._spool.close()
            self._spool = None

    def checked(
        self, plain: StsaStats | StsaFactorStats, num_examples: int
    ) -> tuple[StsaStats, torch.Tensor | None, float | None]:
        """(the checked statistics, the factor they came as or None, their certified bound: None
        where only the screen ran and the stage's certificate decides)."""
        stats, bound = self.check(plain, num_examples)
        return stats, factor_of(plain), bound

    def add_statistics(
        self,
        task: int,
        replies: list[Accepted[StsaStats]],
        factor: torch.Tensor | None = None,
        negative_bound: float | None = math.inf,
    ) -> None:
        """Spatial aggregation (Eq. 2): add ``replies`` (uploads of ``task``'s statistics, current or
        late; ``factor``: the factor one upload stands for) to the round's running sums of ``task``;
        :meth:`close_sums` adds those to the ridge state (temporal, Eq. 4: late ones simply add)."""
        total = self._round_sums.get(task)
        if total is None:
            total = self._round_sums[task] = self.task_sum(task)
        for r in replies:
            total.add(r.client, r.payload, r.num_examples, factor, negative_bound)

    # ---------------------------------------------------------------- the stage certificate
    def certify_sum(self, gram: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor, uploads: int) -> float | None:
        """The PSD test of the sum of ``uploads`` uploads (their noise: √uploads times one client's):
        what it certifies of G (λ_min ≥ −β), or None where it fails. One factorisation; the same
        rule as an opened secure sum's (:meth:`fold_opened`)."""
        wire = WIRE_DTYPES[self.cfg.wire_dtype]
        began = time.perf_counter()
        try:
            return check_packed_statistics(
                gram,
                sums,
                counts,
                relative_tolerance=gram_check_epsilon(wire, self.cfg.check_tolerance),
                noise=self.noise_levels(math.sqrt(max(uploads, 1))),
                **self.feature_bounds,
            )
        except StatisticsRejected:
            return None
        finally:
            self._certificate["factorisations"] += 1
            self._certificate["seconds"] += time.perf_counter() - began

    def certify_subset(self, total: TaskSum, uploads: Sequence[Upload]) -> bool:
        """Whether the sum of ``uploads`` (kept by ``total``) passes the PSD test."""
        part = total.rebuilt(list(uploads), TaskSum(total.dim, int(total.sums.shape[1]), clamp=total.clamp))
        return self.certify_sum(part.gram, part.sums, part.counts, part.uploads) is not None

    def certify_round(self, fold: PlainFold) -> None:
        """One certificate per task sum of the round, on the sum the solve will use (issue 30). A sum
        that fails is bisected to a culprit (:func:`~fcl_flower.analytic.bisect.find_culprit`: about
        log₂K more factorisations); the culprit's whole reply is left out with the reason, every sum
        of the round is rebuilt without it, and the rest is certified again, until every sum
        passes. Where halving finds nobody (rounding at the edge of the slack), every upload of the
        sum is tested on its own, as before issue 30, and the sum is kept with the sum of their
        bounds if all pass."""
        while True:
            culprits: dict[str, str] = {}
            for task, total in sorted(self._round_sums.items()):
                if not total.screened:
                    continue
                bound = self.certify_sum(total.gram, total.sums, total.counts, total.uploads)
                if bound is not None:
                    total.negative_bound, total.screened = bound, 0
                    continue
                culprits.update(self.culprits(task, total))
            if not culprits:
                return
            for client, why in sorted(culprits.items()):
                log(WARNING, "Rejected upload from %s at the end of stage %d: %s", client, fold.plan.task + 1, why)
                self.accounting.retract(client, why)
                fold.drop(client)
                self._certificate["culprits"].append(client)
            self._round_sums = {
                task: total.rebuilt([u for u in total.kept if u.client not in culprits], self.task_sum(task))
                for task, total in self._round_sums.items()
            }

    def culprits(self, task: int, total: TaskSum) -> dict[str, str]:
        """Who makes ``total`` (a sum that failed its certificate) fail: found by halving, or by
        testing each upload alone where halving ends on nobody."""
        why = f"task {task + 1}'s sum fails its PSD certificate with this upload and passes without it: {NOT_PSD}"

        def passes(group: Sequence[Upload]) -> bool:
            return self.certify_subset(total, group)

        # Only a screened (Gram) upload can be the culprit: a factor upload is PSD by construction and
        # carries its own bound, so by the test's monotonicity under union the screened ones alone
        # fail too, and halving them never re-makes a product of factor rows (a client sending tall
        # factors beside a failing Gram upload would otherwise make every halving step redo them).
        found_by_halving, _ = find_culprit([u for u in total.kept if u.bound is None], passes)
        if found_by_halving:
            return {found_by_halving[0].client: why}
        found: dict[str, str] = {}
        bounds = 0.0
        for upload in total.kept:
            bound = upload.bound if upload.bound is not None else self.certify_sum(*self.kept_arrays(total, upload), 1)
            if bound is None:
                found[upload.client] = f"task {task + 1}: {NOT_PSD}"
            else:
                bounds += bound
        if not found:  # every upload passes alone: the sum keeps the sum of their certificates
            trace = float(diagonal_of_packed(total.gram, total.dim).sum())
            bounds += total.stacked_bound  # the products of stacked factor rows (TaskSum)
            total.negative_bound, total.screened = bounds + total.uploads * sum_rounding_bound(trace), 0
        return found

    def kept_arrays(self, total: TaskSum, upload: Upload) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        stats = total.stats_of(upload)
        return stats.gram_packed, stats.class_sums, stats.counts

    def stack_factors(self, classes: range, factors: list[torch.Tensor] | None) -> None:
        """Stack a round's factors of ``classes`` for the kernel solve; without them (an upload
        in Gram form, the cap passed) G holds more than the stack: the stack is dropped for good."""
        if self.stack is None:
            return
        rows = sum(int(f.shape[0]) for f in factors) if factors is not None else 0
        if factors is None or not self.stack.fits(rows):
            self.stack = None
            return
        if factors:  # the round's rows at once: the stack's arrays are copied once a round, not once an upload
            self.stack.add(torch.cat(factors), classes)

    def close_sums(self, task: int) -> None:
        """Add the round's running sums of ``task`` to the ridge state and drop them."""
        total = self._round_sums.pop(task, None)
        if total is not None:
            total.into(self, self.split.tasks[task])
            self._in_ridge.add(task)

    def open_masked(self, plan: RoundPlan, sums: dict[str, np.ndarray], survivors: set[str]) -> None:
        """Open Σ over the survivors, checkpoint it before anything else (an honest resume never asks
        the clients again: their ledgers would refuse another set), then check and add it."""
        assert self.secure is not None and self.secure.opening is not None and self.secure.current is not None
        opening = self.secure.opening
        opened = {
            name: torch.from_numpy(
                unmask_sum(
                    [sums[name]],
                    name,
                    opening.seeds,
                    opening.dropped_keys,
                    opening.s_publics,
                    opening.context,
                    self.cfg.secagg_fraction_bits,
                )
            )
            for name in MASKED_NAMES
        }
        tasks, threshold = self.secure_columns(plan.task), self.secure.current.threshold
        save_state(
            self.checkpoints.folder,
            OPENED_SUM,
            {
                "task": plan.task,
                "survivors": sorted(survivors),
                "tasks": tasks,
                "threshold": threshold,
                "sums": opened,
            },
        )
        self.fold_opened(plan, opened, survivors, tasks, threshold)

    def saved_opening(self, plan: RoundPlan) -> dict[str, Any] | None:
        """On resume: the secure sum of ``plan``'s stage opened before the interruption, if any."""
        path = self.checkpoints.folder / f"{OPENED_SUM}.json"
        if not (self.cfg.resume and self.secure is not None and plan.phase == self.stats_phase and path.exists()):
            return None
        try:
            saved = load_state(path)
        except StateError as err:
            raise RunFailed(f"resume: {err}") from None
        if not isinstance(saved, dict) or saved.get("task") != plan.task:
            return None  # an earlier stage's opened sum: this stage's was never opened
        try:
            return self.check_opening(saved, plan.task)
        except RestoreError as err:
            raise RunFailed(
                f"resume: {path}: {err}; delete it (the stage's secure round then fails) or restore a backup"
            ) from None

    def check_opening(self, saved: dict[str, Any], task: int) -> dict[str, Any]:
        """The fields of a saved opened sum, each checked (the sum itself is checked as an upload
        when it is folded in, :meth:`fold_opened`); RestoreError naming the field."""
        names = {client_name(i) for i in range(self.cfg.num_clients)}
        survivors = fields.strings(fields.entry(saved, "survivors", ""), "survivors")
        if not set(survivors) <= names or len(set(survivors)) != len(survivors):
            raise RestoreError("survivors", "must name distinct clients of this run")
        tasks = fields.integers(fields.entry(saved, "tasks", ""), "tasks", 0, task)
        if not tasks or tasks[0] != task or len(set(tasks)) != len(tasks):
            raise RestoreError("tasks", f"must list stage {task + 1} first, then distinct earlier stages")
        fields.integer(fields.entry(saved, "threshold", ""), "threshold", 1, self.cfg.num_clients)
        sums = fields.mapping(fields.entry(saved, "sums", ""), "sums")
        if set(sums) != set(MASKED_NAMES):
            raise RestoreError("sums", f"must hold {', '.join(MASKED_NAMES)}")
        classes = sum(len(self.split.tasks[t]) for t in tasks)
        shapes = {
            "gram-packed": (packed_length(self.rf_dim),),
            "class-sums": (self.rf_dim * classes,),
            "counts": (classes + 1,),
        }
        for name, shape in shapes.items():
            fields.tensor(sums[name], f"sums/{name}", shape)
        return saved

    def fold_opened(
        self, plan: RoundPlan, opened: dict[str, torch.Tensor], survivors: set[str], tasks: list[int], threshold: int
    ) -> None:
        """Check the opened sum like one upload and add it column block by column block."""
        # Integer counts are exact in fixed point, so their opened sum is exactly integral: a
        # garbage upload is caught here (and a rounding would let random counts through). Noised
        # counts are not integral; the withheld count, never noised, still is.
        noisy = self.counts_noised
        counts, withheld = opened["counts"][:-1], float(opened["counts"][-1])
        gram = opened["gram-packed"]
        sums_c = opened["class-sums"].reshape(self.rf_dim, -1)
        column = 0
        share = secure_share(self.cfg, threshold)
        factor = share * len(survivors) ** 0.5  # the opened sum's noise: |U3| shares
        for client in sorted(survivors):  # one release of each survivor's data: the current task and the owed ones
            owed = [t for t in tasks[1:] if t in self.backfill.missing.get(client, [])]
            self.record_release([client], plan.task, factor / (1 + len(owed)))
        noise = self.noise_levels(factor)
        try:
            if noisy:
                check_counts(counts, 0, noise=noise.counts if noise else 0.0)
                check_counts(opened["counts"][-1:], int(withheld))
            else:
                check_counts(opened["counts"], int(opened["counts"].sum()))
            bound = check_packed_statistics(
                gram,
                sums_c,
                counts,
                relative_tolerance=wire_epsilon(torch.float64),
                absolute_tolerance=len(survivors) * 2.0 ** -(self.cfg.secagg_fraction_bits + 1),
                noise=noise,
                **self.feature_bounds,
            )
        except StatisticsRejected as err:
            reason = f"the opened secure sum fails its checks: {err}; it is never opened again over another set"
            if self.cfg.secagg_failed_sum == "stop":
                raise RunFailed(f"stage {plan.task + 1}: {reason} (secagg-failed-sum=stop)") from None
            raise StageFailed(reason) from None
        for position, task in enumerate(tasks):
            width = len(self.split.tasks[task])
            block = slice(column, column + width)
            samples = noisy_total([counts[block]]) if noisy else int(counts[block].sum())
            self.ridge.add_packed(
                self.split.tasks[task], gram if position == 0 else None, sums_c[:, block], samples, bound
            )
            if not noisy:  # what a secure removal may take out of each class at most
                self.secure_class_counts[self.split.tasks[task].start : self.split.tasks[task].stop] += counts[block]
            self.note_sums_noise(self.split.tasks[task], factor * factor)
            column += width
        if withheld:
            self._withheld["all clients (masked sum)"] = self._withheld.get("all clients (masked sum)", 0) + int(
                withheld
            )
        self._in_ridge.add(plan.task)
        for task in tasks[1:]:  # the owing survivors' late statistics are in
            for client, owed in list(self.backfill.missing.items()):
                if task in owed and client in survivors:
                    self.backfill.strike(client, task)
        self.backfill.note_missing(plan.task, survivors)

    # ---------------------------------------------------------------- unlearning
    def commit(self, client: str, task: int, stats: StsaStats, num_examples: int, factor: torch.Tensor | None) -> None:
        """Keep the digest of an accepted plain Gram upload (strategies/unlearning.py) in a run that
        schedules removals (run config ``forget``; only such a run can apply one, and the SHA-256 of
        every upload costs several times adding it, issue 30); a factor upload's G is the server's
        own product, which the client cannot re-send bit for bit: none."""
        if factor is None and self.removals_scheduled:
            self.commitments.record(self.run_id, client, task, as_upload(stats, num_examples))

    def forget(
        self,
        client: str,
        task: int,
        added: StsaStats,
        added_samples: int,
        kept: StsaStats | None = None,
        kept_samples: int = 0,
        *,
        what: str = "client",
        requested_by: str = "server operator",
    ) -> dict[str, Any]:
        """Take ``client``'s upload of ``task`` out of the ridge state (``kept`` None), or swap it
        for ``kept``, the statistics of the samples it keeps (docs/unlearning.md). Applied between
        stages: the next solve (:meth:`resolve`) re-certifies G. ForgetRefused (why) where the
        upload is not the one committed to, or the removed part is no dataset's statistics."""
        if self.secure is not None:
            raise ForgetRefused("under secure aggregation a removal is its own secure round (SecureForgetFold)")
        if self.noise is not None:
            raise ForgetRefused("noised uploads: the removal check needs exact counts")
        if self._round_sums:
            raise ForgetRefused("a statistics round is under way: removals apply between stages")
        wire = WIRE_DTYPES[self.cfg.wire_dtype]
        kept_upload, removed = verified_removal(
            self.commitments,
            client,
            task,
            as_upload(added, added_samples),
            None if kept is None else as_upload(kept, kept_samples),
            relative_tolerance=gram_check_epsilon(wire, self.cfg.check_tolerance),
            **self.feature_bounds,
        )
        replace_upload(self.ridge, self.split.tasks[task], as_upload(added, added_samples), kept_upload)
        if kept is None:
            self.commitments.drop(client, task)
        else:
            self.commitments.record(self.run_id, client, task, kept_upload)
        self.stack = None  # the stacked factors still hold the removed rows: G solves from now on
        counts = {str(c): int(n) for c, n in zip(self.split.tasks[task], removed.counts.tolist()) if n}
        return self.record_removal(client, task, removed.num_samples, counts, what=what, requested_by=requested_by)

    def forget_client(self, client: str, uploads: dict[int, tuple[StsaStats, int]], **how: Any) -> list[dict[str, Any]]:
        """A whole client (site) out of every stage it contributed to: ``uploads`` its uploads by task,
        as its store kept them (those of stages the server never accepted are passed over). Every one
        is verified before any is applied (all or nothing)."""
        verified = self.site_uploads(
            client, uploads, lambda task, upload: self.commitments.verify(client, task, as_upload(*upload))
        )
        return [self.forget(client, task, *upload, **how) for task, (upload, _) in sorted(verified.items())]

    def withdraw(self, client: str) -> None:
        """``client`` is forgotten wholly: no later round goes to it and it owes nothing."""
        super().withdraw(client)
        self.backfill.withdraw(client)

    # ---------------------------------------------------------------- solve
    def solve(self, task: int) -> tuple[torch.Tensor, dict[str, Any]]:
        kernel = self.kernel_solve(task)
        if kernel is not None:
            weights, extra = kernel
        elif self.noise is not None:
            weights, extra = self.solve_noisy(self.ridge, task)
        else:
            weights, extra = solve_dense(self.ridge, self.num_seen(task), self.cfg)
        if self.cfg.secure_aggregation:
            extra["secure_aggregation"] = True
        return weights, {**extra, **self.certificate_extras(), **self.secure_extras(), **self.backfill.extras()}

    def certificate_extras(self) -> dict[str, Any]:
        """The stage's PSD certificates of sums (``sum_certificate``: how many factorisations, who
        was found by bisection; ``sum_certificate_seconds``: their wall time), then reset."""
        done, self._certificate = self._certificate, fresh_certificate()
        if not done["factorisations"]:
            return {}
        record = {"factorisations": done["factorisations"], "culprits": sorted(done["culprits"], key=client_order)}
        return {"sum_certificate": record, "sum_certificate_seconds": done["seconds"]}

    def secure_extras(self) -> dict[str, Any]:
        """Who the stage's secure round named, with the evidence (``secagg_blame``)."""
        train, self._train_blame = self._train_blame, {}
        if self.secure is None or not (self.secure.blame or train):
            return {}
        blame = {name: list(items) for name, items in train.items()}
        for name, items in self.secure.blame.items():
            blame.setdefault(name, []).extend(items)
        return {"secagg_blame": dict(sorted(blame.items()))}

    def kernel_solve(self, task: int) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """W through the stacked factors (fcl_flower/analytic/kernel.py: equal to the G solve, N × N
        instead of M × M) where every upload so far was a factor and γ is fixed; else None."""
        ridge = self.cfg.ridge_value()
        if self.noise is not None or self.stack is None or not self.stack.rows or ridge is None or ridge <= 0:
            return None
        weights = self.stack.solve(self.num_seen(task), ridge)
        if weights is None:
            return None
        return weights, {**ridge_extras(self.ridge.num_samples, ridge, []), "kernel_rows": self.stack.rows}

    def stage_failed(self, task: int, reason: str) -> dict[str, Any]:
        """Where the stage's statistics are not in the ridge state (its round failed), every client
        owes them (backfill, later); where they are (the solve failed after), nobody does: the next
        stage's solve includes them, and a backfill would add them twice."""
        extra = {**super().stage_failed(task, reason), **self.certificate_extras()}
        if task in self._in_ridge:
            return {**extra, "statistics_kept": True, **self.backfill.extras()}
        revealed = self.secure.revealed if self.secure is not None else set()
        for client in range(self.cfg.num_clients):
            if client_name(client) in revealed:
                continue  # it revealed its shares for this stage: opened once, never asked again
            owed = self.backfill.missing.setdefault(client_name(client), [])
            if task not in owed:
                owed.append(task)
        if revealed:
            extra["statistics_lost"] = sorted(revealed)
        return {**extra, **self.secure_extras(), **self.backfill.extras()}

    def state_dict(self) -> dict[str, Any]:
        barred = {str(c): why for c, why in self.secure.barred.items()} if self.secure is not None else {}
        return {
            **super().state_dict(),
            "ridge": self.ridge.state_dict(),
            "missing": self.backfill.state_dict(),
            "secagg_barred": barred,
            **self.forgetting_state(),
            **({"secure_class_counts": self.secure_class_counts} if self.secure is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ridge = self.restore_ridge(state)
        if self.ridge.num_samples:
            self.stack = None  # the checkpoint holds G, not the factors: solve from G from now on
        self.backfill.load_state_dict(state.get("missing", {}))
        self.load_forgetting_state(state)
        if self.secure is not None and "secure_class_counts" in state:
            totals = fields.tensor(state["secure_class_counts"], "state/secure_class_counts", (self.split.num_classes,))
            if bool((totals < 0).any()) or not torch.equal(totals, totals.round()):
                raise RestoreError("state/secure_class_counts", "must hold non-negative integer counts")
            self.secure_class_counts = totals.clone()
        barred = fields.mapping(state.get("secagg_barred", {}), "state/secagg_barred")
        for client, why in barred.items():
            if not client.isdigit() or int(client) >= self.cfg.num_clients or not isinstance(why, str):
                raise RestoreError(
                    f"state/secagg_barred/{client}", "must name a client of this run and why it is barred"
                )
        if self.secure is not None:  # who broke the protocol stays out after a resume
            self.secure.barred = {int(c): str(why) for c, why in barred.items()}

    def check_restored(self, completed: int) -> None:
        super().check_restored(completed)
        self.backfill.check_restored(completed)
        self.check_restored_ridge(
            self.ridge, completed, sum_of_checked_uploads=True, subtracted=bool(self.unlearning_log)
        )
