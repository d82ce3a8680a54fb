"""Direct tests of ridge_krylov's private helpers (Gram–Schmidt cut, Krylov counters, the spectral
estimates, GCV, the validity and error formulas, the coarse centre, the margin) and of
krylov_gcv's boundaries, each against an independent dense float64 computation on small seeded
problems (eigendecompositions and solves), not against numbers copied from the code."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from fcl_flower.analytic.errors import AnalyticInputError
from fcl_flower.analytic.ridge_krylov import (
    KrylovRow,
    _Centre,
    _coarse_centre,
    _estimates,
    _gcv,
    _inverse,
    _krylov,
    _margin,
    _one_centre,
    _orthonormal,
    factor_solve,
    krylov_gcv,
    ridge_rss,
    rss_agreement,
    shifted_cholesky,
)

F64 = torch.float64


def regression(dim: int, samples: int, classes: int, *, noise: float, seed: int) -> tuple[torch.Tensor, ...]:
    """(G = ΦᵀΦ, C = ΦᵀY, ‖Y‖²) for Y = ΦW + noise, Φ with column scales spread over 1e-2..1e1."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-2, 1, dim, dtype=F64)
    phi = torch.randn(samples, dim, generator=gen, dtype=F64) * scales
    y = phi @ torch.randn(dim, classes, generator=gen, dtype=F64) + noise * torch.randn(
        samples, classes, generator=gen, dtype=F64
    )
    gram = phi.T @ phi
    return 0.5 * (gram + gram.T), phi.T @ y, (y * y).sum()


def rademacher(dim: int, probes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (dim, probes), generator=gen).to(F64) * 2.0 - 1.0


def dense_rss(gram: torch.Tensor, sums: torch.Tensor, yty: float, gamma: float) -> float:
    """‖Y − ΦW‖² = tr YᵀY − 2 tr CᵀW + tr WᵀGW with W = (G + γI)⁻¹C."""
    w = torch.linalg.solve(gram + gamma * torch.eye(gram.shape[0], dtype=F64), sums)
    return float(yty - 2.0 * (sums * w).sum() + (w * (gram @ w)).sum())


