"""The upload checks under noise (fcl_flower/analytic/checks.py), at their exact edges (issue 19).

The bounds are recomputed here from the formulas of the module doc, with the per-bound false
rejection p = 1e-9 / 10, and every widened check is tried just inside (passes) and just outside
(fails, with its one-line reason) of its bound. No expected value is read from checks.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fcl_flower.analytic.checks import (
    NoiseLevels,
    StatisticsRejected,
    check_class_sums,
    check_counts,
    check_gram_statistics,
    check_lowrank_statistics,
    noise_column_bound,
    noise_entry_bound,
    noise_norm_bound,
    noise_spectral_bound,
    noise_sum_bound,
)

P = 1e-10  # FALSE_REJECTION 1e-9 split over ten bounds
IN, OUT = 1 - 1e-6, 1 + 1e-6


def entry(std: float, n: int, p: float = P) -> float:
    return std * math.sqrt(2 * math.log(2 * n / p))


def norm(std: float, d: int, p: float = P) -> float:
    return std * (math.sqrt(d) + math.sqrt(2 * math.log(1 / p)))


def spectral(sg: float, sc: float, sn: float, m: int, c: int) -> float:
    v = max(sg * sg * m + sc * sc * c, sc * sc * m + sn * sn)
    return math.sqrt(2 * v * math.log(2 * (m + c) / P))


def t64(*rows: object) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# ------------------------------------------------------------------------------ the bounds
def test_the_bounds_by_hand() -> None:
    assert noise_entry_bound(2.0, 5) == pytest.approx(entry(2.0, 5), rel=1e-12)
    assert noise_entry_bound(2.0, 5, 1e-3) == pytest.approx(entry(2.0, 5, 1e-3), rel=1e-12)
    assert noise_norm_bound(0.5, 9) == pytest.approx(norm(0.5, 9), rel=1e-12)
    assert noise_norm_bound(0.5, 9, 0.01) == pytest.approx(0.5 * (3 + math.sqrt(2 * math.log(100))), rel=1e-12)
    # the sum of k i.i.d. N(0, σ²) is N(0, kσ²): one entry of std σ√k
    assert noise_sum_bound(0.5, 4) == pytest.approx(entry(1.0, 1), rel=1e-12)
    assert noise_sum_bound(0.5, 4, 1e-3) == pytest.approx(entry(1.0, 1, 1e-3), rel=1e-12)
    assert noise_sum_bound(0.5, 1) == pytest.approx(entry(0.5, 1), rel=1e-12)
    assert noise_sum_bound(0.5, -1) == 0.0  # no terms, no noise
    # a union bound over the columns
    assert noise_column_bound(0.5, 9, 4) == pytest.approx(norm(0.5, 9, P / 4), rel=1e-12)
    assert noise_column_bound(0.5, 9, 0) == pytest.approx(norm(0.5, 9), rel=1e-12)
    levels = NoiseLevels(gram=0.3, sums=0.2, counts=0.7)
    assert noise_spectral_bound(levels, 6, 3) == pytest.approx(spectral(0.3, 0.2, 0.7, 6, 3), rel=1e-12)
    # the other branch of the max: the C rows dominate
    levels = NoiseLevels(gram=0.01, sums=1.0, counts=2.0)
    assert noise_spectral_bound(levels, 6, 3) == pytest.approx(spectral(0.01, 1.0, 2.0, 6, 3), rel=1e-12)
    assert noise_spectral_bound(levels, 6, 3, 1e-2) == pytest.approx(
        math.sqrt(2 * (6 + 4) * math.log(2 * 9 / 1e-2)), rel=1e-12
    )


def test_no_noise_no_widening() -> None:
    for bound in (noise_entry_bound(0.0, 5), noise_entry_bound(-1.0, 5), noise_entry_bound(1.0, 0)):
        assert bound == 0.0
    assert noise_norm_bound(0.0, 3) == 0.0 and noise_norm_bound(1.0, 0) == 0.0 and noise_norm_bound(-1.0, 3) == 0.0
    assert noise_sum_bound(1.0, 0) == 0.0 and noise_sum_bound(0.0, 3) == 0.0
    assert noise_spectral_bound(NoiseLevels(), 5, 2) == 0.0
    assert not NoiseLevels().on
    assert NoiseLevels(gram=1e-9).on and NoiseLevels(sums=1e-9).on and NoiseLevels(counts=1e-9).on


# ------------------------------------------------------------------------------ counts
def test_noisy_counts_at_the_floor() -> None:
    floor = -entry(0.5, 2)
    check_counts(t64(2.3, floor * IN), 99, noise=0.5)  # not integers, not adding up: fine under noise
    with pytest.raises(StatisticsRejected) as err:
        check_counts(t64(2.3, floor * OUT), 99, noise=0.5)
    assert str(err.value) == f"counts below {floor:.4g}, beyond what noise of std 0.5 gives"
    check_counts(t64(2.0, floor), 99, noise=0.5)  # exactly at the floor: still possible
    # float32 counts are compared in float64: float32(floor) lies just below the floor and is rejected
    below = np.float32(floor)
    assert float(below) < floor
    with pytest.raises(StatisticsRejected, match="counts below"):
        check_counts(torch.tensor([2.0, float(below)], dtype=torch.float32), 99, noise=0.5)
    with pytest.raises(StatisticsRejected, match="counts contains NaN or inf"):
        check_counts(t64(math.nan, 1.0), 1, noise=0.5)
    with pytest.raises(StatisticsRejected, match="counts has non-integer entries"):
        check_counts(t64(0.5, 0.5), 1, noise=0.0)


# ------------------------------------------------------------------------------ STSA's Gram
def _gram(g: torch.Tensor, c: torch.Tensor, n: torch.Tensor, noise: NoiseLevels, **kw: object) -> None:
    check_gram_statistics(g, c, n, relative_tolerance=0.0, noise=noise, **kw)  # type: ignore[arg-type]


def test_gram_sign_floors_are_widened_per_block() -> None:
    noise = NoiseLevels(gram=0.1, sums=0.2)
    n = t64(10.0)
    fg, fc = -entry(0.1, 3), -entry(0.2, 2)  # G: the upper triangle (3 entries); C: 2 × 1
    _gram(t64([100.0, fg * IN], [fg * IN, 100.0]), t64([5.0], [fc * IN]), n, noise, nonnegative=True)
    with pytest.raises(StatisticsRejected, match="negative entries"):
        _gram(t64([100.0, fg * OUT], [fg * OUT, 100.0]), t64([5.0], [5.0]), n, noise, nonnegative=True)
    with pytest.raises(StatisticsRejected, match="negative entries"):
        _gram(t64([100.0, 0.0], [0.0, 100.0]), t64([5.0], [fc * OUT]), n, noise, nonnegative=True)
    # two classes: C has 2 × 2 entries, its floor is the bound over four
    fc4, n2 = -entry(0.2, 4), t64(10.0, 10.0)
    _gram(t64([100.0, 0.0], [0.0, 100.0]), t64([5.0, 5.0], [5.0, fc4 * IN]), n2, noise, nonnegative=True)
    with pytest.raises(StatisticsRejected, match="negative entries"):
        _gram(t64([100.0, 0.0], [0.0, 100.0]), t64([5.0, 5.0], [5.0, fc4 * OUT]), n2, noise, nonnegative=True)


def test_gram_negative_diagonal_and_psd_are_widened_by_the_spectral_bound() -> None:
    noise = NoiseLevels(gram=0.1, sums=0.05, counts=0.02)
    tau = spectral(0.1, 0.05, 0.02, 2, 1)
    zero, one = torch.zeros(2, 1, dtype=torch.float64), t64(1.0)
    _gram(t64([-tau * IN, 0.0], [0.0, 1.0]), zero, one, noise)
    with pytest.raises(StatisticsRejected) as err:
        _gram(t64([-tau * OUT, 0.0], [0.0, 1.0]), zero, one, noise)
    assert str(err.value) == "G has a negative diagonal entry (a sum of squares)"
    # λ_min(G) = −t: passes for t below τ, fails above
    _gram(t64([1.0, 1.0 + 0.99 * tau], [1.0 + 0.99 * tau, 1.0]), zero, one, noise)
    with pytest.raises(StatisticsRejected):
        _gram(t64([1.0, 1.0 + 1.01 * tau], [1.0 + 1.01 * tau, 1.0]), zero, one, noise)


def test_gram_trace_bound_is_widened_by_the_noise_on_the_trace_and_on_the_counts() -> None:
    noise = NoiseLevels(gram=0.3, counts=0.4)
    n = t64(3.0, 4.0)
    limit = (7.0 + entry(0.4 * math.sqrt(2), 1)) * 1.5**2 + entry(0.3 * math.sqrt(2), 1)  # B = 1.5
    zero = torch.zeros(2, 2, dtype=torch.float64)
    _gram(torch.eye(2, dtype=torch.float64) * limit / 2 * IN, zero, n, noise, norm_bound=1.5)
    with pytest.raises(StatisticsRejected) as err:
        _gram(torch.eye(2, dtype=torch.float64) * limit / 2 * OUT, zero, n, noise, norm_bound=1.5)
    assert str(err.value) == "trace(G) exceeds n·B² for the feature norm bound B = 1.5"


# ------------------------------------------------------------------------------ STSA-E's class sums
def _sums(column: list[float], count: float, noise: NoiseLevels, **kw: object) -> None:
    sums = torch.tensor(column, dtype=torch.float64).reshape(1, -1, 1).repeat(1, 1, 2)
    sums[..., 1] = 1.0  # a second, ordinary cell
    counts = torch.tensor([[count, 10.0]], dtype=torch.float64)
    check_class_sums(sums, counts, relative_tolerance=0.0, noise=noise, **kw)  # type: ignore[arg-type]


def test_class_sum_sign_floor_is_widened() -> None:
    noise = NoiseLevels(sums=0.2)
    floor = -entry(0.2, 6)  # 3 × 2 entries
    _sums([floor * IN, 1.0, 1.0], 5.0, noise, nonnegative=True)
    with pytest.raises(StatisticsRejected, match="class sums have negative entries"):
        _sums([floor * OUT, 1.0, 1.0], 5.0, noise, nonnegative=True)


def test_a_cell_is_empty_when_its_noisy_count_is_provably_below_one() -> None:
    noise = NoiseLevels(sums=0.2, counts=0.1)
    count_noise, sum_noise = entry(0.1, 2), norm(0.2, 3, P / 2)
    empty = 1.0 - count_noise - 1e-6
    _sums([sum_noise * IN, 0.0, 0.0], empty, noise)
    with pytest.raises(StatisticsRejected) as err:
        _sums([sum_noise * OUT, 0.0, 0.0], empty, noise)
    assert str(err.value) == "a class with no sample has a non-zero sum"
    _sums([50.0, 0.0, 0.0], 1.0 - count_noise + 1e-6, noise)  # maybe one sample: any length
    # noise on the sums only: a count of exactly 0 is still an empty cell, its sum noise-sized
    sums_only = NoiseLevels(sums=0.2)
    _sums([sum_noise * IN, 0.0, 0.0], 0.0, sums_only)
    with pytest.raises(StatisticsRejected, match="no sample"):
        _sums([sum_noise * OUT, 0.0, 0.0], 0.0, sums_only)
    _sums([50.0, 0.0, 0.0], 0.5, sums_only)


def test_class_sum_norm_bound_is_widened() -> None:
    noise = NoiseLevels(sums=0.2, counts=0.1)
    limit = (4.0 + entry(0.1, 2)) * 2.0 + norm(0.2, 3, P / 2)  # B = 2
    _sums([limit * IN, 0.0, 0.0], 4.0, noise, norm_bound=2.0)
    with pytest.raises(StatisticsRejected) as err:
        _sums([limit * OUT, 0.0, 0.0], 4.0, noise, norm_bound=2.0)
    assert str(err.value) == "a class sum is longer than n_c·B for B = 2"


# ------------------------------------------------------------------------------ FedRAN's summary
def _lowrank(sigma: list[float], corr: torch.Tensor, n: int, noise: NoiseLevels, **kw: object) -> None:
    check_lowrank_statistics(t64(*sigma), corr, n, relative_tolerance=0.0, noise=noise, **kw)  # type: ignore[arg-type]


def _corr(length: float) -> torch.Tensor:
    corr = torch.zeros(4, 2, dtype=torch.float64)
    corr[0, 0] = length
    return corr


def test_lowrank_sign_floor_is_widened() -> None:
    noise = NoiseLevels(sums=0.2)
    floor = -entry(0.2, 8)
    corr = torch.full((4, 2), 0.1, dtype=torch.float64)
    corr[1, 1] = floor * IN
    _lowrank([10.0], corr, 10, noise, nonnegative=True)
    corr[1, 1] = floor * OUT
    with pytest.raises(StatisticsRejected, match="B = HᵀY has negative entries"):
        _lowrank([10.0], corr, 10, noise, nonnegative=True)


def test_lowrank_reach_of_b_is_widened() -> None:
    noise = NoiseLevels(gram=0.1, sums=0.2, counts=0.3)
    tau = spectral(0.1, 0.0, 0.0, 4, 0)
    samples = 9 + entry(0.3, 1) + 0.5
    limit = math.sqrt((2.0**2 + tau) * samples) + norm(0.2, 8)
    _lowrank([2.0, 1.0], _corr(limit * IN), 9, noise)
    with pytest.raises(StatisticsRejected, match="exceeds σ₁·√n"):
        _lowrank([2.0, 1.0], _corr(limit * OUT), 9, noise)
    # without count noise, the reported n is exact
    gram_only = NoiseLevels(gram=0.1)
    limit = math.sqrt((4.0 + tau) * 9)
    _lowrank([2.0], _corr(limit * IN), 9, gram_only)
    with pytest.raises(StatisticsRejected, match="exceeds σ₁·√n"):
        _lowrank([2.0], _corr(limit * OUT), 9, gram_only)


def test_lowrank_energy_and_length_bounds_are_widened() -> None:
    noise = NoiseLevels(gram=0.1, sums=0.2, counts=0.3)
    tau = spectral(0.1, 0.0, 0.0, 4, 0)
    samples = 9 + entry(0.3, 1) + 0.5
    energy = samples * 1.0 + 2 * tau  # B = 1, two singular values
    top = math.sqrt(energy - 1.0)
    _lowrank([top * math.sqrt(IN), 1.0], _corr(1.0), 9, noise, norm_bound=1.0)
    with pytest.raises(StatisticsRejected) as err:
        _lowrank([math.sqrt(energy), 1.0], _corr(1.0), 9, noise, norm_bound=1.0)
    assert str(err.value) == "Σσ² exceeds n·B² for the feature norm bound B = 1"
    length = samples + norm(0.2, 8)  # ‖B‖_F ≤ n·B + the noise on B; σ₁ large enough for the reach
    sigma = [math.sqrt(samples), 0.0]
    _lowrank(sigma, _corr(length * IN), 9, noise, norm_bound=1.0)
    with pytest.raises(StatisticsRejected) as err:
        _lowrank(sigma, _corr(length * OUT), 9, noise, norm_bound=1.0)
    assert str(err.value) == "‖B‖_F exceeds n·B for the feature norm bound B = 1"
