"""The ridge floor: no upload the checks accept can make ``ridge auto``'s solve fail.

A Gram of fewer samples than features is singular; rounded to float32 for the wire, its zero
eigenvalues move by up to the rounding, below zero too, and the upload check accepts that (and
whatever an adversary hides inside the same tolerance). GCV runs on the clamped spectrum and could
then pick a γ below |λ_min| (seen with a random-init ViT-B/16, whose features have a large common
part: "G + 0.01·I is not positive definite"), and the stage failed. The exact scan now searches
only γ >= ridge.factorable_floor(spectrum); the Krylov search falls back to it when its γ has no
Cholesky factor.
"""

from __future__ import annotations

import math

import pytest
import torch

from fcl_flower.analytic import pack_upper, random_features, random_projection, unpack_upper
from fcl_flower.analytic.checks import StatisticsRejected, check_packed_statistics, wire_epsilon
from fcl_flower.analytic.errors import AnalyticInputError, NotPositiveDefiniteError
from fcl_flower.analytic.ridge import (
    RidgeState,
    default_ridge_grid,
    factorable_floor,
    gcv_from_spectrum,
    product_rounding_bound,
    select_ridge_gcv,
    solve_ridge,
    solve_ridge_psd,
    sum_rounding_bound,
)
from fcl_flower.analytic.ridge_krylov import KrylovRow

FLOAT32 = wire_epsilon(torch.float32)


def singular_client(seed: int, n: int = 12, dim: int = 40, classes: int = 2, scale: float = 30.0):
    """Statistics of n < dim samples whose features share a large common part (as a random-init ViT's):
    (G packed in float32, C, counts), all as a client uploads them."""
    g = torch.Generator().manual_seed(seed)
    common = scale * torch.randn(16, generator=g, dtype=torch.float64)
    features = common + 0.05 * scale * torch.randn(n, 16, generator=g, dtype=torch.float64)
    phi = random_features(features.float(), random_projection(16, dim, seed=0))
    y = torch.arange(n) % classes
    onehot = torch.nn.functional.one_hot(y, classes).to(torch.float64)
    gram = phi.T @ phi
    return pack_upper(gram).to(torch.float32), (phi.T @ onehot), onehot.sum(0)


def crafted_upload(dim: int = 40, classes: int = 2, depth: float = 0.9):
    """An adversary's upload that passes the check with λ_min(G) as low as the tolerance allows:
    an honest rank-deficient J, minus ``depth`` times the slack along a null direction of the
    scaled G block."""
    packed, sums, counts = singular_client(7, dim=dim, classes=classes)
    gram = unpacked(packed, dim)
    live = gram.diagonal() > 0  # ReLU features that never fire have zero rows: left alone
    scale = gram.diagonal()[live].sqrt()
    scaled = gram[live][:, live] / scale[:, None] / scale[None, :]
    values, vectors = torch.linalg.eigh(scaled)
    null = vectors[:, 0]  # a direction R has (almost) nothing in: the G block's null space
    slack = 4.0 * (dim + classes) * FLOAT32
    attacked = scaled - (depth * slack + float(values[0])) * torch.outer(null, null)
    gram[torch.outer(live, live)] = (attacked * scale[:, None] * scale[None, :]).flatten()
    return pack_upper(gram).to(torch.float32), sums, counts


def unpacked(packed: torch.Tensor, dim: int) -> torch.Tensor:
    return unpack_upper(packed.to(torch.float64), dim)


@pytest.mark.parametrize("depth", [0.5, 0.9, 0.99])
def test_a_crafted_upload_passes_the_check_with_a_negative_eigenvalue_below_the_grid(depth: float) -> None:
    packed, sums, counts = crafted_upload(depth=depth)
    check_packed_statistics(packed, sums, counts, relative_tolerance=FLOAT32)  # accepted
    lowest = float(torch.linalg.eigvalsh(unpacked(packed, 40))[0])
    assert -lowest > 10 * float(default_ridge_grid()[0])  # deep below the grid's first γ


def test_a_crafted_upload_beyond_the_tolerance_is_rejected() -> None:
    packed, sums, counts = crafted_upload(depth=3.0)
    with pytest.raises(StatisticsRejected, match="not positive semidefinite"):
        check_packed_statistics(packed, sums, counts, relative_tolerance=FLOAT32)


