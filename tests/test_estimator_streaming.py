"""GramEstimator (Eq. 9 folded in one upload at a time) against the batch estimate_gram.

The batch form needs every upload at once; the streaming form must give the same Ĝ for
any upload order, with absent classes, dummy clients and both K modes, also once a class's
outer-product sum has switched from columns to its dense form.
"""

from __future__ import annotations

import pytest
import torch

from fcl_flower.analytic import AnalyticInputError, estimate_gram
from fcl_flower.analytic.estimator import GramEstimator


def uploads(num: int, rf_dim: int, classes: int, seed: int, absent: float = 0.3):
    """Random non-negative class sums and integer counts; some (upload, class) pairs absent."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 9, (num, classes), generator=g).to(torch.float64)
    counts[torch.rand(num, classes, generator=g) < absent] = 0.0
    means = torch.rand(num, rf_dim, classes, generator=g, dtype=torch.float64)
    return means * counts.unsqueeze(1), counts  # a class sum is zero where its count is


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max()
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(scale))


@pytest.mark.parametrize("k_mode", ["global", "per-class"])
@pytest.mark.parametrize("rf_dim", [40, 6])  # 6 < number of holders: the dense path is used
def test_streaming_equals_batch(k_mode, rf_dim):
    sums, counts = uploads(num=12, rf_dim=rf_dim, classes=4, seed=rf_dim)
    estimator = GramEstimator(rf_dim, 4, k_mode=k_mode)
    for k in range(12):
        estimator.add(sums[k], counts[k])
    assert_same(estimator.result(), estimate_gram(sums, counts, k_mode=k_mode))
    assert torch.allclose(estimator.class_sums, sums.sum(dim=0), rtol=1e-14)
    assert torch.equal(estimator.counts, counts.sum(dim=0))
    if rf_dim == 6:
        assert any(d is not None for d in estimator._dense)


def test_dummy_client_blocks_count_as_separate_uploads():
    """A client's (K_D, M, c) block is K_D uploads in K, exactly as when stacked."""
    sums, counts = uploads(num=15, rf_dim=10, classes=3, seed=1)
    estimator = GramEstimator(10, 3)
    for k in range(5):  # 5 clients with K_D = 3 each
        estimator.add(sums[3 * k : 3 * k + 3], counts[3 * k : 3 * k + 3])
    assert estimator.num_uploads == 15
    assert_same(estimator.result(), estimate_gram(sums, counts))


def test_upload_order_does_not_matter():
    sums, counts = uploads(num=9, rf_dim=5, classes=3, seed=2)
    results = []
    for order in (range(9), reversed(range(9)), [4, 0, 8, 2, 6, 1, 3, 7, 5]):
        estimator = GramEstimator(5, 3, k_mode="per-class")
        for k in order:
            estimator.add(sums[k], counts[k])
        results.append(estimator.result())
    assert_same(results[1], results[0])
    assert_same(results[2], results[0])


def test_state_is_bounded_by_dense_gram_per_class():
    """However many uploads arrive, the state never exceeds 2·c·M² + M·c numbers."""
    rf_dim, classes = 8, 2
    estimator = GramEstimator(rf_dim, classes)
    bound = 2 * classes * rf_dim**2 + rf_dim * classes
    for seed in range(60):
        sums, counts = uploads(num=1, rf_dim=rf_dim, classes=classes, seed=100 + seed, absent=0.0)
        estimator.add(sums[0], counts[0])
        assert estimator.state_numbers() <= bound
    assert estimator.state_numbers() == classes * rf_dim**2 + rf_dim * classes  # all dense now


def test_bad_input_raises_one_line_errors():
    estimator = GramEstimator(4, 2)
    with pytest.raises(AnalyticInputError, match="at least one upload"):
        estimator.result()
    with pytest.raises(AnalyticInputError, match="shape"):
        estimator.add(torch.zeros(3, 2), torch.ones(2))
    with pytest.raises(AnalyticInputError, match="non-negative"):
        estimator.add(torch.zeros(4, 2), torch.tensor([1.0, -1.0]))
    estimator.add(torch.ones(4, 2), torch.ones(2))
    with pytest.raises(AnalyticInputError, match="at least 2"):
        estimator.result()  # global K needs two uploads, like estimate_gram
    with pytest.raises(AnalyticInputError, match="k_mode"):
        GramEstimator(4, 2, k_mode="nope")  # type: ignore[arg-type]  # the bad value is the test
