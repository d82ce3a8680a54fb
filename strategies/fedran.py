"""FedRAN: low-rank Gram summaries merged by QR-SVD, exact B, closed-form subspace ridge.

Server state is (U_{1:t} ∈ R^{M×r}, σ_{1:t} ∈ R^r, B_{1:t} ∈ R^{M×C_t}) in float64: never an M×M
matrix. Per stage the client summaries are folded in ascending client id (the spatial merge),
then into the running summary (the temporal merge), B_{1:t} = pad(B_{1:t−1}) + Σ_k B_{k,t}
exactly, and W = U (diag(σ²) + γI)⁻¹ UᵀB is re-solved (spec §2.7–2.8, Algorithm 1).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from flwr.app import RecordDict

from clients.fedran import RANK_KEY, UPLOAD_KEYS
from fcl_flower.analytic.communication import WIRE_DTYPE_BYTES, fedran_upload_numbers
from fcl_flower.analytic.lowrank import (
    LowRankError,
    LowRankSummary,
    TailEnergy,
    merge_two_level,
    rank_for_budget,
)
from fcl_flower.analytic.subspace import pad_label_corr, select_subspace_ridge_gcv, solve_subspace_ridge
from fcl_flower.config import ConfigError
from fcl_flower.wire import UploadError, read_tensor
from strategies.analytic import AnalyticStrategy
from strategies.base import Reply, RoundPlan

PSEUDO_METRICS = ("num-labelled", "pseudo-unlabelled", "pseudo-accepted", "pseudo-correct")


class FedRANStrategy(AnalyticStrategy):
    """FedRAN and FedRAN-SSL as a staged Flower strategy (one upload per client per stage).

    Stage-1 adaptation (``stage1-rounds``): the paper keeps a *pretrained* backbone frozen for
    the whole stream (spec §2.3, §6.2 mode (a): ``stage1-rounds 0``), except in its ViT table,
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

    Uploads are checked (only U, σ, B; shapes; finite; σ descending ≥ 0; UᵀU = I; r_k ≤ min(r, ñ, M);
    consistent counts) and a bad one is rejected alone. A client missing from a stage is recorded
    in ``left_out`` and not asked again: FedRAN does not backfill, because a truncated merge
    depends on the order in which summaries arrive.
    """

    name: ClassVar[str] = "fedran"
    stats_phase: ClassVar[str] = "fedran-stats"

    def init_statistics(self) -> tuple[None, None]:
        return None, None  # FedRAN keeps a low-rank summary, never the dense M × M Gram

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bytes_per_number = WIRE_DTYPE_BYTES[self.cfg.wire_dtype]
        self.summary_state = LowRankSummary.empty(self.rf_dim)
        self.label_corr = torch.zeros(self.rf_dim, 0, dtype=torch.float64)
        self.server_rank = 0
        if self.cfg.rank_budget_bytes > 0:
            self.upload_rank(self.num_tasks - 1)  # the last stage has the widest B: fail now, not then
        self._stage: dict[str, Any] = {}

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        summary = self.summary_state
        return {**super().state_dict(), "label_corr": self.label_corr, "server_rank": self.server_rank,
                "summary": {"basis": summary.basis, "singular_values": summary.singular_values,
                            "num_samples": summary.num_samples,
                            "discarded": (summary.discarded.spectral, summary.discarded.trace)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state["summary"]
        self.summary_state = LowRankSummary(saved["basis"], saved["singular_values"], saved["num_samples"],
                                            TailEnergy(*saved["discarded"]))
        self.label_corr, self.server_rank = state["label_corr"], state["server_rank"]

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
        self._stage = {"formula": {}, "pseudo": dict.fromkeys(PSEUDO_METRICS, 0), "client_ranks": {}}
        return super().plan_stage(task)

    def round_config(self, plan: RoundPlan) -> dict[str, Any]:
        return {RANK_KEY: self.upload_rank(plan.task)} if plan.phase == self.stats_phase else {}

    # ---------------------------------------------------------------- replies
    def parse_reply(self, plan: RoundPlan, content: RecordDict) -> Any:
        payload = super().parse_reply(plan, content)
        if plan.phase == self.stats_phase:
            metrics = content.metric_records["metrics"]  # present: base._identify checked it
            counts = {}
            for key in PSEUDO_METRICS:
                value = metrics.get(key)
                if not isinstance(value, int) or value < 0:
                    raise UploadError(f"metric '{key}' is {value!r}, expected a non-negative int")
                counts[key] = value
            payload["pseudo"] = counts
        return payload

    def parse_stats(self, plan: RoundPlan, record: Any) -> dict[str, Any]:
        """Shapes, finiteness, descending σ ≥ 0 and orthonormal U; nothing but (U, σ, B)."""
        extra_keys = sorted(set(record.keys()) - set(UPLOAD_KEYS))
        if extra_keys:
            raise UploadError(f"unexpected array(s) {', '.join(extra_keys)}")
        dim, classes, rank = self.rf_dim, self.num_seen(plan.task), self.upload_rank(plan.task)
        basis = read_tensor(record, "basis", ndim=2, floating=True)
        if basis.shape[0] != dim or basis.shape[1] > rank:
            raise UploadError(f"basis has shape {tuple(basis.shape)}, expected ({dim}, r_k <= {rank})")
        r_k = int(basis.shape[1])
        sigma = read_tensor(record, "singular-values", shape=(r_k,), floating=True, nonnegative=True)
        if r_k > 1 and bool((sigma[1:] > sigma[:-1]).any()):
            raise UploadError("singular values are not in descending order")
        label_corr = read_tensor(record, "label-corr", shape=(dim, classes), floating=True)
        u = basis.to(torch.float64)
        tolerance = 1e3 * torch.finfo(basis.dtype).eps * dim**0.5
        drift = float((u.T @ u - torch.eye(r_k, dtype=torch.float64)).abs().max()) if r_k else 0.0
        if drift > tolerance:
            raise UploadError(f"basis columns are not orthonormal (max |UᵀU − I| = {drift:.2e})")
        return {"basis": u, "sigma": sigma.to(torch.float64), "label-corr": label_corr.to(torch.float64),
                "wire-rank": r_k}

    def validate_reply(self, plan: RoundPlan, reply: Reply) -> None:
        """r_k ≤ min(r, ñ, M); ñ = labelled + accepted; correct ≤ accepted ≤ unlabelled."""
        if plan.phase != self.stats_phase:
            return
        payload, n = reply.payload, reply.num_examples
        r_k = payload["wire-rank"]
        if r_k > min(self.upload_rank(plan.task), n, self.rf_dim):
            raise UploadError(f"rank {r_k} exceeds min(r, n={n}, M)")
        counts = payload["pseudo"]
        if counts["num-labelled"] + counts["pseudo-accepted"] != n + payload["withheld"]:
            raise UploadError("num-examples differs from labelled + accepted pseudo-labelled - withheld samples")
        if not counts["pseudo-correct"] <= counts["pseudo-accepted"] <= counts["pseudo-unlabelled"]:
            raise UploadError("pseudo-label counts are inconsistent (correct <= accepted <= unlabelled)")
        try:
            payload["summary"] = LowRankSummary(payload["basis"], payload["sigma"], n)
        except LowRankError as err:
            raise UploadError(f"bad summary: {err}") from None

    def aggregate_round(self, plan: RoundPlan, replies: list[Reply]) -> None:
        if plan.phase != self.stats_phase:
            super().aggregate_round(plan, replies)
            return
        ordered = sorted(replies, key=lambda r: int(r.client.rsplit("-", 1)[1]))  # ascending client id
        upload_rank = self.upload_rank(plan.task)
        self.server_rank = max(self.server_rank, upload_rank)
        self.summary_state = merge_two_level(
            [r.payload["summary"] for r in ordered], self.summary_state, self.server_rank
        )
        classes = self.num_seen(plan.task)
        stage_corr = sum((r.payload["label-corr"] for r in ordered),
                         torch.zeros(self.rf_dim, classes, dtype=torch.float64))
        self.label_corr = pad_label_corr(self.label_corr, classes) + stage_corr
        self.num_samples += sum(r.num_examples for r in ordered)
        self.note_withheld(ordered)
        for r in ordered:
            r_k = r.payload["wire-rank"]
            self._stage["client_ranks"][r.client] = r_k
            self._stage["formula"][r.client] = (
                fedran_upload_numbers(self.rf_dim, r_k, classes) * self.bytes_per_number
            )
            for key in PSEUDO_METRICS:
                self._stage["pseudo"][key] += r.payload["pseudo"][key]

    # ---------------------------------------------------------------- solve
    def end_stage(self, task: int) -> dict[str, Any]:
        self.model.eval()  # frozen from here on, as in AnalyticStrategy
        label_corr = pad_label_corr(self.label_corr, self.num_seen(task))
        summary = self.summary_state
        extra: dict[str, Any] = {"num_samples": self.num_samples}
        gamma = self.cfg.ridge_value()
        if gamma is None:
            gamma, table = select_subspace_ridge_gcv(summary, label_corr, self.num_samples, float(self.num_samples))
            extra["gcv"] = {"grid_min": table[0].gamma, "grid_max": table[-1].gamma}
        extra["ridge"] = gamma
        self.weights = solve_subspace_ridge(summary, label_corr, gamma)
        pseudo = self._stage["pseudo"]
        extra.update(self.pop_withheld())
        extra.update({
            "rank": {"upload": self.upload_rank(task), "server": self.server_rank, "retained": summary.rank,
                     "clients": dict(sorted(self._stage["client_ranks"].items()))},
            # Tail energy cut by the server's merges (clients' local cuts are not uploaded).
            "merge_discarded_energy": {"spectral": summary.discarded.spectral, "trace": summary.discarded.trace},
            "upload_formula_bytes_per_client": dict(sorted(self._stage["formula"].items())),
            "pseudo_labels": {
                "labelled": pseudo["num-labelled"],
                "unlabelled": pseudo["pseudo-unlabelled"],
                "accepted": pseudo["pseudo-accepted"],
                "correct": pseudo["pseudo-correct"],
            },
        })
        return extra
