"""``fcl-run``: ``flwr run`` that waits for the run and says how it ended, as an exit status.

    fcl-run . --federation-config "num-supernodes=5" --run-config "strategy='fedran' beta=0.1"
    fcl-run . my-superlink -c run.toml

The arguments are ``flwr run``'s. Before anything is submitted the run config is checked here
with the app's own parsing (as ``fcl-config`` does): a bad key or value ends at once with one
``error:`` line and exit status 2. Otherwise the run is submitted (``flwr run ... --format json``),
its log follows (``flwr log RUN_ID --stream``, which ends with the run), and one ``flwr ls`` reads
the outcome (then one every ``--poll`` seconds if the SuperLink has not recorded it yet). The last
line says how the run ended; the exit status is **0** completed, **1** failed (or stopped),
**2** bad configuration, **130** Ctrl-C (fcl-run stops waiting; the run goes on, ``flwr stop`` ends it).

``flwr run`` itself returns 0 whatever the run does (docs/getting_started.md, "Did the run work?").
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

COMPLETED, FAILED, BAD_CONFIG = 0, 1, 2
POLL_S = 10.0  # seconds between two `flwr ls` while the outcome is not recorded yet


def split_args(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """(the positional APP/SUPERLINK, the --run-config values, every argument for ``flwr run``)."""
    positional: list[str] = []
    configs: list[str] = []
    passed: list[str] = []
    takes_value = {"--run-config", "-c", "--federation-config", "--federation", "--format"}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if arg in ("--stream",):  # fcl-run follows the log itself
            i += 1
            continue
        if name == "--format":  # fcl-run asks for json itself
            i += 1 if eq else 2
            continue
        if eq and name.startswith("--"):
            passed.append(arg)
            if name == "--run-config":
                configs.append(value)
        elif arg in takes_value:
            if i + 1 >= len(args):
                raise ValueError(f"{arg} needs a value")
            passed += [arg, args[i + 1]]
            if arg in ("--run-config", "-c"):
                configs.append(args[i + 1])
            i += 1
        else:
            passed.append(arg)
            if not arg.startswith("-"):
                positional.append(arg)
        i += 1
    return positional, configs, passed


def check_run_config(configs: Sequence[str]) -> str:
    """The project's own check of the run config; '' when it can run, else the one-line reason."""
    from flwr.common.config import parse_config_args

    from fcl_flower.config import ConfigError, RunConfig

    try:
        try:
            values = parse_config_args(list(configs))
        except Exception as err:  # ValueError, or click's ClickException (flwr 1.41) for a bad string
            raise ConfigError(f"cannot parse the run config: {err}") from None
        RunConfig.from_mapping(values)
    except ConfigError as err:
        return str(err)
    return ""


def outcome(status: str) -> int:
    """Flower's run status -> the exit status; -1 while the run is not finished."""
    if not status.startswith("finished"):
        return -1
    return COMPLETED if status == "finished:completed" else FAILED


def _json(text: str) -> dict[str, Any]:
    data = json.loads(text[text.index("{") :])
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


class Flwr:
    """The ``flwr`` CLI on PATH, else the one next to this Python (the venv's, not activated)."""

    def __init__(self) -> None:
        self.exe = shutil.which("flwr") or os.path.join(os.path.dirname(sys.executable), "flwr")

    def run(self, args: Sequence[str]) -> subprocess.CompletedProcess:
        return subprocess.run([self.exe, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)

    def stream(self, args: Sequence[str]) -> int:
        return subprocess.run([self.exe, *args], stdin=subprocess.DEVNULL).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fcl-run",
        allow_abbrev=False,
        description=__doc__.splitlines()[0],
        epilog="Every other argument is flwr run's (APP, SUPERLINK, --run-config, --federation-config ...).",
    )
    parser.add_argument("--poll", type=float, default=POLL_S, help="Seconds between two flwr ls when waiting.")
    parser.add_argument("--no-log", action="store_true", help="Do not follow the run's log (only the outcome).")
    ours, rest = parser.parse_known_args(argv)
    try:
        positional, configs, passed = split_args(rest)
    except ValueError as err:
        print(f"fcl-run: error: {err}", file=sys.stderr)
        return BAD_CONFIG
    if len(positional) > 2:
        print(f"fcl-run: error: unexpected arguments: {' '.join(positional[2:])}", file=sys.stderr)
        return BAD_CONFIG
    reason = check_run_config(configs)
    if reason:
        print(f"fcl-run: error: {reason}", file=sys.stderr)
        return BAD_CONFIG
    superlink = positional[1:2]  # flwr log/ls take the SuperLink, not the app
    flwr = Flwr()
    submitted = flwr.run(["run", *passed, "--format", "json"])
    try:
        data = _json(submitted.stdout)
        run_id = int(data["run-id"])
    except (ValueError, KeyError, TypeError):
        said = (submitted.stdout + submitted.stderr).strip().splitlines()
        print(
            f"fcl-run: error: flwr run did not start the run: {said[-1] if said else submitted.returncode}",
            file=sys.stderr,
        )
        return BAD_CONFIG if "run configuration" in " ".join(said).lower() else FAILED
    print(f"fcl-run: run {run_id} submitted", file=sys.stderr, flush=True)
    try:
        return wait(flwr, run_id, superlink, follow=not ours.no_log, poll=ours.poll)
    except KeyboardInterrupt:
        stop = shlex.join(["flwr", "stop", str(run_id), *superlink])
        print(f"\nfcl-run: stopped waiting; run {run_id} goes on (stop it with: {stop})", file=sys.stderr)
        return 130


def wait(flwr: Flwr, run_id: int, superlink: list[str], *, follow: bool, poll: float) -> int:
    """Follow the run's log, then read its outcome (every ``poll`` s until it is recorded)."""
    if follow:
        flwr.stream(["log", str(run_id), *superlink, "--stream"])
    while True:
        listed = flwr.run(["ls", *superlink, "--run-id", str(run_id), "--format", "json"])
        try:
            run = _json(listed.stdout)["runs"][0]
            status, details = str(run["status"]), str(run.get("status-details", ""))
        except (ValueError, KeyError, IndexError, TypeError):
            print(f"fcl-run: error: flwr ls gave no status for run {run_id}", file=sys.stderr)
            return FAILED
        code = outcome(status)
        if code >= 0:
            tail = f" ({details})" if details and code != COMPLETED else ""
            print(f"fcl-run: run {run_id} {status}{tail}", file=sys.stderr)
            return code
        time.sleep(poll)


if __name__ == "__main__":
    sys.exit(main())
