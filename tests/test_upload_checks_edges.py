"""The server-side upload checks (fcl_flower/analytic/checks.py) on small hand-made statistics:
each impossible statistic fails with its exact one-line message, honest ones pass, and every
tolerance is placed by hand (4 (M + c) ε, 4 (M + c) δ, √M δ, 1 + 4 (M + c) ε): a statistic
half the tolerance beyond the exact bound passes, one 1.1 times the tolerance beyond it fails, so a
tolerance 25 % wider is noticed too (issue 19).

The reference dataset: five features of norm exactly 5 in M = 2, two classes,

    φ = [3, 4], [3, 4] (class 0);  [5, 0], [0, 5], [4, 3] (class 1)

so G = [[59, 36], [36, 66]], C = [[6, 9], [8, 8]], n = (2, 3), tr G = 125 = n·5², ‖C_0‖ = 10 = n_0·5
(its two features are parallel) and ‖C_1‖ = √145 < 15; J = [[G, C], [Cᵀ, diag n]] is positive definite.
"""

from __future__ import annotations

import math

import pytest
import torch

from fcl_flower.analytic.checks import (
    MAGNITUDE_LIMIT,
    StatisticsRejected,
    check_class_sums,
    check_counts,
    check_gram_statistics,
    check_lowrank_statistics,
    check_magnitude,
    check_packed_statistics,
    gram_check_epsilon,
    wire_epsilon,
)
from fcl_flower.analytic.packing import pack_upper

F64 = torch.float64
PHI = torch.tensor([[3.0, 4.0], [3.0, 4.0], [5.0, 0.0], [0.0, 5.0], [4.0, 3.0]], dtype=F64)
Y = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]], dtype=F64)
G = torch.tensor([[59.0, 36.0], [36.0, 66.0]], dtype=F64)
C = torch.tensor([[6.0, 9.0], [8.0, 8.0]], dtype=F64)
N = torch.tensor([2.0, 3.0], dtype=F64)
B = 5.0  # every ‖φ_i‖ is exactly 5


def _rejected(call, message: str) -> None:
    with pytest.raises(StatisticsRejected) as info:
        call()
    assert str(info.value) == message


def test_the_reference_statistics_are_those_of_the_dataset() -> None:
    assert torch.equal(PHI.T @ PHI, G) and torch.equal(PHI.T @ Y, C) and torch.equal(Y.sum(0), N)
    assert torch.equal(PHI.norm(dim=1), torch.full((5,), B, dtype=F64))


# =============================================================================== counts, magnitude
def test_counts_that_fit_pass() -> None:
    check_counts(torch.tensor([2.0, 3.0]), 5)
    check_counts(torch.tensor([0, 0]), 0)  # integer dtype, nobody
    check_counts(torch.zeros(0), 0)  # no class at all
    check_counts(torch.tensor([1e15, 1.0], dtype=F64), 10**15 + 1)


COUNTS_BAD = [
    ([float("nan"), 1.0], 1, "counts are not finite"),
    ([1.0, float("-inf")], 1, "counts are not finite"),
    ([float("inf")], 1, "counts are not finite"),
    ([3.0, -1.0], 2, "counts has negative entries"),
    ([-0.5], 0, "counts has negative entries"),
    ([1.5, 0.5], 2, "counts has non-integer entries"),
    ([2.0, 1e-9], 2, "counts has non-integer entries"),
    ([1.0, 2.0], 4, "counts add up to 3, the upload says 4 samples"),
    ([1.0, 2.0], 2, "counts add up to 3, the upload says 2 samples"),
    ([0.0], 1, "counts add up to 0, the upload says 1 samples"),
    ([1e20], 7, "counts add up to 1e+20, the upload says 7 samples"),
]


@pytest.mark.parametrize("counts, total, message", COUNTS_BAD, ids=[f"{i}" for i in range(len(COUNTS_BAD))])
def test_impossible_counts_are_rejected(counts, total, message) -> None:
    _rejected(lambda: check_counts(torch.tensor(counts, dtype=F64), total), message)


def test_magnitude_limit_is_inclusive_and_two_sided() -> None:
    assert MAGNITUDE_LIMIT == 1e150
    check_magnitude("x", torch.tensor([1e150, -1e150], dtype=F64))
    check_magnitude("x", torch.zeros(0))  # empty: no peak
    check_magnitude("x", torch.tensor([-10.0, 10.0]), limit=10.0)
    _rejected(
        lambda: check_magnitude("x", torch.tensor([0.0, -2e150], dtype=F64)),
        "x has an entry of magnitude 2e+150 > 1e+150",
    )
    _rejected(lambda: check_magnitude("w", torch.tensor([-11.0]), limit=10.0), "w has an entry of magnitude 11 > 10")
    _rejected(lambda: check_magnitude("v", torch.tensor([1.0, float("nan")])), "v contains NaN or inf")
    _rejected(lambda: check_magnitude("v", torch.tensor([float("-inf")])), "v contains NaN or inf")


def test_wire_epsilon_is_half_an_ulp_of_one() -> None:
    assert wire_epsilon(torch.float32) == 2.0**-24
    assert wire_epsilon(torch.float64) == 2.0**-53


