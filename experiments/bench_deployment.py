"""Rounds on real SuperNodes: a SuperLink and N SuperNodes on loopback, timed round by round.

    python experiments/bench_deployment.py                     # 3 SuperNodes, STSA, default CNN
    python experiments/bench_deployment.py --stage1-rounds 5 --num-tasks 5 --keep /tmp/fcl-bench

What it does (deploy/local_federation.py does the process work):

1. exports each client's share of the digits split into its own folder
   (experiments/export_partitions.py), as in the deploy/README walkthrough;
2. starts ``flower-superlink`` (TLS, SuperNode authentication) and ``--num-nodes``
   ``flower-supernode`` processes on 127.0.0.1, SuperNode k reading only ``data-dir=client-k``;
   ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``, so nothing is installed at run time;
3. submits one ``flwr run`` of STSA with the default CNN backbone (``small-cnn``), first
   ``--stage1-rounds`` FedAvg rounds of the backbone, then one analytic (statistics) round per
   stage, and waits until it finishes;
4. stops every process it started (by PID: the SuperLink, the SuperNodes and their descendants)
   and checks that none survived.

It reads the server's own clock from the run's results.json: ``rounds[i].seconds`` is one round
as the ServerApp sees it (send the instructions, every ClientApp process starts, loads the app and
its data, works and replies, the server checks and aggregates the replies); ``stages[t].seconds``
is a whole stage (its rounds, the solve, the evaluation). A *FedAvg round* is one of stage 1's
training rounds; an *analytic stage* is a later stage (one statistics round, the ridge solve and
the evaluation). The JSON (experiments/results/bench_deployment.json) holds every round and
stage, the machine and the load average before and after; the table prints medians and maxima.
Targets (issue 16, 3 SuperNodes, 2 cores): analytic stage <= 3 s, FedAvg round <= 3 s.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.benchlib import format_table, median, write_json
from experiments.export_partitions import export_partitions
from fcl_flower.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]

TARGET_SECONDS = {"fedavg_round": 3.0, "analytic_stage": 3.0}


def federation_module() -> Any:
    """deploy/local_federation.py (a script folder, not a package)."""
    spec = importlib.util.spec_from_file_location("local_federation", ROOT / "deploy" / "local_federation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def run_config(args: argparse.Namespace, out: Path) -> RunConfig:
    return RunConfig(
        strategy="stsa",
        dataset="digits",
        backbone="small-cnn",
        num_tasks=args.num_tasks,
        num_clients=args.num_nodes,
        stage1_rounds=args.stage1_rounds,
        local_epochs=args.local_epochs,
        rf_dim=args.rf_dim,
        device="cpu",
        out=str(out),
        run_name="bench-deployment",
        round_timeout=600.0,
        overwrite=True,
    ).validated()


def process_rss_mib(pids: list[int]) -> float:
    """Summed resident memory of ``pids`` now (MiB; Linux /proc)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS"):
                    total += int(line.split()[1])
    return total / 1024


