"""The messages of a secure statistics round (fcl_flower/privacy/secagg.py has the math).

======================  ===============  =====================================================
server -> client        Flower type      client -> server
======================  ===============  =====================================================
:class:`KeysIns`        ``query.keys``   :class:`KeysRes`: two fresh public keys (c, s), signed
                                         with the node's long-term key in signed-keys mode
:class:`SharesIns`      ``query.shares`` :class:`SharesRes`: Shamir shares of (b_i, s_i), one
                                         encrypted bundle per participant
:class:`~fcl_flower.protocol.StatsIns`   ``query.stats`` with :class:`SecAggRound`: the masked upload
:class:`~fcl_flower.protocol.TrainIns`   ``train`` with :class:`SecAggRound` (stage-1 FedAvg): the
                                         masked (n_k · w_k, n_k); beside either, where
                                         :attr:`SecAggRound.prepare` names the next secure round,
                                         its fresh public keys (:attr:`MaskedReport.next_keys`)
:class:`UnmaskIns`      ``query.unmask`` :class:`UnmaskRes`: shares of the survivors' b and of the
                                         dropped participants' s, never both for one node; and,
                                         where :attr:`UnmaskIns.prepare` names the next secure
                                         round, that round's fresh public keys (as a
                                         :class:`KeysRes` would carry them), or where
                                         :attr:`UnmaskIns.ahead` carries its shares step, the
                                         node's share bundles for it (:attr:`UnmaskRes.next_shares`)
======================  ===============  =====================================================

Keys ahead: the unmask instruction of a secure round may name the key round of the next one
(:attr:`UnmaskIns.prepare`, a full header: run, task, stage, round, attempt 0); the node answers as
it would a ``query.keys`` for that header, inside its unmask reply (:attr:`UnmaskRes.next_keys`),
and the next round starts at its shares step (strategies/secure.py).

Shares ahead, one step further: the masked upload's instruction names the next round's key step
(:attr:`SecAggRound.prepare`) and the node's masked reply carries that round's fresh public keys
(:attr:`MaskedReport.next_keys`); the unmask instruction then carries, besides ``prepare``, what
that round's ``query.shares`` would (:attr:`UnmaskIns.ahead`: U1's keys, the clients, the
threshold) and the unmask reply the node's share bundles for it (:attr:`UnmaskRes.next_shares`),
exactly as its :class:`SharesRes` would be; the next round starts at its masked upload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flwr.app import ConfigRecord, RecordDict

from fcl_flower.methods import Kind
from fcl_flower.protocol.base import (
    ROUND,
    SECAGG,
    Header,
    Instruction,
    Reply,
    ReplyBase,
    entry,
    node_map,
    node_map_entries,
    only,
    read_int,
    read_list,
)
from fcl_flower.protocol.errors import ProtocolError

#: the entries of an unmask instruction's ``round`` record that name the next round's key step (its header's)
PREPARE = "prepare-"
PREPARE_ENTRIES = tuple(PREPARE + name for name in ("run-id", "phase", "task", "stage", "round", "attempt"))
#: the entries of an unmask reply's ``secagg`` record that carry the next round's public keys
NEXT_KEYS = ("next-c", "next-s", "next-signer", "next-signature")
#: the entries of a masked upload's ``round`` record that name the next round's key step (shares ahead)
SECAGG_PREPARE = "secagg-prepare-"
#: the prefix of an unmask instruction's entries that carry the next round's shares step (shares ahead)
AHEAD = "next-secagg-"
AHEAD_ENTRIES = tuple(
    AHEAD + name for name in ("nodes", "c", "s", "signer", "signature", "client-nodes", "clients", "threshold")
)
#: the entries of an unmask reply's ``secagg`` record that carry the next round's share bundles
NEXT_SHARES = ("next-nodes", "next-shares", "next-commit-nodes", "next-commits", "next-secrets")


@dataclass(frozen=True)
class PublicKeys:
    """One participant's public keys of a secure round, and in signed-keys mode who signed them."""

    c: bytes  # encrypts the shares sent to this participant
    s: bytes  # agrees the pairwise masks
    signer: bytes = b""  # DER public key of the node's long-term key (signed-keys mode)
    signature: bytes = b""


