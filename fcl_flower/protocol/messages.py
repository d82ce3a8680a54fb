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
                                  secure round's participants, the previous stage's
                                  :class:`EvaluationRequest` where its evaluation rides along
:class:`InfoIns`   ``query.info`` "which client do you serve?"
:class:`EvaluateIns` ``evaluate`` the global model (and, for an analytic method, its ridge
                                  classifier W): score it on your held-out data of the seen classes
=================  =============  ==============================================================

Client -> server: :class:`TrainRes` (trainable state, loss, LGA/STAMP reports),
:class:`StatsRes` (the method's statistics, late statistics it owes, withheld-sample count,
FedRAN's pseudo-label counts, a riding evaluation's counts), :class:`InfoRes` and :class:`EvaluateRes` (per seen class: correct
predictions and test samples). Each reply names the client (partition) it
speaks for and how many examples it used. The arrays of a statistics reply are typed by
:mod:`fcl_flower.protocol.payloads`, whose shapes the server checks against its own state. The
messages of a secure statistics round are in :mod:`fcl_flower.protocol.secure`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.typing import MetricRecordValues

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.methods import Kind
from fcl_flower.protocol.base import (
    ANCHORS,
    BACKFILL_PREFIX,
    CONFIG,
    COUNTS,
    EWC_ANCHOR,
    EWC_FISHER,
    HEADER,
    LGA_PROTO,
    METRICS,
    MODEL,
    OLD_MODEL,
    RIDGE,
    ROUND,
    SECAGG,
    SYNTHETIC,
    TEACHER,
    Header,
    Instruction,
    Reply,
    ReplyBase,
    entry,
    metric_flag,
    metric_float,
    metric_int,
    only,
    read_float,
    read_int,
    read_str,
)
from fcl_flower.protocol.errors import ProtocolError
from fcl_flower.protocol.secure import (
    MaskedReport,
    SecAggRound,
    parse_secure_instruction,
    parse_secure_reply,
)

__all__ = [
    "ANCHORS",
    "BACKFILL_PREFIX",
    "EWC_ANCHOR",
    "EWC_FISHER",
    "HEADER",
    "LGA_PROTO",
    "OLD_MODEL",
    "SYNTHETIC",
    "TEACHER",
    "Header",
]


# ------------------------------------------------------------------------------------ server -> client
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
    secagg: SecAggRound | None = None  # set (stage-1 FedAvg under secure aggregation): upload masked

    OPTIONAL: ClassVar[dict[str, str]] = {
        TEACHER: "teacher",
        EWC_FISHER: "ewc_fisher",
        EWC_ANCHOR: "ewc_anchor",
        OLD_MODEL: "old_model",
        SYNTHETIC: "synthetic",
        ANCHORS: "anchors",
    }

    def _fill(self, content: RecordDict) -> None:
        entries: dict[str, Any] = {"lr": self.lr, "num-seen": self.num_seen}
        if self.secagg is not None:
            entries.update(self.secagg.entries())
        content[ROUND] = ConfigRecord(entries)
        content[MODEL] = self.model
        for name, attribute in self.OPTIONAL.items():
            record = getattr(self, attribute)
            if record is not None:
                content[name] = record


@dataclass(frozen=True)
class EvaluationRequest:
    """The federated evaluation of an earlier stage, riding with a statistics round's instruction
    (strategies/evaluation.py): score the instruction's model, with ridge classifier ``ridge``, on
    this client's held-out data of the ``num_seen`` classes seen after task ``task``. The reply
    carries the counts beside its statistics (:class:`StatsRes` ``evaluation``)."""

    task: int
    num_seen: int
    ridge: ArrayRecord | None = None  # {"weights": W (M x num_seen)}; None: no classifier yet

    def instruction(self, ins: StatsIns) -> EvaluateIns:
        """The evaluation as the instruction of its own exchange would carry it (same model)."""
        header = Header(ins.header.run_id, "evaluate", self.task, self.task + 1, ins.header.server_round, 0)
        return EvaluateIns(header, ins.config, num_seen=self.num_seen, model=ins.model, ridge=self.ridge)


