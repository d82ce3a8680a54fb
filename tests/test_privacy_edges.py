"""Secure aggregation and the minimum-count rule against independent oracles (issue 19).

* Published test vectors: X25519 (RFC 7748 §6.1) and the ChaCha20 keystream (RFC 7539 A.1 #1).
* HKDF-SHA256 recomputed from its definition (RFC 5869) with ``hmac``; Fernet and Shamir from the
  libraries directly; every derived key, mask, share bundle and signed payload rebuilt from the
  construction the module documents, never from the module itself.
* Hand-computed fixed point (values, two's complement, the wrap bound 2^63 / 2^f / n), hand-written
  round contexts and thresholds, and a table of bad inputs per function, each with its exact
  one-line error.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares

from fcl_flower.privacy.disclosure import disclosable, per_class_counts, withheld_cells
from fcl_flower.privacy.secagg import (
    KEY_BYTES,
    MASK_KEY,
    SEED,
    Dealt,
    SecureAggregationError,
    agree,
    check_unmask_request,
    decode_fixed_point,
    derive_key,
    encode_fixed_point,
    encoding_bound,
    generate_keypair,
    load_signing_key,
    load_trusted_keys,
    make_shares,
    mask_arrays,
    mask_stream,
    new_seed,
    open_shares,
    pair_mask,
    pairwise_mask,
    reconstruct,
    round_context,
    secret_commitment,
    self_mask,
    share_commitment,
    sign_keys,
    threshold_for,
    unmask_sum,
    verify_keys,
)

U64 = np.uint64
RING = 2**64
# RFC 7748 §6.1
ALICE = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
ALICE_PUBLIC = bytes.fromhex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
BOB = bytes.fromhex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb")
BOB_PUBLIC = bytes.fromhex("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")
SHARED = bytes.fromhex("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742")
# RFC 7539 A.1, test vector #1: the ChaCha20 block of the all-zero key, nonce and counter
CHACHA_ZERO = bytes.fromhex(
    "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
    "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
)
CONTEXT = b"fcl-flower/secagg/v2|run=r|task=0|stage=1|round=1|attempt=0|participants=1,2,3"


def _refused(call, message: str, error: type[Exception] = SecureAggregationError) -> None:
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message


# ------------------------------------------------------------------------------ oracles
def _hkdf(secret: bytes, context: bytes, label: str) -> bytes:
    """RFC 5869 HKDF-SHA256, no salt (= 32 zero bytes), 32 bytes out, info = SHA256(context) | label."""
    info = hashlib.sha256(context).digest() + b"|" + label.encode()
    prk = hmac.new(b"\x00" * 32, secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def _keystream(key: bytes, length: int) -> np.ndarray:
    """``length`` little-endian uint64 words of the ChaCha20 keystream (zero nonce and counter)."""
    encryptor = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * length)), dtype="<u8").astype(U64)


def _x25519(private: bytes, public: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(public))


def _negate(ring: np.ndarray) -> np.ndarray:
    return np.array([(RING - int(v)) % RING for v in ring], dtype=U64)


def _ring(values: list[int]) -> np.ndarray:
    return np.array([v % RING for v in values], dtype=U64)


def _fernet_key(own_private: bytes, peer_public: bytes, context: bytes, src: int, dst: int) -> bytes:
    return base64.urlsafe_b64encode(_hkdf(_x25519(own_private, peer_public), context, f"shares|{src}|{dst}"))


def _bundle(src: int, dst: int, seed_share: bytes, key_share: bytes) -> bytes:
    """The plaintext layout by hand: src, dst (8 bytes each), len(seed share) (4 bytes), all little-endian."""
    return (
        src.to_bytes(8, "little")
        + dst.to_bytes(8, "little")
        + len(seed_share).to_bytes(4, "little")
        + seed_share
        + key_share
    )


# ------------------------------------------------------------------------------ fixed point
@pytest.mark.parametrize(
    "bits, participants, expected",
    [
        (24, 10, 2.0**63 / 2.0**24 / 10),
        (0, 1, 2.0**63),
        (16, 1, 2.0**47),
        (16, 2, 2.0**46),
        (20, 3, 2.0**43 / 3),
        (16, 0, 2.0**47),  # no participant counts as one
        (16, -4, 2.0**47),
    ],
)
def test_encoding_bound_by_hand(bits: int, participants: int, expected: float) -> None:
    assert encoding_bound(bits, participants) == expected


def test_fixed_point_encodings_by_hand() -> None:
    """f = 2: x·4 rounded half to even; negatives in two's complement mod 2^64."""
    x = np.array([1.5, -0.25, 0.0, 0.125, 0.375, -1.0, 2.5])
    assert encode_fixed_point(x, 2, 1).tolist() == [6, RING - 1, 0, 0, 2, RING - 4, 10]
    matrix = encode_fixed_point(np.array([[1.0, -2.0], [0.5, 3.0]]), 3, 2)
    assert matrix.dtype == U64 and matrix.shape == (2, 2) and matrix.tolist() == [[8, RING - 16], [4, 24]]
    empty = encode_fixed_point(np.zeros((0, 3)), 8, 5)
    assert empty.dtype == U64 and empty.shape == (0, 3)
    assert encode_fixed_point([2, -3], 0, 1).tolist() == [2, RING - 3]  # lists of ints are accepted
    half = np.array([1.0, -0.5], dtype=np.float16)  # narrow floats are scaled in float64, not in their own width
    assert encode_fixed_point(half, 24, 1).tolist() == [2**24, RING - 2**23]
    for bits, n in ((63, 1), (62, 2)):  # a bound of exactly 1: an empty array still encodes
        assert encoding_bound(bits, n) == 1.0 and encode_fixed_point(np.zeros(0), bits, n).shape == (0,)
    _refused(  # a Python integer beyond int64 is a float64 magnitude, refused like any other
        lambda: encode_fixed_point([2**70], 0, 1),
        f"statistic magnitude {2.0**70:.3g} exceeds {2.0**63:.3g}, the limit for 1 participants "
        "at secagg-fraction-bits=0; lower secagg-fraction-bits",
    )