def _keys_entries(keys: Mapping[int, PublicKeys], prefix: str) -> dict[str, Any]:
    nodes = sorted(keys)
    return {
        f"{prefix}nodes": nodes,
        f"{prefix}c": [keys[n].c for n in nodes],
        f"{prefix}s": [keys[n].s for n in nodes],
        f"{prefix}signer": [keys[n].signer for n in nodes],
        f"{prefix}signature": [keys[n].signature for n in nodes],
    }


def _read_keys(record: Mapping[str, Any], prefix: str, where: str) -> dict[int, PublicKeys]:
    nodes = read_list(record, f"{prefix}nodes", where, int)
    columns = [
        read_list(record, f"{prefix}{name}", where, bytes, len(nodes)) for name in ("c", "s", "signer", "signature")
    ]
    if len(set(nodes)) != len(nodes):
        raise ProtocolError(f"'{where}' lists a node twice")
    return {node: PublicKeys(*(column[i] for column in columns)) for i, node in enumerate(nodes)}


@dataclass(frozen=True)
class SecAggRound:
    """What a masked upload needs (:attr:`fcl_flower.protocol.StatsIns.secagg`, and
    :attr:`fcl_flower.protocol.TrainIns.secagg` in a stage-1 FedAvg round)."""

    round_nodes: tuple[int, ...]  # U1: the nodes of the key round, bound into every key derivation
    participants: Mapping[int, PublicKeys]  # U2: the nodes that shared their secrets; masks cancel over them
    clients: Mapping[int, int]  # node -> client, as the server mapped them
    threshold: int  # shares needed to rebuild a secret
    shares: Mapping[int, bytes] = field(default_factory=dict)  # source node -> its bundle for this node
    commitments: Mapping[int, bytes] = field(default_factory=dict)  # source node -> its commitment to that bundle
    # shares ahead: the next secure round's key step (its header); the node sends that round's fresh
    # public keys with this masked upload (MaskedReport.next_keys). None: none asked
    prepare: Header | None = None

    def entries(self) -> dict[str, Any]:
        prepare = {} if self.prepare is None else _prefixed(self.prepare, SECAGG_PREPARE)
        return {
            **prepare,
            "secagg-round-nodes": list(self.round_nodes),
            **_keys_entries(self.participants, "secagg-"),
            **node_map_entries(self.clients, "secagg-client-nodes", "secagg-clients"),
            "secagg-threshold": self.threshold,
            **node_map_entries(self.shares, "secagg-share-src", "secagg-share"),
            **node_map_entries(self.commitments, "secagg-commit-src", "secagg-commit"),
        }

    @classmethod
    def from_entries(cls, record: Mapping[str, Any], header: Header) -> SecAggRound:
        """``header``: the instruction's, against which a named next key step is checked."""
        prepare = _read_prepare(record, header, SECAGG_PREPARE, "masked upload instruction")
        round_nodes = tuple(read_list(record, "secagg-round-nodes", ROUND, int))
        participants = _read_keys(record, "secagg-", ROUND)
        clients = node_map(record, "secagg-client-nodes", "secagg-clients", ROUND, int)
        if not set(participants) <= set(round_nodes) or set(clients) != set(participants):
            raise ProtocolError("secure round: participants, key-round nodes and clients do not agree")
        return cls(
            round_nodes,
            participants,
            clients,
            read_int(entry(record, "secagg-threshold", ROUND), "secagg-threshold", minimum=2),
            node_map(record, "secagg-share-src", "secagg-share", ROUND, bytes),
            node_map(record, "secagg-commit-src", "secagg-commit", ROUND, bytes),
            prepare,
        )

    def binding(self, backfill: Mapping[int, tuple[int, ...]]) -> bytes:
        """What every participant must see alike besides the participants (bound into the view,
        fcl_flower/privacy/secagg.py ``view_context``): the node -> client map and the backfill
        request, so that no participant can be shown its own version of who owes what."""
        clients = ";".join(f"{n}:{self.clients[n]}" for n in sorted(self.clients))
        owed = ";".join(f"{c}:{','.join(map(str, sorted(backfill[c])))}" for c in sorted(backfill))
        return f"clients={clients}|backfill={owed}".encode()

    def backfill_tasks(self, backfill: Mapping[int, tuple[int, ...]], min_clients: int) -> tuple[int, ...]:
        """Owed tasks whose statistics ride in this upload: those owed by ``min_clients`` or more of
        the participants, so the opened sum of a past task's class sums is never one client's."""
        owing: dict[int, int] = {}
        for client in set(self.clients.values()):
            for task in backfill.get(client, ()):
                owing[task] = owing.get(task, 0) + 1
        return tuple(sorted(task for task, count in owing.items() if count >= min_clients))


