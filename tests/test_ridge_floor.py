"""The ridge floor: no upload the checks accept can make G + γI lose its Cholesky factor.

A Gram of fewer samples than features is singular; rounded to float32 for the wire, its zero
eigenvalues move by up to the rounding, below zero too, and the upload check accepts that (and
whatever an adversary hides inside the same tolerance). Before the floor, GCV could then pick a γ
below that level (seen with a random-init ViT-B/16 whose features have a large common part:
"G + 0.01·I is not positive definite") and the stage failed. RidgeState now sums each accepted
upload's bound (checks.accepted_indefiniteness) and GCV searches only γ >= twice the sum.
"""

from __future__ import annotations

import pytest
import torch

from fcl_flower.analytic import pack_upper, random_features, random_projection
from fcl_flower.analytic.checks import (
    StatisticsRejected,
    accepted_indefiniteness,
    check_packed_statistics,
    wire_epsilon,
)
from fcl_flower.analytic.errors import AnalyticInputError, NotPositiveDefiniteError
from fcl_flower.analytic.ridge import RidgeState, default_ridge_grid, solve_ridge
from fcl_flower.protocol.payloads import StsaStats
from strategies.stsa import TaskSum

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
    gram = torch.zeros(dim, dim, dtype=torch.float64)
    rows, cols = torch.triu_indices(dim, dim)
    gram[rows, cols] = packed.to(torch.float64)
    gram = gram + gram.triu(1).T
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
    gram = torch.zeros(dim, dim, dtype=torch.float64)
    rows, cols = torch.triu_indices(dim, dim)
    gram[rows, cols] = packed.to(torch.float64)
    return gram + gram.triu(1).T


@pytest.mark.parametrize("seed", range(6))
def test_an_honest_float32_upload_is_within_its_bound(seed: int) -> None:
    packed, sums, counts = singular_client(seed)
    check_packed_statistics(packed, sums, counts, relative_tolerance=FLOAT32)
    bound = accepted_indefiniteness(packed, 40, 2, relative_tolerance=FLOAT32)
    lowest = float(torch.linalg.eigvalsh(unpacked(packed, 40))[0])
    assert lowest < 0.0  # the rounding does push the zero eigenvalues below zero
    assert -lowest <= bound


@pytest.mark.parametrize("depth", [0.5, 0.9, 0.99])
def test_a_crafted_upload_that_passes_the_check_stays_within_the_bound(depth: float) -> None:
    packed, sums, counts = crafted_upload(depth=depth)
    check_packed_statistics(packed, sums, counts, relative_tolerance=FLOAT32)  # accepted
    bound = accepted_indefiniteness(packed, 40, 2, relative_tolerance=FLOAT32)
    lowest = float(torch.linalg.eigvalsh(unpacked(packed, 40))[0])
    assert -lowest > 10 * float(default_ridge_grid()[0])  # deep below the grid's first γ ...
    assert -lowest <= bound  # ... and no deeper than the bound


def test_a_crafted_upload_beyond_the_tolerance_is_rejected() -> None:
    packed, sums, counts = crafted_upload(depth=3.0)
    with pytest.raises(StatisticsRejected, match="not positive semidefinite"):
        check_packed_statistics(packed, sums, counts, relative_tolerance=FLOAT32)


def test_the_bound_is_the_checks_slack_times_the_largest_diagonal() -> None:
    packed, _, _ = singular_client(0)
    top = float(unpacked(packed, 40).diagonal().max())
    assert accepted_indefiniteness(packed, 40, 2, relative_tolerance=FLOAT32) == pytest.approx(
        4 * 42 * FLOAT32 * top, rel=1e-12
    )
    lifted = accepted_indefiniteness(packed, 40, 2, relative_tolerance=FLOAT32, absolute_tolerance=1e-3)
    lift = 4 * 42 * 1e-3
    assert lifted == pytest.approx(lift + 4 * 42 * FLOAT32 * (top + lift), rel=1e-12)
    assert accepted_indefiniteness(torch.zeros(0), 0, 0, relative_tolerance=FLOAT32) == 0.0
    with pytest.raises(AnalyticInputError, match="does not fit"):
        accepted_indefiniteness(packed, 41, 2, relative_tolerance=FLOAT32)


def attacked_state(selection_floor: bool, honest: int = 0) -> RidgeState:
    """The crafted upload (alone: its null direction is the stage's), then ``honest`` honest ones,
    each accepted by the check; ``selection_floor``: whether the state is told each upload's bound
    (what TaskSum does)."""
    state = RidgeState.empty(40, 2)
    uploads = [crafted_upload(depth=0.99)] + [singular_client(seed, n=4) for seed in range(honest)]
    for packed, sums, counts in uploads:
        check_packed_statistics(packed, sums, counts, relative_tolerance=FLOAT32)
        bound = accepted_indefiniteness(packed, 40, 2, relative_tolerance=FLOAT32) if selection_floor else 0.0
        state.add_packed(range(2), packed.to(torch.float64), sums, int(counts.sum()), bound)
    return state


