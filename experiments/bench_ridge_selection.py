"""Ridge selection (``ridge auto``) against one solve, exact scan and Krylov search (issue 16 item 4).

    python -m experiments.bench_ridge_selection                    # M = 4096 and 10000, ~15 min on 2 cores
    python -m experiments.bench_ridge_selection --dims 1024 --quick

Statistics: G = ΦᵀΦ and C = ΦᵀY of ReLU random features (M wide) of a 100-class Gaussian mixture,
n = ``--samples-per-dim`` · M samples, accumulated in float64 batches (the clients' work; not timed).
Per M, each end to end through :meth:`RidgeState.solve`:

* ``solve``: W at a fixed γ (the exact scan's choice): Cholesky + solve, the unit of cost;
* ``exact``: ``ridge-selection exact``, the eigendecomposition scan of the 41-point grid, then the solve;
* ``krylov cold``: ``ridge-selection krylov`` with no previous γ (the first stage);
* ``krylov warm``: the same with the previous stage's γ one grid step away from the choice (a
  later stage whose choice moved), and ``krylov same``: the previous γ is the choice.

Every state carries the bound the server would hold for uploads checked at the default float32
tolerance (``ridge.RidgeState.negative_bound``: 4(M + c)·2⁻²⁴·max_i G_ii, the sum over uploads
at its smallest; ``--bound none`` gives β = 0, as for statistics known exactly): where it exceeds
γ/2 the solve certifies λ_min(G) ≥ −γ/2 by one more factorisation, which every row pays alike and
reports (``certificate``).

``selection / solve`` = (time with selection − time of the fixed-γ solve) / time of the fixed-γ solve,
each time the median of ``--repeats`` runs (3; every run's time is in the JSON; the exact scan runs once).
Every Krylov row says whether it chose the exact scan's γ and the stated relative error of GCV there.
Writes experiments/results/bench_ridge_selection.json (machine and load average included).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from statistics import median as statistics_median
from typing import Any

import torch

from experiments.benchlib import format_table, machine_info, write_json
from fcl_flower.analytic.ridge import RidgeState, default_ridge_grid


def statistics(dim: int, samples: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """G (symmetrised) and C of ReLU random features of a Gaussian mixture, in batches."""
    gen = torch.Generator().manual_seed(seed)
    width = 128
    means = torch.randn(classes, width, generator=gen)
    projection = torch.randn(width, dim, generator=gen) / math.sqrt(width)
    bias = torch.randn(dim, generator=gen)
    gram = torch.zeros(dim, dim, dtype=torch.float64)
    sums = torch.zeros(dim, classes, dtype=torch.float64)
    for begin in range(0, samples, 2048):
        labels = torch.randint(0, classes, (min(2048, samples - begin),), generator=gen)
        phi = torch.relu((means[labels] + torch.randn(len(labels), width, generator=gen)) @ projection + bias).double()
        gram.addmm_(phi.T, phi)
        sums.index_add_(1, labels, phi.T)
    gram = 0.5 * (gram + gram.T)
    return gram, sums


def timed(state: RidgeState, classes: int, ridge: float | None, selection: str) -> tuple[float, float, dict[str, Any]]:
    began = time.perf_counter()
    _, gamma, _ = state.solve(classes, ridge, selection)
    return time.perf_counter() - began, gamma, dict(state.selection)


def repeated(
    make: Callable[[], RidgeState], classes: int, ridge: float | None, selection: str, repeats: int, times: list[float]
) -> tuple[float, float, dict[str, Any]]:
    """:func:`timed` ``repeats`` times on fresh states; every time is appended to ``times``, the
    median is returned (with γ and the selection record of the last run: the same every run)."""
    for _ in range(repeats):
        seconds, gamma, info = timed(make(), classes, ridge, selection)
        times.append(seconds)
    return statistics_median(times), gamma, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[4096, 10000])
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--samples-per-dim", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--skip-exact-above", type=int, default=20000, help="no exact scan above this M")
    parser.add_argument("--quick", action="store_true", help="small M only: checks the script")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each solve and Krylov search (the median is reported)"
    )
    parser.add_argument(
        "--bound",
        choices=("float32-checks", "none"),
        default="float32-checks",
        help="the certified bound the states carry (default: what float32-tolerance upload checks give)",
    )
    parser.add_argument("--out", help="JSON path (default experiments/results/bench_ridge_selection.json)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    dims = [512] if args.quick else args.dims
    grid = default_ridge_grid().tolist()
    rows: list[dict[str, Any]] = []
    began = time.perf_counter()
    for dim in dims:
        samples = int(args.samples_per_dim * dim)
        load = os.getloadavg()[0]
        gram, sums = statistics(dim, samples, args.classes)
        bound = 0.0
        if args.bound == "float32-checks":
            bound = 4.0 * (dim + args.classes) * 2.0**-24 * float(gram.diagonal().max())
        state = RidgeState(gram, sums, samples, bound)
        exact_s, exact_gamma = math.nan, math.nan
        if dim <= args.skip_exact_above:
            exact_s, exact_gamma, _ = timed(state, args.classes, None, "exact")
        times: dict[str, list[float]] = {"solve": [], "cold": [], "warm": [], "same": []}

        def krylov(name: str, previous: float | None) -> tuple[float, float, dict[str, Any]]:
            """The Krylov search from ``previous`` (None: the first stage), ``--repeats`` times."""
            return repeated(
                lambda: RidgeState(gram, sums, samples, bound, previous=previous),
                args.classes,
                None,
                "krylov",
                args.repeats,
                times[name],
            )

        searches = {"cold": krylov("cold", None)}
        reference = exact_gamma if math.isfinite(exact_gamma) else searches["cold"][1]

        def fresh() -> RidgeState:  # a new state each run: a certificate may lower its bound
            return RidgeState(gram, sums, samples, bound)

        solve_s, _, solve_info = repeated(fresh, args.classes, reference, "exact", args.repeats, times["solve"])
        searches["warm"] = krylov("warm", grid[min(grid.index(reference) + 1, len(grid) - 1)])
        searches["same"] = krylov("same", reference)
        row: dict[str, Any] = {
            "M": dim,
            "n": samples,
            "classes": args.classes,
            "solve s": solve_s,
            "exact s": exact_s,
            "exact / solve": (exact_s - solve_s) / solve_s,
            "gamma exact": exact_gamma,
            "bound": bound,
            "certificate": solve_info.get("certificate"),
            "certificate s": solve_info.get("certificate_seconds", 0.0),
        }
        for name, (seconds, gamma, info) in searches.items():
            row[f"krylov {name} s"] = seconds
            row[f"krylov {name} / solve"] = (seconds - solve_s) / solve_s
            row[f"krylov {name} gamma"] = gamma
            row[f"krylov {name} equals exact"] = gamma == exact_gamma if math.isfinite(exact_gamma) else None
            row[f"krylov {name} detail"] = info
        row["times s"] = times
        row["load average"] = [load, os.getloadavg()[0]]
        rows.append(row)
        print(
            format_table(
                [row],
                [
                    "M",
                    "solve s",
                    "exact / solve",
                    "krylov cold / solve",
                    "krylov warm / solve",
                    "krylov same / solve",
                    "gamma exact",
                    "krylov cold gamma",
                    "bound",
                    "certificate",
                    "certificate s",
                ],
            ),
            flush=True,
        )
    path = write_json(
        "bench_ridge_selection",
        {
            "benchmark": "bench_ridge_selection",
            "machine": machine_info(),
            "threads": torch.get_num_threads(),
            "quick": args.quick,
            "rows": rows,
            "seconds": time.perf_counter() - began,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
