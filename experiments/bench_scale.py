"""Scale: the Ray simulation with 100 clients on this machine, with its time and peak memory.

    python experiments/bench_scale.py                       # STSA, 100 clients, M = 2000 (~5-10 min)
    python experiments/bench_scale.py --strategies stsa stsa-e fedran

Config: digits, 100 clients, 2 tasks (1347 training images: with 5 tasks a task has ~270 samples
and no Dirichlet draw gives every one of 100 clients a sample), beta 0.5, rf-dim 2000, one
FedAvg round on task 1, then one statistics round per stage.

Ray resources: ``--num-cpus`` is the CPU share of one simulated client, and Flower starts
(cores / num-cpus) actors that take turns serving all 100 virtual clients. 1.0 gives 2 actors
here; a fraction such as 0.02 would start 100 actor processes (~0.5 GiB each with torch) and
run out of memory on a 24 GiB machine.

Memory: every 0.5 s the proportional set size (PSS, shared pages split between processes) of
this process and all its descendants (Ray's GCS, raylet, actors) is summed; the peak is
reported with the driver's own peak RSS (the ServerApp runs in the driver).
Writes experiments/results/bench_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from experiments.benchlib import format_table, peak_rss_mib, reset_peak_rss, write_json
from fcl_flower.config import RunConfig


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            tree.setdefault(int(fields[1]), []).append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return tree


def _memory_kib(pid: int) -> int:
    for name, key in (("smaps_rollup", "Pss:"), ("status", "VmRSS:")):
        try:
            with open(f"/proc/{pid}/{name}") as handle:
                for line in handle:
                    if line.startswith(key):
                        return int(line.split()[1])
        except OSError:
            continue
    return 0


def tree_memory_mib(root: int) -> tuple[float, int]:
    """(PSS of ``root`` and all its descendants in MiB, number of processes)."""
    tree, stack, seen = _children(), [root], []
    while stack:
        pid = stack.pop()
        seen.append(pid)
        stack.extend(tree.get(pid, []))
    return sum(_memory_kib(p) for p in seen) / 1024, len(seen)


class MemorySampler(threading.Thread):
    def __init__(self, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak, self.peak_processes = interval, 0.0, 0
        self.min_available = float("inf")
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            total, count = tree_memory_mib(os.getpid())
            if total > self.peak:
                self.peak, self.peak_processes = total, count
            try:
                for line in Path("/proc/meminfo").read_text().splitlines():
                    if line.startswith("MemAvailable"):
                        self.min_available = min(self.min_available, int(line.split()[1]) / 1024)
            except OSError:
                pass
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", default=["stsa"])
    parser.add_argument("--num-clients", type=int, default=100)
    parser.add_argument("--num-tasks", type=int, default=2)
    parser.add_argument("--dataset", default="digits", choices=("digits", "synthetic"))
    parser.add_argument("--rf-dim", type=int, default=2000)
    parser.add_argument("--stage1-rounds", type=int, default=1)
    parser.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPU share per simulated client.")
    parser.add_argument("--out", help="JSON path (default experiments/results/bench_scale.json).")
    args = parser.parse_args(argv)
    from experiments.sim import simulate

    load = os.getloadavg()[0]
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"fcl-bench-scale-{os.getpid()}"
    rows: list[dict[str, Any]] = []
    for name in args.strategies:
        cfg = RunConfig(
            strategy=name,
            dataset=args.dataset,
            num_clients=args.num_clients,
            num_tasks=args.num_tasks,
            beta=0.5,
            seed=0,
            stage1_rounds=args.stage1_rounds,
            local_epochs=1,
            rf_dim=args.rf_dim,
            rank=256,
            dummy_clients=2,
            ridge="auto",
            device="cpu",
            out=str(tmp),
            round_timeout=3600.0,
        )
        sampler = MemorySampler()
        reset_peak_rss()
        sampler.start()
        began = time.perf_counter()
        error = ""
        try:
            path = simulate(cfg, num_cpus=args.num_cpus)
            data = json.loads(path.read_text())
        except Exception as err:  # record and go on: the report must say what broke
            data, error = {}, f"{type(err).__name__}: {err}"
        seconds = time.perf_counter() - began
        sampler.stop()
        stages = data.get("stages", [])
        rows.append(
            {
                "strategy": name,
                "clients": args.num_clients,
                "M": args.rf_dim,
                "wall s": seconds,
                "stage s": [round(s["seconds"], 1) for s in stages],
                "clients per stage": [len(s["clients"]) for s in stages],
                "A_T %": data.get("A_T", float("nan")),
                "peak MiB (all processes, PSS)": sampler.peak,
                "processes": sampler.peak_processes,
                "driver peak RSS MiB": peak_rss_mib(),
                "min MemAvailable MiB": sampler.min_available,
                "error": error,
            }
        )
        print(
            f"  {name}: {seconds:.0f} s, peak {sampler.peak:.0f} MiB over {sampler.peak_processes} processes"
            + (f", FAILED: {error}" if error else ""),
            flush=True,
        )
    print(
        format_table(
            rows,
            [
                "strategy",
                "clients",
                "M",
                "wall s",
                "stage s",
                "clients per stage",
                "A_T %",
                "peak MiB (all processes, PSS)",
                "processes",
                "driver peak RSS MiB",
                "min MemAvailable MiB",
            ],
            floats="{:.1f}",
        )
    )
    path = write_json(
        "bench_scale",
        {
            "load_average_at_start": load,
            "settings": {
                "dataset": args.dataset,
                "num_clients": args.num_clients,
                "num_tasks": args.num_tasks,
                "rf_dim": args.rf_dim,
                "stage1_rounds": args.stage1_rounds,
                "local_epochs": 1,
                "ray_num_cpus_per_client": args.num_cpus,
                "engine": "Flower Ray simulation (experiments/sim.py)",
            },
            "rows": rows,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
