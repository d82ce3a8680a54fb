"""Is an upload of statistics consistent with *some* dataset? Checks the server runs before adding.

A client's STSA upload is G = ΦᵀΦ, C = ΦᵀY and the class counts n_c = (YᵀY)_cc of its n samples.
Whatever the data, these three are blocks of one Gram matrix,

    J = [Φ Y]ᵀ[Φ Y] = [[G, C], [Cᵀ, diag(n_c)]],

which is symmetric positive semidefinite. So the server checks the following: every test but
the factorisation on every upload, at O((M + c)²) (:func:`screen_packed_statistics`), and the
whole list once per stage on the sum the solve uses (:func:`check_packed_statistics`; the sum of
the stage's plain uploads, or the opened secure sum: each is again such a Gram):

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

Noise (the paper's q·N(0, s²) or differential privacy's Gaussian mechanism, fcl_flower/privacy/
noise.py). A noised upload is a Gram of some dataset *plus* i.i.d. Gaussian noise of a known std
per block (:class:`NoiseLevels`), so every check is widened by a bound that Gaussian noise of that
std exceeds with probability below :data:`FALSE_REJECTION` (split over the checks), and nothing
else is dropped: shapes, finiteness, magnitude and the noise-free blocks keep their exact checks.

* entries (ReLU sign, counts ≥ 0): max of N i.i.d. |N(0, σ²)| ≤ σ·√(2 ln(2N/p));
* norms (‖C_c‖, the trace, a sum of counts): ‖N(0, σ² I_d)‖ ≤ σ(√d + √(2 ln(1/p))) (Gaussian
  concentration of a 1-Lipschitz function);
* the spectrum of the noise on J (symmetric, i.i.d. on and above the diagonal, std σ_G on the G
  block, σ_C on the C block, σ_n on the count diagonal): by the matrix Gaussian series bound
  (Tropp 2012, Thm 4.1.1), ‖E‖₂ ≤ √(2 v ln(2(M + c)/p)), v = max(σ_G² M + σ_C² c, σ_C² M + σ_n²).
  J + E + ‖E‖ I is then PSD, so the PSD test (and with it Cauchy–Schwarz) runs on J + τ I;
* counts are no longer integers adding up to the reported number of samples (a noised upload
  reports none); they must be finite and above −bound.

Float32 first (float32 uploads). The PSD test is one Cholesky factorisation of the (M + c)² scaled
matrix per stage (once per upload before issue 30), the server's largest cost after the solve. For uploads rounded to float32 (ε = 2⁻²⁴,
slack s = 4 (M + c) ε) it first factorises R + (s/2)·I in float32, at half the time and memory:

* if that factorisation fails, the float64 test of R + s·I decides, exactly as before: a float32
  failure never rejects an upload;
* if it succeeds, R + (s/2)·I + E = L̂L̂ᵀ ⪰ 0 for the float32 rounding E of forming R and of the
  factorisation, so λ_min(R) ≥ −s/2 − ‖E‖₂: the upload passes the float64 test too whenever
  ‖E‖₂ ≤ s/2 = 2 (M + c) 2⁻²⁴. Since ‖R‖₂ ≤ tr R = M + c, that holds whenever the factorisation's
  normwise backward error stays below 2⁻²³ ‖R‖₂: the usual behaviour of Cholesky (errors of a few
  units of roundoff times ‖R‖₂; honest uploads pass it in tests/test_upload_checks.py),
  though the worst-case bound is (M + c) times larger. So an upload that the float64 test rejects
  can be accepted only if its smallest eigenvalue lies within the float32 rounding of the
  threshold: the checks catch the same impossible statistics (tests/test_upload_checks.py plays
  every attack through both paths).

Float64 uploads. The server's ``check-tolerance`` (:func:`gram_check_epsilon`) decides their ε.
``float32`` (the default): ε = 2⁻²⁴ whatever the wire dtype, so a float64 upload is held to the
threshold a float32 one is and goes float32-first as above, in about two thirds of the time of the
float64 test (a factorisation that alone costs about one solve of the same size: issue 16's
"per-reply handling below the solve"). What that lets through is what a float32 upload may carry
anyway: a scaled spectrum down to −4(M + c)·2⁻²⁴, rounding or an adversary inside it; the solve
copes with such a G (ridge.py: the GCV floor, and a γ used only where λ_min(G) ≥ −γ/2 is
certified, by :func:`negative_bound` summed over the uploads or by a factorisation; docs/privacy.md §3).
``wire``: ε = 2⁻⁵³, tested in float64 only (a slack far below what float32 can resolve). Opened
secure sums are always tested in float64. J is never formed in full: its scaled upper triangle is
built from the packed upload one block of rows at a time into one buffer, factorised in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fcl_flower.limits import MAGNITUDE_LIMIT  # entries beyond it could overflow float64 sums of squares

from .factor import factor_gram, factor_max_rows, factor_packed_gram
from .packing import diagonal_of_packed, pack_upper, row_offset, unpack_rows

FALSE_REJECTION = 1e-9  # chance that the noise alone makes an honest upload fail a check (all checks together)
_PER_BOUND = FALSE_REJECTION / 10  # fewer than ten bounds are used on one upload


@dataclass(frozen=True)
class NoiseLevels:
    """Std of the i.i.d. Gaussian noise on every entry of the checked statistics (0: exact)."""

    gram: float = 0.0
    sums: float = 0.0
    counts: float = 0.0

    @property
    def on(self) -> bool:
        return self.gram > 0 or self.sums > 0 or self.counts > 0


def noise_entry_bound(std: float, entries: int, p: float = _PER_BOUND) -> float:
    """A bound on the largest |noise| of ``entries`` i.i.d. N(0, std²), exceeded with probability ≤ p."""
    if std <= 0 or entries <= 0:
        return 0.0
    return std * math.sqrt(2.0 * math.log(2.0 * entries / p))


def noise_norm_bound(std: float, dim: int, p: float = _PER_BOUND) -> float:
    """A bound on ‖N(0, std² I_dim)‖, exceeded with probability ≤ p."""
    if std <= 0 or dim <= 0:
        return 0.0
    return std * (math.sqrt(dim) + math.sqrt(2.0 * math.log(1.0 / p)))


def noise_spectral_bound(noise: NoiseLevels, dim: int, classes: int, p: float = _PER_BOUND) -> float:
    """A bound on ‖E‖₂ for the noise E on J = [[G, C], [Cᵀ, diag n]] (module doc), exceeded with probability ≤ p."""
    variance = max(noise.gram**2 * dim + noise.sums**2 * classes, noise.sums**2 * dim + noise.counts**2)
    if variance <= 0:
        return 0.0
    return math.sqrt(2.0 * variance * math.log(2.0 * (dim + classes) / p))


class StatisticsRejected(ValueError):
    """Statistics that no dataset can produce (one line naming the violated property)."""


def check_counts(counts: Tensor, num_samples: int, *, noise: float = 0.0) -> None:
    """Finite non-negative integers adding up to ``num_samples``; with noise of std ``noise`` on
    every count: finite and above minus the noise's bound (nothing else is known)."""
    if noise > 0:
        check_magnitude("counts", counts)
        floor = -noise_entry_bound(noise, counts.numel())
        if bool((counts.to(torch.float64) < floor).any()):
            raise StatisticsRejected(f"counts below {floor:.4g}, beyond what noise of std {noise:g} gives")
        return
    if not bool(torch.isfinite(counts).all()):
        raise StatisticsRejected("counts are not finite")
    if bool((counts < 0).any()):
        raise StatisticsRejected("counts has negative entries")
    if not torch.equal(counts, counts.round()):
        raise StatisticsRejected("counts has non-integer entries")
    total = float(counts.sum())
    if total != float(num_samples):
        raise StatisticsRejected(f"counts add up to {total:g}, the upload says {num_samples} samples")