def attacked_state(honest: int = 0) -> RidgeState:
    """The crafted upload (first: its null direction is the stage's), then ``honest`` honest
    float32 uploads, each accepted by the check."""
    state = RidgeState.empty(40, 2)
    uploads = [crafted_upload(depth=0.99)] + [singular_client(seed, n=4) for seed in range(honest)]
    for packed, sums, counts in uploads:
        check_packed_statistics(packed, sums, counts, relative_tolerance=FLOAT32)
        state.add_packed(range(2), packed.to(torch.float64), sums, int(counts.sum()))
    return state


def test_without_the_floor_gcv_chooses_a_gamma_without_a_cholesky_factor() -> None:
    """The attack: GCV on the clamped spectrum over the whole grid picks a γ where the solve fails."""
    state = attacked_state()
    eigvals, vectors = torch.linalg.eigh(state.gram)
    q = ((vectors.T @ state.class_sums) ** 2).sum(dim=1)
    unguarded, _ = gcv_from_spectrum(eigvals.clamp_min(0.0), q, state.num_samples, float(state.num_samples))
    assert unguarded < -float(eigvals[0])
    with pytest.raises(NotPositiveDefiniteError):
        solve_ridge(state.gram, state.class_sums, unguarded)


@pytest.mark.parametrize("selection", ["exact", "krylov"])
@pytest.mark.parametrize("honest", [0, 3])
def test_with_the_floor_the_solve_succeeds_and_is_exact(selection: str, honest: int) -> None:
    state = attacked_state(honest=honest)
    eigvals = torch.linalg.eigvalsh(state.gram)
    weights, gamma, table = state.solve(2, None, selection)
    assert gamma >= factorable_floor(eigvals) >= -2.0 * float(eigvals[0])
    if state.selection["method"] == "exact":
        assert all(row.gamma >= factorable_floor(eigvals) for row in table)
    expected = torch.linalg.solve(state.gram + gamma * torch.eye(40, dtype=torch.float64), state.class_sums)
    torch.testing.assert_close(weights, expected, rtol=1e-8, atol=1e-10)


def test_the_krylov_search_falls_back_when_its_gamma_has_no_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    import fcl_flower.analytic.ridge as ridge

    state = attacked_state()
    lowest = float(torch.linalg.eigvalsh(state.gram)[0])
    below = float(default_ridge_grid()[default_ridge_grid() < -lowest].max())
    real = ridge.krylov_gcv

    def too_low(*args, **kwargs):  # a search whose choice sits under |λ_min|
        found = real(*args, **kwargs)
        found.gamma = below
        found.rows = [*found.rows, KrylovRow(gamma=below, rss=1.0, df=1.0, gcv=1.0, error=0.0)]
        return found

    monkeypatch.setattr(ridge, "krylov_gcv", too_low)
    _, gamma, _ = state.solve(2, None, "krylov")
    assert "not certified" in str(state.selection["fallback"]) and state.selection["method"] == "krylov"
    assert gamma >= factorable_floor(torch.linalg.eigvalsh(state.gram))


def test_the_floor_is_twice_the_negative_part_plus_the_factorisations_rounding() -> None:
    unit = 2.0**-53
    assert factorable_floor(torch.tensor([-3.0, 0.0, 5.0], dtype=torch.float64)) == 2 * (3.0 + 3 * unit * 5.0)
    assert factorable_floor(torch.tensor([1.0, 4.0], dtype=torch.float64)) == 2 * (2 * unit * 4.0)
    assert factorable_floor(torch.tensor([-2.0, -1.0], dtype=torch.float64)) == 4.0
    assert factorable_floor(torch.zeros(0, dtype=torch.float64)) == 0.0


def test_a_floor_above_the_whole_grid_is_the_only_candidate() -> None:
    gram = torch.diag(torch.tensor([-1e9, 1.0, 2.0], dtype=torch.float64))
    gamma, table = select_ridge_gcv(gram, torch.ones(3, 1, dtype=torch.float64), 3, 3.0)
    assert gamma == factorable_floor(torch.tensor([-1e9, 1.0, 2.0], dtype=torch.float64)) and len(table) == 1


