"""Secure summation and the minimum-count rule, as pure math (fcl_flower/privacy).

* Fixed point: decode(encode(x)) is within 2^-(f+1) of x; magnitudes that could wrap the ring
  are refused.
* Masking: the masked uploads of all participants sum to exactly the sum of their encodings;
  each single upload differs from its encoding in every entry; masks are fresh per attempt;
  without one participant the sum is far from the truth (why the server re-runs the round).
* Identifiability (the reason for min-class-count 3): from G = ΦᵀΦ and a class sum over two
  samples both samples' features are recovered; with three samples another feature set with the
  same G and C exists, in which no sample keeps its feature.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fcl_flower.privacy import SecureAggregationError, disclosable, withheld_cells
from fcl_flower.privacy.secagg import (
    decode_fixed_point,
    encode_fixed_point,
    encoding_bound,
    generate_keypair,
    mask_arrays,
    round_context,
    unmask_sum,
)

BITS = 24


def participants(count: int) -> tuple[dict[int, bytes], dict[int, bytes]]:
    """(node id -> private key, node id -> public key) for ``count`` nodes with sparse ids."""
    keys = {1000 + 7 * k: generate_keypair() for k in range(count)}
    return {n: k[0] for n, k in keys.items()}, {n: k[1] for n, k in keys.items()}


def test_fixed_point_round_trip_error_is_at_most_half_a_step() -> None:
    x = np.random.default_rng(0).normal(scale=1e4, size=10_000)
    error = np.abs(decode_fixed_point(encode_fixed_point(x, BITS, 5), BITS) - x)
    assert error.max() <= 2.0 ** -(BITS + 1)
    assert np.all(encode_fixed_point(-x, BITS, 5).view(np.int64) == -encode_fixed_point(x, BITS, 5).view(np.int64))


def test_values_that_could_wrap_the_ring_are_refused() -> None:
    bound = encoding_bound(BITS, 10)
    encode_fixed_point(np.array([0.99 * bound]), BITS, 10)
    with pytest.raises(SecureAggregationError, match="lower secagg-fraction-bits"):
        encode_fixed_point(np.array([bound]), BITS, 10)
    with pytest.raises(SecureAggregationError, match="non-finite"):
        encode_fixed_point(np.array([np.nan]), BITS, 10)


def test_masks_cancel_exactly_and_hide_every_entry() -> None:
    private, public = participants(4)
    rng = np.random.default_rng(1)
    data = {n: {"g": rng.normal(size=(30,)), "c": rng.normal(size=(6, 5))} for n in private}
    context = round_context(0, 3, 0, public)
    uploads = {n: mask_arrays(data[n], n, private[n], public, context, BITS, 2) for n in private}
    for name in ("g", "c"):
        exact = sum(encode_fixed_point(data[n][name], BITS, 4) for n in private)  # ring sum of encodings
        opened = unmask_sum((uploads[n][name] for n in private), BITS)
        assert np.array_equal(opened, decode_fixed_point(exact, BITS))
        assert np.abs(opened - sum(data[n][name] for n in private)).max() <= 4 * 2.0 ** -(BITS + 1)
        for n in private:
            assert uploads[n][name].dtype == np.uint64 and uploads[n][name].shape == data[n][name].shape
            assert np.all(uploads[n][name] != encode_fixed_point(data[n][name], BITS, 4))


def test_masks_are_fresh_per_attempt_and_useless_without_a_participant() -> None:
    private, public = participants(3)
    x = {n: {"g": np.full(50, 1.5)} for n in private}
    first = {n: mask_arrays(x[n], n, private[n], public, round_context(0, 1, 0, public), BITS, 2) for n in private}
    again = {n: mask_arrays(x[n], n, private[n], public, round_context(0, 1, 1, public), BITS, 2) for n in private}
    node = next(iter(private))
    assert not np.any(first[node]["g"] == again[node]["g"])
    partial = unmask_sum((first[n]["g"] for n in list(private)[1:]), BITS)
    assert np.abs(partial - 3.0).min() > 1e3  # two of three masked uploads decode to noise


def test_a_participant_refuses_too_small_a_round_and_rounds_it_is_not_part_of() -> None:
    private, public = participants(2)
    node, other = list(private)
    alone = {node: public[node]}
    with pytest.raises(SecureAggregationError, match="at least 2"):
        mask_arrays({"g": np.ones(3)}, node, private[node], alone, b"ctx", BITS, 2)
    with pytest.raises(SecureAggregationError, match="not among"):
        mask_arrays({"g": np.ones(3)}, node, private[node], {other: public[other], 1: public[other]}, b"ctx", BITS, 2)


# ------------------------------------------------------------------------------ min-class-count
def test_disclosable_keeps_exactly_the_classes_with_enough_samples() -> None:
    labels = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 3])
    assert disclosable(labels, 5, 3).tolist() == [False] * 3 + [True] * 7
    assert disclosable(labels, 5, 1).all()
    assert withheld_cells(torch.tensor([[0, 1, 2, 3]]), 3).tolist() == [[False, True, True, False]]


def class_block(n: int, dim: int, seed: int) -> torch.Tensor:
    """n random features of one class, non-negative like ReLU random features."""
    return torch.rand(n, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_two_samples_of_a_class_are_recovered_from_their_gram_and_class_sum() -> None:
    phi = class_block(2, 12, 0)
    gram, total = phi.T @ phi, phi.sum(dim=0)
    # G - s sᵀ/2 = 2 d dᵀ with φ_{1,2} = s/2 ± d: its top eigenvector gives d up to sign.
    values, vectors = torch.linalg.eigh(gram - torch.outer(total, total) / 2)
    d = vectors[:, -1] * torch.sqrt(values[-1] / 2)
    recovered = torch.stack([total / 2 + d, total / 2 - d])
    for row in phi:
        assert min(float((row - r).norm()) for r in recovered) < 1e-10


def test_three_samples_of_a_class_admit_another_feature_set_with_the_same_upload() -> None:
    phi = class_block(3, 12, 1)
    ones = torch.ones(3, dtype=torch.float64) / 3**0.5
    basis = torch.linalg.qr(torch.cat([ones[:, None], torch.eye(3, dtype=torch.float64)[:, :2]], dim=1)).Q
    angle = 0.7  # rotate within the complement of 1: Q fixes the class indicator
    rotation = torch.tensor(
        [[1, 0, 0], [0, np.cos(angle), -np.sin(angle)], [0, np.sin(angle), np.cos(angle)]], dtype=torch.float64
    )
    q = basis @ rotation @ basis.T
    other = q @ phi
    assert torch.allclose(other.T @ other, phi.T @ phi, atol=1e-12)  # same G
    assert torch.allclose(other.sum(dim=0), phi.sum(dim=0), atol=1e-12)  # same class sum C
    assert all(float((other[i] - phi[i]).norm()) > 1e-3 * float(phi[i].norm()) for i in range(3))
