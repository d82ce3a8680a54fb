"""FedRAN: low-rank Gram summaries merged by QR-SVD, exact B, closed-form subspace ridge.

Server state is (U_{1:t} ∈ R^{M×r}, σ_{1:t} ∈ R^r, B_{1:t} ∈ R^{M×C_t}) in float64: never an M×M
matrix. Per stage the client summaries are folded in ascending client id (the spatial merge),
then into the running summary (the temporal merge), B_{1:t} = pad(B_{1:t−1}) + Σ_k B_{k,t}
exactly, and W = U (diag(σ²) + γI)⁻¹ UᵀB is re-solved (docs/methods/fedran.md §2.7–2.8, Algorithm 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from flwr.app import ArrayRecord

from fcl_flower import restore as fields
from fcl_flower.analytic.checks import check_lowrank_statistics, wire_epsilon
from fcl_flower.analytic.communication import WIRE_DTYPE_BYTES, fedran_upload_numbers
from fcl_flower.analytic.errors import AnalyticInputError
from fcl_flower.analytic.lowrank import (
    LowRankError,
    LowRankSummary,
    TailEnergy,
    merge_two_level,
    rank_for_budget,
)
from fcl_flower.analytic.ridge import GCVRow, default_ridge_grid
from fcl_flower.analytic.subspace import pad_label_corr, select_subspace_ridge_gcv, solve_subspace_ridge
from fcl_flower.analytic.unlearning import remerge_without
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.protocol import FedranReport, Instruction, StatsIns, StatsRes, UploadError
from fcl_flower.protocol.payloads import FedranStats
from fcl_flower.restore import RestoreError
from fcl_flower.results import ResultsRecorder
from fcl_flower.tensors import WIRE_DTYPES
from strategies.analytic import ridge_extras, upload_checks
from strategies.base import Accepted, RoundPlan
from strategies.forgetting import WholeSiteForgetting, site_of
from strategies.unlearning import Commitment, ForgetRefused


class FedRANStrategy(WholeSiteForgetting):
    """FedRAN and FedRAN-SSL as a staged Flower strategy (one upload per client per stage).

    Stage-1 adaptation (``stage1-rounds``): the paper keeps a *pretrained* backbone frozen for
    the whole stream (docs/methods/fedran.md §2.3, §6.2 mode (a): ``stage1-rounds 0``), except in its ViT table,
    where all methods first fine-tune on task 1 "following the prior ViT-based setting" (STSA's
    FedAvg first-stage adaptation, mode (b): ``stage1-rounds 10``). Both modes reuse the FedAvg
    rounds of :class:`AnalyticStrategy`; the project default of 10 suits the randomly
    initialised small backbones used offline.

    Rank: ``rank`` r, or, when ``rank-budget-bytes`` > 0, the largest r whose upload fits the
    budget at this stage's C_t (Eq. 12), so it shrinks as classes arrive. Clients use
    r_k = min(r, ñ_k, M). The server keeps rank max(r_1..r_t): a per-message budget limits
    uploads, not the server's own state. Ridge: the fixed ``ridge`` (the paper fixes 1e-3), or
    ``auto``: GCV on the sketch's spectrum (σ², tr(YᵀY) = ñ), an addition to the paper.

    FedRAN-SSL: ``label-ratio`` ρ < 1 labels a seeded ρ fraction of each client's samples and
    pseudo-labels the rest with threshold ``pseudo-threshold`` τ (see clients/fedran.py). Each
    stage records ``extra["pseudo_labels"]``: labelled, unlabelled, accepted and correct counts
    summed over the clients.

    Noise (strategies/analytic.py, clients/fedran.py): the checks allow for it, r_k ≤ min(r, M)
    only, and ñ is the client's noisy count when the counts are noised.

    Uploads are checked (only U, σ, B; shapes; finite; σ descending ≥ 0; UᵀU = I; r_k ≤ min(r, ñ, M);
    consistent counts; ‖B‖_F ≤ σ₁√ñ, B ≥ 0 for ReLU features and the feature-clip bounds, see
    fcl_flower/analytic/checks.py) and a bad one is rejected alone. A client missing from a stage is recorded
    in ``left_out`` and not asked again: FedRAN does not backfill, because a truncated merge
    depends on the order in which summaries arrive.
    """

    stats_phase = "fedran-stats"
    forget_phase = "fedran-forget"
    upload_keys = FedranStats.KEYS

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        self.bytes_per_number = WIRE_DTYPE_BYTES[cfg.wire_dtype]
        self.summary_state = LowRankSummary.empty(self.rf_dim)
        self.label_corr = torch.zeros(self.rf_dim, 0, dtype=torch.float64)
        self.num_samples = 0
        self.server_rank = 0
        self.gram_noise_variance = 0.0  # Σ over the merged uploads of their Gram noise's variance per entry
        if cfg.rank_budget_bytes > 0:
            self.upload_rank(self.num_tasks - 1)  # the last stage has the widest B: fail now, not then
        self._stage: dict[str, Any] = {}
        # where removals are scheduled (docs/unlearning.md): every site's summary (U_k, σ_k, n_k) per
        # stage in merge order, and the server rank of each stage's merge, to merge the kept ones again
        self.site_summaries: dict[int, list[tuple[int, LowRankSummary]]] = {}
        self.stage_ranks: dict[int, int] = {}

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        summary = self.summary_state
        return {
            **super().state_dict(),
            "label_corr": self.label_corr,
            "server_rank": self.server_rank,
            "num_samples": self.num_samples,
            "gram_noise_variance": self.gram_noise_variance,
            "summary": {
                "basis": summary.basis,
                "singular_values": summary.singular_values,
                "num_samples": summary.num_samples,
                "discarded": (summary.discarded.spectral, summary.discarded.trace),
            },
            "site_summaries": {
                str(task): {str(site): summary_state(kept) for site, kept in sites}
                for task, sites in sorted(self.site_summaries.items())
            },
            "stage_ranks": {str(task): rank for task, rank in sorted(self.stage_ranks.items())},
            **self.forgetting_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every field checked (fcl_flower/restore.py): U (M × r) with orthonormal columns, σ
        descending and >= 0, the tail energies, ΦᵀY (M × seen classes), counts and ranks in range."""
        super().load_state_dict(state)
        dim = self.rf_dim
        saved = fields.mapping(fields.entry(state, "summary", "state"), "state/summary")
        basis = fields.tensor(fields.entry(saved, "basis", "state/summary"), "state/summary/basis", (dim, None))
        rank = int(basis.shape[1])
        sigma = fields.tensor(
            fields.entry(saved, "singular_values", "state/summary"), "state/summary/singular_values", (rank,)
        )
        if rank > dim or bool((sigma < 0).any()) or bool((sigma[1:] > sigma[:-1]).any()):
            raise RestoreError(
                "state/summary/singular_values", "must be non-negative and descending, at most M of them"
            )
        if rank and float((basis.T @ basis - torch.eye(rank, dtype=basis.dtype)).abs().max()) > 1e-6:
            raise RestoreError("state/summary/basis", "does not have orthonormal columns")
        count = fields.integer(fields.entry(saved, "num_samples", "state/summary"), "state/summary/num_samples", 0)
        discarded = fields.entry(saved, "discarded", "state/summary")
        if not isinstance(discarded, (tuple, list)) or len(discarded) != 2:
            raise RestoreError("state/summary/discarded", "must be the (spectral, trace) tail energies")
        tail = [fields.number(v, f"state/summary/discarded/{i}", 0.0) for i, v in enumerate(discarded)]
        try:
            self.summary_state = LowRankSummary(basis, sigma, count, TailEnergy(*tail))
        except LowRankError as err:
            raise RestoreError("state/summary", f"is not a low-rank summary: {err}") from None
        corr = fields.tensor(fields.entry(state, "label_corr", "state"), "state/label_corr", (dim, None))
        if int(corr.shape[1]) > self.split.num_classes:
            raise RestoreError(
                "state/label_corr", f"has {int(corr.shape[1])} class columns, more than the run's classes"
            )
        self.label_corr = corr
        self.server_rank = fields.integer(fields.entry(state, "server_rank", "state"), "state/server_rank", 0, dim)
        self.num_samples = fields.integer(fields.entry(state, "num_samples", "state"), "state/num_samples", 0)
        self.gram_noise_variance = fields.number(
            state.get("gram_noise_variance", 0.0), "state/gram_noise_variance", 0.0
        )
        self.load_site_summaries(state)
        self.load_forgetting_state(state)

    def load_site_summaries(self, state: dict[str, Any]) -> None:
        """The kept per-site summaries and stage ranks (removals scheduled), each checked."""
        ranks = fields.mapping(state.get("stage_ranks", {}), "state/stage_ranks")
        self.stage_ranks = {}
        for key, rank in ranks.items():
            if not str(key).isdigit() or int(key) >= self.num_tasks:
                raise RestoreError(f"state/stage_ranks/{key}", "must name a stage of this run")
            self.stage_ranks[int(key)] = fields.integer(rank, f"state/stage_ranks/{key}", 1, self.rf_dim)
        self.site_summaries = {}
        for key, sites in fields.mapping(state.get("site_summaries", {}), "state/site_summaries").items():
            where = f"state/site_summaries/{key}"
            if not str(key).isdigit() or int(key) not in self.stage_ranks:
                raise RestoreError(where, "must name a stage of this run with its rank in state/stage_ranks")
            kept = []
            for site, saved in sorted(fields.mapping(sites, where).items(), key=lambda item: int(item[0])):
                if not str(site).isdigit() or int(site) >= self.cfg.num_clients:
                    raise RestoreError(f"{where}/{site}", "must name a client of this run")
                kept.append(
                    (int(site), self.restored_summary(fields.mapping(saved, f"{where}/{site}"), f"{where}/{site}"))
                )
            self.site_summaries[int(key)] = kept

    def restored_summary(self, saved: Any, where: str) -> LowRankSummary:
        """One site's summary (U orthonormal, σ descending >= 0) from a checkpoint."""
        basis = fields.tensor(fields.entry(saved, "basis", where), f"{where}/basis", (self.rf_dim, None))
        rank = int(basis.shape[1])
        sigma = fields.tensor(fields.entry(saved, "singular_values", where), f"{where}/singular_values", (rank,))
        samples = fields.integer(fields.entry(saved, "num_samples", where), f"{where}/num_samples", 0)
        try:
            return LowRankSummary(basis, sigma, samples)
        except LowRankError as err:
            raise RestoreError(where, f"is not a low-rank summary: {err}") from None

    def check_restored(self, completed: int) -> None:
        super().check_restored(completed)
        ahead = [t for t in self.stage_ranks if t >= completed]
        if ahead:
            raise RestoreError(f"state/stage_ranks/{ahead[0]}", f"is of a stage that has not run ({completed} have)")
        if int(self.label_corr.shape[1]) > self.num_seen(completed - 1):
            raise RestoreError("state/label_corr", f"has columns of classes not yet seen after {completed} stages")

    # ---------------------------------------------------------------- rank
    def upload_rank(self, task: int) -> int:
        """r for this stage's uploads: ``rank`` capped at M, or Eq. 12 for the stage's C_t."""
        budget = self.cfg.rank_budget_bytes
        if budget <= 0:
            return min(self.cfg.rank, self.rf_dim)
        try:
            return rank_for_budget(budget, self.rf_dim, self.num_seen(task), self.bytes_per_number)
        except LowRankError as err:
            raise ConfigError(f"rank-budget-bytes too small at stage {task + 1}: {err}") from None

    # ---------------------------------------------------------------- schedule
    def plan_stage(self, task: int) -> list[RoundPlan]:
        self._stage = {"formula": {}, "pseudo": dict.fromkeys(PSEUDO_FIELDS, 0), "client_ranks": {}}
        return super().plan_stage(task)

    def customise(self, plan: RoundPlan, ins: Instruction) -> Instruction:
        if isinstance(ins, StatsIns) and plan.phase == self.stats_phase:
            return dataclasses.replace(ins, rank=self.upload_rank(plan.task))
        return super().customise(plan, ins)

    # ---------------------------------------------------------------- replies
    def read_stats(self, plan: RoundPlan, client: str, reply: StatsRes) -> Any:
        """(U, σ, B) checked (fcl_flower/protocol/payloads.py), then r_k ≤ min(r, ñ, M),
        ñ = labelled + accepted − withheld, correct ≤ accepted ≤ unlabelled."""
        if reply.fedran is None:
            raise UploadError("FedRAN reply without its pseudo-label counts")
        rank = self.upload_rank(plan.task)
        stats = FedranStats.read(reply.arrays, dim=self.rf_dim, classes=self.num_seen(plan.task), max_rank=rank)
        n, counts = reply.num_examples, reply.fedran
        if self.noise is not None:  # a noised Gram has full rank; a noised ñ bounds nothing
            if stats.rank > min(rank, self.rf_dim):
                raise UploadError(f"rank {stats.rank} exceeds min(r, M)")
        elif stats.rank > min(rank, n, self.rf_dim):
            raise UploadError(f"rank {stats.rank} exceeds min(r, n={n}, M)")
        if counts.num_labelled + counts.pseudo_accepted != n + reply.withheld:
            raise UploadError("num-examples differs from labelled + accepted pseudo-labelled - withheld samples")
        if not counts.pseudo_correct <= counts.pseudo_accepted <= counts.pseudo_unlabelled:
            raise UploadError("pseudo-label counts are inconsistent (correct <= accepted <= unlabelled)")
        with upload_checks():
            check_lowrank_statistics(
                stats.singular_values,
                stats.label_corr,
                n,
                relative_tolerance=wire_epsilon(WIRE_DTYPES[self.cfg.wire_dtype]),
                noise=self.noise_levels(),
                **self.feature_bounds,
            )
        try:
            summary = LowRankSummary(stats.basis, stats.singular_values, n)
        except LowRankError as err:
            raise UploadError(f"bad summary: {err}") from None
        return {"stats": stats, "summary": summary, "pseudo": counts}

    def aggregate_stats(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        ordered = sorted(replies, key=lambda r: int(r.client.rsplit("-", 1)[1]))  # ascending client id
        upload_rank = self.upload_rank(plan.task)
        self.server_rank = max(self.server_rank, upload_rank)
        self.summary_state = merge_two_level(
            [r.payload["summary"] for r in ordered], self.summary_state, self.server_rank
        )
        classes = self.num_seen(plan.task)
        stage_corr = sum(
            (r.payload["stats"].label_corr for r in ordered), torch.zeros(self.rf_dim, classes, dtype=torch.float64)
        )
        self.label_corr = pad_label_corr(self.label_corr, classes) + stage_corr
        self.num_samples += sum(r.num_examples for r in ordered)
        if self.noise is not None:
            self.gram_noise_variance += len(ordered) * self.noise.gram**2
            self.note_sums_noise(self.split.tasks[plan.task], len(ordered))  # B's task columns only
        if self.removals_scheduled:
            self.site_summaries[plan.task] = [(site_of(r.client), r.payload["summary"]) for r in ordered]
            self.stage_ranks[plan.task] = self.server_rank
        for r in ordered:
            self.commit_upload(r.client, plan.task, r.payload["stats"], r.num_examples)
            r_k = r.payload["stats"].rank
            self._stage["client_ranks"][r.client] = r_k
            self._stage["formula"][r.client] = fedran_upload_numbers(self.rf_dim, r_k, classes) * self.bytes_per_number
            for key in PSEUDO_FIELDS:
                self._stage["pseudo"][key] += getattr(r.payload["pseudo"], key)

    # ---------------------------------------------------------------- unlearning
    def read_upload(self, task: int, record: ArrayRecord) -> FedranStats:
        """A re-sent upload of a forget round, read as the statistics upload of its stage."""
        return FedranStats.read(record, dim=self.rf_dim, classes=self.num_seen(task), max_rank=self.upload_rank(task))

    def remove_site(self, client: str, uploads: dict[int, tuple[FedranStats, Commitment]]) -> None:
        """Merge the kept summaries again without ``client`` (:func:`remerge_without`: the merges of
        a run that never had it, from the same empty start), subtract its B and its samples."""
        lost = [t + 1 for t in uploads if t not in self.site_summaries]
        if lost:
            raise ForgetRefused(f"{client}: the server kept no summaries of stage(s) {lost}")
        site = site_of(client)
        tasks = sorted(self.site_summaries)
        try:
            merged = remerge_without(
                [self.site_summaries[t] for t in tasks],
                {site},
                [self.stage_ranks[t] for t in tasks],
                start=LowRankSummary.empty(self.rf_dim),
            )
        except (LowRankError, AnalyticInputError) as err:
            raise ForgetRefused(f"{client}: the kept summaries do not merge again: {err}") from None
        assert merged is not None
        self.summary_state = merged
        for task, (stats, entry) in uploads.items():
            self.label_corr[:, : self.num_seen(task)] -= stats.label_corr
            self.num_samples -= entry.num_samples
        self.site_summaries = {
            t: [(k, kept) for k, kept in sites if k != site] for t, sites in self.site_summaries.items()
        }

    # ---------------------------------------------------------------- solve
    def ridge_grid(self) -> list[float] | None:
        """GCV's γ grid: the default one (None), or with noise only the points ≥ 2√(v M), the edge of
        the spectrum of the merged Gram noise (symmetric, entry variance v summed over the uploads):
        the clients' sketches are PSD, so the server sees no negative eigenvalue to estimate the
        noise from (fcl_flower/analytic/ridge.py: the dense methods use |λ_min| instead)."""
        if self.noise is None:
            return None
        floor = 2.0 * (self.gram_noise_variance * self.rf_dim) ** 0.5
        return [gamma for gamma in default_ridge_grid().tolist() if gamma >= floor] or [floor]

    def solve(self, task: int) -> tuple[torch.Tensor, dict[str, Any]]:
        label_corr = pad_label_corr(self.label_corr, self.num_seen(task))
        summary = self.summary_state
        gamma = self.cfg.ridge_value()
        table: list[GCVRow] = []
        if gamma is None:
            samples = max(self.num_samples, 1)
            noise = float(self.sums_noise[: self.num_seen(task)].sum())
            gamma, table = select_subspace_ridge_gcv(
                summary, label_corr, samples, float(samples), self.ridge_grid(), sums_noise=noise
            )
        weights = solve_subspace_ridge(summary, label_corr, gamma)
        pseudo = self._stage["pseudo"]
        extra = ridge_extras(self.num_samples, gamma, table)
        extra.update(
            {
                "rank": {
                    "upload": self.upload_rank(task),
                    "server": self.server_rank,
                    "retained": summary.rank,
                    "clients": dict(sorted(self._stage["client_ranks"].items())),
                },
                # Tail energy cut by the server's merges (clients' local cuts are not uploaded).
                "merge_discarded_energy": {"spectral": summary.discarded.spectral, "trace": summary.discarded.trace},
                "upload_formula_bytes_per_client": dict(sorted(self._stage["formula"].items())),
                "pseudo_labels": {
                    "labelled": pseudo["num_labelled"],
                    "unlabelled": pseudo["pseudo_unlabelled"],
                    "accepted": pseudo["pseudo_accepted"],
                    "correct": pseudo["pseudo_correct"],
                },
            }
        )
        return weights, extra


PSEUDO_FIELDS = tuple(f.name for f in dataclasses.fields(FedranReport))


def summary_state(summary: LowRankSummary) -> dict[str, Any]:
    """One site's kept summary as a checkpoint holds it."""
    return {"basis": summary.basis, "singular_values": summary.singular_values, "num_samples": summary.num_samples}