def test_fixed_point_decodings_by_hand() -> None:
    ring = np.array([6, RING - 1, 0, 2**63, 2**63 - 1], dtype=U64)
    assert decode_fixed_point(ring, 2).tolist() == [1.5, -0.25, 0.0, -(2.0**61), (2.0**63 - 1) / 4]
    assert decode_fixed_point(np.array([[RING - 16]], dtype=U64), 3).tolist() == [[-2.0]]
    assert decode_fixed_point([5], 0).dtype == np.float64
    # ring elements held in another integer width: the same two's-complement value
    assert decode_fixed_point(np.array([-8, 4], dtype=np.int32), 2).tolist() == [-2.0, 1.0]
    assert decode_fixed_point(np.array([-1], dtype=np.int64), 0).tolist() == [-1.0]


def test_fixed_point_round_trip_error_is_at_most_half_a_step() -> None:
    bits = 10
    x = np.random.default_rng(1).uniform(-1000, 1000, size=5000)
    assert np.abs(decode_fixed_point(encode_fixed_point(x, bits, 3), bits) - x).max() <= 2.0 ** -(bits + 1)
    halfway = np.array([0.5, 1.5, -0.5]) * 2.0**-bits  # exact ties: still within half a step
    assert np.abs(decode_fixed_point(encode_fixed_point(halfway, bits, 1), bits) - halfway).max() == 2.0 ** -(bits + 1)


@pytest.mark.parametrize("bits, participants", [(0, 2), (8, 3), (20, 1), (30, 7)])
def test_the_wrap_bound_refuses_exactly_at_the_bound(bits: int, participants: int) -> None:
    bound = 2.0**63 / 2.0**bits / participants
    below = np.nextafter(bound, 0.0)
    encode_fixed_point(np.array([below, -below]), bits, participants)
    for peak in (bound, -bound, 2 * bound):
        _refused(
            lambda peak=peak: encode_fixed_point(np.array([0.0, peak]), bits, participants),
            f"statistic magnitude {abs(peak):.3g} exceeds {bound:.3g}, the limit for {participants} participants "
            f"at secagg-fraction-bits={bits}; lower secagg-fraction-bits",
        )


def test_n_encodings_at_the_largest_allowed_magnitude_sum_without_wrapping() -> None:
    bits, n = 12, 4
    x = 0.999 * 2.0**63 / 2.0**bits / n
    total = sum(encode_fixed_point(np.array([x, -x]), bits, n) for _ in range(n))
    assert np.abs(decode_fixed_point(total, bits) - np.array([n * x, -n * x])).max() <= n * 2.0 ** -(bits + 1)


@pytest.mark.parametrize("bad", [[np.nan], [1.0, np.inf], [-np.inf, 0.0], [1.0, np.nan, 2.0]])
def test_non_finite_statistics_are_refused(bad) -> None:
    _refused(lambda: encode_fixed_point(np.array(bad), 16, 2), "cannot encode non-finite statistics")


# ------------------------------------------------------------------------------ keys and context
def test_round_context_by_hand() -> None:
    context = round_context("run-7", 2, 3, 11, 1, [9, 2**64 - 1, 5])
    assert context == (
        b"fcl-flower/secagg/v2|run=run-7|task=2|stage=3|round=11|attempt=1|participants=5,9,18446744073709551615"
    )
    assert (
        round_context("r", 0, 1, 1, 0, ())
        == b"fcl-flower/secagg/v2|run=r|task=0|stage=1|round=1|attempt=0|participants="
    )
    assert round_context("r", 0, 1, 1, 0, (3, 2, 1)) == CONTEXT


