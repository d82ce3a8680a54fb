"""What every message shares: the record names, the header, the instruction and reply bases, and
the checked readers of the scalars inside records (a one-line ProtocolError on anything else)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, NamedTuple

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.typing import ConfigRecordValues, MetricRecordValues

from fcl_flower.config import RunConfig
from fcl_flower.methods import Kind
from fcl_flower.protocol.errors import ProtocolError

# Record names (the only place they are spelled out).
HEADER, CONFIG, ROUND, MODEL, METRICS, SECAGG = "header", "config", "round", "arrays", "metrics", "secagg"
TEACHER, EWC_FISHER, EWC_ANCHOR, OLD_MODEL = "teacher", "ewc-fisher", "ewc-anchor", "lga-old-model"
LGA_PROTO = "lga-proto"
SYNTHETIC, ANCHORS = "synthetic-images", "lander-anchors"  # TARGET/LANDER (train instructions)
RIDGE, COUNTS = "ridge", "counts"  # evaluate: the analytic classifier W; per-class correct / total
BACKFILL_PREFIX = "backfill-"  # reply record "backfill-<task>", metric "backfill-<task>-num-examples"


# ------------------------------------------------------------------------------------ scalars
def read_int(value: Any, what: str, *, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        if minimum is None:
            expected = "an integer"
        elif minimum == 0:
            expected = "a non-negative integer"
        else:
            expected = f"an integer >= {minimum}"
        raise ProtocolError(f"{what} is {value!r}, expected {expected}")
    return value


def read_float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"{what} is {value!r}, expected a finite number")
    return float(value)


def read_str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{what} is {value!r}, expected a non-empty string")
    return value


def read_bytes(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes):
        raise ProtocolError(f"{what} is {type(value).__name__}, expected bytes")
    return value


def entry(record: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in record:
        raise ProtocolError(f"'{where}' record lacks '{key}'")
    return record[key]


def only(names: Any, allowed: set[str], where: str) -> None:
    unknown = sorted(set(names) - allowed)
    if unknown:
        raise ProtocolError(f"unexpected {where}: {', '.join(unknown)}")


def metric_int(metrics: MetricRecord, key: str, default: int | None = None) -> int:
    if key not in metrics and default is not None:
        return default
    return read_int(entry(metrics, key, METRICS), f"metric '{key}'")


def metric_float(metrics: MetricRecord, key: str, default: float | None = None) -> float:
    if key not in metrics and default is not None:
        return default
    return read_float(entry(metrics, key, METRICS), f"metric '{key}'")


def metric_flag(metrics: MetricRecord, key: str) -> bool:
    flag = metric_int(metrics, key)
    if flag not in (0, 1):
        raise ProtocolError(f"metric '{key}' is {flag}, expected 0 or 1")
    return bool(flag)


def read_list(record: Mapping[str, Any], key: str, where: str, kind: type, length: int | None = None) -> list[Any]:
    """A list entry whose items are all of ``kind`` (and ``length`` of them, if given)."""
    values = entry(record, key, where)
    if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, kind) for v in values):
        raise ProtocolError(f"'{where}' entry '{key}' is not a list of {kind.__name__}")
    if length is not None and len(values) != length:
        raise ProtocolError(f"'{where}' entry '{key}' has {len(values)} items, expected {length}")
    return values


def node_map(record: Mapping[str, Any], keys_name: str, values_name: str, where: str, kind: type) -> dict[int, Any]:
    """{node: value} from two parallel list entries (a ConfigRecord carries no dicts)."""
    nodes = read_list(record, keys_name, where, int)
    values = read_list(record, values_name, where, kind, len(nodes))
    if len(set(nodes)) != len(nodes):
        raise ProtocolError(f"'{where}' entry '{keys_name}' lists a node twice")
    return dict(zip(nodes, values, strict=True))


def node_map_entries(values: Mapping[int, Any], keys_name: str, values_name: str) -> dict[str, ConfigRecordValues]:
    nodes = sorted(values)
    out: dict[str, ConfigRecordValues] = {keys_name: nodes, values_name: [values[n] for n in nodes]}
    return out


# ------------------------------------------------------------------------------------ header
@dataclass(frozen=True)
class Header:
    """Which round of which run a message belongs to."""

    run_id: str
    phase: str
    task: int  # 0-based task index
    stage: int  # 1-based stage number (the stage of results.json)
    server_round: int  # 1-based round number over the whole run
    attempt: int = 0  # 0 for the first send of a round; retries count up

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
        only(record, {"run-id", "phase", "task", "stage", "round", "attempt"}, "header entries")
        return cls(
            run_id=read_str(entry(record, "run-id", HEADER), "header run-id"),
            phase=read_str(entry(record, "phase", HEADER), "header phase"),
            task=read_int(entry(record, "task", HEADER), "header task"),
            stage=read_int(entry(record, "stage", HEADER), "header stage", minimum=1),
            server_round=read_int(entry(record, "round", HEADER), "header round", minimum=0),
            attempt=read_int(entry(record, "attempt", HEADER), "header attempt"),
        )

    def require(self, reply: Header) -> None:
        """Raise ProtocolError unless ``reply`` (a reply's header) answers this header."""
        for f in fields(self):
            sent, got = getattr(self, f.name), getattr(reply, f.name)
            if sent != got:
                raise ProtocolError(f"reply is for {f.name.replace('_', ' ')} {got!r}, this round is {sent!r}")


# ------------------------------------------------------------------------------------ bases
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
                CONFIG: ConfigRecord(dict[str, ConfigRecordValues](self.config.client_mapping())),
            }
        )
        self._fill(content)
        return content

    def _fill(self, content: RecordDict) -> None:
        """Subclasses add their records."""

    def to_message(self, dst_node_id: int) -> Message:
        return Message(content=self.to_record(), message_type=str(self.kind), dst_node_id=dst_node_id)


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


class ReplyBase(NamedTuple):
    """The fields every reply has, in the order of :class:`Reply`'s."""

    header: Header
    client: int
    num_examples: int


def config_record(entries: Mapping[str, ConfigRecordValues]) -> ConfigRecord:
    return ConfigRecord(dict(entries))
