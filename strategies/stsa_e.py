"""STSA-E: clients upload class sums and counts only; the server estimates G (Eq. 9).

Each client splits its data of the task into ``dummy-clients`` K_D random chunks and uploads the
chunks' class sums and counts ((M + 1)·c_t·K_D numbers). The server streams the uploads into
the Eq. 9 estimate Ĝ (:class:`~fcl_flower.analytic.estimator.GramEstimator`; ``k-mode`` global is
the paper's, per-class the unbiased variant), adds Ĝ and the class sums to the same
:class:`~fcl_flower.analytic.ridge.RidgeState` as STSA, and solves the same ridge.

Eq. 9 is not a sum over clients (its coefficients depend on the totals of every upload of the
stage), so a stage with missing clients keeps its uploads (class sums and counts) until the last
late client is in, and then swaps the stage's Ĝ for the estimate from all of them.

Noise (Eq. 64, or differential privacy; strategies/analytic.py): the checks allow for it; noisy
counts are post-processed before Eq. 9 (:meth:`STSAEStrategy.usable_counts`: a cell whose noisy
count is below max(½, 2σ_n) counts as empty -- its sum still adds to S, but not to the outer
products, whose 1/n_k would blow its noise up); Ĝ, indefinite or not, is projected onto the PSD
cone before the solve.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, cast

import torch
from flwr.app import ArrayRecord

from fcl_flower import restore as fields
from fcl_flower.analytic import AnalyticInputError, estimate_gram
from fcl_flower.analytic.checks import check_class_sums, check_counts, wire_epsilon
from fcl_flower.analytic.estimator import GramEstimator, KMode
from fcl_flower.analytic.ridge import RidgeState
from fcl_flower.analytic.unlearning import Upload, remove_upload, swap_gram
from fcl_flower.config import RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.protocol import Instruction, StatsIns, StatsRes, UploadError
from fcl_flower.protocol.payloads import StsaEStats
from fcl_flower.restore import RestoreError
from fcl_flower.results import ResultsRecorder
from fcl_flower.tensors import WIRE_DTYPES
from strategies.analytic import solve_dense, upload_checks
from strategies.backfill import Backfill
from strategies.base import Accepted, RoundPlan
from strategies.forgetting import WholeSiteForgetting
from strategies.unlearning import Commitment, ForgetRefused


class STSAEStrategy(WholeSiteForgetting):
    stats_phase = "stsa-e-stats"
    forget_phase = "stsa-e-forget"
    upload_keys = StsaEStats.KEYS

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        self.ridge = RidgeState.empty(self.rf_dim, split.num_classes)
        self.backfill: Backfill[StsaEStats] = Backfill(cfg.num_clients)
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # task -> (sums, counts) so far
        self.k_mode = cast(KMode, cfg.k_mode)  # validated against K_MODES by RunConfig
        # each stage's Eq. 9 inputs, kept where removals are scheduled (docs/unlearning.md): a removal
        # takes a site's uploads out of every one of them and swaps the stage's estimate
        self.estimators: dict[int, GramEstimator] = {}

    def customise(self, plan: RoundPlan, ins: Instruction) -> Instruction:
        if isinstance(ins, StatsIns) and plan.phase == self.stats_phase:
            return dataclasses.replace(ins, backfill=self.backfill.request())
        return super().customise(plan, ins)

    # ---------------------------------------------------------------- replies
    def read_payload(self, task: int, record: ArrayRecord) -> StsaEStats:
        return StsaEStats.read(
            record,
            dummies=self.cfg.dummy_clients,
            dim=self.rf_dim,
            classes=len(self.split.tasks[task]),
            noisy_counts=self.counts_noised,
        )

    def read_upload(self, task: int, record: ArrayRecord) -> StsaEStats:
        """A re-sent upload of a forget round, read as the statistics upload it was."""
        return self.read_payload(task, record)

    def usable_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Counts for Eq. 9: exact ones as they are; noisy ones with cells below max(½, 2σ_n) set to 0."""
        if not self.counts_noised:
            return counts
        assert self.noise is not None
        floor = max(0.5, 2.0 * self.noise.counts)
        return torch.where(counts >= floor, counts, torch.zeros_like(counts))

    def read_stats(self, plan: RoundPlan, client: str, reply: StatsRes) -> Any:
        """Class sums and counts of some dataset (fcl_flower/analytic/checks.py), this stage's and
        every backfilled one's, each adding up to its reported number of samples."""
        stats = self.read_payload(plan.task, reply.arrays)
        late = self.backfill.read(client, reply, self.read_payload)
        noise = self.noise_levels()
        for task, (payload, count) in {plan.task: (stats, reply.num_examples), **late}.items():
            where = "" if task == plan.task else f"backfilled stage {task + 1}: "
            try:
                with upload_checks():
                    check_counts(payload.counts, count, noise=noise.counts if noise else 0.0)
                    check_class_sums(
                        payload.class_sums,
                        payload.counts,
                        relative_tolerance=wire_epsilon(WIRE_DTYPES[self.cfg.wire_dtype]),
                        noise=noise,
                        **self.feature_bounds,
                    )
            except UploadError as err:
                raise UploadError(f"{where}{err}") from None
        return {"stats": stats, "late": late}

    def aggregate_stats(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        on_time = [Accepted(r.client, r.num_examples, r.payload["stats"]) for r in replies]
        # Streaming Eq. 9: no (K·K_D, M, c_t) stack of all uploads on the server.
        estimator = GramEstimator(self.rf_dim, len(self.split.tasks[plan.task]), k_mode=self.k_mode)
        for r in on_time:
            estimator.add(r.payload.class_sums, self.usable_counts(r.payload.counts))
        self.ridge.add(
            self.split.tasks[plan.task], estimator.result(), estimator.class_sums, int(estimator.counts.sum())
        )
        self.note_sums_noise(self.split.tasks[plan.task], len(on_time) * self.cfg.dummy_clients)
        if self.removals_scheduled:
            self.estimators[plan.task] = estimator
            for r in on_time:
                self.commit_upload(r.client, plan.task, r.payload, r.num_examples, r.payload.counts.sum(dim=0))
        self.backfill.fold(replies, lambda r: r.payload["late"], self.add_late, self.release)
        if self.backfill.note_missing(plan.task, {r.client for r in replies}) and not self.removals_scheduled:
            self.held[plan.task] = (
                torch.cat([r.payload.class_sums for r in on_time]),
                torch.cat([self.usable_counts(r.payload.counts) for r in on_time]),
            )

    def release(self, task: int) -> None:
        """Every client's statistics of ``task`` are in: its kept uploads are no longer needed."""
        self.held.pop(task, None)

    def add_late(self, task: int, replies: list[Accepted[StsaEStats]]) -> None:
        """Swap the stage's Ĝ for the estimate from all its uploads; sums and counts just add. Where
        the stage's estimator is kept (removals scheduled) the late uploads go into it."""
        late_sums = torch.cat([r.payload.class_sums for r in replies])
        late_counts = torch.cat([self.usable_counts(r.payload.counts) for r in replies])
        kept = self.estimators.get(task)
        if kept is not None:
            before = kept.result()
            kept.add(late_sums, late_counts)
            delta = kept.result() - before
            for r in replies:
                self.commit_upload(r.client, task, r.payload, r.num_examples, r.payload.counts.sum(dim=0))
        else:
            old_sums, old_counts = self.held[task]
            sums, counts = torch.cat([old_sums, late_sums]), torch.cat([old_counts, late_counts])
            k_mode = self.k_mode
            delta = estimate_gram(sums, counts, k_mode=k_mode) - estimate_gram(old_sums, old_counts, k_mode=k_mode)
            self.held[task] = (sums, counts)
        self.ridge.add(self.split.tasks[task], delta, late_sums.sum(dim=0), int(late_counts.sum()))
        self.note_sums_noise(self.split.tasks[task], len(late_sums))

    # ---------------------------------------------------------------- unlearning
    def remove_site(self, client: str, uploads: dict[int, tuple[StsaEStats, Commitment]]) -> None:
        """Each stage's uploads of ``client`` out of every Eq. 9 input (:meth:`GramEstimator.remove`,
        on a copy until every stage has passed), the stage's Ĝ swapped for the new estimate
        (:func:`swap_gram`), its class sums and samples subtracted (docs/unlearning.md)."""
        changes = []
        for task, (stats, _) in sorted(uploads.items()):
            kept = self.estimators.get(task)
            if kept is None:
                raise ForgetRefused(f"{client}, stage {task + 1}: the server kept no estimator state of the stage")
            trial = copy.deepcopy(kept)
            try:
                trial.remove(stats.class_sums, self.usable_counts(stats.counts))
                new = trial.result() if trial.num_uploads else torch.zeros_like(kept.result())
            except AnalyticInputError as err:
                raise ForgetRefused(f"{client}, stage {task + 1}: {err}") from None
            changes.append((task, stats, kept.result(), new, trial))
        for task, stats, old, new, trial in changes:
            swap_gram(self.ridge, old, new)
            upload = Upload(None, stats.class_sums.sum(dim=0), stats.counts.sum(dim=0), int(stats.counts.sum()))
            remove_upload(self.ridge, self.split.tasks[task], upload)
            self.estimators[task] = trial

    def withdraw(self, client: str) -> None:
        """``client`` is forgotten wholly: no later round goes to it and it owes nothing."""
        super().withdraw(client)
        self.backfill.withdraw(client)

    # ---------------------------------------------------------------- solve
    def solve(self, task: int) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.noise is not None:
            weights, extra = self.solve_noisy(self.ridge, task)
        else:
            weights, extra = solve_dense(self.ridge, self.num_seen(task), self.cfg)
        return weights, {**extra, **self.backfill.extras()}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "ridge": self.ridge.state_dict(),
            "missing": self.backfill.state_dict(),
            "held": dict(self.held),
            "estimators": {str(task): kept.state_dict() for task, kept in sorted(self.estimators.items())},
            **self.forgetting_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ridge = self.restore_ridge(state)
        self.backfill.load_state_dict(state.get("missing", {}))
        held = state.get("held", {})
        if not isinstance(held, dict):
            raise RestoreError("state/held", f"must be a mapping of stages to kept uploads, not {fields.kind(held)}")
        self.held = {}
        for task, kept in held.items():
            where = f"state/held/{task}"
            fields.integer(task, where, 0, self.num_tasks - 1)
            if not isinstance(kept, tuple) or len(kept) != 2:
                raise RestoreError(where, "must be the kept (class sums, counts) of the stage")
            width = len(self.split.tasks[task])
            sums = fields.tensor(kept[0], f"{where}/0", (None, self.rf_dim, width), dtype=None)
            counts = fields.tensor(kept[1], f"{where}/1", (int(sums.shape[0]), width), dtype=None)
            self.held[task] = (sums, counts)
        self.estimators = {}
        for key, saved in fields.mapping(state.get("estimators", {}), "state/estimators").items():
            where = f"state/estimators/{key}"
            if not str(key).isdigit() or int(key) >= self.num_tasks:
                raise RestoreError(where, "must name a stage of this run")
            try:
                kept = GramEstimator.from_state(
                    fields.mapping(saved, where), self.rf_dim, len(self.split.tasks[int(key)])
                )
            except AnalyticInputError as err:
                raise RestoreError(where, f"is not an estimator state: {err}") from None
            if kept.k_mode != self.k_mode:
                raise RestoreError(f"{where}/k_mode", f"is {kept.k_mode}, the run's k-mode is {self.k_mode}")
            self.estimators[int(key)] = kept
        self.load_forgetting_state(state)

    def check_restored(self, completed: int) -> None:
        super().check_restored(completed)
        self.backfill.check_restored(completed)
        ahead = [t for t in self.estimators if t >= completed]
        if ahead:
            raise RestoreError(f"state/estimators/{ahead[0]}", f"is of a stage that has not run ({completed} have)")
        late = [t for t in self.held if t >= completed]
        if late:
            raise RestoreError(f"state/held/{late[0]}", f"keeps uploads of a stage that has not run ({completed} have)")
        self.check_restored_ridge(self.ridge, completed, sum_of_checked_uploads=False)