def test_fresh_keys_and_seeds() -> None:
    private, public = generate_keypair()
    assert len(private) == len(public) == KEY_BYTES == 32
    assert X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw() == public
    assert generate_keypair()[0] != private
    seed = new_seed()
    assert isinstance(seed, bytes) and len(seed) == 32 and new_seed() != seed


def test_derive_key_is_rfc_5869_hkdf_over_the_context_hash_and_label() -> None:
    assert derive_key(b"secret", CONTEXT, "self|g") == _hkdf(b"secret", CONTEXT, "self|g")
    assert derive_key(SHARED, b"", "") == _hkdf(SHARED, b"", "")
    assert len(derive_key(b"s", CONTEXT, "x")) == 32


def test_agree_matches_rfc_7748() -> None:
    assert agree(ALICE, BOB_PUBLIC) == SHARED and agree(BOB, ALICE_PUBLIC) == SHARED


@pytest.mark.parametrize(
    "private, public, message",
    [
        (ALICE, BOB_PUBLIC[:31], "X25519 keys have 32 bytes (got 32, 31)"),
        (ALICE[:31], BOB_PUBLIC, "X25519 keys have 32 bytes (got 31, 32)"),
        (ALICE + b"\x00", BOB_PUBLIC + b"\x00", "X25519 keys have 32 bytes (got 33, 33)"),
        (ALICE, b"", "X25519 keys have 32 bytes (got 32, 0)"),
    ],
)
def test_agree_refuses_keys_of_the_wrong_length(private, public, message) -> None:
    _refused(lambda: agree(private, public), message)


def test_agree_refuses_a_low_order_point() -> None:
    with pytest.raises(SecureAggregationError) as info:
        agree(ALICE, bytes(32))  # the all-zero point: the shared secret would be zero
    assert str(info.value).startswith("key agreement failed: ") and "\n" not in str(info.value)


# ------------------------------------------------------------------------------ masks
def test_mask_stream_is_the_chacha20_keystream() -> None:
    stream = mask_stream(bytes(32), 8)
    assert stream.dtype == U64 and stream.shape == (8,)
    assert stream.tolist() == np.frombuffer(CHACHA_ZERO, dtype="<u8").tolist()
    assert stream.flags.writeable  # a copy the caller owns, not a view of the cipher's buffer
    assert mask_stream(bytes(32), 3).tolist() == stream[:3].tolist()
    assert mask_stream(bytes(32), 0).shape == (0,)
    assert mask_stream(b"k" * 32, 20).tolist() == _keystream(b"k" * 32, 20).tolist()


def test_self_mask_by_hand() -> None:
    seed = b"b" * 32
    assert self_mask(seed, 9, CONTEXT, "gram").tolist() == _keystream(_hkdf(seed, CONTEXT, "self|gram"), 9).tolist()


@pytest.mark.parametrize("low, high", [(1, 2), (7, 2**64 - 1), (0, 2**63)])
def test_pair_masks_by_hand_and_they_cancel(low: int, high: int) -> None:
    key = _keystream(_hkdf(SHARED, CONTEXT, f"pair|{low}|{high}|sums"), 6)
    up = pair_mask(low, ALICE, high, BOB_PUBLIC, 6, CONTEXT, "sums")
    down = pair_mask(high, BOB, low, ALICE_PUBLIC, 6, CONTEXT, "sums")
    assert up.tolist() == key.tolist()
    assert down.tolist() == _negate(key).tolist()
    assert (up + down).tolist() == [0] * 6


def test_pairwise_mask_sums_the_pair_masks_without_its_own_id() -> None:
    keys = {n: generate_keypair() for n in (3, 8, 2**64 - 2)}
    publics = {n: keys[n][1] for n in keys}

    def pair(own: int, peer: int) -> np.ndarray:
        low, high = sorted((own, peer))
        stream = _keystream(_hkdf(_x25519(keys[own][0], publics[peer]), CONTEXT, f"pair|{low}|{high}|g"), 5)
        return stream if own < peer else _negate(stream)

    for own in keys:
        expected = np.zeros(5, dtype=U64)
        for peer in keys:
            if peer != own:
                expected += pair(own, peer)
        assert pairwise_mask(own, keys[own][0], publics, 5, CONTEXT, "g").tolist() == expected.tolist()
        others = {n: p for n, p in publics.items() if n != own}  # the own key is skipped, not required
        assert pairwise_mask(own, keys[own][0], others, 5, CONTEXT, "g").tolist() == expected.tolist()
    total = sum(pairwise_mask(n, keys[n][0], publics, 5, CONTEXT, "g") for n in keys)
    assert total.tolist() == [0] * 5  # the masks cancel in the ring sum
    assert pairwise_mask(3, keys[3][0], {}, 4, CONTEXT, "g").tolist() == [0] * 4