@dataclass(frozen=True)
class StatsIns(Instruction):
    """A statistics round: one pass over the local data of the task with the global (frozen) model."""

    kind: ClassVar[Kind] = Kind.STATS
    num_seen: int = 0
    model: ArrayRecord = field(default_factory=ArrayRecord)
    backfill: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # client -> earlier tasks it owes
    rank: int = 0  # FedRAN: the upload rank r (0: not a FedRAN round)
    secagg: SecAggRound | None = None  # set: upload masked for these participants
    forget: tuple[int, ...] = ()  # a forget round (phase stsa-forget): the sites the server removes wholly
    evaluate: EvaluationRequest | None = None  # the previous stage's evaluation, riding with these statistics

    def _fill(self, content: RecordDict) -> None:
        entries: dict[str, Any] = {
            "num-seen": self.num_seen,
            "rank": self.rank,
            "backfill": encode_backfill(self.backfill),
        }
        if self.forget:  # only in a forget round: a statistics round's instruction is as before
            entries["forget"] = ",".join(str(site) for site in self.forget)
        if self.evaluate is not None:  # only where an evaluation rides along
            entries["evaluate-task"] = self.evaluate.task
            entries["evaluate-num-seen"] = self.evaluate.num_seen
            if self.evaluate.ridge is not None:
                content[RIDGE] = self.evaluate.ridge
        if self.secagg is not None:
            entries.update(self.secagg.entries())
        content[ROUND] = ConfigRecord(entries)
        content[MODEL] = self.model

    def owed_by(self, client: int) -> tuple[int, ...]:
        return tuple(self.backfill.get(client, ()))

    def owed_by_anyone(self) -> tuple[int, ...]:
        return tuple(sorted({t for tasks in self.backfill.values() for t in tasks}))


@dataclass(frozen=True)
class InfoIns(Instruction):
    """Which client (partition) does this node serve? (the server samples clients per round)."""

    kind: ClassVar[Kind] = Kind.INFO


@dataclass(frozen=True)
class EvaluateIns(Instruction):
    """Federated evaluation: score the global model on this client's held-out data of every class
    seen after the header's task (``num_seen`` classes)."""

    kind: ClassVar[Kind] = Kind.EVALUATE
    num_seen: int = 0
    model: ArrayRecord = field(default_factory=ArrayRecord)
    ridge: ArrayRecord | None = None  # analytic methods: {"weights": W (M x num_seen)}

    def _fill(self, content: RecordDict) -> None:
        content[ROUND] = ConfigRecord({"num-seen": self.num_seen})
        content[MODEL] = self.model
        if self.ridge is not None:
            content[RIDGE] = self.ridge


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
    check_client_config(config)
    round_ = content.config_records.get(ROUND)
    if kind is Kind.INFO:
        return InfoIns(header, config)
    if kind in (Kind.KEYS, Kind.SHARES, Kind.UNMASK):
        return parse_secure_instruction(kind, InfoIns(header, config), round_)
    if round_ is None:
        raise ProtocolError(f"message has no '{ROUND}' record")
    model = content.array_records.get(MODEL, ArrayRecord())
    num_seen = read_int(entry(round_, "num-seen", ROUND), "num-seen", minimum=1)
    if kind is Kind.EVALUATE:
        return EvaluateIns(header, config, num_seen=num_seen, model=model, ridge=content.array_records.get(RIDGE))
    if kind is Kind.TRAIN:
        optional = {attribute: content.array_records.get(name) for name, attribute in TrainIns.OPTIONAL.items()}
        lr = read_float(entry(round_, "lr", ROUND), "lr")
        secagg = SecAggRound.from_entries(round_, header) if "secagg-round-nodes" in round_ else None
        return TrainIns(header, config, lr=lr, num_seen=num_seen, model=model, secagg=secagg, **optional)
    return StatsIns(
        header,
        config,
        num_seen=num_seen,
        model=model,
        backfill=decode_backfill(read_str(entry(round_, "backfill", ROUND) or "-", "backfill")),
        rank=read_int(entry(round_, "rank", ROUND), "rank"),
        secagg=SecAggRound.from_entries(round_, header) if "secagg-round-nodes" in round_ else None,
        forget=_decode_sites(read_str(round_["forget"], "forget")) if "forget" in round_ else (),
        evaluate=_evaluation_request(round_, content.array_records.get(RIDGE), header),
    )


