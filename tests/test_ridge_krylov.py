"""GCV's ridge by shift-invert block Krylov (fcl_flower/analytic/ridge_krylov.py) against the exact
eigendecomposition scan (select_ridge_gcv), on random-feature statistics built here."""

from __future__ import annotations

import math

import pytest
import torch

from fcl_flower.analytic.errors import AnalyticInputError
from fcl_flower.analytic.ridge import (
    KRYLOV_DTYPE,
    KRYLOV_FROM_DIM,
    KRYLOV_SAMPLES_PER_DIM,
    RidgeState,
    default_ridge_grid,
    factorable_floor,
    ridge_residual,
    select_ridge_gcv,
    solve_ridge,
    uses_krylov,
)
from fcl_flower.analytic.ridge_krylov import KrylovGCV, KrylovRow, krylov_gcv, ridge_rss


def random_feature_statistics(
    dim: int, samples: int, classes: int, *, seed: int = 0, spread: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """G = ΦᵀΦ and C = ΦᵀY of ReLU random features of a Gaussian mixture (one mean per class)."""
    gen = torch.Generator().manual_seed(seed)
    width = 32
    means = torch.randn(classes, width, generator=gen) * spread
    labels = torch.randint(0, classes, (samples,), generator=gen)
    inputs = means[labels] + torch.randn(samples, width, generator=gen)
    projection = torch.randn(width, dim, generator=gen) / math.sqrt(width)
    phi = torch.relu(inputs @ projection + torch.randn(dim, generator=gen)).double()
    gram = phi.T @ phi
    return 0.5 * (gram + gram.T), phi.T @ torch.nn.functional.one_hot(labels, classes).double()


CASES = [
    (256, 3000, 10, 0, 1.0),
    (384, 4000, 20, 1, 3.0),
    (384, 4000, 20, 2, 0.3),
    (512, 6000, 30, 3, 1.0),
    (512, 1024, 20, 9, 1.0),  # n = 2 M: GCV's denominator n - df is small
]


@pytest.mark.parametrize(("dim", "samples", "classes", "seed", "spread"), CASES)
def test_krylov_choice_equals_the_exact_scan_and_its_errors_are_within_the_stated_ones(
    dim: int, samples: int, classes: int, seed: int, spread: float
) -> None:
    gram, sums = random_feature_statistics(dim, samples, classes, seed=seed, spread=spread)
    exact_gamma, exact_rows = select_ridge_gcv(gram, sums, samples, float(samples))
    found = krylov_gcv(gram, sums, samples, float(samples), default_ridge_grid())
    assert found.gamma == exact_gamma, found.reason
    assert found.margin <= 1e-3
    exact = {row.gamma: row for row in exact_rows}
    usable = [row for row in found.rows if row.error <= 1e-2]
    assert len(usable) >= 3  # the chosen point and a neighbour on each side
    for row in usable:  # the per-row stated error (3 standard errors, from 16 probes) is calibrated within 2x
        assert abs(row.gcv / exact[row.gamma].gcv - 1.0) <= 2.0 * row.error
    # the certified margin bounds the exact GCV differences inside the window
    chosen = exact[exact_gamma].gcv
    for row in found.rows:
        if row.error <= 1e-2 and row.gamma != exact_gamma:
            assert (chosen - exact[row.gamma].gcv) / chosen <= max(found.margin, 0.0) + 1e-12
    centre = found.centres[-1]
    assert found.rows[[r.gamma for r in found.rows].index(centre)].rss == pytest.approx(exact[centre].rss, rel=1e-9)


def test_rss_at_the_centre_is_exact_and_only_df_carries_the_probes_error() -> None:
    gram, sums = random_feature_statistics(256, 2500, 8, seed=5)
    grid = default_ridge_grid()
    _, exact_rows = select_ridge_gcv(gram, sums, 2500, 2500.0)
    for centre in (1.0, 100.0, 1e4):
        found = krylov_gcv(gram, sums, 2500, 2500.0, grid, centre=centre, max_centres=1)
        row = next(r for r in found.rows if r.gamma == centre)
        truth = next(r for r in exact_rows if r.gamma == centre)
        assert row.rss == pytest.approx(truth.rss, rel=1e-9, abs=1e-9)
        assert abs(row.df - truth.df) <= 4.0 * math.sqrt(2.0 * truth.df / 16) + 1e-6  # Hutchinson's spread


def test_same_seed_same_numbers_and_another_seed_the_same_choice() -> None:
    gram, sums = random_feature_statistics(256, 3000, 10, seed=7)
    grid = default_ridge_grid()
    first = krylov_gcv(gram, sums, 3000, 3000.0, grid, seed=0)
    again = krylov_gcv(gram, sums, 3000, 3000.0, grid, seed=0)
    other = krylov_gcv(gram, sums, 3000, 3000.0, grid, seed=1)
    assert first.rows == again.rows and first.gamma == again.gamma
    assert other.gamma == first.gamma
    assert other.rows != first.rows  # other probes, other estimates


def test_an_uncertified_search_falls_back_to_the_exact_scan_with_its_reason() -> None:
    gram, sums = random_feature_statistics(256, 3000, 10, seed=0)
    exact_gamma, _ = select_ridge_gcv(gram, sums, 3000, 3000.0)
    found = krylov_gcv(gram, sums, 3000, 3000.0, default_ridge_grid(), tolerance=-1.0)  # nothing certifies
    assert found.gamma is None and found.factor is None
    assert found.reason.startswith(("GCV's quadrature error", "the probes cannot tell", "GCV is least"))
    state = RidgeState(gram.clone(), sums.clone(), 3000)
    weights, gamma, _ = state.solve(10, None, "krylov")
    assert gamma == exact_gamma
    assert torch.equal(weights, solve_ridge(gram, sums, exact_gamma))


def test_the_state_records_a_fallback() -> None:
    gram, sums = random_feature_statistics(64, 500, 4)
    state = RidgeState(gram - 1e6 * torch.eye(64, dtype=torch.float64), sums.clone(), 500, previous=1.0)
    _, gamma, table = state.solve(4, None, "krylov")  # the exact scan decides, above G's λ_min
    assert gamma >= factorable_floor(torch.linalg.eigvalsh(state.gram)) > 0.0
    assert [row.gamma for row in table] == [g for g in default_ridge_grid().tolist() if g >= table[0].gamma]
    assert state.selection["fallback"] == "G + 1·I has no Cholesky factor"
    assert state.selection["method"] == "krylov" and state.selection["centres"] == [1.0]


@pytest.mark.parametrize("previous", [None, 100.0, 3e3])
def test_state_solve_with_krylov_gives_the_exact_weights_and_reuses_the_previous_gamma(
    previous: float | None,
) -> None:
    gram, sums = random_feature_statistics(384, 4000, 12, seed=4)
    exact_gamma, _ = select_ridge_gcv(gram, sums, 4000, 4000.0)
    state = RidgeState(gram.clone(), sums.clone(), 4000, previous=previous)
    weights, gamma, table = state.solve(12, None, "krylov")
    assert gamma == exact_gamma and state.previous == gamma
    assert state.selection["method"] == "krylov" and "fallback" not in state.selection
    assert float(state.selection["margin"]) <= 1e-3  # type: ignore[arg-type]
    assert torch.equal(weights, solve_ridge(gram, sums, gamma))  # the same factor, the same bits
    assert [row.gamma for row in table] == default_ridge_grid().tolist()
    centres = state.selection["centres"]
    assert isinstance(centres, list)
    if previous is not None:
        nearest = min(default_ridge_grid().tolist(), key=lambda v: abs(math.log(v / previous)))
        assert centres[0] == nearest


def test_state_solve_exact_and_fixed_ridge_are_unchanged() -> None:
    gram, sums = random_feature_statistics(256, 3000, 6, seed=8)
    state = RidgeState(gram.clone(), sums.clone(), 3000)
    weights, gamma, table = state.solve(6, None, "exact")
    exact_gamma, exact_table = select_ridge_gcv(gram, sums, 3000, 3000.0)
    assert gamma == exact_gamma and table == exact_table and state.selection == {"method": "exact"}
    assert torch.equal(weights, solve_ridge(gram, sums, gamma))
    fixed, fixed_gamma, fixed_table = state.solve(6, 10.0, "krylov")
    assert fixed_gamma == 10.0 and fixed_table == [] and state.selection["method"] == "fixed"
    assert state.selection["certificate"] == "float32 factorisation"  # built without a bound: G + 2.5·I factorised
    assert torch.equal(fixed, solve_ridge(gram, sums, 10.0))


def test_selection_modes() -> None:
    enough = KRYLOV_SAMPLES_PER_DIM * KRYLOV_FROM_DIM
    assert not uses_krylov("exact", 10_000, 10**6)
    assert uses_krylov("krylov", 10, 5)
    assert uses_krylov("auto", KRYLOV_FROM_DIM, enough)
    assert not uses_krylov("auto", KRYLOV_FROM_DIM - 1, enough)
    assert not uses_krylov("auto", KRYLOV_FROM_DIM, enough - 1)
    with pytest.raises(AnalyticInputError, match="ridge selection must be auto, exact or krylov, got 'fast'"):
        uses_krylov("fast", 100, 1000)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_samples": 0}, "num_samples must be positive, got 0"),
        ({"grid": [1.0, -1.0]}, "grid must be a non-empty 1-D sequence of positive values"),
        ({"grid": []}, "grid must be a non-empty 1-D sequence of positive values"),
        ({"probes": 1}, "probes and steps must be >= 2, got 1 and 5"),
        ({"steps": 1}, "probes and steps must be >= 2, got 16 and 1"),
        ({"dtype": torch.float16}, "dtype must be torch.float32 or torch.float64, got torch.float16"),
    ],
)
def test_bad_inputs_are_one_line_errors(kwargs: dict[str, object], message: str) -> None:
    gram, sums = random_feature_statistics(64, 500, 4)
    args: dict[str, object] = {"num_samples": 500, "grid": default_ridge_grid(), **kwargs}
    with pytest.raises(AnalyticInputError, match=message):
        krylov_gcv(gram, sums, yty=500.0, **args)  # type: ignore[arg-type]