@dataclass(frozen=True)
class KeysIns(Instruction):
    """The first step of a secure statistics round: make two fresh key pairs, send the public halves."""

    kind: ClassVar[Kind] = Kind.KEYS


@dataclass(frozen=True)
class SharesIns(Instruction):
    """Every key-round participant's public keys: share your secrets among them."""

    kind: ClassVar[Kind] = Kind.SHARES
    keys: Mapping[int, PublicKeys] = field(default_factory=dict)  # U1
    clients: Mapping[int, int] = field(default_factory=dict)  # node -> client
    threshold: int = 2

    def _fill(self, content: RecordDict) -> None:
        content[ROUND] = ConfigRecord(
            {
                **_keys_entries(self.keys, "secagg-"),
                **node_map_entries(self.clients, "secagg-client-nodes", "secagg-clients"),
                "secagg-threshold": self.threshold,
            }
        )


@dataclass(frozen=True)
class UnmaskIns(Instruction):
    """The last step: reveal your shares of the survivors' b and of the dropped nodes' s.

    ``signatures``: every survivor's signature over the view it masked over, relayed from its
    masked upload (signed-keys mode): the consistency check, with no extra exchange.
    ``prepare``: the header of the next secure round's key step (keys ahead, see the module doc):
    make that round's fresh key pairs now and send the public halves with the reply; None: none.
    ``ahead`` (shares ahead; only with ``prepare``): that round's shares step, as a
    :class:`SharesIns` for it would carry it: the node made its keys with its masked upload and
    deals its shares over these keys in the reply (:attr:`UnmaskRes.next_shares`) instead."""

    kind: ClassVar[Kind] = Kind.UNMASK
    survivors: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    signatures: Mapping[int, bytes] = field(default_factory=dict)  # survivor -> its signature over its view
    prepare: Header | None = None
    ahead: SharesAhead | None = None

    def _fill(self, content: RecordDict) -> None:
        if self.ahead is not None and self.prepare is None:
            raise ProtocolError("unmask instruction: the next round's shares step without its key step")
        prepare = {} if self.prepare is None else _prefixed(self.prepare, PREPARE)
        ahead = {}
        if self.ahead is not None:
            ahead = {
                **_keys_entries(self.ahead.keys, AHEAD),
                **node_map_entries(self.ahead.clients, AHEAD + "client-nodes", AHEAD + "clients"),
                AHEAD + "threshold": self.ahead.threshold,
            }
        content[ROUND] = ConfigRecord(
            {
                "survivors": list(self.survivors),
                "dropped": list(self.dropped),
                **node_map_entries(self.signatures, "signature-nodes", "signatures"),
                **prepare,
                **ahead,
            }
        )