def _evaluation_request(round_: ConfigRecord, ridge: ArrayRecord | None, header: Header) -> EvaluationRequest | None:
    """The evaluation riding with a statistics instruction, if any; ProtocolError if malformed."""
    if "evaluate-task" not in round_:
        if ridge is not None:
            raise ProtocolError(f"a '{RIDGE}' record without an evaluation request")
        return None
    task = read_int(round_["evaluate-task"], "evaluate-task")
    if task >= header.task:
        raise ProtocolError(f"evaluate-task {task} is not a stage before this one (task {header.task})")
    num_seen = read_int(entry(round_, "evaluate-num-seen", ROUND), "evaluate-num-seen", minimum=1)
    return EvaluationRequest(task, num_seen, ridge)


def _decode_sites(text: str) -> tuple[int, ...]:
    """``"1,3"`` -> (1, 3): the sites a forget round removes wholly; ProtocolError if malformed."""
    parts = text.split(",")
    if not text or not all(p.isdigit() for p in parts):
        raise ProtocolError(f"forget: '{text[:40]}' is not a list of client ids")
    return tuple(int(p) for p in parts)


def check_client_config(config: RunConfig) -> None:
    """What a client refuses in a server's run config before it acts on it: a file path it would
    open (``task-plan``: the plan travels as its text, ``task-plan-content``, checked here), with
    one line that is the same whatever the path (no file-existence oracle)."""
    if config.task_plan:
        raise ProtocolError(
            "run config: task-plan names a file on this client; a client opens no file the server names "
            "(the server sends the plan's text as task-plan-content)"
        )
    if config.task_plan_content:
        from fcl_flower.data.errors import DatasetError
        from fcl_flower.data.plan import read_plan_text

        try:
            read_plan_text(config.task_plan_content)
        except DatasetError as err:
            raise ProtocolError(f"run config: {err}") from None


def encode_backfill(owed: Mapping[int, tuple[int, ...] | list[int]]) -> str:
    """{client: [task, ...]} -> "0:1,3;2:1" (a ConfigRecord carries scalars, not dicts)."""
    return ";".join(f"{c}:{','.join(str(t) for t in sorted(tasks))}" for c, tasks in sorted(owed.items()) if tasks)


def decode_backfill(text: str) -> dict[int, tuple[int, ...]]:
    """Inverse of :func:`encode_backfill` ("-" or "" is empty); ProtocolError on anything else."""
    owed: dict[int, tuple[int, ...]] = {}
    for item in filter(None, text.strip().strip("-").split(";")):
        try:
            client, tasks = item.split(":")
            owed[int(client)] = tuple(sorted(int(t) for t in tasks.split(",")))
        except ValueError:
            raise ProtocolError(f"cannot read backfill entry '{item}' (expected client:task,task)") from None
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
class TrainRes(Reply):
    kind: ClassVar[Kind] = Kind.TRAIN
    model: ArrayRecord = field(default_factory=ArrayRecord)
    loss: float = 0.0
    lga: LGAReport | None = None
    stamp: StampReport | None = None
    secagg: MaskedReport | None = None  # a masked upload's view signature and accusations (stage 1, secure)
    # wall seconds of the local epochs alone, by the client's own clock (a benchmark's figure, never
    # used in aggregation); None: not reported, or reported as something else (``train_seconds_ignored``)
    train_seconds: float | None = None
    train_seconds_ignored: str = ""  # why a reported ``train-seconds`` was ignored (the server says so)

    def metrics(self) -> dict[str, MetricRecordValues]:
        out: dict[str, MetricRecordValues] = {**super().metrics(), "train-loss": self.loss}
        if self.train_seconds is not None:
            out[TRAIN_SECONDS] = float(self.train_seconds)
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
        if self.secagg is not None:
            content[SECAGG] = ConfigRecord(self.secagg.entries())