class Party:
    """Three participants with fixed keys and seeds."""

    def __init__(self, nodes=(4, 2**63 + 1, 2**64 - 1)) -> None:
        self.nodes = list(nodes)
        self.s = {n: generate_keypair() for n in self.nodes}
        self.seed = {n: bytes([i + 1]) * 32 for i, n in enumerate(self.nodes)}
        self.publics = {n: self.s[n][1] for n in self.nodes}

    def mask(self, node: int, arrays: dict, bits: int = 8, minimum: int = 2) -> dict[str, np.ndarray]:
        return mask_arrays(arrays, node, self.s[node][0], self.seed[node], self.publics, CONTEXT, bits, minimum)


def _pairwise(p: Party, own: int, name: str, length: int) -> np.ndarray:
    """Σ_{j > i} m_ij - Σ_{j < i} m_ij from the X25519 secrets, HKDF and ChaCha20 directly."""
    total = np.zeros(length, dtype=U64)
    for peer in p.nodes:
        if peer != own:
            low, high = sorted((own, peer))
            secret = _x25519(p.s[own][0], p.publics[peer])
            stream = _keystream(_hkdf(secret, CONTEXT, f"pair|{low}|{high}|{name}"), length)
            total += stream if own < peer else _negate(stream)
    return total


def test_a_masked_array_is_its_encoding_plus_the_self_and_pair_masks() -> None:
    p = Party()
    for node in p.nodes:
        values = np.array([[1.5, -2.0], [0.25, 3.0]])
        masked = p.mask(node, {"c": values, "g": np.array([1.0])})
        assert set(masked) == {"c", "g"} and masked["c"].dtype == U64 and masked["c"].shape == (2, 2)
        encoded = _ring([384, -512, 64, 768])  # x · 2^8 by hand
        own = _keystream(_hkdf(p.seed[node], CONTEXT, "self|c"), 4)
        assert (masked["c"].reshape(-1) - own - _pairwise(p, node, "c", 4)).tolist() == encoded.tolist()
        own_g = _keystream(_hkdf(p.seed[node], CONTEXT, "self|g"), 1)
        assert (masked["g"] - own_g - _pairwise(p, node, "g", 1)).tolist() == [256]


def test_masks_cancel_and_the_survivors_sum_opens_by_hand() -> None:
    p = Party()
    data = {p.nodes[0]: [1.5, -2.0], p.nodes[1]: [0.25, 4.0], p.nodes[2]: [-0.75, 0.5]}
    uploads = {n: p.mask(n, {"x": np.array(v)})["x"] for n, v in data.items()}
    opened = unmask_sum(uploads.values(), "x", p.seed, {}, p.publics, CONTEXT, 8)
    assert opened.tolist() == [1.0, 2.5]  # 1.5 + 0.25 - 0.75, -2 + 4 + 0.5
    assert all(uploads[n].tolist() != _ring([int(v * 256) for v in data[n]]).tolist() for n in p.nodes)
    gone = p.nodes[2]  # dropped after sharing: its s key is rebuilt, its upload never arrives
    survivors = {n: p.seed[n] for n in p.nodes[:2]}
    opened = unmask_sum([uploads[n] for n in survivors], "x", survivors, {gone: p.s[gone][0]}, p.publics, CONTEXT, 8)
    assert opened.tolist() == [1.75, 2.0]
    wrong_name = unmask_sum(uploads.values(), "y", p.seed, {}, p.publics, CONTEXT, 8)
    assert np.abs(wrong_name).min() > 1e6  # masks of another array do not cancel these


def test_unmask_sum_leaves_the_uploads_untouched_and_needs_one() -> None:
    p = Party()
    upload = p.mask(p.nodes[0], {"x": np.array([1.0, 2.0])})["x"]
    kept = upload.copy()
    unmask_sum([upload], "x", {p.nodes[0]: p.seed[p.nodes[0]]}, {}, p.publics, CONTEXT, 8)
    assert upload.tolist() == kept.tolist()
    _refused(lambda: unmask_sum([], "x", {}, {}, p.publics, CONTEXT, 8), "no uploads to sum")
    uploads = [p.mask(n, {"x": np.array([1.0, 2.0])})["x"] for n in p.nodes]
    signed = [u.view(np.int64) for u in uploads]  # the same ring elements stored as signed integers
    assert unmask_sum(signed, "x", p.seed, {}, p.publics, CONTEXT, 8).tolist() == [3.0, 6.0]