def test_an_indefinite_gram_at_the_centre_is_reported_not_raised() -> None:
    gram, sums = random_feature_statistics(64, 500, 4)
    gram = gram - 1e6 * torch.eye(64, dtype=torch.float64)
    found = krylov_gcv(gram, sums, 500, 500.0, default_ridge_grid(), centre=1.0)
    assert found.gamma is None and found.reason == "G + 1·I has no Cholesky factor"


def test_state_records_the_krylov_search_as_krylov_gcv_reports_it() -> None:
    gram, sums = random_feature_statistics(256, 3000, 6, seed=8)
    found = krylov_gcv(gram, sums, 3000, 3000.0, default_ridge_grid(), centre=None, dtype=KRYLOV_DTYPE)
    assert found.gamma is not None
    state = RidgeState(gram.clone(), sums.clone(), 3000)
    _, gamma, table = state.solve(6, None, "krylov")
    assert gamma == found.gamma
    searched = {"method", "centres", "block_solves", "margin", "stated_error", "rss_deviation"}
    assert set(state.selection) == searched | {"certificate", "certificate_seconds"}  # no bound: G + γ/2·I factorised
    assert str(state.selection["certificate"]).endswith(" factorisation")
    assert 0.0 <= float(state.selection["rss_deviation"]) <= float(state.selection["stated_error"])  # type: ignore[arg-type]
    assert state.selection["block_solves"] == found.block_solves and state.selection["centres"] == found.centres
    assert state.selection["stated_error"] == next(row.error for row in found.rows if row.gamma == found.gamma)
    assert [(r.gamma, r.rss, r.df, r.gcv) for r in table] == [(r.gamma, r.rss, r.df, r.gcv) for r in found.rows]