# =============================================================================== G, C and the counts
def test_honest_reference_statistics_pass_at_their_exact_bounds() -> None:
    check_gram_statistics(G, C, N, relative_tolerance=0.0)
    check_gram_statistics(G, C, N, relative_tolerance=0.0, norm_bound=B, nonnegative=True)  # tr G = n B², ‖C_0‖ = n_0 B
    check_gram_statistics(G.float(), C.float(), N.long(), relative_tolerance=0.0, norm_bound=B)  # any input dtype


def test_honest_float32_uploads_pass() -> None:
    """Features that float32 cannot hold exactly: G and C rounded to float32 pass with ε = 2⁻²⁴."""
    gen = torch.Generator().manual_seed(0)
    phi = torch.rand(40, 6, generator=gen, dtype=F64) / 3.0
    y = torch.nn.functional.one_hot(torch.arange(40) % 3, 3).to(F64)
    g, c = (phi.T @ phi).float().double(), (phi.T @ y).float().double()
    check_gram_statistics(g, c, y.sum(0), relative_tolerance=wire_epsilon(torch.float32), nonnegative=True)


def test_a_rank_deficient_upload_passes_only_with_its_rounding_tolerance() -> None:
    """Two samples in M = 3 (a singular G): exactly PSD, so ε = 2⁻⁵³ suffices."""
    phi = torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, 3.0]], dtype=F64)
    y = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=F64)  # the second class has no sample
    check_gram_statistics(phi.T @ phi, phi.T @ y, y.sum(0), relative_tolerance=wire_epsilon(F64), nonnegative=True)


SHAPES_BAD = [
    (
        torch.zeros(2, 3),
        torch.zeros(2, 1),
        torch.zeros(1),
        "shapes G (2, 3), C (2, 1), counts (1,) do not fit together",
    ),
    (
        torch.zeros(2, 2),
        torch.zeros(3, 1),
        torch.zeros(1),
        "shapes G (2, 2), C (3, 1), counts (1,) do not fit together",
    ),
    (
        torch.zeros(2, 2),
        torch.zeros(2, 2),
        torch.zeros(3),
        "shapes G (2, 2), C (2, 2), counts (3,) do not fit together",
    ),
    (
        torch.zeros(2, 2),
        torch.zeros(2, 1),
        torch.zeros(1, 1),
        "shapes G (2, 2), C (2, 1), counts (1, 1) do not fit together",
    ),
    (torch.zeros(3), torch.zeros(2, 1), torch.zeros(1), "shapes G (3,), C (2, 1), counts (1,) do not fit together"),
    (
        torch.zeros(2, 2, 1),
        torch.zeros(2, 1),
        torch.zeros(1),
        "shapes G (2, 2, 1), C (2, 1), counts (1,) do not fit together",
    ),
]


@pytest.mark.parametrize("g, c, n, message", SHAPES_BAD, ids=[m for *_, m in SHAPES_BAD])
def test_shapes_that_do_not_fit_are_rejected(g, c, n, message) -> None:
    _rejected(lambda: check_gram_statistics(g, c, n, relative_tolerance=0.0), message)


def _with(tensor: torch.Tensor, index: tuple[int, ...], value: float) -> torch.Tensor:
    out = tensor.clone()
    out[index] = value
    return out


GRAM_BAD = [
    ("G beyond the limit", (_with(G, (0, 1), 2e150), C, N), {}, "G has an entry of magnitude 2e+150 > 1e+150"),
    ("C nan", (G, _with(C, (1, 0), float("nan")), N), {}, "class sums contains NaN or inf"),
    ("counts inf", (G, C, _with(N, (1,), float("inf"))), {}, "counts contains NaN or inf"),
    ("counts beyond", (G, C, _with(N, (0,), -3e150)), {}, "counts has an entry of magnitude 3e+150 > 1e+150"),
    (
        "negative G entry",
        (_with(_with(G, (0, 1), -1.0), (1, 0), -1.0), C, N),
        {"nonnegative": True},
        "G or the class sums have negative entries (random ReLU features are >= 0)",
    ),
    (
        "negative class sum",
        (G, _with(C, (1, 1), -1.0), N),
        {"nonnegative": True},
        "G or the class sums have negative entries (random ReLU features are >= 0)",
    ),
    ("negative G diagonal", (_with(G, (1, 1), -1.0), C, N), {}, "G has a negative diagonal entry (a sum of squares)"),
    ("negative count", (G, C, _with(N, (0,), -1.0)), {}, "G has a negative diagonal entry (a sum of squares)"),
    ("trace", (G, C, N), {"norm_bound": 4.99}, "trace(G) exceeds n·B² for the feature norm bound B = 4.99"),
    (
        "class sum too long",
        (G, C * torch.tensor([1.01, 1.0], dtype=F64), N),
        {"norm_bound": B},
        "a class sum is longer than n_c·B for B = 5",
    ),
    (
        "zero-energy feature",
        (torch.tensor([[0.0, 0.0], [0.0, 66.0]], dtype=F64), C, N),
        {},
        "a feature or class with zero energy has non-zero sums",
    ),
    (
        "empty class with a sum",
        (G, C, torch.tensor([5.0, 0.0], dtype=F64)),
        {},
        "a feature or class with zero energy has non-zero sums",
    ),
    (
        "Cauchy-Schwarz",
        (G, C * 3.0, N),
        {},
        "an entry breaks Cauchy-Schwarz |J_ij| <= sqrt(J_ii J_jj): class sums too large for G and the counts",
    ),
    (
        "not PSD",
        (G, C.flip(1), N),
        {},
        "[[G, C], [Cᵀ, diag(counts)]] is not positive semidefinite: no dataset has these statistics",
    ),
]


