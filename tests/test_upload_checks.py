"""The checks the server runs on every statistics upload (fcl_flower/analytic/checks.py).

Honest statistics of random datasets pass, at wire precision (float32) and with clipped
features; statistics that no dataset can produce are rejected with the violated property.
"""

from __future__ import annotations

import pytest
import torch

from fcl_flower.analytic import random_features, random_projection
from fcl_flower.analytic.checks import (
    StatisticsRejected,
    check_class_sums,
    check_counts,
    check_gram_statistics,
    check_lowrank_statistics,
    wire_epsilon,
)

EPS32 = wire_epsilon(torch.float32)


def dataset(seed: int, n: int = 40, features: int = 12, dim: int = 30, classes: int = 4, clip: float = 0.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen, dtype=torch.float64)
    phi = random_features(x, random_projection(features, dim, seed=seed), clip)
    labels = torch.randint(0, classes, (n,), generator=gen)
    y = torch.nn.functional.one_hot(labels, classes).to(torch.float64)
    return phi, y


def stsa_stats(phi: torch.Tensor, y: torch.Tensor, dtype: torch.dtype = torch.float32):
    g, c, n = phi.T @ phi, phi.T @ y, y.sum(0)
    return g.to(dtype).to(torch.float64), c.to(dtype).to(torch.float64), n


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("clip", [0.0, 2.0])
def test_honest_statistics_pass_every_check(seed: int, clip: float) -> None:
    phi, y = dataset(seed, clip=clip)
    if clip:
        assert float(phi.norm(dim=1).max()) <= clip * (1 + 1e-12)
    g, c, n = stsa_stats(phi, y)
    check_counts(n, phi.shape[0])
    check_gram_statistics(g, c, n, relative_tolerance=EPS32, norm_bound=clip, nonnegative=True)
    chunks = torch.stack([phi[:20].T @ y[:20], phi[20:].T @ y[20:]]).to(torch.float32)
    check_class_sums(
        chunks, torch.stack([y[:20].sum(0), y[20:].sum(0)]), relative_tolerance=EPS32, norm_bound=clip, nonnegative=True
    )
    _, sigma, _ = torch.linalg.svd(phi, full_matrices=False)
    for rank in (1, 5, 30):
        check_lowrank_statistics(
            sigma[:rank].float(),
            (phi.T @ y).float(),
            phi.shape[0],
            relative_tolerance=EPS32,
            norm_bound=clip,
            nonnegative=True,
        )


def test_a_rank_deficient_dataset_passes() -> None:
    """Fewer samples than features: G is singular but PSD, and so is the joint Gram."""
    phi, y = dataset(7, n=5)
    g, c, n = stsa_stats(phi, y, torch.float64)
    check_gram_statistics(g, c, n, relative_tolerance=wire_epsilon(torch.float64), nonnegative=True)


def test_an_empty_upload_passes_and_a_non_zero_one_without_samples_does_not() -> None:
    g, c, n = torch.zeros(3, 3), torch.zeros(3, 2), torch.zeros(2)
    check_gram_statistics(g, c, n, relative_tolerance=EPS32)
    with pytest.raises(StatisticsRejected, match="zero energy"):
        check_gram_statistics(g, c + torch.tensor([[0.0, 1e-3], [0, 0], [0, 0]]), n, relative_tolerance=EPS32)


BAD_GRAM = {
    "not PSD": (lambda g, c, n: (g - 2 * torch.linalg.eigvalsh(g)[-1] * torch.eye(len(g)), c, n), "negative diagonal"),
    "a negative eigenvalue": (
        lambda g, c, n: (g - (_eig(g, 0) + 1e-3 * _eig(g, -1)) * _outer_min(g), c, n),
        "positive semidefinite",
    ),
    "class sums x3": (lambda g, c, n: (g, 3 * c, n), "Cauchy-Schwarz"),
    "labels swapped": (lambda g, c, n: (g, c.flip(1), n), "positive semidefinite|Cauchy-Schwarz"),
    "counts quartered": (lambda g, c, n: (g, c, n / 4), "positive semidefinite|Cauchy-Schwarz"),
    "1e200": (lambda g, c, n: (g * 1e200, c, n), "magnitude"),
    "nan": (lambda g, c, n: (g, c * float("nan"), n), "NaN"),
    "negative entries": (lambda g, c, n: (g, -c, n), "negative entries"),
    "shapes": (lambda g, c, n: (g, c[:, :2], n), "do not fit"),
}


def _eig(g: torch.Tensor, i: int) -> float:
    return float(torch.linalg.eigvalsh(g)[i])


def _outer_min(g: torch.Tensor) -> torch.Tensor:
    v = torch.linalg.eigh(g)[1][:, 0]
    return torch.outer(v, v)


