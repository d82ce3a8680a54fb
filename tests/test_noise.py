"""Noise and differential privacy, the math (fcl_flower/privacy/noise.py, accountant.py) and the
checks and solve that must cope with it (fcl_flower/analytic/checks.py, ridge.py).

* the noise has the stated distribution (statistical tests, fixed seeds);
* the Gaussian mechanism's block scales make one mechanism of multiplier z;
* the accountant's ε is dp-accounting's for known settings, and falls as σ grows;
* clipping bounds every sample's contribution to what each method uploads;
* honest noisy statistics pass the widened checks, gross poisoning still fails;
* the ridge copes with an indefinite noisy G.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

from clients.fedran import random_feature_statistics
from fcl_flower.analytic import StatisticsAccumulator, pack_upper, random_features, random_projection
from fcl_flower.analytic.checks import (
    NoiseLevels,
    StatisticsRejected,
    check_class_sums,
    check_counts,
    check_gram_statistics,
    check_lowrank_statistics,
    noise_spectral_bound,
    wire_epsilon,
)
from fcl_flower.analytic.lowrank import client_summary_from_gram
from fcl_flower.analytic.ridge import solve_ridge, solve_ridge_psd
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.privacy import accountant
from fcl_flower.privacy.noise import (
    NoiseScale,
    dp_scale,
    effective_multiplier,
    noise_generator,
    paper_scale,
    sensitivities,
    symmetric_gaussian,
    upload_scale,
)

EPS64 = wire_epsilon(torch.float64)
DELTA = 1e-5


# ------------------------------------------------------------------------------ configuration
def test_paper_noise_is_q_times_s_on_what_noise_on_names() -> None:
    def stds(scale: NoiseScale | None) -> dict[str, float]:
        assert scale is not None
        return scale.as_dict()

    blocks = ("gram", "sums", "counts")
    assert stds(paper_scale(0.2, 0.05, "features", blocks)) == pytest.approx({"gram": 0.01, "sums": 0.01, "counts": 0})
    assert stds(paper_scale(0.2, 0.05, "counts", ("sums", "counts"))) == pytest.approx(
        {"gram": 0, "sums": 0, "counts": 0.01}
    )
    stsa = RunConfig(strategy="stsa", noise_q=0.1, noise_s=5.0, noise_on="features")
    assert stds(upload_scale(stsa)) == pytest.approx({"gram": 0.5, "sums": 0.5, "counts": 0})  # Eq. 63: G and C
    stsa_e = RunConfig(strategy="stsa-e", noise_q=0.1, noise_s=5.0)
    assert stds(upload_scale(stsa_e)) == pytest.approx({"gram": 0, "sums": 0.5, "counts": 0.5})  # Eq. 64 (E3)
    assert upload_scale(RunConfig()) is None


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"noise_q": 0.1}, "both noise-q and noise-s"),
        ({"noise_s": -1.0}, "noise-s must be"),
        ({"dp_epsilon": 1.0}, "feature-clip"),
        ({"dp_epsilon": 1.0, "feature_clip": 1.0, "noise_q": 0.1, "noise_s": 1.0}, "choose one noise"),
        ({"dp_epsilon": 1.0, "feature_clip": 1.0, "noise_on": "features"}, "noise-on must be 'both'"),
        ({"dp_epsilon": 1.0, "feature_clip": 1.0, "min_class_count": 3}, "min-class-count 1"),
        ({"dp_epsilon": 1.0, "feature_clip": 1.0, "strategy": "fedran", "label_ratio": 0.5}, "label-ratio 1"),
        ({"dp_epsilon": 1.0, "feature_clip": 1.0, "strategy": "joint"}, "noise on the uploads works with"),
        ({"noise_q": 0.1, "noise_s": 1.0, "strategy": "finetune"}, "noise on the uploads works with"),
        ({"dp_delta": 0.0}, "dp-delta"),
        ({"dp_epsilon": math.inf, "feature_clip": 1.0}, "dp-epsilon must be"),
    ],
)
def test_bad_noise_settings_fail_with_one_line(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        RunConfig(**changes).validated()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("blocks", [("gram", "sums", "counts"), ("sums", "counts")])
def test_the_block_scales_make_one_gaussian_mechanism_of_multiplier_z(blocks: tuple[str, ...]) -> None:
    """σ_j = z Δ_j √J: the upload with each block divided by its σ moves by 1/z for one sample."""
    for z, bound in ((0.7, 1.0), (3.0, 2.5)):
        scale = dp_scale(z, bound, blocks)
        delta = sensitivities(bound)
        assert math.sqrt(sum((delta[b] / scale.of(b)) ** 2 for b in blocks)) == pytest.approx(1 / z)
        assert effective_multiplier(scale, bound, blocks) == pytest.approx(z)
        assert effective_multiplier(scale.scaled(0.5), bound, blocks) == pytest.approx(z / 2)


# ------------------------------------------------------------------------------ the noise itself
def test_seeded_noise_repeats_and_os_noise_does_not() -> None:
    a = noise_generator(True, (0, 1, 2, 0)).normal(size=5)
    assert np.array_equal(a, noise_generator(True, (0, 1, 2, 0)).normal(size=5))
    assert not np.array_equal(a, noise_generator(True, (0, 2, 2, 0)).normal(size=5))
    assert not np.array_equal(noise_generator(False).normal(size=5), noise_generator(False).normal(size=5))


def test_symmetric_noise_is_iid_on_and_above_the_diagonal() -> None:
    std, dim = 0.3, 60
    noise = symmetric_gaussian(noise_generator(True, (7,)), dim, std)
    assert torch.equal(noise, noise.T)
    upper = pack_upper(noise).numpy() / std  # diagonal included
    assert stats.kstest(upper, "norm").pvalue > 1e-3
    assert np.std(upper) == pytest.approx(1.0, rel=0.05)


# ------------------------------------------------------------------------------ accountant
@pytest.mark.parametrize("z", [0.8, 2.0, 7.0])
def test_pld_epsilon_of_one_gaussian_is_the_analytic_gaussian_mechanism(z: float) -> None:
    import dp_accounting

    exact = dp_accounting.get_epsilon_gaussian(z, DELTA)  # Balle & Wang 2018, in dp-accounting
    assert accountant.epsilon_spent([z], DELTA, "pld") == pytest.approx(exact, rel=1e-3)
    # composing k Gaussian mechanisms of multiplier z is one of multiplier z/√k
    assert accountant.epsilon_spent([z] * 4, DELTA, "pld") == pytest.approx(
        dp_accounting.get_epsilon_gaussian(z / 2, DELTA), rel=1e-3
    )


def test_rdp_epsilon_is_dp_accountings_rdp_accountant() -> None:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    direct = rdp_privacy_accountant.RdpAccountant()
    direct.compose(dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z) for z in (1.5, 3.0, 3.0)]))
    assert accountant.epsilon_spent([1.5, 3.0, 3.0], DELTA, "rdp") == pytest.approx(direct.get_epsilon(DELTA))
    # RDP is an upper bound of the tight PLD value
    assert accountant.epsilon_spent([1.5, 3.0, 3.0], DELTA, "rdp") >= accountant.epsilon_spent([1.5, 3.0, 3.0], DELTA)


@pytest.mark.parametrize("name", accountant.ACCOUNTANTS)
def test_epsilon_falls_as_the_noise_grows(name: str) -> None:
    epsilons = [accountant.epsilon_spent([z] * 3, DELTA, name) for z in (0.5, 1.0, 2.0, 4.0, 8.0)]
    assert all(a > b for a, b in itertools.pairwise(epsilons))
    assert accountant.epsilon_spent([], DELTA, name) == 0.0
    assert accountant.epsilon_spent([0.0], DELTA, name) == math.inf  # a release without noise


def test_calibration_meets_the_target_and_no_smaller_noise_would() -> None:
    for epsilon, releases in ((1.0, 1), (4.0, 5)):
        z = accountant.calibrate_multiplier(epsilon, DELTA, releases)
        assert accountant.epsilon_spent([z] * releases, DELTA) <= epsilon
        assert accountant.epsilon_spent([z * 0.99] * releases, DELTA) > epsilon


def test_the_ledger_composes_each_clients_releases_and_survives_a_checkpoint() -> None:
    ledger = accountant.PrivacyLedger(DELTA)
    ledger.record(["client-0", "client-1"], 0, 2.0)
    ledger.record(["client-1"], 1, 2.0)  # client-1 released twice
    assert ledger.counts() == {"client-0": 1, "client-1": 2}
    assert ledger.worst() == ("client-1", pytest.approx(accountant.epsilon_spent([2.0, 2.0], DELTA)))
    assert ledger.worst(0)[1] == pytest.approx(accountant.epsilon_spent([2.0], DELTA))
    copy = accountant.PrivacyLedger(DELTA)
    copy.load_state_dict(ledger.state_dict())
    assert copy.releases == ledger.releases


# ------------------------------------------------------------------------------ clipping
def _with_outlier(seed: int, rf_dim: int, clip: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 3, (30,), generator=gen)
    outlier = 1e4 * torch.randn(1, 8, generator=gen, dtype=torch.float64)  # a sample far out
    return features, labels, torch.cat([features, outlier]), torch.cat([labels, torch.tensor([1])])


@pytest.mark.parametrize("rf_dim", [40, 0])  # 0: no projection, the backbone features are clipped
def test_clipping_bounds_every_per_sample_contribution(rf_dim: int) -> None:
    bound = 1.5
    projection = random_projection(8, rf_dim, seed=3) if rf_dim else None
    dim = rf_dim or 8
    for seed in range(3):
        features, labels, more, more_labels = _with_outlier(seed, rf_dim, bound)

        def stsa(f: torch.Tensor, y: torch.Tensor):
            acc = StatisticsAccumulator(dim, 3, with_gram=True)
            acc.update(random_features(f, projection, bound), y)
            return acc.result()

        a, b = stsa(features, labels), stsa(more, more_labels)
        assert b.gram is not None and a.gram is not None
        assert float(torch.linalg.matrix_norm(b.gram - a.gram)) <= bound**2 * (1 + 1e-9)  # Δ_G = B²
        assert float(torch.linalg.matrix_norm(b.class_sums - a.class_sums)) <= bound * (1 + 1e-9)  # Δ_C = B
        assert float((b.counts - a.counts).abs().sum()) == 1.0  # Δ_n = 1
        # STSA-E's cells are the same sums over a subset: the same bounds. FedRAN: G (its sketch) and B
        sa, ba = (
            random_feature_statistics(f, y, projection, 3, dim, clip=bound)
            for f, y in ((features, labels), (more, more_labels))
        )
        assert float(torch.linalg.matrix_norm(ba[0].gram() - sa[0].gram())) <= bound**2 * (1 + 1e-6)
        assert float(torch.linalg.matrix_norm(ba[1] - sa[1])) <= bound * (1 + 1e-9)


# ------------------------------------------------------------------------------ checks under noise
def _honest(seed: int, n: int = 60, dim: int = 30, classes: int = 4, clip: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=gen, dtype=torch.float64)
    phi = random_features(x, random_projection(12, dim, seed=seed), clip)
    y = torch.nn.functional.one_hot(torch.randint(0, classes, (n,), generator=gen), classes).to(torch.float64)
    return phi, y


def _noised(phi: torch.Tensor, y: torch.Tensor, noise: NoiseLevels, seed: int):
    rng = noise_generator(True, (seed,))
    g = phi.T @ phi + symmetric_gaussian(rng, phi.shape[1], noise.gram)
    c = phi.T @ y + torch.from_numpy(rng.normal(0.0, noise.sums or 1.0, (phi.shape[1], y.shape[1]))) * (noise.sums > 0)
    n = y.sum(0) + torch.from_numpy(rng.normal(0.0, noise.counts or 1.0, y.shape[1])) * (noise.counts > 0)
    return g, c, n


NOISES = {
    "paper q=0.1 s=5": NoiseLevels(0.5, 0.5, 0.5),
    "DP eps=0.5 (z=15.7, B=1)": NoiseLevels(27.2, 27.2, 27.2),
    "features only": NoiseLevels(2.0, 2.0, 0.0),
}


@pytest.mark.parametrize("name", NOISES)
def test_honest_noisy_statistics_pass_the_widened_checks(name: str) -> None:
    noise = NOISES[name]
    for seed in range(10):
        phi, y = _honest(seed)
        g, c, n = _noised(phi, y, noise, seed)
        check_counts(n, 0 if noise.counts else phi.shape[0], noise=noise.counts)
        check_gram_statistics(g, c, n, relative_tolerance=EPS64, norm_bound=1.0, nonnegative=True, noise=noise)
        cells = torch.stack([phi[:30].T @ y[:30], phi[30:].T @ y[30:]])
        counts = torch.stack([y[:30].sum(0), y[30:].sum(0)])
        rng = noise_generator(True, (seed, 1))
        noisy_cells = cells + torch.from_numpy(rng.normal(0.0, noise.sums, cells.shape))
        noisy_counts = counts + torch.from_numpy(rng.normal(0.0, noise.counts or 1e-300, counts.shape)) * (
            noise.counts > 0
        )
        check_class_sums(
            noisy_cells, noisy_counts, relative_tolerance=EPS64, norm_bound=1.0, nonnegative=True, noise=noise
        )
        eigenvalues = torch.linalg.eigvalsh(g).flip(0).clamp_min(0.0)
        n_reported = max(round(float(n.sum())), 0) if noise.counts else phi.shape[0]
        check_lowrank_statistics(
            eigenvalues.sqrt(), c, n_reported, relative_tolerance=EPS64, norm_bound=1.0, nonnegative=True, noise=noise
        )


POISON = {
    "not PSD": lambda g, c, n, tau: (g - 10 * tau * torch.eye(len(g)), c, n),
    "class sums x1000": lambda g, c, n, tau: (g, 1000 * c, n),
    "negative class sums": lambda g, c, n, tau: (g, c - 100 * tau, n),
    "a Gram far beyond n B^2": lambda g, c, n, tau: (g + 100 * float(n.sum()) * torch.eye(len(g)), c, n),
}


@pytest.mark.parametrize("poison", POISON)
@pytest.mark.parametrize("name", NOISES)
def test_gross_poisoning_is_still_rejected_under_noise(poison: str, name: str) -> None:
    noise = NOISES[name]
    phi, y = _honest(0, n=200)
    g, c, n = _noised(phi, y, noise, 0)
    tau = max(noise_spectral_bound(noise, g.shape[0], c.shape[1]), 1.0)
    bad = POISON[poison](g, c, n, tau)
    with pytest.raises(StatisticsRejected):
        check_gram_statistics(*bad, relative_tolerance=EPS64, norm_bound=1.0, nonnegative=True, noise=noise)


def test_noisy_counts_far_below_zero_and_cells_with_sums_but_no_samples_are_rejected() -> None:
    with pytest.raises(StatisticsRejected, match="counts below"):
        check_counts(torch.tensor([3.0, -100.0]), 0, noise=1.0)
    sums = torch.zeros(1, 30, 2)
    sums[0, :, 1] = 50.0  # a long sum in a cell whose noisy count is provably 0
    with pytest.raises(StatisticsRejected, match="no sample"):
        check_class_sums(sums, torch.tensor([[5.0, -3.0]]), relative_tolerance=EPS64, noise=NoiseLevels(0.0, 0.1, 0.1))


def test_fedran_noisy_sketch_is_orthonormal_and_keeps_min_r_m_components() -> None:
    phi, _ = _honest(1, n=10)  # fewer samples than M: a noised Gram still has full rank
    noisy = phi.T @ phi + symmetric_gaussian(noise_generator(True, (1,)), phi.shape[1], 0.5)
    summary = client_summary_from_gram(noisy, 10, 25, keep=25)
    assert summary.rank == 25
    eye = torch.eye(25, dtype=torch.float64)
    assert torch.allclose(summary.basis.T @ summary.basis, eye, atol=1e-10)


# ------------------------------------------------------------------------------ the solve
def test_the_ridge_copes_with_an_indefinite_noisy_gram() -> None:
    phi, y = _honest(2, n=20, dim=40)
    g, c, _ = _noised(phi, y, NoiseLevels(3.0, 0.0, 0.0), 2)
    assert float(torch.linalg.eigvalsh(g)[0]) < -1.0  # indefinite
    with pytest.raises(Exception, match="not positive definite"):
        solve_ridge(g, c, 0.01)
    weights, gamma, table, projection = solve_ridge_psd(g, c, 20, None)
    assert projection.negative > 0 and bool(torch.isfinite(weights).all())
    assert gamma >= -float(torch.linalg.eigvalsh(g)[0])  # GCV's grid starts at the noise floor |λ_min|
    assert table and all(row.gamma >= table[0].gamma for row in table)
    # the projection is the nearest PSD matrix: with no negative eigenvalue it changes nothing
    exact = phi.T @ phi
    w_exact, *_ = solve_ridge_psd(exact + 1e-9 * torch.eye(40, dtype=torch.float64), c, 20, 5.0)
    assert torch.allclose(w_exact, solve_ridge(exact, c, 5.0), atol=1e-7)
