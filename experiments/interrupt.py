"""Ctrl-C for the launchers (fcl-sim, fcl-compare): the first SIGINT stops the run within seconds,
with one line and exit code 130.

Flower 1.41's ``run_simulation`` installs no signal handler: a SIGINT raises KeyboardInterrupt in
the main thread, which runs the Simulation Engine (``vce_api.run_api`` waiting on its worker
threads), while the ServerApp runs in another, non-daemon thread (``run_simulation.run_serverapp_th``)
that nobody tells to stop. Python prints the traceback, Ray is shut down by ``run_api``'s
``finally``, and the process then waits at exit for the ServerApp thread, which waits for replies
up to ``round-timeout``.

:func:`sigint_stops` replaces that. Python runs a signal handler only when the main thread next
executes Python code, which inside the engine (a thread join, a Ray call) can be seconds later;
so the C-level handler's wakeup socket (``signal.set_wakeup_fd``) is read by a thread of ours,
which acts at once. The first SIGINT only asks the run to stop
(:func:`fcl_flower.interrupt.request_stop`; the stage loop ends with ``RunInterrupted`` at the
next round or poll, results.json says ``interrupted``, Flower's engine sees the ServerApp end and
shuts Ray down) and mutes the engine's logs. If the process has not ended ``grace`` seconds later
(a client still training, the engine's worker pool waiting on it), or on a second SIGINT, it ends
itself: results.json marked ``interrupted``, every child process (Ray's raylet, GCS, workers)
terminated, then killed, the line printed, ``os._exit(130)``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from fcl_flower import interrupt
from fcl_flower.config import RunConfig
from fcl_flower.results import mark_interrupted

EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a process ended by Ctrl-C
GRACE_S = 3.0  # seconds the engine gets to end by itself after the first Ctrl-C


def resume_command(argv: Sequence[str], program: str = "fcl-sim") -> str:
    """The command that continues the run: the same flags plus ``--resume`` (once)."""
    args = [a for a in argv if a not in ("--resume", "--no-resume")]
    return shlex.join([program, *args, "--resume"])


def sim_line(results: Path, num_tasks: int, argv: Sequence[str]) -> str:
    """fcl-sim's one line: what is saved and how to go on."""
    stages = mark_interrupted(results)
    folder = results.parent
    if _status(results) == "completed":
        return f"interrupted after the run completed: results in {results}"
    if not stages and (folder / "checkpoint.json").exists():  # stage 1 saved, its evaluation still to ride
        return (
            f"interrupted: stage 1 of {num_tasks} saved in {folder} (checkpoint; scored with the next stage); "
            f"continue with: {resume_command(argv)}"
        )
    if not stages:
        return f"interrupted before stage 1 of {num_tasks} finished: nothing to resume ({folder}); run it again to start over"
    return (
        f"interrupted: {stages} of {num_tasks} stages saved in {folder} (results.json, checkpoint); "
        f"continue with: {resume_command(argv)}"
    )


def compare_line(started: Sequence[RunConfig], total: int, argv: Sequence[str]) -> str:
    """fcl-compare's one line: the run that was stopped, the runs kept, how to go on."""
    if not started:
        return "interrupted before the first run started"
    current = started[-1]
    stages = mark_interrupted(current.output_dir / "results.json")
    done = len(started) - 1
    args = [*argv] if "--skip-existing" in argv else [*argv, "--skip-existing"]
    return (
        f"interrupted: run {current.output_dir.name} stopped after {stages or 0} of {current.num_tasks} stages "
        f"({current.output_dir}); the {done} run(s) before it are kept; continue with: "
        f"{shlex.join(['fcl-compare', *args])} (it starts the stopped run again)"
    )