def test_the_wrap_bound_of_a_masked_upload_counts_the_participants() -> None:
    """3 participants at f = 8: 2^63 / 2^8 / 3 is the limit, not the one for 2."""
    p = Party()
    bound3 = 2.0**63 / 2.0**8 / 3
    p.mask(p.nodes[0], {"x": np.array([0.99 * bound3])})
    _refused(
        lambda: p.mask(p.nodes[0], {"x": np.array([1.01 * bound3])}),
        f"statistic magnitude {1.01 * bound3:.3g} exceeds {bound3:.3g}, the limit for 3 participants "
        "at secagg-fraction-bits=8; lower secagg-fraction-bits",
    )


def test_mask_arrays_refusals() -> None:
    p = Party()
    node = p.nodes[0]
    p.mask(node, {"x": np.ones(2)}, minimum=3)  # exactly the minimum
    _refused(
        lambda: p.mask(node, {"x": np.ones(2)}, minimum=4),
        "secure round with 3 participant(s); at least 4 are required (a sum over too few clients reveals them)",
    )
    alone = {node: p.publics[node]}
    _refused(
        lambda: mask_arrays({"x": np.ones(2)}, node, p.s[node][0], p.seed[node], alone, CONTEXT, 8, 2),
        "secure round with 1 participant(s); at least 2 are required (a sum over too few clients reveals them)",
    )
    others = {n: k for n, k in p.publics.items() if n != node}
    _refused(
        lambda: mask_arrays({"x": np.ones(2)}, node, p.s[node][0], p.seed[node], others, CONTEXT, 8, 2),
        "this node (4) is not among the round's participants",
    )
    _refused(
        lambda: mask_arrays({"x": np.ones(2)}, 9, p.s[node][0], p.seed[node], {9: b"", 4: b""}, CONTEXT, 8, 3),
        "secure round with 2 participant(s); at least 3 are required (a sum over too few clients reveals them)",
    )


# ------------------------------------------------------------------------------ Shamir shares
@pytest.mark.parametrize(
    "participants, min_clients, expected",
    [(2, 2, 2), (3, 2, 2), (4, 2, 3), (5, 2, 3), (6, 3, 4), (7, 2, 4), (10, 8, 8), (1, 2, 2), (9, 5, 5)],
)
def test_threshold_by_hand(participants: int, min_clients: int, expected: int) -> None:
    assert threshold_for(participants, min_clients) == expected


class Sharing:
    """Three participants 5, 2^63 and 2^64 - 1 with c and s key pairs and seeds."""

    def __init__(self, threshold: int = 2) -> None:
        self.nodes = [5, 2**63, 2**64 - 1]
        self.c = {n: generate_keypair() for n in self.nodes}
        self.s = {n: generate_keypair() for n in self.nodes}
        self.seed = {n: new_seed() for n in self.nodes}
        self.c_public = {n: self.c[n][1] for n in self.nodes}
        self.threshold = threshold

    def dealt(self, src: int, context: bytes = CONTEXT) -> Dealt:
        return make_shares(src, self.seed[src], self.s[src][0], self.c[src][0], self.c_public, self.threshold, context)

    def shares_of(self, src: int, context: bytes = CONTEXT) -> dict[int, bytes]:
        return self.dealt(src, context).bundles

    def commitments_to(self, dst: int, context: bytes = CONTEXT) -> dict[int, bytes]:
        return {src: self.dealt(src, context).commitments[dst] for src in self.nodes}


def test_share_bundles_by_hand() -> None:
    """Each bundle decrypts under the Fernet key both ends derive for (src, dst) and holds, in the
    documented layout, one share of the seed and one of the s key; any t of them rebuild both."""
    r = Sharing()
    src = r.nodes[0]
    bundles = r.shares_of(src)
    assert sorted(bundles) == r.nodes  # one per participant, the source included
    seeds, keys = [], []
    for dst, ciphertext in bundles.items():
        plain = Fernet(_fernet_key(r.c[src][0], r.c_public[dst], CONTEXT, src, dst)).decrypt(ciphertext)
        assert int.from_bytes(plain[:8], "little") == src and int.from_bytes(plain[8:16], "little") == dst
        size = int.from_bytes(plain[16:20], "little")
        seeds.append(plain[20 : 20 + size])
        keys.append(plain[20 + size :])
    for pair in ((0, 1), (1, 2), (0, 2)):
        assert combine_shares([seeds[i] for i in pair]) == r.seed[src]
        assert combine_shares([keys[i] for i in pair]) == r.s[src][0]


