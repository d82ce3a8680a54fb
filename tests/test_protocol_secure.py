"""The messages of a secure statistics round (fcl_flower/protocol/secure.py), one bad field at a
time: every rejection is a ProtocolError whose one line names the record, the entry and the
expectation. Node ids use Flower's whole unsigned 64-bit range and survive the real wire (protobuf);
a secure round's participants lie within the key round's nodes, its clients are exactly its
participants, and its threshold is at least 2 (issue 19)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto

from fcl_flower.methods import Kind
from fcl_flower.protocol import (
    KeysIns,
    KeysRes,
    MaskedReport,
    ProtocolError,
    PublicKeys,
    SecAggRound,
    SharesIns,
    SharesRes,
    StatsIns,
    StatsRes,
    TrainIns,
    TrainRes,
    UnmaskIns,
    UnmaskRes,
    parse_instruction,
    parse_reply,
)
from tests.test_protocol import CFG, HEADER, MODEL, _deliver

LOW, MID, TOP = 5, 2**63, 2**64 - 1  # node ids: small, above the signed range, the largest uint64
KEYS = {
    LOW: PublicKeys(b"c" * 32, b"s" * 32),
    TOP: PublicKeys(b"C" * 32, b"S" * 32, b"signer-der", b"signature"),
}
SECAGG = SecAggRound(
    (LOW, MID, TOP), KEYS, {LOW: 0, TOP: 2}, 2, {LOW: b"from-low", TOP: b"from-top"}, {LOW: b"L" * 64, TOP: b"T" * 64}
)
STATS_INS = StatsIns(HEADER, CFG, num_seen=6, model=MODEL, secagg=SECAGG)
TRAIN_INS = TrainIns(HEADER, CFG, lr=0.05, num_seen=6, model=MODEL, secagg=SECAGG)  # stage-1 FedAvg, secure
SHARES_INS = SharesIns(
    HEADER, CFG, keys={**KEYS, MID: PublicKeys(b"m" * 32, b"n" * 32)}, clients={LOW: 0, MID: 1, TOP: 2}, threshold=3
)
UNMASK_INS = UnmaskIns(HEADER, CFG, survivors=(LOW, TOP), dropped=(MID,), signatures={LOW: b"sig-low", TOP: b"sig-top"})


def _raises(call, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        call()
    assert str(info.value) == message


def _over_the_wire(message: Message) -> Message:
    """The message after protobuf serialisation, as a SuperNode or the SuperLink gets it."""
    content = recorddict_from_proto(recorddict_to_proto(message.content))
    return Message(content, dst_node_id=message.metadata.dst_node_id, message_type=message.metadata.message_type)


def _round(ins, changes: dict | None = None, drop: str | None = None) -> Message:
    """The delivered instruction with entries of its 'round' record replaced (None: removed)."""
    message = _deliver(ins)
    if drop is not None:
        del message.content[drop]
    for key, value in (changes or {}).items():
        if value is None:
            del message.content.config_records["round"][key]
        else:
            message.content.config_records["round"][key] = value
    return message


# =============================================================================== round trips
@pytest.mark.parametrize(
    "ins", [STATS_INS, TRAIN_INS, SHARES_INS, UNMASK_INS, KeysIns(HEADER, CFG)], ids=lambda i: type(i).__name__
)
def test_secure_instructions_survive_the_wire_with_64_bit_node_ids(ins) -> None:
    parsed = parse_instruction(_over_the_wire(_deliver(ins)))
    assert type(parsed) is type(ins)
    for f in dataclasses.fields(ins):
        if f.name != "model":
            assert getattr(parsed, f.name) == getattr(ins, f.name), f.name


def test_what_a_parsed_secure_round_holds() -> None:
    parsed = parse_instruction(_deliver(STATS_INS))
    assert isinstance(parsed, StatsIns) and parsed.secagg is not None
    secagg = parsed.secagg
    assert secagg.round_nodes == (LOW, MID, TOP) and isinstance(secagg.round_nodes, tuple)
    assert secagg.participants == {LOW: PublicKeys(b"c" * 32, b"s" * 32, b"", b""), TOP: KEYS[TOP]}
    assert secagg.participants[TOP].signer == b"signer-der" and secagg.participants[TOP].signature == b"signature"
    assert secagg.clients == {LOW: 0, TOP: 2} and secagg.threshold == 2
    assert secagg.shares == {LOW: b"from-low", TOP: b"from-top"}
    record = _deliver(STATS_INS).content.config_records["round"]
    assert record["secagg-round-nodes"] == [LOW, MID, TOP]
    assert record["secagg-nodes"] == [LOW, TOP]  # sorted by node id, columns in the same order
    assert record["secagg-c"] == [b"c" * 32, b"C" * 32] and record["secagg-s"] == [b"s" * 32, b"S" * 32]
    assert record["secagg-signer"] == [b"", b"signer-der"] and record["secagg-signature"] == [b"", b"signature"]
    assert record["secagg-client-nodes"] == [LOW, TOP] and record["secagg-clients"] == [0, 2]
    assert record["secagg-threshold"] == 2
    assert record["secagg-share-src"] == [LOW, TOP] and record["secagg-share"] == [b"from-low", b"from-top"]


def test_accepted_secure_rounds_at_the_edges() -> None:
    every_node = dataclasses.replace(SECAGG, round_nodes=(LOW, TOP))  # U2 = U1: nobody dropped
    parsed = parse_instruction(_deliver(dataclasses.replace(STATS_INS, secagg=every_node)))
    assert isinstance(parsed, StatsIns) and parsed.secagg == every_node
    no_shares = dataclasses.replace(SECAGG, shares={})
    parsed = parse_instruction(_deliver(dataclasses.replace(STATS_INS, secagg=no_shares)))
    assert isinstance(parsed, StatsIns) and parsed.secagg is not None and parsed.secagg.shares == {}
    plain = parse_instruction(_round(STATS_INS, {"secagg-round-nodes": None}))  # no key round: a plain upload
    assert isinstance(plain, StatsIns) and plain.secagg is None
    defaults = parse_instruction(_deliver(SharesIns(HEADER, CFG)))
    assert isinstance(defaults, SharesIns) and (defaults.keys, defaults.clients, defaults.threshold) == ({}, {}, 2)
    nobody = parse_instruction(_deliver(UnmaskIns(HEADER, CFG)))
    assert isinstance(nobody, UnmaskIns) and nobody.survivors == () and nobody.dropped == ()
    with_round = _deliver(KeysIns(HEADER, CFG))
    with_round.content["round"] = ConfigRecord({"anything": 1})  # a keys round reads no round record
    assert type(parse_instruction(with_round)) is KeysIns


# =============================================================================== bad instructions
AGREE = "secure round: participants, key-round nodes and clients do not agree"
STATS_BAD = [
    ({"secagg-round-nodes": ["x", "y"]}, "'round' entry 'secagg-round-nodes' is not a list of int"),
    ({"secagg-round-nodes": LOW}, "'round' entry 'secagg-round-nodes' is not a list of int"),
    ({"secagg-round-nodes": [True, False]}, "'round' entry 'secagg-round-nodes' is not a list of int"),
    ({"secagg-nodes": None}, "'round' record lacks 'secagg-nodes'"),
    ({"secagg-nodes": [1.5, 2.5]}, "'round' entry 'secagg-nodes' is not a list of int"),
    ({"secagg-c": [b"c" * 32]}, "'round' entry 'secagg-c' has 1 items, expected 2"),
    ({"secagg-s": ["s", "S"]}, "'round' entry 'secagg-s' is not a list of bytes"),
    ({"secagg-signer": None}, "'round' record lacks 'secagg-signer'"),
    ({"secagg-signature": [b"", b"", b""]}, "'round' entry 'secagg-signature' has 3 items, expected 2"),
    ({"secagg-nodes": [TOP, TOP]}, "'round' lists a node twice"),
    ({"secagg-nodes": [LOW, 7]}, AGREE),  # a participant outside the key round
    ({"secagg-client-nodes": [LOW, MID]}, AGREE),  # clients of other nodes than the participants
    ({"secagg-client-nodes": [LOW], "secagg-clients": [0]}, AGREE),  # a participant without a client
    ({"secagg-client-nodes": [LOW, TOP, TOP]}, "'round' entry 'secagg-clients' has 2 items, expected 3"),
    ({"secagg-client-nodes": [TOP, TOP]}, "'round' entry 'secagg-client-nodes' lists a node twice"),
    ({"secagg-clients": [0]}, "'round' entry 'secagg-clients' has 1 items, expected 2"),
    ({"secagg-clients": [0.0, 2.0]}, "'round' entry 'secagg-clients' is not a list of int"),
    ({"secagg-client-nodes": None}, "'round' record lacks 'secagg-client-nodes'"),
    ({"secagg-threshold": 1}, "secagg-threshold is 1, expected an integer >= 2"),
    ({"secagg-threshold": "2"}, "secagg-threshold is '2', expected an integer >= 2"),
    ({"secagg-threshold": None}, "'round' record lacks 'secagg-threshold'"),
    ({"secagg-share-src": [LOW]}, "'round' entry 'secagg-share' has 2 items, expected 1"),
    ({"secagg-share": [1, 2]}, "'round' entry 'secagg-share' is not a list of bytes"),
    ({"secagg-share-src": [LOW, LOW]}, "'round' entry 'secagg-share-src' lists a node twice"),
    ({"secagg-share": None}, "'round' record lacks 'secagg-share'"),
    ({"secagg-commit": None}, "'round' record lacks 'secagg-commit'"),
    ({"secagg-commit": [b"x"]}, "'round' entry 'secagg-commit' has 1 items, expected 2"),
    ({"secagg-commit-src": [LOW, LOW]}, "'round' entry 'secagg-commit-src' lists a node twice"),
]


@pytest.mark.parametrize("changes, message", STATS_BAD, ids=[f"{i}-{m}" for i, (_, m) in enumerate(STATS_BAD)])
def test_bad_secure_rounds_are_refused(changes, message) -> None:
    _raises(lambda: parse_instruction(_round(STATS_INS, changes)), message)


SHARES_BAD = [
    (_round(SHARES_INS, drop="round"), "message has no 'round' record"),
    (_round(SHARES_INS, {"secagg-nodes": [LOW, MID, LOW]}), "'round' lists a node twice"),
    (_round(SHARES_INS, {"secagg-c": None}), "'round' record lacks 'secagg-c'"),
    (_round(SHARES_INS, {"secagg-s": [b"s"]}), "'round' entry 'secagg-s' has 1 items, expected 3"),
    (
        _round(SHARES_INS, {"secagg-client-nodes": ["a", "b"]}),
        "'round' entry 'secagg-client-nodes' is not a list of int",
    ),
    (_round(SHARES_INS, {"secagg-clients": [1]}), "'round' entry 'secagg-clients' has 1 items, expected 3"),
    (_round(SHARES_INS, {"secagg-threshold": 1}), "secagg-threshold is 1, expected an integer >= 2"),
    (_round(SHARES_INS, {"secagg-threshold": None}), "'round' record lacks 'secagg-threshold'"),
    (_round(UNMASK_INS, drop="round"), "message has no 'round' record"),
    (_round(UNMASK_INS, {"survivors": [1.5]}), "'round' entry 'survivors' is not a list of int"),
    (_round(UNMASK_INS, {"survivors": None}), "'round' record lacks 'survivors'"),
    (_round(UNMASK_INS, {"dropped": ["x"]}), "'round' entry 'dropped' is not a list of int"),
    (_round(UNMASK_INS, {"dropped": None}), "'round' record lacks 'dropped'"),
    (_round(UNMASK_INS, {"signatures": None}), "'round' record lacks 'signatures'"),
    (_round(UNMASK_INS, {"signatures": ["x", "y"]}), "'round' entry 'signatures' is not a list of bytes"),
    (_round(UNMASK_INS, {"signature-nodes": [LOW]}), "'round' entry 'signatures' has 2 items, expected 1"),
]


@pytest.mark.parametrize("message, reason", SHARES_BAD, ids=[f"{i}-{r}" for i, (_, r) in enumerate(SHARES_BAD)])
def test_bad_share_and_unmask_instructions_are_refused(message, reason) -> None:
    _raises(lambda: parse_instruction(message), reason)


# =============================================================================== backfill in a secure round
def test_backfill_tasks_ride_only_where_enough_participants_owe_them() -> None:
    """Hand-counted: clients 0, 1, 2 owe {1, 3}, {1}, {1, 3, 4}; task 1 is owed by 3, task 3 by 2,
    task 4 by 1; two nodes that map to one client count once."""
    secagg = SecAggRound((1, 2, 3, 4), {n: PublicKeys(b"", b"") for n in (1, 2, 3, 4)}, {1: 0, 2: 1, 3: 2, 4: 2}, 2)
    owed = {0: (1, 3), 1: (1,), 2: (1, 3, 4), 9: (1, 5)}  # client 9 is not in this round
    assert secagg.backfill_tasks(owed, 1) == (1, 3, 4)
    assert secagg.backfill_tasks(owed, 2) == (1, 3)
    assert secagg.backfill_tasks(owed, 3) == (1,)
    assert secagg.backfill_tasks(owed, 4) == ()
    assert secagg.backfill_tasks({}, 1) == ()


# =============================================================================== replies
def _reply(reply, *, entries: dict | None = None, **records) -> Message:
    """The reply as the server receives it, with entries of its 'secagg' record replaced (None: removed)
    and whole records replaced (None: removed)."""
    message = reply.reply_to(_deliver(KeysIns(HEADER, CFG)))
    for key, value in (entries or {}).items():
        if value is None:
            del message.content.config_records["secagg"][key]
        else:
            message.content.config_records["secagg"][key] = value
    for name, record in records.items():
        if record is None:
            del message.content[name]
        else:
            message.content[name] = record
    return message


KEYS_RES = KeysRes(HEADER, 3, 0, keys=PublicKeys(b"c" * 32, b"s" * 32, b"signer-der", b"signature"))
SHARES_RES = SharesRes(
    HEADER,
    3,
    0,
    shares={LOW: b"to-low", TOP: b"to-top"},
    commitments={LOW: b"l" * 64, TOP: b"t" * 64},
    secrets=b"x" * 64,
)
UNMASK_RES = UnmaskRes(HEADER, 3, 0, seed_shares={LOW: b"b-low", TOP: b"b-top"}, key_shares={MID: b"s-mid"})


@pytest.mark.parametrize("reply", [KEYS_RES, SHARES_RES, UNMASK_RES], ids=lambda r: type(r).__name__)
def test_secure_replies_survive_the_wire(reply) -> None:
    message = reply.reply_to(_deliver(KeysIns(HEADER, CFG)))
    wired = Message(
        recorddict_from_proto(recorddict_to_proto(message.content)), reply_to=_deliver(KeysIns(HEADER, CFG))
    )
    assert parse_reply(wired, HEADER, reply.kind) == reply


def test_secure_reply_defaults() -> None:
    assert parse_reply(_reply(KeysRes(HEADER, 0, 0)), HEADER, Kind.KEYS) == KeysRes(
        HEADER, 0, 0, keys=PublicKeys(b"", b"", b"", b"")
    )
    assert parse_reply(_reply(SharesRes(HEADER, 1, 0)), HEADER, Kind.SHARES) == SharesRes(HEADER, 1, 0, shares={})
    empty = parse_reply(_reply(UnmaskRes(HEADER, 2, 0)), HEADER, Kind.UNMASK)
    assert isinstance(empty, UnmaskRes) and empty.seed_shares == {} and empty.key_shares == {}


BYTES = "keys reply: the keys and signature must be bytes"
REPLY_BAD = [
    (_reply(KEYS_RES, secagg=None), Kind.KEYS, "reply has no 'secagg' record"),
    (_reply(KEYS_RES, entries={"extra": 1}), Kind.KEYS, "unexpected secagg entries: extra"),
    (_reply(KEYS_RES, entries={"signer": None}), Kind.KEYS, "'secagg' record lacks 'signer'"),
    (_reply(KEYS_RES, entries={"c": None}), Kind.KEYS, "'secagg' record lacks 'c'"),
    (_reply(KEYS_RES, entries={"c": "key"}), Kind.KEYS, BYTES),
    (_reply(KEYS_RES, entries={"s": 5}), Kind.KEYS, BYTES),
    (_reply(KEYS_RES, entries={"signature": [b"sig"]}), Kind.KEYS, BYTES),  # only one of four is wrong
    (_reply(KEYS_RES, notes=ConfigRecord({"a": 1})), Kind.KEYS, "unexpected config records: notes"),
    (_reply(KEYS_RES, arrays=MODEL), Kind.KEYS, "unexpected array records: arrays"),
    (_reply(KEYS_RES, round=ConfigRecord({"a": 1})), Kind.KEYS, "unexpected config records: round"),
    (_reply(SHARES_RES, secagg=None), Kind.SHARES, "reply has no 'secagg' record"),
    (_reply(SHARES_RES, entries={"c": b""}), Kind.SHARES, "unexpected secagg entries: c"),
    (_reply(SHARES_RES, entries={"nodes": ["x", "y"]}), Kind.SHARES, "'secagg' entry 'nodes' is not a list of int"),
    (_reply(SHARES_RES, entries={"shares": [b"a"]}), Kind.SHARES, "'secagg' entry 'shares' has 1 items, expected 2"),
    (_reply(SHARES_RES, entries={"shares": ["a", "b"]}), Kind.SHARES, "'secagg' entry 'shares' is not a list of bytes"),
    (_reply(SHARES_RES, entries={"nodes": [TOP, TOP]}), Kind.SHARES, "'secagg' entry 'nodes' lists a node twice"),
    (_reply(SHARES_RES, entries={"shares": None}), Kind.SHARES, "'secagg' record lacks 'shares'"),
    (_reply(SHARES_RES, arrays=MODEL), Kind.SHARES, "unexpected array records: arrays"),
    (_reply(KEYS_RES), Kind.SHARES, "unexpected secagg entries: c, s, signature, signer"),
    (
        _reply(UNMASK_RES, entries={"seed-nodes": [LOW, LOW]}),
        Kind.UNMASK,
        "'secagg' entry 'seed-nodes' lists a node twice",
    ),
    (
        _reply(UNMASK_RES, entries={"key-shares": [1]}),
        Kind.UNMASK,
        "'secagg' entry 'key-shares' is not a list of bytes",
    ),
    (_reply(UNMASK_RES, entries={"key-nodes": None}), Kind.UNMASK, "'secagg' record lacks 'key-nodes'"),
    (
        _reply(UNMASK_RES, entries={"seed-shares": [b"x"]}),
        Kind.UNMASK,
        "'secagg' entry 'seed-shares' has 1 items, expected 2",
    ),
    (_reply(UNMASK_RES, entries={"nodes": [1]}), Kind.UNMASK, "unexpected secagg entries: nodes"),
    (_reply(UNMASK_RES, secagg=None), Kind.UNMASK, "reply has no 'secagg' record"),
    (_reply(SHARES_RES), Kind.UNMASK, "unexpected secagg entries: commit-nodes, commits, nodes, secrets, shares"),
    (_reply(SHARES_RES), Kind.KEYS, "unexpected secagg entries: commit-nodes, commits, nodes, secrets, shares"),
    (
        _reply(
            SHARES_RES, entries={"nodes": None, "shares": None, "commit-nodes": None, "commits": None, "secrets": None}
        ),
        Kind.KEYS,
        "'secagg' record lacks 'c'",
    ),
    (_reply(SHARES_RES, entries={"secrets": "x"}), Kind.SHARES, "shares reply: the secret commitment must be bytes"),
    (_reply(SHARES_RES, entries={"secrets": None}), Kind.SHARES, "'secagg' record lacks 'secrets'"),
    (_reply(SHARES_RES, entries={"commits": [b"a"]}), Kind.SHARES, "'secagg' entry 'commits' has 1 items, expected 2"),
    (_reply(SHARES_RES, entries={"commit-nodes": None}), Kind.SHARES, "'secagg' record lacks 'commit-nodes'"),
]


@pytest.mark.parametrize("message, kind, reason", REPLY_BAD, ids=[f"{i}-{r}" for i, (_, _, r) in enumerate(REPLY_BAD)])
def test_bad_secure_replies_are_refused(message, kind, reason) -> None:
    _raises(lambda: parse_reply(message, HEADER, kind), reason)


# =============================================================================== what rides beside a masked upload
REPORT = MaskedReport(b"view-signature", {MID: "does not decrypt", TOP: "does not match"})


def _stats_reply(report: MaskedReport | None, entries: dict | None = None) -> Message:
    message = StatsRes(HEADER, 3, 0, arrays=MODEL, secagg=report).reply_to(_deliver(STATS_INS))
    for key, value in (entries or {}).items():
        if value is None:
            del message.content.config_records["secagg"][key]
        else:
            message.content.config_records["secagg"][key] = value
    return message


def test_a_masked_uploads_report_survives_the_wire() -> None:
    message = _stats_reply(REPORT)
    wired = Message(recorddict_from_proto(recorddict_to_proto(message.content)), reply_to=_deliver(STATS_INS))
    parsed = parse_reply(wired, HEADER, Kind.STATS)
    assert isinstance(parsed, StatsRes) and parsed.secagg == REPORT
    plain = parse_reply(_stats_reply(None), HEADER, Kind.STATS)
    assert isinstance(plain, StatsRes) and plain.secagg is None


def test_a_masked_train_reply_and_its_instruction_survive_the_wire() -> None:
    """Stage 1 under secure aggregation: the train instruction carries the round, the reply its
    report; a plain train instruction and reply carry neither."""
    parsed = parse_instruction(_deliver(TRAIN_INS))
    assert isinstance(parsed, TrainIns) and parsed.secagg == SECAGG and parsed.lr == 0.05
    plain_ins = parse_instruction(_deliver(dataclasses.replace(TRAIN_INS, secagg=None)))
    assert isinstance(plain_ins, TrainIns) and plain_ins.secagg is None
    message = TrainRes(HEADER, 3, 0, model=MODEL, secagg=REPORT).reply_to(_deliver(TRAIN_INS))
    wired = Message(recorddict_from_proto(recorddict_to_proto(message.content)), reply_to=_deliver(TRAIN_INS))
    reply = parse_reply(wired, HEADER, Kind.TRAIN)
    assert isinstance(reply, TrainRes) and reply.secagg == REPORT and reply.num_examples == 0
    plain = parse_reply(TrainRes(HEADER, 3, 7, model=MODEL).reply_to(_deliver(TRAIN_INS)), HEADER, Kind.TRAIN)
    assert isinstance(plain, TrainRes) and plain.secagg is None
    message.content.config_records["secagg"]["accused"] = "x"
    with pytest.raises(ProtocolError, match="secagg"):
        parse_reply(message, HEADER, Kind.TRAIN)


REPORT_BAD = [
    ({"view-signature": "x"}, "masked upload: the view signature must be bytes"),
    ({"view-signature": None}, "'secagg' record lacks 'view-signature'"),
    ({"accused": [MID, MID]}, "'secagg' entry 'accused' lists a node twice"),
    ({"accused": ["a"]}, "'secagg' entry 'accused' is not a list of int"),
    ({"accused-reasons": ["x"]}, "'secagg' entry 'accused-reasons' has 1 items, expected 2"),
    ({"accused-keys": [b"k", b"k"]}, "unexpected secagg entries: accused-keys"),
    ({"accused-reasons": [1, 2]}, "'secagg' entry 'accused-reasons' is not a list of str"),
    ({"other": 1}, "unexpected secagg entries: other"),
]


@pytest.mark.parametrize("entries, reason", REPORT_BAD, ids=[r for _, r in REPORT_BAD])
def test_bad_masked_upload_reports_are_refused(entries, reason) -> None:
    _raises(lambda: parse_reply(_stats_reply(REPORT, entries), HEADER, Kind.STATS), reason)


def test_an_accusations_reason_is_one_printable_line_of_at_most_300_characters() -> None:
    """A client's free text enters the server's logs and results.json: no newline or escape code
    can forge an entry there."""
    long = MaskedReport(b"", {MID: "x" * 1000, TOP: "line one\nWARNING forged\x1b[31m"})
    parsed = parse_reply(_stats_reply(long), HEADER, Kind.STATS)
    assert isinstance(parsed, StatsRes) and parsed.secagg is not None
    assert parsed.secagg.accused == {MID: "x" * 300, TOP: "line one?WARNING forged?[31m"}


@pytest.mark.parametrize(
    ("arrays", "words"),
    [
        ({"weights": np.zeros(6, np.uint64), "count": np.zeros(1, np.uint64)}, "shape"),  # another model's length
        ({"weights": np.zeros(5, np.float32), "count": np.zeros(1, np.uint64)}, "dtype float32, expected uint64"),
        ({"weights": np.zeros(5, np.uint64), "count": np.zeros(2, np.uint64)}, "shape"),
        ({"weights": np.zeros(5, np.uint64)}, "not a masked upload"),
        ({"weights": np.zeros(5, np.uint64), "count": np.zeros(1, np.uint64), "extra": np.zeros(1)}, "not a masked"),
        ({"head.weight": np.zeros(5, np.float32)}, "plain model state is refused"),
    ],
)
def test_a_garbage_masked_fedavg_upload_is_refused_with_its_reason(arrays, words: str) -> None:
    """Stage-1 secure uploads are untrusted like the statistics: wrong length, dtype, a missing or
    extra array, or a clear state are refused at parse with one line."""
    from flwr.app import Array, ArrayRecord

    from fcl_flower.protocol import UploadError
    from fcl_flower.protocol.payloads import MaskedFedAvgState

    record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
    with pytest.raises(UploadError, match=words) as caught:
        MaskedFedAvgState.read(record, length=5)
    assert "\n" not in str(caught.value)
    good = ArrayRecord({"weights": Array(np.arange(5, dtype=np.uint64)), "count": Array(np.ones(1, np.uint64))})
    assert MaskedFedAvgState.read(good, length=5).weights.tolist() == [0, 1, 2, 3, 4]