def test_the_attack_breaks_the_bottom_of_the_grid() -> None:
    """Without the floor, γ at the grid's start has no Cholesky factor: a GCV choice there fails the stage."""
    state = attacked_state(selection_floor=False)
    assert float(torch.linalg.eigvalsh(state.gram)[0]) < -float(default_ridge_grid()[0])
    with pytest.raises(NotPositiveDefiniteError):
        solve_ridge(state.gram, state.class_sums, float(default_ridge_grid()[0]))
    for selection in ("exact", "krylov"):  # and GCV does choose such a γ
        with pytest.raises(NotPositiveDefiniteError):
            attacked_state(selection_floor=False).solve(2, None, selection)


@pytest.mark.parametrize("selection", ["exact", "krylov"])
@pytest.mark.parametrize("honest", [0, 3])
def test_with_the_floor_every_candidate_factorises_and_the_solve_succeeds(selection: str, honest: int) -> None:
    state = attacked_state(selection_floor=True, honest=honest)
    lowest = float(torch.linalg.eigvalsh(state.gram)[0])
    assert state.min_ridge >= -2.0 * lowest
    grid = state.ridge_grid()
    assert float(grid.min()) >= state.min_ridge and float(grid.max()) == float(default_ridge_grid().max())
    torch.linalg.cholesky(state.gram + float(grid.min()) * torch.eye(40, dtype=torch.float64))
    weights, gamma, table = state.solve(2, None, selection)
    assert gamma >= state.min_ridge and all(row.gamma >= state.min_ridge for row in table)
    assert state.selection["min_ridge"] == state.min_ridge
    expected = torch.linalg.solve(state.gram + gamma * torch.eye(40, dtype=torch.float64), state.class_sums)
    torch.testing.assert_close(weights, expected, rtol=1e-8, atol=1e-10)


def test_a_floor_above_the_whole_grid_is_the_only_candidate() -> None:
    state = RidgeState.empty(3, 1)
    state.add(range(1), torch.eye(3, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64), 3, 1e9)
    assert state.ridge_grid().tolist() == [2e9]
    assert state.solve(1, None)[1] == 2e9


def test_a_fixed_ridge_and_a_clean_state_are_unchanged() -> None:
    state = attacked_state(selection_floor=True)
    assert state.solve(2, 5.0)[1] == 5.0  # the user's γ is the user's
    clean = RidgeState.empty(40, 2)
    assert torch.equal(clean.ridge_grid(), default_ridge_grid())
    assert clean.min_ridge == 0.0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_bad_bound_is_refused(bad: float) -> None:
    state = RidgeState.empty(3, 1)
    with pytest.raises(AnalyticInputError, match="indefiniteness"):
        state.add(range(1), None, torch.zeros(3, 1, dtype=torch.float64), 0, bad)
    with pytest.raises(AnalyticInputError, match="indefiniteness"):
        RidgeState.from_state({**state.state_dict(), "indefiniteness": bad})


def test_the_bound_survives_a_checkpoint_and_old_checkpoints_load() -> None:
    state = attacked_state(selection_floor=True)
    saved = state.state_dict()
    assert RidgeState.from_state(saved).indefiniteness == state.indefiniteness
    older = {key: value for key, value in saved.items() if key != "indefiniteness"}
    assert RidgeState.from_state(older).indefiniteness == 0.0


def test_task_sum_adds_each_uploads_bound_at_its_wire_precision() -> None:
    uploads = [singular_client(seed) for seed in range(3)]
    total = TaskSum(40, 2)
    for packed, sums, counts in uploads:
        total.add(StsaStats(packed, sums, counts), int(counts.sum()))
    expected = sum(accepted_indefiniteness(p, 40, 2, relative_tolerance=FLOAT32) for p, _, _ in uploads)
    assert total.indefiniteness == pytest.approx(expected, rel=1e-12)
    as_float64 = TaskSum(40, 2)
    packed, sums, counts = uploads[0]
    as_float64.add(StsaStats(packed.to(torch.float64), sums, counts), int(counts.sum()))
    assert as_float64.indefiniteness == pytest.approx(
        accepted_indefiniteness(packed, 40, 2, relative_tolerance=wire_epsilon(torch.float64)), rel=1e-12
    )
    assert as_float64.indefiniteness < 1e-8 * total.indefiniteness