@dataclass(frozen=True)
class StatsRes(Reply):
    kind: ClassVar[Kind] = Kind.STATS
    arrays: ArrayRecord = field(default_factory=ArrayRecord)
    withheld: int = 0  # samples left out under min-class-count (this and every backfilled task)
    backfill: Mapping[int, Backfill] = field(default_factory=dict)  # task -> late statistics
    fedran: FedranReport | None = None
    secagg: MaskedReport | None = None  # a masked upload's view signature and accusations
    evaluation: EvaluateRes | None = None  # the counts of an evaluation that rode with the instruction

    def metrics(self) -> dict[str, MetricRecordValues]:
        out: dict[str, MetricRecordValues] = {**super().metrics(), "withheld-samples": self.withheld}
        if self.evaluation is not None:
            out["evaluate-num-examples"] = self.evaluation.num_examples
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
        if self.evaluation is not None:
            content[COUNTS] = self.evaluation.counts
        if self.secagg is not None:
            content[SECAGG] = ConfigRecord(self.secagg.entries())


@dataclass(frozen=True)
class InfoRes(Reply):
    kind: ClassVar[Kind] = Kind.INFO


@dataclass(frozen=True)
class EvaluateRes(Reply):
    """Per seen class: how many of this client's held-out samples the model got right, and how
    many there were (record ``counts``: int64 arrays ``correct`` and ``total``)."""

    kind: ClassVar[Kind] = Kind.EVALUATE
    counts: ArrayRecord = field(default_factory=ArrayRecord)

    def _fill(self, content: RecordDict) -> None:
        content[COUNTS] = self.counts


TRAIN_SECONDS = "train-seconds"  # a train reply's local-training wall time (TrainRes.train_seconds)
_LGA_METRICS = {"lga-cb", "lga-sd", "lga-detected", "lga-new-task", "lga-memory", "lga-proto-classes"}
_STAMP_METRICS = {"stamp-proto", "stamp-old-tasks", "stamp-coreset"}
_FEDRAN_METRICS = {"num-labelled", "pseudo-unlabelled", "pseudo-accepted", "pseudo-correct"}


def parse_reply(message: Message, sent: Header, kind: Kind) -> Reply:
    """The typed reply of a ``kind`` round whose instruction carried ``sent``.

    Raises ProtocolError (one line) for anything that does not fit: an error reply, a reply to
    another run/task/stage/round/attempt, missing or unexpected records (metric, array or config
    records other than the kind's own: refused by name) and metrics, wrong types.
    Array *contents* are checked by the strategy (:mod:`fcl_flower.protocol.payloads`).
    """
    if message.has_error():
        raise ProtocolError(f"client failed: {message.error.reason}")
    content = message.content
    sent.require(Header.from_record(content.config_records.get(HEADER)))
    only(content.metric_records, {METRICS}, "metric records")
    metrics = content.metric_records.get(METRICS)
    if metrics is None:
        raise ProtocolError(f"reply has no '{METRICS}' record")
    client = read_int(entry(metrics, "partition-id", METRICS), "partition-id")
    return _parse_body(content, metrics, kind, sent, client)


def _parse_body(content: RecordDict, metrics: MetricRecord, kind: Kind, sent: Header, client: int) -> Reply:
    base = ReplyBase(sent, client, metric_int(metrics, "num-examples"))
    if kind is Kind.TRAIN:
        return _parse_train(content, metrics, base)
    if kind is Kind.STATS:
        return _parse_stats(content, metrics, base)
    only(metrics, {"partition-id", "num-examples"}, "metrics")
    if kind is Kind.EVALUATE:
        only(content.array_records, {COUNTS}, "array records")
        only(content.config_records, {HEADER}, "config records")
        if COUNTS not in content.array_records:
            raise ProtocolError(f"reply has no '{COUNTS}' record")
        return EvaluateRes(*base, counts=content.array_records[COUNTS])
    if kind is Kind.INFO:
        only(content.array_records, set(), "array records")
        only(content.config_records, {HEADER}, "config records")
        return InfoRes(*base)
    return parse_secure_reply(kind, content, base)


