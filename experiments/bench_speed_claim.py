"""The speed claim, measured in one run: wall time of every stage after stage 1 of the analytic
methods (stsa, stsa-e, fedran) against the gradient ones (target, lander, lga, stamp, finetune),
each at its own paper's schedule, on the same data, partitions and clients.

    python experiments/bench_speed_claim.py                    # the papers' schedules (hours on 2 cores)
    python experiments/bench_speed_claim.py --quick            # a ~1-minute smoke run (tiny schedules, JSON to $TMPDIR)
    python experiments/bench_speed_claim.py --strategies stsa lander --budget-s 3600

What is scaled and what is not. The papers measure ResNet-18 on CIFAR-100 on a GPU (STSA
Table 5: after stage 1, STSA < 3 min vs LANDER > 10 h, "over 80 times faster"; FedRAN Table 5:
190.3x on average over the gradient baselines). Here only the *data* is scaled: digits (1,347
training images, 5 tasks of 2 classes, 5 clients, Dirichlet beta 0.5) instead of CIFAR-100,
with the small CNN that fits 8x8 images; the *schedules* are the papers' (``SCHEDULES``: rounds
per task, local epochs, batch size, generator rounds x iterations x batch, student steps, proxy
iterations, random-feature size M, rank r, dummy clients). Exemplar memories (LGA, STAMP: 2,000
of CIFAR-100's 50,000 images) are scaled with the data to 54. Every method runs through the real
ServerApp logic and ClientApp on the in-process grid (no Ray start-up), one after the other in
this process, with the same torch thread count (``--threads``, default 1: on a shared 2-core
machine one thread is faster and far steadier than two).

Nothing is extrapolated. A method's run stops after ``--max-post-stages`` stages after the first
or, once at least one is measured, when its wall time passes ``--budget-s``; the JSON and the
table say how many post-stages were measured. A stage's wall time covers all its rounds (every
client's work, done one after the other here), aggregation, the end-of-stage work (ridge solve;
TARGET/LANDER's generator for the next task; LGA's proxy) and the evaluation. Both its wall
time and this process's CPU time are recorded (one torch thread, everything in this process): on
a machine shared with other jobs the CPU time is what the work cost, the wall time also counts the
waits for a core, so the load averages at each method's start and end are recorded too.
Writes experiments/results/bench_speed_claim.json (machine, load averages, settings, every
stage's seconds, ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import logging
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from threadpoolctl import threadpool_limits

from experiments.benchlib import format_table, write_json
from fcl_flower.config import RunConfig

ANALYTIC = ("stsa", "stsa-factor", "stsa-e", "fedran")
GRADIENT = ("target", "lander", "lga", "stamp", "finetune")
MEMORY = round(2000 * 1347 / 50000)  # the papers' 2,000 exemplars of CIFAR-100, scaled to digits

#: The data, partitions and stage 1 every method shares (STSA/LANDER's ResNet CIFAR-100 setting).
COMMON: dict[str, Any] = {
    "dataset": "digits",
    "backbone": "small-cnn",
    "num-tasks": 5,
    "num-clients": 5,
    "beta": 0.5,
    "seed": 0,
    "stage1-rounds": 100,
    "local-epochs": 2,
    "lr": 0.04,
    "batch-size": 128,
    "weighted-fedavg": False,
    "device": "cpu",
}

#: Each method's own paper/code schedule (docs/method_notes_target_lander.md §5 lists the sources).
SCHEDULES: dict[str, dict[str, Any]] = {
    # STSA Table 5 (ResNet-18): M = 5000, gamma = 1e4, K_D = 50; one statistics round per stage
    "stsa": {"rf-dim": 5000, "ridge": "10000", "head": "cosine", "wire-dtype": "float32"},
    "stsa-e": {"rf-dim": 5000, "ridge": "10000", "head": "cosine", "dummy-clients": 50},
    # the same STSA, each client's statistics uploaded as its rotated [Φ Y] where that is smaller
    "stsa-factor": {
        "rf-dim": 5000,
        "ridge": "10000",
        "head": "cosine",
        "wire-dtype": "float32",
        "stats-form": "factor",
    },
    # FedRAN Tables 3-5 (ResNet-18): M = 8192, r = 2048, lambda = 1e-3, fp64 uploads
    "fedran": {"rf-dim": 8192, "rank": 2048, "ridge": "0.001", "head": "dot", "wire-dtype": "float64"},
    # the STSA/FedRAN baselines' code: 100 rounds x 2 local epochs per task
    "finetune": {"rounds-per-task": 100},
    # TARGET code, CIFAR-100 branch: 10 synthesis rounds x 10 iterations x 256 images, warm-up 20
    # (so no student / adversarial term), bn 10, client KD weight 25
    "target": {
        "rounds-per-task": 100,
        "generator-rounds": 10,
        "generator-steps": 10,
        "generator-warmup": 20,
        "synthesis-batch": 256,
        "generator-bn": 10.0,
        "student-steps": 400,
        "kd-weight": 25.0,
    },
    # LANDER code defaults: 40 + 10 warm-up synthesis rounds x 40 iterations x 256, student 50 steps
    "lander": {
        "rounds-per-task": 100,
        "generator-rounds": 40,
        "generator-steps": 40,
        "generator-warmup": 10,
        "synthesis-batch": 256,
        "generator-bn": 1.0,
        "student-steps": 50,
        "text-encoder": "name-hash",
    },
    # LGA paper: 10 rounds per task x 20 local epochs, 250 L-BFGS inversion steps
    "lga": {
        "stage1-rounds": 10,
        "rounds-per-task": 10,
        "local-epochs": 20,
        "memory-size": MEMORY,
        "proxy-iterations": 250,
    },
    # STAMP paper: 25 rounds per task x 5 local epochs, lr 0.005, no momentum / weight decay
    "stamp": {
        "stage1-rounds": 25,
        "rounds-per-task": 25,
        "local-epochs": 5,
        "lr": 0.005,
        "momentum": 0.0,
        "weight-decay": 0.0,
        "memory-size": MEMORY,
        "gm-c": 0.5,
    },
}

#: --quick: the same code paths with tiny schedules (a smoke run, not a measurement of the claim).
QUICK: dict[str, Any] = {
    "stage1-rounds": 2,
    "rounds-per-task": 2,
    "local-epochs": 1,
    "generator-rounds": 2,
    "generator-steps": 2,
    "generator-warmup": 1,
    "synthesis-batch": 32,
    "student-steps": 2,
    "proxy-iterations": 5,
    "rf-dim": 500,
    "rank": 100,
    "dummy-clients": 5,
}

PAPER_CLAIMS = {
    "stsa": "STSA Table 5 (ResNet-18, CIFAR-100, 10 tasks, RTX 3090): whole process after stage 1 "
    "STSA / STSA-E < 3 min vs LANDER > 10 h; text: 'over 80 times faster than LANDER'",
    "fedran": "FedRAN Table 5 (ResNet-18, RTX A5000): per client per task FedRAN 3.54 s vs finetune 322.28 s "
    "on CIFAR-100; 190.3x faster on average than the gradient baselines",
}


class _Enough(Exception):
    """Raised after a stage is recorded once the run has measured what it was asked to."""


#: Rows that run another method's strategy with other settings: row name -> strategy.
VARIANTS = {"stsa-factor": "stsa"}


def config_for(strategy: str, out: Path, *, quick: bool, common: dict[str, Any] | None = None) -> RunConfig:
    """The run of row ``strategy`` (a method, or a variant of one: :data:`VARIANTS`)."""
    method = VARIANTS.get(strategy, strategy)
    values = {**(common or COMMON), **SCHEDULES[strategy], "strategy": method, "out": str(out), "run-name": strategy}
    if quick:
        values.update(QUICK)
    return RunConfig.from_mapping(values)


def measure(
    cfg: RunConfig, *, max_post_stages: int, budget_s: float, profiler: cProfile.Profile | None = None
) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds) of every stage run: stage 1, then post-stages until enough are measured.

    Wall time is results.json's ``seconds``. CPU time is this process's (server and every client
    run here, one torch thread): on a machine shared with other jobs it is what the work cost,
    where wall time also counts the waiting for a core."""
    from clients.app import app as client_app
    from fcl_flower.local_grid import LocalGrid
    from fcl_flower.results import ResultsRecorder, StageRecord
    from fcl_flower.runtime import federated_split
    from strategies import build_strategy

    recorder = ResultsRecorder(cfg.output_dir, cfg.strategy, cfg.to_mapping())
    strategy = build_strategy(cfg, federated_split(cfg), recorder)
    began = time.perf_counter()
    cpu_marks = [time.process_time()]
    add = recorder.add

    def add_and_check(record: StageRecord) -> None:
        cpu_marks.append(time.process_time())
        add(record)
        post = len(recorder.stages) - 1
        if profiler is not None and post == 0:
            profiler.enable()  # the post-stages only
        if post >= max_post_stages or (post >= 1 and time.perf_counter() - began > budget_s):
            raise _Enough

    recorder.add = add_and_check  # type: ignore[method-assign]  # stops the stage loop early
    try:
        with contextlib.suppress(_Enough):
            strategy.start(LocalGrid(client_app, cfg.num_clients))
    finally:
        if profiler is not None:
            profiler.disable()
    return [s.seconds for s in recorder.stages], [b - a for a, b in itertools.pairwise(cpu_marks)]


