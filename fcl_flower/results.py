"""results.json, results.csv, results.png, the per-stage table, and upload-byte accounting.

results.json and results.csv are rewritten atomically when the run starts and after every stage,
so a run killed half-way still leaves a valid, complete record of the stages it finished.
results.json says how the run went: ``status`` is ``running``, ``completed``, ``failed`` (with
``error``, one line) or ``interrupted`` (Ctrl-C; the checkpoint of the last finished stage stays). results.png is drawn when the run ends. Trackers (fcl_flower/tracking.py)
get the same records; a tracker that fails is dropped with a warning, never the run.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fcl_flower.metrics import CILSummary, summarise, summarise_clients
from fcl_flower.report import plot_run, write_csv
from fcl_flower.tracking import Tracker

LOG = logging.getLogger("flwr")


@dataclass
class StageRecord:
    """What one stage (task) produced."""

    stage: int  # 1-based
    classes: list[int]  # labels (class-order positions) introduced by this stage
    accuracy: float  # A_t over all seen classes, percent
    per_task_accuracy: list[float]  # A_{t,tau}, tau = 1..t
    seconds: float  # wall time of the stage: client work, aggregation, solve, evaluation
    rounds: int  # federated rounds run in this stage
    upload_bytes_per_client: dict[str, int]  # numeric payload each client sent (all rounds)
    upload_message_bytes_per_client: dict[str, int]  # whole serialised reply messages
    clients: list[str] = field(default_factory=list)  # clients whose data is in this stage
    left_out: dict[str, str] = field(default_factory=dict)  # client -> why it is missing
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific (ridge, pseudo-labels...)


class ResultsRecorder:
    """Collects StageRecords and writes ``<output_dir>/results.json`` (and .csv) after each stage."""

    def __init__(
        self,
        output_dir: Path,
        strategy: str,
        config: dict[str, Any],
        *,
        num_tasks: int | None = None,
        trackers: Sequence[Tracker] = (),
    ) -> None:
        self.output_dir = Path(output_dir)
        self.strategy = strategy
        self.config = dict(config)
        self.num_tasks = int(num_tasks if num_tasks is not None else config.get("num-tasks", 0))
        self.stages: list[StageRecord] = []
        self.rounds: list[dict[str, float]] = []  # every round this server process ran: seconds, replies...
        self.info: dict[str, Any] = {}
        self.trackers = list(trackers)

    @property
    def path(self) -> Path:
        return self.output_dir / "results.json"

    # ---------------------------------------------------------------- the run's life
    def start(self) -> None:
        """The run begins: results.json says ``running`` (and the folder is this config's)."""
        self.info.update({"status": "running"})
        self.info.pop("error", None)
        self.write()
        self._track(lambda t: t.start(self.config))

    def round(self, step: int, metrics: Mapping[str, float]) -> None:
        self.rounds.append({"round": step, **{k: float(v) for k, v in metrics.items()}})
        self._track(lambda t: t.round(step, metrics))

    def add(self, record: StageRecord) -> None:
        self.stages.append(record)
        self.write()
        metrics = {
            "accuracy": record.accuracy,
            **{f"task_{k + 1}": a for k, a in enumerate(record.per_task_accuracy)},
            "seconds": record.seconds,
            "upload_bytes_mean_per_client": _mean(record.upload_bytes_per_client),
            "left_out": float(len(record.left_out)),
        }
        self._track(lambda t: t.stage(record.stage, metrics))

    def finish(self, error: str = "", *, interrupted: bool = False) -> Path | None:
        """The run ended: ``completed``, ``failed`` with ``error``, or ``interrupted``; draws
        results.png. A run that failed before :meth:`start` (e.g. a checkpoint it may not resume)
        leaves the folder as it was."""
        if "status" not in self.info:
            return None
        self.info["status"] = "interrupted" if interrupted else "failed" if error else "completed"
        if error and not interrupted:
            self.info["error"] = error
        path = self.write()
        try:
            plot_run(self.output_dir / "results.png", self.stages, f"{self.strategy}: {self.output_dir.name}")
        except Exception as err:  # a plot must never turn a finished run into a failed one
            LOG.warning("results.png not drawn: %s", err)
        data = self.to_dict()
        summary: dict[str, float] = {k: float(data[k]) for k in ("A_avg", "A_T", "F_T", "total_seconds") if k in data}
        self._track(lambda t: t.finish(summary, self.info["status"]))
        return path

    def _track(self, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as err:
                LOG.warning("tracking: %s failed (%s); it is switched off for this run", type(tracker).__name__, err)
                self.trackers.remove(tracker)

    # ---------------------------------------------------------------- files
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "strategy": self.strategy,
            "config": self.config,
            "stages": [asdict(s) for s in self.stages],
            "rounds": self.rounds,
            **self.info,
        }
        if self.stages:
            summary, per_client = run_summary(self.stages)
            data.update(asdict(summary))
            if per_client:
                data["per_client"] = {c: asdict(m) for c, m in per_client.items()}
            data["total_seconds"] = sum(s.seconds for s in self.stages)
            data["total_upload_bytes_per_client"] = total_upload(self.stages)
        return data

    def write(self) -> Path:
        write_json_atomic(self.path, self.to_dict())
        write_csv(self.output_dir / "results.csv", self.stages, self.num_tasks)
        return self.path

    def table(self) -> str:
        return format_stage_table(self.stages)


def _mean(per_client: Mapping[str, int]) -> float:
    return sum(per_client.values()) / len(per_client) if per_client else 0.0


def run_summary(stages: list[StageRecord]) -> tuple[CILSummary, dict[str, CILSummary]]:
    """A_avg, A_T, F_T of a run, and per client where the stages score clients separately.

    Under STAMP's task pool every stage carries ``extra["per_client"]`` (client -> its accuracy
    on each of its own tasks so far); the run's numbers are then the means over clients of each
    client's own (:func:`fcl_flower.metrics.summarise_clients`). Otherwise: the shared stream's.
    """
    if stages and all("per_client" in s.extra for s in stages):
        clients = sorted(stages[0].extra["per_client"])
        mean, each = summarise_clients([[s.extra["per_client"][c] for s in stages] for c in clients])
        return mean, dict(zip(clients, each))
    return summarise([s.accuracy for s in stages], [s.per_task_accuracy for s in stages]), {}


def total_upload(stages: list[StageRecord]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for stage in stages:
        for client, nbytes in stage.upload_bytes_per_client.items():
            totals[client] = totals.get(client, 0) + nbytes
    return dict(sorted(totals.items()))


def format_stage_table(stages: list[StageRecord]) -> str:
    """A plain-text table: one line per stage, then the summary metrics. Under differential privacy
    two more columns: the ε of the stage's releases and the ε spent so far (worst client)."""
    private = any("privacy" in s.extra for s in stages)
    header = (
        f"{'stage':>5} {'classes':>7} {'acc %':>7} {'per-task acc %':<34} {'rounds':>6} {'s':>8} {'upload/client':>14}"
    )
    if private:
        header += f" {'ε stage':>8} {'ε spent':>8}"
    lines = [header, "-" * len(header)]
    for s in stages:
        per_task = " ".join(f"{a:5.1f}" for a in s.per_task_accuracy)
        uploads = list(s.upload_bytes_per_client.values())
        mean_upload = human_bytes(sum(uploads) / len(uploads)) if uploads else "-"
        line = (
            f"{s.stage:>5} {len(s.classes):>7} {s.accuracy:>7.2f} {per_task[:34]:<34} "
            f"{s.rounds:>6} {s.seconds:>8.2f} {mean_upload:>14}"
        )
        if private:
            dp = s.extra.get("privacy", {})
            line += f" {_epsilon(dp.get('epsilon_stage')):>8} {_epsilon(dp.get('epsilon_spent')):>8}"
        lines.append(line)
    if stages:
        m, _ = run_summary(stages)
        summary = f"A_avg = {m.A_avg:.2f}   A_T = {m.A_T:.2f}   F_T = {m.F_T:.2f}"
        if private:
            last = stages[-1].extra.get("privacy", {})
            summary += f"   (ε, δ) = ({_epsilon(last.get('epsilon_spent'))}, {last.get('delta', '-')})"
        lines.append(summary)
    return "\n".join(lines)


def _epsilon(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "-"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def mark_interrupted(path: Path, *, over_failed: bool = False) -> int | None:
    """Set ``"status": "interrupted"`` in the results.json at ``path`` if it still says ``running``
    (a run stopped before its ServerApp could say so itself), or ``failed`` with ``over_failed`` (a
    ServerApp that the stop ended with an error); returns the number of stages it holds, None if
    there is no readable results file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if data.get("status") == "running" or (over_failed and data.get("status") == "failed"):
        data["status"] = "interrupted"
        data.pop("error", None)
        write_json_atomic(path, data)
    stages = data.get("stages")
    return len(stages) if isinstance(stages, list) else 0


def write_json_atomic(path: Path, data: Any) -> None:
    """Write to a temp file in the same folder, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, default=_json_default)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")
