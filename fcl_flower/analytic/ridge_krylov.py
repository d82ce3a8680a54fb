"""GCV ridge selection without an eigendecomposition: shift-invert block Krylov (issue 16 item 4).

:func:`fcl_flower.analytic.ridge.select_ridge_gcv` diagonalises G (``eigh``): at M = 4096 that is
an order of magnitude more work than the Cholesky solve it serves. This module picks γ on the same
grid, by the same criterion, GCV(γ) = n · RSS(γ) / (n − df(γ))², from one Cholesky factor of
G + γ_c I at a centre γ_c (the previous stage's γ when there is one) plus a few block solves:

* With A = (G + γ_c I)⁻¹ (eigenvalues μ = 1/(λ + γ_c)), both GCV ingredients are spectral sums of
  rational functions of μ:

      RSS(γ) = tr(YᵀY) − Σ_c c_cᵀ g_γ(A) c_c,   g_γ(μ) = μ (1 + (2γ − γ_c) μ) / (1 + (γ − γ_c) μ)²,
      df(γ)  = tr h_γ(A),                        h_γ(μ) = (1 − γ_c μ) / (1 + (γ − γ_c) μ).

* A block Krylov space of A started from [C, Z] (Z: ``probes`` Rademacher vectors from a seeded
  generator) and its Rayleigh–Ritz pairs give block Gauss quadrature for the quadratic forms
  (exact for polynomials in μ of degree < 2·steps; Golub & Meurant, "Matrices, Moments and
  Quadrature"); the trace is Hutchinson's estimator over Z (Golub & von Matt, "Generalized
  cross-validation for large-scale problems", 1997, use the same two pieces). At γ = γ_c, g and h
  are polynomials, so RSS(γ_c) is exact and df(γ_c) carries only the trace estimator's error.
* Stated error. The quadrature's truncation error is estimated per grid point as the change from
  ``steps − 1`` to ``steps`` blocks; the grid points where it is below ``tolerance`` (relative to
  GCV) form the accurate window around the centre. The probes are shared by every γ, so the
  difference GCV(γ_i) − GCV(γ_j) is far more precise than either value: per probe it is computed,
  and its mean plus three standard errors plus both quadrature errors bounds how much worse the
  chosen γ can be than any other point of the window (``margin``, relative; ≤ 0: better than
  every other point). γ is the window's least-GCV point when it is not on the window's edge (else
  the search recentres there, at most ``max_centres`` times) and its margin is ≤ ``tolerance``;
  otherwise ``gamma`` is None, ``reason`` says why, and the caller falls back to the exact scan.
  Each row also carries the absolute stated error of its own GCV estimate (quadrature plus three
  standard errors of the trace estimator).

Precision. The search only ranks grid points, so its factors and block products may run in
float32 (``dtype``; :meth:`RidgeState.solve` does so): half the time and memory of the float64
factorisation and block solves, while the basis, the compression and the quadrature stay float64.
A float32 factor is the exact factor of G + γ_c I + E, E its rounding (a few units of 2⁻²⁴ times
‖G‖₂ in practice), so the search ranks the GCV of a slightly perturbed G; on the benchmark's
statistics the two agree to about 10⁻⁶ relative, against stated errors near 10⁻³. No bound that
small holds for every G, so the caller checks afterwards: the float64 solve at the chosen γ gives
the exact RSS(γ) = tr(YᵀY) − tr(WᵀC) − γ‖W‖²_F at no cost (:func:`ridge_rss`), and when the
search's RSS there is further from it than the row's stated error, the choice is not trusted and
the exact scan decides.

So the chosen γ equals the exact scan's whenever the exact GCV's minimum is lower than every other
grid point in the window (margin < 0), and otherwise its GCV is within ``tolerance`` (relative) of
that point's (tests/test_ridge_krylov.py compares both on random-feature statistics, n/M from 2 to
12; experiments/bench_ridge_selection.py at M = 4096 and 10000).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .errors import AnalyticInputError

__all__ = ["KrylovGCV", "KrylovRow", "factor_solve", "krylov_gcv", "ridge_rss", "rss_agreement", "shifted_cholesky"]


@dataclass(frozen=True)
class KrylovRow:
    """One grid point: γ, the estimated RSS, df and GCV, and GCV's stated relative error."""

    gamma: float
    rss: float
    df: float
    gcv: float
    error: float


