"""Optional experiment tracking: TensorBoard event files and MLflow runs (knob ``tracking``).

What is logged, for both backends:

* at the start: the run config (MLflow params; TensorBoard a text summary);
* after every round (step = server round): ``round/seconds``, ``round/replies``,
  ``round/rejected``, ``round/upload_bytes`` and the clients' aggregated training metrics
  (``round/train_loss`` ...);
* after every stage (step = stage): ``stage/accuracy`` (A_t), ``stage/task_<k>`` (A_{t,k}),
  ``stage/seconds``, ``stage/upload_bytes_mean_per_client``, ``stage/left_out``;
* at the end: ``A_avg``, ``A_T``, ``F_T``, ``total_seconds``, and the outcome (MLflow run status
  FINISHED or FAILED; a ``status`` tag).

Both backends live in the ``tracking`` extra (``pip install -e ".[tracking]"``). TensorBoard writes
``<run folder>/tensorboard``; MLflow writes to ``tracking-uri``, by default a file store in
``<run folder>/mlruns`` (MLflow 3 keeps file stores in maintenance mode and asks to opt in with
MLFLOW_ALLOW_FILE_STORE, which is set for that default only; give a ``sqlite:///`` or
``http://`` URI for a database or a tracking server).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from fcl_flower.config import ConfigError, RunConfig

EXPERIMENT = "fcl-flower"


class Tracker(Protocol):
    def start(self, config: Mapping[str, Any]) -> None: ...
    def round(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def stage(self, stage: int, metrics: Mapping[str, float]) -> None: ...
    def finish(self, summary: Mapping[str, float], status: str) -> None: ...


def make_trackers(cfg: RunConfig, folder: Path) -> list[Tracker]:
    """The trackers ``cfg.tracking`` asks for; ConfigError (one line) if their package is missing."""
    wanted = {"none": (), "tensorboard": ("tensorboard",), "mlflow": ("mlflow",), "both": ("tensorboard", "mlflow")}
    trackers: list[Tracker] = []
    for name in wanted[cfg.tracking]:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(Path(folder) / "tensorboard"))
        else:
            trackers.append(MLflowTracker(cfg.tracking_uri or (Path(folder) / "mlruns").as_uri(), Path(folder).name))
    return trackers


def _missing(package: str) -> ConfigError:
    return ConfigError(
        f"tracking needs the '{package}' package: pip install -e \".[tracking]\" (or set tracking='none')"
    )


class TensorBoardTracker:
    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def start(self, config: Mapping[str, Any]) -> None:
        table = "\n".join(f"| {k} | {v} |" for k, v in sorted(config.items()))
        self.writer.add_text("config", "| key | value |\n|---|---|\n" + table, 0)

    def round(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(f"round/{key}", value, step)

    def stage(self, stage: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(f"stage/{key}", value, stage)
        self.writer.flush()

    def finish(self, summary: Mapping[str, float], status: str) -> None:
        for key, value in summary.items():
            self.writer.add_scalar(f"run/{key}", value, 0)
        self.writer.add_text("status", status, 0)
        self.writer.close()


class MLflowTracker:
    """Through ``MlflowClient`` (no global active run: the ServerApp may share its process)."""

    def __init__(self, uri: str, run_name: str) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow-skinny") from None
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # our default store: see module doc
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self.client.create_experiment(EXPERIMENT)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def start(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in sorted(config.items())])

    def round(self, step: int, metrics: Mapping[str, float]) -> None:
        self._metrics("round/", metrics, step)

    def stage(self, stage: int, metrics: Mapping[str, float]) -> None:
        self._metrics("stage/", metrics, stage)

    def finish(self, summary: Mapping[str, float], status: str) -> None:
        self._metrics("", summary, 0)
        self.client.set_tag(self.run_id, "status", status)
        self.client.set_terminated(self.run_id, "FINISHED" if status == "completed" else "FAILED")

    def _metrics(self, prefix: str, metrics: Mapping[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(f"{prefix}{k}", float(v), now, step) for k, v in metrics.items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)


def require_tracking_packages(cfg: RunConfig) -> None:
    """Fail fast (before any engine starts) when ``tracking`` names a backend that is not installed."""
    import importlib.util

    needs = {"tensorboard": ["tensorboard"], "mlflow": ["mlflow"], "both": ["tensorboard", "mlflow"]}
    for module in needs.get(cfg.tracking, []):
        if importlib.util.find_spec(module) is None:
            raise _missing("mlflow-skinny" if module == "mlflow" else module)