@pytest.mark.parametrize("args, options, message", [c[1:] for c in GRAM_BAD], ids=[c[0] for c in GRAM_BAD])
def test_impossible_gram_statistics_are_rejected(args, options, message) -> None:
    _rejected(lambda: check_gram_statistics(*args, relative_tolerance=0.0, **options), message)


def test_negative_entries_are_allowed_without_relu_features() -> None:
    """Signed features, one class: G_01 = -1 and the class sum (3, -1) has a negative entry."""
    phi = torch.tensor([[1.0, -3.0], [2.0, 1.0], [0.0, 1.0]], dtype=F64)
    y = torch.ones(3, 1, dtype=F64)
    assert float((phi.T @ phi)[0, 1]) == -1.0 and (phi.T @ y).flatten().tolist() == [3.0, -1.0]
    check_gram_statistics(phi.T @ phi, phi.T @ y, y.sum(0), relative_tolerance=0.0)


def test_the_nonnegativity_floor_is_the_absolute_tolerance() -> None:
    """With fixed-point rounding δ an exact zero may open as -δ: entries down to -δ pass. Features
    on disjoint coordinates, so G_01 = 0 and C_10 = 0 exactly."""
    delta = 2.0**-10
    phi = torch.tensor([[5.0, 0.0], [3.0, 0.0], [0.0, 5.0], [0.0, 4.0], [4.0, 0.0]], dtype=F64)
    g, c, n = phi.T @ phi, phi.T @ Y, Y.sum(0)
    assert float(g[0, 1]) == 0.0 and float(c[1, 0]) == 0.0
    options = {"relative_tolerance": 0.0, "absolute_tolerance": delta, "nonnegative": True}
    check_gram_statistics(g, c, n, **options)
    cases = ((-delta, 0.0, True), (0.0, -delta, True), (-2 * delta, 0.0, False), (0.0, -2 * delta, False))
    for g_01, c_10, passes in cases:
        call = lambda g_01=g_01, c_10=c_10: check_gram_statistics(  # noqa: E731
            _with(_with(g, (0, 1), g_01), (1, 0), g_01), _with(c, (1, 0), c_10), n, **options
        )
        if passes:
            call()
        else:
            _rejected(call, "G or the class sums have negative entries (random ReLU features are >= 0)")


def test_the_diagonal_floor_is_four_m_plus_c_deltas() -> None:
    """M = 1, c = 1, δ = 2⁻¹⁰: a diagonal down to -4·2·δ = -2⁻⁷ is rounding; below it is not."""
    delta = 2.0**-10
    zero_c, zero_n = torch.zeros(1, 1, dtype=F64), torch.zeros(1, dtype=F64)
    for g in (-(2.0**-7), -(2.0**-8), 0.0):
        check_gram_statistics(
            torch.tensor([[g]], dtype=F64), zero_c, zero_n, relative_tolerance=0.0, absolute_tolerance=delta
        )
    _rejected(
        lambda: check_gram_statistics(
            torch.tensor([[-(2.0**-7) - 2.0**-20]], dtype=F64),
            zero_c,
            zero_n,
            relative_tolerance=0.0,
            absolute_tolerance=delta,
        ),
        "G has a negative diagonal entry (a sum of squares)",
    )
    _rejected(
        lambda: check_gram_statistics(torch.tensor([[-(2.0**-20)]], dtype=F64), zero_c, zero_n, relative_tolerance=0.0),
        "G has a negative diagonal entry (a sum of squares)",
    )


@pytest.mark.parametrize("epsilon", [1e-3, 1e-4])
def test_the_trace_bound_has_relative_slack_four_m_plus_c_epsilon(epsilon: float) -> None:
    """M + c = 4: tr G may exceed n B² by the factor 1 + 16 ε (G scaled up stays a PSD Gram)."""
    slack = 16 * epsilon
    check_gram_statistics(G * (1 + 0.5 * slack), C, N, relative_tolerance=epsilon, norm_bound=B)
    _rejected(
        lambda: check_gram_statistics(G * (1 + 1.1 * slack), C, N, relative_tolerance=epsilon, norm_bound=B),
        "trace(G) exceeds n·B² for the feature norm bound B = 5",
    )


def test_the_trace_bound_has_absolute_slack_four_m_plus_c_deltas_per_feature() -> None:
    """δ = 0.01, M + c = 4, M = 2: tr G may exceed n B² by 4·4·δ·2 = 0.32."""
    delta = 0.01
    eye = torch.eye(2, dtype=F64)
    check_gram_statistics(G + 0.15 * eye, C, N, relative_tolerance=0.0, absolute_tolerance=delta, norm_bound=B)
    _rejected(
        lambda: check_gram_statistics(
            G + 0.17 * eye, C, N, relative_tolerance=0.0, absolute_tolerance=delta, norm_bound=B
        ),
        "trace(G) exceeds n·B² for the feature norm bound B = 5",
    )