@dataclass
class KrylovGCV:
    """The outcome: the chosen γ (None when the search did not settle), the rows of the last
    centre, every centre tried, the Cholesky factor of G + γI when γ is the last centre of a
    float64 search (a caller may solve with it; RidgeState, whose searches run in float32, solves
    afresh in float64), and why the search gave up when it did."""

    gamma: float | None
    rows: list[KrylovRow]
    centres: list[float]
    factor: Tensor | None = None
    reason: str = ""
    block_solves: int = 0
    margin: float = math.nan

    @property
    def certified(self) -> bool:
        return self.gamma is not None


def shifted_cholesky(
    gram: Tensor, shift: float, dtype: torch.dtype = torch.float64, index: np.ndarray | None = None
) -> tuple[Tensor, int]:
    """(lower Cholesky factor of G + shift·I in ``dtype``, LAPACK's info: 0 when it exists), built in
    one M × M buffer factorised in place: no identity or second M × M temporary (512 MiB each at
    M = 8192). ``index``: of the principal submatrix G[index][:, index] only (a CPU G), gathered
    straight into the buffer (ridge.py ``live_features``); info then counts in ``index``'s order."""
    if index is not None:
        factor = torch.from_numpy(gram.numpy()[np.ix_(index, index)]).to(dtype)  # fresh, C-ordered
    else:
        factor = torch.empty_like(gram, dtype=dtype).copy_(gram)
    factor.diagonal().add_(float(shift))
    info = torch.zeros((), dtype=torch.int32, device=factor.device)
    # factorised through its transposed view, which is column-major: LAPACK then works in place
    # (on the row-major buffer itself torch would copy it to column order and back: M² more numbers);
    # the upper factor of the view is the lower factor L in the buffer
    torch.linalg.cholesky_ex(factor.T, upper=True, out=(factor.T, info))
    return factor, int(info)


def ridge_rss(class_sums: Tensor, weights: Tensor, yty: float, ridge: float) -> float:
    """‖Y − ΦW‖²_F of the ridge solution W = (G + γI)⁻¹C from W and C alone: since GW = C − γW,
    tr(WᵀGW) = tr(WᵀC) − γ‖W‖²_F, so RSS = tr(YᵀY) − tr(WᵀC) − γ‖W‖²_F (O(M c), no product with G)."""
    w = weights.to(torch.float64)
    return float(yty) - float((w * class_sums.to(torch.float64)).sum()) - float(ridge) * float((w * w).sum())


def rss_agreement(estimate: float, exact: float, error: float) -> tuple[bool, float]:
    """(whether the search's RSS at its γ agrees with the float64 solution's, their relative
    deviation |estimate − exact| / |exact|): it agrees when the deviation is at most ``error``,
    the row's stated relative error (module doc, "Precision")."""
    deviation = abs(estimate - exact) / max(abs(exact), 1e-300)
    return deviation <= error, deviation


def _orthonormal(block: Tensor, basis: Tensor | None, passes: int = 2) -> Tensor:
    """``block`` orthogonalised against ``basis`` (``passes`` times: classical Gram–Schmidt,
    re-orthogonalised) and then within itself; columns that vanish (rank deficiency) are dropped."""
    for _ in range(passes if basis is not None else 0):
        assert basis is not None
        block = block - basis @ (basis.T @ block)
    q, r = torch.linalg.qr(block)
    diag = torch.diagonal(r).abs()
    keep = diag > 1e-10 * max(float(diag.max()), 1e-300) if diag.numel() else diag.bool()
    return q[:, keep]


