"""What differential privacy costs: the accuracy-ε curve of the analytic methods on digits.

    python experiments/privacy_curve.py                  # 4 methods x 6 ε x 5 seeds: 120 runs (6-10 min on 2 shared cores)
    python experiments/privacy_curve.py --seeds 0 --epsilons 1 8 inf --strategies stsa   # a quick look

Every run goes through the real ServerApp logic and ClientApp in this process (``LocalGrid``,
one torch thread). Setting: digits, 5 tasks of 2 classes, 5 clients, beta 0.5, the seeded small
CNN kept frozen (``stage1-rounds 0``: no FedAvg round, so the (ε, δ) guarantee covers everything
that leaves a client), M = 200 random features clipped to ‖φ‖ ≤ B = 1 (every feature of this
backbone is longer, so clipping normalises them), ridge by GCV, and (ε, δ = 1e-5) for the whole
run (``dp-scope run``: the composition of the 5 stages' releases, PLD accountant). ε = inf is the
same pipeline without noise (clipping included). ``stsa (secure)`` is STSA under secure
aggregation, whose clients add shares of the noise (docs/privacy.md §6.3). The noise is seeded
(``noise-seeded``) so the curve can be re-run number for number; its distribution is the
deployed one.

Writes experiments/results/privacy_curve.{json,csv,png}: per (method, ε), A_T and A_avg mean ±
sample std over the seeds, the ε the accountant reports as spent (worst client, largest over
the seeds), and the cost: A_T(inf) − A_T(ε).
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from experiments.benchlib import RESULTS_DIR, format_table, write_json
from fcl_flower.config import RunConfig

EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, math.inf)
METHODS: dict[str, dict[str, Any]] = {
    "stsa": {"strategy": "stsa"},
    "stsa (secure)": {"strategy": "stsa", "secure_aggregation": True},
    "stsa-e": {"strategy": "stsa-e"},
    "fedran": {"strategy": "fedran"},
}
SETTING: dict[str, Any] = dict(
    dataset="digits",
    num_tasks=5,
    num_clients=5,
    beta=0.5,
    stage1_rounds=0,
    rf_dim=200,
    feature_clip=1.0,
    ridge="auto",
    dummy_clients=1,
    rank=256,
    dp_delta=1e-5,
    dp_scope="run",
    dp_accountant="pld",
    noise_seeded=True,
    device="cpu",
)


def config(method: str, epsilon: float, seed: int, out: Path) -> RunConfig:
    name = f"{method.replace(' (secure)', '-secure')}-eps{epsilon:g}-seed{seed}"
    dp = {} if math.isinf(epsilon) else {"dp_epsilon": float(epsilon)}
    return RunConfig(**SETTING, **METHODS[method], **dp, seed=seed, out=str(out), run_name=name).validated()


def run(cfg: RunConfig) -> dict[str, Any]:
    from experiments.sim import run_local

    began = time.perf_counter()
    recorder = run_local(cfg)
    data = recorder.to_dict()
    privacy = data["stages"][-1]["extra"].get("privacy", {})
    return {
        "A_T": float(data["A_T"]),
        "A_avg": float(data["A_avg"]),
        "epsilon_spent": float(privacy.get("epsilon_spent", math.inf)),
        "noise_multiplier": privacy.get("noise_multiplier"),
        "failed_stages": sum(1 for s in data["stages"] if "failed" in s["extra"]),
        "left_out": sum(len(s["left_out"]) for s in data["stages"]),
        "seconds": time.perf_counter() - began,
    }


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for method in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == method]
        clean = [r["A_T"] for r in mine if math.isinf(r["epsilon"])]
        reference = statistics.fmean(clean) if clean else math.nan
        for epsilon in dict.fromkeys(r["epsilon"] for r in mine):
            point = [r for r in mine if r["epsilon"] == epsilon]
            a_t, a_t_std = mean_std([r["A_T"] for r in point])
            a_avg, a_avg_std = mean_std([r["A_avg"] for r in point])
            rows.append(
                {
                    "method": method,
                    "epsilon": epsilon,
                    "seeds": len(point),
                    "A_T": a_t,
                    "A_T_std": a_t_std,
                    "A_avg": a_avg,
                    "A_avg_std": a_avg_std,
                    "cost_A_T": reference - a_t,
                    "epsilon_spent_max": max(r["epsilon_spent"] for r in point),
                    "noise_multiplier": point[0]["noise_multiplier"],
                    "failed_stages": sum(r["failed_stages"] for r in point),
                    "seconds_mean": statistics.fmean(r["seconds"] for r in point),
                }
            )
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = sorted({r["epsilon"] for r in rows if not math.isinf(r["epsilon"])})
    x_inf = (finite[-1] * 2.5) if finite else 1.0
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["epsilon"])
        xs = [x_inf if math.isinf(r["epsilon"]) else r["epsilon"] for r in mine]
        ys, es = [r["A_T"] for r in mine], [r["A_T_std"] for r in mine]
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=method)
    ax.set_xscale("log")
    ticks = [*finite, x_inf]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in finite] + ["∞"])
    ax.set_xlabel("ε for the whole run (δ = 1e-5)")
    ax.set_ylabel("final accuracy A_T (%)")
    ax.set_title("digits, 5 tasks, 5 clients: accuracy vs ε (mean ± std over seeds)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--epsilons", nargs="+", type=float, default=list(EPSILONS), help="'inf': no noise")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", default=str(Path("~/fcl-flower-results/privacy_curve").expanduser()))
    parser.add_argument("--results", default=str(RESULTS_DIR), help="Folder for privacy_curve.{json,csv,png}.")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from flwr.common.logger import console_handler

    console_handler.setLevel(logging.WARNING)  # one line per run instead of Flower's per-round INFO lines
    out, results = Path(args.out), Path(args.results)
    load_start, began = os.getloadavg(), time.perf_counter()
    runs = []
    for method in args.strategies:
        for epsilon in args.epsilons:
            for seed in args.seeds:
                record = {"method": method, "epsilon": epsilon, "seed": seed, **run(config(method, epsilon, seed, out))}
                runs.append(record)
                print(
                    f"{method:>14} ε={epsilon:<5g} seed {seed}: A_T {record['A_T']:6.2f}  "
                    f"ε spent {record['epsilon_spent']:.3f}  ({record['seconds']:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    rows = summarise(runs)
    columns = ["method", "epsilon", "seeds", "A_T", "A_T_std", "A_avg", "A_avg_std", "cost_A_T", "epsilon_spent_max"]
    print(format_table(rows, columns, floats="{:.2f}"))
    results.mkdir(parents=True, exist_ok=True)
    with open(results / "privacy_curve.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, results / "privacy_curve.png")
    setting = {k: v for k, v in SETTING.items() if k != "device"}
    wall = time.perf_counter() - began
    timing = {"wall_seconds": wall, "load_average_start": list(load_start), "load_average_end": list(os.getloadavg())}
    data = {"setting": setting, **timing, "rows": rows, "runs": runs}
    write_json("privacy_curve", data, results / "privacy_curve.json")
    print(
        f"{len(runs)} runs in {wall:.0f} s (load average {load_start[0]:.1f} at the start); "
        f"wrote {results}/privacy_curve.{{json,csv,png}}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