@pytest.mark.parametrize("epsilon", [1e-3, 1e-4])
def test_the_class_sum_bound_has_relative_slack(epsilon: float) -> None:
    """(κ²G, κC, n) is the Gram of κΦ: with κ = 1 + 0.4·16ε it is within both slacks; C_0 alone
    longer by 1 + 32ε is not."""
    slack = 16 * epsilon
    kappa = 1 + 0.4 * slack
    check_gram_statistics(G * kappa**2, C * kappa, N, relative_tolerance=epsilon, norm_bound=B)
    longer = C * torch.tensor([1 + 1.1 * slack, 1.0], dtype=F64)
    _rejected(
        lambda: check_gram_statistics(G, longer, N, relative_tolerance=epsilon, norm_bound=B),
        "a class sum is longer than n_c·B for B = 5",
    )


def test_the_class_sum_bound_has_absolute_slack_root_m_deltas() -> None:
    """δ = 10⁻⁴, M = 2: ‖C_0‖ may exceed n_0 B = 10 by √2 δ."""
    delta = 1e-4
    unit = C[:, 0] / 10.0
    for extra, passes in ((0.5, True), (2.0, False)):
        c = C.clone()
        c[:, 0] = unit * (10.0 + extra * math.sqrt(2) * delta)
        call = lambda c=c: check_gram_statistics(  # noqa: E731
            G, c, N, relative_tolerance=0.0, absolute_tolerance=delta, norm_bound=B
        )
        if passes:
            call()
        else:
            _rejected(call, "a class sum is longer than n_c·B for B = 5")