@dataclass(frozen=True)
class SharesAhead:
    """The next secure round's shares step, carried by an unmask instruction (shares ahead)."""

    keys: Mapping[int, PublicKeys]  # U1 of the next round: the nodes whose keys rode with their masked uploads
    clients: Mapping[int, int]  # node -> client
    threshold: int


@dataclass(frozen=True)
class DealtShares:
    """A node's answer to a shares step (:class:`SharesRes`'s fields), here riding with its unmask reply."""

    shares: Mapping[int, bytes]  # destination node -> encrypted bundle
    commitments: Mapping[int, bytes]  # destination node -> commitment to its shares
    secrets: bytes  # commitment to the dealer's seed and mask key


def _prefixed(header: Header, prefix: str) -> dict[str, Any]:
    return {prefix + k: v for k, v in header.to_record().items()}


@dataclass(frozen=True)
class MaskedReport:
    """What rides beside a masked upload (record ``secagg`` of its reply): the node's signature over
    its view (signed-keys mode; empty otherwise) and its accusations: the dealers whose bundle to
    it did not decrypt or match their commitment, each with the reason. No key travels as
    evidence: it would open the dealer's real bundle to a server that altered what it relayed."""

    view_signature: bytes = b""
    accused: Mapping[int, str] = field(default_factory=dict)  # dealer -> reason
    # a secure forget round (docs/unlearning.md): this site masks a removal (the negation of what it
    # takes out), not zeros; sent only where true, so every other masked upload is as before
    leaving: bool = False
    # shares ahead: the next secure round's public keys, where the masked upload's instruction asked them
    next_keys: PublicKeys | None = None

    def entries(self) -> dict[str, Any]:
        nodes = sorted(self.accused)
        out: dict[str, Any] = {
            "view-signature": self.view_signature,
            "accused": nodes,
            "accused-reasons": [self.accused[n] for n in nodes],
        }
        if self.leaving:
            out["leaving"] = True
        if self.next_keys is not None:
            out.update(_next_keys_entries(self.next_keys))
        return out

    @classmethod
    def from_entries(cls, record: Mapping[str, Any]) -> MaskedReport:
        only(record, {"view-signature", "accused", "accused-reasons", "leaving", *NEXT_KEYS}, "secagg entries")
        signature = entry(record, "view-signature", SECAGG)
        if not isinstance(signature, bytes):
            raise ProtocolError("masked upload: the view signature must be bytes")
        nodes = read_list(record, "accused", SECAGG, int)
        if len(set(nodes)) != len(nodes):
            raise ProtocolError(f"'{SECAGG}' entry 'accused' lists a node twice")
        reasons = read_list(record, "accused-reasons", SECAGG, str, len(nodes))
        leaving = record.get("leaving", False)
        if leaving is not True and leaving is not False:
            raise ProtocolError(f"'{SECAGG}' entry 'leaving' must be a boolean")
        accused = {n: _printable(r) for n, r in zip(nodes, reasons, strict=True)}
        return cls(signature, accused, leaving, _read_next_keys(record, "masked upload"))


def _next_keys_entries(keys: PublicKeys) -> dict[str, bytes]:
    return dict(zip(NEXT_KEYS, (keys.c, keys.s, keys.signer, keys.signature), strict=True))


def _read_next_keys(record: Mapping[str, Any], where: str) -> PublicKeys | None:
    """The next round's public keys a reply carries (None: none), whole or not at all."""
    present = [name for name in NEXT_KEYS if name in record]
    if present and len(present) != len(NEXT_KEYS):
        raise ProtocolError(f"{where}: the next round's keys only in part")
    values = [entry(record, name, SECAGG) for name in present]
    if not all(isinstance(v, bytes) for v in values):
        raise ProtocolError(f"{where}: the next round's keys and signature must be bytes")
    return PublicKeys(*values) if values else None


