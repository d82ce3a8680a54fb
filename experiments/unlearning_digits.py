"""The digits example of exact unlearning (docs/unlearning.md): five sites, site 3 withdraws after stage 3.

    python -m experiments.unlearning_digits            # two digits runs in process (a few minutes on 2 cores)

Two STSA runs of the default digits setting (5 sites, 5 stages of 2 classes, stage-1 FedAvg,
``ridge auto``), both with ``stage1-exclude = 3`` so that the backbone never learns from site 3,
through the real ClientApp and the strategy's own stage loop on an in-process grid:

* ``withdraws``: every site keeps its uploads (node config ``upload-store``); run config
  ``forget = "3:3"``: after stage 3 the server asks site 3 to re-send them, checks them against its
  commitments, takes them out, solves again and records the accuracy before and after; site 3
  takes no part in stages 4 and 5;
* ``never``: the same run where site 3's statistics never reach the server.

Written: experiments/results/unlearning_digits.json (per-task accuracy of both runs at every stage,
the removal's record, the relative difference of W between the runs after stage 3's removal and at
stages 4 and 5) and docs/img/unlearning_digits.png (per-task accuracy after stage 3 before and after
the removal, and of the run that never had site 3; the same after stage 5).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import Message
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from clients.app import app as client_app
from experiments.benchlib import RESULTS_DIR
from fcl_flower.config import RunConfig
from fcl_flower.local_grid import LocalGrid
from fcl_flower.results import ResultsRecorder
from fcl_flower.runtime import server_split
from strategies import build_strategy

SITE, AFTER = 3, 3
IMG = Path(__file__).resolve().parent.parent / "docs" / "img" / "unlearning_digits.png"


def run(
    cfg: RunConfig, node_configs: list[dict[str, Any]], drop: int | None = None
) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """Run every stage of ``cfg``; (the strategy, W after each stage's solve, W after each re-solve
    of a forget round)."""
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
    recorder = ResultsRecorder(cfg.output_dir, cfg.strategy, cfg.to_mapping(), num_tasks=cfg.num_tasks)
    strategy = build_strategy(cfg, server_split(cfg), recorder)
    weights: list[torch.Tensor] = []
    end_stage = strategy.end_stage

    def spy(task: int) -> dict[str, Any]:
        extra = end_stage(task)
        weights.append(strategy.weights.clone())  # type: ignore[attr-defined]
        return extra

    strategy.end_stage = spy  # type: ignore[method-assign]
    resolved: list[torch.Tensor] = []
    resolve = getattr(strategy, "resolve", None)

    def resolve_spy(task: int) -> dict[str, Any]:
        assert resolve is not None
        record = resolve(task)
        resolved.append(strategy.weights.clone())  # type: ignore[attr-defined]
        return record

    if resolve is not None:
        strategy.resolve = resolve_spy  # type: ignore[attr-defined]

    def tamper(sent: Sequence[Message], replies: list[Message]) -> list[Message]:
        if drop is None:
            return replies
        return [
            r
            for r in replies
            if r.has_error() or int(r.content.metric_records["metrics"]["partition-id"]) != drop  # type: ignore[arg-type]
        ]

    grid = LocalGrid(client_app, cfg.num_clients, tamper=tamper, record=False, node_configs=node_configs)
    strategy.start(grid)
    recorder.finish()
    return strategy, weights, resolved


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


def plot(path: Path, withdraws: dict[str, Any], never: dict[str, Any], record: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    width = 0.27
    stage3 = range(1, AFTER + 1)
    bars = [
        ("with site 3 (before)", record["per_task_before"]),
        ("site 3 forgotten (after)", record["per_task_after"]),
        ("never had site 3", never["stages"][AFTER - 1]["per_task_accuracy"]),
    ]
    for i, (label, values) in enumerate(bars):
        axes[0].bar([t + (i - 1) * width for t in stage3], values, width, label=label)
    axes[0].set_title(f"after stage {AFTER}")
    axes[0].set_xlabel("task")
    axes[0].set_ylabel("accuracy (%)")
    axes[0].set_xticks(list(stage3))
    last = range(1, len(withdraws["stages"]) + 1)
    for i, (label, values) in enumerate(
        [
            ("site 3 forgotten after stage 3", withdraws["stages"][-1]["per_task_accuracy"]),
            ("never had site 3", never["stages"][-1]["per_task_accuracy"]),
        ]
    ):
        axes[1].bar([t + (i - 0.5) * width for t in last], values, width, label=label)
    axes[1].set_title(f"after stage {len(last)}")
    axes[1].set_xlabel("task")
    axes[1].set_xticks(list(last))
    for ax in axes:
        ax.set_ylim(80, 100.5)
        ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS_DIR / "unlearning_digits.json"))
    parser.add_argument("--img", default=str(IMG))
    parser.add_argument("--stage1-rounds", type=int, default=RunConfig().stage1_rounds)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the numbers of a Ray actor
    with tempfile.TemporaryDirectory() as folder:
        base = RunConfig(
            dataset="digits",
            num_clients=5,
            num_tasks=5,
            stage1_rounds=args.stage1_rounds,
            stage1_exclude=str(SITE),
            device="cpu",
            out=folder,
            round_timeout=60.0,
        )
        store = Path(folder) / "store"
        nodes = [{"partition-id": k, "num-partitions": 5, "upload-store": str(store)} for k in range(5)]
        plain = [{"partition-id": k, "num-partitions": 5} for k in range(5)]
        withdraws, w_weights, w_resolved = run(
            base.replace(run_name="withdraws", forget=f"{AFTER}:{SITE}").validated(), nodes
        )
        never, n_weights, _ = run(base.replace(run_name="never").validated(), plain, drop=SITE)
        sizes = {int(p.stem.removeprefix("task-")): p.stat().st_size for p in (store / f"partition-{SITE}").glob("*")}
        w_json = json.loads(withdraws.recorder.path.read_text())
        n_json = json.loads(never.recorder.path.read_text())
    record = w_json["unlearning"][0]
    after_removal = relative(w_resolved[0], n_weights[AFTER - 1])  # the forget round's re-solve
    result = {
        "site": SITE,
        "after_stage": AFTER,
        "site_store_bytes_per_stage": dict(sorted(sizes.items())),
        "removal": record,
        "w_relative_difference": {
            f"stage {AFTER} before the removal": relative(w_weights[AFTER - 1], n_weights[AFTER - 1]),
            f"stage {AFTER} after the removal": after_removal,
            **{f"stage {t + 1}": relative(w_weights[t], n_weights[t]) for t in range(AFTER, base.num_tasks)},
        },
        "withdraws": {k: w_json[k] for k in ("A_avg", "A_T", "F_T")},
        "never": {k: n_json[k] for k in ("A_avg", "A_T", "F_T")},
        "per_task_accuracy": {
            "withdraws": [s["per_task_accuracy"] for s in w_json["stages"]],
            "never": [s["per_task_accuracy"] for s in n_json["stages"]],
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    plot(Path(args.img), w_json, n_json, record)
    print(json.dumps({k: result[k] for k in ("w_relative_difference", "withdraws", "never")}, indent=2))
    print(f"wrote {args.out} and {args.img}")


if __name__ == "__main__":
    main()
