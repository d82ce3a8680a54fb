"""deploy/README.md's one-command walkthrough, timed end to end (issue 32: <= 2.5 min at load <= 2).

    python -m experiments.bench_walkthrough                      # 3 SuperNodes, 5 tasks, secure, warm workers
    python -m experiments.bench_walkthrough --num-tasks 2 --run-extra "stage1-rounds=1 rf-dim=100"  # a smoke run

What it does:

1. exports the clients' folders as the walkthrough's step 0 does (``experiments/export_partitions.py``,
   timed apart: the walkthrough does it once, before any federation);
2. runs the walkthrough's command as a user would, in a process of its own::

       python deploy/local_federation.py --workdir W --data D --num-nodes 3 --warm-worker \\
           --run "num-clients=3 num-tasks=5 seed=0 secure-aggregation=true out='O'"

   (``secagg-signed-keys=true`` is added by the launcher; the run config's other knobs keep their
   defaults: 10 FedAvg rounds in stage 1, the default CNN) and stamps, by this process's clock,
   the moment each of its lines arrives: ``federation up`` ends the start-up (credentials,
   SuperLink, registration, SuperNodes online), ``submitting the run`` starts the run, the
   command's exit ends it (the launcher stops every process before it exits: that stop is
   reported as ``stop_seconds``, from the ``run N: finished`` line to the exit);
3. reads the run's results.json (status, stage and round seconds, the clients' training time).

The JSON (experiments/results/bench_walkthrough.json, or ``--out``) holds the command, the wall
seconds split into start-up, run and stop, the load average before and after, and the run's own
figures. The launcher streams the run's log with one ``flwr log --stream`` process, as the
walkthrough does; that is part of what a user waits for.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from experiments.benchlib import RESULTS_DIR, write_json
from experiments.export_partitions import export_partitions
from fcl_flower.config import ConfigError, RunConfig

ROOT = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 150.0  # issue 32: the walkthrough in <= 2.5 minutes at load <= 2
TARGET_LOAD = 2.0

#: a launcher line -> the moment it names (deploy/local_federation.py prints them)
MARKS = {
    "federation up in": "federation_up",
    "submitting the run": "submitting",
    "submitted; its log follows": "submitted",
}


def walkthrough_run_config(num_nodes: int, num_tasks: int, seed: int, extra: str, out: Path) -> str:
    """The walkthrough's ``--run`` text (flwr run --run-config syntax)."""
    text = f"num-clients={num_nodes} num-tasks={num_tasks} seed={seed} secure-aggregation=true"
    if extra.strip():
        text += f" {extra.strip()}"
    return f"{text} out={json.dumps(str(out))}"


def parse_run_config(text: str) -> RunConfig:
    """The run config the ServerApp will see (with the launcher's signed keys), checked."""
    from flwr.common.config import parse_config_args

    return RunConfig.from_mapping(parse_config_args([text])).replace(secagg_signed_keys=True).validated()


def split_times(stamps: dict[str, float], began: float, ended: float, finished: float | None) -> dict[str, Any]:
    """Wall seconds of the walkthrough's phases from the moments its lines arrived (this process's
    monotonic clock): ``startup`` launch -> ``federation up``; ``run`` ``submitting the run`` -> the
    ``run N: ...`` line (the launcher's own follow of the run); ``stop`` that line -> the exit; None
    where a line never came."""
    up, submitting = stamps.get("federation_up"), stamps.get("submitting")
    return {
        "total_seconds": ended - began,
        "startup_seconds": None if up is None else up - began,
        "run_seconds": None if submitting is None or finished is None else finished - submitting,
        "stop_seconds": None if finished is None else ended - finished,
    }