def _printable(text: str, limit: int = 300) -> str:
    """A client's free text as it may enter logs and results: printable, one line, at most ``limit``."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


@dataclass(frozen=True)
class KeysRes(Reply):
    kind: ClassVar[Kind] = Kind.KEYS
    keys: PublicKeys = field(default_factory=lambda: PublicKeys(b"", b""))

    def _fill(self, content: RecordDict) -> None:
        k = self.keys
        content[SECAGG] = ConfigRecord({"c": k.c, "s": k.s, "signer": k.signer, "signature": k.signature})


@dataclass(frozen=True)
class SharesRes(Reply):
    kind: ClassVar[Kind] = Kind.SHARES
    shares: Mapping[int, bytes] = field(default_factory=dict)  # destination node -> encrypted bundle
    commitments: Mapping[int, bytes] = field(default_factory=dict)  # destination node -> commitment to its shares
    secrets: bytes = b""  # commitment to the dealer's seed and mask key

    def _fill(self, content: RecordDict) -> None:
        content[SECAGG] = ConfigRecord(
            {
                **node_map_entries(self.shares, "nodes", "shares"),
                **node_map_entries(self.commitments, "commit-nodes", "commits"),
                "secrets": self.secrets,
            }
        )


@dataclass(frozen=True)
class UnmaskRes(Reply):
    kind: ClassVar[Kind] = Kind.UNMASK
    seed_shares: Mapping[int, bytes] = field(default_factory=dict)  # survivor node -> share of its b
    key_shares: Mapping[int, bytes] = field(default_factory=dict)  # dropped node -> share of its s
    next_keys: PublicKeys | None = None  # the next secure round's public keys, where they were asked for
    next_shares: DealtShares | None = None  # the next secure round's share bundles (shares ahead)

    def _fill(self, content: RecordDict) -> None:
        k, d = self.next_keys, self.next_shares
        dealt = {}
        if d is not None:
            dealt = {
                **node_map_entries(d.shares, "next-nodes", "next-shares"),
                **node_map_entries(d.commitments, "next-commit-nodes", "next-commits"),
                "next-secrets": d.secrets,
            }
        content[SECAGG] = ConfigRecord(
            {
                **node_map_entries(self.seed_shares, "seed-nodes", "seed-shares"),
                **node_map_entries(self.key_shares, "key-nodes", "key-shares"),
                **({} if k is None else _next_keys_entries(k)),
                **dealt,
            }
        )


def parse_secure_instruction(kind: Kind, base: Instruction, round_: Mapping[str, Any] | None) -> Instruction:
    """The typed secure-round instruction (``base`` carries header and config)."""
    if kind is Kind.KEYS:
        return KeysIns(base.header, base.config)
    if round_ is None:
        raise ProtocolError(f"message has no '{ROUND}' record")
    if kind is Kind.SHARES:
        keys = _read_keys(round_, "secagg-", ROUND)
        clients = node_map(round_, "secagg-client-nodes", "secagg-clients", ROUND, int)
        threshold = read_int(entry(round_, "secagg-threshold", ROUND), "secagg-threshold", minimum=2)
        return SharesIns(base.header, base.config, keys=keys, clients=clients, threshold=threshold)
    survivors = tuple(read_list(round_, "survivors", ROUND, int))
    dropped = tuple(read_list(round_, "dropped", ROUND, int))
    signatures = node_map(round_, "signature-nodes", "signatures", ROUND, bytes)
    only(
        round_,
        {"survivors", "dropped", "signature-nodes", "signatures", *PREPARE_ENTRIES, *AHEAD_ENTRIES},
        "round entries",
    )
    prepare = _read_prepare(round_, base.header, PREPARE, "unmask instruction")
    ahead = None
    if any(name in round_ for name in AHEAD_ENTRIES):
        if prepare is None:
            raise ProtocolError("unmask instruction: the next round's shares step without its key step")
        ahead = SharesAhead(
            _read_keys(round_, AHEAD, ROUND),
            node_map(round_, AHEAD + "client-nodes", AHEAD + "clients", ROUND, int),
            read_int(entry(round_, AHEAD + "threshold", ROUND), AHEAD + "threshold", minimum=2),
        )
    return UnmaskIns(
        base.header,
        base.config,
        survivors=survivors,
        dropped=dropped,
        signatures=signatures,
        prepare=prepare,
        ahead=ahead,
    )


def _read_prepare(record: Mapping[str, Any], header: Header, prefix: str, where: str) -> Header | None:
    """The next secure round's key step an instruction names (None: none): of this run,
    a later round, a task not before this one, a first attempt; else a one-line ProtocolError."""
    names = tuple(prefix + name for name in ("run-id", "phase", "task", "stage", "round", "attempt"))
    present = {name for name in record if name.startswith(prefix)}
    if not present:
        return None
    if present != set(names):
        raise ProtocolError(f"{where}: the next round's key step is named only in part")
    prepare = Header.from_record(ConfigRecord({name.removeprefix(prefix): record[name] for name in names}))
    if prepare.run_id != header.run_id:
        raise ProtocolError(f"{where}: keys asked for run {prepare.run_id!r}, this is {header.run_id!r}")
    if prepare.server_round <= header.server_round or prepare.task < header.task:
        raise ProtocolError(
            f"{where}: keys asked for round {prepare.server_round} of stage {prepare.stage}, "
            f"not after this round {header.server_round} of stage {header.stage}"
        )
    if prepare.attempt != 0 or prepare.stage != prepare.task + 1:
        raise ProtocolError(f"{where}: keys asked for a retry or a stage that is not its task's")
    return prepare


def parse_secure_reply(kind: Kind, content: RecordDict, base: ReplyBase) -> Reply:
    only(content.config_records, {"header", SECAGG}, "config records")
    only(content.array_records, set(), "array records")
    record = content.config_records.get(SECAGG)
    if record is None:
        raise ProtocolError(f"reply has no '{SECAGG}' record")
    if kind is Kind.KEYS:
        only(record, {"c", "s", "signer", "signature"}, "secagg entries")
        values = [entry(record, name, SECAGG) for name in ("c", "s", "signer", "signature")]
        if not all(isinstance(v, bytes) for v in values):
            raise ProtocolError("keys reply: the keys and signature must be bytes")
        return KeysRes(*base, keys=PublicKeys(*values))
    if kind is Kind.SHARES:
        only(record, {"nodes", "shares", "commit-nodes", "commits", "secrets"}, "secagg entries")
        secrets = entry(record, "secrets", SECAGG)
        if not isinstance(secrets, bytes):
            raise ProtocolError("shares reply: the secret commitment must be bytes")
        return SharesRes(
            *base,
            shares=node_map(record, "nodes", "shares", SECAGG, bytes),
            commitments=node_map(record, "commit-nodes", "commits", SECAGG, bytes),
            secrets=secrets,
        )
    only(record, {"seed-nodes", "seed-shares", "key-nodes", "key-shares", *NEXT_KEYS, *NEXT_SHARES}, "secagg entries")
    dealt = None
    present = [name for name in NEXT_SHARES if name in record]
    if present:
        if len(present) != len(NEXT_SHARES):
            raise ProtocolError("unmask reply: the next round's shares only in part")
        secrets = entry(record, "next-secrets", SECAGG)
        if not isinstance(secrets, bytes):
            raise ProtocolError("unmask reply: the next round's secret commitment must be bytes")
        dealt = DealtShares(
            node_map(record, "next-nodes", "next-shares", SECAGG, bytes),
            node_map(record, "next-commit-nodes", "next-commits", SECAGG, bytes),
            secrets,
        )
    return UnmaskRes(
        *base,
        seed_shares=node_map(record, "seed-nodes", "seed-shares", SECAGG, bytes),
        key_shares=node_map(record, "key-nodes", "key-shares", SECAGG, bytes),
        next_keys=_read_next_keys(record, "unmask reply"),
        next_shares=dealt,
    )
