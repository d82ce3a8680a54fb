"""Framework overhead: STSA statistics stages through Flower + Ray vs the same math in one process.

    python experiments/bench_framework_overhead.py            # ~1-2 min on 2 cores
    python experiments/bench_framework_overhead.py --no-ray   # skip the Ray simulation
    python -m experiments.bench_framework_overhead --rf-dim 2000 --num-clients 20   # issue 16, item 5

Config: STSA on digits, 5 tasks, 5 clients, stage1-rounds 0 (the seeded backbone stays frozen,
so every stage is exactly one statistics round + solve + evaluation), fixed ridge.

* ``direct``: for every client, its partition -> frozen features -> ReLU(F W) -> G, C
  (StatisticsAccumulator), summed on the "server", Cholesky solve, evaluation: plain function
  calls, no messages;
* ``direct + upload checks``: the same, plus what the server must do with every upload however it
  travels: the client packs G's upper triangle in the wire dtype, the server runs its upload checks
  on it (``check_counts``, ``check_packed_statistics``: the PSD test of one (M + c)² Cholesky per
  upload, a security requirement that stays) and adds it to a packed float64 running sum. The
  floor a secure server cannot go below; the table gives each engine's ratio to both floors;
* ``local``: the real strategy and ClientApp, messages delivered in-process (LocalGrid):
  adds message construction, (de)serialisation of records, packing, validation, accounting;
* ``ray``: Flower's Ray simulation (experiments/sim.py): adds Ray actors, inter-process
  transfer and scheduling. Its start-up (Ray + actors) is reported separately.

Per-stage times come from results.json (StageRecord.seconds: first message sent -> evaluation
done). Ratios are per stage, stages 2..T (stage 1 also pays each process's first-use costs).
Writes experiments/results/bench_framework_overhead.json (other sizes:
bench_framework_overhead-M<M>-K<clients>.json).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from experiments.benchlib import format_table, write_json
from fcl_flower.config import RunConfig


def direct_stage_times(cfg: RunConfig, checks: bool = False) -> list[float]:
    """The same statistics, solve and evaluation as STSA, as plain calls in this process.

    ``checks``: also what the server must do with each upload whatever carries it: the client packs
    G's upper triangle in the wire dtype (as it uploads it), the server runs the same upload checks
    on it (``check_counts`` and ``check_packed_statistics``, the PSD test: a security requirement)
    and adds it to a running packed float64 sum, which goes into G once per stage."""
    from fcl_flower.analytic import (
        StatisticsAccumulator,
        packed_length,
        predict,
        random_features,
        random_projection,
        solve_ridge,
    )
    from fcl_flower.analytic.checks import check_counts, check_packed_statistics, wire_epsilon
    from fcl_flower.analytic.packing import add_packed_
    from fcl_flower.metrics import accuracy_by_task  # noqa: F401  (same work as the strategy's evaluation)
    from fcl_flower.protocol import WIRE_DTYPES
    from fcl_flower.runtime import build_model, federated_split, iter_features

    split = federated_split(cfg)
    model = build_model(cfg, split).eval()
    device = torch.device("cpu")
    projection = random_projection(model.backbone.feature_dim, cfg.rf_dim, seed=cfg.seed)
    dim = cfg.rf_dim
    gram = torch.zeros(dim, dim, dtype=torch.float64)
    sums = torch.zeros(dim, split.bundle.num_classes, dtype=torch.float64)
    times = []
    wire = WIRE_DTYPES[cfg.wire_dtype]
    bounds = {"norm_bound": cfg.feature_clip, "nonnegative": projection is not None}
    for task, classes in enumerate(split.tasks):
        began = time.perf_counter()
        packed_sum = torch.zeros(packed_length(dim), dtype=torch.float64) if checks else None
        for client in range(cfg.num_clients):
            acc = StatisticsAccumulator(dim, len(classes), with_gram=True)
            data = split.client_train(task, client, eval_transform=True)
            for features, y in iter_features(model, data, cfg, device):
                acc.update(random_features(features, projection), y - classes.start)
            if packed_sum is None:
                stats = acc.result()
                gram += stats.gram
            else:
                packed = acc.packed_gram(wire)
                stats = acc.result(with_gram=False)
                counts = stats.counts.to(torch.float64)
                check_counts(counts, stats.num_samples)
                check_packed_statistics(
                    packed, stats.class_sums, counts, relative_tolerance=wire_epsilon(packed.dtype), **bounds
                )
                packed_sum += packed
            sums[:, classes.start : classes.stop] += stats.class_sums
        if packed_sum is not None:
            add_packed_(gram, packed_sum)
        weights = solve_ridge(gram, sums[:, : classes.stop], cfg.ridge_value())
        phis, labels = [], []
        for features, y in iter_features(model, split.seen_test(task), cfg, device):
            phis.append(random_features(features, projection))
            labels.append(y)
        predictions = predict(torch.cat(phis), weights, cfg.head)
        _ = float((predictions == torch.cat(labels)).double().mean())
        times.append(time.perf_counter() - began)
    return times


def local_stage_times(cfg: RunConfig) -> tuple[list[float], float]:
    from experiments.sim import run_local

    began = time.perf_counter()
    recorder = run_local(cfg)
    return [s.seconds for s in recorder.stages], time.perf_counter() - began


def ray_stage_times(cfg: RunConfig, num_cpus: float) -> tuple[list[float], float]:
    import json

    from experiments.sim import simulate

    began = time.perf_counter()
    path = simulate(cfg, num_cpus=num_cpus)
    total = time.perf_counter() - began
    return [s["seconds"] for s in json.loads(path.read_text())["stages"]], total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-clients", type=int, default=5)
    parser.add_argument("--num-tasks", type=int, default=5, help="Must divide the 10 digit classes.")
    parser.add_argument("--rf-dim", type=int, default=1000)
    parser.add_argument("--num-cpus", type=float, default=1.0, help="Ray: CPU per simulated client.")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of the in-process engines (direct, local); 0: torch's default. Ray's actors run "
        "with one thread each (OMP_NUM_THREADS = --num-cpus), so --threads 1 compares like with like.",
    )
    parser.add_argument("--out", help="JSON path (default experiments/results/bench_framework_overhead.json).")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from flwr.common.logger import console_handler

    console_handler.setLevel(logging.WARNING)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"fcl-bench-overhead-{os.getpid()}"
    cfg = RunConfig(
        strategy="stsa",
        dataset="digits",
        num_tasks=args.num_tasks,
        num_clients=args.num_clients,
        seed=0,
        stage1_rounds=0,
        rf_dim=args.rf_dim,
        ridge="100.0",
        wire_dtype="float32",
        device="cpu",
        out=str(tmp),
    )
    engines: dict[str, dict[str, Any]] = {}
    began = time.perf_counter()
    stages = direct_stage_times(cfg)
    engines["direct"] = {"stages": stages, "total": time.perf_counter() - began}
    began = time.perf_counter()
    stages = direct_stage_times(cfg, checks=True)
    engines["direct + upload checks"] = {"stages": stages, "total": time.perf_counter() - began}
    stages, total = local_stage_times(cfg.replace(run_name="local"))
    engines["local"] = {"stages": stages, "total": total}
    if not args.no_ray:
        stages, total = ray_stage_times(cfg.replace(run_name="ray"), args.num_cpus)
        engines["ray"] = {"stages": stages, "total": total}
    rows = []

    def later_mean(stages: list[float]) -> float:
        return sum(stages[1:]) / len(stages[1:])

    floor = later_mean(engines["direct"]["stages"])
    floor_checked = later_mean(engines["direct + upload checks"]["stages"])
    for name, result in engines.items():
        later = later_mean(result["stages"])
        rows.append(
            {
                "engine": name,
                "stage 1 s": result["stages"][0],
                "stages 2..T mean s": later,
                "ratio vs direct": later / floor,
                "ratio vs direct + checks": later / floor_checked,
                "run total s": result["total"],
                "outside stages s": result["total"] - sum(result["stages"]),
            }
        )
    columns = ["engine", "stage 1 s", "stages 2..T mean s", "ratio vs direct", "ratio vs direct + checks"]
    print(format_table(rows, [*columns, "run total s", "outside stages s"], floats="{:.2f}"))
    name = "bench_framework_overhead"
    if not (args.rf_dim == 1000 and args.num_clients == 5):
        name += f"-M{args.rf_dim}-K{args.num_clients}"
    if args.threads > 0:
        name += f"-threads{args.threads}"
    path = write_json(
        name,
        {
            "load_average_at_start": load,
            "load_average_at_end": os.getloadavg()[0],
            "settings": {
                "strategy": "stsa",
                "dataset": "digits",
                "num_tasks": args.num_tasks,
                "num_clients": args.num_clients,
                "rf_dim": args.rf_dim,
                "stage1_rounds": 0,
                "ray_num_cpus_per_client": args.num_cpus,
                "wire_dtype": "float32",
                "torch_threads_in_process": torch.get_num_threads(),
            },
            "engines": engines,
            "rows": rows,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
