"""The ServerApp (``[tool.flwr.app.components] serverapp``): builds the run from its configuration
and hands it to the strategy of the chosen method."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from logging import ERROR
from typing import Any

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import DatasetError
from fcl_flower.models import ModelError
from fcl_flower.results import ResultsRecorder
from fcl_flower.runtime import federated_split
from strategies import build_strategy
from strategies.checkpoint import run_folder_lock

USER_ERRORS = (ConfigError, DatasetError, ModelError)


def run_experiment(grid: Grid, cfg: RunConfig) -> ResultsRecorder:
    """Everything a run does, given a grid of connected client nodes."""
    split = federated_split(cfg)
    recorder = ResultsRecorder(cfg.output_dir, cfg.strategy, cfg.to_mapping())
    strategy = build_strategy(cfg, split, recorder)
    with run_folder_lock(cfg.output_dir):
        strategy.start(grid)
    return recorder


def build_server_app(overrides: Mapping[str, Any] | None = None) -> ServerApp:
    """A ServerApp whose config is the run config plus ``overrides`` (used by experiments/sim.py,
    since Flower's in-process simulation hands the ServerApp an empty run config)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            cfg = RunConfig.from_mapping({**dict(context.run_config), **dict(overrides or {})})
            run_experiment(grid, cfg)
        except USER_ERRORS as err:
            log(ERROR, "fcl-flower: %s", err)
            sys.exit(2)

    return app


app = build_server_app()
