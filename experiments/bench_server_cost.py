"""Server cost: solve and estimator time versus M, and aggregation versus the number of clients.

    python experiments/bench_server_cost.py            # ~2-3 min on 2 cores
    python experiments/bench_server_cost.py --quick    # ~20 s

Part 1, versus M (500 ... 8192), per stage on the server:
  * ``solve``: W = (G + γI)⁻¹ C by Cholesky, C with 100 seen classes (STSA, STSA-E);
  * ``gcv``: the eigendecomposition-based ridge selection of ``ridge = auto`` (up to --gcv-max M);
  * ``stsa-e estimator``: Ĝ from K·K_D = 5·10 uploads of a 10-class task (streaming Eq. 9);
  * ``fedran merge``: the spatial + temporal QR-SVD merge of 5 rank-r summaries, and its solve.
Part 2, versus the number of clients K (5 ... 200) at M = 2000, c_t = 10: each upload is
generated, handed to the server's aggregation and dropped, as if replies arrived one by one:
  * ``stsa``: G += G_k;  ``stsa-e``: GramEstimator.add (K_D = 10 uploads per client);
  * ``fedran``: merge_pair with each client's rank-r summary.
For STSA-E the batch estimator of the stacked uploads (estimate_gram) is measured too, for
contrast. ``round buffer`` is what Flower's Grid holds anyway: every reply of a round at once
(K × the upload size), before the strategy sees the first.

Peak memory is the process's peak RSS above its RSS before each step (Linux VmHWM, reset per
step; glibc is made to return freed blocks at once so the RSS follows the live tensors).
Writes experiments/results/bench_server_cost.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from typing import Any

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # large blocks via mmap: freed memory leaves the RSS
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    os.execv(sys.executable, [sys.executable, *sys.argv])


import torch

from experiments.benchlib import current_rss_mib, format_table, peak_rss_mib, reset_peak_rss, write_json
from fcl_flower.analytic import estimate_gram, select_ridge_gcv, solve_ridge
from fcl_flower.analytic.estimator import GramEstimator
from fcl_flower.analytic.lowrank import LowRankSummary, merge_pair
from fcl_flower.analytic.subspace import solve_subspace_ridge

MIB = 2**20


def measure(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(seconds, peak MiB above the RSS before the call, result)."""
    gc.collect()
    reset_peak_rss()
    before = current_rss_mib()
    began = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - began
    return seconds, max(0.0, peak_rss_mib() - before), result


def random_gram(rf_dim: int, rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    phi = torch.relu(torch.randn(rows, rf_dim, generator=g, dtype=torch.float64))
    return phi.T @ phi


def random_summary(rf_dim: int, rank: int, seed: int) -> LowRankSummary:
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(rf_dim, rank, generator=g, dtype=torch.float64))
    sigma = torch.sort(torch.rand(rank, generator=g, dtype=torch.float64) * 100, descending=True).values
    return LowRankSummary(basis, sigma, rank)


def stsa_e_upload(rf_dim: int, classes: int, dummies: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 6, (dummies, classes), generator=g).to(torch.float64)
    sums = torch.rand(dummies, rf_dim, classes, generator=g, dtype=torch.float64) * counts.unsqueeze(1)
    return sums, counts


