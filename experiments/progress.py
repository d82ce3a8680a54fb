"""Progress bars driven by the strategies' own log lines, for the Python launchers.

The staged strategies log "[stage s/T] round r/R (phase)" before each round and "[stage s/T]
accuracy ... (…; ETA …)" after each stage (strategies/loop.py), in the ServerApp's process (the
launcher's own process for both engines), so no strategy needs to know about progress bars.
The bars are drawn only on an interactive terminal (tqdm ``disable=None``); in a log file or
under ``flwr run`` the log lines, with their ETA, are the progress.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from strategies.loop import STAGE_DONE_MSG, STAGE_ROUND_MSG


class ProgressHandler(logging.Handler):
    """Turns the strategies' per-round log lines into a tqdm bar of stages and rounds."""

    def __init__(self, bar: Any) -> None:
        super().__init__(logging.INFO)
        self.bar = bar
        self.rounds = 0
        self.stages = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.msg == STAGE_ROUND_MSG and record.args:
                stage, total, index, rounds, phase = record.args  # type: ignore[misc]  # LogRecord.args is a tuple here: our own log call
                self.rounds += 1
                if self.bar.total != total:
                    self.bar.reset(total=total)
                    self.bar.update(stage - 1)
                self.bar.set_postfix_str(f"stage {stage}/{total} round {index}/{rounds} ({phase})", refresh=True)
            elif record.msg == STAGE_DONE_MSG and record.args:
                self.stages += 1
                stage, total = record.args[0], record.args[1]  # type: ignore[index]  # as above
                if self.bar.total != total:
                    self.bar.reset(total=total)
                self.bar.n = stage
                eta = str(record.args[5]).removeprefix("; ")  # type: ignore[index]  # as above
                self.bar.set_postfix_str(f"stage {stage}/{total}: {record.args[3]:.1f}% {eta}", refresh=True)  # type: ignore[index]  # as above
        except Exception:  # a progress bar must never break a run
            pass


@contextmanager
def flower_progress(bar: Any, verbose: bool) -> Iterator[ProgressHandler]:
    from flwr.common.logger import FLOWER_LOGGER, console_handler

    handler = ProgressHandler(bar)
    FLOWER_LOGGER.addHandler(handler)
    level = console_handler.level
    if not verbose and not getattr(bar, "disable", True):
        console_handler.setLevel(logging.WARNING)  # a drawn bar replaces Flower's INFO lines
    try:
        yield handler
    finally:
        FLOWER_LOGGER.removeHandler(handler)
        console_handler.setLevel(level)
