"""Message parsing, one bad field at a time: every rejection is a ProtocolError whose one line names
the record, the field and the expectation; optional fields take their documented defaults; what a
reply carries (arrays, prototypes, late statistics) reaches the parsed message (issue 19)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from fcl_flower.methods import Kind
from fcl_flower.protocol import (
    Backfill,
    EvaluateIns,
    EvaluateRes,
    InfoIns,
    InfoRes,
    KeysIns,
    LGAReport,
    ProtocolError,
    StatsIns,
    StatsRes,
    TrainIns,
    TrainRes,
    parse_instruction,
    parse_reply,
)
from fcl_flower.protocol.base import (
    config_record,
    entry,
    metric_flag,
    metric_float,
    metric_int,
    node_map,
    node_map_entries,
    only,
    read_bytes,
    read_float,
    read_int,
    read_list,
    read_str,
)
from fcl_flower.protocol.messages import decode_backfill, encode_backfill
from fcl_flower.tensors import tensor_record
from tests.test_protocol import CFG, HEADER, INSTRUCTIONS, MODEL, _deliver

KEYS_INS = next(i for i in INSTRUCTIONS if isinstance(i, KeysIns))  # header and config only
STATS_INS_FULL = INSTRUCTIONS[3]  # backfill, rank and a secure round (its entries: test_protocol_secure.py)
assert isinstance(STATS_INS_FULL, StatsIns) and STATS_INS_FULL.secagg is not None


def _raises(call, message: str) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        call()
    assert str(info.value) == message
    return info.value


# =============================================================================== checked readers
READER_BAD = [
    (lambda: read_int(-1, "n"), "n is -1, expected a non-negative integer"),
    (lambda: read_int(1, "n", minimum=2), "n is 1, expected an integer >= 2"),
    (lambda: read_int("1", "n", minimum=None), "n is '1', expected an integer"),
    (lambda: read_int(False, "n", minimum=None), "n is False, expected an integer"),
    (lambda: read_int(2.0, "n", minimum=None), "n is 2.0, expected an integer"),
    (lambda: read_float(float("inf"), "x"), "x is inf, expected a finite number"),
    (lambda: read_float(None, "x"), "x is None, expected a finite number"),
    (lambda: read_str(b"s", "s"), "s is b's', expected a non-empty string"),
    (lambda: read_bytes("k", "key"), "key is str, expected bytes"),
    (lambda: read_bytes(bytearray(b"k"), "key"), "key is bytearray, expected bytes"),
    (lambda: entry({"a": 1}, "b", "where"), "'where' record lacks 'b'"),
    (lambda: only({"a": 1, "c": 2, "b": 3}, {"a"}, "things"), "unexpected things: b, c"),
    (lambda: metric_int(MetricRecord({"k": -2}), "k", 5), "metric 'k' is -2, expected a non-negative integer"),
    (lambda: metric_float(MetricRecord({"k": float("nan")}), "k", 1.0), "metric 'k' is nan, expected a finite number"),
    (lambda: metric_flag(MetricRecord({"k": 3}), "k"), "metric 'k' is 3, expected 0 or 1"),
    (lambda: read_list({"k": (1, 2)}, "k", "r", int), "'r' entry 'k' is not a list of int"),
    (lambda: read_list({"k": [1, True]}, "k", "r", int), "'r' entry 'k' is not a list of int"),
    (lambda: read_list({"k": [1, 2]}, "k", "r", int, 3), "'r' entry 'k' has 2 items, expected 3"),
    (lambda: node_map({"n": [1, 1], "v": [b"a", b"b"]}, "n", "v", "r", bytes), "'r' entry 'n' lists a node twice"),
    (lambda: node_map({"n": [1, 2], "v": [b"a"]}, "n", "v", "r", bytes), "'r' entry 'v' has 1 items, expected 2"),
]


@pytest.mark.parametrize("call, message", READER_BAD, ids=[m for _, m in READER_BAD])
def test_checked_readers_refuse(call, message) -> None:
    _raises(call, message)


def test_checked_readers_accept() -> None:
    assert read_int(-7, "n", minimum=None) == -7 and read_int(0, "n") == 0 and read_int(2, "n", minimum=2) == 2
    assert read_float(3, "x") == 3.0 and type(read_float(3, "x")) is float
    assert read_str("s", "s") == "s" and read_bytes(b"", "key") == b""
    assert metric_int(MetricRecord({}), "k", 5) == 5 and metric_int(MetricRecord({"k": 0}), "k", 5) == 0
    assert metric_float(MetricRecord({}), "k", 1.5) == 1.5 and metric_float(MetricRecord({"k": 2.0}), "k", 1.5) == 2.0
    assert metric_flag(MetricRecord({"k": 1}), "k") is True and metric_flag(MetricRecord({"k": 0}), "k") is False
    assert read_list({"k": []}, "k", "r", bytes, 0) == [] and read_list({"k": [2**64 - 1]}, "k", "r", int) == [
        2**64 - 1
    ]
    assert node_map({"n": [9, 2], "v": [b"a", b"b"]}, "n", "v", "r", bytes) == {9: b"a", 2: b"b"}
    assert node_map_entries({9: b"a", 2: b"b"}, "n", "v") == {"n": [2, 9], "v": [b"b", b"a"]}  # sorted by node
    source = {"a": 1, "b": [b"x"]}
    record = config_record(source)
    assert isinstance(record, ConfigRecord) and dict(record) == {"a": 1, "b": [b"x"]}
    source["a"] = 2
    assert record["a"] == 1  # a copy of the entries


# =============================================================================== headers
def _header_message(**changes) -> Message:
    message = _deliver(KEYS_INS)
    record = message.content.config_records["header"]
    for key, value in changes.items():
        if value is None:
            del record[key]
        else:
            record[key] = value
    return message


HEADER_BAD = [
    ({"run-id": ""}, "header run-id is '', expected a non-empty string"),
    ({"run-id": 5}, "header run-id is 5, expected a non-empty string"),
    ({"phase": ""}, "header phase is '', expected a non-empty string"),
    ({"phase": 1.5}, "header phase is 1.5, expected a non-empty string"),
    ({"task": "two"}, "header task is 'two', expected a non-negative integer"),
    ({"task": -1}, "header task is -1, expected a non-negative integer"),
    ({"task": True}, "header task is True, expected a non-negative integer"),
    ({"stage": 0}, "header stage is 0, expected an integer >= 1"),
    ({"round": -1}, "header round is -1, expected a non-negative integer"),
    ({"round": 1.0}, "header round is 1.0, expected a non-negative integer"),
    ({"attempt": -1}, "header attempt is -1, expected a non-negative integer"),
    *[
        ({key: None}, f"'header' record lacks '{key}'")
        for key in ("run-id", "phase", "task", "stage", "round", "attempt")
    ],
    ({"a": 1, "b": 2}, "unexpected header entries: a, b"),
]


@pytest.mark.parametrize("changes, message", HEADER_BAD, ids=[m for _, m in HEADER_BAD])
def test_bad_headers_are_refused(changes, message) -> None:
    _raises(lambda: parse_instruction(_header_message(**changes)), message)


def test_header_boundaries() -> None:
    parsed = parse_instruction(_header_message(stage=1, round=0, task=0, attempt=0))
    assert (parsed.header.stage, parsed.header.server_round, parsed.header.task) == (1, 0, 0)
    message = _deliver(KEYS_INS)
    del message.content.config_records["header"]
    _raises(lambda: parse_instruction(message), "message has no 'header' record")


# =============================================================================== instructions
def _instruction(ins, round_changes: dict | None = None, drop: str | None = None) -> Message:
    message = _deliver(ins)
    if drop is not None:
        del message.content[drop]
    for key, value in (round_changes or {}).items():
        if value is None:
            del message.content.config_records["round"][key]
        else:
            message.content.config_records["round"][key] = value
    return message


TRAIN_INS = TrainIns(HEADER, CFG, lr=0.01, num_seen=4, model=MODEL)
RIDGE_W = tensor_record({"weights": torch.arange(6.0).reshape(3, 2)})
EVALUATE_INS = EvaluateIns(HEADER, CFG, num_seen=2, model=MODEL, ridge=RIDGE_W)
INSTRUCTION_BAD = [
    (_instruction(KEYS_INS, drop="config"), "message has no 'config' record"),
    (_instruction(TRAIN_INS, drop="round"), "message has no 'round' record"),
    (_instruction(TRAIN_INS, {"num-seen": None}), "'round' record lacks 'num-seen'"),
    (_instruction(TRAIN_INS, {"num-seen": 0}), "num-seen is 0, expected an integer >= 1"),
    (_instruction(TRAIN_INS, {"lr": None}), "'round' record lacks 'lr'"),
    (_instruction(TRAIN_INS, {"lr": "fast"}), "lr is 'fast', expected a finite number"),
    (_instruction(TRAIN_INS, {"lr": float("nan")}), "lr is nan, expected a finite number"),
    (_instruction(TRAIN_INS, {"lr": True}), "lr is True, expected a finite number"),
    (_instruction(STATS_INS_FULL, {"rank": None}), "'round' record lacks 'rank'"),
    (_instruction(STATS_INS_FULL, {"rank": -1}), "rank is -1, expected a non-negative integer"),
    (_instruction(STATS_INS_FULL, {"backfill": None}), "'round' record lacks 'backfill'"),
    (_instruction(STATS_INS_FULL, {"backfill": 5}), "backfill is 5, expected a non-empty string"),
    (_instruction(STATS_INS_FULL, {"backfill": "0:x"}), "cannot read backfill entry '0:x' (expected client:task,task)"),
    (_instruction(STATS_INS_FULL, drop="round"), "message has no 'round' record"),
    (_instruction(STATS_INS_FULL, {"num-seen": -2}), "num-seen is -2, expected an integer >= 1"),
    (_instruction(EVALUATE_INS, drop="round"), "message has no 'round' record"),
    (_instruction(EVALUATE_INS, {"num-seen": None}), "'round' record lacks 'num-seen'"),
    (_instruction(EVALUATE_INS, {"num-seen": 0}), "num-seen is 0, expected an integer >= 1"),
    (_instruction(EVALUATE_INS, {"num-seen": "6"}), "num-seen is '6', expected an integer >= 1"),
]


@pytest.mark.parametrize("message, reason", INSTRUCTION_BAD, ids=[r for _, r in INSTRUCTION_BAD])
def test_bad_instructions_are_refused(message, reason) -> None:
    _raises(lambda: parse_instruction(message), reason)


def test_instruction_fields_and_defaults() -> None:
    parsed = parse_instruction(_instruction(TRAIN_INS, {"lr": 1, "num-seen": 1}))
    assert isinstance(parsed, TrainIns) and parsed.lr == 1.0 and type(parsed.lr) is float and parsed.num_seen == 1
    no_model = parse_instruction(_instruction(StatsIns(HEADER, CFG, num_seen=2, model=MODEL), drop="arrays"))
    assert isinstance(no_model, StatsIns) and isinstance(no_model.model, ArrayRecord) and len(no_model.model) == 0
    assert no_model.backfill == {} and no_model.rank == 0 and no_model.secagg is None
    empty = parse_instruction(_instruction(STATS_INS_FULL, {"backfill": ""}))  # "" means nothing owed
    assert isinstance(empty, StatsIns) and empty.backfill == {}
    full = parse_instruction(_instruction(STATS_INS_FULL))
    assert isinstance(full, StatsIns) and full.backfill == {0: (1,), 2: (0, 1)} and full.rank == 16
    assert full.secagg == STATS_INS_FULL.secagg and full.num_seen == 6
    info = parse_instruction(_instruction(InfoIns(HEADER, CFG)))
    assert type(info) is InfoIns and info.header == HEADER and info.config == CFG
    keys = parse_instruction(_instruction(KEYS_INS))  # no round record needed
    assert type(keys) is KeysIns and keys.header == HEADER and keys.config == CFG


def test_evaluate_instruction_fields() -> None:
    """num-seen from the round record, the model and (analytic methods) W in their own records."""
    message = _instruction(EVALUATE_INS)
    assert message.metadata.message_type == "evaluate"
    assert dict(message.content.config_records["round"]) == {"num-seen": 2}
    assert message.content.array_records["ridge"]["weights"].numpy().tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    parsed = parse_instruction(message)
    assert type(parsed) is EvaluateIns and parsed.num_seen == 2 and parsed.header == HEADER and parsed.config == CFG
    assert parsed.ridge is not None and parsed.ridge["weights"].numpy().tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert list(parsed.model.keys()) == list(MODEL.keys())
    plain = _instruction(EvaluateIns(HEADER, CFG, num_seen=1))  # a gradient method: no W, no record for it
    assert "ridge" not in plain.content.array_records
    parsed = parse_instruction(plain)
    assert type(parsed) is EvaluateIns and parsed.ridge is None and parsed.num_seen == 1 and len(parsed.model) == 0
    no_model = parse_instruction(_instruction(EVALUATE_INS, drop="arrays"))
    assert isinstance(no_model, EvaluateIns) and len(no_model.model) == 0 and no_model.ridge is not None


def test_backfill_codec() -> None:
    owed = {2: (1,), 0: (3, 1), 5: ()}
    text = encode_backfill(owed)
    assert text == "0:1,3;2:1"  # sorted clients and tasks, nothing for a client that owes nothing
    assert decode_backfill(text) == {0: (1, 3), 2: (1,)}
    assert decode_backfill("-") == {} and decode_backfill("") == {} and decode_backfill(" 4:2 ") == {4: (2,)}
    for bad, item in (("X0:1", "X0:1"), ("0:1:2", "0:1:2"), ("0:", "0:"), ("a:1", "a:1"), ("0;1", "0")):
        _raises(
            lambda bad=bad: decode_backfill(bad), f"cannot read backfill entry '{item}' (expected client:task,task)"
        )
    ins = StatsIns(HEADER, CFG, num_seen=2, backfill={0: (1, 3), 2: (1,)})
    assert ins.owed_by(0) == (1, 3) and ins.owed_by(2) == (1,) and ins.owed_by(7) == ()
    assert ins.owed_by_anyone() == (1, 3)
    assert StatsIns(HEADER, CFG, num_seen=2).owed_by_anyone() == ()


# =============================================================================== replies
def _reply_message(reply, ins=STATS_INS_FULL, **metric_changes) -> Message:
    message = reply.reply_to(_deliver(ins))
    metrics = message.content.metric_records["metrics"]
    for key, value in metric_changes.items():
        if value is None:
            del metrics[key]
        else:
            metrics[key] = value
    return message


STATS = StatsRes(HEADER, 1, 10, arrays=MODEL)
TRAIN = TrainRes(HEADER, 1, 10, model=MODEL, loss=0.5)
LGA = TrainRes(
    HEADER, 1, 10, model=MODEL, lga=LGAReport(0.1, 0.2, True, False, 12, 1, tensor_record({"4/0": torch.ones(2)}))
)
INFO = InfoRes(HEADER, 2, 0)
EVALUATE = EvaluateRes(
    HEADER, 2, 7, counts=tensor_record({"correct": torch.tensor([1, 2]), "total": torch.tensor([3, 4])})
)


def _with(message: Message, **records) -> Message:
    for name, record in records.items():
        message.content[name] = record
    return message


def _without(message: Message, *names: str) -> Message:
    for name in names:
        del message.content[name]
    return message


REPLY_BAD = [
    (_without(_reply_message(STATS), "metrics"), Kind.STATS, "reply has no 'metrics' record"),
    (_reply_message(STATS, **{"partition-id": None}), Kind.STATS, "'metrics' record lacks 'partition-id'"),
    (_reply_message(STATS, **{"partition-id": -3}), Kind.STATS, "partition-id is -3, expected a non-negative integer"),
    (_reply_message(STATS, **{"num-examples": None}), Kind.STATS, "'metrics' record lacks 'num-examples'"),
    (
        _reply_message(STATS, **{"num-examples": 1.5}),
        Kind.STATS,
        "metric 'num-examples' is 1.5, expected a non-negative integer",
    ),
    (_reply_message(STATS, b=1, a=2), Kind.STATS, "unexpected metrics: a, b"),
    (_without(_reply_message(STATS), "arrays"), Kind.STATS, "reply has no 'arrays' record"),
    (_with(_reply_message(STATS), **{"backfill-x": MODEL}), Kind.STATS, "unexpected array record 'backfill-x'"),
    (_with(_reply_message(STATS), **{"7": MODEL}), Kind.STATS, "unexpected array record '7'"),
    (
        _reply_message(
            StatsRes(HEADER, 1, 10, arrays=MODEL, backfill={0: Backfill(MODEL, 4)}), **{"backfill-0-num-examples": -1}
        ),
        Kind.STATS,
        "metric 'backfill-0-num-examples' is -1, expected a non-negative integer",
    ),
    (_reply_message(STATS, **{"num-labelled": 3}), Kind.STATS, "'metrics' record lacks 'pseudo-unlabelled'"),
    (_with(_reply_message(STATS), notes=ConfigRecord({"a": 1})), Kind.STATS, "unexpected config records: notes"),
    (_without(_reply_message(TRAIN), "arrays"), Kind.TRAIN, "reply has no 'arrays' record"),
    (_with(_reply_message(TRAIN), extra=MODEL), Kind.TRAIN, "unexpected array records: extra"),
    (_with(_reply_message(TRAIN), notes=ConfigRecord({"a": 1})), Kind.TRAIN, "unexpected config records: notes"),
    (_reply_message(TRAIN, surprise=1), Kind.TRAIN, "unexpected metrics: surprise"),
    (
        _reply_message(TRAIN, **{"train-loss": float("inf")}),
        Kind.TRAIN,
        "metric 'train-loss' is inf, expected a finite number",
    ),
    (_reply_message(LGA, **{"lga-cb": None}), Kind.TRAIN, "'metrics' record lacks 'lga-cb'"),
    (_reply_message(LGA, **{"lga-sd": float("nan")}), Kind.TRAIN, "metric 'lga-sd' is nan, expected a finite number"),
    (_reply_message(LGA, **{"lga-detected": 2}), Kind.TRAIN, "metric 'lga-detected' is 2, expected 0 or 1"),
    (
        _reply_message(LGA, **{"lga-memory": 1.5}),
        Kind.TRAIN,
        "metric 'lga-memory' is 1.5, expected a non-negative integer",
    ),
    (_reply_message(TRAIN, **{"stamp-proto": 0.1}), Kind.TRAIN, "'metrics' record lacks 'stamp-old-tasks'"),
    (
        _with(_reply_message(INFO), secagg=ConfigRecord({"c": b"k"})),
        Kind.INFO,
        "unexpected config records: secagg",
    ),
    (_with(_reply_message(INFO), arrays=MODEL), Kind.INFO, "unexpected array records: arrays"),
    (_reply_message(INFO, extra=1), Kind.INFO, "unexpected metrics: extra"),
    (_without(_reply_message(EVALUATE, EVALUATE_INS), "counts"), Kind.EVALUATE, "reply has no 'counts' record"),
    (
        _with(_reply_message(EVALUATE, EVALUATE_INS), arrays=MODEL),
        Kind.EVALUATE,
        "unexpected array records: arrays",
    ),
    (
        _with(_reply_message(EVALUATE, EVALUATE_INS), notes=ConfigRecord({"a": 1})),
        Kind.EVALUATE,
        "unexpected config records: notes",
    ),
    (_reply_message(EVALUATE, EVALUATE_INS, accuracy=0.5), Kind.EVALUATE, "unexpected metrics: accuracy"),
    (
        _reply_message(EVALUATE, EVALUATE_INS, **{"num-examples": -7}),
        Kind.EVALUATE,
        "metric 'num-examples' is -7, expected a non-negative integer",
    ),
]


@pytest.mark.parametrize("message, kind, reason", REPLY_BAD, ids=[r for _, _, r in REPLY_BAD])
def test_bad_replies_are_refused(message, kind, reason) -> None:
    _raises(lambda: parse_reply(message, HEADER, kind), reason)


def test_reply_defaults_and_carried_records() -> None:
    no_loss = parse_reply(_reply_message(TRAIN, **{"train-loss": None}), HEADER, Kind.TRAIN)
    assert isinstance(no_loss, TrainRes) and no_loss.loss == 0.0 and no_loss.lga is None and no_loss.stamp is None
    no_withheld = parse_reply(_reply_message(STATS, **{"withheld-samples": None}), HEADER, Kind.STATS)
    assert isinstance(no_withheld, StatsRes) and no_withheld.withheld == 0
    lga = parse_reply(_reply_message(LGA), HEADER, Kind.TRAIN)
    assert isinstance(lga, TrainRes) and lga.lga is not None and lga.lga.prototypes is not None
    assert list(lga.lga.prototypes.keys()) == ["4/0"] and lga.lga.prototypes["4/0"].numpy().tolist() == [1.0, 1.0]
    assert (
        "lga-proto" not in TrainRes(HEADER, 1, 1, model=MODEL, lga=LGAReport(0.1, 0.2, False, False, 1, 0)).to_record()
    )
    late = StatsRes(
        HEADER,
        1,
        10,
        arrays=MODEL,
        backfill={3: Backfill(tensor_record({"z": torch.ones(1)}), 4), 1: Backfill(MODEL, 0)},
    )
    parsed = parse_reply(_reply_message(late), HEADER, Kind.STATS)
    assert isinstance(parsed, StatsRes) and list(parsed.backfill) == [1, 3]
    assert parsed.backfill[3].num_examples == 4 and list(parsed.backfill[3].arrays.keys()) == ["z"]
    assert list(parsed.arrays.keys()) == list(MODEL.keys())
    assert parse_reply(_reply_message(INFO), HEADER, Kind.INFO) == INFO


def test_evaluate_reply_carries_its_counts() -> None:
    message = _reply_message(EVALUATE, EVALUATE_INS)
    assert set(message.content.array_records) == {"counts"}
    assert dict(message.content.metric_records["metrics"]) == {"partition-id": 2, "num-examples": 7}
    parsed = parse_reply(message, HEADER, Kind.EVALUATE)
    assert type(parsed) is EvaluateRes and parsed.client == 2 and parsed.num_examples == 7
    assert parsed.counts["correct"].numpy().tolist() == [1, 2] and parsed.counts["total"].numpy().tolist() == [3, 4]