def versus_rf_dim(dims: list[int], gcv_max: int, rank: int, classes_seen: int = 100) -> list[dict[str, Any]]:
    rows = []
    for m in dims:
        row: dict[str, Any] = {"M": m}
        gram = random_gram(m, 256, seed=m) + torch.eye(m, dtype=torch.float64)
        sums = torch.rand(m, classes_seen, dtype=torch.float64)
        row["solve s"], row["solve MiB"], _ = measure(lambda: solve_ridge(gram, sums, 1e4))
        if m <= gcv_max:
            row["gcv s"], row["gcv MiB"], _ = measure(lambda: select_ridge_gcv(gram, sums, 10_000, 10_000.0))
        del gram
        uploads = [stsa_e_upload(m, 10, 10, seed=k) for k in range(5)]

        def estimator() -> torch.Tensor:
            est = GramEstimator(m, 10)
            for s, c in uploads:
                est.add(s, c)
            return est.result()

        row["stsa-e est s"], row["stsa-e est MiB"], _ = measure(estimator)
        del uploads
        r = min(rank, m // 2)
        summaries = [random_summary(m, r, seed=k) for k in range(5)]
        previous = random_summary(m, r, seed=99)

        def merge() -> LowRankSummary:
            current = LowRankSummary.empty(m)
            for s in summaries:
                current = merge_pair(current, s, r)
            return merge_pair(previous, current, r)

        row["fedran merge s"], row["fedran merge MiB"], merged = measure(merge)
        row["fedran solve s"], _, _ = measure(lambda: solve_subspace_ridge(merged, sums, 1e-3))
        row["fedran r"] = r
        rows.append(row)
        print(
            f"  M={m}: solve {row['solve s']:.2f} s, estimator {row['stsa-e est s']:.2f} s, "
            f"fedran merge {row['fedran merge s']:.2f} s",
            flush=True,
        )
    return rows


def versus_clients(clients: list[int], rf_dim: int, dummies: int, rank: int, classes: int = 10) -> list[dict[str, Any]]:
    rows = []
    base = random_gram(rf_dim, 64, seed=1)
    for k_total in clients:
        row: dict[str, Any] = {"K": k_total, "M": rf_dim}

        def stsa() -> torch.Tensor:
            total = torch.zeros(rf_dim, rf_dim, dtype=torch.float64)
            for k in range(k_total):
                upload = base * (1.0 + k / 1000)  # one arriving upload at a time
                total += upload
                del upload
            return total

        row["stsa s"], row["stsa MiB"], _ = measure(stsa)

        def stsa_e_stream() -> torch.Tensor:
            est = GramEstimator(rf_dim, classes)
            for k in range(k_total):
                est.add(*stsa_e_upload(rf_dim, classes, dummies, seed=k))
            return est.result()

        row["stsa-e s"], row["stsa-e MiB"], _ = measure(stsa_e_stream)

        def stsa_e_batch() -> torch.Tensor:
            uploads = [stsa_e_upload(rf_dim, classes, dummies, seed=k) for k in range(k_total)]
            return estimate_gram(torch.cat([u[0] for u in uploads]), torch.cat([u[1] for u in uploads]))

        row["stsa-e batch s"], row["stsa-e batch MiB"], _ = measure(stsa_e_batch)

        def fedran() -> LowRankSummary:
            current = LowRankSummary.empty(rf_dim)
            for k in range(k_total):
                current = merge_pair(current, random_summary(rf_dim, rank, seed=k), rank)
            return current

        row["fedran s"], row["fedran MiB"], _ = measure(fedran)
        packed = rf_dim * (rf_dim + 1) // 2 + rf_dim * classes
        row["round buffer MiB (stsa, f32)"] = k_total * packed * 4 / MIB
        row["round buffer MiB (stsa-e, f32)"] = k_total * (rf_dim + 1) * classes * dummies * 4 / MIB
        rows.append(row)
        print(
            f"  K={k_total}: stsa {row['stsa s']:.2f} s / {row['stsa MiB']:.0f} MiB, stsa-e "
            f"{row['stsa-e s']:.2f} s / {row['stsa-e MiB']:.0f} MiB (batch {row['stsa-e batch MiB']:.0f} MiB), "
            f"fedran {row['fedran s']:.2f} s / {row['fedran MiB']:.0f} MiB",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rf-dims", type=int, nargs="+", default=[500, 1000, 2000, 4096, 8192])
    parser.add_argument("--clients", type=int, nargs="+", default=[5, 10, 25, 50, 100, 200])
    parser.add_argument("--clients-rf-dim", type=int, default=2000)
    parser.add_argument("--dummy-clients", type=int, default=10, help="K_D of the STSA-E uploads.")
    parser.add_argument("--rank", type=int, default=256, help="FedRAN rank r in part 1.")
    parser.add_argument("--clients-rank", type=int, default=128, help="FedRAN rank r in part 2.")
    parser.add_argument("--gcv-max", type=int, default=4096, help="Largest M for the GCV timing.")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", help="JSON path (default experiments/results/bench_server_cost.json).")
    args = parser.parse_args(argv)
    if args.quick:
        args.rf_dims, args.clients, args.clients_rf_dim, args.gcv_max = [500, 1000, 2000], [5, 25, 100], 1000, 1000
    load = os.getloadavg()[0]
    torch.manual_seed(0)
    print(f"part 1: versus M (load average {load:.2f}, {torch.get_num_threads()} threads)")
    by_m = versus_rf_dim(args.rf_dims, args.gcv_max, args.rank)
    print(
        format_table(
            by_m,
            [
                "M",
                "solve s",
                "solve MiB",
                "gcv s",
                "gcv MiB",
                "stsa-e est s",
                "stsa-e est MiB",
                "fedran r",
                "fedran merge s",
                "fedran merge MiB",
                "fedran solve s",
            ],
            floats="{:.3g}",
        )
    )
    print(f"part 2: versus clients (M = {args.clients_rf_dim}, K_D = {args.dummy_clients}, r = {args.clients_rank})")
    by_k = versus_clients(args.clients, args.clients_rf_dim, args.dummy_clients, args.clients_rank)
    print(
        format_table(
            by_k,
            [
                "K",
                "stsa s",
                "stsa MiB",
                "stsa-e s",
                "stsa-e MiB",
                "stsa-e batch s",
                "stsa-e batch MiB",
                "fedran s",
                "fedran MiB",
                "round buffer MiB (stsa, f32)",
                "round buffer MiB (stsa-e, f32)",
            ],
            floats="{:.3g}",
        )
    )
    path = write_json(
        "bench_server_cost",
        {
            "load_average_at_start": load,
            "settings": {
                "classes_seen_for_solve": 100,
                "stsa_e_uploads_part1": "5 clients x K_D=10, c_t=10",
                "fedran_rank_part1": args.rank,
                "clients_rf_dim": args.clients_rf_dim,
                "dummy_clients": args.dummy_clients,
                "fedran_rank_part2": args.clients_rank,
                "memory": "peak RSS above the RSS before each step (VmHWM), MiB",
            },
            "versus_rf_dim": by_m,
            "versus_clients": by_k,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
