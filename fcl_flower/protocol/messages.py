"""Every message between the ServerApp (``strategies/``) and the ClientApp (``clients/``).

Each message kind is a frozen dataclass with ``to_record()`` and a validating ``from_record()``
(through :func:`parse_instruction` on the client and :func:`parse_reply` on the server): nothing
else in the code builds or reads a record by its string keys. Every message carries a
:class:`Header` -- run id, phase, task, stage, server round and attempt -- and a reply must
echo the header of the instruction it answers: a reply parsed against another run, task,
stage, round or attempt (a replay, or a late answer to an earlier attempt) is rejected at parse.

Server -> client:

=================  =============  ==============================================================
message            Flower type    carries
=================  =============  ==============================================================
:class:`TrainIns`  ``train``      global trainable state, learning rate, method arrays (teacher,
                                  Fisher + anchor, LGA's old model, TARGET/LANDER's synthetic
                                  images, LANDER's label-text anchors)
:class:`StatsIns`  ``query.stats``global trainable state, backfill request, FedRAN rank, the
                                  secure round's participants
:class:`KeysIns`   ``query.keys`` nothing but the header and config: "send a fresh public key"
:class:`InfoIns`   ``query.info`` "which client do you serve?"
=================  =============  ==============================================================

Client -> server: :class:`TrainRes` (trainable state, loss, LGA/STAMP reports),
:class:`StatsRes` (the method's statistics, late statistics it owes, withheld-sample count,
FedRAN's pseudo-label counts), :class:`KeysRes` (a public key) and :class:`InfoRes`. Each reply
names the client (partition) it speaks for and how many examples it used. The arrays of a
statistics reply are typed by :mod:`fcl_flower.protocol.payloads`, whose shapes the server checks
against its own state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.typing import ConfigRecordValues, MetricRecordValues

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.methods import Kind
from fcl_flower.protocol.errors import ProtocolError

# Record names (the only place they are spelled out).
HEADER, CONFIG, ROUND, MODEL, METRICS, SECAGG = "header", "config", "round", "arrays", "metrics", "secagg"
TEACHER, EWC_FISHER, EWC_ANCHOR, OLD_MODEL = "teacher", "ewc-fisher", "ewc-anchor", "lga-old-model"
LGA_PROTO = "lga-proto"
SYNTHETIC, ANCHORS = "synthetic-images", "lander-anchors"
BACKFILL_PREFIX = "backfill-"  # reply record "backfill-<task>", metric "backfill-<task>-num-examples"


# ------------------------------------------------------------------------------------ scalars
def _int(value: Any, what: str, *, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        expected = (
            "an integer"
            if minimum is None
            else "a non-negative integer"
            if minimum == 0
            else f"an integer >= {minimum}"
        )
        raise ProtocolError(f"{what} is {value!r}, expected {expected}")
    return value


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"{what} is {value!r}, expected a finite number")
    return float(value)


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{what} is {value!r}, expected a non-empty string")
    return value


def _metric_int(metrics: MetricRecord, key: str, default: int | None = None) -> int:
    if key not in metrics and default is not None:
        return default
    return _int(_get(metrics, key, METRICS), f"metric '{key}'")


def _metric_float(metrics: MetricRecord, key: str, default: float | None = None) -> float:
    if key not in metrics and default is not None:
        return default
    return _float(_get(metrics, key, METRICS), f"metric '{key}'")


def _get(record: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in record:
        raise ProtocolError(f"'{where}' record lacks '{key}'")
    return record[key]


def _only(names: Any, allowed: set[str], where: str) -> None:
    unknown = sorted(set(names) - allowed)
    if unknown:
        raise ProtocolError(f"unexpected {where}: {', '.join(unknown)}")


# ------------------------------------------------------------------------------------ header
@dataclass(frozen=True)
class Header:
    """Which round of which run a message belongs to."""

    run_id: str
    phase: str
    task: int  # 0-based task index
    stage: int  # 1-based stage number (the stage of results.json)
    server_round: int  # 1-based round number over the whole run
    attempt: int = 0  # 0 for the first send of a round; retries and secure re-runs count up

    def to_record(self) -> ConfigRecord:
        return ConfigRecord(
            {
                "run-id": self.run_id,
                "phase": self.phase,
                "task": self.task,
                "stage": self.stage,
                "round": self.server_round,
                "attempt": self.attempt,
            }
        )

    @classmethod
    def from_record(cls, record: ConfigRecord | None) -> Header:
        if record is None:
            raise ProtocolError(f"message has no '{HEADER}' record")
        _only(record, {"run-id", "phase", "task", "stage", "round", "attempt"}, "header entries")
        return cls(
            run_id=_str(_get(record, "run-id", HEADER), "header run-id"),
            phase=_str(_get(record, "phase", HEADER), "header phase"),
            task=_int(_get(record, "task", HEADER), "header task"),
            stage=_int(_get(record, "stage", HEADER), "header stage", minimum=1),
            server_round=_int(_get(record, "round", HEADER), "header round", minimum=0),
            attempt=_int(_get(record, "attempt", HEADER), "header attempt"),
        )

    def require(self, reply: Header) -> None:
        """Raise ProtocolError unless ``reply`` (a reply's header) answers this header."""
        for f in fields(self):
            sent, got = getattr(self, f.name), getattr(reply, f.name)
            if sent != got:
                raise ProtocolError(f"reply is for {f.name.replace('_', ' ')} {got!r}, this round is {sent!r}")


# ------------------------------------------------------------------------------------ server -> client
@dataclass(frozen=True)
class SecAggRound:
    """The participants of one secure statistics attempt: node id -> public key."""

    participants: Mapping[int, bytes]


@dataclass(frozen=True)
class Instruction:
    """What every server message carries: the header and the full run configuration."""

    kind: ClassVar[Kind]
    header: Header
    config: RunConfig

    def to_record(self) -> RecordDict:
        content = RecordDict(
            {
                HEADER: self.header.to_record(),
                CONFIG: ConfigRecord(dict[str, ConfigRecordValues](self.config.to_mapping())),
            }
        )
        self._fill(content)
        return content

    def _fill(self, content: RecordDict) -> None:
        """Subclasses add their records."""

    def to_message(self, dst_node_id: int) -> Message:
        return Message(content=self.to_record(), message_type=str(self.kind), dst_node_id=dst_node_id)


@dataclass(frozen=True)
class TrainIns(Instruction):
    """A local-training round: train the global model on this client's data of the task."""

    kind: ClassVar[Kind] = Kind.TRAIN
    lr: float = 0.0
    num_seen: int = 0
    model: ArrayRecord = field(default_factory=ArrayRecord)
    teacher: ArrayRecord | None = None  # LwF: the previous task's global model
    ewc_fisher: ArrayRecord | None = None  # EWC: the aggregated Fisher ...
    ewc_anchor: ArrayRecord | None = None  # ... and the parameters it anchors to
    old_model: ArrayRecord | None = None  # LGA: the old model the proxy selected
    synthetic: ArrayRecord | None = None  # TARGET/LANDER: the server's synthetic images (uint8)
    anchors: ArrayRecord | None = None  # LANDER: the label-text embeddings of all classes

    OPTIONAL: ClassVar[dict[str, str]] = {
        TEACHER: "teacher",
        EWC_FISHER: "ewc_fisher",
        EWC_ANCHOR: "ewc_anchor",
        OLD_MODEL: "old_model",
        SYNTHETIC: "synthetic",
        ANCHORS: "anchors",
    }

    def _fill(self, content: RecordDict) -> None:
        content[ROUND] = ConfigRecord({"lr": self.lr, "num-seen": self.num_seen})
        content[MODEL] = self.model
        for name, attribute in self.OPTIONAL.items():
            record = getattr(self, attribute)
            if record is not None:
                content[name] = record


@dataclass(frozen=True)
class StatsIns(Instruction):
    """A statistics round: one pass over the local data of the task with the global (frozen) model."""

    kind: ClassVar[Kind] = Kind.STATS
    num_seen: int = 0
    model: ArrayRecord = field(default_factory=ArrayRecord)
    backfill: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # client -> earlier tasks it owes
    rank: int = 0  # FedRAN: the upload rank r (0: not a FedRAN round)
    secagg: SecAggRound | None = None  # set: upload masked for these participants

    def _fill(self, content: RecordDict) -> None:
        entries: dict[str, Any] = {
            "num-seen": self.num_seen,
            "rank": self.rank,
            "backfill": encode_backfill(self.backfill),
        }
        if self.secagg is not None:
            nodes = sorted(self.secagg.participants)
            entries["secagg-nodes"] = nodes
            entries["secagg-keys"] = [self.secagg.participants[n] for n in nodes]
        content[ROUND] = ConfigRecord(entries)
        content[MODEL] = self.model

    def owed_by(self, client: int) -> tuple[int, ...]:
        return tuple(self.backfill.get(client, ()))

    def owed_by_anyone(self) -> tuple[int, ...]:
        return tuple(sorted({t for tasks in self.backfill.values() for t in tasks}))


@dataclass(frozen=True)
class KeysIns(Instruction):
    """Before a secure statistics round: make a fresh key pair and send the public half."""

    kind: ClassVar[Kind] = Kind.KEYS


@dataclass(frozen=True)
class InfoIns(Instruction):
    """Which client (partition) does this node serve? (the server samples clients per round)."""

    kind: ClassVar[Kind] = Kind.INFO


def parse_instruction(message: Message) -> Instruction:
    """The typed instruction in a server message; ProtocolError if it is not one."""
    try:
        kind = Kind(message.metadata.message_type)
    except ValueError:
        raise ProtocolError(f"unknown message type '{message.metadata.message_type}'") from None
    content = message.content
    header = Header.from_record(content.config_records.get(HEADER))
    if CONFIG not in content.config_records:
        raise ProtocolError(f"message has no '{CONFIG}' record")
    try:
        config = RunConfig.from_mapping(dict(content.config_records[CONFIG]))
    except ConfigError as err:
        raise ProtocolError(f"run config: {err}") from None
    if kind is Kind.KEYS:
        return KeysIns(header, config)
    if kind is Kind.INFO:
        return InfoIns(header, config)
    round_ = content.config_records.get(ROUND)
    if round_ is None:
        raise ProtocolError(f"message has no '{ROUND}' record")
    model = content.array_records.get(MODEL, ArrayRecord())
    num_seen = _int(_get(round_, "num-seen", ROUND), "num-seen", minimum=1)
    if kind is Kind.TRAIN:
        optional = {attribute: content.array_records.get(name) for name, attribute in TrainIns.OPTIONAL.items()}
        return TrainIns(
            header, config, lr=_float(_get(round_, "lr", ROUND), "lr"), num_seen=num_seen, model=model, **optional
        )
    secagg = None
    if "secagg-nodes" in round_:
        nodes, keys = round_["secagg-nodes"], _get(round_, "secagg-keys", ROUND)
        if not isinstance(nodes, list) or not isinstance(keys, list) or len(nodes) != len(keys):
            raise ProtocolError("secagg-nodes and secagg-keys must be lists of the same length")
        secagg = SecAggRound({_int(n, "secagg node", minimum=None): _bytes(k) for n, k in zip(nodes, keys)})
    return StatsIns(
        header,
        config,
        num_seen=num_seen,
        model=model,
        backfill=decode_backfill(_str(_get(round_, "backfill", ROUND) or "-", "backfill")),
        rank=_int(_get(round_, "rank", ROUND), "rank"),
        secagg=secagg,
    )


def _bytes(value: Any) -> bytes:
    if not isinstance(value, bytes):
        raise ProtocolError(f"secagg key is {type(value).__name__}, expected bytes")
    return value


def encode_backfill(owed: Mapping[int, tuple[int, ...] | list[int]]) -> str:
    """{client: [task, ...]} -> "0:1,3;2:1" (a ConfigRecord carries scalars, not dicts)."""
    return ";".join(f"{c}:{','.join(str(t) for t in sorted(tasks))}" for c, tasks in sorted(owed.items()) if tasks)


def decode_backfill(text: str) -> dict[int, tuple[int, ...]]:
    """Inverse of :func:`encode_backfill` ("-" or "" is empty); ProtocolError on anything else."""
    owed: dict[int, tuple[int, ...]] = {}
    for entry in filter(None, text.strip().strip("-").split(";")):
        try:
            client, tasks = entry.split(":")
            owed[int(client)] = tuple(sorted(int(t) for t in tasks.split(",")))
        except ValueError:
            raise ProtocolError(f"cannot read backfill entry '{entry}' (expected client:task,task)") from None
    return owed


# ------------------------------------------------------------------------------------ client -> server
@dataclass(frozen=True)
class LGAReport:
    """What an LGA client reports besides its model: losses, the Eq. 8 detector, memory and the
    perturbed prototype gradients of its new classes (record ``lga-proto``, keys ``<class>/<i>``)."""

    cb: float
    sd: float
    detected: bool
    new_task: bool
    memory: int
    proto_classes: int
    prototypes: ArrayRecord | None = None


@dataclass(frozen=True)
class StampReport:
    proto: float  # mean ProtoNet loss
    old_tasks: int  # old tasks matched by temporal gradient matching
    coreset: int  # samples in the coreset


@dataclass(frozen=True)
class FedranReport:
    """FedRAN-SSL's counts: labelled samples and the pseudo-labelling outcome of the others."""

    num_labelled: int
    pseudo_unlabelled: int
    pseudo_accepted: int
    pseudo_correct: int


@dataclass(frozen=True)
class Backfill:
    """Late statistics of an earlier task (same arrays as the task's own upload)."""

    arrays: ArrayRecord
    num_examples: int


@dataclass(frozen=True)
class Reply:
    """What every reply carries: the header it answers, the client it speaks for, its sample count."""

    kind: ClassVar[Kind]
    header: Header
    client: int
    num_examples: int

    def metrics(self) -> dict[str, MetricRecordValues]:
        return {"partition-id": self.client, "num-examples": self.num_examples}

    def to_record(self) -> RecordDict:
        content = RecordDict({HEADER: self.header.to_record()})
        self._fill(content)
        content[METRICS] = MetricRecord(self.metrics())
        return content

    def _fill(self, content: RecordDict) -> None:
        """Subclasses add their records."""

    def reply_to(self, message: Message) -> Message:
        return Message(self.to_record(), reply_to=message)


@dataclass(frozen=True)
class TrainRes(Reply):
    kind: ClassVar[Kind] = Kind.TRAIN
    model: ArrayRecord = field(default_factory=ArrayRecord)
    loss: float = 0.0
    lga: LGAReport | None = None
    stamp: StampReport | None = None

    def metrics(self) -> dict[str, MetricRecordValues]:
        out: dict[str, MetricRecordValues] = {**super().metrics(), "train-loss": self.loss}
        if self.lga is not None:
            r = self.lga
            out.update(
                {
                    "lga-cb": r.cb,
                    "lga-sd": r.sd,
                    "lga-detected": int(r.detected),
                    "lga-new-task": int(r.new_task),
                    "lga-memory": r.memory,
                    "lga-proto-classes": r.proto_classes,
                }
            )
        if self.stamp is not None:
            out.update(
                {
                    "stamp-proto": self.stamp.proto,
                    "stamp-old-tasks": self.stamp.old_tasks,
                    "stamp-coreset": self.stamp.coreset,
                }
            )
        return out

    def _fill(self, content: RecordDict) -> None:
        content[MODEL] = self.model
        if self.lga is not None and self.lga.prototypes is not None:
            content[LGA_PROTO] = self.lga.prototypes


@dataclass(frozen=True)
class StatsRes(Reply):
    kind: ClassVar[Kind] = Kind.STATS
    arrays: ArrayRecord = field(default_factory=ArrayRecord)
    withheld: int = 0  # samples left out under min-class-count (this and every backfilled task)
    backfill: Mapping[int, Backfill] = field(default_factory=dict)  # task -> late statistics
    fedran: FedranReport | None = None

    def metrics(self) -> dict[str, MetricRecordValues]:
        out: dict[str, MetricRecordValues] = {**super().metrics(), "withheld-samples": self.withheld}
        for task, late in self.backfill.items():
            out[f"{BACKFILL_PREFIX}{task}-num-examples"] = late.num_examples
        if self.fedran is not None:
            f = self.fedran
            out.update(
                {
                    "num-labelled": f.num_labelled,
                    "pseudo-unlabelled": f.pseudo_unlabelled,
                    "pseudo-accepted": f.pseudo_accepted,
                    "pseudo-correct": f.pseudo_correct,
                }
            )
        return out

    def _fill(self, content: RecordDict) -> None:
        content[MODEL] = self.arrays
        for task, late in sorted(self.backfill.items()):
            content[f"{BACKFILL_PREFIX}{task}"] = late.arrays


@dataclass(frozen=True)
class KeysRes(Reply):
    kind: ClassVar[Kind] = Kind.KEYS
    public_key: bytes = b""

    def _fill(self, content: RecordDict) -> None:
        content[SECAGG] = ConfigRecord({"public-key": self.public_key})


@dataclass(frozen=True)
class InfoRes(Reply):
    kind: ClassVar[Kind] = Kind.INFO


_LGA_METRICS = {"lga-cb", "lga-sd", "lga-detected", "lga-new-task", "lga-memory", "lga-proto-classes"}
_STAMP_METRICS = {"stamp-proto", "stamp-old-tasks", "stamp-coreset"}
_FEDRAN_METRICS = {"num-labelled", "pseudo-unlabelled", "pseudo-accepted", "pseudo-correct"}


def parse_reply(message: Message, sent: Header, kind: Kind) -> Reply:
    """The typed reply of a ``kind`` round whose instruction carried ``sent``.

    Raises ProtocolError (one line) for anything that does not fit: an error reply, a reply to
    another run/task/stage/round/attempt, missing or unexpected records and metrics, wrong types.
    Array *contents* are checked by the strategy (:mod:`fcl_flower.protocol.payloads`).
    """
    if message.has_error():
        raise ProtocolError(f"client failed: {message.error.reason}")
    content = message.content
    sent.require(Header.from_record(content.config_records.get(HEADER)))
    metrics = content.metric_records.get(METRICS)
    if metrics is None:
        raise ProtocolError(f"reply has no '{METRICS}' record")
    client = _int(_get(metrics, "partition-id", METRICS), "partition-id")
    try:
        return _parse_body(content, metrics, kind, sent, client)
    except ProtocolError as err:
        err.claimed_client = client  # name the rejection after the client the reply claims to be
        raise


class _Base(NamedTuple):
    """The fields every reply has, in the order of :class:`Reply`'s."""

    header: Header
    client: int
    num_examples: int


def _parse_body(content: RecordDict, metrics: MetricRecord, kind: Kind, sent: Header, client: int) -> Reply:
    num_examples = _metric_int(metrics, "num-examples")
    base = _Base(sent, client, num_examples)
    if kind is Kind.TRAIN:
        return _parse_train(content, metrics, base)
    if kind is Kind.STATS:
        return _parse_stats(content, metrics, base)
    _only(content.array_records, set(), "array records")
    _only(metrics, {"partition-id", "num-examples"}, "metrics")
    if kind is Kind.KEYS:
        _only(content.config_records, {HEADER, SECAGG}, "config records")
        record = content.config_records.get(SECAGG)
        key = None if record is None else record.get("public-key")
        if not isinstance(key, bytes):
            raise ProtocolError("keys reply carries no public key")
        return KeysRes(*base, public_key=key)
    _only(content.config_records, {HEADER}, "config records")
    return InfoRes(*base)


def _parse_train(content: RecordDict, metrics: MetricRecord, base: _Base) -> TrainRes:
    _only(content.config_records, {HEADER}, "config records")
    _only(content.array_records, {MODEL, LGA_PROTO}, "array records")
    _only(metrics, {"partition-id", "num-examples", "train-loss"} | _LGA_METRICS | _STAMP_METRICS, "metrics")
    if MODEL not in content.array_records:
        raise ProtocolError(f"reply has no '{MODEL}' record")
    lga = stamp = None
    if _LGA_METRICS & set(metrics):
        lga = LGAReport(
            cb=_metric_float(metrics, "lga-cb"),
            sd=_metric_float(metrics, "lga-sd"),
            detected=_flag(metrics, "lga-detected"),
            new_task=_flag(metrics, "lga-new-task"),
            memory=_metric_int(metrics, "lga-memory"),
            proto_classes=_metric_int(metrics, "lga-proto-classes"),
            prototypes=content.array_records.get(LGA_PROTO),
        )
    elif LGA_PROTO in content.array_records:
        raise ProtocolError(f"'{LGA_PROTO}' record without the LGA metrics")
    if _STAMP_METRICS & set(metrics):
        stamp = StampReport(
            proto=_metric_float(metrics, "stamp-proto"),
            old_tasks=_metric_int(metrics, "stamp-old-tasks"),
            coreset=_metric_int(metrics, "stamp-coreset"),
        )
    return TrainRes(
        *base, model=content.array_records[MODEL], loss=_metric_float(metrics, "train-loss", 0.0), lga=lga, stamp=stamp
    )


def _flag(metrics: MetricRecord, key: str) -> bool:
    flag = _metric_int(metrics, key)
    if flag not in (0, 1):
        raise ProtocolError(f"metric '{key}' is {flag}, expected 0 or 1")
    return bool(flag)


def _parse_stats(content: RecordDict, metrics: MetricRecord, base: _Base) -> StatsRes:
    _only(content.config_records, {HEADER}, "config records")
    if MODEL not in content.array_records:
        raise ProtocolError(f"reply has no '{MODEL}' record")
    backfill: dict[int, Backfill] = {}
    for name, record in content.array_records.items():
        if name == MODEL:
            continue
        task_text = name.removeprefix(BACKFILL_PREFIX)
        if not name.startswith(BACKFILL_PREFIX) or not task_text.isdigit():
            raise ProtocolError(f"unexpected array record '{name}'")
        backfill[int(task_text)] = Backfill(record, _metric_int(metrics, f"{name}-num-examples"))
    allowed = {"partition-id", "num-examples", "withheld-samples"} | _FEDRAN_METRICS
    allowed |= {f"{BACKFILL_PREFIX}{task}-num-examples" for task in backfill}
    _only(metrics, allowed, "metrics")
    fedran = None
    if _FEDRAN_METRICS & set(metrics):
        fedran = FedranReport(
            *(
                _metric_int(metrics, key)
                for key in ("num-labelled", "pseudo-unlabelled", "pseudo-accepted", "pseudo-correct")
            )
        )
    return StatsRes(
        *base,
        arrays=content.array_records[MODEL],
        withheld=_metric_int(metrics, "withheld-samples", 0),
        backfill=dict(sorted(backfill.items())),
        fedran=fedran,
    )