def dense_df(gram: torch.Tensor, probes: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per probe zᵀ G (G + γI)⁻¹ z (Hutchinson's terms for df = tr G (G + γI)⁻¹)."""
    solved = torch.linalg.solve(gram + gamma * torch.eye(gram.shape[0], dtype=F64), probes)
    return (probes * (gram @ solved)).sum(dim=0)


def diagonal_apply(values: list[float]) -> tuple[torch.Tensor, object]:
    matrix = torch.diag(torch.tensor(values, dtype=F64))
    return matrix, lambda block: matrix @ block


def unit(dim: int, *indices: int) -> torch.Tensor:
    v = torch.zeros(dim, 1, dtype=F64)
    v[list(indices)] = 1.0
    return v


# --- shifted_cholesky -----------------------------------------------------------------------------


def test_shifted_cholesky_is_float64_and_reports_lapacks_failing_minor() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 5, generator=gen)
    gram = x.T @ x
    gram = (0.5 * (gram + gram.T)).float()  # float32 in, float64 factor out
    factor, info = shifted_cholesky(gram, 0.5)
    assert info == 0 and factor.dtype == F64
    assert torch.allclose(factor @ factor.T, gram.double() + 0.5 * torch.eye(5, dtype=F64), rtol=1e-10, atol=1e-10)
    assert torch.equal(factor, torch.tril(factor))
    _, info = shifted_cholesky(torch.diag(torch.tensor([1.0, 2.0, -4.0, 3.0], dtype=F64)), 1.0)
    assert info == 3  # the leading minor of order 3 is the first that is not positive definite


# --- _orthonormal ---------------------------------------------------------------------------------


def test_orthonormal_of_an_empty_block_is_empty() -> None:
    assert _orthonormal(torch.zeros(5, 0, dtype=F64), None).shape == (5, 0)


def test_orthonormal_drops_a_column_exactly_at_the_relative_cut_and_keeps_small_blocks() -> None:
    at_cut = torch.zeros(3, 2, dtype=F64)
    at_cut[0, 0], at_cut[1, 1] = 1.0, 1e-10  # R's diagonal is (1, 1e-10): not above 1e-10 · 1
    assert _orthonormal(at_cut, None).shape == (3, 1)
    small = torch.zeros(3, 2, dtype=F64)
    small[0, 0], small[1, 1] = 1e-3, 1e-12  # the cut is relative to the largest column: 1e-13 here
    assert _orthonormal(small, None).shape == (3, 2)


def test_orthonormal_against_a_basis() -> None:
    gen = torch.Generator().manual_seed(3)
    basis, _ = torch.linalg.qr(torch.randn(7, 3, generator=gen, dtype=F64))
    block = torch.cat([torch.randn(7, 2, generator=gen, dtype=F64), basis[:, :1] * 5.0], dim=1)
    q = _orthonormal(block, basis)
    assert q.shape == (7, 2)  # the third column lies in the basis: dropped
    assert torch.allclose(q.T @ q, torch.eye(2, dtype=F64), atol=1e-12)
    assert float((basis.T @ q).abs().max()) < 1e-12


# --- _krylov --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "size", "previous", "applied"),
    [
        (1, 2, 2, 2),  # one block: "previous" is the whole basis
        (2, 4, 2, 4),
        (3, 5, 4, 5),  # the second start column's Krylov space (dimension 2) is exhausted: width 1
        (4, 6, 5, 6),
    ],
)
def test_krylov_counters_on_invariant_subspaces(steps: int, size: int, previous: int, applied: int) -> None:
    matrix, apply = diagonal_apply([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    # Krylov spaces: span(e1..e4) from the first column (dim 4), span(e5, e6) from the second (dim 2)
    start = torch.cat([unit(8, 0, 1, 2, 3), unit(8, 4, 5)], dim=1)
    basis, compressed, coords, prev, done = _krylov(apply, start, steps)  # type: ignore[arg-type]
    assert (basis.shape[1], prev, done) == (size, previous, applied)
    assert torch.allclose(basis.T @ basis, torch.eye(size, dtype=F64), atol=1e-12)
    assert torch.allclose(compressed, basis.T @ matrix @ basis, atol=1e-12)
    assert torch.allclose(coords, basis.T @ start, atol=1e-12)


def test_krylov_from_a_single_column() -> None:
    _, apply = diagonal_apply([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    basis, _, coords, prev, done = _krylov(apply, unit(6, 0, 1), 2)  # type: ignore[arg-type]
    assert (basis.shape[1], prev, done) == (2, 1, 2)
    assert torch.allclose(basis @ coords, unit(6, 0, 1), atol=1e-12)


def test_krylov_stops_at_an_exactly_invariant_space() -> None:
    """A symmetric swap of e1 and e2 in R^3: from e1 the space {e1, e2} is invariant in exact
    arithmetic (every number here is exact), so the third block is empty and the loop stops."""
    swap = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 5.0]], dtype=F64)
    basis, compressed, coords, prev, done = _krylov(lambda b: swap @ b, unit(3, 0), 6)
    assert (basis.shape[1], prev, done) == (2, 1, 2)
    assert torch.equal(compressed.abs(), torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=F64))
    assert torch.equal(coords.abs(), torch.tensor([[1.0], [0.0]], dtype=F64))


def test_krylov_stops_when_the_basis_fills_the_space() -> None:
    gen = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=gen, dtype=F64))
    matrix = q @ torch.diag(torch.tensor([1.0, 3.0, 7.0, 20.0], dtype=F64)) @ q.T
    start = torch.randn(4, 2, generator=gen, dtype=F64)
    basis, compressed, _, prev, done = _krylov(lambda b: matrix @ b, start, 5)
    assert (basis.shape[1], prev, done) == (4, 2, 4)
    assert torch.allclose(torch.linalg.eigvalsh(compressed), torch.tensor([1.0, 3.0, 7.0, 20.0], dtype=F64))


def test_krylov_in_one_dimension() -> None:
    basis, compressed, coords, prev, done = _krylov(lambda b: 2.0 * b, torch.tensor([[3.0]], dtype=F64), 3)
    assert (basis.shape, prev, done) == ((1, 1), 1, 1)
    assert float(compressed) == pytest.approx(2.0) and float(coords.abs()) == pytest.approx(3.0)


def test_krylov_compression_is_symmetric_and_read_off_the_projections() -> None:
    """The compression assembled from the Gram–Schmidt projections (upper blocks, mirrored) equals
    Vᵀ A V of the dense matrix, blocks below the diagonal included, and is exactly symmetric."""
    gen = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(30, 30, generator=gen, dtype=F64))
    matrix = q @ torch.diag(torch.logspace(-3, 0, 30, dtype=F64)) @ q.T
    basis, compressed, _, prev, done = _krylov(lambda b: matrix @ b, torch.randn(30, 3, generator=gen, dtype=F64), 4)
    assert (basis.shape[1], prev, done) == (12, 9, 12)
    assert torch.equal(compressed, compressed.T)
    assert torch.allclose(compressed, basis.T @ matrix @ basis, atol=1e-13)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-12), (torch.float32, 1e-4)])
