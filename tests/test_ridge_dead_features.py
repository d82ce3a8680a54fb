"""Dead features in the ridge solve (issue 30): a feature no sample activates has a zero row and
column in G, so (G + γI) is block diagonal and the solve splits exactly into a smaller factor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fcl_flower.analytic import solve_ridge
from fcl_flower.analytic.errors import NotPositiveDefiniteError
from fcl_flower.analytic.ridge import live_features


def relu_statistics(dim: int = 60, rows: int = 25, dead: int = 15, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """G = ΦᵀΦ and C = ΦᵀY of random ReLU features, ``dead`` of them never active."""
    generator = torch.Generator().manual_seed(seed)
    phi = torch.relu(torch.randn(rows, dim, generator=generator, dtype=torch.float64))
    phi[:, torch.randperm(dim, generator=generator)[:dead]] = 0.0
    labels = torch.randint(0, 3, (rows,), generator=generator)
    y = torch.nn.functional.one_hot(labels, 3).to(torch.float64)
    return phi.T @ phi, phi.T @ y


def reference(gram: torch.Tensor, sums: torch.Tensor, ridge: float) -> torch.Tensor:
    return torch.linalg.solve(gram + ridge * torch.eye(gram.shape[0], dtype=torch.float64), sums)


def test_dead_features_split_the_solve_and_give_the_centralised_solution() -> None:
    gram, sums = relu_statistics()
    live = live_features(gram)
    assert live is not None and live.size == 45  # 15 of 60 dead
    weights = solve_ridge(gram, sums, 3.0)
    assert torch.allclose(weights, reference(gram, sums, 3.0), rtol=1e-12, atol=1e-14)
    dead = np.setdiff1d(np.arange(60), live)
    assert torch.equal(weights[dead], torch.zeros(15, 3, dtype=torch.float64))


def test_a_dead_row_with_class_sums_gets_them_over_gamma() -> None:
    """W_dead = C_dead / γ whatever C holds there (the split is algebra, not an assumption on C)."""
    gram, sums = relu_statistics(seed=1)
    live = live_features(gram)
    assert live is not None
    dead = np.setdiff1d(np.arange(60), live)
    sums[dead] = torch.linspace(-2.0, 5.0, 45, dtype=torch.float64).reshape(15, 3)
    weights = solve_ridge(gram, sums, 7.0)
    assert torch.allclose(weights, reference(gram, sums, 7.0), rtol=1e-12, atol=1e-14)
    assert torch.allclose(weights[dead], sums[dead] / 7.0, rtol=1e-15, atol=0.0)


@pytest.mark.parametrize("where", ["row", "column"])
def test_a_zero_diagonal_with_anything_beside_it_is_not_split(where: str) -> None:
    """A zero diagonal alone does not make a feature dead: its row and column must be zero too (an
    indefinite or non-symmetric G takes the full factorisation, as before)."""
    gram, sums = relu_statistics(seed=2)
    live = live_features(gram)
    assert live is not None
    i = int(np.setdiff1d(np.arange(60), live)[0])
    j = int(live[0])
    if where == "row":
        gram[i, j] = 0.25
    else:
        gram[j, i] = 0.25
    assert live_features(gram) is None
    if where == "row":  # the factorisation reads the lower triangle: a symmetric change to compare
        gram[j, i] = 0.25
        assert torch.allclose(solve_ridge(gram, sums, 3.0), reference(gram, sums, 3.0), rtol=1e-10)


def test_few_dead_features_keep_the_full_factorisation() -> None:
    gram, _ = relu_statistics(dead=2)
    assert live_features(gram) is None  # 2 of 60 is below the share worth a gather


def test_a_failed_factor_names_the_column_of_g() -> None:
    """The live block's failure is reported in G's own column numbers."""
    gram, sums = relu_statistics(seed=3)
    live = live_features(gram)
    assert live is not None
    target = int(live[10])
    gram[target, target] = -1e6  # indefinite at that feature: no factor for a small γ
    with pytest.raises(NotPositiveDefiniteError, match=f"column {target + 1}\\)"):
        solve_ridge(gram, sums, 1.0)