def noise_sum_bound(std: float, terms: int, p: float = _PER_BOUND) -> float:
    """A bound on |sum of ``terms`` i.i.d. N(0, std²)| (e.g. the noise on a trace), exceeded with probability ≤ p."""
    return noise_entry_bound(std * math.sqrt(terms), 1, p) if terms > 0 else 0.0


def noise_column_bound(std: float, dim: int, columns: int) -> float:
    """A bound on the norm of each of ``columns`` noise vectors N(0, std² I_dim) (union over the columns)."""
    return noise_norm_bound(std, dim, _PER_BOUND / max(columns, 1))


def check_magnitude(name: str, tensor: Tensor, limit: float = MAGNITUDE_LIMIT) -> float:
    """Finite and at most ``limit`` in absolute value (one pass, no temporary: NaN propagates
    into both the minimum and the maximum); returns the smallest entry (0 for an empty tensor)."""
    if not tensor.numel():
        return 0.0
    low, high = (float(v) for v in torch.aminmax(tensor))
    return _magnitude_verdict(name, low, high, limit)


def _magnitude_verdict(name: str, low: float, high: float, limit: float = MAGNITUDE_LIMIT) -> float:
    """:func:`check_magnitude`'s decision from the extremes ``low`` and ``high`` (NaN in either
    stands for a NaN entry); returns ``low``."""
    if not (math.isfinite(low) and math.isfinite(high)):
        raise StatisticsRejected(f"{name} contains NaN or inf")
    peak = max(-low, high)
    if peak > limit:
        raise StatisticsRejected(f"{name} has an entry of magnitude {peak:.3g} > {limit:g}")
    return low


def wire_epsilon(dtype: torch.dtype) -> float:
    """Relative rounding of the wire dtype (half an ulp)."""
    return float(torch.finfo(dtype).eps) / 2.0


def gram_check_epsilon(dtype: torch.dtype, tolerance: str = "float32") -> float:
    """The relative rounding ε a Gram upload in ``dtype`` is checked with: the wire dtype's own
    (``tolerance`` "wire"), or at least float32's ("float32", the default): a float64 upload is
    then held to the float32 threshold and its PSD test runs float32-first ("Float32 first")."""
    if tolerance not in ("float32", "wire"):
        raise ValueError(f"check tolerance must be 'float32' or 'wire', got {tolerance!r}")
    epsilon = wire_epsilon(dtype)
    return epsilon if tolerance == "wire" else max(epsilon, FLOAT32_EPSILON)


def check_gram_statistics(
    gram: Tensor,
    class_sums: Tensor,
    counts: Tensor,
    *,
    relative_tolerance: float,
    absolute_tolerance: float = 0.0,
    norm_bound: float = 0.0,
    nonnegative: bool = False,
    noise: NoiseLevels | None = None,
) -> float:
    """Raise StatisticsRejected unless (G, C, n_c) are the blocks of a PSD Gram (see module doc);
    return what that certifies of G's spectrum (:func:`negative_bound`).

    ``relative_tolerance`` ε and ``absolute_tolerance`` δ are per-entry rounding errors; the
    scaled PSD test allows eigenvalues down to ``-4 (M + c) (ε + δ / d_min)``. ``noise``: the std
    of the Gaussian noise on G, C and the counts; every test is widened by its bound. G is a full
    matrix here (symmetrised first); the server checks uploads in their packed form with
    :func:`check_packed_statistics`.
    """
    dim, classes = int(gram.shape[0]), int(class_sums.shape[1]) if class_sums.dim() == 2 else -1
    if (
        tuple(gram.shape) != (dim, dim)
        or tuple(class_sums.shape) != (dim, classes)
        or tuple(counts.shape) != (classes,)
    ):
        raise StatisticsRejected(
            f"shapes G {tuple(gram.shape)}, C {tuple(class_sums.shape)}, "
            f"counts {tuple(counts.shape)} do not fit together"
        )
    g = gram.to(torch.float64)
    check_magnitude("G", g)  # the matrix as given: symmetrising could halve an entry beyond the limit
    return check_packed_statistics(
        pack_upper(0.5 * (g + g.T)),
        class_sums,
        counts,
        relative_tolerance=relative_tolerance,
        absolute_tolerance=absolute_tolerance,
        norm_bound=norm_bound,
        nonnegative=nonnegative,
        noise=noise,
    )