def top_functions(profiler: cProfile.Profile, count: int = 15) -> dict[str, list[dict[str, Any]]]:
    """The ``count`` functions with the most own time and the most cumulative time (summed over the
    post-stages profiled)."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # {(file, line, name): (cc, nc, tt, ct, callers)}
    entries = [
        {"function": f"{Path(file).name}:{line}({name})", "calls": nc, "own s": tt, "cumulative s": ct}
        for (file, line, name), (_, nc, tt, ct, _) in stats.items()
    ]
    return {
        "by own time": sorted(entries, key=lambda e: -e["own s"])[:count],
        "by cumulative time": sorted(entries, key=lambda e: -e["cumulative s"])[:count],
    }


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Gradient / analytic mean post-stage seconds (wall and CPU), for every pair measured."""
    return [
        {
            "analytic": a["strategy"],
            "gradient": g["strategy"],
            "ratio (wall)": g["mean post-stage s"] / a["mean post-stage s"],
            "ratio (CPU)": g["mean post-stage cpu s"] / a["mean post-stage cpu s"],
            "gradient post-stages measured": g["post-stages"],
        }
        for a in rows
        if a["kind"] == "analytic" and a["post-stages"]
        for g in rows
        if g["kind"] == "gradient" and g["post-stages"]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", default=[*ANALYTIC, *GRADIENT])
    parser.add_argument("--max-post-stages", type=int, default=4, help="Stages after the first to measure (4 = all).")
    parser.add_argument(
        "--budget-s", type=float, default=1800.0, help="Per method: stop after the stage that passes this wall time."
    )
    parser.add_argument("--backbone", default=COMMON["backbone"], help="e.g. resnet18-cifar, the papers' backbone.")
    parser.add_argument(
        "--analytic-stage1-rounds",
        type=int,
        default=COMMON["stage1-rounds"],
        help="FedAvg rounds of the analytic methods' stage 1 (it precedes every measured stage and does not "
        "enter their post-stage time; 0 keeps the seeded backbone).",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the same for every method).")
    parser.add_argument("--quick", action="store_true", help="Tiny schedules: checks the script, measures nothing.")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="Also record where each method's post-stage time goes (cProfile over the post-stages: top functions "
        "by own and by cumulative time); profiling slows the run, so take timings from a run without it.",
    )
    parser.add_argument(
        "--out", help="JSON path (default experiments/results/bench_speed_claim[_<backbone>].json; --quick: $TMPDIR)."
    )
    args = parser.parse_args(argv)
    import torch
    from flwr.common.logger import console_handler

    torch.set_num_threads(args.threads)
    # NumPy's and SciPy's BLAS pools too: their idle workers spin on the other core after a call,
    # which adds CPU time (about 1.9 s a stage for stsa-factor) but no speed
    threadpool_limits(args.threads)
    console_handler.setLevel(logging.WARNING)
    load_start = os.getloadavg()
    began = time.perf_counter()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"fcl-bench-speed-{os.getpid()}"
    common = {**COMMON, "backbone": args.backbone}
    name = "bench_speed_claim" + ("" if args.backbone == COMMON["backbone"] else f"_{args.backbone}")
    out = args.out or (str(tmp / f"{name}_quick.json") if args.quick else None)
    rows: list[dict[str, Any]] = []

    def write(complete: bool) -> Path:
        """The JSON so far: rewritten after every method, so a long run that is stopped keeps what it measured."""
        return write_json(
            name,
            {
                "complete": complete,
                "quick": args.quick,
                "threads": args.threads,
                "load_average_at_start": list(load_start),
                "load_average_now": list(os.getloadavg()),
                "total_seconds": time.perf_counter() - began,
                "engine": "in-process LocalGrid (real ServerApp logic and ClientApp, no Ray)",
                "common": common,
                "analytic_stage1_rounds": args.analytic_stage1_rounds,
                "max_post_stages": args.max_post_stages,
                "budget_s": args.budget_s,
                "methods": rows,
                "ratios": summary(rows),
                "paper_claims": PAPER_CLAIMS,
            },
            out,
        )

    for strategy in args.strategies:
        method_common = dict(common)
        if strategy in ANALYTIC:
            method_common["stage1-rounds"] = args.analytic_stage1_rounds
        cfg = config_for(strategy, tmp, quick=args.quick, common=method_common)
        load = os.getloadavg()[0]
        profiler = cProfile.Profile() if args.profile else None
        stages, cpu = measure(cfg, max_post_stages=args.max_post_stages, budget_s=args.budget_s, profiler=profiler)
        post, post_cpu = stages[1:], cpu[1:]
        row = {
            "strategy": strategy,
            "kind": "analytic" if strategy in ANALYTIC else "gradient",
            "stage 1 s": stages[0],
            "post-stages": len(post),
            "mean post-stage s": statistics.fmean(post) if post else float("nan"),
            "median post-stage s": statistics.median(post) if post else float("nan"),
            "mean post-stage cpu s": statistics.fmean(post_cpu) if post_cpu else float("nan"),
            "load at start": load,
            "load at end": os.getloadavg()[0],
            "stage_seconds": stages,
            "stage_cpu_seconds": cpu,
            "settings": cfg.to_mapping(),
        }
        if profiler is not None:
            row["profile"] = top_functions(profiler)
        rows.append(row)
        print(
            f"  {strategy}: stage 1 {stages[0]:.1f} s; {len(post)} post-stage(s), mean {row['mean post-stage s']:.2f} s "
            f"wall, {row['mean post-stage cpu s']:.2f} s CPU (load {load:.1f} -> {row['load at end']:.1f})",
            flush=True,
        )
        write(complete=False)
    columns = [
        "strategy",
        "kind",
        "post-stages",
        "mean post-stage s",
        "mean post-stage cpu s",
        "stage 1 s",
        "load at start",
        "load at end",
    ]
    print(format_table(rows, columns, floats="{:.2f}"))
    print(
        format_table(
            summary(rows),
            ["analytic", "gradient", "ratio (wall)", "ratio (CPU)", "gradient post-stages measured"],
            floats="{:.1f}",
        )
    )
    print(f"wrote {write(complete=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
