"""Low-rank Gram summaries and their QR-SVD merge (FedRAN, docs/methods/fedran.md §2.6–§2.7, §2.11).

A client never uploads its M×M Gram G = HᵀH. It uploads a rank-r factor (U, σ) with
G ≈ U diag(σ²) Uᵀ: M·r + r numbers instead of M². The server folds these factors together with
a QR of the stacked factors [U_a Σ_a, U_b Σ_b] and an SVD of the small triangular R, so no M×M
matrix is ever formed on either side (Algorithm 3, cost O(M r² + r³) per merge).

Every truncation discards a PSD residual. Each summary carries the running total of what was
discarded (:class:`TailEnergy`): its ``spectral`` part is the bound ε_G of Theorem 1 on
‖G* − G̃‖₂, and its ``trace`` part equals tr(G* − G̃) exactly (residuals are PSD and add up).
This bookkeeping is two scalars, not part of the paper's upload.

All numbers are float64; results keep the device of their inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from .errors import AnalyticInputError

__all__ = [
    "LowRankError",
    "LowRankSummary",
    "TailEnergy",
    "client_summary",
    "client_summary_from_gram",
    "discarded_energy",
    "merge_pair",
    "merge_summaries",
    "merge_two_level",
    "rank_for_budget",
]


class LowRankError(AnalyticInputError):
    """A low-rank summary, rank or budget argument is malformed."""


@dataclass(frozen=True)
class TailEnergy:
    """What truncations have thrown away, summed over every truncation step so far.

    ``spectral`` = Σ (largest discarded eigenvalue of each step): the Theorem 1 bound ε_G on
    ‖G* − G̃‖₂ (spectral norm). ``trace`` = Σ (all discarded eigenvalues of each step), which is
    exactly tr(G* − G̃) and bounds ‖G* − G̃‖₂ and ‖G* − G̃‖_F (Corollary 2).
    """

    spectral: float = 0.0
    trace: float = 0.0

    def __add__(self, other: TailEnergy) -> TailEnergy:
        return TailEnergy(self.spectral + other.spectral, self.trace + other.trace)


@dataclass(frozen=True, eq=False)
class LowRankSummary:
    """Gram sketch G̃ = U diag(σ²) Uᵀ of ``num_samples`` feature rows.

    ``basis`` U is (M, r) with orthonormal columns, ``singular_values`` σ is (r,), descending,
    non-negative. ``discarded`` is the bookkeeping described in the module docstring.
    No ``==``: compare the tensors (or ``gram()``) explicitly.
    """

    basis: Tensor
    singular_values: Tensor
    num_samples: int
    discarded: TailEnergy = field(default_factory=TailEnergy)

    def __post_init__(self) -> None:
        basis, sigma = self.basis, self.singular_values
        if not isinstance(basis, Tensor) or basis.ndim != 2:
            raise LowRankError("basis must be a 2-D tensor (M, r)")
        if not isinstance(sigma, Tensor) or sigma.ndim != 1:
            raise LowRankError("singular_values must be a 1-D tensor (r,)")
        if basis.dtype != torch.float64 or sigma.dtype != torch.float64:
            raise LowRankError("basis and singular_values must be float64")
        if basis.shape[1] != sigma.shape[0]:
            raise LowRankError(f"basis has {basis.shape[1]} columns but there are {sigma.shape[0]} singular values")
        if basis.shape[1] > basis.shape[0]:
            raise LowRankError(f"rank {basis.shape[1]} exceeds the feature dimension {basis.shape[0]}")
        if basis.device != sigma.device:
            raise LowRankError("basis and singular_values must be on the same device")
        if sigma.numel() and not bool(torch.isfinite(sigma).all() and (sigma >= 0).all()):
            raise LowRankError("singular_values must be finite and non-negative")
        if basis.numel() and not bool(torch.isfinite(basis).all()):
            raise LowRankError("basis must be finite")
        if isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int) or self.num_samples < 0:
            raise LowRankError(f"num_samples must be a non-negative int, got {self.num_samples!r}")

    @classmethod
    def empty(cls, dim: int, device: torch.device | str | None = None) -> LowRankSummary:
        """The rank-0 summary of no data (the server state before task 1)."""
        if not isinstance(dim, int) or dim <= 0:
            raise LowRankError(f"dim must be a positive int, got {dim!r}")
        return cls(
            basis=torch.zeros(dim, 0, dtype=torch.float64, device=device),
            singular_values=torch.zeros(0, dtype=torch.float64, device=device),
            num_samples=0,
        )

    @property
    def dim(self) -> int:
        """Feature dimension M."""
        return int(self.basis.shape[0])

    @property
    def rank(self) -> int:
        """Number of retained directions r."""
        return int(self.basis.shape[1])

    def gram(self) -> Tensor:
        """The dense sketch U diag(σ²) Uᵀ (M×M). For tests and diagnostics only."""
        scaled = self.basis * self.singular_values
        return scaled @ scaled.T

    def factor(self) -> Tensor:
        """U diag(σ), the (M, r) block that enters the stacked QR of a merge."""
        return self.basis * self.singular_values


def discarded_energy(singular_values: Tensor, rank: int) -> TailEnergy:
    """Tail energy lost by keeping the first ``rank`` of the descending ``singular_values``.

    ``spectral`` = s²_{rank+1} (0 if nothing is dropped), the per-step term of Theorem 1;
    ``trace`` = Σ_{i>rank} s_i². The singular values are those of a factor A (so A Aᵀ has
    eigenvalues s²): a client's H, or the stacked factors of one merge.
    """
    if not isinstance(singular_values, Tensor) or singular_values.ndim != 1:
        raise LowRankError("singular_values must be a 1-D tensor")
    _check_rank(rank, allow_zero=True)
    tail = singular_values[rank:].to(torch.float64)
    if tail.numel() == 0:
        return TailEnergy()
    squares = tail * tail
    return TailEnergy(spectral=float(squares[0].item()), trace=float(squares.sum().item()))


def client_summary(features: Tensor, rank: int, *, method: Literal["auto", "svd", "gram"] = "auto") -> LowRankSummary:
    """Algorithm 2 (ClientSVD): rank-r_k sketch of HᵀH with r_k = min(rank, n, M).

    ``method="auto"`` works on the smaller side: for n < M a thin SVD of H itself (O(n²M),
    exact, never forms the M×M Gram); for n ≥ M an eigendecomposition of the M×M Gram HᵀH
    (O(nM² + M³), the same order as the SVD, but the Gram can also be accumulated in batches,
    see :func:`client_summary_from_gram`). The Gram route squares the condition number: it
    resolves eigenvalues only down to ~1e-16·‖G‖, far below any useful ridge γ.
    ``"svd"`` / ``"gram"`` force one route (the two agree up to rounding).
    """
    if not isinstance(features, Tensor) or features.ndim != 2:
        raise LowRankError("features must be a 2-D tensor (n, M)")
    if not features.is_floating_point():
        raise LowRankError(f"features must be floating point, got {features.dtype}")
    _check_rank(rank)
    if method not in ("auto", "svd", "gram"):
        raise LowRankError(f"method must be 'auto', 'svd' or 'gram', got {method!r}")
    n, dim = features.shape
    if dim == 0:
        raise LowRankError("features have zero columns")
    h = features.to(torch.float64)
    if not bool(torch.isfinite(h).all()):
        raise LowRankError("features contain NaN or Inf")
    if n == 0:
        return LowRankSummary.empty(dim, device=h.device)
    if method == "gram" or (method == "auto" and n >= dim):
        return client_summary_from_gram(h.T @ h, n, rank)
    _, sigma, vh = torch.linalg.svd(h, full_matrices=False)
    keep = min(rank, n, dim)
    basis = _canonical_signs(vh[:keep].T)
    return LowRankSummary(basis, sigma[:keep].contiguous(), n, discarded_energy(sigma, keep))


def client_summary_from_gram(gram: Tensor, num_samples: int, rank: int, *, keep: int | None = None) -> LowRankSummary:
    """Same sketch as :func:`client_summary`, from an already accumulated Gram G = HᵀH.

    For clients that stream H in batches and sum HᵀH: eigendecomposition of G, eigenvalues
    clipped at 0 (rounding can make tiny ones negative), σ = √λ, r_k = min(rank, n, M).
    ``keep`` overrides r_k (capped at M) and skips the n = 0 shortcut: a *noised* Gram has full
    rank whatever n is, and its sketch must not reveal n (fcl_flower/privacy/noise.py).
    """
    if not isinstance(gram, Tensor) or gram.ndim != 2 or gram.shape[0] != gram.shape[1]:
        raise LowRankError("gram must be a square 2-D tensor (M, M)")
    if gram.shape[0] == 0:
        raise LowRankError("gram is empty")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
        raise LowRankError(f"num_samples must be a non-negative int, got {num_samples!r}")
    _check_rank(rank)
    g = gram.to(torch.float64)
    if not bool(torch.isfinite(g).all()):
        raise LowRankError("gram contains NaN or Inf")
    scale = float(g.abs().max().item()) if g.numel() else 0.0
    if float((g - g.T).abs().max().item()) > 1e-8 * max(scale, 1e-300):
        raise LowRankError("gram is not symmetric")
    dim = g.shape[0]
    if num_samples == 0 and keep is None:
        return LowRankSummary.empty(dim, device=g.device)
    eigenvalues, eigenvectors = torch.linalg.eigh(0.5 * (g + g.T))
    eigenvalues = eigenvalues.flip(0).clamp_min(0.0)
    eigenvectors = eigenvectors.flip(1)
    sigma = eigenvalues.sqrt()
    keep = min(rank, num_samples, dim) if keep is None else min(int(keep), dim)
    basis = _canonical_signs(eigenvectors[:, :keep])
    # A rank-deficient Gram has at most num_samples non-zero eigenvalues; those beyond
    # min(n, M) are rounding noise and count as discarded (they are ~0).
    return LowRankSummary(basis, sigma[:keep].contiguous(), num_samples, discarded_energy(sigma, keep))


def merge_pair(first: LowRankSummary, second: LowRankSummary, rank: int) -> LowRankSummary:
    """Algorithm 3 (MergeSVD): rank-r sketch of U_a Σ_a² U_aᵀ + U_b Σ_b² U_bᵀ.

    A = [U_a Σ_a, U_b Σ_b] = QR (reduced QR), R = U_R diag(σ̄) W_Rᵀ, keep Q U_R[:, :r] and σ̄[:r].
    A Aᵀ = Q R Rᵀ Qᵀ, so σ̄ are the singular values of A and the result is T_r(A Aᵀ), the best
    rank-r approximation (Proposition 2); exactly A Aᵀ when nothing is cut. An empty operand
    short-cuts to a plain truncation of the other one.
    """
    _check_compatible((first, second))
    _check_rank(rank)
    num_samples = first.num_samples + second.num_samples
    carried = first.discarded + second.discarded
    if first.rank == 0 or second.rank == 0:
        return _truncated(second if first.rank == 0 else first, rank, num_samples, carried)
    return _qr_svd_merge([first.factor(), second.factor()], rank, num_samples, carried)


def _truncated(only: LowRankSummary, rank: int, num_samples: int, carried: TailEnergy) -> LowRankSummary:
    """The one non-empty summary of a merge, cut to ``rank``, with what the cut discards."""
    keep = min(rank, only.rank)
    return LowRankSummary(
        only.basis[:, :keep].contiguous(),
        only.singular_values[:keep].contiguous(),
        num_samples,
        carried + discarded_energy(only.singular_values, keep),
    )


def merge_summaries(summaries: Sequence[LowRankSummary], rank: int, *, stacked: bool = False) -> LowRankSummary:
    """Spatial merge of several summaries in the order given (use ascending client id).

    Default (the paper's Algorithm 1): a left fold of :func:`merge_pair`, truncating to ``rank``
    after every step. ``stacked=True`` (optional extension, docs/methods/fedran.md §2.7 [I]): one QR-SVD of all
    blocks side by side, so at most one truncation. When nothing is truncated both give exactly
    Σ U_k Σ_k² U_kᵀ whatever the order; the factor itself is then order-invariant up to signs and
    rotations inside tied singular values. With truncation the sequential result depends on the
    order, hence the fixed order.
    """
    if len(summaries) == 0:
        raise LowRankError("merge_summaries needs at least one summary")
    _check_compatible(summaries)
    _check_rank(rank)
    if stacked:
        nonempty = [s for s in summaries if s.rank > 0]
        num_samples = sum(s.num_samples for s in summaries)
        carried = sum((s.discarded for s in summaries), TailEnergy())
        if not nonempty:
            empty = LowRankSummary.empty(summaries[0].dim, device=summaries[0].basis.device)
            return LowRankSummary(empty.basis, empty.singular_values, num_samples, carried)
        if len(nonempty) == 1:
            return _truncated(nonempty[0], rank, num_samples, carried)
        return _qr_svd_merge([s.factor() for s in nonempty], rank, num_samples, carried)
    merged = LowRankSummary.empty(summaries[0].dim, device=summaries[0].basis.device)
    for summary in summaries:
        merged = merge_pair(merged, summary, rank)
    return merged


def merge_two_level(
    per_client: Sequence[LowRankSummary],
    previous: LowRankSummary | None,
    rank: int,
    *,
    stacked: bool = False,
) -> LowRankSummary:
    """The server's per-task update (Algorithm 1, lines 14–20).

    First the spatial merge over this task's client summaries (in the given order), then the
    temporal merge MergeSVD((V_{1:t−1}, σ_{1:t−1}), (V_t, σ_t), r) with the running summary of
    tasks 1..t−1 (``None`` before task 1). A task with no client summaries leaves the running
    summary as it is.
    """
    _check_rank(rank)
    if not per_client:
        if previous is None:
            raise LowRankError("merge_two_level needs client summaries or a previous summary")
        return merge_pair(previous, LowRankSummary.empty(previous.dim, previous.basis.device), rank)
    current = merge_summaries(per_client, rank, stacked=stacked)
    if previous is None:
        return current
    return merge_pair(previous, current, rank)


def rank_for_budget(budget_bytes: int, rf_dim: int, num_classes: int, bytes_per_number: int) -> int:
    """Largest rank whose upload fits the byte budget, Eq. 12 (docs/methods/fedran.md), capped at M.

    r = ⌊(𝔅/b − M·C)/(M + 1)⌋, computed in integers as ⌊(𝔅 − b·M·C)/(b·(M + 1))⌋. Ranks above M
    cannot occur (r_k = min(r, ñ, M)), hence the cap. Raises when the budget cannot hold B
    (M·C numbers) plus at least one rank-1 component.
    """
    for name, value in (
        ("budget_bytes", budget_bytes),
        ("rf_dim", rf_dim),
        ("num_classes", num_classes),
        ("bytes_per_number", bytes_per_number),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise LowRankError(f"{name} must be an int, got {value!r}")
    if rf_dim <= 0 or bytes_per_number <= 0 or num_classes < 0 or budget_bytes < 0:
        raise LowRankError("rf_dim and bytes_per_number must be positive, budget and classes non-negative")
    label_bytes = bytes_per_number * rf_dim * num_classes
    if budget_bytes < label_bytes:
        raise LowRankError(
            f"budget of {budget_bytes} bytes cannot hold B ({rf_dim}x{num_classes} numbers = {label_bytes} bytes)"
        )
    rank = (budget_bytes - label_bytes) // (bytes_per_number * (rf_dim + 1))
    if rank < 1:
        raise LowRankError(
            f"budget of {budget_bytes} bytes holds B but not one rank-1 factor ({bytes_per_number * (rf_dim + 1)} bytes more)"
        )
    return min(rank, rf_dim)


def _qr_svd_merge(blocks: list[Tensor], rank: int, num_samples: int, carried: TailEnergy) -> LowRankSummary:
    """Rank-r sketch of A Aᵀ for A = [blocks...], via reduced QR of A and SVD of R."""
    stacked = torch.cat(blocks, dim=1)
    q, r_factor = torch.linalg.qr(stacked, mode="reduced")
    u_r, sigma, _ = torch.linalg.svd(r_factor, full_matrices=False)
    keep = min(rank, sigma.shape[0])
    basis = _canonical_signs(q @ u_r[:, :keep])
    return LowRankSummary(basis, sigma[:keep].contiguous(), num_samples, carried + discarded_energy(sigma, keep))


def _canonical_signs(basis: Tensor) -> Tensor:
    """Flip each column so its largest-magnitude entry is positive.

    Singular vectors are defined up to sign; fixing it makes the upload independent of the
    LAPACK/cuSOLVER sign convention (the Gram sketch does not depend on it either way).
    """
    if basis.numel() == 0:
        return basis.contiguous()
    pivots = basis.abs().argmax(dim=0)
    signs = torch.sign(basis.gather(0, pivots.unsqueeze(0))).squeeze(0)
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return (basis * signs).contiguous()


def _check_rank(rank: int, *, allow_zero: bool = False) -> None:
    lowest = 0 if allow_zero else 1
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < lowest:
        raise LowRankError(f"rank must be an int >= {lowest}, got {rank!r}")


def _check_compatible(summaries: Sequence[LowRankSummary]) -> None:
    for summary in summaries:
        if not isinstance(summary, LowRankSummary):
            raise LowRankError(f"expected LowRankSummary, got {type(summary).__name__}")
    dims = {s.dim for s in summaries}
    if len(dims) > 1:
        raise LowRankError(f"summaries have different feature dimensions {sorted(dims)}")
    devices = {str(s.basis.device) for s in summaries}
    if len(devices) > 1:
        raise LowRankError(f"summaries live on different devices {sorted(devices)}")
