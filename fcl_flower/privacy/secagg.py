"""Secure summation with dropout recovery inside one attempt (Bonawitz et al., CCS 2017): the math.

Why: STSA's server needs only Σ_k G_k and Σ_k C_k, never one client's G_k or C_k, and a client's
class sum over a single sample *is* that sample's random feature Φ_i.

How, per statistics round (fcl_flower/protocol carries the messages, strategies/secure.py and
clients/secure.py run them):

1. **Keys.** Every participant i makes two fresh X25519 key pairs: ``c`` (to encrypt the shares
   it sends) and ``s`` (to agree pairwise mask keys). Optionally it signs both public keys with
   its long-term SuperNode key (:func:`sign_keys`), so the server cannot substitute them.
2. **Shares.** i draws a self-mask seed b_i (32 random bytes) and Shamir-shares both b_i and its
   ``s`` private key among the n participants with threshold t (Flower's ``create_shares``);
   share j travels to j encrypted under the c-key i agrees with j (Flower's Fernet ``encrypt``).
3. **Masked upload.** i encodes its statistics in fixed point in the ring Z_{2^64}, adds
   PRG(b_i) and, for every other participant j, +m_ij if i < j and -m_ij if i > j, where m_ij is
   the ChaCha20 keystream of a key both derive from X25519(s_i, s_j) through HKDF-SHA256.
4. **Unmasking.** For the participants whose uploads arrived and passed the checks (U3) the
   survivors reveal their shares of b_k; for the ones that dropped or were rejected they reveal
   their shares of the ``s`` private key; never both for one participant (:func:`check_unmask_request`).
   With ≥ t shares the server rebuilds those secrets, removes PRG(b_k) and the dropped ones'
   pairwise masks, and opens exactly Σ_{k ∈ U3} x_k.

Against a server that deviates from the protocol (Bonawitz et al.'s active setting, with the
node's long-term SuperNode key as the PKI: signed-keys mode):

* **One view per round.** Every mask is derived from :func:`view_context`, which binds the
  participant set the node masked over (U2), so masks computed over different views never
  cancel; the node signs that view (:func:`sign_view`) and the signature rides in its masked
  upload. The unmask request relays every survivor's signature; a node reveals nothing unless
  all of them sign its own view and survivors and dropped nodes partition it
  (:func:`check_unmask_request`). With a majority threshold and one answer per node, the server
  cannot obtain both secrets of any node.
* **Commitments, so a cheat is named.** The dealer of the shares commits to each share
  (:func:`share_commitment`) and to its secrets (:func:`secret_commitment`); a recipient checks
  its share on receipt and accuses the dealer if it does not decrypt or match (never with the
  bundle's key: a server that altered what it relayed would decrypt the dealer's real bundle with
  it); the server checks every revealed share against its commitment and every rebuilt secret
  against the dealer's, so a wrong share names its revealer and an inconsistent sharing its dealer.

Every key derivation binds :func:`round_context` (run id, task, stage, round, attempt and the
key round's nodes) and the array name, so no keystream is ever used twice; keys are fresh per
round and dropped after it. A rejected upload keeps its self-mask: the server can remove its
pairwise masks but never b_k, so it learns nothing about it; there is never a second attempt
over the same inputs. Threat model and what still travels in clear: docs/privacy.md.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt

KEY_BYTES = 32  # X25519 public and private keys, and the self-mask seed
_RING_MAX = 2**63  # |encoded sum| must stay below this to decode unambiguously


class SecureAggregationError(ValueError):
    """A secure-aggregation input cannot be encoded, masked, shared or unmasked safely."""


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


# ------------------------------------------------------------------------------ keys and context
def generate_keypair() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair as raw bytes (private, public)."""
    private = X25519PrivateKey.generate()
    return (
        private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()),
        private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
    )


def new_seed() -> bytes:
    """A fresh self-mask seed b_i (from the operating system's CSPRNG)."""
    return os.urandom(KEY_BYTES)