def _status(results: Path) -> Any:
    try:
        return json.loads(results.read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


class Interruption:
    """What the SIGINT handler knows: whether it fired, and how to end the process."""

    def __init__(self, line: Callable[[], str], grace: float) -> None:
        self.line = line
        self.grace = grace
        self.at: float | None = None  # time.monotonic() of the first SIGINT
        self._lock = threading.Lock()
        self._said = False
        self._disarmed = threading.Event()
        self._children: list[Any] = []  # psutil.Process of every descendant when Ctrl-C came

    @property
    def happened(self) -> bool:
        return self.at is not None

    def say(self) -> int:
        """Print the one line (once, whoever comes first: the launcher or the watchdog); 130."""
        with self._lock:
            if not self._said:
                self._said = True
                try:
                    text = self.line()
                except Exception as err:  # the line must never turn into a traceback
                    text = f"interrupted ({type(err).__name__}: {err})"
                if sys.stderr.isatty():  # over a progress bar the run may have left on the line
                    text = "\r\x1b[K" + text
                print(text, file=sys.stderr, flush=True)
        return EXIT_CODE

    def handle(self, _signum: int, _frame: FrameType | None) -> None:
        """The Python-level handler: it runs only when the main thread next executes Python code,
        which inside Flower's engine can be seconds later; :meth:`watch` has usually begun the stop."""
        self.begin()

    def begin(self) -> None:
        """The first Ctrl-C: ask the run to stop, mute the engine, arm the watchdog (once)."""
        with self._lock:
            if self.at is not None:
                return
            self.at = time.monotonic()
        self._children = descendants()  # Ray's workers outlive the raylet, their parent, for a while
        interrupt.request_stop()
        mute_engine_logs()
        threading.Thread(target=self._watchdog, name="fcl-interrupt", daemon=True).start()

    def watch(self, wakeup: socket.socket) -> None:
        """Read the signal numbers that Python's C-level handler writes to the wakeup socket at
        once, whichever thread the signal hit: the first SIGINT begins the stop, the second ends
        the process."""
        count = 0
        while True:
            try:
                data = wakeup.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum == signal.SIGINT:
                    count += 1
                    if count == 1:
                        self.begin()
                    else:
                        self.force()

    def disarm(self) -> None:
        """The process goes on after the run (tests): no forced end after ``grace``."""
        self._disarmed.set()

    def _watchdog(self) -> None:
        if not self._disarmed.wait(self.grace):
            self.force()

    def end_children(self) -> None:
        """No process left: this process's descendants now and when Ctrl-C came."""
        end_processes([*self._children, *descendants()])

    def force(self) -> None:
        """End the process now: results.json, the line, no child process left, exit 130."""
        self.say()
        silence()  # the main thread may still be printing (the end of a run that had just completed)
        self.end_children()
        os._exit(EXIT_CODE)


def silence() -> None:
    """Nothing more on stdout/stderr from this process: after the one line it only ends."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)


def mute_engine_logs() -> None:
    """After Ctrl-C the engine's and Ray's complaints about stopped clients are noise: only the one line."""
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def descendants() -> list[Any]:
    """psutil.Process of every descendant of this process (Ray's raylet, GCS server, workers...)."""
    import psutil

    try:
        return list(psutil.Process().children(recursive=True))
    except psutil.Error:
        return []


def end_processes(children: Sequence[Any], grace: float = 0.5) -> None:
    """SIGTERM ``children`` (psutil.Process: a reused PID is never hit), then SIGKILL what is left."""
    import psutil

    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(alive, timeout=grace)


@contextmanager
def sigint_stops(line: Callable[[], str], grace: float | None = None) -> Iterator[Interruption]:
    """SIGINT handled as described in the module docstring while inside; ``line`` makes the one
    line (and marks results.json); ``grace`` defaults to :data:`GRACE_S`. The watchdog stays armed
    after the block (the process is about to end; its exit may hang on the engine's threads). In a
    thread other than the main one nothing is installed."""
    state = Interruption(line, GRACE_S if grace is None else grace)
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    interrupt.clear()
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.signal(signal.SIGINT, state.handle)
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=state.watch, args=(reader,), name="fcl-sigint", daemon=True).start()
    try:
        yield state
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous)
        writer.close()  # the watcher reads EOF and ends; it closes nothing else
        reader.shutdown(socket.SHUT_RDWR)
