"""Flower's floor alone (issue 32): the minimal app of bench_deployment.py on fresh federations.

    python -m experiments.bench_floor                          # 3 fresh federations, 8 rounds each
    python -m experiments.bench_floor --federations 1 --rounds 8 --log-level DEBUG --keep /tmp/floor

Each federation is what ``experiments/bench_deployment.py`` starts (deploy/local_federation.py:
``flower-superlink`` with TLS and SuperNode authentication, ``--num-nodes`` SuperNodes on
127.0.0.1, ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1`` unless set), but it runs only the floor app
(bench_deployment ``write_floor_app`` / ``floor_run``: one ``query`` message per node per round, a
ClientApp importing only flwr), once, with no project app before or after it and no warm worker,
then stops. The JSON (experiments/results/bench_floor[-<tag>].json) holds every round's seconds,
each run's median, the median and spread over all rounds (and without each run's first round),
and the load average before and after every run.

Each run also records the machine's busy CPU seconds during it (every process, anyone's) and, when
the script runs in a cpuacct cgroup of its own, the CPU seconds of that cgroup (this process and
every process of the federation, short-lived flwr-clientapp processes included)::

    mkdir /sys/fs/cgroup/cpuacct/floor && sh -c 'echo $$ > /sys/fs/cgroup/cpuacct/floor/tasks &&
        exec python -m experiments.bench_floor' ; rmdir /sys/fs/cgroup/cpuacct/floor

``--log-level DEBUG`` gives the SuperNodes' and SuperLink's log lines timestamps
(``FLWR_LOG_LEVEL``); with ``--keep`` the logs stay in ``<keep>/fed-<k>/federation/logs``, and
``--decompose`` prints, per round, when each SuperNode received its message and sent its reply
(relative to the round's start by the ServerApp's clock).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from experiments.bench_deployment import (
    federation_module,
    floor_run,
    machine_cpu_seconds,
    own_cgroup_cpu_seconds,
    write_floor_app,
)
from experiments.benchlib import median, write_json

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STAMP = re.compile(r"^[A-Z]+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}):\s+(.*)$")
# A SuperNode's log lines (its own and its flwr-clientapp processes', which inherit its output) that
# mark a message's way through it: pulled from the SuperLink; the ClientApp process's interpreter up
# (its DEBUG warning, once flwr's logger is imported); the process past its imports; the reply
# leaving; the reply pushed to the SuperLink.
NODE_MARKS = {
    "Receiving:": "pulled",
    "DEBUG logs enabled": "proc_up",
    "Start `flwr-clientapp` process": "app_imported",
    "Sending:": "sending",
    "Sent successfully": "sent",
}


def quantiles(values: list[float]) -> dict[str, float]:
    xs = sorted(values)
    if not xs:
        return {}

    def q(p: float) -> float:
        at = p * (len(xs) - 1)
        lo = int(at)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)

    return {"min": xs[0], "q1": q(0.25), "median": q(0.5), "q3": q(0.75), "max": xs[-1], "n": len(xs)}


def log_events(log: Path, marks: dict[str, str]) -> list[tuple[float, str]]:
    """(epoch seconds, mark) for every timestamped line (DEBUG logs) that starts with one of ``marks``."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        m = STAMP.match(ANSI.sub("", line).strip())
        if not m:
            continue
        for prefix, mark in marks.items():
            if m.group(2).startswith(prefix):
                events.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), mark))
    return events


def decompose(logs: Path, starts: list[float], seconds: list[float]) -> list[dict[str, Any]]:
    """Per round: when each SuperNode pulled its message, its ClientApp process came up and got past
    its imports, and its reply left, in seconds from the round's start (the ServerApp's clock); and
    when the SuperLink got the server's push and each node's reply."""
    nodes = {log.stem: log_events(log, NODE_MARKS)[1:] for log in sorted(logs.glob("supernode-*.log"))}
    link = log_events(
        logs / "superlink.log", {"Runtime.PushMessages": "server_push", "[Fleet.PushMessages]": "reply_in"}
    )
    rounds = []
    for k, (start, length) in enumerate(zip(starts, seconds, strict=True)):
        row: dict[str, Any] = {"round": k + 1, "seconds": length}
        window = (start - 0.05, start + length + 0.05)
        for name, events in nodes.items():
            inside = [(t, mark) for t, mark in events if window[0] <= t <= window[1]]
            pulled = next((t for t, mark in inside if mark == "pulled"), None)
            row[name] = {}
            for t, mark in inside:  # this round's message: its marks come after its pull
                if mark not in row[name] and (pulled is None or t >= pulled):
                    row[name][mark] = round(t - start, 3)
        row["superlink"] = {
            mark: [round(t - start, 3) for t, m in link if m == mark and window[0] <= t <= window[1]]
            for mark in ("server_push", "reply_in")
        }
        rounds.append(row)
    return rounds


def clientapp_start_seconds(repeats: int = 3) -> list[float]:
    """Wall seconds of ``flwr-clientapp --help`` (the interpreter and the imports every ClientApp
    process pays), one at a time before the federation starts: how fast this machine is right now."""
    exe = str(Path(sys.executable).parent / "flwr-clientapp")
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        subprocess.run([exe, "--help"], capture_output=True, check=True)
        times.append(time.perf_counter() - began)
    return times