def run_walkthrough(argv: list[str], timeout: float, log_path: Path) -> dict[str, Any]:
    """The launcher as a child process; every line it prints goes to ``log_path`` (and this
    process's stdout), stamped with the moment it arrived."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stamps: dict[str, float] = {}
    finished: float | None = None
    status = ""
    began = time.monotonic()
    with (
        log_path.open("w") as log,
        subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        ) as proc,
    ):
        assert proc.stdout is not None
        # past the timeout, SIGTERM: the launcher stops its federation and exits (even if silent)
        timer = threading.Timer(timeout, proc.terminate)
        timer.daemon = True
        timer.start()
        for line in proc.stdout:
            now = time.monotonic()
            log.write(f"{now - began:9.2f} {line}")
            print(f"  | {line}", end="", flush=True)
            for text, mark in MARKS.items():
                if text in line and mark not in stamps:
                    stamps[mark] = now
            stripped = line.strip()
            if stripped.startswith("run ") and ": finished" in stripped and finished is None:
                finished, status = now, stripped.split(": ", 1)[1]
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        timer.cancel()
    ended = time.monotonic()
    return {
        "exit_code": code,
        "status": status or None,
        **split_times(stamps, began, ended, finished),
        "marks_seconds": {mark: at - began for mark, at in stamps.items()},
    }


def run_figures(results_file: Path) -> dict[str, Any]:
    """What the run's own results.json says: status, stage seconds, FedAvg rounds and their training."""
    if not results_file.is_file():
        return {"results_json": None}
    data = json.loads(results_file.read_text())
    stages = data.get("stages", [])
    rounds = data.get("rounds", [])
    return {
        "results_json": str(results_file),
        "run_status": data.get("status"),
        "stage_seconds": [s.get("seconds") for s in stages],
        "accuracy": [s.get("accuracy") for s in stages],
        "round_seconds": [r.get("seconds") for r in rounds],
        "train_seconds_max": [r.get("train_seconds_max") for r in rounds if "train_seconds_max" in r],
        "total_seconds_by_stages": data.get("total_seconds"),
    }


def seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-nodes", type=int, default=3, help="SuperNodes (one client each; default 3)")
    parser.add_argument("--num-tasks", type=int, default=5, help="tasks (default 5, as the walkthrough)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--run-extra",
        default="",
        help='more run config for --run (flwr syntax), e.g. "stage1-rounds=1 rf-dim=100" for a smoke run',
    )
    parser.add_argument(
        "--no-warm-worker",
        dest="warm_worker",
        action="store_false",
        help="the launcher without --warm-worker (a fresh ClientApp process does every message's work)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the walkthrough is stopped")
    parser.add_argument("--keep", default=None, help="work folder to keep (default: a temporary one, removed)")
    parser.add_argument("--out", default=None, help="JSON output (default experiments/results/bench_walkthrough.json)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fcl-bench-walk-") as tmp:
        work = Path(args.keep).expanduser().resolve() if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        run_text = walkthrough_run_config(args.num_nodes, args.num_tasks, args.seed, args.run_extra, work / "results")
        try:
            cfg = parse_run_config(run_text)
        except (ConfigError, ValueError) as err:
            print(f"bench_walkthrough: error: {err}", file=sys.stderr)
            return 2
        began = time.monotonic()
        export_partitions(cfg, work / "data")
        export_seconds = time.monotonic() - began
        command = [
            sys.executable,
            str(ROOT / "deploy" / "local_federation.py"),
            "--workdir",
            str(work / "federation"),
            "--data",
            str(work / "data"),
            "--num-nodes",
            str(args.num_nodes),
            *(["--warm-worker"] if args.warm_worker else []),
            "--run",
            run_text,
        ]
        load_before = os.getloadavg()
        print(f"bench_walkthrough: load average {load_before}; {' '.join(command[1:])}", flush=True)
        timing = run_walkthrough(command, args.timeout, work / "walkthrough.log")
        load_after = os.getloadavg()
        figures = run_figures(cfg.output_dir / "results.json")
    result = {
        "command": ["python", *command[1:]],
        "run_config": run_text,
        "warm_worker": args.warm_worker,
        "num_nodes": args.num_nodes,
        "num_tasks": args.num_tasks,
        "stage1_rounds": cfg.stage1_rounds,
        "export_seconds": export_seconds,
        **timing,
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "target": {
            "seconds": TARGET_SECONDS,
            "at_load_at_most": TARGET_LOAD,
            "met": timing["exit_code"] == 0 and timing["total_seconds"] <= TARGET_SECONDS,
            "load_within": max(load_before[0], load_after[0]) <= TARGET_LOAD,
        },
        **figures,
    }
    out = write_json("bench_walkthrough", result, args.out or RESULTS_DIR / "bench_walkthrough.json")
    print(
        f"walkthrough: {timing['total_seconds']:.1f} s in all (start-up {seconds(timing['startup_seconds'])}, "
        f"run {seconds(timing['run_seconds'])}, stop {seconds(timing['stop_seconds'])}); exit "
        f"{timing['exit_code']}; load {load_before[0]:.2f} -> {load_after[0]:.2f}; wrote {out}"
    )
    return 0 if timing["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