def check_packed_statistics(
    gram_packed: Tensor,
    class_sums: Tensor,
    counts: Tensor,
    *,
    relative_tolerance: float,
    absolute_tolerance: float = 0.0,
    norm_bound: float = 0.0,
    nonnegative: bool = False,
    noise: NoiseLevels | None = None,
    fast: bool = True,
) -> float:
    """:func:`check_gram_statistics` on the packed upper triangle of G, as uploaded; returns what
    the check certifies of G's spectrum, β with λ_min(G) ≥ −β (:func:`negative_bound`).

    Lean: J is never formed in full. Its scaled upper triangle is built one block of rows at a
    time (checking Cauchy–Schwarz on the way) into one (M + c)² buffer that is factorised in
    place. ``fast`` (a tolerance of float32's ε or coarser, no absolute one): a float32
    factorisation with half the slack decides first (see the module doc, "Float32 first"); when it
    fails, the float64 test decides as before.
    ``noise``: as in :func:`check_gram_statistics` (the PSD test runs on J + τ I, τ the spectral
    bound of the noise, added to the diagonal with the absolute slack).
    """
    scaled = _screen(
        gram_packed,
        class_sums,
        counts,
        relative_tolerance=relative_tolerance,
        absolute_tolerance=absolute_tolerance,
        norm_bound=norm_bound,
        nonnegative=nonnegative,
        noise=noise or NoiseLevels(),
    )
    c, n, inv, empty, shift, slack_rel = scaled.c, scaled.n, scaled.inv, scaled.empty, scaled.shift, scaled.slack_rel
    float32_first = fast and relative_tolerance >= FLOAT32_EPSILON and absolute_tolerance == 0.0
    if float32_first and _positive_factor(
        gram_packed, c, n, inv, empty, shift, slack_rel, 0.5 * slack_rel, torch.float32
    ):
        return scaled.certified
    if not _positive_factor(gram_packed, c, n, inv, empty, shift, slack_rel, slack_rel, torch.float64):
        raise StatisticsRejected(NOT_PSD)
    return scaled.certified


NOT_PSD = "[[G, C], [Cᵀ, diag(counts)]] is not positive semidefinite: no dataset has these statistics"


def screen_packed_statistics(
    gram_packed: Tensor,
    class_sums: Tensor,
    counts: Tensor,
    *,
    relative_tolerance: float,
    absolute_tolerance: float = 0.0,
    norm_bound: float = 0.0,
    nonnegative: bool = False,
    noise: NoiseLevels | None = None,
) -> None:
    """Every test of :func:`check_packed_statistics` but the factorisation, at O((M + c)²): the
    cost of adding the upload, not of factorising it (issue 30).

    Shapes, finiteness and magnitude, the ReLU sign, counts, a non-negative diagonal of J, the
    feature norm bound, zero energy, and Cauchy–Schwarz |J_ij| ≤ (1 + 4(M + c)ε)·√(J_ii J_jj) on
    every entry (C against diag(G) and the counts included). These are necessary conditions of
    positive semidefiniteness, not sufficient ones: what they still allow is bounded, since with
    them ‖J‖_F ≤ tr J, so λ_min(J) ≥ −tr J (what one client can take away from a sum is at most the
    trace it declares, ≤ n B² + n with a norm bound B). The PSD test itself runs once per stage on
    the sum that the solve uses (:func:`check_packed_statistics` on the sum; strategies/stsa.py
    bisects a failing sum to its culprits). No randomised PSD test is used: a random probe v finds
    vᵀJv < 0 with a probability that a single small negative eigenvalue can make arbitrarily
    small, so none comes with an error probability worth stating.
    """
    scaled = _screen(
        gram_packed,
        class_sums,
        counts,
        relative_tolerance=relative_tolerance,
        absolute_tolerance=absolute_tolerance,
        norm_bound=norm_bound,
        nonnegative=nonnegative,
        noise=noise or NoiseLevels(),
        zero_energy=False,
    )
    _check_cauchy_schwarz(gram_packed, scaled.c, scaled.inv, scaled.slack_rel, scaled.empty, scaled.floor_g)


@dataclass(frozen=True)
class _Scaled:
    """What the screen computed that the PSD test reuses: J's scaling and slacks."""

    c: Tensor  # class sums, float64
    n: Tensor  # counts, float64
    inv: Tensor  # D^{-1/2} (0 where the lifted diagonal is 0)
    empty: Tensor  # rows and columns of zero energy
    shift: float  # absolute slack plus the noise's spectral bound, added to J's diagonal
    slack_rel: float  # 4 (M + c) ε
    certified: float  # what a passing PSD test certifies of G (negative_bound)
    floor_g: float | None = None  # the screen's: G's lowest entry allowed, tested in its Cauchy–Schwarz pass