def test_state_auto_selection_is_exact_below_the_krylov_size_and_remembers_gamma() -> None:
    gram, sums = random_feature_statistics(64, 500, 4, seed=5)
    state = RidgeState(gram.clone(), sums.clone(), 500)
    _, gamma, table = state.solve(4, None, "auto")  # M = 64 < KRYLOV_FROM_DIM: the exact scan
    assert state.selection == {"method": "exact"} and state.previous == gamma
    assert (gamma, table) == select_ridge_gcv(gram, sums, 500, 500.0)


def test_state_solve_with_krylov_takes_float32_class_sums() -> None:
    """The state's class sums are solved in float64 whatever their dtype, on the Krylov path too."""
    gram, sums = random_feature_statistics(256, 3000, 6, seed=8)
    state = RidgeState(gram.clone(), sums.float(), 3000)
    weights, gamma, _ = state.solve(6, None, "krylov")
    assert weights.dtype == torch.float64 and torch.equal(weights, solve_ridge(gram, sums.float().double(), gamma))


@pytest.mark.parametrize(("dim", "samples", "classes", "seed", "spread"), CASES)
def test_a_float32_search_ranks_as_the_float64_one(
    dim: int, samples: int, classes: int, seed: int, spread: float
) -> None:
    """Float32 factors (the state's default) choose the float64 search's γ, from the same centres;
    every accurate row's GCV moves by less than 10⁻⁵ (relative; a few 10⁻⁶ at the smallest γ, where
    G + γI is worst conditioned), the chosen row's by less than a hundredth of its stated error;
    only a float64 search hands its factor back for the solve."""
    gram, sums = random_feature_statistics(dim, samples, classes, seed=seed, spread=spread)
    wide = krylov_gcv(gram, sums, samples, float(samples), default_ridge_grid())
    narrow = krylov_gcv(gram, sums, samples, float(samples), default_ridge_grid(), dtype=torch.float32)
    assert narrow.gamma == wide.gamma and narrow.centres == wide.centres, narrow.reason
    assert narrow.factor is None and (wide.factor is None or wide.factor.dtype == torch.float64)
    for a, b in zip(wide.rows, narrow.rows, strict=True):
        if a.error <= 1e-2:
            assert abs(b.gcv - a.gcv) <= 1e-5 * a.gcv
        if a.gamma == wide.gamma:
            assert abs(b.gcv - a.gcv) <= 0.01 * a.error * a.gcv and abs(b.rss - a.rss) <= 0.01 * a.error * a.rss


