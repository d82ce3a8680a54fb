"""Closed-form FedRAN classifier in the retained subspace (docs/methods/fedran.md §2.8, Eqs. 25–29; Theorem 2).

The server keeps only the sketch G̃ = U diag(σ²) Uᵀ and the exact label statistic B = Σ_k H_kᵀ Y_k.
Restricting the ridge weights to span(U), W = U W̃, turns the normal equations into a diagonal
system, Uᵀ G̃ U = diag(σ²):

    W̃ = (diag(σ²) + γ I_r)⁻¹ Uᵀ B,        W = U W̃.

No M×M matrix, no factorisation: O(M r C). The part of B outside span(U), (I − UUᵀ)B, is
dropped (its weights are set to zero), unlike the full sketched ridge (G̃ + γI)⁻¹B, which would
scale it by 1/γ (Eq. 73). When nothing was ever truncated U spans the row space of all features,
B lies in span(U), and W equals the centralised ridge (G* + γI)⁻¹ B exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .lowrank import LowRankError, LowRankSummary
from .ridge import GCVRow, gcv_from_spectrum

__all__ = [
    "outside_subspace_norm",
    "pad_label_corr",
    "select_subspace_ridge_gcv",
    "solve_subspace_ridge",
    "subspace_coefficients",
    "weight_error_bound",
]


def pad_label_corr(label_corr: Tensor, num_classes: int) -> Tensor:
    """Zero-pad B (M × C_old) with new class columns to width ``num_classes`` (float64).

    Old samples carry a 0 in every new class column of Y, so their contribution to the new
    columns of B = HᵀY is exactly zero; padding is therefore exact, not an approximation.
    """
    _check_label_corr(label_corr)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int):
        raise LowRankError(f"num_classes must be an int, got {num_classes!r}")
    width = label_corr.shape[1]
    if num_classes < width:
        raise LowRankError(f"cannot pad B of width {width} down to {num_classes} classes")
    padded = label_corr.new_zeros((label_corr.shape[0], num_classes), dtype=torch.float64)
    padded[:, :width] = label_corr
    return padded


def subspace_coefficients(summary: LowRankSummary, label_corr: Tensor, ridge: float) -> Tensor:
    """W̃ = (diag(σ²) + γI)⁻¹ UᵀB, shape (r, C): row i is (UᵀB)_i / (σ_i² + γ).

    Inference can use s = (h U) W̃, which is cheaper than forming W when C > r.
    """
    if not isinstance(summary, LowRankSummary):
        raise LowRankError(f"expected LowRankSummary, got {type(summary).__name__}")
    _check_label_corr(label_corr)
    if label_corr.shape[0] != summary.dim:
        raise LowRankError(f"B has {label_corr.shape[0]} rows but the summary has dimension {summary.dim}")
    ridge = float(ridge)
    if not ridge >= 0.0 or ridge == float("inf"):
        raise LowRankError(f"ridge must be finite and >= 0, got {ridge!r}")
    denominators = summary.singular_values.square() + ridge
    if denominators.numel() and not bool((denominators > 0).all()):
        raise LowRankError("sigma_i^2 + ridge is zero for some direction; use a positive ridge")
    projected = summary.basis.T @ label_corr.to(torch.float64)
    return projected / denominators.unsqueeze(1)


def solve_subspace_ridge(summary: LowRankSummary, label_corr: Tensor, ridge: float) -> Tensor:
    """W = U (diag(σ²) + γI)⁻¹ Uᵀ B, shape (M, C); zero on the orthogonal complement of U."""
    return summary.basis @ subspace_coefficients(summary, label_corr, ridge)


def select_subspace_ridge_gcv(
    summary: LowRankSummary,
    label_corr: Tensor,
    num_samples: int,
    yty: float,
    grid: Sequence[float] | Tensor | None = None,
    sums_noise: float = 0.0,
) -> tuple[float, list[GCVRow]]:
    """γ for :func:`solve_subspace_ridge` by generalised cross-validation, from the summary alone.

    ``sums_noise``: Σ_c of the noise variance per entry of B's column c; q_i is debiased by it
    (fcl_flower/analytic/ridge.py ``solve_ridge_psd``).

    The sketch is already diagonal in U (eigenvalues σ²), so with q_i = ‖(UᵀB)_i‖² the residual of
    W = U W̃ is RSS(γ) = tr(YᵀY) − Σ_i q_i (σ_i² + 2γ)/(σ_i² + γ)² and df(γ) = Σ_i σ_i²/(σ_i² + γ),
    summed over the retained directions only (the complement carries zero weights). This is the
    dense GCV of STSA with G* replaced by the sketch G̃, so without truncation both pick the same
    γ. For one-hot labels tr(YᵀY) = n. O(M r C), no M×M matrix.
    """
    if not isinstance(summary, LowRankSummary):
        raise LowRankError(f"expected LowRankSummary, got {type(summary).__name__}")
    _check_label_corr(label_corr)
    if label_corr.shape[0] != summary.dim:
        raise LowRankError(f"B has {label_corr.shape[0]} rows but the summary has dimension {summary.dim}")
    projected = summary.basis.T @ label_corr.to(device=summary.basis.device, dtype=torch.float64)
    q = (projected * projected).sum(dim=1)
    if sums_noise:
        q = (q - float(sums_noise)).clamp_min(0.0)
    return gcv_from_spectrum(summary.singular_values.square(), q, num_samples, yty, grid)


def outside_subspace_norm(summary: LowRankSummary, label_corr: Tensor) -> float:
    """‖(I − UUᵀ)B‖_F: the label statistic the subspace solve ignores (Theorem 2, 2nd term)."""
    _check_label_corr(label_corr)
    if label_corr.shape[0] != summary.dim:
        raise LowRankError(f"B has {label_corr.shape[0]} rows but the summary has dimension {summary.dim}")
    b = label_corr.to(torch.float64)
    residual = b - summary.basis @ (summary.basis.T @ b)
    return float(torch.linalg.matrix_norm(residual).item())


def weight_error_bound(summary: LowRankSummary, label_corr: Tensor, ridge: float) -> float:
    """Theorem 2: ‖W* − W‖_F ≤ (ε_G/γ²)‖B‖_F + (1/γ)‖(I − UUᵀ)B‖_F, with ε_G from the summary.

    W* is the centralised ridge on the exact Gram; ε_G is ``summary.discarded.spectral``.
    """
    ridge = float(ridge)
    if not ridge > 0.0 or ridge == float("inf"):
        raise LowRankError(f"ridge must be finite and > 0 for the bound, got {ridge!r}")
    b_norm = float(torch.linalg.matrix_norm(label_corr.to(torch.float64)).item())
    eps_g = summary.discarded.spectral
    return eps_g / ridge**2 * b_norm + outside_subspace_norm(summary, label_corr) / ridge


def _check_label_corr(label_corr: Tensor) -> None:
    if not isinstance(label_corr, Tensor) or label_corr.ndim != 2:
        raise LowRankError("label correlation B must be a 2-D tensor (M, C)")
    if not label_corr.is_floating_point():
        raise LowRankError(f"label correlation B must be floating point, got {label_corr.dtype}")
