"""Analytic vs gradient: wall time of one stage after the first, same data, same clients.

    python experiments/bench_analytic_vs_gradient.py          # ~1-2 min on 2 cores (digits)
    python experiments/bench_analytic_vs_gradient.py --quick
    python experiments/bench_analytic_vs_gradient.py --dataset cifar100 --backbone resnet18-cifar \
        --num-tasks 10 --first-task-classes 0 --rf-dim 5000 --dummy-clients 50 --rank 2048 \
        --stage1-rounds 100 --rounds-per-task 100 --device cuda     # the paper's setting (data + GPU)

Every strategy runs the same config through the real ClientApp (in-process grid, no Ray, so
the framework's start-up does not blur the comparison). Tasks: 4 + 3 + 3 digit classes, 5
clients, beta 0.5, small CNN trained on task 1. The timed stage is stage 2 of 3: for
``stsa``/``stsa-e``/``fedran`` one statistics round + the server solve + evaluation; for
``finetune``/``lwf``/``ewc`` ``rounds-per-task`` FedAvg rounds of ``local-epochs`` epochs +
evaluation (EWC also its Fisher round). The ratio is gradient time / analytic time.

The papers' 80-190x compare against 100 rounds x 2 epochs per task on ResNet-18/ViT; here the
schedule is ``--rounds-per-task`` x ``--local-epochs`` (default 5 x 2) on a small CNN, and a
gradient stage's time grows linearly in rounds x epochs, so the JSON also gives the ratio
scaled to the papers' 100 x 2 (``ratio_at_paper_schedule``).
Writes experiments/results/bench_analytic_vs_gradient.json.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from experiments.benchlib import format_table, write_json
from fcl_flower.config import RunConfig

ANALYTIC = ("stsa", "stsa-e", "fedran")
GRADIENT = ("finetune", "lwf", "ewc")
PAPER_ROUNDS_X_EPOCHS = 100 * 2


def run_stage_times(cfg: RunConfig) -> tuple[list[float], float]:
    """(seconds of every stage, total wall time) of one in-process run."""
    from experiments.sim import run_local

    began = time.perf_counter()
    recorder = run_local(cfg)
    return [s.seconds for s in recorder.stages], time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dataset", default="digits", help="Any registered dataset; e.g. cifar100 on a machine that has it."
    )
    parser.add_argument("--backbone", default="small-cnn", help="e.g. resnet18-cifar with --dataset cifar100.")
    parser.add_argument("--num-tasks", type=int, default=3)
    parser.add_argument("--first-task-classes", type=int, default=4, help="0: equal tasks.")
    parser.add_argument("--data-root", default="")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--strategies", nargs="+", default=[*ANALYTIC, *GRADIENT])
    parser.add_argument("--num-clients", type=int, default=5)
    parser.add_argument("--rf-dim", type=int, default=1000)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--dummy-clients", type=int, default=10)
    parser.add_argument("--stage1-rounds", type=int, default=2)
    parser.add_argument("--rounds-per-task", type=int, default=5)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="rf-dim 300, 2 rounds x 1 epoch.")
    parser.add_argument("--out", help="JSON path (default experiments/results/bench_analytic_vs_gradient.json).")
    args = parser.parse_args(argv)
    if args.quick:
        args.rf_dim, args.rank, args.rounds_per_task, args.local_epochs, args.stage1_rounds = 300, 100, 2, 1, 1
    load = os.getloadavg()[0]
    from flwr.common.logger import console_handler

    console_handler.setLevel(logging.WARNING)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"fcl-bench-avg-{os.getpid()}"
    base = RunConfig(
        dataset=args.dataset,
        backbone=args.backbone,
        num_tasks=args.num_tasks,
        first_task_classes=args.first_task_classes,
        num_clients=args.num_clients,
        seed=0,
        stage1_rounds=args.stage1_rounds,
        rounds_per_task=args.rounds_per_task,
        local_epochs=args.local_epochs,
        rf_dim=args.rf_dim,
        rank=args.rank,
        data_root=args.data_root,
        dummy_clients=args.dummy_clients,
        ridge="100.0",
        device=args.device,
        out=str(tmp),
    )
    rows: list[dict[str, Any]] = []
    for name in args.strategies:
        cfg = base.replace(strategy=name)
        stages, total = run_stage_times(cfg)
        rows.append(
            {
                "strategy": name,
                "kind": "analytic" if name in ANALYTIC else "gradient",
                "stage 1 s": stages[0],
                "stage 2 s": stages[1],
                "stage 3 s": stages[2],
                "total s": total,
            }
        )
        print(f"  {name}: stage 2 took {stages[1]:.2f} s", flush=True)
    print(format_table(rows, ["strategy", "kind", "stage 1 s", "stage 2 s", "stage 3 s", "total s"], floats="{:.2f}"))
    ratios = []
    scale = PAPER_ROUNDS_X_EPOCHS / (args.rounds_per_task * args.local_epochs)
    for a in (r for r in rows if r["kind"] == "analytic"):
        for g in (r for r in rows if r["kind"] == "gradient"):
            ratio = g["stage 2 s"] / a["stage 2 s"]
            ratios.append(
                {
                    "analytic": a["strategy"],
                    "gradient": g["strategy"],
                    "ratio": ratio,
                    "ratio_at_paper_schedule": ratio * scale,
                }
            )
    print(format_table(ratios, ["analytic", "gradient", "ratio", "ratio_at_paper_schedule"], floats="{:.1f}"))
    print(
        f"(gradient stage = {args.rounds_per_task} rounds x {args.local_epochs} epochs; the papers' 100 x 2 "
        f"would multiply the gradient side by {scale:g})"
    )
    path = write_json(
        "bench_analytic_vs_gradient",
        {
            "load_average_at_start": load,
            "settings": {
                k: getattr(args, k)
                for k in (
                    "dataset",
                    "backbone",
                    "num_tasks",
                    "first_task_classes",
                    "num_clients",
                    "rf_dim",
                    "rank",
                    "dummy_clients",
                    "stage1_rounds",
                    "rounds_per_task",
                    "local_epochs",
                    "device",
                )
            }
            | {"engine": "in-process LocalGrid", "timed_stage": 2},
            "stages": rows,
            "ratios": ratios,
            "paper_claims": "STSA: > 80x faster than LANDER, 120x than PILoRA after stage 1; FedRAN: 190.3x mean "
            "over gradient baselines (96.9x / 246.9x / 227.2x)",
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