def _pair(rho: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M = 1, c = 1: J = [[1, ρ], [ρ, 1]], already scaled."""
    return torch.ones(1, 1, dtype=F64), torch.full((1, 1), rho, dtype=F64), torch.ones(1, dtype=F64)


def test_cauchy_schwarz_allows_the_relative_slack() -> None:
    """ε = 10⁻⁴, M + c = 2: |J_01| may exceed √(J_00 J_11) = 1 by 8ε; the PSD test with the same
    slack then passes too (eigenvalues 1 ± ρ, plus 8ε)."""
    epsilon, slack = 1e-4, 8e-4
    check_gram_statistics(*_pair(1.0), relative_tolerance=epsilon)
    check_gram_statistics(*_pair(1 + 0.5 * slack), relative_tolerance=epsilon)
    check_gram_statistics(*_pair(-(1 + 0.5 * slack)), relative_tolerance=epsilon)
    for rho in (1 + 1.1 * slack, -(1 + 1.1 * slack)):
        _rejected(
            lambda rho=rho: check_gram_statistics(*_pair(rho), relative_tolerance=epsilon),
            "an entry breaks Cauchy-Schwarz |J_ij| <= sqrt(J_ii J_jj): class sums too large for G and the counts",
        )


def test_cauchy_schwarz_allows_1e_12_beyond_the_slack() -> None:
    """ρ = 1 + 10⁻¹² passes the Cauchy-Schwarz test (its absolute allowance) and so reaches the
    PSD test, which a 2 × 2 [[1, ρ], [ρ, 1]] with ρ > 1 fails."""
    _rejected(
        lambda: check_gram_statistics(*_pair(1.0 + 1e-12), relative_tolerance=0.0),
        "[[G, C], [Cᵀ, diag(counts)]] is not positive semidefinite: no dataset has these statistics",
    )
    _rejected(
        lambda: check_gram_statistics(*_pair(1.0 + 1e-11), relative_tolerance=0.0),
        "an entry breaks Cauchy-Schwarz |J_ij| <= sqrt(J_ii J_jj): class sums too large for G and the counts",
    )


def _triple(t: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M = 2, c = 1: J has unit diagonal and every off-diagonal entry r = -1/2 - t, so its eigenvalues
    are 1 + 2r = -2t and 1 - r (twice): Cauchy-Schwarz holds, PSD fails by 2t."""
    r = -0.5 - t
    return (
        torch.tensor([[1.0, r], [r, 1.0]], dtype=F64),
        torch.tensor([[r], [r]], dtype=F64),
        torch.ones(1, dtype=F64),
    )


def test_the_psd_test_allows_the_relative_slack() -> None:
    """ε = 10⁻⁴, M + c = 3: eigenvalues of the scaled J down to -12ε pass."""
    epsilon, slack = 1e-4, 12e-4
    check_gram_statistics(*_triple(0.25 * slack), relative_tolerance=epsilon)
    _rejected(
        lambda: check_gram_statistics(*_triple(0.55 * slack), relative_tolerance=epsilon),
        "[[G, C], [Cᵀ, diag(counts)]] is not positive semidefinite: no dataset has these statistics",
    )


def test_the_psd_test_allows_the_absolute_slack() -> None:
    """δ = 10⁻⁴, M + c = 3: J + 12δ I is tested, so eigenvalues of J down to -12δ pass."""
    delta, slack = 1e-4, 12e-4
    check_gram_statistics(*_triple(0.25 * slack), relative_tolerance=0.0, absolute_tolerance=delta)
    _rejected(
        lambda: check_gram_statistics(*_triple(0.55 * slack), relative_tolerance=0.0, absolute_tolerance=delta),
        "[[G, C], [Cᵀ, diag(counts)]] is not positive semidefinite: no dataset has these statistics",
    )


def test_the_check_tolerance_holds_float64_uploads_to_float32s_unless_wire() -> None:
    assert gram_check_epsilon(torch.float32) == gram_check_epsilon(torch.float32, "wire") == 2.0**-24
    assert gram_check_epsilon(F64) == 2.0**-24 and gram_check_epsilon(F64, "wire") == 2.0**-53
    with pytest.raises(ValueError, match="'float32' or 'wire'"):
        gram_check_epsilon(F64, "exact")


@pytest.mark.parametrize("depth", [0.1, 0.45])
def test_a_float64_upload_between_the_two_thresholds_passes_only_at_the_float32_tolerance(depth: float) -> None:
    """M + c = 3: a float64 J whose scaled spectrum reaches -2·depth·12·2⁻²⁴, far beyond float64's
    slack 12·2⁻⁵³ and inside float32's: what the default check tolerance lets through (and nothing
    beyond it), and what ``wire`` rejects."""
    slack32 = 12 * 2.0**-24
    g, c, n = _triple(depth * slack32)
    packed = pack_upper(g)
    check_packed_statistics(packed, c, n, relative_tolerance=gram_check_epsilon(F64))
    psd = "[[G, C], [Cᵀ, diag(counts)]] is not positive semidefinite: no dataset has these statistics"
    _rejected(lambda: check_packed_statistics(packed, c, n, relative_tolerance=gram_check_epsilon(F64, "wire")), psd)
    beyond = _triple(0.55 * slack32)
    for tolerance in ("float32", "wire"):
        _rejected(
            lambda tolerance=tolerance: check_packed_statistics(
                pack_upper(beyond[0]), *beyond[1:], relative_tolerance=gram_check_epsilon(F64, tolerance)
            ),
            psd,
        )


def test_float32_and_integer_inputs_are_judged_in_float64() -> None:
    """Each case is exact in float64 and would round the other way in float32."""
    # G in float32, diagonal (2^24, 1): tr G = 2^24 + 1 > n B² = 2^24 (n = 1, B = 4096); float32 sums 2^24.
    g32 = torch.tensor([[2.0**24, 4096.0], [4096.0, 1.0]], dtype=torch.float32)
    _rejected(
        lambda: check_gram_statistics(
            g32,
            torch.tensor([[4096.0], [1.0]], dtype=F64),
            torch.ones(1, dtype=F64),
            relative_tolerance=0.0,
            norm_bound=4096.0,
        ),
        "trace(G) exceeds n·B² for the feature norm bound B = 4096",
    )
    # C in float32, a column (4096, 1): ‖C_0‖ = √(2^24 + 1) > n_0 B = 4096; float32 gives exactly 4096.
    c32 = torch.tensor([[4096.0, 0.0], [1.0, 0.0]], dtype=torch.float32)
    _rejected(
        lambda: check_gram_statistics(
            g32.double(), c32, torch.ones(2, dtype=F64), relative_tolerance=0.0, norm_bound=4096.0
        ),
        "a class sum is longer than n_c·B for B = 4096",
    )
    # integer counts (3): n_0 B = 0.3 < 0.3000000005; in float32 3 · 0.1 = 0.30000001.
    _rejected(
        lambda: check_gram_statistics(
            torch.tensor([[0.03]], dtype=F64),
            torch.tensor([[0.3000000005]], dtype=F64),
            torch.tensor([3]),
            relative_tolerance=0.0,
            norm_bound=0.1,
        ),
        "a class sum is longer than n_c·B for B = 0.1",
    )


def test_a_float32_gram_is_symmetrised_in_float64() -> None:
    """G01 = 1, G10 = 2^-24 in float32: the symmetric part 0.5 + 2^-25 exists only in float64, and
    with G00 = G11 = 0.5 it breaks Cauchy-Schwarz by 2^-24 (float32 would round it to exactly 0.5)."""
    g32 = torch.tensor([[0.5, 1.0], [2.0**-24, 0.5]], dtype=torch.float32)
    _rejected(
        lambda: check_gram_statistics(
            g32, torch.zeros(2, 1, dtype=F64), torch.ones(1, dtype=F64), relative_tolerance=0.0
        ),
        "an entry breaks Cauchy-Schwarz |J_ij| <= sqrt(J_ii J_jj): class sums too large for G and the counts",
    )


def test_g_is_judged_by_its_symmetric_part() -> None:
    """Only the upper triangle travels; an asymmetric G whose symmetric part is G passes, although
    its (0, 1) entry alone would break Cauchy-Schwarz."""
    skew = torch.tensor([[0.0, 30.0], [-30.0, 0.0]], dtype=F64)
    check_gram_statistics(G + skew, C, N, relative_tolerance=0.0)


def test_a_feature_without_energy_is_left_out_of_the_scaled_test() -> None:
    """A zero feature (column of Φ all zero) and an empty class: their rows of J are zero and the
    rest is tested alone; with a tiny non-zero entry in such a row the upload fails."""
    phi = torch.cat([PHI, torch.zeros(5, 1, dtype=F64)], dim=1)
    y = torch.cat([Y, torch.zeros(5, 1, dtype=F64)], dim=1)
    g, c, n = phi.T @ phi, phi.T @ y, y.sum(0)
    check_gram_statistics(g, c, n, relative_tolerance=0.0, norm_bound=B, nonnegative=True)
    _rejected(
        lambda: check_gram_statistics(g, _with(c, (2, 0), 1e-300), n, relative_tolerance=0.0),
        "a feature or class with zero energy has non-zero sums",
    )
    negative = _with(g, (2, 2), -1e-6)  # within δ's diagonal floor, so still "no energy"
    check_gram_statistics(negative, c, n, relative_tolerance=0.0, absolute_tolerance=1e-6)


def test_a_zero_energy_feature_with_a_non_zero_gram_entry_is_rejected() -> None:
    """A feature with G_ii = 0 must have G_ij = 0 for every j, whether the entry sits in its row
    (the feature first) or in its column (the feature last) of the packed upper triangle."""
    zero = torch.zeros(5, 1, dtype=F64)
    for phi, entry in ((torch.cat([zero, PHI], dim=1), (0, 1)), (torch.cat([PHI, zero], dim=1), (0, 2))):
        g, c = phi.T @ phi, phi.T @ Y
        check_gram_statistics(g, c, N, relative_tolerance=0.0)  # honest: passes
        leak = _with(_with(g, entry, 1e-300), entry[::-1], 1e-300)  # symmetric, the diagonal still zero
        _rejected(
            lambda leak=leak, c=c: check_gram_statistics(leak, c, N, relative_tolerance=0.0),
            "a feature or class with zero energy has non-zero sums",
        )


def test_zero_energy_is_checked_across_row_blocks() -> None:
    """M = 2049 packs in two blocks of rows (2047 + 2): the zero-energy test finds an entry of the
    last feature's column in either block, and leaves every diagonal out."""
    dim = 2049
    g = torch.eye(dim, dtype=F64)
    g[dim - 1, dim - 1] = 0.0  # the last feature has no energy
    c, n = torch.zeros(dim, 1, dtype=F64), torch.zeros(1, dtype=F64)
    check_gram_statistics(g, c, n, relative_tolerance=0.0)
    for row in (5, dim - 2):  # first block, second block
        leak = _with(_with(g, (row, dim - 1), 1e-300), (dim - 1, row), 1e-300)
        _rejected(
            lambda leak=leak: check_gram_statistics(leak, c, n, relative_tolerance=0.0),
            "a feature or class with zero energy has non-zero sums",
        )


# =============================================================================== packed uploads
PACKED = pack_upper(G)  # [59, 36, 66]


def _packed_shapes(g, c, n) -> str:
    return f"shapes G packed {tuple(g.shape)}, C {tuple(c.shape)}, counts {tuple(n.shape)} do not fit together"


@pytest.mark.parametrize(
    "g, c, n",
    [
        (PACKED.reshape(3, 1), C, N),  # G not 1-D
        (PACKED, C.reshape(-1), N),  # C not 2-D
        (PACKED[:2], C, N),  # G's length is not M(M+1)/2
        (PACKED, C, N[:1]),  # counts do not match the classes
    ],
)
def test_packed_shapes_that_do_not_fit_are_rejected(g, c, n) -> None:
    _rejected(lambda: check_packed_statistics(g, c, n, relative_tolerance=0.0), _packed_shapes(g, c, n))


def test_packed_checks_name_the_packed_gram_and_default_to_signed_features() -> None:
    check_packed_statistics(PACKED, C, N, relative_tolerance=0.0)  # the dataset's own statistics
    _rejected(
        lambda: check_packed_statistics(_with(PACKED, (1,), float("inf")), C, N, relative_tolerance=0.0),
        "G contains NaN or inf",
    )
    signed = torch.tensor([[3.0, -4.0], [-3.0, 4.0], [5.0, 0.0], [1.0, -2.0], [-2.0, 1.0]], dtype=F64)  # either sign
    y = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]], dtype=F64)
    g, c, n = signed.T @ signed, signed.T @ y, y.sum(0)
    check_packed_statistics(pack_upper(g), c, n, relative_tolerance=0.0)  # nonnegative is off by default
    _rejected(
        lambda: check_packed_statistics(pack_upper(g), c, n, relative_tolerance=0.0, nonnegative=True),
        "G or the class sums have negative entries (random ReLU features are >= 0)",
    )


