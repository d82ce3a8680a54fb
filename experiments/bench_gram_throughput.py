"""Statistics throughput: the client's Gram accumulation against this machine's matmul peak.

    python experiments/bench_gram_throughput.py            # ~1 min on 2 cores
    python experiments/bench_gram_throughput.py --quick    # a few seconds

A STSA client streams its random features Φ (batch × M, float64) through
``StatisticsAccumulator.update`` (G += ΦᵀΦ with ``addmm_``, C += ΦᵀY with ``index_add_``).
Its throughput is 2·n·M² flop / time (what addmm executes; the symmetric half would suffice,
so the "useful" rate is half of it). The reference is the same run's best square matmul in
float32 and float64 (``torch.mm``, the same BLAS). The goal is ≥ 70 % of the float64 peak.

Columns: ``kernel`` = addmm_ alone, ``accumulator`` = the full update (validation, cast,
addmm_, index_add_, bincount), ``client path`` = accumulator after the random-feature map
ReLU(F W) from d = 512 backbone features (its extra 2·n·d·M flop are counted too).
Writes experiments/results/bench_gram_throughput.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from experiments.benchlib import best_time, format_table, write_json
from fcl_flower.analytic import StatisticsAccumulator, random_features, random_projection


def matmul_peak(dtype: torch.dtype, sizes: list[int], repeats: int) -> dict[str, float]:
    """Best GFLOP/s of an N×N @ N×N product over ``sizes``."""
    best = {"gflops": 0.0, "n": 0}
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        a = torch.randn(n, n, generator=g, dtype=dtype)
        b = torch.randn(n, n, generator=g, dtype=dtype)
        seconds = best_time(lambda: torch.mm(a, b), repeats=repeats)
        gflops = 2 * n**3 / seconds / 1e9
        if gflops > best["gflops"]:
            best = {"gflops": gflops, "n": n}
    return best


def gram_rates(rf_dim: int, batch: int, rows: int, repeats: int, feature_dim: int = 512) -> dict[str, float]:
    g = torch.Generator().manual_seed(rf_dim * 7 + batch)
    phi = torch.relu(torch.randn(rows, rf_dim, generator=g, dtype=torch.float64))
    labels = torch.randint(0, 10, (rows,), generator=g)
    features = torch.randn(rows, feature_dim, generator=g, dtype=torch.float32)
    projection = random_projection(feature_dim, rf_dim, seed=0)
    starts = range(0, rows, batch)
    flop = 2.0 * rows * rf_dim**2

    def kernel() -> None:
        gram = torch.zeros(rf_dim, rf_dim, dtype=torch.float64)
        for s in starts:
            block = phi[s : s + batch]
            gram.addmm_(block.T, block)

    def kernel32() -> None:
        gram = torch.zeros(rf_dim, rf_dim, dtype=torch.float32)
        phi32 = phi32_all
        for s in starts:
            block = phi32[s : s + batch]
            gram.addmm_(block.T, block)

    def accumulator() -> None:
        acc = StatisticsAccumulator(rf_dim, 10, with_gram=True)
        for s in starts:
            acc.update(phi[s : s + batch], labels[s : s + batch])
        acc.result()

    def client_path() -> None:
        acc = StatisticsAccumulator(rf_dim, 10, with_gram=True)
        for s in starts:
            acc.update(random_features(features[s : s + batch], projection), labels[s : s + batch])
        acc.result()

    phi32_all = phi.float()
    out = {}
    for name, fn, work in (
        ("kernel64", kernel, flop),
        ("kernel32", kernel32, flop),
        ("accumulator", accumulator, flop),
        ("client_path", client_path, flop + 2.0 * rows * feature_dim * rf_dim),
    ):
        seconds = best_time(fn, repeats=repeats)
        out[name] = work / seconds / 1e9
        out[f"{name}_seconds"] = seconds
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rf-dims", type=int, nargs="+", default=[1000, 2000, 4000])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--rows", type=int, default=2048, help="Samples streamed per measurement.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="M = 1000 only, batches 64 and 1024.")
    parser.add_argument("--out", help="JSON path (default experiments/results/bench_gram_throughput.json).")
    args = parser.parse_args(argv)
    if args.quick:
        args.rf_dims, args.batches, args.rows, args.repeats = [1000], [64, 1024], 1024, 2
    load = os.getloadavg()[0]
    torch.manual_seed(0)
    sizes = [1024, 2048] if args.quick else [1024, 2048, 4096]
    peak64 = matmul_peak(torch.float64, sizes, args.repeats)
    peak32 = matmul_peak(torch.float32, sizes, args.repeats)
    print(
        f"matmul peak: float64 {peak64['gflops']:.1f} GFLOP/s (N={peak64['n']}), "
        f"float32 {peak32['gflops']:.1f} GFLOP/s (N={peak32['n']}); {torch.get_num_threads()} threads, "
        f"load average {load:.2f}"
    )
    rows = []
    for rf_dim in args.rf_dims:
        for batch in args.batches:
            rates = gram_rates(rf_dim, batch, args.rows, args.repeats)
            rows.append(
                {
                    "M": rf_dim,
                    "batch": batch,
                    "kernel64 GFLOP/s": rates["kernel64"],
                    "% f64 peak": 100 * rates["kernel64"] / peak64["gflops"],
                    "accumulator GFLOP/s": rates["accumulator"],
                    "acc % f64 peak": 100 * rates["accumulator"] / peak64["gflops"],
                    "client path GFLOP/s": rates["client_path"],
                    "kernel32 GFLOP/s": rates["kernel32"],
                    "% f32 peak": 100 * rates["kernel32"] / peak32["gflops"],
                    **{k: v for k, v in rates.items() if k.endswith("_seconds")},
                }
            )
    columns = [
        "M",
        "batch",
        "kernel64 GFLOP/s",
        "% f64 peak",
        "accumulator GFLOP/s",
        "acc % f64 peak",
        "client path GFLOP/s",
        "kernel32 GFLOP/s",
        "% f32 peak",
    ]
    print(format_table(rows, columns, floats="{:.1f}"))
    best = max(r["acc % f64 peak"] for r in rows)
    print(f"best accumulator efficiency: {best:.0f} % of the float64 matmul peak (goal >= 70 %)")
    path = write_json(
        "bench_gram_throughput",
        {
            "load_average_at_start": load,
            "settings": {"rows": args.rows, "repeats": args.repeats, "flop_count": "2 n M^2 per accumulation"},
            "peak": {"float64": peak64, "float32": peak32},
            "rows": rows,
            "best_accumulator_percent_of_f64_peak": best,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