def _screen(
    gram_packed: Tensor,
    class_sums: Tensor,
    counts: Tensor,
    *,
    relative_tolerance: float,
    absolute_tolerance: float,
    norm_bound: float,
    nonnegative: bool,
    noise: NoiseLevels,
    zero_energy: bool = True,
) -> _Scaled:
    """The O((M + c)²) tests shared by :func:`check_packed_statistics` and
    :func:`screen_packed_statistics` (all but Cauchy–Schwarz, which the PSD test checks while it
    builds J, and the factorisation). ``zero_energy=False``: G's part of the zero-energy test is
    left to the caller (the screen's Cauchy–Schwarz pass does it on the way)."""
    dim, classes = (int(class_sums.shape[0]), int(class_sums.shape[1])) if class_sums.dim() == 2 else (-1, -1)
    if (
        gram_packed.dim() != 1
        or dim < 0
        or gram_packed.numel() != dim * (dim + 1) // 2
        or tuple(counts.shape) != (classes,)
    ):
        raise StatisticsRejected(
            f"shapes G packed {tuple(gram_packed.shape)}, C {tuple(class_sums.shape)}, "
            f"counts {tuple(counts.shape)} do not fit together"
        )
    c, n = class_sums.to(torch.float64), counts.to(torch.float64)
    # the screen (zero_energy False) tests G's entries in its Cauchy–Schwarz pass, one read of the
    # upload for both; here only its diagonal, which the tests below use
    whole = gram_packed if zero_energy else diagonal_of_packed(gram_packed, dim)
    low_g, low_c, _ = (check_magnitude(name, t) for name, t in (("G", whole), ("class sums", c), ("counts", n)))
    floor_g = -math.inf
    if nonnegative:
        floor_g = -absolute_tolerance - noise_entry_bound(noise.gram, dim * (dim + 1) // 2)
        floor_c = -absolute_tolerance - noise_entry_bound(noise.sums, dim * classes)
        if low_g < floor_g or low_c < floor_c:
            raise StatisticsRejected(NEGATIVE_ENTRIES)
    size = dim + classes
    slack_rel = 4.0 * size * relative_tolerance
    slack_abs = 4.0 * size * absolute_tolerance
    spectral = noise_spectral_bound(noise, dim, classes)
    diag = torch.cat([diagonal_of_packed(gram_packed, dim).to(torch.float64), n])
    if bool((diag < -(slack_abs + spectral)).any()):
        raise StatisticsRejected("G has a negative diagonal entry (a sum of squares)")
    if norm_bound > 0:
        _check_norm_bound(diag[:dim], c, n, norm_bound, slack_rel, slack_abs, absolute_tolerance, noise)
    # absolute rounding δ per entry: ‖E‖₂ ≤ ‖E‖_F ≤ (M + c) δ; noise: ‖E‖₂ ≤ the spectral bound
    shift = slack_abs + spectral
    scale = (diag + shift).clamp_min(0.0)
    empty = scale <= 0
    if bool(empty.any()):  # a zero diagonal forces its whole row and column to zero
        _check_zero_energy(gram_packed, c, empty, packed=zero_energy)
    inv = torch.where(empty, 0.0, scale.rsqrt())
    certified = negative_bound(scale[:dim], slack_rel, shift)  # G is a principal block of J
    return _Scaled(c, n, inv, empty, shift, slack_rel, certified, None if zero_energy else floor_g)


NEGATIVE_ENTRIES = "G or the class sums have negative entries (random ReLU features are >= 0)"


def negative_bound(scale: Tensor, slack: float, lift: float = 0.0) -> float:
    """What an accepted PSD test certifies of G: λ_min(G) ≥ −β, β = lift + slack·max D_G.

    The test factorised R + slack·I, R = D^{-1/2} (J + lift·I) D^{-1/2} with D the diagonal of
    J + lift·I, so J + lift·I ⪰ −slack·D, and on G's principal block G + lift·I ⪰ −slack·D_G ⪰
    −slack·max D_G·I (``scale``: D_G, G's part of D), up to the factorisation's own rounding, as
    the test itself. The ridge solve uses the sum of these over what it adds
    (fcl_flower/analytic/ridge.py)."""
    largest = float(scale.max()) if scale.numel() else 0.0
    return float(lift) + float(slack) * max(largest, 0.0)


def _check_norm_bound(
    gram_diagonal: Tensor,
    c: Tensor,
    n: Tensor,
    norm_bound: float,
    slack_rel: float,
    slack_abs: float,
    absolute_tolerance: float,
    noise: NoiseLevels,
) -> None:
    """Every ‖φ_i‖ ≤ B: tr G ≤ n B² and ‖C_c‖ ≤ n_c B, widened by the rounding slack and the noise."""
    dim, classes = int(c.shape[0]), int(c.shape[1])
    bound = norm_bound * norm_bound * (1.0 + slack_rel)
    total = float(n.sum()) + noise_sum_bound(noise.counts, classes)
    trace_noise = noise_sum_bound(noise.gram, dim)
    if float(gram_diagonal.sum()) > total * bound + slack_abs * dim + trace_noise:
        raise StatisticsRejected(f"trace(G) exceeds n·B² for the feature norm bound B = {norm_bound:g}")
    sums = torch.linalg.vector_norm(c, dim=0)
    widened = (n + noise_entry_bound(noise.counts, classes)) * norm_bound * (1.0 + slack_rel)
    widened = widened + noise_column_bound(noise.sums, dim, classes)
    if bool((sums > widened + math.sqrt(dim) * absolute_tolerance).any()):
        raise StatisticsRejected(f"a class sum is longer than n_c·B for B = {norm_bound:g}")


FLOAT64_UNIT = 2.0**-53  # unit roundoff of the server's own float64 products


def check_factor_statistics(
    factor: Tensor, counts: Tensor, num_samples: int, *, dim: int, **options: Any
) -> tuple[Tensor, Tensor]:
    """:func:`screen_factor_statistics` (``options``: its ``relative_tolerance``, ``norm_bound`` and
    ``nonnegative``), then the packed G and the C the factor stands for (float64; with
    ``nonnegative`` G's negative rounding clamped to 0 as C's): what a Gram upload would carry."""
    screen = screen_factor_statistics(factor, counts, num_samples, dim=dim, **options)
    return factor_packed_gram(factor, dim, clamp=bool(options.get("nonnegative", False))), screen.class_sums


@dataclass(frozen=True)
class FactorScreen:
    """What :func:`screen_factor_statistics` accepted: G's diagonal (each feature column's sum of
    squares) and C (float64; with ReLU features its negative rounding clamped to 0)."""

    diagonal: Tensor
    class_sums: Tensor


def screen_factor_statistics(
    factor: Tensor,
    counts: Tensor,
    num_samples: int,
    *,
    dim: int,
    relative_tolerance: float,
    norm_bound: float = 0.0,
    nonnegative: bool = False,
) -> FactorScreen:
    """A factor upload F = O[Φ Y] (fcl_flower/analytic/factor.py): check it without making the
    packed G (its signs come from a product read block by block, ~3 ms an upload at M = 2000,
    n = 14; the server makes the sum of a round's factors by one product of their stacked rows).
    Raise StatisticsRejected with the violated property.

    FᵀF is positive semidefinite by construction, so no factorisation is needed. What the server
    keeps differs from FᵀF in two places only: the label block is replaced by diag(n_c), and with
    ReLU features the negative rounding of G and C is clamped to 0. Both changes are bounded, in the
    diagonally scaled J of the Gram check, by a Frobenius norm of at most half that check's slack
    2 (M + c) ε (the other half covers the rounding of the float64 products), so the statistics
    returned pass :func:`check_packed_statistics` with the same options: the factor form accepts
    nothing the Gram form would reject. Checked, cheapest first:

    * shapes: one row per sample (``num_samples`` rows, at most
      :func:`~fcl_flower.analytic.factor.factor_max_rows`: a factor with more numbers than the Gram
      upload is refused, it would make this check dearer than the Gram's), M + c columns, c counts;
      the counts themselves are checked by :func:`check_counts`;
    * magnitude: every |F_ij| ≤ √(MAGNITUDE_LIMIT / rows), so every entry of FᵀF obeys
      :data:`MAGNITUDE_LIMIT` like a Gram upload's;
    * labels, before the r M² product of the features (r c² work): F_Yᵀ F_Y equals diag(n_c) entry
      by entry within τ √(n_i n_j), τ = 2ε + 4(rows + 1) u (the wire rounding ε of both factors and
      the float64 products' own, u = 2⁻⁵³), and the scaled deviation has Frobenius norm L at most
      2 (M + c) ε (entry by entry, c entries of τ could add up to more than the Gram check allows in
      float64); a class without samples must have an exactly zero label column (so its class sums
      are exactly zero: squares that underflow cannot hide it);
    * no underflow: every non-zero |F_ij| ≥ :data:`FACTOR_FLOOR` = 2⁻⁵⁰⁰, so every product of two
      entries is a normal float64 (a subnormal G_ii loses precision, and the Gram check's
      Cauchy–Schwarz test would then refuse what this one accepted);
    * zero energy, which the Gram check tests (a feature whose G_ii is 0 has an exactly zero row in
      G and C), then holds by construction and costs no pass: G_ii = 0 only for an exactly zero
      column of F_Φ, whose products are exactly zero (an entry whose square would underflow to a
      zero G_ii beside non-zero products is refused as underflow);
    * with random ReLU features (``nonnegative``): G_ij ≥ −τ √(G_ii G_jj) and C_ic ≥ −τ √(G_ii n_c)
      (a true zero, two features never active together, comes out as ± rounding of that size), the
      scaled negative part has Frobenius norm K with L + K ≤ 2 (M + c) ε, and is then clamped to 0;
    * with a feature norm bound B: tr G ≤ n B², ‖C_c‖ ≤ n_c B, with exactly the Gram upload's slack.
    """
    classes = int(counts.shape[0]) if counts.dim() == 1 else -1
    rows = int(factor.shape[0]) if factor.dim() == 2 else -1
    if factor.dim() != 2 or classes < 0 or int(factor.shape[1]) != dim + classes:
        raise StatisticsRejected(
            f"shapes factor {tuple(factor.shape)}, counts {tuple(counts.shape)} do not fit M = {dim}"
        )
    if rows != num_samples:
        raise StatisticsRejected(f"the factor has {rows} rows, the upload says {num_samples} samples (one row each)")
    most = factor_max_rows(dim, classes)
    if rows > most:
        raise StatisticsRejected(
            f"the factor has {rows} rows, more than the {most} that keep it smaller than the Gram upload: send the Gram"
        )
    check_magnitude("factor", factor, math.sqrt(MAGNITUDE_LIMIT / max(rows, 1)))
    n = counts.to(torch.float64)
    check_magnitude("counts", n)
    tau = 2.0 * relative_tolerance + 4.0 * (rows + 1) * FLOAT64_UNIT
    budget = 2.0 * (dim + classes) * relative_tolerance  # half the Gram check's PSD slack
    label_shift = _check_label_block(factor[:, dim:], n, tau, budget)
    _check_no_underflow(factor)
    stats = factor_gram(factor, dim, packed=False)
    sums, diagonal = stats.class_sums, stats.diagonal
    empty = diagonal <= 0
    # Zero energy holds by construction here, so it is not tested again (issue 30: that pass over
    # G was ~5 ms an upload at M = 2000). Every entry is finite, and non-zero ones are at least
    # FACTOR_FLOOR in magnitude, so a column of F_Φ with a non-zero entry has G_ii ≥ its square > 0
    # (a sum of non-negative normal terms); G_ii = 0 means the column is exactly zero, and then row
    # i of G and of C, products with that column, are exactly ±0. A class without samples has an
    # exactly zero label column (the label check), so its column of C is ±0 too.
    if nonnegative:
        if min(stats.lowest_gram, stats.lowest_sums) < -tau:
            raise StatisticsRejected("G or the class sums have negative entries (random ReLU features are >= 0)")
        inv_g = torch.where(empty, 0.0, diagonal.clamp_min(0.0).rsqrt())
        root = n.clamp_min(0.0).sqrt()
        inv_n = torch.where(root > 0, 1.0 / torch.where(root > 0, root, 1.0), 0.0)
        scaled_sums = (sums * inv_g[:, None] * inv_n[None, :]).clamp_max(0.0)
        energy = stats.negative_gram_energy + 2.0 * float((scaled_sums * scaled_sums).sum())
        if label_shift + math.sqrt(energy) > budget:
            raise StatisticsRejected(
                f"G or the class sums have negative entries beyond a rotation's rounding (scaled norm "
                f"{math.sqrt(energy):.3g} > {budget - label_shift:.3g}; random ReLU features are >= 0)"
            )
        sums.clamp_min_(0.0)  # what is left is rounding of true zeros (G's: factor_packed_gram's clamp)
    if norm_bound > 0:
        slack = 4.0 * (dim + classes) * relative_tolerance  # the Gram upload's, exactly
        _check_norm_bound(diagonal, sums, n, norm_bound, slack, 0.0, 0.0, NoiseLevels())
    return FactorScreen(diagonal, sums)


FACTOR_FLOOR = 2.0**-500  # smallest non-zero |F_ij|: products of two entries stay normal (>= 2^-1000)


def _check_no_underflow(factor: Tensor) -> None:
    """No non-zero entry below :data:`FACTOR_FLOOR` in magnitude: its square would be subnormal,
    G_ii would lose relative precision and the derived G could break Cauchy-Schwarz by it (only a
    float64 factor can hold such entries; a float32 one is skipped)."""
    info = torch.finfo(factor.dtype)
    if info.tiny * info.eps >= FACTOR_FLOOR:  # the dtype's smallest subnormal is above the floor
        return
    if bool(torch.logical_and(factor != 0, factor.abs() < FACTOR_FLOOR).any()):
        raise StatisticsRejected(
            f"the factor has a non-zero entry below {FACTOR_FLOOR:.3g} in magnitude: its square would underflow"
        )


def _check_label_block(labels: Tensor, n: Tensor, tau: float, budget: float) -> float:
    """F_Y (rows × c) against the counts (see :func:`check_factor_statistics`); returns the
    Frobenius norm of the scaled deviation D^{-1/2}(F_YᵀF_Y − diag n)D^{-1/2}, D = diag n."""
    y = labels.to(torch.float64)
    deviation = y.T @ y - torch.diag(n)
    root = torch.sqrt(n.clamp_min(0.0))
    if bool((torch.abs(deviation) > tau * torch.outer(root, root)).any()):
        raise StatisticsRejected("the label block of the factor is not diag(counts): its rows are not [Φ Y] rotated")
    empty = n == 0
    if bool(empty.any()) and bool((y[:, empty] != 0).any()):
        raise StatisticsRejected("the label block of the factor has a non-zero column for a class without samples")
    inv = torch.where(root > 0, 1.0 / torch.where(root > 0, root, 1.0), 0.0)
    shift = float(torch.linalg.matrix_norm(deviation * inv[:, None] * inv[None, :]))
    if shift > budget:
        raise StatisticsRejected(
            f"the label block of the factor is off diag(counts) by {shift:.3g} (scaled Frobenius norm), "
            f"more than the Gram check's slack allows ({budget:.3g})"
        )
    return shift


FLOAT32_EPSILON = 2.0**-24  # wire_epsilon(torch.float32): uploads this coarse may be tested in float32


_SCREEN_CHUNK = 1 << 18  # packed entries per pass of the O(M²) screens (1 MiB of float32)
_FACTOR_ROWS = 256  # rows of J per block while the PSD test builds it


def _low(tensor: Tensor) -> float:
    return float(tensor.min()) if tensor.numel() else 0.0


def _widened(low: float, high: float, least: float, most: float) -> tuple[float, float]:
    """(low, high) widened by a chunk's extremes; NaN stays NaN."""
    if math.isnan(least) or math.isnan(most) or math.isnan(low):
        return math.nan, math.nan
    return min(low, least), max(high, most)


@lru_cache(maxsize=8)
def _screen_chunks(dim: int) -> tuple[tuple[int, int, int, int, np.ndarray], ...]:
    """The O(M²) screens' passes over a packed upload of dimension ``dim``, ~1 MiB of float32 at a
    time: (first row a, end row b, packed entries start..stop, each row's first entry relative to
    start). The same for every upload of a run, so computed once."""
    out = []
    rows_per_chunk = max(1, _SCREEN_CHUNK // max(dim, 1))
    for a in range(0, dim, rows_per_chunk):
        b = min(dim, a + rows_per_chunk)
        local = np.arange(b - a, dtype=np.int64)
        starts = local * (dim - a) - local * (local - 1) // 2
        starts.flags.writeable = False
        out.append((a, b, row_offset(a, dim), row_offset(b, dim), starts))
    return tuple(out)


def _check_zero_energy(gram_packed: Tensor, c: Tensor, empty: Tensor, packed: bool = True) -> None:
    """Rows/columns of J whose diagonal is zero once lifted must be zero (before anything is
    scaled). Their diagonal entries are not tested: lifted by the slack they are exactly 0 (a
    diagonal below minus the slack was rejected before), so rounding there is no energy.
    Contiguous passes over the packed upload, one cached chunk of rows at a time, however many
    features are empty: with the diagonal zeroed, |G_ij| times the flag of column j (the suffixes
    of the column flags laid end to end) must be 0 on every row, and |G_ij| itself on an empty
    row (per-row maxima by ``np.maximum.reduceat``; an exact test, since |x|·1 = |x| and
    |x|·0 = 0 for the finite entries the screen has already required)."""
    dim = int(c.shape[0])
    rows, classes = empty[:dim].numpy(), empty[dim:].numpy()
    sums = c.numpy()
    if bool(np.any(sums[rows] != 0)) or bool(np.any(sums[:, classes] != 0)):
        raise StatisticsRejected(ZERO_ENERGY)
    if not packed or not rows.any():
        return
    values = gram_packed.numpy()
    flags = rows.astype(values.dtype)
    rows_per_chunk = max(1, _SCREEN_CHUNK // dim)
    magnitudes = np.empty(min(values.size, rows_per_chunk * dim), dtype=values.dtype)
    flagged = np.empty_like(magnitudes)
    for a in range(0, dim, rows_per_chunk):
        b = min(dim, a + rows_per_chunk)
        start, stop = row_offset(a, dim), row_offset(b, dim)
        part, mask = magnitudes[: stop - start], flagged[: stop - start]
        np.abs(values[start:stop], out=part)
        local = np.arange(b - a, dtype=np.int64)
        starts = local * (dim - a) - local * (local - 1) // 2
        part[starts] = 0  # the diagonal entries themselves
        np.concatenate([flags[i:dim] for i in range(a, b)], out=mask)
        mask *= part
        if float(mask.max()) > 0 or bool(np.any(np.maximum.reduceat(part, starts)[rows[a:b]] > 0)):
            raise StatisticsRejected(ZERO_ENERGY)


ZERO_ENERGY = "a feature or class with zero energy has non-zero sums"


def _scaled_blocks(
    gram_packed: Tensor, c: Tensor, inv: Tensor, lift: float, slack_rel: float, dtype: np.dtype[Any]
) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """(a, b, R[a:b, a:M], R[a:b, M:]) of R = D^{-1/2} (J + lift·I) D^{-1/2}, one block of
    ``_FACTOR_ROWS`` rows at a time in ``dtype`` (lower-triangle positions of the block are zero;
    the block is a view of one reused buffer, valid until the next), after checking
    Cauchy–Schwarz |R_ij| <= 1 + slack_rel on it. Rows are copied from their packed slices (a
    boolean-mask scatter of the whole triangle, as before, was most of the certificate's cost
    beside the factorisation)."""
    dim = int(c.shape[0])
    limit = 1.0 + slack_rel + 1e-12
    packed, sums, w = gram_packed.numpy(), c.numpy(), inv.numpy().astype(dtype)
    scratch = np.empty(min(_FACTOR_ROWS, max(dim, 1)) * dim, dtype=dtype)
    for a in range(0, dim, _FACTOR_ROWS):
        b = min(dim, a + _FACTOR_ROWS)
        block = unpack_rows(packed, a, b, dim, scratch)
        rows = np.arange(b - a)
        block[rows, rows] += lift
        block *= w[None, a:dim]
        block *= w[a:b, None]
        corner = sums[a:b].astype(dtype, copy=True)
        corner *= w[None, dim:]
        corner *= w[a:b, None]
        for part in (block, corner):
            if part.size and max(float(part.max()), -float(part.min())) > limit:
                raise StatisticsRejected(
                    "an entry breaks Cauchy-Schwarz |J_ij| <= sqrt(J_ii J_jj): "
                    "class sums too large for G and the counts"
                )
        yield a, b, block, corner


def _check_cauchy_schwarz(
    gram_packed: Tensor, c: Tensor, inv: Tensor, slack_rel: float, empty: Tensor, floor: float | None = None
) -> None:
    """Cauchy–Schwarz |R_ij| <= 1 + slack on every entry of R = D^{-1/2} (J + lift·I) D^{-1/2}
    (the screen's part of :func:`_positive_factor`) and the zero-energy test of G, together, in
    contiguous passes over the packed upload, one chunk of rows (~1 MiB) at a time so each pass
    after the first reads from cache: row i of the upper triangle is a slice, scaled by the suffix
    v[i:] of the weights, its maximum taken per row by ``np.fmax.reduceat`` and scaled by v_i.

    v_i = w_i = D_ii^{-1/2}, and +inf for a feature of zero energy: a non-zero entry in its column
    becomes +inf (rejected), a zero one NaN (0·inf), which ``fmax`` passes over (the screen has
    already required finite entries); its row is tested unweighted (its maximum must be 0). The
    diagonal is left out (R_ii ≤ 1 always).
    In the upload's own precision: float32 products of float32 entries are off by a few units of
    2⁻²⁴, far inside the slack 4(M + c)·2⁻²⁴ (and the stage's PSD test on the sum decides anyway).
    """
    dim = int(c.shape[0])
    if dim == 0:
        return
    dtype = np.float32 if gram_packed.dtype == torch.float32 else np.float64
    rows = empty.numpy()[:dim]
    v = inv.numpy()[:dim].astype(dtype)
    v[rows] = np.inf
    packed = gram_packed.numpy()
    limit = 1.0 + slack_rel + (1e-6 if dtype == np.float32 else 1e-12)
    chunks = _screen_chunks(dim)
    size = max(stop - start for _, _, start, stop, _ in chunks)
    magnitudes, scaled = np.empty(size, dtype=dtype), np.empty(size, dtype=dtype)
    worst, low, high, energy = 0.0, math.inf, -math.inf, False
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        for a, b, start, stop, starts in chunks:
            values = packed[start:stop]
            # the chunk's extremes: the screen's magnitude test (one pass, the chunk then in cache)
            least, most = (float(x) for x in torch.aminmax(gram_packed[start:stop]))
            if floor is not None:
                low, high = _widened(low, high, least, most)
            if least >= 0:  # |G_ij| = G_ij: no copy (the usual case: ReLU features)
                magnitude = values
            else:
                magnitude = magnitudes[: stop - start]
                np.abs(values, out=magnitude, dtype=dtype)
            # an empty row unweighted (a subnormal times a small w_j would round to 0); its
            # diagonal is 0 when the chunk has no negative entry (an empty row's G_ii <= 0)
            if rows[a:b].any():
                if magnitude is not values:
                    magnitude[starts] = 0
                energy = energy or bool(np.any(np.maximum.reduceat(magnitude, starts)[rows[a:b]] > 0))
            part = scaled[: stop - start]
            np.concatenate([v[i:dim] for i in range(a, b)], out=part)  # the weights' suffixes, in C
            np.multiply(part, magnitude, out=part)
            part[starts] = 0  # the diagonal
            per_row = np.fmax.reduceat(part, starts)
            per_row *= v[a:b]
            worst = max(worst, float(np.fmax.reduce(per_row, initial=0.0)))
    # the verdicts in the order of check_packed_statistics: magnitude, sign, zero energy, Cauchy–Schwarz
    if floor is not None and _magnitude_verdict("G", low, high) < floor:
        raise StatisticsRejected(NEGATIVE_ENTRIES)
    if energy:
        raise StatisticsRejected(ZERO_ENERGY)
    if worst == math.inf:  # a zero-energy feature with a non-zero entry, or an overflow: say which
        _check_zero_energy(gram_packed, c, empty)
    corner = np.abs(c.numpy()) * inv.numpy()[:dim, None] * inv.numpy()[None, dim:]
    if worst > limit or (corner.size and float(corner.max()) > limit):
        raise StatisticsRejected(
            "an entry breaks Cauchy-Schwarz |J_ij| <= sqrt(J_ii J_jj): class sums too large for G and the counts"
        )


def _positive_factor(
    gram_packed: Tensor,
    c: Tensor,
    n: Tensor,
    inv: Tensor,
    empty: Tensor,
    lift: float,
    slack_rel: float,
    shift: float,
    dtype: torch.dtype,
) -> bool:
    """Build the upper triangle of R = D^{-1/2} (J + lift·I) D^{-1/2} + shift·I in ``dtype``, checking
    |R_ij| <= 1 + slack_rel on the way; True if it has a Cholesky factor. Rows and columns of zero
    energy (all zero: the screen's zero-energy test) are left out: R is block diagonal with a unit
    block there, so R has a factor exactly when the rest has, and the factorisation is of the rest
    only (a quarter of the features of a stage's sum on the digits backbone: (3/4)³ of the work).
    ``lift``: the absolute slack plus the noise's spectral bound; D is the diagonal of J + lift·I."""
    dim = int(c.shape[0])
    w, kept = inv.numpy(), np.flatnonzero(~empty.numpy())
    features, classes = kept[kept < dim], kept[kept >= dim] - dim  # J's rows of non-zero energy
    live = int(features.size)
    joint = torch.empty(kept.size, kept.size, dtype=dtype, device="cpu")
    out = joint.numpy()
    whole = live == dim  # no feature of zero energy: each block as it is, no gather
    for a, b, block, corner in _scaled_blocks(gram_packed, c, inv, lift, slack_rel, np.dtype(np.float64)):
        if whole:
            out[a:b, a:live] = block
            out[a:b, live:] = corner[:, classes]
            continue
        first, end = np.searchsorted(features, (a, b))
        if first < end:  # those rows, their columns from the first of them on (the upper triangle)
            rows = features[first:end] - a
            out[first:end, first:live] = block[np.ix_(rows, features[first:] - a)]
            out[first:end, live:] = corner[np.ix_(rows, classes)]
    out[live:, live:] = np.diag(((n.numpy() + lift) * w[dim:] * w[dim:])[classes])
    diagonal = np.einsum("ii->i", out)  # a writable view of the diagonal
    diagonal += shift
    info = torch.zeros((), dtype=torch.int32, device="cpu")
    # the upper triangle of the row-major buffer is the lower one of its column-major transposed
    # view: factorised there, in place (on the buffer itself torch copies it to column order and back)
    torch.linalg.cholesky_ex(joint.T, out=(joint.T, info))
    return int(info) == 0


def check_class_sums(
    class_sums: Tensor,
    counts: Tensor,
    *,
    relative_tolerance: float,
    norm_bound: float = 0.0,
    nonnegative: bool = False,
    noise: NoiseLevels | None = None,
) -> None:
    """STSA-E: class sums s_c = Σ_{i: y_i = c} φ_i (shape (..., M, c)) of counts n_c (shape (..., c)).

    A cell with no sample has a zero sum; with ReLU features no entry is negative; with a
    feature norm bound B every ‖s_c‖ ≤ n_c B (triangle inequality). Without a bound, any
    finite sums of non-empty cells are possible: docs/privacy.md says what that leaves open.
    With ``noise`` (std on the sums and on the counts): a cell whose noisy count is provably
    below 1 is empty and its sum must be noise-sized; signs and norms are widened by the bounds.
    """
    noise = noise or NoiseLevels()
    if tuple(class_sums.shape[:-2]) + tuple(class_sums.shape[-1:]) != tuple(counts.shape):
        raise StatisticsRejected(
            f"class sums {tuple(class_sums.shape)} and counts {tuple(counts.shape)} do not fit together"
        )
    sums, n = class_sums.to(torch.float64), counts.to(torch.float64)
    check_magnitude("class sums", sums)
    dim, cells = int(sums.shape[-2]), max(int(n.numel()), 1)
    if nonnegative and bool((sums < -noise_entry_bound(noise.sums, sums.numel())).any()):
        raise StatisticsRejected("class sums have negative entries (random ReLU features are >= 0)")
    lengths = torch.linalg.vector_norm(sums, dim=-2)
    count_noise = noise_entry_bound(noise.counts, cells)
    sum_noise = noise_column_bound(noise.sums, dim, cells)
    empty = (n + count_noise < 1.0) if count_noise > 0 else (n == 0)
    if bool((empty & (lengths > sum_noise)).any()):
        raise StatisticsRejected("a class with no sample has a non-zero sum")
    if norm_bound > 0:
        slack = 4.0 * dim * relative_tolerance
        if bool((lengths > (n + count_noise) * norm_bound * (1.0 + slack) + sum_noise).any()):
            raise StatisticsRejected(f"a class sum is longer than n_c·B for B = {norm_bound:g}")


def check_lowrank_statistics(
    singular_values: Tensor,
    label_corr: Tensor,
    num_samples: int,
    *,
    relative_tolerance: float,
    norm_bound: float = 0.0,
    nonnegative: bool = False,
    noise: NoiseLevels | None = None,
) -> None:
    """FedRAN: the top singular values σ of H (n × M) and B = HᵀY, Y one-hot (‖Y‖_F² = n).

    ‖B‖_F = ‖HᵀY‖_F ≤ ‖H‖₂ ‖Y‖_F = σ₁ √n (σ₁ is kept by every rank-r ≥ 1 sketch, and is 0 when
    nothing is kept); with ReLU features B ≥ 0; with a feature norm bound B_φ:
    Σσ² ≤ ‖H‖_F² ≤ n B_φ² and ‖B‖_F ≤ Σ_c ‖B_c‖ ≤ n B_φ.

    With ``noise`` (std on the Gram before the client's sketch, on B and on the count n, the
    reported n being that noisy count rounded and clipped at 0): λ_max(G) ≤ σ₁² + τ_E and
    Σ_{top r} λ_i(G + E)₊ ≤ tr G + r τ_E with τ_E the spectral bound of the Gram's noise;
    n ≤ reported + τ_n + ½; ‖B‖_F grows by at most the norm bound of its noise.
    """
    noise = noise or NoiseLevels()
    sigma, corr = singular_values.to(torch.float64), label_corr.to(torch.float64)
    check_magnitude("singular values", sigma)
    check_magnitude("label correlations", corr)
    dim, classes = int(corr.shape[0]), int(corr.shape[1])
    if nonnegative and bool((corr < -noise_entry_bound(noise.sums, corr.numel())).any()):
        raise StatisticsRejected("B = HᵀY has negative entries (random ReLU features are >= 0)")
    slack = 1.0 + 4.0 * (dim + classes) * relative_tolerance
    gram_noise = noise_spectral_bound(NoiseLevels(gram=noise.gram), dim, 0)
    corr_noise = noise_norm_bound(noise.sums, dim * classes)
    samples = num_samples + (noise_entry_bound(noise.counts, 1) + 0.5 if noise.counts > 0 else 0.0)
    top = float(sigma.max()) if sigma.numel() else 0.0
    length = float(torch.linalg.vector_norm(corr))
    reach = math.sqrt((top * top + gram_noise) * samples) if noise.on else top * math.sqrt(num_samples)
    if length > reach * slack + corr_noise:
        raise StatisticsRejected(
            f"‖B‖_F = {length:.4g} exceeds σ₁·√n = {top * math.sqrt(num_samples):.4g}: B is not HᵀY for this H"
        )
    if norm_bound > 0:
        energy = samples * norm_bound * norm_bound * slack + sigma.numel() * gram_noise
        if float((sigma * sigma).sum()) > energy:
            raise StatisticsRejected(f"Σσ² exceeds n·B² for the feature norm bound B = {norm_bound:g}")
        if length > samples * norm_bound * slack + corr_noise:
            raise StatisticsRejected(f"‖B‖_F exceeds n·B for the feature norm bound B = {norm_bound:g}")