def test_inverse_applies_the_inverse_of_the_factored_matrix(dtype: torch.dtype, tolerance: float) -> None:
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(40, 40, generator=gen, dtype=F64)
    matrix = a @ a.T + 40.0 * torch.eye(40, dtype=F64)
    factor, info = shifted_cholesky(matrix, 0.0, dtype)
    assert info == 0 and factor.dtype == dtype
    block = torch.randn(40, 5, generator=gen, dtype=F64)
    image = _inverse(factor)(block)
    assert image.dtype == F64
    exact = torch.linalg.solve(matrix, block)
    assert float(torch.linalg.matrix_norm(image - exact)) <= tolerance * float(torch.linalg.matrix_norm(exact))


# --- _estimates and _gcv --------------------------------------------------------------------------


def spectral_weights(
    gram: torch.Tensor, sums: torch.Tensor, probes: torch.Tensor, centre: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eigenvalues of A = (G + γ_c I)⁻¹ and the squared projections of C (summed) and of each probe."""
    lam, vectors = torch.linalg.eigh(gram)
    return 1.0 / (lam + centre), ((vectors.T @ sums) ** 2).sum(dim=1), (vectors.T @ probes) ** 2


def test_estimates_equal_the_dense_rss_and_df_and_clamp_rss_at_zero() -> None:
    gram, sums, yty = regression(6, 20, 2, noise=0.01, seed=2)
    probes = rademacher(6, 3, seed=4)
    gammas = torch.tensor([1e-4, 0.01, 0.5, 2.0, 30.0], dtype=F64)
    centre = 2.0
    theta, wc, wz = spectral_weights(gram, sums, probes, centre)
    rss, df = _estimates(theta, wc, wz, centre, gammas, float(yty))
    expected = [dense_rss(gram, sums, float(yty), g) for g in gammas.tolist()]
    assert expected[0] < 1.0  # RSS below 1: a clamp at 1 would show
    assert torch.allclose(rss, torch.tensor(expected, dtype=F64), rtol=1e-8, atol=1e-12)
    for i, g in enumerate(gammas.tolist()):
        assert torch.allclose(df[i], dense_df(gram, probes, g), rtol=1e-10)
    zero, _ = _estimates(theta, wc, wz, centre, gammas, 0.0)  # "tr YᵀY" too small: RSS clamps at 0
    assert torch.equal(zero, torch.zeros_like(zero))


def test_gcv_values_and_no_room() -> None:
    n = 10
    rss = torch.tensor([2.0, 0.0, 3.0, 4.0], dtype=F64)
    df = torch.tensor([n - 0.5, float(n), n + 1.0, 6.0], dtype=F64)
    out = _gcv(rss, df, n)
    assert out.tolist() == [n * 2.0 / 0.25, math.inf, math.inf, n * 4.0 / 16.0]


# --- _coarse_centre -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_coarse_centre_is_the_exact_minimum_when_the_krylov_space_is_everything(seed: int) -> None:
    dim, samples, classes = 8, 30, 2
    gram, sums, yty = regression(dim, samples, classes, noise=1.0, seed=seed)
    probes = rademacher(dim, 2, seed=seed + 10)
    start = torch.cat([sums, probes], dim=1)  # 4 columns, 2 blocks: the whole of R^8
    gammas = torch.logspace(-3, 3, 241, dtype=F64)
    gcv = []
    for g in gammas.tolist():
        df = float(dense_df(gram, probes, g).mean())
        gcv.append(samples * dense_rss(gram, sums, float(yty), g) / (samples - df) ** 2)
    best = min(range(len(gcv)), key=gcv.__getitem__)
    assert 0 < best < len(gcv) - 1
    assert _coarse_centre(gram, start, classes, samples, float(yty), gammas, 2) == gammas[best].item()


# --- _one_centre ----------------------------------------------------------------------------------


def test_one_centre_without_a_factor_is_empty() -> None:
    found = _one_centre(
        -10.0 * torch.eye(4, dtype=F64), torch.ones(4, 2, dtype=F64), 1, 10, 1.0, torch.ones(3, dtype=F64), 1.0, 3
    )
    assert found.rows == [] and found.factor is None and found.solved == 0
    assert found.quadrature.numel() == 0 and found.per_probe.numel() == 0


def test_one_centre_in_the_whole_space_is_exact_and_states_only_the_probes_error() -> None:
    dim, rows, classes, nprobes = 8, 8, 2, 4
    samples = 7  # n below M: df crosses n at small γ, where the validity rule bites
    gram, sums, yty = regression(dim, rows, classes, noise=0.3, seed=5)
    probes = rademacher(dim, nprobes, seed=6)
    start = torch.cat([sums, probes], dim=1)  # 6 columns: two blocks fill R^8
    gammas = torch.logspace(-6, 3, 400, dtype=F64)
    centre = float(gammas[200])
    found = _one_centre(gram, start, classes, samples, float(yty), gammas, centre, 3)
    assert found.solved == dim
    # RSS = tr(YᵀY) − (fitted part): its absolute rounding is about tr(YᵀY)·κ(G + γ_c I)·ε
    eigenvalues = torch.linalg.eigvalsh(gram)
    condition = float((eigenvalues.max() + centre) / (eigenvalues.min() + centre))
    rounding = float(yty) * condition * torch.finfo(F64).eps
    bands = {"valid": 0, "within 3 se": 0, "3 to 4 se": 0, "room < 1": 0}
    for i, (row, g) in enumerate(zip(found.rows, gammas.tolist(), strict=True)):
        per = dense_df(gram, probes, g)
        df, se = float(per.mean()), statistics.stdev(per.tolist()) / math.sqrt(nprobes)
        rss = dense_rss(gram, sums, float(yty), g)
        assert row.gamma == g
        assert row.rss == pytest.approx(rss, rel=1e-7, abs=rounding)
        assert row.df == pytest.approx(df, rel=1e-9)
        room = samples - df
        if abs(room) > 1e-6:  # not on the edge n = df, where rounding decides
            assert row.gcv == (pytest.approx(samples * rss / room**2, rel=1e-6) if room > 0 else math.inf)
        for d, value in zip(per.tolist(), found.per_probe[i].tolist(), strict=True):
            if abs(samples - d) > 1e-6:  # not on the edge n = df, where rounding decides
                expected = samples * rss / (samples - d) ** 2 if d < samples else math.inf
                assert value == pytest.approx(expected, rel=1e-6)
        if df + 3.0 * se < samples:
            bands["valid"] += 1
            bands["room < 1"] += room < 1.0
            assert float(found.quadrature[i]) == 0.0
            assert row.error == pytest.approx(6.0 * se / room, rel=1e-6)
        else:
            bands["within 3 se"] += df < samples
            assert float(found.quadrature[i]) == math.inf and row.error == math.inf
        bands["3 to 4 se"] += df + 3.0 * se < samples <= df + 4.0 * se
    assert all(count > 0 for count in bands.values()), bands  # every case of the validity rule is met


def test_one_centre_from_an_invariant_start_states_an_infinite_quadrature_error() -> None:
    gram = torch.diag(torch.linspace(1.0, 10.0, 6, dtype=F64))
    start = torch.cat([unit(6, 0), unit(6, 1), unit(6, 2)], dim=1)  # one block spans an eigenspace
    found = _one_centre(gram, start, 1, 50, 100.0, torch.tensor([0.5, 1.0, 2.0], dtype=F64), 1.0, 4)
    assert found.solved == 3
    assert all(row.error == math.inf for row in found.rows)
    assert torch.equal(found.quadrature, torch.full((3,), math.inf, dtype=F64))


def test_one_centre_quadrature_error_is_the_change_from_one_block_fewer() -> None:
    dim, samples, classes = 30, 60, 1
    gram, sums, yty = regression(dim, samples, classes, noise=0.01, seed=7)
    start = torch.cat([sums, rademacher(dim, 2, seed=8)], dim=1)
    gammas = torch.logspace(-4, 2, 25, dtype=F64)
    centre = float(gammas[12])
    found = _one_centre(gram, start, classes, samples, float(yty), gammas, centre, 3)
    fewer = _one_centre(gram, start, classes, samples, float(yty), gammas, centre, 2)
    assert found.solved == 9 and fewer.solved == 6
    small_rss = 0
    for i, (row, prev) in enumerate(zip(found.rows, fewer.rows, strict=True)):
        room = samples - row.df
        quadrature = abs(row.rss - prev.rss) / row.rss + 2.0 * abs(row.df - prev.df) / room
        assert float(found.quadrature[i]) == pytest.approx(quadrature, rel=1e-6, abs=1e-12)
        small_rss += row.rss < 1.0 and quadrature > 0.0
    assert small_rss > 0
    for row, q in zip(found.rows, found.quadrature.tolist(), strict=True):  # error = quadrature + probes'
        assert row.error >= q and (math.isfinite(row.error) == math.isfinite(q))


def test_one_centre_treats_a_slightly_negative_eigenvalue_as_zero() -> None:
    """Ritz values of A are clamped to (0, 1/γ_c]: a negative eigenvalue of G (rounding in a Gram
    matrix) counts as 0, i.e. the estimates are those of G with that eigenvalue replaced by 0."""
    dim, centre = 6, 0.5
    gen = torch.Generator().manual_seed(11)
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=F64))
    lam = torch.tensor([-0.75 * centre, 0.3, 1.0, 2.0, 5.0, 9.0], dtype=F64)
    gram = q @ torch.diag(lam) @ q.T
    gram = 0.5 * (gram + gram.T)
    clipped = q @ torch.diag(lam.clamp_min(0.0)) @ q.T
    sums = torch.randn(dim, 1, generator=gen, dtype=F64)
    probes = rademacher(dim, 3, seed=12)
    gammas = torch.tensor([0.2, 0.5, 1.0, 4.0], dtype=F64)
    found = _one_centre(gram, torch.cat([sums, probes], dim=1), 1, 100, 50.0, gammas, centre, 3)
    for row, g in zip(found.rows, gammas.tolist(), strict=True):
        assert row.rss == pytest.approx(dense_rss(clipped, sums, 50.0, g), rel=1e-8)
        assert row.df == pytest.approx(float(dense_df(clipped, probes, g).mean()), rel=1e-8)


# --- _margin --------------------------------------------------------------------------------------


def test_margin_is_the_worst_paired_difference_plus_three_standard_errors_and_quadrature() -> None:
    gcv = [5.0, 4.0, 3.0, 3.2, 3.05]
    per_probe = torch.tensor(
        [
            [5.1, 4.9, 5.0, 5.2],
            [4.0, 4.1, 3.8, 4.1],
            [3.0, 3.1, 2.9, 3.0],
            [3.1, 3.3, 3.2, 3.2],
            [3.0, 3.2, 2.9, 3.1],
        ],
        dtype=F64,
    )
    quadrature = torch.tensor([0.01, 0.002, 0.001, 0.003, 0.004], dtype=F64)
    rows = [KrylovRow(float(i), 1.0, 1.0, v, 0.0) for i, v in enumerate(gcv)]
    found = _Centre(rows, None, 0, quadrature, per_probe)

    def bound(best: int, j: int) -> float:
        paired = [a - b for a, b in zip(per_probe[best].tolist(), per_probe[j].tolist(), strict=True)]
        spread = 3.0 * statistics.stdev(paired) / 2.0
        return gcv[best] - gcv[j] + spread + float(quadrature[best]) * gcv[best] + float(quadrature[j]) * gcv[j]

    expected = max(bound(2, j) for j in (0, 1, 3, 4)) / gcv[2]
    assert bound(2, 4) > max(bound(2, 0), bound(2, 1), bound(2, 3))  # the worst is after the best
    assert _margin(found, 2, range(5)) == pytest.approx(expected, rel=1e-12)
    assert _margin(found, 2, range(1, 4)) == pytest.approx(max(bound(2, 1), bound(2, 3)) / gcv[2], rel=1e-12)
    assert _margin(found, 2, range(2, 3)) == -math.inf  # no other point: nothing to be worse than


# --- krylov_gcv -----------------------------------------------------------------------------------


def random_features(dim: int, samples: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, 16, generator=gen)
    labels = torch.randint(0, classes, (samples,), generator=gen)
    inputs = means[labels] + torch.randn(samples, 16, generator=gen)
    phi = torch.relu(inputs @ torch.randn(16, dim, generator=gen) / 4.0 + torch.randn(dim, generator=gen)).double()
    gram = phi.T @ phi
    return 0.5 * (gram + gram.T), phi.T @ torch.nn.functional.one_hot(labels, classes).double()


GRID = torch.logspace(-4, 4, 33, dtype=F64)


def test_search_without_a_factor_reports_nothing_else() -> None:
    gram, sums = random_features(16, 100, 3, seed=0)
    found = krylov_gcv(gram - 1e6 * torch.eye(16, dtype=F64), sums, 100, 100.0, GRID, centre=1.0)
    assert found.rows == [] and found.centres == [1.0] and found.block_solves == 0 and math.isnan(found.margin)
    assert found.reason == "G + 1·I has no Cholesky factor"


def test_block_solves_add_up_over_the_centres() -> None:
    dim, samples, classes, probes, steps = 64, 500, 4, 4, 4
    gram, sums = random_features(dim, samples, classes, seed=1)
    found = krylov_gcv(gram, sums, samples, float(samples), GRID, centre=1e-4, probes=probes, steps=steps)
    assert found.gamma is not None, found.reason
    assert len(found.centres) >= 2 and found.centres[0] == 1e-4
    assert found.block_solves == len(found.centres) * (classes + probes) * steps  # no column ever vanishes
    assert (found.factor is not None) == (found.gamma == found.centres[-1])
    if found.factor is not None:
        assert torch.allclose(found.factor @ found.factor.T, gram + found.gamma * torch.eye(dim, dtype=F64))


def accurate_window(quadrature: list[float], centre: float) -> tuple[int, int, int, list[bool]]:
    """(index of the centre, first and last index of the run of grid points around it whose
    quadrature error is <= 1e-3, which points are accurate), computed directly from the rows."""
    usable = [float(q) <= 1e-3 for q in quadrature]
    here = GRID.tolist().index(centre)
    low = high = here
    while low - 1 >= 0 and usable[low - 1]:
        low -= 1
    while high + 1 < len(usable) and usable[high + 1]:
        high += 1
    return here, low, high, usable


def test_the_window_is_the_run_of_accurate_points_around_the_centre_and_the_margin_is_over_it() -> None:
    dim, samples, classes, probes, steps = 64, 500, 4, 4, 4
    gram, sums = random_features(dim, samples, classes, seed=3)
    found = krylov_gcv(gram, sums, samples, float(samples), GRID, centre=1e-4, probes=probes, steps=steps)
    start = torch.cat([sums, rademacher(dim, probes, seed=0)], dim=1)  # the documented seeded probes
    centre = found.centres[-1]
    last = _one_centre(gram, start, classes, samples, float(samples), GRID, centre, steps)
    assert last.rows == found.rows
    here, low, high, usable = accurate_window(last.quadrature, centre)
    assert 0 < low < here < high < len(usable) - 1  # a window strictly inside the grid
    best = min(range(low, high + 1), key=lambda i: found.rows[i].gcv)
    assert low < best < high
    margin = _margin(last, best, range(low, high + 1))
    assert found.margin == margin and margin > 1e-3
    assert found.gamma is None and found.factor is None
    assert found.reason == (
        f"the probes cannot tell γ = {GRID[best].item():g} from its neighbours: GCV may be "
        f"{margin:.2g} (relative) above another grid point's"
    )


def test_a_least_gcv_at_the_centre_on_the_window_edge_gives_up_with_that_reason() -> None:
    dim, samples, classes, probes, steps = 64, 500, 4, 4, 3
    gram, sums = random_features(dim, samples, classes, seed=1)
    found = krylov_gcv(gram, sums, samples, float(samples), GRID, centre=1e-4, probes=probes, steps=steps)
    centre = found.centres[-1]
    start = torch.cat([sums, rademacher(dim, probes, seed=0)], dim=1)
    last = _one_centre(gram, start, classes, samples, float(samples), GRID, centre, steps)
    here, low, high, usable = accurate_window(last.quadrature, centre)
    best = min(range(low, high + 1), key=lambda i: last.rows[i].gcv)
    assert best == here and (low == here or high == here) and low > 0 and high < len(usable) - 1
    assert found.gamma is None and found.rows == last.rows
    assert found.reason == f"GCV is least at γ_c = {centre:g}, at the edge of its accurate window"
    assert found.block_solves == len(found.centres) * (classes + probes) * steps


def test_a_search_that_keeps_moving_stops_after_max_centres() -> None:
    dim, samples, classes, probes, steps = 64, 500, 4, 4, 3
    gram, sums = random_features(dim, samples, classes, seed=2)
    grid = torch.logspace(-4, 4, 65, dtype=F64)
    found = krylov_gcv(gram, sums, samples, float(samples), grid, centre=1e-4, probes=probes, steps=steps)
    assert found.gamma is None and len(found.centres) == 5  # the default max_centres
    assert found.reason == f"no interior minimum after 5 centres {found.centres}"
    assert found.block_solves == 5 * (classes + probes) * steps
    fewer = krylov_gcv(
        gram, sums, samples, float(samples), grid, centre=1e-4, probes=probes, steps=steps, max_centres=3
    )
    assert fewer.centres == found.centres[:3] and fewer.reason == f"no interior minimum after 3 centres {fewer.centres}"


def test_float32_inputs_and_integer_grids_give_the_float64_search() -> None:
    gram, sums = random_features(24, 300, 3, seed=2)
    reference = krylov_gcv(gram, sums, 300, 300.0, [1, 10, 100, 1000, 10000], centre=100)
    assert all(type(c) is float for c in reference.centres)  # an integer grid still gives float γ
    lowered = krylov_gcv(gram.float(), sums.float(), 300, 300.0, [1.0, 10.0, 100.0, 1000.0, 10000.0], centre=100.0)
    as64 = krylov_gcv(gram.float().double(), sums.float().double(), 300, 300.0, [1.0, 10.0, 100.0, 1000.0, 10000.0])
    as64_centred = krylov_gcv(
        gram.float().double(), sums.float().double(), 300, 300.0, [1.0, 10.0, 100.0, 1000.0, 10000.0], centre=100.0
    )
    assert lowered.rows == as64_centred.rows
    lowered_coarse = krylov_gcv(gram.float(), sums.float(), 300, 300.0, [1.0, 10.0, 100.0, 1000.0, 10000.0])
    assert lowered_coarse.rows == as64.rows and lowered_coarse.centres == as64.centres


def test_the_default_seed_is_zero() -> None:
    gram, sums = random_features(16, 200, 3, seed=3)
    assert krylov_gcv(gram, sums, 200, 200.0, GRID).rows == krylov_gcv(gram, sums, 200, 200.0, GRID, seed=0).rows


def test_smallest_accepted_inputs() -> None:
    gram, sums = random_features(16, 200, 3, seed=4)
    found = krylov_gcv(gram, sums, 200, 200.0, GRID, probes=2, steps=2)
    assert len(found.rows) == len(GRID) and found.centres
    one = krylov_gcv(gram, sums, 1, 200.0, GRID, centre=1.0, max_centres=1)  # n = 1 is a valid count
    assert one.centres == [1.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_samples": 0}, "num_samples must be positive, got 0"),
        ({"grid": [1.0, 0.0]}, "grid must be a non-empty 1-D sequence of positive values"),
        ({"grid": [[1.0, 2.0]]}, "grid must be a non-empty 1-D sequence of positive values"),
        ({"probes": 1, "steps": 2}, "probes and steps must be >= 2, got 1 and 2"),
        ({"probes": 2, "steps": 1}, "probes and steps must be >= 2, got 2 and 1"),
    ],
)
def test_refusals_are_these_exact_messages(kwargs: dict[str, object], message: str) -> None:
    gram, sums = random_features(8, 50, 2, seed=0)
    args: dict[str, object] = {"num_samples": 50, "grid": GRID, **kwargs}
    with pytest.raises(AnalyticInputError) as caught:
        krylov_gcv(gram, sums, yty=50.0, **args)  # type: ignore[arg-type]
    assert str(caught.value) == message


def whole_space_problem() -> tuple[torch.Tensor, torch.Tensor, float]:
    """M = 8 and 2 classes + 6 probes: one block is the whole space, quadrature exact everywhere."""
    gram, sums, yty = regression(8, 400, 2, noise=1.0, seed=9)
    return gram, sums, float(yty)


def test_exact_quadrature_is_usable_at_zero_tolerance_and_a_margin_equal_to_the_tolerance_certifies() -> None:
    gram, sums, yty = whole_space_problem()
    n = 400
    grid = torch.logspace(-3, 4, 57, dtype=F64)
    loose = krylov_gcv(gram, sums, n, yty, grid, probes=6, tolerance=1.0)
    assert loose.gamma is not None and loose.margin >= 0.0, loose.reason
    exact_window = krylov_gcv(gram, sums, n, yty, grid, probes=6, tolerance=0.0)
    assert not exact_window.reason.startswith("GCV's quadrature error")  # zero error is within zero
    assert exact_window.reason.startswith("the probes cannot tell")
    tight = krylov_gcv(gram, sums, n, yty, grid, probes=6, tolerance=loose.margin)
    assert tight.gamma == loose.gamma and tight.margin == loose.margin


def dense_gcv(gram: torch.Tensor, sums: torch.Tensor, yty: float, n: int, probes: torch.Tensor, gamma: float) -> float:
    """GCV with df by Hutchinson's estimator over ``probes`` and the exact RSS."""
    return n * dense_rss(gram, sums, yty, gamma) / (n - float(dense_df(gram, probes, gamma).mean())) ** 2


@pytest.mark.parametrize("offset", [-1, 0, 1, 3])
def test_in_the_whole_space_a_short_grid_gives_its_least_gcv_point_even_at_its_ends(offset: int) -> None:
    """With quadrature exact every point is usable: the window is the whole grid, and its least-GCV
    point is chosen even at the grid's first or last point (there is nothing beyond to move to)."""
    gram, sums, yty = whole_space_problem()
    n, probes = 400, 6
    fine = torch.logspace(-3, 4, 57, dtype=F64).tolist()
    z = rademacher(8, probes, seed=0)
    curve = [dense_gcv(gram, sums, yty, n, z, g) for g in fine]
    k = min(range(len(curve)), key=curve.__getitem__)
    assert 3 < k < len(fine) - 4
    grid = fine[k + offset - 1 : k + offset + 2]  # three points: around, above or below the minimum
    values = curve[k + offset - 1 : k + offset + 2]
    expected = grid[min(range(3), key=values.__getitem__)]
    for centre in grid:
        found = krylov_gcv(gram, sums, n, yty, grid, centre=centre, probes=probes, tolerance=1.0)
        assert found.gamma == expected, found.reason
        assert found.centres == [centre]
        assert (found.factor is not None) == (expected == centre)  # the factor is kept for γ = γ_c only


def test_no_centres_no_rows() -> None:
    gram, sums, yty = whole_space_problem()
    found = krylov_gcv(gram, sums, 400, yty, [1.0, 10.0], centre=1.0, max_centres=0)
    assert found.rows == [] and found.centres == [] and found.reason == "no interior minimum after 0 centres []"


# --- precision (float32 search) -------------------------------------------------------------------


def test_krylov_keeps_the_basis_orthonormal_when_the_images_nearly_lie_in_it() -> None:
    """A = I + 10⁻⁷·D: every image A V_k is V_k up to 10⁻⁷, so one Gram–Schmidt pass cancels all
    but 10⁻⁷ of it and leaves rounding of relative size 10⁻⁹; the second pass restores
    orthonormality to 10⁻¹³."""
    gen = torch.Generator().manual_seed(5)
    q, _ = torch.linalg.qr(torch.randn(60, 60, generator=gen, dtype=F64))
    matrix = q @ torch.diag(1.0 + 1e-7 * torch.rand(60, generator=gen, dtype=F64)) @ q.T
    basis, _, _, _, done = _krylov(lambda b: matrix @ b, torch.randn(60, 4, generator=gen, dtype=F64), 5)
    assert done == basis.shape[1] == 20
    assert float((basis.T @ basis - torch.eye(20, dtype=F64)).abs().max()) <= 1e-13


def test_factor_solve_works_in_the_factors_dtype() -> None:
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(30, 30, generator=gen, dtype=F64)
    factor, _ = shifted_cholesky(a @ a.T, 30.0, torch.float32)
    rhs = torch.randn(30, 3, generator=gen, dtype=F64)
    solved = factor_solve(factor, rhs)
    assert solved.dtype == torch.float32
    assert torch.equal(solved, factor_solve(factor, rhs.float()))


def test_ridge_rss_reads_float32_inputs_exactly_in_float64() -> None:
    gen = torch.Generator().manual_seed(7)
    weights, sums = torch.randn(20, 3, generator=gen), torch.randn(20, 3, generator=gen)
    assert ridge_rss(sums, weights, 50.0, 0.3) == ridge_rss(sums.double(), weights.double(), 50.0, 0.3)
    w, c = weights.double(), sums.double()
    assert ridge_rss(sums, weights, 50.0, 0.3) == pytest.approx(
        50.0 - float((w * c).sum()) - 0.3 * float((w * w).sum()), rel=1e-15
    )


def test_a_float32_search_factorises_and_estimates_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """dtype reaches the coarse products and every centre's factor; the float32 rows then differ
    from the float64 ones by rounding (and only the float64 search hands its factor back)."""
    import fcl_flower.analytic.ridge_krylov as module

    seen: list[torch.dtype] = []
    coarse, cholesky = module._coarse_centre, module.shifted_cholesky

    def spy_coarse(gram: torch.Tensor, *args: object) -> float:
        seen.append(gram.dtype)
        return coarse(gram, *args)  # type: ignore[arg-type]

    def spy_cholesky(gram: torch.Tensor, shift: float, dtype: torch.dtype = F64) -> tuple[torch.Tensor, int]:
        seen.append(dtype)
        return cholesky(gram, shift, dtype)

    monkeypatch.setattr(module, "_coarse_centre", spy_coarse)
    monkeypatch.setattr(module, "shifted_cholesky", spy_cholesky)
    gram, sums, yty = regression(40, 400, 3, noise=0.5, seed=4)
    narrow = krylov_gcv(gram, sums, 400, float(yty), torch.logspace(-2, 3, 11, dtype=F64), dtype=torch.float32)
    assert seen and set(seen) == {torch.float32}
    seen.clear()
    wide = krylov_gcv(gram, sums, 400, float(yty), torch.logspace(-2, 3, 11, dtype=F64))
    assert set(seen) == {F64}
    assert narrow.centres == wide.centres and narrow.factor is None
    assert any(a.gcv != b.gcv for a, b in zip(narrow.rows, wide.rows, strict=True))


@pytest.mark.parametrize(
    ("estimate", "exact", "error", "expected"),
    [
        (1.5, 1.0, 0.5, (True, 0.5)),  # exactly at the stated error: agrees
        (1.5, 1.0, 0.25, (False, 0.5)),
        (0.5, 0.25, 0.99, (False, 1.0)),  # relative to a small exact RSS, not to 1
        (0.24, 0.25, 0.05, (True, pytest.approx(0.04))),
    ],
)
def test_rss_agreement_is_the_relative_deviation_within_the_stated_error(
    estimate: float, exact: float, error: float, expected: tuple[bool, float]
) -> None:
    assert rss_agreement(estimate, exact, error) == expected


def test_rss_agreement_with_a_zero_exact_rss_agrees_only_with_zero() -> None:
    assert rss_agreement(0.0, 0.0, 0.0) == (True, 0.0)
    agrees, deviation = rss_agreement(1e-200, 0.0, 1e-3)
    assert not agrees and deviation == pytest.approx(1e100)
