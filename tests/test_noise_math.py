"""The noise and accounting formulas, unit by unit, against independent oracles (issue 19).

fcl_flower/privacy/noise.py and accountant.py, and the noise-aware parts of the analytic core
(ridge.py ``solve_ridge_psd``, subspace.py ``sums_noise``, lowrank.py ``keep``):

* every bad input is rejected with its one-line error;
* sensitivities, block scales and effective multipliers are hand-computed;
* the draws are NumPy's own draws from the documented seed sequence;
* ε and the calibrated z are checked against dp-accounting called directly;
* the PSD-projected ridge against a NumPy eigendecomposition and a hand-written GCV scan.

No expected value here is read from the function under test. The accountant tests use the RDP
accountant where the value does not matter (it is fast); PLD where the tight value is the point.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from fcl_flower.analytic.errors import AnalyticInputError
from fcl_flower.analytic.lowrank import LowRankSummary, client_summary_from_gram
from fcl_flower.analytic.ridge import PSDProjection, RidgeState, solve_ridge_psd
from fcl_flower.analytic.subspace import select_subspace_ridge_gcv
from fcl_flower.config import RunConfig
from fcl_flower.privacy import accountant
from fcl_flower.privacy.accountant import AccountingError, PrivacyLedger
from fcl_flower.privacy.noise import (
    NoiseError,
    NoiseScale,
    add_gaussian,
    dp_scale,
    effective_multiplier,
    gaussian,
    noise_generator,
    noise_multiplier,
    paper_scale,
    releases_per_target,
    secure_share,
    sensitivities,
    symmetric_gaussian,
    upload_scale,
)

DELTA = 1e-5
DOMAIN = 0x5EED_0015  # the noise's seed-sequence tag, as the module documents it
ALL = ("gram", "sums", "counts")


@pytest.fixture(autouse=True)
def _fresh_accounting_caches() -> None:
    """The accountant memoises ε and z: every test computes its own (and a mutant cannot hide in a cache)."""
    accountant.calibrate_multiplier.cache_clear()
    accountant._epsilon.cache_clear()


def _one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------------------ NoiseScale
@pytest.mark.parametrize("block", ALL)
@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, -math.inf])
def test_a_noise_std_must_be_finite_and_non_negative(block: str, value: float) -> None:
    with pytest.raises(NoiseError) as err:
        NoiseScale(**{block: value})
    assert _one_line(err) == f"noise std of {block} must be a finite number >= 0, got {value!r}"


def test_noise_scale_accessors_scaling_and_on() -> None:
    scale = NoiseScale(gram=2.0, sums=3.0, counts=5.0)
    assert scale.as_dict() == {"gram": 2.0, "sums": 3.0, "counts": 5.0}
    assert [scale.of(b) for b in ALL] == [2.0, 3.0, 5.0]
    assert scale.scaled(0.5).as_dict() == {"gram": 1.0, "sums": 1.5, "counts": 2.5}
    assert NoiseScale().as_dict() == {"gram": 0.0, "sums": 0.0, "counts": 0.0}  # zero is allowed
    assert not NoiseScale().on
    for block in ALL:  # any one block with noise switches it on
        assert NoiseScale(**{block: 1e-12}).on


# ------------------------------------------------------------------------------ paper's noise
def test_paper_scale_is_q_times_s_on_the_targeted_blocks_only() -> None:
    assert paper_scale(0.5, 4.0, "both", ALL).as_dict() == {"gram": 2.0, "sums": 2.0, "counts": 2.0}
    assert paper_scale(0.5, 4.0, "features", ALL).as_dict() == {"gram": 2.0, "sums": 2.0, "counts": 0.0}
    assert paper_scale(0.5, 4.0, "counts", ALL).as_dict() == {"gram": 0.0, "sums": 0.0, "counts": 2.0}
    # a block the method does not upload gets nothing, whatever noise-on says
    assert paper_scale(0.5, 4.0, "both", ("sums",)).as_dict() == {"gram": 0.0, "sums": 2.0, "counts": 0.0}
    assert paper_scale(0.0, 0.0, "both", ALL).as_dict() == {"gram": 0.0, "sums": 0.0, "counts": 0.0}


@pytest.mark.parametrize(
    "q, s, on, message",
    [
        (0.1, 1.0, "gram", "noise-on must be one of features, counts, both, got 'gram'"),
        (-0.1, 1.0, "both", "q and s must be >= 0, got -0.1, 1.0"),
        (0.1, -1.0, "both", "q and s must be >= 0, got 0.1, -1.0"),
    ],
)
def test_paper_scale_rejects_bad_settings(q: float, s: float, on: str, message: str) -> None:
    with pytest.raises(NoiseError) as err:
        paper_scale(q, s, on, ALL)
    assert _one_line(err) == message


# ------------------------------------------------------------------------------ DP scales
def test_sensitivities_by_hand() -> None:
    # one sample φ with ‖φ‖ = B: ‖φφᵀ‖_F = B², ‖φ e_yᵀ‖_F = B, one count
    assert sensitivities(1.5) == {"gram": 2.25, "sums": 1.5, "counts": 1.0}
    assert sensitivities(0.5) == {"gram": 0.25, "sums": 0.5, "counts": 1.0}


@pytest.mark.parametrize("bound", [0.0, -1.0, math.nan, math.inf])
def test_sensitivities_need_a_finite_positive_bound(bound: float) -> None:
    with pytest.raises(NoiseError) as err:
        sensitivities(bound)
    assert _one_line(err) == f"the per-sample bound must be a finite number > 0, got {bound!r}"


def test_dp_scale_by_hand() -> None:
    root3 = math.sqrt(3.0)
    scale = dp_scale(2.0, 1.5, ALL)  # z Δ_j √J with J = 3
    assert scale.as_dict() == pytest.approx({"gram": 2 * 2.25 * root3, "sums": 2 * 1.5 * root3, "counts": 2 * root3})
    assert dp_scale(2.0, 1.5, ("sums",)).as_dict() == pytest.approx({"gram": 0.0, "sums": 3.0, "counts": 0.0})
    two = dp_scale(4.0, 0.5, ["sums", "counts"])  # a list works as well as a tuple
    assert two.as_dict() == pytest.approx({"gram": 0.0, "sums": 4 * 0.5 * math.sqrt(2), "counts": 4 * math.sqrt(2)})


@pytest.mark.parametrize(
    "multiplier, bound, blocks, message",
    [
        (0.0, 1.0, ALL, "the noise multiplier must be a finite number > 0, got 0.0"),
        (-1.0, 1.0, ALL, "the noise multiplier must be a finite number > 0, got -1.0"),
        (math.inf, 1.0, ALL, "the noise multiplier must be a finite number > 0, got inf"),
        (math.nan, 1.0, ALL, "the noise multiplier must be a finite number > 0, got nan"),
        (1.0, 1.0, (), "blocks must be a non-empty subset of ('gram', 'sums', 'counts'), got ()"),
        (
            1.0,
            1.0,
            ("gram", "labels"),
            "blocks must be a non-empty subset of ('gram', 'sums', 'counts'), got ('gram', 'labels')",
        ),
        (1.0, 0.0, ALL, "the per-sample bound must be a finite number > 0, got 0.0"),
    ],
)
def test_dp_scale_rejects_bad_settings(multiplier: float, bound: float, blocks: tuple, message: str) -> None:
    with pytest.raises(NoiseError) as err:
        dp_scale(multiplier, bound, blocks)
    assert _one_line(err) == message


def test_effective_multiplier_by_hand() -> None:
    # B = 1: Δ = (1, 1, 1); σ = (3, 4): 1/√(1/9 + 1/16) = 12/5
    assert effective_multiplier(NoiseScale(3.0, 4.0, 0.0), 1.0, ("gram", "sums")) == pytest.approx(2.4)
    # B = 2: Δ_gram = 4, Δ_sums = 2: 1/√(16/9 + 4/16) = 6/√73
    assert effective_multiplier(NoiseScale(3.0, 4.0, 0.0), 2.0, ("gram", "sums")) == pytest.approx(6 / math.sqrt(73))
    assert effective_multiplier(NoiseScale(0.0, 2.0, 0.0), 1.0, ("sums",)) == pytest.approx(2.0)
    # a released block without noise: z = 0, whatever the other blocks carry
    assert effective_multiplier(NoiseScale(3.0, 4.0, 0.0), 1.0, ("gram", "counts", "sums")) == 0.0
    assert effective_multiplier(NoiseScale(3.0, 4.0, 0.0), 1.0, ()) == math.inf  # nothing released


# ------------------------------------------------------------------------------ the draws
def test_seeded_generator_is_numpys_generator_of_the_tagged_key() -> None:
    draws = noise_generator(True, (3, 0, 7)).normal(size=6)
    assert np.array_equal(draws, np.random.default_rng([DOMAIN, 3, 0, 7]).normal(size=6))
    # the tag separates it from the run's other seeded draws of the same key
    assert not np.array_equal(draws, np.random.default_rng([3, 0, 7]).normal(size=6))
    assert np.array_equal(
        noise_generator(True, (0, 0)).normal(size=3), np.random.default_rng([DOMAIN, 0, 0]).normal(size=3)
    )


def test_seeded_generator_rejects_negative_keys() -> None:
    with pytest.raises(NoiseError) as err:
        noise_generator(True, (1, -2))
    assert _one_line(err) == "noise seed keys must be >= 0, got (1, -2)"
    noise_generator(False, (1, -2))  # the key means nothing to the OS generator


def test_gaussian_is_numpys_normal_and_draws_nothing_at_zero_std() -> None:
    rng = noise_generator(True, (1,))
    out = gaussian(rng, torch.Size([3, 4]), 0.7)
    assert out.dtype == torch.float64 and tuple(out.shape) == (3, 4)
    assert np.array_equal(out.numpy(), np.random.default_rng([DOMAIN, 1]).normal(0.0, 0.7, size=(3, 4)))
    rng = noise_generator(True, (2,))
    zero = gaussian(rng, (2, 5), 0.0)
    assert zero.dtype == torch.float64 and torch.equal(zero, torch.zeros(2, 5, dtype=torch.float64))
    # nothing was drawn: the generator's next draw is its first
    assert rng.normal() == np.random.default_rng([DOMAIN, 2]).normal()


def test_add_gaussian_adds_numpys_draws_in_float64() -> None:
    values = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert add_gaussian(values, noise_generator(True, (4,)), 0.0) is values  # std 0: untouched, same object
    out = add_gaussian(values, noise_generator(True, (4,)), 2.5)
    expected = values.numpy().astype(np.float64) + np.random.default_rng([DOMAIN, 4]).normal(0.0, 2.5, size=(2, 3))
    assert out.dtype == torch.float64 and np.array_equal(out.numpy(), expected)


def test_symmetric_gaussian_mirrors_the_upper_triangle_of_the_draws() -> None:
    out = symmetric_gaussian(noise_generator(True, (5,)), 4, 1.5)
    draws = np.random.default_rng([DOMAIN, 5]).normal(0.0, 1.5, size=(4, 4))
    upper = np.triu(draws)
    assert np.array_equal(out.numpy(), upper + np.triu(upper, 1).T)
    assert torch.equal(symmetric_gaussian(noise_generator(True, (5,)), 3, 0.0), torch.zeros(3, 3, dtype=torch.float64))


# ------------------------------------------------------------------------------ a run's noise
def _rdp_epsilon(z: float, releases: int, delta: float = DELTA) -> float:
    direct = rdp_privacy_accountant.RdpAccountant()
    direct.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), releases))
    return float(direct.get_epsilon(delta))


def test_releases_per_target_counts_stages_only_for_run_scope() -> None:
    assert releases_per_target(RunConfig(num_tasks=4, dp_scope="run")) == 4
    assert releases_per_target(RunConfig(num_tasks=4, dp_scope="stage")) == 1


def test_upload_scale_under_dp_is_the_calibrated_gaussian_mechanism() -> None:
    cfg = RunConfig(strategy="stsa", dp_epsilon=2.0, feature_clip=1.5, num_tasks=3, dp_accountant="rdp")
    scale = upload_scale(cfg)
    assert scale is not None
    blocks = cfg.method.upload_noise
    root = math.sqrt(len(blocks))
    z = scale.counts / root  # Δ_counts = 1
    assert z == pytest.approx(noise_multiplier(cfg))
    assert scale.gram == pytest.approx(z * 1.5**2 * root) and scale.sums == pytest.approx(z * 1.5 * root)
    # dp-accounting, called directly: three stages (scope "run") at z meet ε = 2, slightly less noise does not
    assert _rdp_epsilon(z, 3) <= 2.0 < _rdp_epsilon(z * (1 - 1e-3), 3)
    per_stage = noise_multiplier(
        RunConfig(strategy="stsa", dp_epsilon=2.0, feature_clip=1.5, num_tasks=3, dp_scope="stage", dp_accountant="rdp")
    )
    assert _rdp_epsilon(per_stage, 1) <= 2.0 < _rdp_epsilon(per_stage * (1 - 1e-3), 1)


def test_secure_share_divides_dp_noise_among_the_threshold_only() -> None:
    dp = RunConfig(strategy="stsa", dp_epsilon=1.0, feature_clip=1.0)
    assert secure_share(dp, 4) == pytest.approx(0.5)
    assert secure_share(dp, 1) == 1.0
    assert secure_share(RunConfig(strategy="stsa", noise_q=0.1, noise_s=1.0), 4) == 1.0  # the paper's: per client
    with pytest.raises(NoiseError) as err:
        secure_share(dp, 0)
    assert _one_line(err) == "threshold must be >= 1, got 0"


# ------------------------------------------------------------------------------ accountant
def test_make_accountant_builds_dp_accountings_accountants() -> None:
    pld = accountant.make_accountant("pld")
    assert isinstance(pld, pld_privacy_accountant.PLDAccountant)
    rdp = accountant.make_accountant("rdp")
    assert isinstance(rdp, rdp_privacy_accountant.RdpAccountant)
    assert rdp.neighboring_relation == dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    with pytest.raises(AccountingError) as err:
        accountant.make_accountant("moments")
    assert _one_line(err) == "unknown accountant 'moments'; choose one of: pld, rdp"
    # the PLD accountant is dp-accounting's at its 1e-4 discretisation: tight for one Gaussian mechanism
    pld.compose(dp_accounting.GaussianDpEvent(2.0))
    assert pld.get_epsilon(1e-3) == pytest.approx(dp_accounting.get_epsilon_gaussian(2.0, 1e-3), rel=1e-3)


def test_without_dp_accounting_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # `import dp_accounting` now raises ImportError
    with pytest.raises(AccountingError) as err:
        accountant.make_accountant("rdp")
    assert _one_line(err) == "differential privacy needs dp-accounting: pip install 'fcl-flower[dp]'"


def test_composed_event_of_known_lists() -> None:
    gauss = dp_accounting.GaussianDpEvent
    assert accountant.composed_event([]) == dp_accounting.NoOpDpEvent()
    assert accountant.composed_event([math.inf, math.inf]) == dp_accounting.NoOpDpEvent()
    assert accountant.composed_event([2.0]) == gauss(2.0)
    assert accountant.composed_event([math.inf, 2.0]) == gauss(2.0)
    assert accountant.composed_event([2.0, 3.0]) == dp_accounting.ComposedDpEvent([gauss(2.0), gauss(3.0)])
    assert accountant.composed_event([2.0, 0.0, 3.0]) == dp_accounting.NonPrivateDpEvent()
    assert accountant.composed_event([-1.0]) == dp_accounting.NonPrivateDpEvent()
    assert accountant.composed_event([0.5]) == gauss(0.5)  # any z > 0 is a Gaussian mechanism, even below 1


def test_epsilon_spent_is_dp_accountings_for_known_settings() -> None:
    assert accountant.epsilon_spent([1.5, 3.0], DELTA, "rdp") == pytest.approx(_direct_rdp([1.5, 3.0]), rel=1e-12)
    assert accountant.epsilon_spent([3.0, math.inf, 1.5], DELTA, "rdp") == pytest.approx(_direct_rdp([1.5, 3.0]))
    # the default accountant is PLD, whose ε of one Gaussian mechanism is the analytic one (Balle & Wang)
    assert accountant.epsilon_spent([2.0], 1e-3) == pytest.approx(
        dp_accounting.get_epsilon_gaussian(2.0, 1e-3), rel=1e-3
    )
    assert accountant.epsilon_spent([], DELTA) == 0.0
    assert accountant.epsilon_spent([math.inf, math.inf], DELTA, "rdp") == 0.0
    assert accountant.epsilon_spent([2.0, 0.0], DELTA, "rdp") == math.inf
    assert accountant.epsilon_spent([-3.0], DELTA, "rdp") == math.inf


def _direct_rdp(multipliers: list[float], delta: float = DELTA) -> float:
    direct = rdp_privacy_accountant.RdpAccountant()
    direct.compose(dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z) for z in multipliers]))
    return float(direct.get_epsilon(delta))


@pytest.mark.parametrize("delta", [0.0, 1.0, -0.5, 2.0])
def test_epsilon_needs_delta_in_the_open_unit_interval(delta: float) -> None:
    with pytest.raises(AccountingError) as err:
        accountant.epsilon_spent([1.0], delta, "rdp")
    assert _one_line(err) == f"delta must be in (0, 1), got {delta}"


@pytest.mark.parametrize(
    "epsilon, delta, releases, message",
    [
        (0.0, DELTA, 1, "epsilon must be a finite number > 0, got 0.0"),
        (-1.0, DELTA, 1, "epsilon must be a finite number > 0, got -1.0"),
        (math.inf, DELTA, 1, "epsilon must be a finite number > 0, got inf"),
        (math.nan, DELTA, 1, "epsilon must be a finite number > 0, got nan"),
        (1.0, 0.0, 1, "delta must be in (0, 1), got 0.0"),
        (1.0, 1.0, 1, "delta must be in (0, 1), got 1.0"),
        (1.0, DELTA, 0, "releases must be >= 1, got 0"),
    ],
)
def test_calibration_rejects_bad_targets(epsilon: float, delta: float, releases: int, message: str) -> None:
    with pytest.raises(AccountingError) as err:
        accountant.calibrate_multiplier(epsilon, delta, releases, "rdp")
    assert _one_line(err) == message


@pytest.mark.parametrize("epsilon, releases", [(1.0, 1), (3.0, 6)])
def test_rdp_calibration_is_the_smallest_multiplier_dp_accounting_accepts(epsilon: float, releases: int) -> None:
    z = accountant.calibrate_multiplier(epsilon, DELTA, releases, "rdp")
    assert _rdp_epsilon(z, releases) <= epsilon < _rdp_epsilon(z * (1 - 1e-4), releases)


def test_pld_calibration_of_one_release_is_the_analytic_gaussian_mechanism() -> None:
    # one Gaussian mechanism: PLD is tight, so z is dp-accounting's analytic σ(ε, δ) (defaults: 1 release, PLD)
    z = accountant.calibrate_multiplier(1.0, 1e-3)
    assert z == pytest.approx(dp_accounting.get_sigma_gaussian(1.0, 1e-3), rel=2e-3)
    assert (
        dp_accounting.get_epsilon_gaussian(z * (1 + 2e-3), 1e-3)
        < 1.0
        < dp_accounting.get_epsilon_gaussian(z * (1 - 5e-3), 1e-3)
    )


# ------------------------------------------------------------------------------ ledger
def test_ledger_rejects_an_unknown_accountant() -> None:
    with pytest.raises(AccountingError) as err:
        PrivacyLedger(DELTA, "moments")
    assert _one_line(err) == "unknown accountant 'moments'; choose one of: pld, rdp"


def test_ledger_composes_per_client_and_per_stage() -> None:
    ledger = PrivacyLedger(DELTA, "rdp")
    assert ledger.delta == DELTA and ledger.accountant == "rdp"
    assert ledger.worst() == (None, 0.0)  # nothing released yet
    ledger.record(["b", "a"], 0, 2.0)
    ledger.record(["a"], 1, 4)
    assert ledger.multipliers("a") == [2.0, 4.0] and ledger.multipliers("a", 1) == [4.0]
    assert ledger.multipliers("b", 1) == [] and ledger.multipliers("nobody") == []
    assert ledger.epsilon("a") == pytest.approx(_direct_rdp([2.0, 4.0]))
    assert ledger.epsilon("a", 0) == pytest.approx(_direct_rdp([2.0]))
    assert ledger.epsilon("b", 1) == 0.0
    assert ledger.worst() == ("a", pytest.approx(_direct_rdp([2.0, 4.0])))
    assert ledger.worst(0) == ("a", pytest.approx(_direct_rdp([2.0])))  # a tie: the first client by name
    assert ledger.worst(1) == ("a", pytest.approx(_direct_rdp([4.0])))
    assert ledger.counts() == {"a": 2, "b": 1}
    assert ledger.counts(1) == {"a": 1}  # clients without a release in the stage are left out
    assert ledger.state_dict() == {"b": [[0, 2.0]], "a": [[0, 2.0], [1, 4.0]]}
    copy = PrivacyLedger(DELTA, "rdp")
    copy.load_state_dict({"a": [["1", 3]], "c": [[2, "0.5"]]})  # a checkpoint read back from JSON text
    assert copy.releases == {"a": [(1, 3.0)], "c": [(2, 0.5)]}
    assert all(isinstance(s, int) and isinstance(z, float) for items in copy.releases.values() for s, z in items)


def test_the_ledgers_default_accountant_is_pld() -> None:
    ledger = PrivacyLedger(1e-3)
    ledger.record(["a"], 0, 2.0)
    assert ledger.epsilon("a") == pytest.approx(dp_accounting.get_epsilon_gaussian(2.0, 1e-3), rel=1e-3)


def test_ledger_worst_prefers_the_larger_epsilon_whatever_the_name() -> None:
    ledger = PrivacyLedger(DELTA, "rdp")
    ledger.record(["a"], 0, 8.0)
    ledger.record(["z"], 0, 1.0)  # less noise: more ε
    assert ledger.worst()[0] == "z"


# ------------------------------------------------------------------------------ analytic core under noise
def _psd_oracle(gram: np.ndarray, sums: np.ndarray, ridge: float) -> np.ndarray:
    lam, q = np.linalg.eigh(0.5 * (gram + gram.T))
    projected = q @ np.diag(np.maximum(lam, 0.0)) @ q.T
    return np.linalg.solve(projected + ridge * np.eye(len(gram)), sums)


def _gcv_oracle(lam: np.ndarray, q: np.ndarray, n: int, yty: float, grid: list[float]) -> float:
    best, best_gamma = math.inf, math.nan
    for gamma in grid:
        rss = max(yty - float(np.sum(q * (lam + 2 * gamma) / (lam + gamma) ** 2)), 0.0)
        df = float(np.sum(lam / (lam + gamma)))
        gcv = n * rss / (n - df) ** 2 if df < n else math.inf
        if gcv < best:
            best, best_gamma = gcv, gamma
    return best_gamma


def test_psd_projection_by_hand_on_a_diagonal_gram() -> None:
    gram = torch.diag(torch.tensor([3.0, -1.0, -2.0, 0.5], dtype=torch.float64))
    sums = torch.tensor([[3.0], [1.0], [2.0], [1.0]], dtype=torch.float64)
    weights, gamma, table, projection = solve_ridge_psd(gram, sums, 10, 1.0)
    assert projection == PSDProjection(negative=2, clipped=3.0, trace=0.5)
    assert projection.as_dict() == {"negative_eigenvalues": 2, "clipped": 3.0, "trace": 0.5}
    # P(G) = diag(3, 0, 0, 0.5): W = C / (λ⁺ + 1)
    assert torch.allclose(weights, torch.tensor([[0.75], [1.0], [2.0], [1 / 1.5]], dtype=torch.float64))
    assert gamma == 1.0 and table == []
    # a zero eigenvalue is not a negative one
    zero = solve_ridge_psd(torch.diag(torch.tensor([2.0, 0.0], dtype=torch.float64)), sums[:2], 10, 1.0)[3]
    assert zero == PSDProjection(negative=0, clipped=0.0, trace=2.0)


def test_psd_ridge_matches_a_numpy_projection_on_a_random_indefinite_gram() -> None:
    rng = np.random.default_rng(11)
    a = rng.normal(size=(6, 6))
    gram, sums = a + a.T, rng.normal(size=(6, 3))
    weights, *_ = solve_ridge_psd(torch.from_numpy(gram), torch.from_numpy(sums), 5, 0.3)
    assert np.allclose(weights.numpy(), _psd_oracle(gram, sums, 0.3), atol=1e-10)
    # float32 statistics are solved in float64 (the oracle sees the same float32 values)
    g32, c32 = torch.from_numpy(gram).float(), torch.from_numpy(sums).float()
    weights, *_ = solve_ridge_psd(g32, c32, 5, 0.3)
    assert weights.dtype == torch.float64
    assert np.allclose(weights.numpy(), _psd_oracle(g32.double().numpy(), c32.double().numpy(), 0.3), atol=1e-12)


@pytest.mark.parametrize("ridge", [0.0, -1.0, math.inf, math.nan])
def test_psd_ridge_needs_a_positive_finite_ridge(ridge: float) -> None:
    gram = torch.eye(3, dtype=torch.float64)
    with pytest.raises(AnalyticInputError) as err:
        solve_ridge_psd(gram, torch.ones(3, 1, dtype=torch.float64), 3, ridge)
    assert _one_line(err) == f"ridge must be a finite number > 0, got {ridge!r}"
    with pytest.raises(AnalyticInputError, match="gram must be square"):
        solve_ridge_psd(torch.ones(3, 2, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64), 3, 1.0)


def _gcv_rows(lam: np.ndarray, q: np.ndarray, n: int, grid: list[float]) -> list[float]:
    """rss, df, rss, df, … of the GCV scan, written out from the formula."""
    rows: list[float] = []
    for gamma in grid:
        rss = max(n - float(np.sum(q * (lam + 2 * gamma) / (lam + gamma) ** 2)), 0.0)
        rows += [rss, float(np.sum(lam / (lam + gamma)))]
    return rows


@pytest.mark.parametrize("sums_noise", [0.0, 0.5, 40.0])
def test_psd_gcv_scans_the_grid_above_the_noise_floor_with_debiased_q(sums_noise: float) -> None:
    rng = np.random.default_rng(3)
    phi = rng.normal(size=(6, 8))  # rank 6 < M = 8: the noise makes G indefinite
    noise = rng.normal(size=(8, 8))
    gram = phi.T @ phi + 0.5 * (noise + noise.T)
    sums = phi.T @ np.eye(3)[rng.integers(0, 3, 6)] * 0.3
    lam, vecs = np.linalg.eigh(gram)
    assert lam[0] < 0
    floor = -lam[0]
    grid = [g for g in np.logspace(-2, 8, 41).tolist() if g >= floor]
    q = np.maximum(((vecs.T @ sums) ** 2).sum(axis=1) - sums_noise, 0.0)
    expected = _gcv_oracle(np.maximum(lam, 0.0), q, 6, 6.0, grid)
    extra = {"sums_noise": sums_noise} if sums_noise else {}  # 0 is the default
    weights, gamma, table, _ = solve_ridge_psd(torch.from_numpy(gram), torch.from_numpy(sums), 6, None, **extra)
    assert gamma == pytest.approx(expected) and gamma >= floor
    assert [row.gamma for row in table] == pytest.approx(grid)
    rows = _gcv_rows(np.maximum(lam, 0.0), q, 6, grid)
    assert [v for row in table for v in (row.rss, row.df)] == pytest.approx(rows, rel=1e-9, abs=1e-12)
    assert np.allclose(weights.numpy(), _psd_oracle(gram, sums, gamma), atol=1e-9)
    # RidgeState.solve_projected solves the seen classes' columns with the state's n
    state = RidgeState(torch.from_numpy(gram), torch.from_numpy(np.hstack([sums, np.ones((8, 2))])), 6)
    w_state, gamma_state, table_state, _ = state.solve_projected(3, None, **extra)
    assert gamma_state == pytest.approx(expected) and torch.allclose(w_state, weights)
    assert [v for row in table_state for v in (row.rss, row.df)] == pytest.approx(rows, rel=1e-9, abs=1e-12)
    w_fixed, gamma_fixed, table_fixed, _ = state.solve_projected(3, 0.7)
    assert gamma_fixed == 0.7 and table_fixed == []
    assert np.allclose(w_fixed.numpy(), _psd_oracle(gram, sums, 0.7), atol=1e-9)


def test_psd_gcv_grid_starts_at_the_floor_itself_and_is_whole_for_a_psd_gram() -> None:
    sums = torch.ones(2, 1, dtype=torch.float64)
    # λ_min = −1 exactly: the grid point 1 = |λ_min| is kept (γ ≥ floor), 1e-2 … 10^-0.25 are not
    table = solve_ridge_psd(torch.diag(torch.tensor([5.0, -1.0], dtype=torch.float64)), sums, 4, None)[2]
    assert table[0].gamma == 1.0 and len(table) == 33
    # a PSD Gram (λ_min = 0): the floor is 0, the whole 41-point grid
    table = solve_ridge_psd(torch.diag(torch.tensor([5.0, 0.0], dtype=torch.float64)), sums, 4, None)[2]
    assert len(table) == 41 and table[0].gamma == pytest.approx(0.01)
    # no features at all: no spectrum, the floor is 0, every γ scores alike and the first is taken
    weights, gamma, table, _ = solve_ridge_psd(
        torch.zeros(0, 0, dtype=torch.float64), torch.zeros(0, 2, dtype=torch.float64), 5, None
    )
    assert tuple(weights.shape) == (0, 2) and gamma == pytest.approx(0.01) and len(table) == 41


def test_psd_gcv_falls_back_to_the_floor_when_the_whole_grid_is_below_it() -> None:
    gram = torch.diag(torch.tensor([1.0, -1e9], dtype=torch.float64))
    sums = torch.ones(2, 1, dtype=torch.float64)
    _, gamma, table, _ = solve_ridge_psd(gram, sums, 0, None)  # n = 0 is scored as n = 1
    assert gamma == 1e9 and [row.gamma for row in table] == [1e9]
    # n = 1, one column of q: λ = (1, 0), γ = 1e9
    lam, q = np.array([0.0, 1.0]), np.array([1.0, 1.0])
    rss = max(1.0 - float(np.sum(q * (lam + 2e9) / (lam + 1e9) ** 2)), 0.0)
    df = float(np.sum(lam / (lam + 1e9)))
    assert table[0].rss == pytest.approx(rss) and table[0].df == pytest.approx(df)


@pytest.mark.parametrize("sums_noise", [0.0, 0.5, 1e6])
def test_subspace_gcv_debiases_q_by_the_sums_noise(sums_noise: float) -> None:
    rng = np.random.default_rng(5)
    basis, _ = np.linalg.qr(rng.normal(size=(7, 3)))
    sigma = np.array([5.0, 2.0, 0.5])
    summary = LowRankSummary(torch.from_numpy(basis), torch.from_numpy(sigma), 40)
    b = rng.normal(size=(7, 2)) * 3
    grid = [0.01, 0.1, 1.0, 10.0, 100.0]
    q = np.maximum(((basis.T @ b) ** 2).sum(axis=1) - sums_noise, 0.0)
    expected = _gcv_oracle(sigma**2, q, 40, 40.0, grid)
    gamma, table = select_subspace_ridge_gcv(summary, torch.from_numpy(b), 40, 40.0, grid, sums_noise=sums_noise)
    assert gamma == expected
    rss = [max(40.0 - float(np.sum(q * (sigma**2 + 2 * g) / (sigma**2 + g) ** 2)), 0.0) for g in grid]
    assert [row.rss for row in table] == pytest.approx(rss)


def test_lowrank_keep_overrides_rank_and_n_and_is_capped_at_m() -> None:
    rng = np.random.default_rng(9)
    a = rng.normal(size=(5, 5))
    noisy = torch.from_numpy(a @ a.T + np.diag([5.0, 4.0, 3.0, 2.0, 1.0]))
    lam = np.sort(np.linalg.eigvalsh(noisy.numpy()))[::-1]
    kept = client_summary_from_gram(noisy, 0, 1, keep=3)  # n = 0: a noised Gram is still sketched
    assert kept.rank == 3 and kept.num_samples == 0
    assert np.allclose(kept.singular_values.numpy(), np.sqrt(lam[:3]))
    capped = client_summary_from_gram(noisy, 2, 2, keep=9)
    assert capped.rank == 5 and np.allclose(capped.singular_values.numpy(), np.sqrt(lam))
    assert client_summary_from_gram(noisy, 0, 4).rank == 0  # without keep, n = 0 is the empty sketch
    assert client_summary_from_gram(noisy, 2, 4).rank == 2  # and r = min(rank, n, M)