def test_open_shares_returns_what_each_source_sent() -> None:
    r = Sharing()
    dst = r.nodes[2]
    dealt = {src: r.dealt(src) for src in r.nodes}
    received = {src: dealt[src].bundles[dst] for src in r.nodes}
    commitments = {src: dealt[src].commitments[dst] for src in r.nodes}
    opened, bad = open_shares(dst, r.c[dst][0], r.c_public, received, commitments, CONTEXT)
    assert sorted(opened) == r.nodes and bad == {}
    for src in r.nodes:
        plain = Fernet(_fernet_key(r.c[dst][0], r.c_public[src], CONTEXT, src, dst)).decrypt(received[src])
        size = int.from_bytes(plain[16:20], "little")
        assert opened[src] == (plain[20 : 20 + size], plain[20 + size :])
        seed_share, key_share = opened[src]
        assert commitments[src] == share_commitment(CONTEXT, src, dst, SEED, seed_share) + share_commitment(
            CONTEXT, src, dst, MASK_KEY, key_share
        )
    assert dealt[r.nodes[0]].secrets == secret_commitment(CONTEXT, r.nodes[0], SEED, r.seed[r.nodes[0]]) + (
        secret_commitment(CONTEXT, r.nodes[0], MASK_KEY, r.s[r.nodes[0]][0])
    )
    assert open_shares(dst, r.c[dst][0], r.c_public, {}, {}, CONTEXT) == ({}, {})


@pytest.mark.parametrize("threshold, ok", [(1, False), (2, True), (3, True), (4, False), (0, False)])
def test_make_shares_threshold_range(threshold: int, ok: bool) -> None:
    r = Sharing(threshold)
    if ok:
        dealt = r.dealt(r.nodes[1])
        assert len(dealt.bundles) == 3
        src = r.nodes[1]
        shares = [
            open_shares(d, r.c[d][0], r.c_public, {src: dealt.bundles[d]}, {src: dealt.commitments[d]}, CONTEXT)[0][
                src
            ][0]
            for d in r.nodes
        ]
        assert reconstruct(shares[:threshold], threshold) == r.seed[r.nodes[1]]
    else:
        _refused(lambda: r.shares_of(r.nodes[1]), f"threshold {threshold} is not in [2, 3]")


def test_make_shares_refuses_a_round_without_its_node() -> None:
    r = Sharing()
    _refused(
        lambda: make_shares(7, r.seed[5], r.s[5][0], r.c[5][0], r.c_public, 2, CONTEXT),
        "this node (7) is not among the round's participants",
    )


def test_open_shares_accuses_instead_of_refusing() -> None:
    """A bundle that does not decrypt, is addressed to another pair or does not match its dealer's
    commitment does not stop the node: it is returned as an accusation with its reason (and no
    key: the key would open the dealer's real bundle to a server that altered what it relayed)."""
    r = Sharing()
    src, dst, other = r.nodes
    dealt = r.dealt(src)
    good, commitment = dealt.bundles[dst], dealt.commitments[dst]
    key = _fernet_key(r.c[dst][0], r.c_public[src], CONTEXT, src, dst)  # what dst derives for src's bundle

    def forged(plaintext: bytes) -> dict[int, bytes]:
        return {src: Fernet(key).encrypt(plaintext)}

    with pytest.raises(SecureAggregationError, match="a share from node 9, which is not a participant"):
        open_shares(dst, r.c[dst][0], r.c_public, {9: good}, {9: commitment}, CONTEXT)
    cases = [
        ({src: b"garbage"}, f"the share bundle from node {src} does not decrypt for this round"),
        ({src: r.shares_of(src)[other]}, f"the share bundle from node {src} does not decrypt for this round"),
        (
            {src: r.shares_of(src, round_context("r", 0, 1, 2, 0, r.nodes))[dst]},
            f"the share bundle from node {src} does not decrypt for this round",
        ),
        (forged(b"\x00" * 19), "a share bundle is too short"),
        (forged(_bundle(other, dst, b"s", b"k")), f"the share bundle from node {src} is addressed {other}->{dst}"),
        (forged(_bundle(src, other, b"s", b"k")), f"the share bundle from node {src} is addressed {src}->{other}"),
        (
            forged(_bundle(src, dst, b"\x00" * 33, b"\x00" * 33)),
            f"the shares from node {src} do not match its commitment",
        ),
    ]
    for received, message in cases:
        opened, bad = open_shares(dst, r.c[dst][0], r.c_public, received, {src: commitment}, CONTEXT)
        assert opened == {} and bad == {src: message}
    assert open_shares(dst, r.c[dst][0], r.c_public, {src: good}, {src: b"x" * 64}, CONTEXT)[1][src] == (
        f"the shares from node {src} do not match its commitment"
    )
    layout = _bundle(src, dst, b"abc", b"defg")
    made = share_commitment(CONTEXT, src, dst, SEED, b"abc") + share_commitment(CONTEXT, src, dst, MASK_KEY, b"defg")
    assert open_shares(dst, r.c[dst][0], r.c_public, forged(layout), {src: made}, CONTEXT) == (
        {src: (b"abc", b"defg")},
        {},
    )
    empty = share_commitment(CONTEXT, src, dst, SEED, b"") + share_commitment(CONTEXT, src, dst, MASK_KEY, b"")
    shortest = open_shares(dst, r.c[dst][0], r.c_public, forged(_bundle(src, dst, b"", b"")), {src: empty}, CONTEXT)
    assert shortest == ({src: (b"", b"")}, {})  # exactly 20 bytes: a header and two empty shares


