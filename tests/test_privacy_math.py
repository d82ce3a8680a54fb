"""Secure summation and the minimum-count rule, as pure math (fcl_flower/privacy).

* Fixed point: decode(encode(x)) is within 2^-(f+1) of x; magnitudes that could wrap the ring
  are refused (the bound is checked against a hand computation, not the function itself).
* Masking: with every participant, or with dropouts whose mask keys are rebuilt from Shamir
  shares, the opened sum is exactly the ring sum of the survivors' encodings; each single upload
  differs from its encoding in every entry; masks depend on every field of the round context.
* Shares: t of n shares rebuild a secret, t - 1 do not; an honest participant never reveals both
  secrets of one node, nor anything with fewer than t survivors.
* Signed keys: only keys signed by a listed SuperNode key, for this round, verify.
* Identifiability (the reason for min-class-count 3): from G = ΦᵀΦ and a class sum over two
  samples both samples' features are recovered; with three samples another feature set with the
  same G and C exists, in which no sample keeps its feature.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fcl_flower.privacy import SecureAggregationError, disclosable, withheld_cells
from fcl_flower.privacy.secagg import (
    check_unmask_request,
    decode_fixed_point,
    encode_fixed_point,
    encoding_bound,
    generate_keypair,
    make_shares,
    mask_arrays,
    new_seed,
    open_shares,
    reconstruct,
    round_context,
    sign_keys,
    threshold_for,
    unmask_sum,
    verify_keys,
)

BITS = 24


class Round:
    """n participants with sparse node ids over Flower's whole uint64 range (real SuperNodes get
    random 64-bit ids): their key pairs, seeds and decrypted shares."""

    def __init__(self, count: int, context: bytes = b"", min_clients: int = 2) -> None:
        self.nodes = [2**64 - 1 - 7919 * k if k % 2 else 1000 + 7 * k for k in range(count)]
        self.context = context or round_context("run", 1, 2, 3, 0, self.nodes)
        self.c = {n: generate_keypair() for n in self.nodes}
        self.s = {n: generate_keypair() for n in self.nodes}
        self.seed = {n: new_seed() for n in self.nodes}
        self.threshold = threshold_for(count, min_clients)
        c_public = {n: self.c[n][1] for n in self.nodes}
        self.dealt = {
            n: make_shares(n, self.seed[n], self.s[n][0], self.c[n][0], c_public, self.threshold, self.context)
            for n in self.nodes
        }
        self.held = {
            d: open_shares(
                d,
                self.c[d][0],
                c_public,
                {src: self.dealt[src].bundles[d] for src in self.nodes},
                {src: self.dealt[src].commitments[d] for src in self.nodes},
                self.context,
            )[0]
            for d in self.nodes
        }

    @property
    def s_public(self) -> dict[int, bytes]:
        return {n: self.s[n][1] for n in self.nodes}

    def mask(self, node: int, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return mask_arrays(arrays, node, self.s[node][0], self.seed[node], self.s_public, self.context, BITS, 2)

    def open(self, uploads: dict[int, np.ndarray], name: str, responders: list[int]) -> np.ndarray:
        """Open the survivors' sum the way the server does, from the responders' shares."""
        survivors = sorted(uploads)
        dropped = [n for n in self.nodes if n not in uploads]
        seeds = {k: reconstruct([self.held[d][k][0] for d in responders], self.threshold) for k in survivors}
        keys = {j: reconstruct([self.held[d][j][1] for d in responders], self.threshold) for j in dropped}
        return unmask_sum(uploads.values(), name, seeds, keys, self.s_public, self.context, BITS)


def test_fixed_point_round_trip_error_is_at_most_half_a_step() -> None:
    x = np.random.default_rng(0).normal(scale=1e4, size=10_000)
    error = np.abs(decode_fixed_point(encode_fixed_point(x, BITS, 5), BITS) - x)
    assert error.max() <= 2.0 ** -(BITS + 1)
    assert np.all(encode_fixed_point(-x, BITS, 5).view(np.int64) == -encode_fixed_point(x, BITS, 5).view(np.int64))


def test_values_that_could_wrap_the_ring_are_refused() -> None:
    bound = encoding_bound(BITS, 10)
    assert bound == 2.0**63 / 2.0**24 / 10  # hand computation: the ring's half range / 2^f / participants
    encode_fixed_point(np.array([0.99 * bound]), BITS, 10)
    with pytest.raises(SecureAggregationError, match="lower secagg-fraction-bits"):
        encode_fixed_point(np.array([bound]), BITS, 10)
    with pytest.raises(SecureAggregationError, match="non-finite"):
        encode_fixed_point(np.array([np.nan]), BITS, 10)


@pytest.mark.parametrize("dropped", [0, 1, 2])
def test_the_opened_sum_is_exactly_the_survivors_ring_sum(dropped: int) -> None:
    r = Round(5)
    rng = np.random.default_rng(dropped)
    data = {n: {"g": rng.normal(size=(30,)), "c": rng.normal(size=(6, 5))} for n in r.nodes}
    uploads = {n: r.mask(n, data[n]) for n in r.nodes}
    survivors = r.nodes[dropped:]
    for name in ("g", "c"):
        exact = sum(encode_fixed_point(data[n][name], BITS, 5) for n in survivors)  # ring sum of encodings
        opened = r.open({n: uploads[n][name] for n in survivors}, name, survivors[: r.threshold])
        assert np.array_equal(opened, decode_fixed_point(exact, BITS).reshape(-1))
        assert np.abs(opened - sum(data[n][name] for n in survivors).reshape(-1)).max() <= 5 * 2.0 ** -(BITS + 1)
        for n in r.nodes:
            assert uploads[n][name].dtype == np.uint64 and uploads[n][name].shape == data[n][name].shape
            assert np.all(uploads[n][name] != encode_fixed_point(data[n][name], BITS, 5))


@pytest.mark.parametrize("field", range(6))
def test_masks_depend_on_every_field_of_the_round_context(field: int) -> None:
    """Run, task, stage, round, attempt and participants: change any one and every mask changes
    (the same mask in two tasks would be a two-time pad)."""
    nodes = [1, 2, 3]
    values = ["run", 1, 2, 3, 0, nodes]
    other = list(values)
    other[field] = "other" if field == 0 else ([*nodes, 4] if field == 5 else values[field] + 1)  # type: ignore[operator]
    private, public = generate_keypair()
    _peer_private, peer_public = generate_keypair()
    seed, x = new_seed(), {"g": np.full(64, 1.5)}
    peers = {1: public, 2: peer_public}
    first = mask_arrays(x, 1, private, seed, peers, round_context(*values), BITS, 2)["g"]
    second = mask_arrays(x, 1, private, seed, peers, round_context(*other), BITS, 2)["g"]
    assert not np.any(first == second)


def test_without_its_secrets_a_sum_is_noise() -> None:
    r = Round(3)
    uploads = {n: r.mask(n, {"g": np.full(50, 1.5)})["g"] for n in r.nodes}
    no_masks_removed = decode_fixed_point(sum(uploads[n] for n in r.nodes[1:]), BITS)
    assert np.abs(no_masks_removed - 3.0).min() > 1e3


def test_t_shares_rebuild_a_secret_and_fewer_do_not() -> None:
    r = Round(5)  # threshold 3
    assert r.threshold == 3
    target = r.nodes[0]
    assert reconstruct([r.held[d][target][0] for d in r.nodes[1:4]], 3) == r.seed[target]
    assert reconstruct([r.held[d][target][1] for d in r.nodes[2:5]], 3) == r.s[target][0]
    with pytest.raises(SecureAggregationError, match="2 share"):
        reconstruct([r.held[d][target][0] for d in r.nodes[:2]], 3)
    # two shares combined as if they were enough do not give the seed (garbage, or no secret at all)
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares

    with contextlib.suppress(ValueError):
        assert combine_shares([r.held[d][target][0] for d in r.nodes[:2]]) != r.seed[target]


def test_an_honest_participant_never_reveals_both_secrets_of_a_node() -> None:
    nodes = [1, 2, 3, 4, 5]
    check_unmask_request([1, 2, 3], [4, 5], nodes, 3)
    with pytest.raises(SecureAggregationError, match=r"both secrets of node\(s\) \[3\]"):
        check_unmask_request([1, 2, 3], [3, 4], nodes, 3)
    with pytest.raises(SecureAggregationError, match="fewer than the threshold"):
        check_unmask_request([1, 2], [3, 4, 5], nodes, 3)
    with pytest.raises(SecureAggregationError, match="outside the round"):
        check_unmask_request([1, 2, 3, 9], [], nodes, 3)


def test_shares_bind_their_round_and_their_recipient() -> None:
    r = Round(3)
    c_public = {n: r.c[n][1] for n in r.nodes}
    src, dst, other = r.nodes
    dealt = make_shares(src, r.seed[src], r.s[src][0], r.c[src][0], c_public, 2, r.context)
    bundle, commitment = {src: dealt.bundles[dst]}, {src: dealt.commitments[dst]}
    for node, context in ((dst, round_context("run", 1, 2, 4, 0, r.nodes)), (other, r.context)):
        opened, accused = open_shares(node, r.c[node][0], c_public, bundle, commitment, context)
        assert opened == {} and "does not decrypt" in accused[src]


def test_a_participant_refuses_too_small_a_round_and_rounds_it_is_not_part_of() -> None:
    private, public = generate_keypair()
    _, other = generate_keypair()
    with pytest.raises(SecureAggregationError, match="at least 2"):
        mask_arrays({"g": np.ones(3)}, 1, private, new_seed(), {1: public}, b"ctx", BITS, 2)
    with pytest.raises(SecureAggregationError, match="not among"):
        mask_arrays({"g": np.ones(3)}, 1, private, new_seed(), {2: other, 3: other}, b"ctx", BITS, 2)


def test_only_listed_keys_that_signed_this_round_verify() -> None:
    signing = ec.generate_private_key(ec.SECP384R1())
    stranger = ec.generate_private_key(ec.SECP384R1())
    der = signing.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    (_, c), (_, s) = generate_keypair(), generate_keypair()
    context = round_context("run", 0, 1, 1, 0, ())
    signer, signature = sign_keys(signing, c, s, context)
    verify_keys([der], signer, signature, c, s, context)
    with pytest.raises(SecureAggregationError, match="does not verify"):
        verify_keys([der], signer, signature, s, c, context)  # substituted keys
    with pytest.raises(SecureAggregationError, match="does not verify"):
        verify_keys([der], signer, signature, c, s, round_context("run", 0, 1, 2, 0, ()))  # another round
    other_signer, other_signature = sign_keys(stranger, c, s, context)
    with pytest.raises(SecureAggregationError, match="did not list"):
        verify_keys([der], other_signer, other_signature, c, s, context)


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