def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    fed = federation_module()
    cfg = run_config(args, workdir / "out")
    data = workdir / "data"
    began = time.monotonic()
    export_partitions(cfg, data)
    export_seconds = time.monotonic() - began
    load_before = os.getloadavg()
    federation = fed.LocalFederation(workdir / "federation", fed.node_configs_for(args.num_nodes, data))
    with federation:
        began = time.monotonic()
        federation.start(say=lambda line: print(f"  {line}", flush=True))
        startup_seconds = time.monotonic() - began
        began = time.monotonic()
        run_id = federation.submit(cfg.to_mapping())
        submit_seconds = time.monotonic() - began
        print(f"  run {run_id} submitted; waiting for it ...", flush=True)
        status = federation.wait_run(run_id, timeout=args.timeout)
        run_seconds = time.monotonic() - began
        core_rss = process_rss_mib([p.pid for p in federation.core.values()])
        if status != "finished:completed":
            raise SystemExit(f"error: run {run_id} {status}:\n{federation.run_log(run_id)[-3000:]}")
    survivors = federation.surviving()
    if survivors:
        raise SystemExit(f"error: processes survived the stop: {survivors}")
    load_after = os.getloadavg()
    results = json.loads((cfg.output_dir / "results.json").read_text())
    rounds, stages = results["rounds"], results["stages"]
    train_rounds = [r["seconds"] for r in rounds[: cfg.stage1_rounds]]
    stats_round_1 = rounds[cfg.stage1_rounds]["seconds"]
    analytic = [s["seconds"] for s in stages[1:]]
    return {
        "config": {k: v for k, v in cfg.to_mapping().items() if k not in ("out",)},
        "num_nodes": args.num_nodes,
        "fedavg_round_seconds": train_rounds,
        "stage1_statistics_round_seconds": stats_round_1,
        "analytic_stage_seconds": analytic,
        "analytic_round_seconds": [r["seconds"] for r in rounds[cfg.stage1_rounds + 1 :]],
        "stage_seconds": [s["seconds"] for s in stages],
        "rounds": rounds,
        "accuracy": [s["accuracy"] for s in stages],
        "export_seconds": export_seconds,
        "federation_startup_seconds": startup_seconds,
        "submit_seconds": submit_seconds,
        "run_wall_seconds": run_seconds,
        "superlink_supernodes_rss_mib_at_end": core_rss,
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "targets_seconds": TARGET_SECONDS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-nodes", type=int, default=3, help="SuperNodes (one client each)")
    parser.add_argument("--num-tasks", type=int, default=5, help="stages: 1 with FedAvg rounds, the rest analytic")
    parser.add_argument("--stage1-rounds", type=int, default=3, help="FedAvg rounds of the backbone in stage 1")
    parser.add_argument("--local-epochs", type=int, default=2, help="local epochs per FedAvg round (default 2)")
    parser.add_argument("--rf-dim", type=int, default=1000, help="random-feature dimension M (default 1000)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the run")
    parser.add_argument("--keep", default=None, help="work folder to keep (default: a temporary one, removed)")
    parser.add_argument("--out", default=None, help="JSON output (default experiments/results/bench_deployment.json)")
    args = parser.parse_args(argv)
    if args.stage1_rounds < 1 or args.num_tasks < 2:
        parser.error("need --stage1-rounds >= 1 and --num-tasks >= 2 (a FedAvg round and an analytic stage)")
    print(f"bench_deployment: {args.num_nodes} SuperNodes on loopback, load average {os.getloadavg()}")
    if args.keep:
        workdir = Path(args.keep).expanduser().resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        result = bench(args, workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="fcl-bench-deploy-") as tmp:
            result = bench(args, Path(tmp))
    rows = []
    for name, values in (
        ("FedAvg round (stage 1)", result["fedavg_round_seconds"]),
        ("analytic stage (stages 2..)", result["analytic_stage_seconds"]),
        ("  its statistics round", result["analytic_round_seconds"]),
    ):
        target = TARGET_SECONDS.get("fedavg_round" if "FedAvg" in name else "analytic_stage", float("nan"))
        rows.append(
            {
                "what": name,
                "n": len(values),
                "median s": median(values),
                "max s": max(values),
                "target s": target if not name.startswith("  ") else "",
            }
        )
    print(format_table(rows, ["what", "n", "median s", "max s", "target s"], floats="{:.2f}"))
    print(
        f"federation start {result['federation_startup_seconds']:.1f} s, flwr run submit {result['submit_seconds']:.1f} s, "
        f"whole run {result['run_wall_seconds']:.1f} s; load average before {result['load_average_before'][0]:.2f}, "
        f"after {result['load_average_after'][0]:.2f} (1 min)"
    )
    print(f"wrote {write_json('bench_deployment', result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
