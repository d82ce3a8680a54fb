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
* Stated error, per grid point: the quadrature's truncation error is estimated as the change from
  ``steps − 1`` to ``steps`` blocks; the trace's standard error is the probes' sample standard
  deviation / √probes; both go through GCV's formula to a relative error. A point is usable when
  that error is below ``tolerance``; γ is the usable point of least GCV, provided it is not on the
  usable window's edge (then the search recentres there, at most ``max_centres`` times). If no
  centre gives an interior minimum, or the usable window is empty, the caller falls back to the
  exact scan (``certified`` False says why).

The chosen γ therefore equals the exact scan's whenever the exact GCV curve's minimum beats its
neighbours by more than the stated error; otherwise it is a grid point whose GCV is within that
error of the minimum (tests/test_ridge_krylov.py compares both on random-feature statistics).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import AnalyticInputError

__all__ = ["KrylovGCV", "KrylovRow", "krylov_gcv"]


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
    centre, every centre tried, the Cholesky factor of G + γI when γ is the last centre (so the
    solve reuses it), and why the search gave up when it did."""

    gamma: float | None
    rows: list[KrylovRow]
    centres: list[float]
    factor: Tensor | None = None
    reason: str = ""
    block_solves: int = 0

    @property
    def certified(self) -> bool:
        return self.gamma is not None


def _orthonormal(block: Tensor, basis: Tensor | None) -> Tensor:
    """``block`` orthogonalised against ``basis`` (twice: classical Gram–Schmidt, re-orthogonalised)
    and then within itself; columns that vanish (rank deficiency) are dropped."""
    for _ in range(2 if basis is not None else 0):
        assert basis is not None
        block = block - basis @ (basis.T @ block)
    q, r = torch.linalg.qr(block)
    diag = torch.diagonal(r).abs()
    keep = diag > 1e-10 * max(float(diag.max()), 1e-300) if diag.numel() else diag.bool()
    return q[:, keep]


def _estimates(
    theta: Tensor, weights_c: Tensor, weights_z: Tensor, centre: float, gammas: Tensor, yty: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(RSS, df mean, df standard error) per γ from Ritz values ``theta`` of A and the squared
    projections of C (summed over classes) and of each probe onto the Ritz vectors."""
    shift = (gammas - centre).unsqueeze(1)  # (grid, 1)
    mu = theta.unsqueeze(0)  # (1, s)
    denom = 1.0 + shift * mu
    g = mu * (1.0 + (2.0 * gammas.unsqueeze(1) - centre) * mu) / (denom * denom)
    h = (1.0 - centre * mu) / denom
    rss = (yty - g @ weights_c).clamp_min(0.0)
    per_probe = h @ weights_z  # (grid, probes)
    probes = weights_z.shape[1]
    df = per_probe.mean(dim=1)
    se = per_probe.std(dim=1) / math.sqrt(probes) if probes > 1 else torch.full_like(df, math.inf)
    return rss, df, se


def _gcv(rss: Tensor, df: Tensor, n: int) -> Tensor:
    room = n - df
    return torch.where(room > 0, n * rss / room.clamp_min(1e-300) ** 2, torch.full_like(rss, math.inf))


def _krylov(apply: Callable[[Tensor], Tensor], start: Tensor, steps: int) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """Block Krylov space of ``apply`` from ``start``: (orthonormal basis V, the symmetrised
    compression Vᵀ·apply(V), Vᵀ·start, the width of all blocks but the last, columns applied)."""
    dim = start.shape[0]
    blocks: list[Tensor] = []
    images: list[Tensor] = []
    block = _orthonormal(start, None)
    basis = block[:, :0]
    applied = 0
    for _ in range(steps):
        if block.shape[1] == 0 or basis.shape[1] >= dim:
            break
        blocks.append(block)
        image = apply(block)
        applied += block.shape[1]
        images.append(image)
        basis = torch.cat(blocks, dim=1)
        block = _orthonormal(image, basis)
    compressed = basis.T @ torch.cat(images, dim=1)
    previous = basis.shape[1] - (blocks[-1].shape[1] if len(blocks) > 1 else 0)
    return basis, 0.5 * (compressed + compressed.T), basis.T @ start, previous, applied


def _ritz(compressed: Tensor, coords: Tensor, size: int, classes: int) -> tuple[Tensor, Tensor, Tensor]:
    """Ritz values of the leading ``size`` block and the squared coordinates of the start block on
    the Ritz vectors: summed over the ``classes`` columns of C, and per probe."""
    theta, vectors = torch.linalg.eigh(compressed[:size, :size])
    squared = (vectors.T @ coords[:size]) ** 2
    return theta, squared[:, :classes].sum(dim=1), squared[:, classes:]


def _coarse_centre(gram: Tensor, start: Tensor, classes: int, n: int, yty: float, gammas: Tensor, steps: int) -> float:
    """A starting centre: the least-GCV grid point by Gauss quadrature in a Krylov space of G
    itself (no factorisation; its small eigenvalues are lumped, so it is only a starting point)."""
    basis, compressed, coords, _, _ = _krylov(lambda block: gram @ block, start, steps)
    theta, weights_c, weights_z = _ritz(compressed, coords, basis.shape[1], classes)
    rss, df, _ = _estimates(1.0 / (theta.clamp_min(0.0) + 1.0), weights_c, weights_z, 1.0, gammas, yty)
    return float(gammas[int(torch.argmin(_gcv(rss, df, n)))])


