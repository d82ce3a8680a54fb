"""A request to stop the run of this process (Ctrl-C), and the exception the stage loop ends on.

A launcher's SIGINT handler (experiments/interrupt.py) calls :func:`request_stop`; the stage loop
and the reply stream call :func:`check` where stopping is safe (before a round, while waiting for
replies) and end with :class:`RunInterrupted`. results.json then says ``"status": "interrupted"``;
the checkpoint of the last finished stage stays, so ``resume`` continues from the next stage.
"""

from __future__ import annotations

import threading

_STOP = threading.Event()


class RunInterrupted(BaseException):
    """The run was asked to stop (Ctrl-C). A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` that rejects one bad reply swallows it."""


def request_stop() -> None:
    _STOP.set()


def stop_requested() -> bool:
    return _STOP.is_set()


def clear() -> None:
    """Forget a stop request (a launcher that runs several runs in one process, and tests)."""
    _STOP.clear()


def check() -> None:
    """Raise :class:`RunInterrupted` if a stop was requested."""
    if _STOP.is_set():
        raise RunInterrupted("interrupted")