def _estimates(
    theta: Tensor, weights_c: Tensor, weights_z: Tensor, centre: float, gammas: Tensor, yty: float
) -> tuple[Tensor, Tensor]:
    """(RSS per γ, df per γ and probe) from Ritz values ``theta`` of A and the squared projections
    of C (summed over classes) and of each probe onto the Ritz vectors."""
    shift = (gammas - centre).unsqueeze(1)  # (grid, 1)
    mu = theta.unsqueeze(0)  # (1, s)
    denom = 1.0 + shift * mu
    g = mu * (1.0 + (2.0 * gammas.unsqueeze(1) - centre) * mu) / (denom * denom)
    h = (1.0 - centre * mu) / denom
    rss = (yty - g @ weights_c).clamp_min(0.0)
    return rss, h @ weights_z  # RSS per γ, df per γ and probe


def _gcv(rss: Tensor, df: Tensor, n: int) -> Tensor:
    room = n - df
    return torch.where(room > 0, n * rss / room.clamp_min(1e-300) ** 2, torch.full_like(rss, math.inf))


def _krylov(apply: Callable[[Tensor], Tensor], start: Tensor, steps: int) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """Block Krylov space of ``apply`` from ``start``: (orthonormal basis V, the symmetrised
    compression Vᵀ·apply(V), Vᵀ·start, the width of all blocks but the last, columns applied).

    The compression is read off the first Gram–Schmidt pass: step k projects its image A V_k on
    the basis so far, which is the block column V_{≤k}ᵀ A V_k; the blocks below the diagonal are
    the transposes of later steps' (A symmetric), and each diagonal block is symmetrised."""
    dim = start.shape[0]
    blocks: list[Tensor] = []
    projections: list[Tensor] = []
    block = _orthonormal(start, None)
    basis = block[:, :0]
    applied = 0
    for step in range(steps):
        if block.shape[1] == 0 or basis.shape[1] >= dim:
            break
        blocks.append(block)
        image = apply(block)
        applied += block.shape[1]
        basis = torch.cat(blocks, dim=1)
        projection = basis.T @ image
        projections.append(projection)
        if step + 1 < steps:  # the last image only enters the compression
            block = _orthonormal(image - basis @ projection, basis, passes=1)
    width = basis.shape[1]
    compressed = torch.zeros(width, width, dtype=basis.dtype, device=basis.device)
    end = 0
    for projection in projections:
        begin, end = end, end + projection.shape[1]
        compressed[:end, begin:end] = projection
    compressed = compressed + compressed.T
    end = 0
    for projection in projections:  # the diagonal blocks were added to their own transposes
        begin, end = end, end + projection.shape[1]
        compressed[begin:end, begin:end] *= 0.5
    previous = width - (blocks[-1].shape[1] if len(blocks) > 1 else 0)
    return basis, compressed, basis.T @ start, previous, applied


def _ritz(compressed: Tensor, coords: Tensor, size: int, classes: int) -> tuple[Tensor, Tensor, Tensor]:
    """Ritz values of the leading ``size`` block and the squared coordinates of the start block on
    the Ritz vectors: summed over the ``classes`` columns of C, and per probe."""
    theta, vectors = torch.linalg.eigh(compressed[:size, :size])
    squared = (vectors.T @ coords[:size]) ** 2
    return theta, squared[:, :classes].sum(dim=1), squared[:, classes:]


def _coarse_centre(gram: Tensor, start: Tensor, classes: int, n: int, yty: float, gammas: Tensor, steps: int) -> float:
    """A starting centre: the least-GCV grid point by Gauss quadrature in a Krylov space of G
    itself (no factorisation; its small eigenvalues are lumped, so it is only a starting point).
    ``gram`` may be a float32 copy: its products then run in float32, the rest in float64."""
    basis, compressed, coords, _, _ = _krylov(
        lambda block: (gram @ block.to(gram.dtype)).to(torch.float64), start, steps
    )
    theta, weights_c, weights_z = _ritz(compressed, coords, basis.shape[1], classes)
    rss, df = _estimates(1.0 / (theta.clamp_min(0.0) + 1.0), weights_c, weights_z, 1.0, gammas, yty)
    return float(gammas[int(torch.argmin(_gcv(rss, df.mean(dim=1), n)))])


