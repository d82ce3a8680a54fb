"""Show that a change leaves every result number as it was.

    fcl-results-diff run --out /tmp/after            # every method's default digits run, plus variants
    fcl-results-diff diff /tmp/before /tmp/after     # every number equal? (exit 1 if not)

``run`` drives the real ServerApp logic and ClientApp in this process (``LocalGrid``, one torch
thread, as in a Ray actor) for the default run config of every registered method and a few
variants that exercise other paths (secure aggregation, min-class-count, dummy clients,
FedRAN-SSL, LGA's client protocol, STAMP's task pool). ``diff`` compares two such folders run by
run: every number and string in results.json must be identical, except wall-clock times
(``seconds``, ``total_seconds``) and, listed separately, the whole-message byte counts
(``upload_message_bytes_per_client``), which change whenever the message framing does.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "stsa-secure": {"strategy": "stsa", "secure_aggregation": True},
    "stsa-mincount3": {"strategy": "stsa", "min_class_count": 3, "beta": 0.2},
    "stsa-e-dummies": {"strategy": "stsa-e", "dummy_clients": 4, "k_mode": "per-class"},
    "fedran-ssl": {"strategy": "fedran", "label_ratio": 0.5, "rank": 64},
    "lga-sampled": {
        "strategy": "lga",
        "partition": "class-subsets",
        "initial_clients": 3,
        "joining_per_task": 1,
        "num_clients": 7,
        "clients_per_round": 3,
        "old_only_fraction": 0.2,
        "beta": 5.0,
        "proxy_iterations": 5,
    },
    "stamp-pool": {"strategy": "stamp", "partition": "task-pool", "classes_per_task": 2, "num_clients": 3},
    "ewc-pool": {"strategy": "ewc", "partition": "task-pool", "classes_per_task": 2, "num_clients": 3},
}
TIMING_KEYS = {"seconds", "total_seconds"}
IGNORED_PATHS = {".config.out"}  # the two runs write to different folders
FRAMING_KEYS = {"upload_message_bytes_per_client"}


def run_all(out: Path, only: list[str] | None = None) -> None:
    import torch

    from experiments.sim import run_local
    from fcl_flower import methods
    from fcl_flower.config import RunConfig

    torch.set_num_threads(1)
    runs = {name: {"strategy": name} for name in methods.names()} | VARIANTS
    for name, changes in runs.items():
        if only and name not in only:
            continue
        cfg = RunConfig(out=str(out), run_name=name, device="cpu").replace(**changes)
        began = time.perf_counter()
        run_local(cfg)
        print(f"{name}: {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)


def differences(before: Any, after: Any, path: str = "") -> tuple[list[str], list[str]]:
    """(differences in results, differences in message framing) between two JSON values."""
    key = path.rsplit(".", 1)[-1]
    if key in TIMING_KEYS or path in IGNORED_PATHS:
        return [], []
    if isinstance(before, dict) and isinstance(after, dict):
        found, framing = [], []
        for k in sorted(set(before) | set(after)):
            if k not in before or k not in after:
                found.append(f"{path}.{k}: only in {'after' if k in after else 'before'}")
                continue
            sub, frame = differences(before[k], after[k], f"{path}.{k}")
            if k in FRAMING_KEYS or path.rsplit(".", 1)[-1] in FRAMING_KEYS:
                frame, sub = frame + sub, []
            found += sub
            framing += frame
        return found, framing
    if isinstance(before, list) and isinstance(after, list):
        if len(before) != len(after):
            return [f"{path}: {len(before)} items before, {len(after)} after"], []
        found, framing = [], []
        for i, (b, a) in enumerate(zip(before, after)):
            sub, frame = differences(b, a, f"{path}[{i}]")
            found += sub
            framing += frame
        return found, framing
    same = before == after or (
        isinstance(before, float) and isinstance(after, float) and math.isnan(before) and math.isnan(after)
    )
    return ([] if same else [f"{path}: {before!r} -> {after!r}"]), []


def diff(before: Path, after: Path) -> int:
    names = sorted(p.name for p in before.iterdir() if (p / "results.json").exists())
    failed = 0
    print(f"{'run':<18} {'result numbers':<16} whole-message bytes (framing), change per stage and client")
    for name in names:
        other = after / name / "results.json"
        if not other.exists():
            print(f"{name:<18} missing after")
            failed += 1
            continue
        found, framing = differences(
            json.loads((before / name / "results.json").read_text()), json.loads(other.read_text())
        )
        deltas = sorted({_delta(line) for line in framing})
        print(
            f"{name:<18} {'identical' if not found else f'{len(found)} differ':<16} "
            f"{'unchanged' if not framing else ', '.join(deltas)}"
        )
        for line in found[:10]:
            print(f"    {line}")
        failed += bool(found)
    print(f"{len(names) - failed} of {len(names)} runs identical")
    return 1 if failed else 0


def _delta(line: str) -> str:
    try:
        old, new = line.rsplit(": ", 1)[1].split(" -> ")
        return f"{int(new) - int(old):+d} B"
    except ValueError:
        return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run every method's default digits run and the variants")
    run.add_argument("--out", required=True, type=Path)
    run.add_argument("--only", nargs="*", help="run names to run (default: all)")
    compare = sub.add_parser("diff", help="compare two folders written by 'run'")
    compare.add_argument("before", type=Path)
    compare.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        run_all(args.out, args.only)
        return 0
    return diff(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