def test_packed_statistics_without_features_judge_the_counts_alone() -> None:
    empty_g, empty_c = torch.zeros(0, dtype=F64), torch.zeros(0, 2, dtype=F64)  # M = 0
    check_packed_statistics(empty_g, empty_c, N, relative_tolerance=0.0, nonnegative=True)
    _rejected(
        lambda: check_packed_statistics(empty_g, empty_c, torch.tensor([-1.0, 3.0]), relative_tolerance=0.0),
        "G has a negative diagonal entry (a sum of squares)",
    )


def test_the_float32_factorisation_runs_only_for_float32_tolerances_and_fast() -> None:
    from unittest import mock

    from fcl_flower.analytic import checks

    calls: list[torch.dtype] = []
    real = checks._positive_factor

    def spy(*args):
        calls.append(args[-1])
        return real(*args)

    eps32 = wire_epsilon(torch.float32)
    cases = [
        ({"relative_tolerance": eps32}, [torch.float32]),  # fast by default
        ({"relative_tolerance": eps32, "fast": False}, [F64]),
        ({"relative_tolerance": wire_epsilon(F64)}, [F64]),  # float64 uploads, check-tolerance wire
        ({"relative_tolerance": gram_check_epsilon(F64)}, [torch.float32]),  # float64 uploads, by default
        ({"relative_tolerance": eps32, "absolute_tolerance": 1e-9}, [F64]),  # opened secure sums
    ]
    for options, expected in cases:
        calls.clear()
        with mock.patch.object(checks, "_positive_factor", spy):
            check_packed_statistics(PACKED.float(), C.float(), N, **options)
        assert calls == expected, options