def factor_solve(factor: Tensor, rhs: Tensor) -> Tensor:
    """(L Lᵀ)⁻¹ B for the lower Cholesky factor L, in L's dtype: two triangular solves, on L and on
    its transposed view. ``torch.cholesky_solve`` copies L on every call (M² more numbers at the
    peak: 512 MiB at M = 8192 in float64) and takes about twice as long on a block of columns."""
    half = torch.linalg.solve_triangular(factor, rhs.to(factor.dtype), upper=False)
    return torch.linalg.solve_triangular(factor.T, half, upper=True)


def _inverse(factor: Tensor) -> Callable[[Tensor], Tensor]:
    """X ↦ (L Lᵀ)⁻¹ X for the lower Cholesky factor L, in L's dtype, the result in float64."""
    return lambda block: factor_solve(factor, block).to(torch.float64)


@dataclass(frozen=True)
class _Centre:
    """One centre's estimates: the rows, the factor of G + γ_c I (None: not positive definite),
    the columns solved, the quadrature's relative error of GCV per γ, and GCV per γ and probe."""

    rows: list[KrylovRow]
    factor: Tensor | None
    solved: int
    quadrature: Tensor
    per_probe: Tensor


def _one_centre(
    gram: Tensor,
    start: Tensor,
    classes: int,
    n: int,
    yty: float,
    gammas: Tensor,
    centre: float,
    steps: int,
    dtype: torch.dtype = torch.float64,
) -> _Centre:
    factor, info = shifted_cholesky(gram, centre, dtype)
    if info != 0:
        return _Centre([], None, 0, torch.empty(0), torch.empty(0))
    basis, compressed, coords, previous, solved = _krylov(_inverse(factor), start, steps)

    def estimates(size: int) -> tuple[Tensor, Tensor]:
        theta, weights_c, weights_z = _ritz(compressed, coords, size, classes)
        return _estimates(theta.clamp(0.0, 1.0 / centre), weights_c, weights_z, centre, gammas, yty)

    rss, per_probe = estimates(basis.shape[1])
    df = per_probe.mean(dim=1)
    se = per_probe.std(dim=1) / math.sqrt(per_probe.shape[1])
    if previous < basis.shape[1] < gram.shape[0]:
        rss_prev, df_prev = estimates(previous)
        rss_err, df_err = (rss - rss_prev).abs(), (df - df_prev.mean(dim=1)).abs()
    else:  # one block, or the space is the whole of R^M (then quadrature is exact)
        rss_err = torch.zeros_like(rss) if basis.shape[1] >= gram.shape[0] else torch.full_like(rss, math.inf)
        df_err = rss_err
    gcv = _gcv(rss, df, n)
    room = (n - df).clamp_min(1e-300)
    valid = torch.isfinite(gcv) & (df + df_err + 3.0 * se < n)
    quadrature = torch.where(valid, rss_err / rss.clamp_min(1e-300) + 2.0 * df_err / room, math.inf)
    relative = torch.where(valid, quadrature + 6.0 * se / room, math.inf)
    rows = [
        KrylovRow(float(gm), float(r), float(d), float(gc), float(e))
        for gm, r, d, gc, e in zip(
            gammas.tolist(), rss.tolist(), df.tolist(), gcv.tolist(), relative.tolist(), strict=True
        )
    ]
    return _Centre(rows, factor, solved, quadrature, _gcv(rss.unsqueeze(1), per_probe, n))


def _margin(found: _Centre, best: int, others: range) -> float:
    """Upper bound (three standard errors of the paired probe differences, plus both points'
    quadrature errors) on max_j GCV(γ_best) − GCV(γ_j) over ``others``, relative to GCV(γ_best).
    The probes are shared by all γ, so the differences are far more precise than the values."""
    rows, per_probe = found.rows, found.per_probe
    worst = -math.inf
    for j in others:
        if j == best:
            continue
        paired = per_probe[best] - per_probe[j]
        spread = 3.0 * float(paired.std()) / math.sqrt(paired.numel())
        quadrature = float(found.quadrature[best]) * rows[best].gcv + float(found.quadrature[j]) * rows[j].gcv
        worst = max(worst, rows[best].gcv - rows[j].gcv + spread + quadrature)
    return worst / rows[best].gcv