def round_context(
    run_id: str, task: int, stage: int, server_round: int, attempt: int, participants: Iterable[int]
) -> bytes:
    """What binds every key of a secure round: the run, task, stage, round, attempt and participants."""
    ids = ",".join(str(i) for i in sorted(participants))
    return (
        f"fcl-flower/secagg/v2|run={run_id}|task={task}|stage={stage}|round={server_round}"
        f"|attempt={attempt}|participants={ids}"
    ).encode()


def view_context(context: bytes, participants: Iterable[int], bound: bytes = b"") -> bytes:
    """The round's context with the participant set a node masks over (U2) bound in, and whatever
    else every participant must agree on (``bound``: the node -> client map and the backfill
    request): masks derived over two different views never cancel, and a signature over it fixes
    the view."""
    ids = ",".join(str(i) for i in sorted(participants))
    return context + b"|view=" + ids.encode() + b"|bound=" + hashlib.sha256(bound).hexdigest().encode()


def derive_key(secret: bytes, context: bytes, label: str) -> bytes:
    """A 32-byte key from ``secret`` for one use: HKDF-SHA256 with info = H(context) | label."""
    info = hashlib.sha256(context).digest() + b"|" + label.encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def agree(private: bytes, peer_public: bytes) -> bytes:
    """The X25519 shared secret of ``private`` and a peer's public key."""
    if len(peer_public) != KEY_BYTES or len(private) != KEY_BYTES:
        raise SecureAggregationError(f"X25519 keys have {KEY_BYTES} bytes (got {len(private)}, {len(peer_public)})")
    try:
        return X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as err:  # e.g. a low-order point
        raise SecureAggregationError(f"key agreement failed: {err}") from None


# ------------------------------------------------------------------------------ masks
def mask_stream(key: bytes, length: int) -> np.ndarray:
    """``length`` pseudo-random ring elements: the ChaCha20 keystream of ``key`` (used once)."""
    encryptor = Cipher(algorithms.ChaCha20(key, b"\x00" * 16), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * length)), dtype=np.uint64).copy()


def self_mask(seed: bytes, length: int, context: bytes, name: str) -> np.ndarray:
    """PRG(b_i) for one named array."""
    return mask_stream(derive_key(seed, context, f"self|{name}"), length)


def pair_mask(
    own_id: int, private: bytes, peer_id: int, peer_public: bytes, length: int, context: bytes, name: str
) -> np.ndarray:
    """+m_ij (own_id < peer_id) or -m_ij (own_id > peer_id) for one named array."""
    low, high = sorted((own_id, peer_id))
    stream = mask_stream(derive_key(agree(private, peer_public), context, f"pair|{low}|{high}|{name}"), length)
    return stream if own_id < peer_id else (np.zeros(length, dtype=np.uint64) - stream)


def pairwise_mask(
    own_id: int, private: bytes, peers: Mapping[int, bytes], length: int, context: bytes, name: str
) -> np.ndarray:
    """Σ_{j > i} m_ij - Σ_{j < i} m_ij over the peers (own id excluded): cancels in the sum."""
    total = np.zeros(length, dtype=np.uint64)
    for peer_id, public in sorted(peers.items()):
        if peer_id != own_id:
            total += pair_mask(own_id, private, peer_id, public, length, context, name)  # wraps mod 2^64
    return total


def mask_arrays(
    arrays: Mapping[str, np.ndarray],
    own_id: int,
    private: bytes,
    seed: bytes,
    peers: Mapping[int, bytes],
    context: bytes,
    fraction_bits: int,
    min_participants: int,
) -> dict[str, np.ndarray]:
    """Encode every array in fixed point and add PRG(b_i) and the pairwise masks (same shapes, uint64).

    ``peers``: every participant's ``s`` public key, this node's included.
    """
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
        ring = (
            ring
            + self_mask(seed, ring.size, context, name)
            + pairwise_mask(own_id, private, peers, ring.size, context, name)
        )
        masked[name] = ring.reshape(np.shape(values))
    return masked