def test_packed_checks_work_on_the_cpu_whatever_the_default_device() -> None:
    with torch.device("meta"):
        check_packed_statistics(PACKED, C, N, relative_tolerance=0.0)
        _rejected(
            lambda: check_packed_statistics(PACKED, C * 3.0, N, relative_tolerance=0.0),
            "an entry breaks Cauchy-Schwarz |J_ij| <= sqrt(J_ii J_jj): class sums too large for G and the counts",
        )


def test_gram_statistics_with_one_dimensional_class_sums_are_rejected_by_shape() -> None:
    _rejected(
        lambda: check_gram_statistics(G, C.reshape(-1), N, relative_tolerance=0.0),
        f"shapes G {tuple(G.shape)}, C (4,), counts {tuple(N.shape)} do not fit together",
    )


# =============================================================================== STSA-E class sums
def test_honest_class_sums_pass_at_the_bound() -> None:
    sums, counts = C.unsqueeze(0), N.unsqueeze(0)  # one dummy client
    check_class_sums(sums, counts, relative_tolerance=0.0, norm_bound=B, nonnegative=True)
    two = torch.stack([PHI[:2].T @ Y[:2], PHI[2:].T @ Y[2:]])  # two dummy clients, an empty cell each
    check_class_sums(two, torch.stack([Y[:2].sum(0), Y[2:].sum(0)]), relative_tolerance=0.0, norm_bound=B)
    check_class_sums(-C, N, relative_tolerance=0.0)  # signed features, no bound: any finite sum


CLASS_SUMS_BAD = [
    (torch.zeros(2, 3, 4), torch.zeros(2, 3), {}, "class sums (2, 3, 4) and counts (2, 3) do not fit together"),
    (torch.zeros(3, 4), torch.zeros(3), {}, "class sums (3, 4) and counts (3,) do not fit together"),
    (torch.zeros(1, 3, 4), torch.zeros(2, 4), {}, "class sums (1, 3, 4) and counts (2, 4) do not fit together"),
    (C * 1e150, N, {}, "class sums has an entry of magnitude 9e+150 > 1e+150"),
    (_with(C, (0, 0), float("inf")), N, {}, "class sums contains NaN or inf"),
    (
        _with(C, (0, 1), -1.0),
        N,
        {"nonnegative": True},
        "class sums have negative entries (random ReLU features are >= 0)",
    ),
    (C, torch.tensor([0.0, 3.0], dtype=F64), {}, "a class with no sample has a non-zero sum"),
    (
        _with(torch.zeros(2, 2, dtype=F64), (1, 1), -1e-100),
        torch.zeros(2),
        {},
        "a class with no sample has a non-zero sum",
    ),
    (C, N, {"norm_bound": 4.99}, "a class sum is longer than n_c·B for B = 4.99"),
]


@pytest.mark.parametrize("sums, counts, options, message", CLASS_SUMS_BAD, ids=[m for *_, m in CLASS_SUMS_BAD])
def test_impossible_class_sums_are_rejected(sums, counts, options, message) -> None:
    _rejected(lambda: check_class_sums(sums, counts, relative_tolerance=0.0, **options), message)


@pytest.mark.parametrize("epsilon", [1e-3, 1e-4])
def test_the_class_sum_length_slack_is_four_m_epsilon(epsilon: float) -> None:
    """M = 2: ‖s_c‖ may exceed n_c B by the factor 1 + 8ε (the lengths are over the features)."""
    slack = 8 * epsilon
    check_class_sums(C * (1 + 0.5 * slack), N, relative_tolerance=epsilon, norm_bound=B)
    longer = C * torch.tensor([1 + 1.1 * slack, 1.0], dtype=F64)
    _rejected(
        lambda: check_class_sums(longer, N, relative_tolerance=epsilon, norm_bound=B),
        "a class sum is longer than n_c·B for B = 5",
    )
    wide = torch.tensor([[3.0, 0.0, 0.0], [4.0, 0.0, 0.0]], dtype=F64)  # ‖s_0‖ = 5 over M = 2, c = 3
    check_class_sums(wide, torch.tensor([1.0, 0.0, 0.0]), relative_tolerance=0.0, norm_bound=5.0)
    _rejected(
        lambda: check_class_sums(wide, torch.tensor([1.0, 0.0, 0.0]), relative_tolerance=0.0, norm_bound=4.9),
        "a class sum is longer than n_c·B for B = 4.9",
    )


