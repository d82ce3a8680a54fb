"""Cost of exact unlearning (issue 33, docs/unlearning.md) next to re-running the federation.

    python experiments/bench_unlearning.py              # M = 2000 and 5000 (a few minutes on 2 cores)
    python experiments/bench_unlearning.py --dims 500   # a quick look

A federation of K sites and T stages (c classes each, n samples per site and stage, random ReLU
features of class-shifted Gaussians, float64 statistics as the clients compute them) is summed
into the server's ridge state as STSA does; then site 0 withdraws after the last stage. Measured:

* ``client: kept uploads``: the bytes on disk the site keeps per stage (clients/upload_store.py)
  and the time to write and read them all (atomic write, fsync);
* ``server: verify``: the SHA-256 of every re-sent upload against the commitment, and the sum of
  the site's statistics subtracted (strategies/unlearning.py);
* ``server: re-solve``: one ridge solve with γ re-selected (``ridge auto``, ``ridge-selection auto``);
* ``samples``: the other request, a site forgetting 10 % of its samples of one stage: the site's
  one statistics pass over the kept samples, and the server's check that the removed part is a
  dataset's statistics (a PSD factorisation of (M + c)²) and its swap;
* ``re-run``: the federation again without site 0: the (K − 1)·T statistics passes of the other
  sites (the work of their statistics rounds, one after another) and the T stage solves of a run.
  The stage-1 FedAvg training and the backbone's feature extraction are not counted (the features
  are given), so the re-run is if anything under-counted.

The removal's W is compared with the re-run's (relative Frobenius difference). Writes
experiments/results/bench_unlearning.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from clients.upload_store import load_upload, save_upload
from experiments.benchlib import format_table, write_json
from fcl_flower.analytic import StatisticsAccumulator
from fcl_flower.analytic.checks import gram_check_epsilon
from fcl_flower.analytic.ridge import RidgeState
from fcl_flower.analytic.unlearning import Upload, check_removal, remove_upload, replace_upload, upload_digest
from fcl_flower.protocol.payloads import StsaStats


def features(
    gen: torch.Generator, labels: torch.Tensor, dim: int, means: torch.Tensor, proj: torch.Tensor
) -> torch.Tensor:
    x = means[labels] + torch.randn(len(labels), means.shape[1], generator=gen)
    return torch.relu(x @ proj).to(torch.float64) / dim**0.5


def statistics(phi: torch.Tensor, labels: torch.Tensor, classes: range) -> tuple[StsaStats, int]:
    """One site's upload of one stage, as clients/stsa.py computes it (batches of 256)."""
    acc = StatisticsAccumulator(int(phi.shape[1]), len(classes))
    for start in range(0, len(labels), 256):
        acc.update(phi[start : start + 256], labels[start : start + 256] - classes.start)
    stats = acc.result(with_gram=False)
    return StsaStats(acc.packed_gram(), stats.class_sums, stats.counts.to(torch.float64)), stats.num_samples