@pytest.mark.parametrize("name", sorted(BAD_GRAM))
def test_statistics_no_dataset_has_are_rejected(name: str) -> None:
    """On a client with uneven classes (150, 40, 10 samples)."""
    phi, _ = dataset(3, n=200, classes=3)
    y = torch.nn.functional.one_hot(torch.tensor([0] * 150 + [1] * 40 + [2] * 10), 3).to(torch.float64)
    make, reason = BAD_GRAM[name]
    g, c, n = make(*stsa_stats(phi, y))
    with pytest.raises(StatisticsRejected, match=reason):
        check_gram_statistics(g, c, n, relative_tolerance=EPS32, nonnegative=name == "negative entries")


def test_the_feature_bound_catches_a_consistent_rescaling() -> None:
    """(κ²G, κC, n) is the Gram of κΦ: only a stated bound ‖φ‖ ≤ B rejects it."""
    phi, y = dataset(4, clip=1.0)
    g, c, n = stsa_stats(phi, y)
    check_gram_statistics(100 * g, 10 * c, n, relative_tolerance=EPS32)
    with pytest.raises(StatisticsRejected, match="trace"):
        check_gram_statistics(100 * g, 10 * c, n, relative_tolerance=EPS32, norm_bound=1.0)


@pytest.mark.parametrize(
    ("counts", "total", "reason"),
    [
        ([1.0, -1.0], 0, "negative"),
        ([1.5, 0.5], 2, "non-integer"),
        ([1.0, 2.0], 4, "add up to 3"),
        ([float("inf"), 0.0], 1, "finite"),
    ],
)
def test_bad_counts_are_rejected(counts, total, reason) -> None:
    with pytest.raises(StatisticsRejected, match=reason):
        check_counts(torch.tensor(counts, dtype=torch.float64), total)


def test_class_sums_checks() -> None:
    phi, y = dataset(5, clip=1.0)
    sums, counts = (phi.T @ y).unsqueeze(0), y.sum(0).unsqueeze(0)
    empty = counts.clone()
    empty[0, 0] = 0
    with pytest.raises(StatisticsRejected, match="no sample has a non-zero sum"):
        check_class_sums(sums, empty, relative_tolerance=EPS32)
    with pytest.raises(StatisticsRejected, match="longer than"):
        check_class_sums(
            1.01 * counts.max() * sums / sums.norm(dim=1, keepdim=True),
            counts,
            relative_tolerance=EPS32,
            norm_bound=1.0,
        )
    with pytest.raises(StatisticsRejected, match="negative"):
        check_class_sums(-sums, counts, relative_tolerance=EPS32, nonnegative=True)
    with pytest.raises(StatisticsRejected, match="magnitude"):
        check_class_sums(sums * 1e160, counts, relative_tolerance=EPS32)


def test_lowrank_checks() -> None:
    phi, y = dataset(6, clip=1.0)
    sigma = torch.linalg.svdvals(phi)
    corr = phi.T @ y
    n = phi.shape[0]
    with pytest.raises(StatisticsRejected, match="σ₁"):
        check_lowrank_statistics(sigma[:3], 10 * corr, n, relative_tolerance=EPS32)
    with pytest.raises(StatisticsRejected, match="σ₁"):
        check_lowrank_statistics(sigma[:0], corr, n, relative_tolerance=EPS32)  # nothing kept, B must be 0
    check_lowrank_statistics(sigma[:0], 0 * corr, 0, relative_tolerance=EPS32)
    with pytest.raises(StatisticsRejected, match="Σσ²"):
        check_lowrank_statistics(3 * sigma, corr, n, relative_tolerance=EPS32, norm_bound=1.0)
    with pytest.raises(StatisticsRejected, match="negative"):
        check_lowrank_statistics(sigma, -corr, n, relative_tolerance=EPS32, nonnegative=True)


@pytest.mark.parametrize("seed", range(3))
def test_an_honest_opened_secure_sum_passes_with_fewer_samples_than_features(seed: int) -> None:
    """Under secure aggregation each entry is rounded to fixed point (δ = 2^-(f+1) per client): a
    rank-deficient sum (5 clients × 20 samples < M = 300) has zero eigenvalues that this rounding
    pushes below zero, and the absolute tolerance must cover it."""
    bits, clients = 16, 5
    g = torch.zeros(300, 300, dtype=torch.float64)
    c = torch.zeros(300, 4, dtype=torch.float64)
    n = torch.zeros(4, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(clients):
        phi = torch.randn(20, 300, generator=gen, dtype=torch.float64).relu()
        y = torch.nn.functional.one_hot(torch.randint(0, 4, (20,), generator=gen), 4).to(torch.float64)
        rounded = [torch.round(t * 2**bits) / 2**bits for t in (phi.T @ phi, phi.T @ y)]
        g, c, n = g + rounded[0], c + rounded[1], n + y.sum(0)
    check_gram_statistics(
        g,
        c,
        n,
        relative_tolerance=wire_epsilon(torch.float64),
        absolute_tolerance=clients * 2.0 ** -(bits + 1),
        nonnegative=True,
    )