@pytest.mark.parametrize("seed", range(4))
def test_honest_float32_uploads_of_few_samples_solve_and_a_psd_gram_keeps_the_whole_grid(seed: int) -> None:
    state = RidgeState.empty(40, 2)
    for client in range(3):
        packed, sums, counts = singular_client(seed * 10 + client)
        check_packed_statistics(packed, sums, counts, relative_tolerance=FLOAT32)
        state.add_packed(range(2), packed.to(torch.float64), sums, int(counts.sum()))
    _, gamma, _ = state.solve(2, None, "exact")
    assert gamma >= factorable_floor(torch.linalg.eigvalsh(state.gram))
    exact = RidgeState.empty(40, 2)
    exact.add(range(2), torch.eye(40, dtype=torch.float64), torch.ones(40, 2, dtype=torch.float64), 50)
    assert len(exact.solve(2, None, "exact")[2]) == default_ridge_grid().numel()


def test_the_floor_of_a_negative_semidefinite_spectrum_adds_no_rounding_term() -> None:
    assert factorable_floor(torch.tensor([-1e-20, -1e-21], dtype=torch.float64)) == 2e-20


def test_a_grid_point_equal_to_the_floor_is_kept() -> None:
    gram = torch.diag(torch.tensor([-0.5, -0.25, 0.0], dtype=torch.float64))  # floor exactly 2·0.5 = 1.0
    assert factorable_floor(torch.linalg.eigvalsh(gram)) == 1.0 and 1.0 in default_ridge_grid().tolist()
    _, table = select_ridge_gcv(gram, torch.ones(3, 1, dtype=torch.float64), 3, 3.0)
    assert table[0].gamma == 1.0


def test_a_floor_above_the_grid_keeps_its_float64_value() -> None:
    spectrum = torch.tensor([-(1e9 + 1 / 3), 1.0, 2.0], dtype=torch.float64)
    floor = factorable_floor(spectrum)
    assert float(torch.tensor(floor, dtype=torch.float32)) != floor  # not representable in float32
    gamma, table = select_ridge_gcv(torch.diag(spectrum), torch.ones(3, 1, dtype=torch.float64), 3, 3.0)
    assert gamma == floor and [row.gamma for row in table] == [floor]


def test_a_python_grid_is_searched_at_its_float64_values() -> None:
    gram = torch.eye(3, dtype=torch.float64)
    _, table = select_ridge_gcv(gram, torch.ones(3, 1, dtype=torch.float64), 3, 3.0, grid=[0.1, 0.3])
    assert [row.gamma for row in table] == [0.1, 0.3]


def test_the_psd_projection_solves_a_float32_gram_in_float64() -> None:
    packed, sums, counts = singular_client(3)
    gram32 = unpacked(packed, 40).to(torch.float32)
    weights, gamma, _, projection = solve_ridge_psd(gram32, sums, int(counts.sum()), 2.5)
    reference, _, _, expected = solve_ridge_psd(gram32.to(torch.float64), sums, int(counts.sum()), 2.5)
    assert weights.dtype == torch.float64 and gamma == 2.5
    assert torch.equal(weights, reference)
    assert projection == expected  # the trace too, summed in float64


# ------------------------------------------------------------------------------ a fixed γ, the certificate
def projected_system(gram: torch.Tensor, gamma: float) -> torch.Tensor:
    """P(G) + γI straight from the definition (P: the negative eigenvalues set to zero)."""
    values, vectors = torch.linalg.eigh(gram)
    projected = vectors @ torch.diag(values.clamp_min(0.0)) @ vectors.T
    return projected + gamma * torch.eye(gram.shape[0], dtype=torch.float64)


def assert_projected(state: RidgeState, weights: torch.Tensor, gamma: float) -> None:
    """W solves (P(G) + γI) W = C (backward-stably) and is solve_ridge_psd's, and the selection says so."""
    system = projected_system(state.gram, gamma)
    residual = float(torch.linalg.matrix_norm(system @ weights - state.class_sums, ord=2))
    scale = float(torch.linalg.matrix_norm(system, ord=2) * torch.linalg.matrix_norm(weights, ord=2))
    assert residual <= 1e-12 * scale
    assert torch.equal(weights, solve_ridge_psd(state.gram, state.class_sums, state.num_samples, gamma)[0])
    projection = state.selection["psd_projection"]
    assert isinstance(projection, dict) and "not certified" in projection["reason"]
    assert projection["negative_eigenvalues"] >= 1 and projection["clipped"] > 0