def run(dim: int, sites: int, stages: int, classes: int, samples: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    total_classes = stages * classes
    means = torch.randn(total_classes, 32, generator=gen) * 2.0
    proj = torch.randn(32, dim, generator=gen)
    data = {}
    for site in range(sites):
        for stage in range(stages):
            labels = torch.arange(samples) % classes + stage * classes
            data[(site, stage)] = (features(gen, labels, dim, means, proj), labels)
    ranges = [range(s * classes, (s + 1) * classes) for s in range(stages)]

    # the federation as it ran (uploads streamed into the server's state, as STSA folds them); the
    # uploads of sites 0 and 1 are kept (they are the ones the requests below take out)
    uploads: dict[tuple[int, int], tuple[StsaStats, int]] = {}
    state = RidgeState.empty(dim, total_classes)
    digests = {}
    for stage in range(stages):
        for site in range(sites):
            stats, n = statistics(*data[(site, stage)], ranges[stage])
            state.add_packed(ranges[stage], stats.gram_packed, stats.class_sums, n)
            context: dict[str, str | int] = {"run": "bench", "client": f"client-{site}", "task": stage}
            digests[(site, stage)] = upload_digest(
                context, Upload(stats.gram_packed, stats.class_sums, stats.counts, n)
            )
            if site in (0, 1):
                uploads[(site, stage)] = (stats, n)
    state.solve(total_classes, None, "auto")  # the last stage's solve (γ from it seeds the search)

    row: dict[str, Any] = {"M": dim, "sites": sites, "stages": stages, "samples_per_site_stage": samples}
    # --- the site keeps its uploads on disk
    with tempfile.TemporaryDirectory() as folder:
        began = time.perf_counter()
        sizes = [
            save_upload(Path(folder), 0, stage, *uploads[(0, stage)], run="bench", client="client-0")
            for stage in range(stages)
        ]
        row["client_store_write_s"] = time.perf_counter() - began
        row["client_store_bytes_per_stage"] = sizes[0]
        began = time.perf_counter()
        kept = {stage: load_upload(Path(folder), 0, stage)[:2] for stage in range(stages)}
        row["client_store_read_s"] = time.perf_counter() - began

    # --- a whole-site removal on the server: verify, subtract, one solve
    removal = RidgeState(state.gram.clone(), state.class_sums.clone(), state.num_samples, previous=state.previous)
    began = time.perf_counter()
    for stage, (stats, n) in kept.items():
        upload = Upload(stats.gram_packed, stats.class_sums, stats.counts, n)
        context = {"run": "bench", "client": "client-0", "task": stage}
        assert upload_digest(context, upload) == digests[(0, stage)]
        remove_upload(removal, ranges[stage], upload)
    row["server_verify_subtract_s"] = time.perf_counter() - began
    began = time.perf_counter()
    weights, gamma, _ = removal.solve(total_classes, None, "auto")
    row["server_resolve_s"] = time.perf_counter() - began
    row["resolve_method"] = removal.selection.get("method")
    row["removal_total_s"] = row["client_store_read_s"] + row["server_verify_subtract_s"] + row["server_resolve_s"]

    # --- a site forgets 10 % of its samples of the last stage: one statistics pass, the check, the swap
    phi, labels = data[(1, stages - 1)]
    keep = torch.ones(len(labels), dtype=torch.bool)
    keep[::10] = False
    began = time.perf_counter()
    kept_stats, kept_n = statistics(phi[keep], labels[keep], ranges[-1])
    row["samples_client_pass_s"] = time.perf_counter() - began
    added_stats, added_n = uploads[(1, stages - 1)]
    added = Upload(added_stats.gram_packed, added_stats.class_sums, added_stats.counts, added_n)
    kept_upload = Upload(kept_stats.gram_packed, kept_stats.class_sums, kept_stats.counts, kept_n)
    partial = RidgeState(state.gram.clone(), state.class_sums.clone(), state.num_samples)
    began = time.perf_counter()
    check_removal(added, kept_upload, relative_tolerance=gram_check_epsilon(torch.float64), nonnegative=True)
    row["samples_server_check_s"] = time.perf_counter() - began
    began = time.perf_counter()
    replace_upload(partial, ranges[-1], added, kept_upload)
    row["samples_server_swap_s"] = time.perf_counter() - began

    del partial, kept, uploads
    # --- the re-run without site 0: the other sites' statistics passes and a solve per stage
    rerun = RidgeState.empty(dim, total_classes)
    row["rerun_statistics_s"] = row["rerun_server_s"] = 0.0
    for stage in range(stages):
        for site in range(1, sites):
            began = time.perf_counter()
            stats, n = statistics(*data[(site, stage)], ranges[stage])
            row["rerun_statistics_s"] += time.perf_counter() - began
            began = time.perf_counter()
            rerun.add_packed(ranges[stage], stats.gram_packed, stats.class_sums, n)
            row["rerun_server_s"] += time.perf_counter() - began
        began = time.perf_counter()
        reference, ref_gamma, _ = rerun.solve((stage + 1) * classes, None, "auto")
        row["rerun_server_s"] += time.perf_counter() - began
    row["rerun_total_s"] = row["rerun_statistics_s"] + row["rerun_server_s"]
    row["speedup"] = row["rerun_total_s"] / row["removal_total_s"]
    row["gamma_removal"], row["gamma_rerun"] = gamma, ref_gamma
    row["w_relative_difference"] = float(
        torch.linalg.matrix_norm(weights - reference) / torch.linalg.matrix_norm(reference)
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="+", default=[2000, 5000])
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--stages", type=int, default=5)
    parser.add_argument("--classes", type=int, default=2, help="classes per stage")
    parser.add_argument("--samples", type=int, default=500, help="samples per site and stage")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [run(dim, args.sites, args.stages, args.classes, args.samples, args.seed) for dim in args.dims]
    columns = [
        "M",
        "client_store_bytes_per_stage",
        "removal_total_s",
        "server_resolve_s",
        "samples_client_pass_s",
        "samples_server_check_s",
        "rerun_total_s",
        "speedup",
        "w_relative_difference",
    ]
    print(format_table(rows, columns))
    path = write_json("bench_unlearning", {"args": vars(args), "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
