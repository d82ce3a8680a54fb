"""Framework overhead: STSA statistics stages through Flower + Ray vs the same math in one process.

    python experiments/bench_framework_overhead.py            # ~1-2 min on 2 cores
    python experiments/bench_framework_overhead.py --no-ray   # skip the Ray simulation
    python -m experiments.bench_framework_overhead --rf-dim 2000 --num-clients 20   # issue 30's target
    python -m experiments.bench_framework_overhead --server-scaling --rf-dim 4000   # server work, K = 10..50
    python -m experiments.bench_framework_overhead --rf-dim 2000 --num-clients 20 --stats-form factor
        # the same with factor uploads (stats-form factor: ~14 rows of F = O[Φ Y] a client and stage)

Config: STSA on digits, 5 tasks, 5 clients, stage1-rounds 0 (the seeded backbone stays frozen,
so every stage is exactly one statistics round + solve + evaluation), fixed ridge.

* ``floor``: the same math done directly in plain torch (features, per-client G_k = ΦᵀΦ and
  C_k, their sum, one Cholesky solve, predict): what any implementation has to do;
* ``direct``: the project's own functions as plain calls (StatisticsAccumulator, its packed G
  summed over the stage's clients and added into the running G once, solve_ridge, predict), no
  messages;
* ``direct + upload checks``: the same, plus what the server must do with every upload however it
  travels: the client packs G's upper triangle in the wire dtype, the server screens it
  (``check_counts``, ``screen_packed_statistics``: O(M²)) and adds it to a packed float64 running
  sum, and certifies the stage's sum once (``check_packed_statistics``: one (M + c)² factorisation);
* ``local``: the real strategy and ClientApp, messages delivered in-process (LocalGrid):
  adds message construction, (de)serialisation of records, packing, validation, accounting;
* ``ray``: Flower's Ray simulation (experiments/sim.py): adds Ray actors, inter-process
  transfer and scheduling. Its start-up (Ray + actors) is reported separately;
* ``flower floor (local)`` and ``flower floor (ray)``: Flower's transport floor on each of those
  two engines (experiments/transport_floor.py): a minimal Flower app (ServerApp + a ClientApp that
  imports only flwr and numpy) with one round per stage, in which every node answers at once with
  ONE float32 array of the real upload's length (M(M+1)/2 + M·c + c, c = the stage's classes;
  ones, built once per process) and the server views each reply's array and adds it into float64
  running sums, pulling replies as the project's server does. No features, checks, solve or
  evaluation: what moving the uploads through Flower costs on that engine, on the same settings
  (the LocalGrid with K nodes; the Ray simulation with K SuperNodes, ``--num-cpus`` per client and
  experiments/sim.py's backend config). ``local`` and ``ray`` are also given as ratios to their
  own transport floor (``ratio vs flower floor``) and seconds above it. ``--no-ray`` skips both
  Ray engines.

The engines run alternately, ``--repeats`` times each (A B C D E F G, A B C D E F G, ...); per-stage
times come from results.json for the Flower engines (StageRecord.seconds: first message sent ->
evaluation done), and from the floor app's server clock (first message sent -> last reply folded). The figure of an engine is the median over its repeats and stages 2..T (stage 1
also pays each process's first-use costs); ratios are to the floor's. The load average is written
down before and after every run.

``--server-scaling``: the server's own work on one stage of synthetic honest uploads (K clients,
each n = 20 random ReLU feature rows, packed float32 as on the wire) for K = 10, 20, 30, 40, 50:
per upload screen + add, then the certificate of the sum and one solve; least-squares fit
T(K) = a + b·K, next to the time of adding alone (writes bench_server_scaling-M<M>.json).
Writes experiments/results/bench_framework_overhead.json (other sizes:
bench_framework_overhead-M<M>-K<clients>.json; ``-threads<T>`` with ``--threads``, ``-factor``
with ``--stats-form factor``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from experiments.benchlib import format_table, median, write_json
from fcl_flower.config import RunConfig


def floor_stage_times(cfg: RunConfig) -> list[float]:
    """The floor: the same math done directly in plain torch, no project code on the hot path
    beyond the model and its data. Per client: backbone features, Φ = ReLU(F W), G_k = ΦᵀΦ and
    C_k = ΦᵀY in float64, summed; then one Cholesky solve of (G + γI) W = C and the prediction of
    the seen test classes."""
    from fcl_flower.analytic import random_projection
    from fcl_flower.runtime import build_model, federated_split, iter_features

    split = federated_split(cfg)
    model = build_model(cfg, split).eval()
    device = torch.device("cpu")
    projection = random_projection(model.backbone.feature_dim, cfg.rf_dim, seed=cfg.seed)
    assert projection is not None
    w_rand = projection.to(torch.float64)
    dim, ridge = cfg.rf_dim, float(cfg.ridge)
    gram = torch.zeros(dim, dim, dtype=torch.float64)
    sums = torch.zeros(dim, split.bundle.num_classes, dtype=torch.float64)
    times = []
    for task, classes in enumerate(split.tasks):
        began = time.perf_counter()
        for client in range(cfg.num_clients):
            for features, y in iter_features(model, split.client_train(task, client, eval_transform=True), cfg, device):
                phi = torch.relu(features @ w_rand)
                gram += phi.T @ phi
                sums += phi.T @ torch.nn.functional.one_hot(y, sums.shape[1]).to(torch.float64)
        factor = torch.linalg.cholesky(gram + ridge * torch.eye(dim, dtype=torch.float64))
        weights = torch.cholesky_solve(sums[:, : classes.stop], factor)
        phis, labels = [], []
        for features, y in iter_features(model, split.seen_test(task), cfg, device):
            phis.append(torch.relu(features @ w_rand))
            labels.append(y)
        _ = float(((torch.cat(phis) @ weights).argmax(dim=1) == torch.cat(labels)).double().mean())
        times.append(time.perf_counter() - began)
    return times


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
    from fcl_flower.analytic.checks import (
        check_counts,
        check_packed_statistics,
        screen_packed_statistics,
        wire_epsilon,
    )
    from fcl_flower.analytic.heads import Head
    from fcl_flower.analytic.packing import add_packed_
    from fcl_flower.metrics import accuracy_by_task  # noqa: F401  (same work as the strategy's evaluation)
    from fcl_flower.runtime import build_model, federated_split, iter_features
    from fcl_flower.tensors import WIRE_DTYPES

    split = federated_split(cfg)
    model = build_model(cfg, split).eval()
    device = torch.device("cpu")
    projection = random_projection(model.backbone.feature_dim, cfg.rf_dim, seed=cfg.seed)
    dim = cfg.rf_dim
    gram = torch.zeros(dim, dim, dtype=torch.float64)
    sums = torch.zeros(dim, split.bundle.num_classes, dtype=torch.float64)
    times = []
    wire = WIRE_DTYPES[cfg.wire_dtype]
    norm_bound, nonnegative = cfg.feature_clip, projection is not None
    ridge, head = cfg.ridge_value(), cast(Head, cfg.head)
    assert ridge is not None, "the benchmark's ridge is fixed"
    for task, classes in enumerate(split.tasks):
        began = time.perf_counter()
        packed_sum = torch.zeros(packed_length(dim), dtype=torch.float64)  # the stage's G, as the server sums it
        before = sums[:, classes.start : classes.stop].clone()
        count_sum = torch.zeros(split.bundle.num_classes, dtype=torch.float64)
        for client in range(cfg.num_clients):
            acc = StatisticsAccumulator(dim, len(classes), with_gram=True)
            data = split.client_train(task, client, eval_transform=True)
            for features, y in iter_features(model, data, cfg, device):
                acc.update(random_features(features, projection), y - classes.start)
            if not checks:  # the packed float64 G into the stage's packed sum
                packed_sum += acc.packed_gram()
                stats = acc.result(with_gram=False)
            else:
                packed = acc.packed_gram(wire)
                stats = acc.result(with_gram=False)
                counts = stats.counts.to(torch.float64)
                check_counts(counts, stats.num_samples)
                screen_packed_statistics(
                    packed,
                    stats.class_sums,
                    counts,
                    relative_tolerance=wire_epsilon(packed.dtype),
                    norm_bound=norm_bound,
                    nonnegative=nonnegative,
                )
                packed_sum += packed
                count_sum[classes.start : classes.stop] += counts
            sums[:, classes.start : classes.stop] += stats.class_sums
        if checks:  # the stage's one certificate, on the sum
            check_packed_statistics(
                packed_sum,
                sums[:, classes.start : classes.stop] - before,
                count_sum[classes.start : classes.stop],
                relative_tolerance=wire_epsilon(wire),
                norm_bound=norm_bound,
                nonnegative=nonnegative,
            )
        add_packed_(gram, packed_sum)  # into the running G once a stage, as the ridge state does
        weights = solve_ridge(gram, sums[:, : classes.stop], ridge)
        phis, labels = [], []
        for features, y in iter_features(model, split.seen_test(task), cfg, device):
            phis.append(random_features(features, projection))
            labels.append(y)
        predictions = predict(torch.cat(phis), weights, head)
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


def transport_floor_stage_times(cfg: RunConfig, engine: str, num_cpus: float = 1.0) -> tuple[list[float], float]:
    """Flower's transport floor of ``cfg``'s stages on ``engine`` ("local" or "ray"):
    experiments/transport_floor.py's rounds with the stages' upload sizes; (seconds, run total).
    With ``stats-form factor`` each node's array has the length of the stage's mean factor upload,
    n̄ (M + c) + c for the clients' mean number of samples n̄ (the floor app's array has a Gram
    upload's length for some dimension: the smallest whose length is at least that)."""
    from experiments import transport_floor
    from fcl_flower.runtime import federated_split

    split = federated_split(cfg)
    sizes = [(cfg.rf_dim, len(classes)) for classes in split.tasks]
    if cfg.stats_form == "factor":
        sizes = [_same_length(factor_upload_length(cfg, split, task), c) for task, (_, c) in enumerate(sizes)]
    began = time.perf_counter()
    if engine == "ray":
        seconds = transport_floor.run_ray(sizes, cfg.num_clients, num_cpus=num_cpus)
    else:
        seconds = transport_floor.run_local(sizes, cfg.num_clients)
    return seconds, time.perf_counter() - began