@pytest.mark.parametrize("honest", [0, 3])
def test_a_fixed_gamma_below_the_attacked_spectrum_projects_instead_of_failing_the_stage(honest: int) -> None:
    """The attack against a fixed γ below the |λ_min| the tolerance lets an adversary reach: G + γI
    has no Cholesky factor, so the stage used to fail; the solve now keeps γ on G projected onto the
    PSD cone, and says so."""
    state = attacked_state(honest=honest)
    gamma = float(default_ridge_grid()[0])
    assert gamma < -float(torch.linalg.eigvalsh(state.gram)[0])
    with pytest.raises(NotPositiveDefiniteError):
        solve_ridge(state.gram, state.class_sums, gamma)
    weights, chosen, table = state.solve(2, gamma)
    assert chosen == gamma and table == [] and state.selection["method"] == "fixed"
    assert_projected(state, weights, gamma)


@pytest.mark.parametrize("excess", [1e-9, 1e-4, 0.25])
def test_a_fixed_gamma_just_above_the_attacked_spectrum_is_not_amplified(excess: float) -> None:
    """The other half of the attack: γ just above |λ_min| factorises, but G + γI is nearly singular
    along the adversary's direction and W blows up there (by γ/(γ + λ_min)); with the cosine head
    that silences chosen classes. λ_min(G) ≥ −γ/2 is not certified there, so the solve projects:
    W stays the projected one, whatever the excess."""
    state = attacked_state()
    lowest = float(torch.linalg.eigvalsh(state.gram)[0])
    gamma = -lowest * (1.0 + excess)
    direct = solve_ridge(state.gram, state.class_sums, gamma)  # factorises: the old solve's answer
    weights, _, _ = state.solve(2, gamma)
    assert_projected(state, weights, gamma)
    if excess < 1e-3:
        assert float(direct.norm()) > 100 * float(weights.norm())  # what the attack did to the old solve
    assert float(weights.norm()) <= float(state.class_sums.norm()) / gamma  # ‖(P(G) + γI)⁻¹‖ ≤ 1/γ