def krylov_gcv(
    gram: Tensor,
    class_sums: Tensor,
    num_samples: int,
    yty: float,
    grid: Sequence[float] | Tensor,
    *,
    centre: float | None = None,
    probes: int = 16,
    steps: int = 5,
    tolerance: float = 1e-3,
    max_centres: int = 5,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> KrylovGCV:
    """GCV's γ on ``grid`` from Cholesky factors at a few centres (module doc). ``centre``: where to
    start (the grid point nearest it; default: the least-GCV point of a Gauss-quadrature estimate in
    a Krylov space of G itself, which costs a few block products and no factorisation). ``dtype``:
    the precision of the factors and of those products (module doc, "Precision"); the factor is
    handed back for the solve only in float64."""
    n = int(num_samples)
    if n <= 0:
        raise AnalyticInputError(f"num_samples must be positive, got {num_samples}")
    gammas = torch.as_tensor(grid, dtype=torch.float64)
    if gammas.dim() != 1 or gammas.numel() == 0 or bool((gammas <= 0).any()):
        raise AnalyticInputError("grid must be a non-empty 1-D sequence of positive values")
    if probes < 2 or steps < 2:
        raise AnalyticInputError(f"probes and steps must be >= 2, got {probes} and {steps}")
    if dtype not in (torch.float32, torch.float64):
        raise AnalyticInputError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    g = gram.to(torch.float64)
    c = class_sums.to(torch.float64)
    dim = g.shape[0]
    generator = torch.Generator().manual_seed(seed)
    z = torch.randint(0, 2, (dim, probes), generator=generator).to(torch.float64).mul_(2.0).sub_(1.0)
    values = gammas.tolist()
    start = torch.cat([c, z], dim=1)
    if centre is None:
        centre = _coarse_centre(g.to(dtype), start, c.shape[1], n, float(yty), gammas, steps)
    else:
        wanted = math.log(float(centre))
        centre = min(values, key=lambda v: abs(math.log(v) - wanted))
    result = KrylovGCV(gamma=None, rows=[], centres=[])
    for _ in range(max_centres):
        result.centres.append(centre)
        found = _one_centre(g, start, c.shape[1], n, float(yty), gammas, centre, steps, dtype)
        result.block_solves += found.solved
        if found.factor is None:
            result.reason = f"G + {centre:g}·I has no Cholesky factor"
            result.rows = []
            return result
        rows = result.rows = found.rows
        usable = [float(q) <= tolerance for q in found.quadrature]
        here = values.index(centre)
        if not usable[here]:
            result.reason = f"GCV's quadrature error at γ_c = {centre:g} exceeds {tolerance:g} (df close to n?)"
            return result
        low = high = here  # the run of grid points around the centre where the quadrature is accurate
        while low > 0 and usable[low - 1]:
            low -= 1
        while high < len(rows) - 1 and usable[high + 1]:
            high += 1
        best = min(range(low, high + 1), key=lambda i: rows[i].gcv)
        if (best == low and low > 0) or (best == high and high < len(rows) - 1):
            if best == here:
                result.reason = f"GCV is least at γ_c = {centre:g}, at the edge of its accurate window"
                return result
            centre = rows[best].gamma  # the minimum lies beyond this window: recentre there
            del found  # its M × M factor goes before the next centre's is built
            continue
        result.margin = _margin(found, best, range(low, high + 1))
        if result.margin > tolerance:
            result.reason = (
                f"the probes cannot tell γ = {rows[best].gamma:g} from its neighbours: GCV may be "
                f"{result.margin:.2g} (relative) above another grid point's"
            )
            return result
        result.gamma = rows[best].gamma
        result.factor = found.factor if best == here and dtype == torch.float64 else None
        return result
    result.reason = f"no interior minimum after {max_centres} centres {result.centres}"
    return result