def _one_centre(
    gram: Tensor, start: Tensor, classes: int, n: int, yty: float, gammas: Tensor, centre: float, steps: int
) -> tuple[list[KrylovRow], Tensor | None, int]:
    """The rows at one centre, the factor of G + centre·I (None: not positive definite) and the
    number of columns solved."""
    system = gram.clone()
    system.diagonal().add_(centre)
    factor, info = torch.linalg.cholesky_ex(system)
    del system
    if int(info) != 0:
        return [], None, 0
    basis, compressed, coords, previous, solved = _krylov(
        lambda block: torch.cholesky_solve(block, factor), start, steps
    )

    def estimates(size: int) -> tuple[Tensor, Tensor, Tensor]:
        theta, weights_c, weights_z = _ritz(compressed, coords, size, classes)
        return _estimates(theta.clamp(0.0, 1.0 / centre), weights_c, weights_z, centre, gammas, yty)

    rss, df, se = estimates(basis.shape[1])
    if previous < basis.shape[1] < gram.shape[0]:
        rss_prev, df_prev, _ = estimates(previous)
        rss_err, df_err = (rss - rss_prev).abs(), (df - df_prev).abs()
    else:  # one block, or the space is the whole of R^M (then quadrature is exact)
        rss_err = torch.zeros_like(rss) if basis.shape[1] >= gram.shape[0] else torch.full_like(rss, math.inf)
        df_err = rss_err
    gcv = _gcv(rss, df, n)
    room = (n - df).clamp_min(1e-300)
    relative = rss_err / rss.clamp_min(1e-300) + 2.0 * (df_err + 3.0 * se) / room
    relative = torch.where(
        torch.isfinite(gcv) & (df + df_err + 3.0 * se < n), relative, torch.full_like(relative, math.inf)
    )
    rows = [
        KrylovRow(float(gm), float(r), float(d), float(gc), float(e))
        for gm, r, d, gc, e in zip(
            gammas.tolist(), rss.tolist(), df.tolist(), gcv.tolist(), relative.tolist(), strict=True
        )
    ]
    return rows, factor, solved


def krylov_gcv(
    gram: Tensor,
    class_sums: Tensor,
    num_samples: int,
    yty: float,
    grid: Sequence[float] | Tensor,
    *,
    centre: float | None = None,
    probes: int = 32,
    steps: int = 5,
    tolerance: float = 2e-3,
    max_centres: int = 3,
    seed: int = 0,
) -> KrylovGCV:
    """GCV's γ on ``grid`` from Cholesky factors at a few centres (module doc). ``centre``: where to
    start (the grid point nearest it; default: the least-GCV point of a Gauss-quadrature estimate in
    a Krylov space of G itself, which costs a few block products and no factorisation)."""
    n = int(num_samples)
    if n <= 0:
        raise AnalyticInputError(f"num_samples must be positive, got {num_samples}")
    gammas = torch.as_tensor(grid, dtype=torch.float64)
    if gammas.dim() != 1 or gammas.numel() == 0 or bool((gammas <= 0).any()):
        raise AnalyticInputError("grid must be a non-empty 1-D sequence of positive values")
    if probes < 2 or steps < 2:
        raise AnalyticInputError(f"probes and steps must be >= 2, got {probes} and {steps}")
    g = gram.to(torch.float64)
    c = class_sums.to(torch.float64)
    dim = g.shape[0]
    generator = torch.Generator().manual_seed(seed)
    z = torch.randint(0, 2, (dim, probes), generator=generator).to(torch.float64).mul_(2.0).sub_(1.0)
    values = gammas.tolist()
    start = torch.cat([c, z], dim=1)
    if centre is None:
        centre = _coarse_centre(g, start, c.shape[1], n, float(yty), gammas, steps)
    else:
        wanted = math.log(float(centre))
        centre = min(values, key=lambda v: abs(math.log(v) - wanted))
    result = KrylovGCV(gamma=None, rows=[], centres=[])
    for _ in range(max_centres):
        result.centres.append(centre)
        rows, factor, solved = _one_centre(g, start, c.shape[1], n, float(yty), gammas, centre, steps)
        result.block_solves += solved
        if factor is None:
            result.reason = f"G + {centre:g}·I has no Cholesky factor"
            result.rows = []
            return result
        result.rows = rows
        usable = [row.error <= tolerance for row in rows]
        if not usable[values.index(centre)]:  # moving away from the centre only adds quadrature error
            result.reason = (
                f"GCV's stated error at γ_c = {centre:g} is {rows[values.index(centre)].error:.2g} > {tolerance:g}"
                " (df close to n, or too few probes)"
            )
            return result
        low = high = values.index(centre)  # the run of usable grid points around the centre
        while low > 0 and usable[low - 1]:
            low -= 1
        while high < len(rows) - 1 and usable[high + 1]:
            high += 1
        best = min(range(low, high + 1), key=lambda i: rows[i].gcv)
        if (best > low or low == 0) and (best < high or high == len(rows) - 1):
            result.gamma = rows[best].gamma
            result.factor = factor if rows[best].gamma == centre else None
            return result
        centre = rows[best].gamma
    result.reason = f"no interior minimum after {max_centres} centres {result.centres}"
    return result