UNMASK_BAD = [
    ([1, 2, 3], [3, 4], "asked for both secrets of node(s) [3]: refused"),
    ([1, 2, 3, 4], [4, 2], "asked for both secrets of node(s) [2, 4]: refused"),
    ([1, 2, 3, 9], [9], "asked for both secrets of node(s) [9]: refused"),  # checked before "outside"
    ([1, 2, 3, 9], [], "asked about node(s) [9] outside the round"),
    ([1, 2, 3], [8, 7], "asked about node(s) [7, 8] outside the round"),
    ([1, 2], [3, 4, 5], "2 survivor(s), fewer than the threshold 3: refused"),
    ([], [1, 2, 3, 4, 5], "0 survivor(s), fewer than the threshold 3: refused"),
    (
        [1, 2, 3],
        [4],
        "the unmask request leaves out node(s) [5] of the participants this node masked over: "
        "another view of the round; refused",
    ),
    (
        [1, 2, 3],
        [],
        "the unmask request leaves out node(s) [4, 5] of the participants this node masked over: "
        "another view of the round; refused",
    ),
]


@pytest.mark.parametrize("survivors, dropped, message", UNMASK_BAD, ids=[m for *_, m in UNMASK_BAD])
def test_an_honest_participant_refuses_these_unmask_requests(survivors, dropped, message) -> None:
    _refused(lambda: check_unmask_request(survivors, dropped, [1, 2, 3, 4, 5], 3), message)


def test_unmask_requests_an_honest_participant_answers() -> None:
    everyone = [1, 2, 3, 4, 5]
    check_unmask_request([1, 2, 3], [4, 5], everyone, 3)  # exactly the threshold
    check_unmask_request(everyone, [], everyone, 3)
    check_unmask_request(iter([2, 4]), iter([1, 3, 5]), iter(everyone), 2)  # any iterables


def test_reconstruct_needs_t_shares_and_uses_the_first_t() -> None:
    secret = bytes(range(32))
    shares = create_shares(secret, 3, 5)
    assert reconstruct(shares[:3], 3) == secret and reconstruct(shares[2:], 3) == secret
    assert reconstruct(shares, 3) == secret
    assert reconstruct([*shares[:3], b"\x09\x00\x00\x00" + b"z" * 48], 3) == secret  # extras are ignored
    _refused(lambda: reconstruct(shares[:2], 3), "2 share(s), 3 needed")
    _refused(lambda: reconstruct([], 2), "0 share(s), 2 needed")
    _refused(lambda: reconstruct([shares[0], shares[0], shares[1]], 3), "shares do not combine: Duplicate share")
    _refused(lambda: reconstruct(create_shares(b"s" * 16, 2, 3)[:2], 2), "a rebuilt secret has 16 bytes, expected 32")
    _refused(lambda: reconstruct(create_shares(b"s" * 33, 2, 3)[1:], 2), "a rebuilt secret has 33 bytes, expected 32")


# ------------------------------------------------------------------------------ signed keys
def _ssh_private(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )


