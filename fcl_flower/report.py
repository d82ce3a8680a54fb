"""A single run's report next to its results.json: results.csv (one row per stage) and results.png
(accuracy per stage, and upload per client per stage).

The CSV is rewritten atomically after every stage with results.json; the plot is drawn when the
run ends (completed or failed), from the same stage records.
"""

from __future__ import annotations

import csv
import io
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fcl_flower.results import StageRecord

MIB = 2**20


def stage_rows(stages: Sequence[StageRecord], num_tasks: int) -> list[dict[str, Any]]:
    """One flat row per stage: accuracy, A_{t,tau} per task, rounds, seconds, bytes, clients, failure;
    under differential privacy also the ε of the stage and the ε spent so far (extra.privacy)."""
    rows = []
    seen = 0
    for s in stages:
        seen += len(s.classes)
        uploads = list(s.upload_bytes_per_client.values())
        row: dict[str, Any] = {
            "stage": s.stage,
            "new_classes": len(s.classes),
            "seen_classes": seen,
            "accuracy": round(s.accuracy, 4),
        }
        for tau in range(num_tasks):
            row[f"task_{tau + 1}"] = round(s.per_task_accuracy[tau], 4) if tau < len(s.per_task_accuracy) else ""
        row.update(
            {
                "rounds": s.rounds,
                "seconds": round(s.seconds, 3),
                "upload_bytes_mean_per_client": round(sum(uploads) / len(uploads)) if uploads else 0,
                "upload_bytes_total": sum(uploads),
                "clients": len(s.clients),
                "left_out": len(s.left_out),
                "failed": s.extra.get("failed", ""),
            }
        )
        if any("privacy" in t.extra for t in stages):  # differential privacy: the ε of each stage and spent so far
            privacy = s.extra.get("privacy", {})
            row["epsilon_stage"] = privacy.get("epsilon_stage", "")
            row["epsilon_spent"] = privacy.get("epsilon_spent", "")
        rows.append(row)
    return rows


def write_csv(path: Path, stages: Sequence[StageRecord], num_tasks: int) -> Path:
    """results.csv, written atomically (a reader never sees half a file)."""
    rows = stage_rows(stages, num_tasks)
    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    _write_atomic(Path(path), buffer.getvalue())
    return Path(path)


def plot_run(path: Path, stages: Sequence[StageRecord], title: str) -> Path | None:
    """results.png: A_t (and each task's accuracy) per stage; mean upload per client per stage.
    Returns None when there is nothing to draw."""
    if not stages:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s.stage for s in stages]
    fig, (acc, comm) = plt.subplots(1, 2, figsize=(10, 3.8))
    for tau in range(len(stages[-1].per_task_accuracy)):
        points = [(s.stage, s.per_task_accuracy[tau]) for s in stages if tau < len(s.per_task_accuracy)]
        acc.plot(*zip(*points, strict=True), color="0.75", linewidth=0.8)
    acc.plot(x, [s.accuracy for s in stages], marker="o", color="C0", label="A_t (all seen classes)")
    acc.plot([], [], color="0.75", linewidth=0.8, label="each task")
    acc.set(xlabel="stage", ylabel="accuracy (%)", ylim=(0, 100), xticks=x, title="accuracy")
    acc.legend(loc="lower left", fontsize=8)
    means = [
        sum(s.upload_bytes_per_client.values()) / len(s.upload_bytes_per_client) / MIB
        if s.upload_bytes_per_client
        else 0
        for s in stages
    ]
    comm.bar(x, means, color="C1")
    comm.set(xlabel="stage", ylabel="MiB per client", xticks=x, title="upload per client")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
