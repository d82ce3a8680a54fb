"""Pairwise-masked secure summation of client statistics (Bonawitz et al., CCS 2017, §4).

Why: STSA's server needs only Σ_k G_k and Σ_k C_k, never one client's G_k or C_k, and a
client's class sum over a single sample *is* that sample's random feature Φ_i. With masking,
every upload the server receives is uniformly distributed in Z_{2^64}; only the sum over every
participant of a round is readable.

How: each participant encodes its float64 statistics in fixed point, x ↦ round(x · 2^f) in the
ring Z_{2^64} (two's complement), and adds, for every other participant j, the stream
+m_ij if i < j and -m_ij if i > j. m_ij is a ChaCha20 keystream keyed by HKDF-SHA256 of the
X25519 shared secret of i and j, bound to the round's ``context`` and the array name, so the
masks cancel in the sum and are fresh in every round. The sum is exact in the ring; the only
error is the fixed-point rounding, at most ``participants · 2^-(f+1)`` per entry.

Threat model: an honest-but-curious server that relays the public keys faithfully (it could
substitute keys, as in any SecAgg without a PKI). There is no Shamir-based dropout recovery:
a statistics round is one cheap pass, so when a participant drops, the round is simply run
again with the survivors and fresh masks (strategies/secure.py); nothing of the failed attempt
is ever unmasked. A participant refuses rounds with fewer than a minimum number of peers,
because the sum of one client is that client's upload.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

KEY_BYTES = 32  # X25519 public and private keys
_RING_MAX = 2**63  # |encoded sum| must stay below this to decode unambiguously


class SecureAggregationError(ValueError):
    """A secure-aggregation input cannot be encoded, masked or unmasked safely."""


# ------------------------------------------------------------------------------ fixed point
def encoding_bound(fraction_bits: int, participants: int) -> float:
    """Largest |x| one participant may encode so that the sum of ``participants`` cannot wrap."""
    return _RING_MAX / float(2**fraction_bits) / max(participants, 1)


def encode_fixed_point(values: np.ndarray, fraction_bits: int, participants: int) -> np.ndarray:
    """float64 → uint64 ring elements round(x · 2^f) mod 2^64; refuses values that could wrap."""
    x = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise SecureAggregationError("cannot encode non-finite statistics")
    bound = encoding_bound(fraction_bits, participants)
    peak = float(np.abs(x).max()) if x.size else 0.0
    if peak >= bound:
        raise SecureAggregationError(
            f"statistic magnitude {peak:.3g} exceeds {bound:.3g}, the limit for {participants} participants "
            f"at secagg-fraction-bits={fraction_bits}; lower secagg-fraction-bits"
        )
    return np.rint(x * float(2**fraction_bits)).astype(np.int64).view(np.uint64)


def decode_fixed_point(ring: np.ndarray, fraction_bits: int) -> np.ndarray:
    """uint64 ring elements (two's complement) → float64."""
    return np.asarray(ring, dtype=np.uint64).view(np.int64).astype(np.float64) / float(2**fraction_bits)


# ------------------------------------------------------------------------------ keys + masks
def generate_keypair() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair as raw bytes (private, public)."""
    private = X25519PrivateKey.generate()
    return (
        private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()),
        private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
    )


def _pair_key(private: bytes, peer_public: bytes, context: bytes, name: str) -> bytes:
    if len(peer_public) != KEY_BYTES:
        raise SecureAggregationError(f"a peer public key has {len(peer_public)} bytes, expected {KEY_BYTES}")
    secret = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(peer_public))
    info = hashlib.sha256(context + b"\x00" + name.encode()).digest()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def mask_stream(key: bytes, length: int) -> np.ndarray:
    """``length`` pseudo-random ring elements: the ChaCha20 keystream of ``key``."""
    encryptor = Cipher(algorithms.ChaCha20(key, b"\x00" * 16), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * length)), dtype=np.uint64).copy()


def pairwise_mask(
    own_id: int, private: bytes, peers: Mapping[int, bytes], length: int, context: bytes, name: str
) -> np.ndarray:
    """Σ_{j > i} m_ij - Σ_{j < i} m_ij over the peers (own id excluded): cancels in the sum."""
    total = np.zeros(length, dtype=np.uint64)
    for peer_id, public in sorted(peers.items()):
        if peer_id == own_id:
            continue
        stream = mask_stream(_pair_key(private, public, context, name), length)
        total = total + stream if own_id < peer_id else total - stream  # wraps mod 2^64
    return total


def mask_arrays(
    arrays: Mapping[str, np.ndarray],
    own_id: int,
    private: bytes,
    peers: Mapping[int, bytes],
    context: bytes,
    fraction_bits: int,
    min_participants: int,
) -> dict[str, np.ndarray]:
    """Encode and mask every array (same shapes, dtype uint64) for one secure round."""
    participants = len(set(peers) | {own_id})
    if participants < min_participants:
        raise SecureAggregationError(
            f"secure round with {participants} participant(s); at least {min_participants} are required "
            "(a sum over too few clients reveals them)"
        )
    if own_id not in peers:
        raise SecureAggregationError(f"this node ({own_id}) is not among the round's participants")
    masked = {}
    for name, values in arrays.items():
        ring = encode_fixed_point(values, fraction_bits, participants).reshape(-1)
        masked[name] = (ring + pairwise_mask(own_id, private, peers, ring.size, context, name)).reshape(
            np.shape(values)
        )
    return masked


def unmask_sum(uploads: Iterable[np.ndarray], fraction_bits: int) -> np.ndarray:
    """Sum the masked uploads of *every* participant of a round in the ring, and decode."""
    total = None
    for upload in uploads:
        ring = np.asarray(upload, dtype=np.uint64)
        total = ring.copy() if total is None else total + ring
    if total is None:
        raise SecureAggregationError("no uploads to sum")
    return decode_fixed_point(total, fraction_bits)


def round_context(run_seed: int, server_round: int, attempt: int, participants: Iterable[int]) -> bytes:
    """What binds the masks to one attempt of one round with one participant set."""
    ids = ",".join(str(i) for i in sorted(participants))
    return f"fcl-flower/secagg/v1|seed={run_seed}|round={server_round}|attempt={attempt}|{ids}".encode()