def factor_upload_length(cfg: RunConfig, split: Any, task: int) -> int:
    """The numbers of a factor upload of ``task`` from a client with the mean number of samples."""
    from fcl_flower.analytic.factor import factor_length

    rows = [len(split.client_train(task, k)) for k in range(cfg.num_clients)]
    return factor_length(round(sum(rows) / len(rows)), cfg.rf_dim, len(split.tasks[task]))


def _same_length(length: int, classes: int) -> tuple[int, int]:
    """(the smallest dimension m whose Gram upload with ``classes`` classes has >= ``length`` numbers, classes)."""
    from experiments.transport_floor import upload_length

    dim = 1
    while upload_length(dim, classes) < length:
        dim += 1
    return dim, classes


#: the engines that have a transport floor of their own: engine -> its floor's engine
TRANSPORT_FLOORS = {"local": "flower floor (local)", "ray": "flower floor (ray)"}


def server_scaling(dim: int, clients: list[int], repeats: int, rows: int = 20, classes: int = 2) -> dict[str, Any]:
    """The server's work on one stage of synthetic honest uploads, per K (see the module doc)."""
    from fcl_flower.analytic import packed_length, solve_ridge
    from fcl_flower.analytic.checks import check_packed_statistics, screen_packed_statistics
    from fcl_flower.analytic.packing import add_packed_, pack_symmetrised

    generator = torch.Generator().manual_seed(0)
    uploads = []
    for _ in range(max(clients)):
        phi = torch.relu(torch.randn(rows, dim, generator=generator, dtype=torch.float64))
        labels = torch.randint(0, classes, (rows,), generator=generator)
        y = torch.nn.functional.one_hot(labels, classes).to(torch.float64)
        uploads.append((pack_symmetrised(phi.T @ phi, torch.float32), phi.T @ y, y.sum(dim=0)))
    tolerance = 2.0**-24  # float32 uploads; the features are ReLU outputs (nonnegative)
    samples: dict[int, list[dict[str, float]]] = {k: [] for k in clients}
    # the running sums are allocated once and zeroed per stage (as a server's buffers are reused): a
    # fresh 64 MiB buffer's first touch (page faults) would be counted as the first upload's add
    packed = torch.zeros(packed_length(dim), dtype=torch.float64)
    sums = torch.zeros(dim, classes, dtype=torch.float64)
    counts = torch.zeros(classes, dtype=torch.float64)
    for _ in range(repeats):
        for k in clients:  # alternating K within every repeat
            timing = {"add": 0.0, "screen": 0.0}
            began = time.perf_counter()
            for buffer in (packed, sums, counts):
                buffer.zero_()
            for gram, c, n in uploads[:k]:
                t0 = time.perf_counter()
                screen_packed_statistics(gram, c, n, relative_tolerance=tolerance, nonnegative=True)
                t1 = time.perf_counter()
                np.add(packed.numpy(), gram.numpy(), out=packed.numpy())  # as TaskSum.add (strategies/stsa.py)
                sums += c
                counts += n
                timing["screen"] += t1 - t0
                timing["add"] += time.perf_counter() - t1
            t0 = time.perf_counter()
            check_packed_statistics(packed, sums, counts, relative_tolerance=tolerance, nonnegative=True)
            timing["certificate"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            full = torch.zeros(dim, dim, dtype=torch.float64)
            add_packed_(full, packed)
            solve_ridge(full, sums, 100.0)
            timing["solve"] = time.perf_counter() - t0
            timing["stage"] = time.perf_counter() - began
            timing["load"] = os.getloadavg()[0]
            samples[k].append(timing)
    rows_out = []
    for k in clients:
        row: dict[str, Any] = {"clients": k}
        for key in ("stage", "add", "screen", "certificate", "solve", "load"):
            row[key] = median([t[key] for t in samples[k]])
        rows_out.append(row)
    ks = [float(r["clients"]) for r in rows_out]
    ts = [float(r["stage"]) for r in rows_out]
    mean_k, mean_t = sum(ks) / len(ks), sum(ts) / len(ts)
    slope = sum((k - mean_k) * (t - mean_t) for k, t in zip(ks, ts)) / sum((k - mean_k) ** 2 for k in ks)
    intercept = mean_t - slope * mean_k
    first, last = rows_out[0], rows_out[-1]
    beyond = (last["stage"] - last["add"] - last["screen"]) / (first["stage"] - first["add"] - first["screen"])
    return {
        "rf_dim": dim,
        "rows_per_client": rows,
        "repeats": repeats,
        "rows": rows_out,
        "fit_seconds": {"a": intercept, "b_per_client": slope},
        "add_per_upload_s": median([r["add"] / r["clients"] for r in rows_out]),
        "screen_per_upload_s": median([r["screen"] / r["clients"] for r in rows_out]),
        "growth_beyond_per_upload_work": beyond,
        "samples": {str(k): v for k, v in samples.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-clients", type=int, default=5)
    parser.add_argument("--num-tasks", type=int, default=5, help="Must divide the 10 digit classes.")
    parser.add_argument("--rf-dim", type=int, default=1000)
    parser.add_argument("--num-cpus", type=float, default=1.0, help="Ray: CPU per simulated client.")
    parser.add_argument("--repeats", type=int, default=3, help="Alternating repeats of every engine (medians).")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument(
        "--server-scaling",
        action="store_true",
        help="Measure the server's work per stage for K = 10..50 synthetic uploads instead.",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of the in-process engines (direct, local); 0: torch's default. Ray's actors run "
        "with one thread each (OMP_NUM_THREADS = --num-cpus), so --threads 1 compares like with like.",
    )
    parser.add_argument(
        "--stats-form",
        choices=("gram", "factor"),
        default="gram",
        help="The uploads of the local and ray engines (run config stats-form). With factor, the engines that "
        "model Gram uploads (direct, direct + upload checks) are not run, and the transport floors move arrays "
        "of a factor upload's length (the clients' mean number of samples).",
    )
    parser.add_argument("--out", help="JSON path (default experiments/results/bench_framework_overhead.json).")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.server_scaling:
        result = server_scaling(args.rf_dim, [10, 20, 30, 40, 50], args.repeats)
        result["load_average_at_start"], result["load_average_at_end"] = load, os.getloadavg()[0]
        result["torch_threads"] = torch.get_num_threads()
        print(format_table(result["rows"], ["clients", "stage", "add", "screen", "certificate", "solve", "load"]))
        fit = result["fit_seconds"]
        print(
            f"fit T(K) = {fit['a']:.3f} s + {fit['b_per_client'] * 1e3:.1f} ms·K; adding alone "
            f"{result['add_per_upload_s'] * 1e3:.1f} ms, screen {result['screen_per_upload_s'] * 1e3:.1f} ms an "
            f"upload; the rest grows {result['growth_beyond_per_upload_work']:.2f}x from K = 10 to 50"
        )
        print(f"wrote {write_json(f'bench_server_scaling-M{args.rf_dim}', result, args.out)}")
        return 0
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
        stats_form=args.stats_form,
    )
    engines: dict[str, dict[str, Any]] = {}
    runners: dict[str, Any] = {
        "floor": lambda i: (floor_stage_times(cfg), None),
        "direct": lambda i: (direct_stage_times(cfg), None),
        "direct + upload checks": lambda i: (direct_stage_times(cfg, checks=True), None),
        "local": lambda i: local_stage_times(cfg.replace(run_name=f"local-{i}")),
        "flower floor (local)": lambda i: transport_floor_stage_times(cfg, "local"),
    }
    if not args.no_ray:
        runners["ray"] = lambda i: ray_stage_times(cfg.replace(run_name=f"ray-{i}"), args.num_cpus)
        runners["flower floor (ray)"] = lambda i: transport_floor_stage_times(cfg, "ray", args.num_cpus)
    if args.stats_form == "factor":  # these model Gram uploads
        for gram_only in ("direct", "direct + upload checks"):
            runners.pop(gram_only, None)
    for repeat in range(args.repeats):  # A B C D E, A B C D E, ...
        for name, run in runners.items():
            before = os.getloadavg()[0]
            began = time.perf_counter()
            stages, _ = run(repeat)
            total = time.perf_counter() - began
            record = engines.setdefault(name, {"runs": []})
            record["runs"].append(
                {"stages": stages, "total": total, "load_before": before, "load_after": os.getloadavg()[0]}
            )
            print(f"[{repeat + 1}/{args.repeats}] {name}: stages 2..T {median(stages[1:]):.3f} s (load {before:.1f})")
    rows = []
    figure = {name: median([s for r in e["runs"] for s in r["stages"][1:]]) for name, e in engines.items()}
    for name, result in engines.items():
        result["median_stage_s"] = figure[name]
        transport = figure.get(TRANSPORT_FLOORS.get(name, ""))  # this engine's own transport floor
        rows.append(
            {
                "engine": name,
                "stages 2..T median s": figure[name],
                "ratio vs floor": figure[name] / figure["floor"],
                "ratio vs direct + checks": (
                    figure[name] / figure["direct + upload checks"] if "direct + upload checks" in figure else None
                ),
                "ratio vs flower floor": None if transport is None else figure[name] / transport,
                "s above flower floor": None if transport is None else figure[name] - transport,
                "run total s (median)": median([r["total"] for r in result["runs"]]),
            }
        )
    columns = [
        "engine",
        "stages 2..T median s",
        "ratio vs floor",
        "ratio vs direct + checks",
        "ratio vs flower floor",
        "s above flower floor",
        "run total s (median)",
    ]
    shown = [{k: "" if v is None else v for k, v in row.items()} for row in rows]
    print(format_table(shown, columns, floats="{:.2f}"))
    name = "bench_framework_overhead"
    if not (args.rf_dim == 1000 and args.num_clients == 5):
        name += f"-M{args.rf_dim}-K{args.num_clients}"
    if args.threads > 0:
        name += f"-threads{args.threads}"
    if args.stats_form != "gram":
        name += f"-{args.stats_form}"
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
                "stats_form": args.stats_form,
                "torch_threads_in_process": torch.get_num_threads(),
                "repeats": args.repeats,
                "order": "alternating: " + " ".join(runners),
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