def one_federation(fed: Any, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    app = write_floor_app(workdir / "floor-app")
    calibration = clientapp_start_seconds()
    federation = fed.LocalFederation(workdir / "federation", fed.node_configs_for(args.num_nodes, None))
    with federation:
        began = time.monotonic()
        federation.start()
        startup = time.monotonic() - began
        idle: dict[str, Any] = {}
        if args.settle > 0:  # the federation up and idle: what its polling costs, before the run
            cpu_before, busy_before = own_cgroup_cpu_seconds(), machine_cpu_seconds()
            time.sleep(args.settle)
            cpu_after = own_cgroup_cpu_seconds()
            idle = {
                "seconds": args.settle,
                "machine_busy_cpu_seconds": machine_cpu_seconds() - busy_before,
                "own_cgroup_cpu_seconds": None if cpu_before is None or cpu_after is None else cpu_after - cpu_before,
            }
        run = floor_run(federation, app, args.rounds, args.num_nodes, workdir / "floor.json", args.timeout)
    survivors = federation.surviving()
    if survivors:
        raise SystemExit(f"error: processes survived the stop: {survivors}")
    run["federation_startup_seconds"] = startup
    run["clientapp_start_seconds_before"] = calibration
    run["idle_before_run"] = idle
    run["median_round_seconds"] = median(run["round_seconds"])
    if args.decompose and run.get("round_starts"):
        run["decomposition"] = decompose(federation.workdir / "logs", run["round_starts"], run["round_seconds"])
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8, help="floor rounds per run (default 8)")
    parser.add_argument("--federations", type=int, default=3, help="fresh federations, one floor run each")
    parser.add_argument("--settle", type=float, default=0.0, help="seconds to wait between start-up and the run")
    parser.add_argument("--log-level", default=None, help="FLWR_LOG_LEVEL for every process (DEBUG: timestamps)")
    parser.add_argument(
        "--superexec-poll", default=None, help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL (default: local_federation's 0.1)"
    )
    parser.add_argument("--decompose", action="store_true", help="per-round node timestamps (needs DEBUG logs)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--keep", default=None, help="work folder to keep (default: a temporary one)")
    parser.add_argument("--tag", default="", help="suffix of the JSON's name")
    args = parser.parse_args(argv)
    for flag, value in (
        ("--num-nodes", args.num_nodes),
        ("--rounds", args.rounds),
        ("--federations", args.federations),
    ):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.settle < 0 or args.timeout <= 0:
        parser.error("--settle must be >= 0 and --timeout > 0")
    if args.decompose and (args.log_level or "").upper() != "DEBUG":
        parser.error("--decompose reads the DEBUG log lines: add --log-level DEBUG")
    os.environ["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    if args.log_level:
        os.environ["FLWR_LOG_LEVEL"] = args.log_level
    if args.superexec_poll:
        os.environ["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = args.superexec_poll
    fed = federation_module()
    runs = []
    with tempfile.TemporaryDirectory(prefix="fcl-floor-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        for k in range(args.federations):
            run = one_federation(fed, root / f"fed-{k}", args)
            print(
                f"federation {k + 1}/{args.federations}: rounds "
                + " ".join(f"{s:.2f}" for s in run["round_seconds"])
                + f"  median {run['median_round_seconds']:.2f} s  load before {run['load_average_before'][0]:.2f}"
                f" after {run['load_average_after'][0]:.2f}; flwr-clientapp start alone"
                f" {median(run['clientapp_start_seconds_before']):.2f} s; run {run['wall_seconds']:.1f} s wall, machine busy"
                f" {run['machine_busy_cpu_seconds']:.1f} CPU s"
                + (
                    f", ours {run['own_cgroup_cpu_seconds']:.1f} CPU s"
                    if run.get("own_cgroup_cpu_seconds") is not None
                    else ""
                )
                + (
                    f"; idle federation {run['idle_before_run']['own_cgroup_cpu_seconds']:.2f} CPU s"
                    f" in {run['idle_before_run']['seconds']:g} s"
                    if run["idle_before_run"].get("own_cgroup_cpu_seconds") is not None
                    else ""
                ),
                flush=True,
            )
            for row in run.get("decomposition", []):
                print(f"  round {row['round']} {row['seconds']:.2f} s  superlink {row['superlink']}", flush=True)
                for name, marks in row.items():
                    if name.startswith("supernode"):
                        print(f"    {name}: " + "  ".join(f"{m} {t:.2f}" for m, t in marks.items()), flush=True)
            runs.append(run)
    every = [s for run in runs for s in run["round_seconds"]]
    later = [s for run in runs for s in run["round_seconds"][1:]]
    result = {
        "what": "Flower's floor alone: bench_deployment's minimal app on fresh federations, no project app, no warm worker",
        "num_nodes": args.num_nodes,
        "rounds_per_run": args.rounds,
        "federations": args.federations,
        "env": {
            "FLWR_LOG_LEVEL": os.environ.get("FLWR_LOG_LEVEL"),
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1"),
        },
        "settle_seconds": args.settle,
        "runs": runs,
        "run_medians": [run["median_round_seconds"] for run in runs],
        "all_rounds": quantiles(every),
        "without_first_round": quantiles(later),
        "cpu_count": os.cpu_count(),
    }
    name = f"bench_floor{'-' + args.tag if args.tag else ''}"
    write_json(name, result)
    q = result["all_rounds"]
    print(
        f"all {q['n']} rounds: median {q['median']:.2f} s, q1 {q['q1']:.2f}, q3 {q['q3']:.2f}, "
        f"min {q['min']:.2f}, max {q['max']:.2f}; run medians "
        + " ".join(f"{m:.2f}" for m in result["run_medians"])
        + f"  -> experiments/results/{name}.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