def _parse_train(content: RecordDict, metrics: MetricRecord, base: ReplyBase) -> TrainRes:
    only(content.config_records, {HEADER, SECAGG}, "config records")
    report = content.config_records.get(SECAGG)
    only(content.array_records, {MODEL, LGA_PROTO}, "array records")
    only(
        metrics,
        {"partition-id", "num-examples", "train-loss", TRAIN_SECONDS} | _LGA_METRICS | _STAMP_METRICS,
        "metrics",
    )
    if MODEL not in content.array_records:
        raise ProtocolError(f"reply has no '{MODEL}' record")
    lga = stamp = None
    if _LGA_METRICS & set(metrics):
        lga = LGAReport(
            cb=metric_float(metrics, "lga-cb"),
            sd=metric_float(metrics, "lga-sd"),
            detected=metric_flag(metrics, "lga-detected"),
            new_task=metric_flag(metrics, "lga-new-task"),
            memory=metric_int(metrics, "lga-memory"),
            proto_classes=metric_int(metrics, "lga-proto-classes"),
            prototypes=content.array_records.get(LGA_PROTO),
        )
    elif LGA_PROTO in content.array_records:
        raise ProtocolError(f"'{LGA_PROTO}' record without the LGA metrics")
    if _STAMP_METRICS & set(metrics):
        stamp = StampReport(
            proto=metric_float(metrics, "stamp-proto"),
            old_tasks=metric_int(metrics, "stamp-old-tasks"),
            coreset=metric_int(metrics, "stamp-coreset"),
        )
    return TrainRes(
        *base,
        model=content.array_records[MODEL],
        loss=metric_float(metrics, "train-loss", 0.0),
        lga=lga,
        stamp=stamp,
        secagg=None if report is None else MaskedReport.from_entries(report),
        **_train_seconds(metrics),
    )


def _train_seconds(metrics: MetricRecord) -> dict[str, Any]:
    """``train-seconds`` as TrainRes's fields: a non-negative finite number is kept; anything else
    is ignored with the reason (a timing is only a benchmark's figure: it never rejects a reply)."""
    if TRAIN_SECONDS not in metrics:
        return {}
    value = metrics[TRAIN_SECONDS]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return {"train_seconds": float(value)}
    shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)[:40]
    return {"train_seconds_ignored": f"metric '{TRAIN_SECONDS}' is {shown}, not a non-negative finite number"}


def _parse_stats(content: RecordDict, metrics: MetricRecord, base: ReplyBase) -> StatsRes:
    only(content.config_records, {HEADER, SECAGG}, "config records")
    report = content.config_records.get(SECAGG)
    if MODEL not in content.array_records:
        raise ProtocolError(f"reply has no '{MODEL}' record")
    backfill: dict[int, Backfill] = {}
    for name, record in content.array_records.items():
        if name in (MODEL, COUNTS):
            continue
        task_text = name.removeprefix(BACKFILL_PREFIX)
        if not name.startswith(BACKFILL_PREFIX) or not task_text.isdigit():
            raise ProtocolError(f"unexpected array record '{name}'")
        backfill[int(task_text)] = Backfill(record, metric_int(metrics, f"{name}-num-examples"))
    allowed = {"partition-id", "num-examples", "withheld-samples"} | _FEDRAN_METRICS
    allowed |= {f"{BACKFILL_PREFIX}{task}-num-examples" for task in backfill}
    evaluation = None
    if COUNTS in content.array_records:  # an evaluation rode along; the server checks it was asked for
        allowed.add("evaluate-num-examples")
        evaluation = EvaluateRes(
            base.header,
            base.client,
            metric_int(metrics, "evaluate-num-examples"),
            counts=content.array_records[COUNTS],
        )
    only(metrics, allowed, "metrics")
    fedran = None
    if _FEDRAN_METRICS & set(metrics):
        fedran = FedranReport(
            *(
                metric_int(metrics, key)
                for key in ("num-labelled", "pseudo-unlabelled", "pseudo-accepted", "pseudo-correct")
            )
        )
    return StatsRes(
        *base,
        arrays=content.array_records[MODEL],
        withheld=metric_int(metrics, "withheld-samples", 0),
        backfill=dict(sorted(backfill.items())),
        fedran=fedran,
        secagg=None if report is None else MaskedReport.from_entries(report),
        evaluation=evaluation,
    )