@pytest.mark.parametrize("ridge", [1e-2, 3.0, 1e3])
def test_ridge_rss_from_the_solution_alone_equals_the_residual_with_g(ridge: float) -> None:
    gram, sums = random_feature_statistics(128, 1500, 5, seed=6)
    weights = solve_ridge(gram, sums, ridge)
    direct = ridge_residual(gram, sums, weights, 1500.0)
    assert ridge_rss(sums, weights, 1500.0, ridge) == pytest.approx(direct, rel=1e-9)


def test_a_search_whose_rss_disagrees_with_the_float64_solution_is_not_trusted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Attack on the a-posteriori check: a search that reports an RSS at its γ further from the
    float64 solution's than its stated error (what a float32 factor too coarse for G would do) is
    overruled by the exact scan, with the reason recorded."""
    import fcl_flower.analytic.ridge as ridge_module

    real = ridge_module.krylov_gcv

    def skewed(*args: object, **kwargs: object) -> KrylovGCV:
        found = real(*args, **kwargs)  # type: ignore[arg-type]
        rows = [
            KrylovRow(r.gamma, r.rss * (1.0 + 3.0 * r.error), r.df, r.gcv, r.error) if r.gamma == found.gamma else r
            for r in found.rows
        ]
        return KrylovGCV(found.gamma, rows, found.centres, found.factor, found.reason, found.block_solves, found.margin)

    monkeypatch.setattr(ridge_module, "krylov_gcv", skewed)
    gram, sums = random_feature_statistics(256, 3000, 6, seed=8)
    state = RidgeState(gram.clone(), sums.clone(), 3000)
    weights, gamma, table = state.solve(6, None, "krylov")
    exact_gamma, exact_table = select_ridge_gcv(gram, sums, 3000, 3000.0)
    assert (gamma, table) == (exact_gamma, exact_table) and state.previous == exact_gamma
    reason = str(state.selection["fallback"])
    assert reason.startswith(f"the search's RSS at γ = {exact_gamma:g} is ") and "stated error" in reason
    assert float(state.selection["rss_deviation"]) > float(state.selection["stated_error"])  # type: ignore[arg-type]
    assert torch.equal(weights, solve_ridge(gram, sums, exact_gamma))
