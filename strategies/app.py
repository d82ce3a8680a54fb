"""The ServerApp (``[tool.flwr.app.components] serverapp``): builds the run from its configuration
and hands it to the strategy of the chosen method.

A run that cannot go on ends with one log line and :class:`RunAborted`, an exception, so that every
launcher sees the failure: ``flwr run`` records the run as ``finished:failed`` (``flwr ls``), and
experiments/sim.py exits non-zero. results.json then says ``"status": "failed"`` with the error.
A run stopped by Ctrl-C (fcl_flower/interrupt.py) says ``"status": "interrupted"`` and ends with
RunAborted of exit code 130, logged by no one: the launcher prints the one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import ERROR
from typing import Any

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import DatasetError
from fcl_flower.interrupt import RunInterrupted
from fcl_flower.models import ModelError
from fcl_flower.quiet import OneLineError, quiet_known_noise
from fcl_flower.results import ResultsRecorder
from fcl_flower.runtime import server_split
from fcl_flower.state_io import StateError
from fcl_flower.tracking import make_trackers
from strategies import build_strategy
from strategies.checkpoint import open_run_folder
from strategies.loop import RunFailed

#: Errors that are the user's to fix (config, data, model, checkpoint): one line, no traceback.
USER_ERRORS = (ConfigError, DatasetError, ModelError, StateError)
#: Errors the run ends on by design (require-all-clients and a client missing): one line too.
RUN_ERRORS = (RunFailed,)
#: The exit code of a run stopped by Ctrl-C (128 + SIGINT, as shells report it).
INTERRUPTED = 130


class RunAborted(OneLineError):
    """The run stopped on an error whose one-line message was logged; ``exit_code`` for launchers:
    2 for a configuration/data error (nothing was computed), 1 for a run that failed under way,
    130 for a run stopped by Ctrl-C (nothing logged). A OneLineError: Flower's traceback of it is
    left out of the log (fcl_flower/quiet.py); the run still ends ``finished:failed``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_experiment(grid: Grid, cfg: RunConfig) -> ResultsRecorder:
    """Everything a run does, given a grid of connected client nodes.

    Before any training: the run folder is made, checked writable and not another configuration's,
    and locked; the dataset is checked (under federated evaluation the server opens none: it holds
    only the task plan). results.json says ``running`` from the start and
    ``completed``, ``failed`` (with the error) or ``interrupted`` at the end; results.png is drawn then.
    """
    with open_run_folder(cfg) as folder:
        split = server_split(cfg)
        trackers = make_trackers(cfg, folder)
        recorder = ResultsRecorder(folder, cfg.strategy, cfg.to_mapping(), num_tasks=cfg.num_tasks, trackers=trackers)
        strategy = build_strategy(cfg, split, recorder)
        try:
            strategy.start(grid)
        except RunInterrupted:
            recorder.finish(interrupted=True)
            raise
        except BaseException as err:
            recorder.finish(
                error=f"{type(err).__name__}: {err}" if not isinstance(err, USER_ERRORS + RUN_ERRORS) else str(err)
            )
            raise
        recorder.finish()
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
            log(ERROR, "fcl-flower: error: %s", err)
            raise RunAborted(str(err), exit_code=2) from None
        except RUN_ERRORS as err:
            log(ERROR, "fcl-flower: the run failed: %s", err)
            raise RunAborted(str(err), exit_code=1) from None
        except RunInterrupted:  # an Exception now, so that Flower's server thread hands it on quietly
            raise RunAborted("interrupted", exit_code=INTERRUPTED) from None

    return app


quiet_known_noise()
app = build_server_app()
