"""The message protocol: every kind round-trips through its record, and parsing rejects, with a
one-line reason, anything that does not fit -- a reply to another run, task, stage, round or
attempt, unknown records or metrics, wrong types, a missing header."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fcl_flower.config import RunConfig
from fcl_flower.methods import Kind
from fcl_flower.protocol import (
    Backfill,
    EvaluateIns,
    EvaluateRes,
    FedranReport,
    Header,
    InfoIns,
    InfoRes,
    KeysIns,
    KeysRes,
    LGAReport,
    ProtocolError,
    PublicKeys,
    SecAggRound,
    SharesIns,
    SharesRes,
    StampReport,
    StatsIns,
    StatsRes,
    TrainIns,
    TrainRes,
    UnmaskIns,
    UnmaskRes,
    UploadError,
    parse_instruction,
    parse_reply,
)
from fcl_flower.protocol.payloads import FedranStats, StsaEStats, StsaStats, read_state
from fcl_flower.tensors import tensor_record
from tests.conftest import server_identity

HEADER = Header("stsa-0123abcd", "stsa-stats", task=2, stage=3, server_round=7, attempt=1)
CFG = RunConfig(num_clients=3)
MODEL = tensor_record({"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(2)})


def _deliver(ins, node: int = 5) -> Message:
    """The instruction as the client receives it (what Flower hands the ClientApp)."""
    server_identity()
    message = ins.to_message(node)
    return Message(message.content, dst_node_id=node, message_type=message.metadata.message_type)


def _reply(reply, ins_message: Message) -> Message:
    return reply.reply_to(ins_message)


INSTRUCTIONS = [
    TrainIns(HEADER, CFG, lr=0.01, num_seen=4, model=MODEL),
    TrainIns(
        HEADER,
        CFG,
        lr=0.02,
        num_seen=6,
        model=MODEL,
        teacher=MODEL,
        ewc_fisher=MODEL,
        ewc_anchor=MODEL,
        old_model=MODEL,
    ),
    StatsIns(HEADER, CFG, num_seen=6, model=MODEL),
    StatsIns(
        HEADER,
        CFG,
        num_seen=6,
        model=MODEL,
        backfill={0: (1,), 2: (0, 1)},
        rank=16,
        secagg=SecAggRound(
            (3, 9, 11),
            {3: PublicKeys(b"a" * 32, b"b" * 32), 9: PublicKeys(b"c" * 32, b"d" * 32, b"signer", b"sig")},
            {3: 0, 9: 2},
            2,
            {3: b"bundle-from-3", 9: b"bundle-from-9"},
        ),
    ),
    KeysIns(HEADER, CFG),
    SharesIns(
        HEADER,
        CFG,
        keys={3: PublicKeys(b"a" * 32, b"b" * 32), 9: PublicKeys(b"c" * 32, b"d" * 32)},
        clients={3: 0, 9: 1},
        threshold=2,
    ),
    UnmaskIns(HEADER, CFG, survivors=(3, 9), dropped=(11,)),
    InfoIns(HEADER, CFG),
    EvaluateIns(HEADER, CFG, num_seen=6, model=MODEL),
    EvaluateIns(HEADER, CFG, num_seen=6, model=MODEL, ridge=tensor_record({"weights": torch.ones(5, 6)})),
]


@pytest.mark.parametrize("ins", INSTRUCTIONS, ids=lambda i: type(i).__name__)
def test_every_instruction_round_trips(ins) -> None:
    parsed = parse_instruction(_deliver(ins))
    assert type(parsed) is type(ins) and parsed.header == ins.header and parsed.config == ins.config
    for f in dataclasses.fields(ins):
        a, b = getattr(ins, f.name), getattr(parsed, f.name)
        if isinstance(a, ArrayRecord):
            assert isinstance(b, ArrayRecord)
            assert {k: v.numpy().tolist() for k, v in a.items()} == {k: v.numpy().tolist() for k, v in b.items()}
        else:
            assert a == b, f.name


REPLIES = [
    TrainRes(HEADER, 1, 40, model=MODEL, loss=0.5),
    TrainRes(
        HEADER,
        1,
        40,
        model=MODEL,
        loss=0.5,
        lga=LGAReport(0.1, 0.2, True, False, 12, 1, tensor_record({"4/0": torch.ones(2)})),
    ),
    TrainRes(HEADER, 1, 40, model=MODEL, loss=0.5, stamp=StampReport(0.3, 2, 20)),
    StatsRes(HEADER, 2, 40, arrays=MODEL, withheld=3, backfill={0: Backfill(MODEL, 9), 1: Backfill(MODEL, 0)}),
    StatsRes(HEADER, 2, 40, arrays=MODEL, fedran=FedranReport(30, 10, 8, 7)),
    KeysRes(HEADER, 0, 0, keys=PublicKeys(b"k" * 32, b"s" * 32, b"signer", b"signature")),
    SharesRes(HEADER, 0, 0, shares={3: b"x", 9: b"y"}),
    UnmaskRes(HEADER, 0, 0, seed_shares={3: b"x"}, key_shares={11: b"z"}),
    InfoRes(HEADER, 2, 0),
    EvaluateRes(HEADER, 2, 7, counts=tensor_record({"correct": torch.tensor([1, 2]), "total": torch.tensor([3, 4])})),
]


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_every_reply_round_trips(reply) -> None:
    message = _reply(reply, _deliver(INSTRUCTIONS[0]))
    parsed = parse_reply(message, HEADER, reply.kind)
    for f in dataclasses.fields(reply):
        a, b = getattr(reply, f.name), getattr(parsed, f.name)
        if isinstance(a, (ArrayRecord, dict)):
            assert a.keys() == b.keys()
        elif isinstance(a, LGAReport):
            assert dataclasses.replace(a, prototypes=None) == dataclasses.replace(b, prototypes=None)
        else:
            assert a == b, f.name


@pytest.mark.parametrize("field", ["run_id", "phase", "task", "stage", "server_round", "attempt"])
def test_a_reply_to_another_round_is_rejected_at_parse(field: str) -> None:
    """A replay of an earlier task's statistics, a late answer to an earlier attempt, a reply of
    another run: all carry another header and never parse."""
    other = dataclasses.replace(
        HEADER, **{field: "x" if isinstance(getattr(HEADER, field), str) else getattr(HEADER, field) + 1}
    )
    message = _reply(StatsRes(other, 1, 10, arrays=MODEL), _deliver(INSTRUCTIONS[2]))
    with pytest.raises(ProtocolError) as err:
        parse_reply(message, HEADER, Kind.STATS)
    assert field.replace("_", " ") in str(err.value) and "\n" not in str(err.value)


def _stats_message(**metrics) -> Message:
    message = _reply(StatsRes(HEADER, 1, 10, arrays=MODEL), _deliver(INSTRUCTIONS[2]))
    for key, value in metrics.items():
        message.content.metric_records["metrics"][key] = value
    return message


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"num-examples": -1}, "num-examples"),
        ({"num-examples": 2.5}, "num-examples"),
        ({"partition-id": -3}, "partition-id"),
        ({"withheld-samples": -1}, "withheld-samples"),
        ({"surprise": 1}, "unexpected metrics: surprise"),
        ({"backfill-1-num-examples": 3}, "unexpected metrics"),  # a count without its record
    ],
)
def test_bad_metrics_are_rejected(change: dict, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        parse_reply(_stats_message(**change), HEADER, Kind.STATS)


def test_missing_or_unexpected_records_are_rejected() -> None:
    message = _stats_message()
    message.content["smuggled"] = ArrayRecord({"x": Array(torch.zeros(2).numpy())})
    with pytest.raises(ProtocolError, match="unexpected array record 'smuggled'"):
        parse_reply(message, HEADER, Kind.STATS)
    message = _stats_message()
    message.content["backfill-1"] = MODEL  # a late record without its count
    with pytest.raises(ProtocolError, match="backfill-1-num-examples"):
        parse_reply(message, HEADER, Kind.STATS)
    message = _stats_message()
    message.content["notes"] = ConfigRecord({"free": "text"})
    with pytest.raises(ProtocolError, match="unexpected config records: notes"):
        parse_reply(message, HEADER, Kind.STATS)
    no_header = Message(
        RecordDict({"metrics": MetricRecord({"partition-id": 0, "num-examples": 1})}),
        reply_to=_deliver(INSTRUCTIONS[2]),
    )
    with pytest.raises(ProtocolError, match="no 'header' record"):
        parse_reply(no_header, HEADER, Kind.STATS)
    train = _reply(TrainRes(HEADER, 1, 10, model=MODEL), _deliver(INSTRUCTIONS[0]))
    train.content["lga-proto"] = MODEL
    with pytest.raises(ProtocolError, match="without the LGA metrics"):
        parse_reply(train, HEADER, Kind.TRAIN)


def test_a_failed_client_is_a_protocol_error_naming_its_reason() -> None:
    from flwr.app import Error

    failed = Message(Error(code=0, reason="RuntimeError: disk full"), reply_to=_deliver(INSTRUCTIONS[2]))
    with pytest.raises(ProtocolError, match="client failed: RuntimeError: disk full"):
        parse_reply(failed, HEADER, Kind.STATS)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda c: c.config_records["header"].__setitem__("task", "two"), "header task"),
        (lambda c: c.config_records["header"].__setitem__("stage", 0), "header stage"),
        (lambda c: c.config_records["header"].__setitem__("extra", 1), "unexpected header entries: extra"),
        (lambda c: c.config_records["config"].__setitem__("beta", 0.0), "run config: beta"),
        (lambda c: c.config_records["config"].__setitem__("bogus", 1), "bogus"),
        (lambda c: c.config_records["round"].__setitem__("num-seen", 0), "num-seen"),
        (lambda c: c.config_records["round"].__setitem__("backfill", "1:x"), "backfill entry"),
    ],
)
def test_a_bad_instruction_is_refused_by_the_client(mutate, reason: str) -> None:
    message = _deliver(INSTRUCTIONS[3])
    mutate(message.content)
    with pytest.raises(ProtocolError, match=reason):
        parse_instruction(message)


def test_unknown_message_types_are_refused() -> None:
    message = Message(INSTRUCTIONS[0].to_record(), dst_node_id=1, message_type="query.nope")
    with pytest.raises(ProtocolError, match=r"unknown message type 'query\.nope'"):
        parse_instruction(message)


# ------------------------------------------------------------------------------- payloads
def test_payload_shapes_come_from_the_server_not_the_reply() -> None:
    good = StsaStats(torch.zeros(6), torch.zeros(3, 2), torch.zeros(2)).to_record("float64")
    StsaStats.read(good, packed=6, dim=3, classes=2)
    with pytest.raises(UploadError, match="'gram-packed' has shape"):
        StsaStats.read(good, packed=10, dim=4, classes=2)
    extra = tensor_record(
        {
            "gram-packed": torch.zeros(6),
            "class-sums": torch.zeros(3, 2),
            "counts": torch.zeros(2),
            "gram": torch.zeros(9),
        }
    )
    with pytest.raises(UploadError, match="unexpected array"):
        StsaStats.read(extra, packed=6, dim=3, classes=2)
    counts = StsaEStats(torch.zeros(1, 3, 2), torch.tensor([[1.5, 0.0]])).to_record("float64")
    with pytest.raises(UploadError, match="non-integer"):
        StsaEStats.read(counts, dummies=1, dim=3, classes=2)
    basis = FedranStats(torch.eye(4)[:, :2] * 2, torch.ones(2), torch.zeros(4, 3)).to_record("float64")
    with pytest.raises(UploadError, match="orthonormal"):
        FedranStats.read(basis, dim=4, classes=3, max_rank=2)
    with pytest.raises(UploadError, match="keys differ"):
        read_state(tensor_record({"w": torch.zeros(2)}), {"w": torch.zeros(2), "b": torch.zeros(1)})