def _pem_private(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _ssh_public(key) -> str:
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def _der(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def test_load_signing_key_reads_openssh_and_pem_ec_keys(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    for name, data in (("ssh", _ssh_private(key)), ("pem", _pem_private(key))):
        path = tmp_path / name
        path.write_bytes(data)
        loaded = load_signing_key(str(path))
        assert isinstance(loaded, ec.EllipticCurvePrivateKey) and _der(loaded) == _der(key)
    for name, data in (
        ("ed-ssh", _ssh_private(ed25519.Ed25519PrivateKey.generate())),
        ("ed-pem", _pem_private(ed25519.Ed25519PrivateKey.generate())),
    ):
        path = tmp_path / name
        path.write_bytes(data)
        _refused(lambda path=path: load_signing_key(str(path)), f"{path} is not an elliptic-curve private key")


def test_load_trusted_keys(tmp_path: Path) -> None:
    first, second = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP256R1())
    listed = tmp_path / "trusted"
    listed.write_text(f"# the operator's SuperNodes\n{_ssh_public(first)}\n   \n\n  {_ssh_public(second)}  \n")
    assert load_trusted_keys(str(listed)) == [_der(first), _der(second)]
    empty = tmp_path / "empty"
    empty.write_text("# nobody yet\n\n  \n")
    _refused(lambda: load_trusted_keys(str(empty)), f"{empty} lists no public key")
    line = _ssh_public(ed25519.Ed25519PrivateKey.generate())
    foreign = tmp_path / "foreign"
    foreign.write_text(f"{_ssh_public(first)}\n{line}\n")
    _refused(lambda: load_trusted_keys(str(foreign)), f"{foreign}: not an elliptic-curve public key: {line[:40]}...")


def _payload(c_public: bytes, s_public: bytes, context: bytes) -> bytes:
    return b"fcl-flower/secagg-keys|" + hashlib.sha256(context).digest() + c_public + s_public


def test_sign_keys_signs_the_documented_payload() -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    signer, signature = sign_keys(key, b"c" * 32, b"s" * 32, CONTEXT)
    assert signer == _der(key)
    key.public_key().verify(signature, _payload(b"c" * 32, b"s" * 32, CONTEXT), ec.ECDSA(hashes.SHA256()))


def test_signed_keys_verification_table() -> None:
    node, stranger = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    c, s = b"c" * 32, b"s" * 32
    signature = node.sign(_payload(c, s, CONTEXT), ec.ECDSA(hashes.SHA256()))  # signed by hand
    trusted = [_der(stranger), _der(node)]
    verify_keys(trusted, _der(node), signature, c, s, CONTEXT)
    edwards = ed25519.Ed25519PrivateKey.generate()
    edwards_der = _der(edwards)
    forged = stranger.sign(_payload(c, s, CONTEXT), ec.ECDSA(hashes.SHA256()))
    not_listed = "the keys are signed by a key the operator did not list"
    no_verify = "the signature over the round's keys does not verify"
    cases = [
        ((trusted[:1], _der(node), signature, c, s, CONTEXT), not_listed),  # an unlisted node
        (([], _der(node), signature, c, s, CONTEXT), not_listed),
        ((trusted, _der(node), forged, c, s, CONTEXT), no_verify),  # the wrong signer's signature
        ((trusted, _der(stranger), signature, c, s, CONTEXT), no_verify),  # claims another listed signer
        ((trusted, _der(node), signature, s, c, CONTEXT), no_verify),  # swapped keys
        ((trusted, _der(node), signature, b"C" * 32, s, CONTEXT), no_verify),  # a substituted c key
        ((trusted, _der(node), signature, c, b"S" * 32, CONTEXT), no_verify),  # a substituted s key
        ((trusted, _der(node), signature, c, s, CONTEXT + b"4"), no_verify),  # another round
        ((trusted, _der(node), signature[:-1] + bytes([signature[-1] ^ 1]), c, s, CONTEXT), no_verify),
        (
            ([*trusted, edwards_der], edwards_der, edwards.sign(b"x"), c, s, CONTEXT),
            "the signer is not an elliptic-curve key",
        ),
    ]
    for args, message in cases:
        _refused(lambda args=args: verify_keys(*args), message)


# ------------------------------------------------------------------------------ min-class-count
def test_per_class_counts_by_hand() -> None:
    assert per_class_counts(torch.tensor([[2, 0], [2, 2]]), 4).tolist() == [1, 0, 3, 0]  # any shape
    assert per_class_counts(torch.tensor([0.0, 1.0, 1.0]), 3).tolist() == [1, 2, 0]  # float labels
    assert per_class_counts(torch.tensor([1, 1], dtype=torch.uint8), 2).tolist() == [0, 2]
    assert per_class_counts(torch.zeros(0, dtype=torch.long), 3).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "min_count, expected",
    [
        (1, [True] * 6),
        (2, [False, True, True, True, True, True]),
        (3, [False, False, False, True, True, True]),
        (4, [False] * 6),
    ],
)
def test_disclosable_by_hand(min_count: int, expected: list[bool]) -> None:
    for dtype in (torch.long, torch.int32, torch.uint8):
        labels = torch.tensor([0, 1, 1, 2, 2, 2], dtype=dtype)
        assert disclosable(labels, 4, min_count).tolist() == expected


def test_disclosable_edges() -> None:
    assert disclosable(torch.zeros(0, dtype=torch.long), 3, 2).tolist() == []
    assert disclosable(torch.tensor([1.0, 1.0, 0.0]), 2, 2).tolist() == [True, True, False]
    for bad in (0, -1):
        _refused(
            lambda bad=bad: disclosable(torch.tensor([0]), 1, bad), f"min_count must be >= 1, got {bad}", ValueError
        )


@pytest.mark.parametrize(
    "min_count, expected",
    [(1, [False] * 5), (2, [False, True, False, False, False]), (3, [False, True, True, False, False])],
)
def test_withheld_cells_by_hand(min_count: int, expected: list[bool]) -> None:
    counts = torch.tensor([[0, 1, 2, 3, 4]])
    assert withheld_cells(counts, min_count).tolist() == [expected]
    assert withheld_cells(counts.double(), min_count).tolist() == [expected]