# ------------------------------------------------------------------------------ Shamir shares
def threshold_for(participants: int, min_clients: int, signed: bool = False) -> int:
    """Shares needed to rebuild a secret, and at least ``min_clients``: a majority of the
    participants; in signed-keys mode (a malicious server in scope) more than two thirds, so that
    even with c < 2t - n clients colluding with the server, two requests that split the survivors
    differently cannot both collect t shares (each honest node answers once)."""
    if signed:
        return max(min_clients, (2 * participants) // 3 + 1)
    return max(min_clients, participants // 2 + 1)


def share_key(c_private: bytes, peer_c_public: bytes, context: bytes, src: int, dst: int) -> bytes:
    """The one-use Fernet key of the bundle ``src`` sends ``dst`` (one direction only). Never
    revealed: it opens the real bundle, whatever the server relayed."""
    key = derive_key(agree(c_private, peer_c_public), context, f"shares|{src}|{dst}")
    return base64.urlsafe_b64encode(key)


SEED, MASK_KEY = "b", "s"  # what a share or secret commitment is of: the self-mask seed, the mask key


def _digest(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.digest()


def share_commitment(context: bytes, src: int, dst: int, what: str, share: bytes) -> bytes:
    """SHA-256 commitment of the dealer ``src`` to one share it deals ``dst`` (a share is a uniform
    field element of over 256 bits, so the hash hides it)."""
    return _digest(b"fcl-flower/secagg-share", context, f"{src}|{dst}|{what}".encode(), share)


def secret_commitment(context: bytes, src: int, what: str, secret: bytes) -> bytes:
    """SHA-256 commitment of ``src`` to a secret it shares (32 uniform bytes: the hash hides it)."""
    return _digest(b"fcl-flower/secagg-secret", context, f"{src}|{what}".encode(), secret)


@dataclass(frozen=True)
class Dealt:
    """What a dealer sends in the shares step: the encrypted bundles and its commitments."""

    bundles: dict[int, bytes]  # recipient -> encrypted bundle
    commitments: dict[int, bytes]  # recipient -> commitment to its seed share ‖ to its key share (64 bytes)
    secrets: bytes  # commitment to b ‖ to s (64 bytes)


def make_shares(
    own_id: int,
    seed: bytes,
    s_private: bytes,
    c_private: bytes,
    c_publics: Mapping[int, bytes],
    threshold: int,
    context: bytes,
) -> Dealt:
    """Shamir shares of (b_i, s_i) for every participant, each encrypted for its recipient, with
    a commitment to every share and to both secrets."""
    nodes = sorted(c_publics)
    if own_id not in c_publics:
        raise SecureAggregationError(f"this node ({own_id}) is not among the round's participants")
    if not 2 <= threshold <= len(nodes):
        raise SecureAggregationError(f"threshold {threshold} is not in [2, {len(nodes)}]")
    seed_shares = create_shares(seed, threshold, len(nodes))
    key_shares = create_shares(s_private, threshold, len(nodes))
    bundles, commitments = {}, {}
    for dst, seed_share, key_share in zip(nodes, seed_shares, key_shares, strict=True):
        plaintext = _bundle(own_id, dst, seed_share, key_share)
        bundles[dst] = encrypt(share_key(c_private, c_publics[dst], context, own_id, dst), plaintext)
        commitments[dst] = share_commitment(context, own_id, dst, SEED, seed_share) + share_commitment(
            context, own_id, dst, MASK_KEY, key_share
        )
    secrets = secret_commitment(context, own_id, SEED, seed) + secret_commitment(context, own_id, MASK_KEY, s_private)
    return Dealt(bundles, commitments, secrets)


def open_bundle(
    key: bytes, ciphertext: bytes, src: int, dst: int, commitment: bytes, context: bytes
) -> tuple[bytes, bytes]:
    """(share of b_src, share of s_src) from the bundle ``src`` sent ``dst``, decrypted with its
    one-use ``key`` and checked against the dealer's ``commitment``; raises SecureAggregationError."""
    try:
        plaintext = decrypt(key, ciphertext)
    except Exception:  # InvalidToken: forged, corrupted or meant for another round
        raise SecureAggregationError(f"the share bundle from node {src} does not decrypt for this round") from None
    bundle_src, bundle_dst, seed_share, key_share = _unbundle(plaintext)
    if (bundle_src, bundle_dst) != (src, dst):
        raise SecureAggregationError(f"the share bundle from node {src} is addressed {bundle_src}->{bundle_dst}")
    expected = share_commitment(context, src, dst, SEED, seed_share) + share_commitment(
        context, src, dst, MASK_KEY, key_share
    )
    if not hmac.compare_digest(expected, commitment):
        raise SecureAggregationError(f"the shares from node {src} do not match its commitment")
    return seed_share, key_share


def open_shares(
    own_id: int,
    c_private: bytes,
    c_publics: Mapping[int, bytes],
    received: Mapping[int, bytes],
    commitments: Mapping[int, bytes],
    context: bytes,
) -> tuple[dict[int, tuple[bytes, bytes]], dict[int, str]]:
    """Decrypt and check the shares addressed to this node.

    Returns (src -> (share of b_src, share of s_src), src -> reason) for the bundles that open and
    match their dealer's commitment, and for those that do not: a bad bundle accuses its dealer
    instead of stopping the round."""
    good: dict[int, tuple[bytes, bytes]] = {}
    bad: dict[int, str] = {}
    for src, ciphertext in received.items():
        if src not in c_publics:
            raise SecureAggregationError(f"a share from node {src}, which is not a participant")
        key = share_key(c_private, c_publics[src], context, src, own_id)
        try:
            good[src] = open_bundle(key, ciphertext, src, own_id, commitments.get(src, b""), context)
        except SecureAggregationError as err:
            bad[src] = str(err)
    return good, bad


def _bundle(src: int, dst: int, seed_share: bytes, key_share: bytes) -> bytes:
    return b"".join(
        [
            src.to_bytes(8, "little"),
            dst.to_bytes(8, "little"),
            len(seed_share).to_bytes(4, "little"),
            seed_share,
            key_share,
        ]
    )


def _unbundle(plaintext: bytes) -> tuple[int, int, bytes, bytes]:
    if len(plaintext) < 20:
        raise SecureAggregationError("a share bundle is too short")
    size = int.from_bytes(plaintext[16:20], "little")
    return (
        int.from_bytes(plaintext[:8], "little"),
        int.from_bytes(plaintext[8:16], "little"),
        plaintext[20 : 20 + size],
        plaintext[20 + size :],
    )


def check_unmask_request(
    survivors: Iterable[int], dropped: Iterable[int], participants: Iterable[int], threshold: int
) -> None:
    """What an honest participant verifies before it reveals shares (raises SecureAggregationError).

    Never a b-share and an s-share of the same participant; survivors and dropped nodes partition
    the participants this node masked over (its view: any other set is another view of the
    round); at least ``threshold`` survivors (else the round cannot be opened and nothing is
    revealed). In signed-keys mode the caller also checks every survivor's signature over the view
    (:func:`verify_view`).
    """
    alive, gone, everyone = set(survivors), set(dropped), set(participants)
    if alive & gone:
        raise SecureAggregationError(f"asked for both secrets of node(s) {sorted(alive & gone)}: refused")
    if not (alive | gone) <= everyone:
        raise SecureAggregationError(f"asked about node(s) {sorted((alive | gone) - everyone)} outside the round")
    if alive | gone != everyone:
        raise SecureAggregationError(
            f"the unmask request leaves out node(s) {sorted(everyone - alive - gone)} of the participants this node "
            "masked over: another view of the round; refused"
        )
    if len(alive) < threshold:
        raise SecureAggregationError(f"{len(alive)} survivor(s), fewer than the threshold {threshold}: refused")


def reconstruct(shares: Sequence[bytes], threshold: int) -> bytes:
    """A secret from at least ``threshold`` Shamir shares (Flower's ``combine_shares``)."""
    if len(shares) < threshold:
        raise SecureAggregationError(f"{len(shares)} share(s), {threshold} needed")
    try:
        secret = combine_shares(list(shares)[:threshold])
    except ValueError as err:
        raise SecureAggregationError(f"shares do not combine: {err}") from None
    if len(secret) != KEY_BYTES:
        raise SecureAggregationError(f"a rebuilt secret has {len(secret)} bytes, expected {KEY_BYTES}")
    return secret


class SecretNotRebuilt(SecureAggregationError):
    """A secret that cannot be rebuilt, with who provably caused it."""

    def __init__(self, message: str, liars: Sequence[int], dealer_at_fault: bool) -> None:
        super().__init__(message)
        self.liars = tuple(liars)
        self.dealer_at_fault = dealer_at_fault


@dataclass(frozen=True)
class Rebuilt:
    """A secret rebuilt from revealed shares, and who revealed a share that is not the one dealt."""

    secret: bytes
    liars: tuple[int, ...]


def rebuild_secret(
    dealer: int,
    what: str,
    revealed: Mapping[int, bytes],
    commitments: Mapping[int, bytes],
    secrets: bytes,
    threshold: int,
    context: bytes,
) -> Rebuilt:
    """``dealer``'s secret (``what``: :data:`SEED` or :data:`MASK_KEY`) from the shares revealed to
    the server (revealer -> share), each checked against the commitment the dealer made to it
    (``commitments``: revealer -> the 64-byte commitment of the bundle it was dealt; ``secrets``:
    the dealer's 64-byte secret commitment).

    A share that does not match is its revealer's doing (it checked the dealer's commitment on
    receipt, or accused the dealer then) and is left out; a secret rebuilt from checked shares
    that does not match the dealer's commitment is the dealer's (shares not on one polynomial).
    Raises SecureAggregationError naming who stopped the opening."""
    half = 0 if what == SEED else 32
    good, liars = [], []
    for revealer, share in sorted(revealed.items()):
        expected = commitments.get(revealer, b"")[half : half + 32]
        if hmac.compare_digest(share_commitment(context, dealer, revealer, what, share), expected):
            good.append(share)
        else:
            liars.append(revealer)
    if len(good) < threshold:
        named = f"; node(s) {liars} revealed shares that are not the ones dealt" if liars else ""
        raise SecretNotRebuilt(
            f"node {dealer}'s {'seed' if what == SEED else 'mask key'}: {len(good)} checked share(s), "
            f"{threshold} needed{named}",
            liars,
            dealer_at_fault=False,
        )
    try:
        secret = reconstruct(good, threshold)
    except SecureAggregationError:
        secret = b""
    if not hmac.compare_digest(secret_commitment(context, dealer, what, secret), secrets[half : half + 32]):
        raise SecretNotRebuilt(
            f"node {dealer} dealt shares that do not rebuild the secret it committed to (not one polynomial)",
            liars,
            dealer_at_fault=True,
        )
    return Rebuilt(secret, tuple(liars))


# ------------------------------------------------------------------------------ opening the sum
def add_ring(sums: dict[str, np.ndarray], name: str, values: object) -> None:
    """``sums[name] += values`` in the ring Z/2⁶⁴ (uint64 wraps around, as the masks need); the
    first values of a name are copied, never aliased."""
    ring = np.asarray(values, dtype=np.uint64).reshape(-1)
    if name in sums:
        sums[name] += ring
    else:
        sums[name] = ring.copy()


def unmask_sum(
    uploads: Iterable[np.ndarray],
    name: str,
    survivor_seeds: Mapping[int, bytes],
    dropped_keys: Mapping[int, bytes],
    s_publics: Mapping[int, bytes],
    context: bytes,
    fraction_bits: int,
) -> np.ndarray:
    """Σ_{k ∈ U3} x_k in float64, from the masked uploads of the survivors U3 (one named array).

    ``survivor_seeds``: the rebuilt b_k of every survivor; ``dropped_keys``: the rebuilt ``s``
    private key of every participant that dropped or was rejected; ``s_publics``: every
    participant's ``s`` public key. A wrong set of uploads or secrets gives noise, not an error.
    """
    total: np.ndarray | None = None
    for upload in uploads:
        ring = np.asarray(upload, dtype=np.uint64).reshape(-1)
        total = ring.copy() if total is None else total + ring
    if total is None:
        raise SecureAggregationError("no uploads to sum")
    length = total.size
    for seed in survivor_seeds.values():
        total -= self_mask(seed, length, context, name)
    for gone, private in dropped_keys.items():  # a survivor k added ±m_kj for every dropped j
        for k in survivor_seeds:
            total += pair_mask(gone, private, k, s_publics[k], length, context, name)
    return decode_fixed_point(total, fraction_bits)


# ------------------------------------------------------------------------------ signed keys
def load_signing_key(path: str) -> ec.EllipticCurvePrivateKey:
    """A SuperNode's long-term private key (OpenSSH or PEM, as deploy/make_keys.sh writes it)."""
    data = Path(path).read_bytes()
    try:
        key = serialization.load_ssh_private_key(data, password=None)
    except ValueError:
        key = serialization.load_pem_private_key(data, password=None)  # type: ignore[assignment]  # PEM fallback
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SecureAggregationError(f"{path} is not an elliptic-curve private key")
    return key


def load_trusted_keys(path: str) -> list[bytes]:
    """The operator's list of SuperNode public keys (one OpenSSH public key per line), as DER bytes."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            key = serialization.load_ssh_public_key(line.strip().encode())
            if not isinstance(key, ec.EllipticCurvePublicKey):
                raise SecureAggregationError(f"{path}: not an elliptic-curve public key: {line[:40]}...")
            out.append(key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo))
    if not out:
        raise SecureAggregationError(f"{path} lists no public key")
    return out


def _view_payload(view: bytes) -> bytes:
    return b"fcl-flower/secagg-view|" + hashlib.sha256(view).digest()


def sign_view(key: ec.EllipticCurvePrivateKey, view: bytes) -> bytes:
    """ECDSA-SHA256 signature of the node's long-term key over its view (:func:`view_context`)."""
    return key.sign(_view_payload(view), ec.ECDSA(hashes.SHA256()))


def verify_view(signer: bytes, signature: bytes, view: bytes) -> None:
    """Raise SecureAggregationError unless ``signer`` (DER) signed exactly this view."""
    try:
        public = serialization.load_der_public_key(signer)
    except ValueError:
        raise SecureAggregationError("the signer of a view is not a public key") from None
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise SecureAggregationError("the signer of a view is not an elliptic-curve key")
    try:
        public.verify(signature, _view_payload(view), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise SecureAggregationError("its signature is not over this node's view of the round") from None


def _signed_payload(c_public: bytes, s_public: bytes, context: bytes) -> bytes:
    return b"fcl-flower/secagg-keys|" + hashlib.sha256(context).digest() + c_public + s_public


def sign_keys(key: ec.EllipticCurvePrivateKey, c_public: bytes, s_public: bytes, context: bytes) -> tuple[bytes, bytes]:
    """(signer's DER public key, ECDSA-SHA256 signature) over this round's two public keys."""
    signature = key.sign(_signed_payload(c_public, s_public, context), ec.ECDSA(hashes.SHA256()))
    return key.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo), signature


def verify_keys(
    trusted: Sequence[bytes], signer: bytes, signature: bytes, c_public: bytes, s_public: bytes, context: bytes
) -> None:
    """Raise SecureAggregationError unless ``signer`` is trusted and signed these keys for this round."""
    if signer not in trusted:
        raise SecureAggregationError("the keys are signed by a key the operator did not list")
    public = serialization.load_der_public_key(signer)
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise SecureAggregationError("the signer is not an elliptic-curve key")
    try:
        public.verify(signature, _signed_payload(c_public, s_public, context), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise SecureAggregationError("the signature over the round's keys does not verify") from None