# =============================================================================== FedRAN
def test_honest_lowrank_statistics_pass_at_the_bound() -> None:
    """One sample φ = (3, 4) of class 0 of 2: σ = (5), B = HᵀY = [[3, 0], [4, 0]], ‖B‖_F = 5 = σ₁√1."""
    corr = torch.tensor([[3.0, 0.0], [4.0, 0.0]], dtype=F64)
    check_lowrank_statistics(torch.tensor([5.0]), corr, 1, relative_tolerance=0.0, norm_bound=5.0, nonnegative=True)
    check_lowrank_statistics(torch.tensor([0.0, 5.0]), corr, 1, relative_tolerance=0.0)  # σ₁ is the largest
    sigma = torch.linalg.svdvals(PHI)
    check_lowrank_statistics(sigma, PHI.T @ Y, 5, relative_tolerance=wire_epsilon(F64), norm_bound=B)
    check_lowrank_statistics(sigma[:1], PHI.T @ Y, 5, relative_tolerance=wire_epsilon(F64), norm_bound=B)
    check_lowrank_statistics(torch.zeros(0), torch.zeros(2, 2), 0, relative_tolerance=0.0, norm_bound=B)
    check_lowrank_statistics(torch.tensor([5.0]), -corr, 1, relative_tolerance=0.0)  # signed features


LOWRANK_BAD = [
    (torch.tensor([float("nan")]), torch.zeros(2, 2), 1, {}, "singular values contains NaN or inf"),
    (
        torch.tensor([2e150], dtype=F64),
        torch.zeros(2, 2),
        1,
        {},
        "singular values has an entry of magnitude 2e+150 > 1e+150",
    ),
    (torch.tensor([5.0]), torch.full((2, 2), float("inf")), 1, {}, "label correlations contains NaN or inf"),
    (
        torch.tensor([5.0]),
        torch.tensor([[3.0, 0.0], [-4.0, 0.0]]),
        1,
        {"nonnegative": True},
        "B = HᵀY has negative entries (random ReLU features are >= 0)",
    ),
    (
        torch.tensor([5.0]),
        torch.tensor([[6.0, 0.0], [8.0, 0.0]]),
        1,
        {},
        "‖B‖_F = 10 exceeds σ₁·√n = 5: B is not HᵀY for this H",
    ),
    (
        torch.tensor([5.0]),
        torch.tensor([[6.0, 0.0], [8.0, 0.0]]),
        3,
        {},
        "‖B‖_F = 10 exceeds σ₁·√n = 8.66: B is not HᵀY for this H",
    ),
    (
        torch.zeros(0),
        torch.tensor([[0.0], [1e-100]], dtype=F64),
        4,
        {},
        "‖B‖_F = 1e-100 exceeds σ₁·√n = 0: B is not HᵀY for this H",
    ),
    (
        torch.tensor([5.0, 1.0]),
        torch.tensor([[3.0, 0.0], [4.0, 0.0]]),
        1,
        {"norm_bound": 5.0},
        "Σσ² exceeds n·B² for the feature norm bound B = 5",
    ),
]


@pytest.mark.parametrize("sigma, corr, n, options, message", LOWRANK_BAD, ids=[m for *_, m in LOWRANK_BAD])
def test_impossible_lowrank_statistics_are_rejected(sigma, corr, n, options, message) -> None:
    _rejected(lambda: check_lowrank_statistics(sigma, corr, n, relative_tolerance=0.0, **options), message)


@pytest.mark.parametrize("epsilon", [1e-3, 1e-4])
def test_lowrank_slack_is_one_plus_four_m_plus_c_epsilon(epsilon: float) -> None:
    """M + c = 4: every bound may be exceeded by the factor 1 + 16ε."""
    slack = 16 * epsilon
    corr = torch.tensor([[3.0, 0.0], [4.0, 0.0]], dtype=F64)
    sigma = torch.tensor([5.0], dtype=F64)
    check_lowrank_statistics(sigma, corr * (1 + 0.5 * slack), 1, relative_tolerance=epsilon)
    _rejected(
        lambda: check_lowrank_statistics(sigma, corr * (1 + 1.1 * slack), 1, relative_tolerance=epsilon),
        f"‖B‖_F = {5 * (1 + 1.1 * slack):.4g} exceeds σ₁·√n = 5: B is not HᵀY for this H",
    )
    grown = sigma * math.sqrt(1 + 0.5 * slack)  # Σσ² = 25 (1 + slack / 2)
    check_lowrank_statistics(grown, corr, 1, relative_tolerance=epsilon, norm_bound=5.0)
    _rejected(
        lambda: check_lowrank_statistics(
            sigma * math.sqrt(1 + 1.1 * slack), corr, 1, relative_tolerance=epsilon, norm_bound=5.0
        ),
        "Σσ² exceeds n·B² for the feature norm bound B = 5",
    )


def test_the_length_bound_binds_only_inside_the_slack() -> None:
    """‖B‖_F ≤ σ₁√n and Σσ² ≤ n B² imply ‖B‖_F ≤ n B, up to the slack s = 1 + 16ε: with n = 1,
    B = 1, ε = 0.01 (s = 1.16), σ₁² = 1.15 and ‖B‖_F = 1.2 pass the first two and fail the third."""
    corr = torch.tensor([[1.2, 0.0], [0.0, 0.0]], dtype=F64)
    sigma = torch.tensor([math.sqrt(1.15)], dtype=F64)
    check_lowrank_statistics(sigma, corr * (1.15 / 1.2), 1, relative_tolerance=0.01, norm_bound=1.0)
    _rejected(
        lambda: check_lowrank_statistics(sigma, corr, 1, relative_tolerance=0.01, norm_bound=1.0),
        "‖B‖_F exceeds n·B for the feature norm bound B = 1",
    )
    check_lowrank_statistics(sigma, corr, 1, relative_tolerance=0.01)  # no bound: only ‖B‖_F ≤ σ₁√n s