def count_factorisations(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The shift of every Cholesky factorisation ridge.py makes from now on (certificates and solves)."""
    import fcl_flower.analytic.ridge as ridge

    shifts: list[float] = []
    real = ridge.shifted_cholesky

    def counting(gram, shift, *args):
        shifts.append(shift)
        return real(gram, shift, *args)

    monkeypatch.setattr(ridge, "shifted_cholesky", counting)
    return shifts


def test_a_gamma_the_checks_certify_costs_one_factorisation_and_one_they_do_not_two(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = count_factorisations(monkeypatch)  # the solve's own included
    honest = RidgeState.empty(40, 2)
    for seed in range(3):
        packed, sums, counts = singular_client(seed)
        bound = check_packed_statistics(packed, sums, counts, relative_tolerance=FLOAT32)
        honest.add_packed(range(2), packed.to(torch.float64), sums, int(counts.sum()), bound)
    gamma = 2.0 * honest.negative_bound  # certified by the checks alone
    weights, _, _ = honest.solve(2, gamma)
    assert calls == [gamma] and honest.selection == {"method": "fixed", "certificate": "checks"}
    calls.clear()
    unknown = RidgeState(honest.gram.clone(), honest.class_sums.clone(), honest.num_samples, math.inf)
    again, _, _ = unknown.solve(2, gamma)
    assert calls == [gamma / 4, gamma] and unknown.selection["certificate"] == "float32 factorisation"
    assert torch.equal(weights, again)
    assert unknown.negative_bound == gamma / 2  # what the float32 factorisation certified


def test_what_a_check_certifies_holds_for_honest_and_crafted_uploads() -> None:
    """λ_min(G) ≥ −β for the β the check returns: honest float32 uploads, and the adversary's
    deepest accepted one; β is lift + slack·max D, the slack 4(M + c)ε."""
    uploads = [singular_client(seed) for seed in range(3)] + [crafted_upload(depth=0.99)]
    for packed, sums, counts in uploads:
        bound = check_packed_statistics(packed, sums, counts, relative_tolerance=FLOAT32)
        gram = unpacked(packed, 40)
        assert float(torch.linalg.eigvalsh(gram)[0]) >= -bound
        assert bound == pytest.approx(4 * 42 * FLOAT32 * float(gram.diagonal().max()), rel=1e-12)  # G's block


def test_the_state_sums_what_is_certified_and_keeps_it_across_a_checkpoint() -> None:
    state = RidgeState.empty(3, 1)
    assert state.negative_bound == 0.0  # an empty G is PSD
    one = torch.ones(3, 1, dtype=torch.float64)
    state.add(range(1), torch.eye(3, dtype=torch.float64), one, 1, 0.25)
    state.add_packed(range(1), pack_upper(torch.eye(3, dtype=torch.float64)), one, 1, 0.5)
    state.add_packed(range(1), None, one, 1, 7.0)  # no G added: nothing to certify
    rounding = 2 * 2.0**-53 * (3 + 6)  # each addition's own: 2u·tr of the sum it made
    assert state.negative_bound == pytest.approx(0.75 + rounding, abs=1e-18)
    again = RidgeState.from_state(state.state_dict())
    assert again.negative_bound == state.negative_bound and torch.equal(again.gram, state.gram)
    state.add(range(1), torch.eye(3, dtype=torch.float64), one, 1)  # a caller that knows nothing
    assert state.negative_bound == math.inf and "negative_bound" not in state.state_dict()
    assert RidgeState.from_state(state.state_dict()).negative_bound == math.inf  # as an old checkpoint
    samples = state.num_samples
    for bad in (-1.0, math.nan):
        for add in (state.add, state.add_packed):
            with pytest.raises(AnalyticInputError, match="negative_bound"):
                add(range(1), None, one, 1, bad)
    assert state.num_samples == samples  # refused before anything changed
    with pytest.raises(AnalyticInputError, match="negative_bound"):
        RidgeState.from_state({**again.state_dict(), "negative_bound": -0.5})


def test_the_server_s_own_float64_product_is_certified_by_its_rounding_bound() -> None:
    g = torch.Generator().manual_seed(5)
    phi = torch.randn(30, 50, generator=g, dtype=torch.float64) * torch.logspace(0, 6, 50, dtype=torch.float64)
    gram = phi.T @ phi  # rank 30 < 50: its zero eigenvalues come out as ± rounding
    bound = product_rounding_bound(30, float(gram.trace()))
    assert float(torch.linalg.eigvalsh(gram)[0]) >= -bound
    assert bound == pytest.approx(30 * 2.0**-53 * float(gram.trace()), rel=1e-12)
    assert product_rounding_bound(2**53, 1.0) == math.inf and product_rounding_bound(10, -5.0) == 0.0


def test_a_zero_fixed_gamma_on_a_singular_gram_still_fails_with_its_reason() -> None:
    """γ = 0 (the API's; the run config wants γ > 0) has no projection to fall back on."""
    state = attacked_state()
    with pytest.raises(NotPositiveDefiniteError, match="increase the ridge"):
        state.solve(2, 0.0)


def test_a_failed_eigendecomposition_is_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    import scipy.linalg

    def diverges(*args, **kwargs):
        raise np.linalg.LinAlgError("the algorithm failed to converge")

    monkeypatch.setattr(scipy.linalg, "eigh", diverges)
    with pytest.raises(AnalyticInputError, match="eigendecomposition of G failed: the algorithm failed"):
        attacked_state().solve(2, float(default_ridge_grid()[0]))


def test_the_stage_records_and_logs_the_fixed_gamma_projection(caplog: pytest.LogCaptureFixture) -> None:
    """The server's glue (strategies.analytic.solve_dense): the projected solve is the stage's
    ``psd_projection`` extra with its reason, the certificate is ``ridge_solve``'s, and a warning
    is logged: never silent."""
    from fcl_flower.config import RunConfig
    from strategies.analytic import solve_dense

    state = attacked_state()
    with caplog.at_level("WARNING", logger="flwr"):
        weights, extra = solve_dense(state, 2, RunConfig(ridge="0.01"))
    assert extra["ridge"] == 0.01 and "gcv" not in extra
    assert torch.equal(weights, solve_ridge_psd(state.gram, state.class_sums, state.num_samples, 0.01)[0])
    assert "PSD cone" in extra["psd_projection"]["reason"] and extra["psd_projection"]["negative_eigenvalues"] >= 1
    assert extra["ridge_solve"]["method"] == "fixed" and extra["ridge_solve"]["certificate"].startswith("none")
    assert extra["certificate_seconds"] > 0  # the factorisation that failed to certify: a wall time
    assert any("PSD cone" in record.getMessage() for record in caplog.records)
    honest = RidgeState.empty(40, 2)
    honest.add(range(2), torch.eye(40, dtype=torch.float64), torch.ones(40, 2, dtype=torch.float64), 50, 0.0)
    extra = solve_dense(honest, 2, RunConfig(ridge="0.01"))[1]
    assert "psd_projection" not in extra and extra["ridge_solve"] == {"method": "fixed", "certificate": "checks"}


def test_a_small_gamma_is_certified_in_float64_and_a_failed_float32_factorisation_never_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """float32 certifies only where its usual backward error (2⁻²² tr(G + γ/4·I)) fits under γ/4;
    below that, and whenever its factorisation fails, float64 decides and certifies −γ/4."""
    import fcl_flower.analytic.ridge as ridge

    gram = torch.diag(torch.tensor([1e9, 1.0, 2.0], dtype=torch.float64))
    sums = torch.ones(3, 1, dtype=torch.float64)
    small = RidgeState(gram.clone(), sums.clone(), 3)  # 2⁻²²·1e9 ≈ 238 > γ/4: float64
    small.solve(1, 4.0)
    assert small.selection["certificate"] == "float64 factorisation" and small.negative_bound == 1.0
    dtypes: list[torch.dtype] = []
    real = ridge.shifted_cholesky

    def float32_fails(gram, shift, dtype=torch.float64):
        dtypes.append(dtype)
        factor, info = real(gram, shift, dtype)
        return factor, (1 if dtype == torch.float32 else info)

    monkeypatch.setattr(ridge, "shifted_cholesky", float32_fails)
    large = RidgeState(gram.clone(), sums.clone(), 3)
    weights, _, _ = large.solve(1, 1e4)
    assert dtypes[:2] == [torch.float32, torch.float64] and large.selection["certificate"] == "float64 factorisation"
    assert large.negative_bound == 2.5e3 and torch.equal(weights, solve_ridge(gram, sums, 1e4))


def test_the_checks_certify_only_up_to_half_the_ridge(monkeypatch: pytest.MonkeyPatch) -> None:
    """β ≤ γ/2 is free; β just above it costs the factorisation of G + γ/4·I."""
    shifts = count_factorisations(monkeypatch)
    gram, sums = torch.eye(3, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64)
    for bound, certificate in ((0.5, "checks"), (0.5 + 1e-12, "float32 factorisation"), (1.0, "float32 factorisation")):
        shifts.clear()
        state = RidgeState(gram.clone(), sums.clone(), 3, bound)
        state.solve(1, 1.0)
        assert state.selection["certificate"] == certificate
        assert shifts == ([1.0] if certificate == "checks" else [0.25, 1.0])


def test_a_bound_that_lies_still_cannot_fail_the_stage() -> None:
    """A state that claims β = 0 for an indefinite G (a bug, or a bound the checks got wrong): the
    certificate passes, the solve finds no factor, and the fixed γ is kept on the projection."""
    state = attacked_state()
    lying = RidgeState(state.gram.clone(), state.class_sums.clone(), state.num_samples, 0.0)
    weights, _, _ = lying.solve(2, float(default_ridge_grid()[0]))
    assert lying.selection["certificate"] == "checks, but G + γI has no Cholesky factor"
    assert_projected(lying, weights, float(default_ridge_grid()[0]))


def test_the_rounding_bounds_at_their_edges() -> None:
    unit = 2.0**-53
    assert product_rounding_bound(0, 1.0) == product_rounding_bound(1, 1.0) == pytest.approx(unit, rel=1e-12)
    assert product_rounding_bound(2**50, 6.0) == pytest.approx(1.0, rel=1e-12)  # γ_n = 1/7, / (1 − γ_n)
    assert product_rounding_bound(2**52, 1.0) == math.inf  # n u = 1/2: no bound
    assert sum_rounding_bound(0.0) == sum_rounding_bound(-3.0) == 0.0
    assert sum_rounding_bound(0.5) == unit


def test_a_zero_bound_survives_a_checkpoint() -> None:
    state = RidgeState.empty(2, 1)
    assert state.state_dict()["negative_bound"] == 0.0
    assert RidgeState.from_state(state.state_dict()).negative_bound == 0.0
