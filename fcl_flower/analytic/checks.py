"""Is an upload of statistics consistent with *some* dataset? Checks the server runs before adding.

A client's STSA upload is G = ΦᵀΦ, C = ΦᵀY and the class counts n_c = (YᵀY)_cc of its n samples.
Whatever the data, these three are blocks of one Gram matrix,

    J = [Φ Y]ᵀ[Φ Y] = [[G, C], [Cᵀ, diag(n_c)]],

which is symmetric positive semidefinite. So the server checks, on every upload (and, under
secure aggregation, on the opened sum, which is again such a Gram):

* counts are finite non-negative integers adding up to the reported number of samples;
* every entry is finite and at most :data:`MAGNITUDE_LIMIT` in absolute value, so the float64
  running sum over any realistic number of uploads, and the solve's products, cannot overflow;
* with random ReLU features (``nonnegative``), G and C have no negative entry;
* the diagonal of J is non-negative, every entry obeys Cauchy–Schwarz |J_ij| ≤ √(J_ii J_jj),
  and J is positive semidefinite within the tolerance below (a Cholesky factorisation of the
  diagonally scaled J plus the tolerance on its diagonal must exist);
* with a feature norm bound B > 0 (clients clip ‖φ_i‖ ≤ B): tr G ≤ n B² and ‖C_c‖ ≤ n_c B.

Tolerance. Uploads are rounded to the wire dtype (relative error ε: 2⁻²⁴ for float32, 2⁻⁵³ for
float64) and, under secure aggregation, to fixed point (absolute error δ per entry, summed over
the participants). An absolute error E moves the eigenvalues of J by at most ‖E‖_F ≤ (M + c) δ,
so the check first adds ``4 (M + c) δ`` to the diagonal of J; a relative error moves those of the
scaled R = D^{-1/2} J D^{-1/2} (unit diagonal) by at most (M + c) ε, so it then adds
``4 (M + c) ε`` to the diagonal of R. A matrix whose smallest eigenvalue is above minus
that tolerance passes: the check catches every upload that no dataset can produce up to
rounding, not a plausible but false dataset (docs/privacy.md lists what it cannot catch).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MAGNITUDE_LIMIT = 1e150  # entries beyond this could overflow float64 in sums of squares (1e300 < 1.8e308)


class StatisticsRejected(ValueError):
    """Statistics that no dataset can produce (one line naming the violated property)."""


def check_counts(counts: Tensor, num_samples: int) -> None:
    """Finite non-negative integers adding up to ``num_samples``."""
    if not bool(torch.isfinite(counts).all()):
        raise StatisticsRejected("counts are not finite")
    if bool((counts < 0).any()):
        raise StatisticsRejected("counts has negative entries")
    if not torch.equal(counts, counts.round()):
        raise StatisticsRejected("counts has non-integer entries")
    total = float(counts.sum())
    if total != float(num_samples):
        raise StatisticsRejected(f"counts add up to {total:g}, the upload says {num_samples} samples")


def check_magnitude(name: str, tensor: Tensor, limit: float = MAGNITUDE_LIMIT) -> None:
    if not bool(torch.isfinite(tensor).all()):
        raise StatisticsRejected(f"{name} contains NaN or inf")
    peak = float(tensor.abs().max()) if tensor.numel() else 0.0
    if peak > limit:
        raise StatisticsRejected(f"{name} has an entry of magnitude {peak:.3g} > {limit:g}")


def wire_epsilon(dtype: torch.dtype) -> float:
    """Relative rounding of the wire dtype (half an ulp)."""
    return float(torch.finfo(dtype).eps) / 2.0


def check_gram_statistics(
    gram: Tensor,
    class_sums: Tensor,
    counts: Tensor,
    *,
    relative_tolerance: float,
    absolute_tolerance: float = 0.0,
    norm_bound: float = 0.0,
    nonnegative: bool = False,
) -> None:
    """Raise StatisticsRejected unless (G, C, n_c) are the blocks of a PSD Gram (see module doc).

    ``relative_tolerance`` ε and ``absolute_tolerance`` δ are per-entry rounding errors; the
    scaled PSD test allows eigenvalues down to ``-4 (M + c) (ε + δ / d_min)``.
    """
    dim, classes = int(gram.shape[0]), int(class_sums.shape[1])
    if (
        tuple(gram.shape) != (dim, dim)
        or tuple(class_sums.shape) != (dim, classes)
        or tuple(counts.shape) != (classes,)
    ):
        raise StatisticsRejected(
            f"shapes G {tuple(gram.shape)}, C {tuple(class_sums.shape)}, "
            f"counts {tuple(counts.shape)} do not fit together"
        )
    g, c, n = gram.to(torch.float64), class_sums.to(torch.float64), counts.to(torch.float64)
    for name, tensor in (("G", g), ("class sums", c), ("counts", n)):
        check_magnitude(name, tensor)
    if nonnegative:
        floor = -absolute_tolerance
        if bool((g < floor).any()) or bool((c < floor).any()):
            raise StatisticsRejected("G or the class sums have negative entries (random ReLU features are >= 0)")
    size = dim + classes
    slack_rel = 4.0 * size * relative_tolerance
    slack_abs = 4.0 * size * absolute_tolerance
    joint = torch.zeros(size, size, dtype=torch.float64)
    joint[:dim, :dim] = 0.5 * (g + g.T)
    joint[:dim, dim:] = c
    joint[dim:, :dim] = c.T
    joint[dim:, dim:] = torch.diag(n)
    diag = torch.diagonal(joint).clone()
    if bool((diag < -slack_abs).any()):
        raise StatisticsRejected("G has a negative diagonal entry (a sum of squares)")
    if norm_bound > 0:
        bound = norm_bound * norm_bound * (1.0 + slack_rel)
        if float(torch.diagonal(g).sum()) > float(n.sum()) * bound + slack_abs * dim:
            raise StatisticsRejected(f"trace(G) exceeds n·B² for the feature norm bound B = {norm_bound:g}")
        sums = torch.linalg.vector_norm(c, dim=0)
        if bool((sums > n * norm_bound * (1.0 + slack_rel) + math.sqrt(dim) * absolute_tolerance).any()):
            raise StatisticsRejected(f"a class sum is longer than n_c·B for B = {norm_bound:g}")
    joint.diagonal().add_(slack_abs)  # absolute rounding δ per entry: ‖E‖₂ ≤ ‖E‖_F ≤ (M + c) δ
    scale = torch.diagonal(joint).clamp_min(0.0)
    empty = scale <= 0
    if bool(empty.any()):  # a zero diagonal forces its whole row and column to zero
        if bool(joint[empty].abs().max() > 0):
            raise StatisticsRejected("a feature or class with zero energy has non-zero sums")
        keep = ~empty
        joint, scale = joint[keep][:, keep], scale[keep]
    inv = scale.rsqrt()
    scaled = joint * inv.unsqueeze(0) * inv.unsqueeze(1)
    if bool((scaled.abs() > 1.0 + slack_rel + 1e-12).any()):
        raise StatisticsRejected(
            "an entry breaks Cauchy-Schwarz |J_ij| <= sqrt(J_ii J_jj): class sums too large for G and the counts"
        )
    scaled.diagonal().add_(slack_rel)
    _, info = torch.linalg.cholesky_ex(scaled)
    if int(info) != 0:
        raise StatisticsRejected(
            "[[G, C], [Cᵀ, diag(counts)]] is not positive semidefinite: no dataset has these statistics"
        )


def check_class_sums(
    class_sums: Tensor,
    counts: Tensor,
    *,
    relative_tolerance: float,
    norm_bound: float = 0.0,
    nonnegative: bool = False,
) -> None:
    """STSA-E: class sums s_c = Σ_{i: y_i = c} φ_i (shape (..., M, c)) of counts n_c (shape (..., c)).

    A cell with no sample has a zero sum; with ReLU features no entry is negative; with a
    feature norm bound B every ‖s_c‖ ≤ n_c B (triangle inequality). Without a bound, any
    finite sums of non-empty cells are possible: docs/privacy.md says what that leaves open.
    """
    if tuple(class_sums.shape[:-2]) + tuple(class_sums.shape[-1:]) != tuple(counts.shape):
        raise StatisticsRejected(
            f"class sums {tuple(class_sums.shape)} and counts {tuple(counts.shape)} do not fit together"
        )
    sums, n = class_sums.to(torch.float64), counts.to(torch.float64)
    check_magnitude("class sums", sums)
    if nonnegative and bool((sums < 0).any()):
        raise StatisticsRejected("class sums have negative entries (random ReLU features are >= 0)")
    lengths = torch.linalg.vector_norm(sums, dim=-2)
    if bool(((n == 0) & (lengths > 0)).any()):
        raise StatisticsRejected("a class with no sample has a non-zero sum")
    if norm_bound > 0:
        slack = 4.0 * sums.shape[-2] * relative_tolerance
        if bool((lengths > n * norm_bound * (1.0 + slack)).any()):
            raise StatisticsRejected(f"a class sum is longer than n_c·B for B = {norm_bound:g}")


def check_lowrank_statistics(
    singular_values: Tensor,
    label_corr: Tensor,
    num_samples: int,
    *,
    relative_tolerance: float,
    norm_bound: float = 0.0,
    nonnegative: bool = False,
) -> None:
    """FedRAN: the top singular values σ of H (n × M) and B = HᵀY, Y one-hot (‖Y‖_F² = n).

    ‖B‖_F = ‖HᵀY‖_F ≤ ‖H‖₂ ‖Y‖_F = σ₁ √n (σ₁ is kept by every rank-r ≥ 1 sketch, and is 0 when
    nothing is kept); with ReLU features B ≥ 0; with a feature norm bound B_φ:
    Σσ² ≤ ‖H‖_F² ≤ n B_φ² and ‖B‖_F ≤ Σ_c ‖B_c‖ ≤ n B_φ.
    """
    sigma, corr = singular_values.to(torch.float64), label_corr.to(torch.float64)
    check_magnitude("singular values", sigma)
    check_magnitude("label correlations", corr)
    if nonnegative and bool((corr < 0).any()):
        raise StatisticsRejected("B = HᵀY has negative entries (random ReLU features are >= 0)")
    slack = 1.0 + 4.0 * (corr.shape[0] + corr.shape[1]) * relative_tolerance
    top = float(sigma.max()) if sigma.numel() else 0.0
    length = float(torch.linalg.vector_norm(corr))
    if length > top * math.sqrt(num_samples) * slack:
        raise StatisticsRejected(
            f"‖B‖_F = {length:.4g} exceeds σ₁·√n = {top * math.sqrt(num_samples):.4g}: B is not HᵀY for this H"
        )
    if norm_bound > 0:
        if float((sigma * sigma).sum()) > num_samples * norm_bound * norm_bound * slack:
            raise StatisticsRejected(f"Σσ² exceeds n·B² for the feature norm bound B = {norm_bound:g}")
        if length > num_samples * norm_bound * slack:
            raise StatisticsRejected(f"‖B‖_F exceeds n·B for the feature norm bound B = {norm_bound:g}")
