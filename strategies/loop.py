"""The stage loop: every stage's rounds, then solve, evaluate, record and checkpoint.

After each stage the server state is checkpointed atomically, so ``resume`` continues from the
next stage and ends with the same classifier as an uninterrupted run.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fcl_flower.results import StageRecord, format_stage_table
from strategies.checkpoint import resumable_config

if TYPE_CHECKING:
    from strategies.base import StagedStrategy


def run_stages(strategy: StagedStrategy, grid: Grid, *, timeout: float) -> Result:
    cfg = strategy.cfg
    log(INFO, "Starting %s", cfg.strategy)
    strategy.summary()
    result = Result()
    first_task = restore(strategy) if cfg.resume else 0
    for task in range(first_task, strategy.num_tasks):
        began = time.perf_counter()
        strategy.accounting.reset()
        plans = strategy.plan_stage(task)
        for plan in plans:
            strategy.begin_round(plan)
            log(
                INFO,
                "[stage %d/%d] round %d/%d (%s)",
                task + 1,
                strategy.num_tasks,
                plan.index + 1,
                plan.total,
                plan.phase,
            )
            replies = strategy.run_round(grid, plan, timeout)
            arrays, metrics = strategy.aggregate_train(strategy.server_round, replies)
            if metrics is not None:
                result.train_metrics_clientapp[strategy.server_round] = metrics
            if arrays is not None:
                result.arrays = arrays
        extra = strategy.end_stage(task)
        record = stage_record(strategy, task, rounds=len(plans), began=began, extra=extra)
        strategy.recorder.add(record)
        save(strategy, task)
        log(
            INFO,
            "[stage %d/%d] accuracy on %d seen classes: %.2f%% (%.1f s)",
            task + 1,
            strategy.num_tasks,
            strategy.num_seen(task),
            record.accuracy,
            record.seconds,
        )
        if record.left_out:
            log(
                WARNING,
                "[stage %d/%d] data missing from this stage: %s",
                task + 1,
                strategy.num_tasks,
                "; ".join(f"{c}: {why}" for c, why in record.left_out.items()),
            )
    log(INFO, "\n%s", format_stage_table(strategy.recorder.stages))
    log(INFO, "results: %s", strategy.recorder.path)
    return result


def stage_record(
    strategy: StagedStrategy, task: int, *, rounds: int, began: float, extra: dict[str, Any]
) -> StageRecord:
    accuracy, per_task, scores = strategy.score_stage(task)
    accounting = strategy.accounting
    extra = {**extra, **scores, **accounting.sampling_extra()}
    old_only = strategy.split.old_only
    if len(old_only[task]):
        extra = {**extra, "old_only_clients": [f"client-{c}" for c in old_only[task].tolist()]}
    return StageRecord(
        stage=task + 1,
        classes=strategy.split.stage_classes(task),
        accuracy=accuracy,
        per_task_accuracy=per_task,
        seconds=time.perf_counter() - began,
        rounds=rounds,
        upload_bytes_per_client=dict(sorted(accounting.upload.items())),
        upload_message_bytes_per_client=dict(sorted(accounting.message.items())),
        clients=sorted(accounting.clients),
        left_out=accounting.left_out(strategy.cfg.num_clients, rounds),
        extra=extra,
    )


def save(strategy: StagedStrategy, task: int) -> None:
    strategy.checkpoints.save(
        {
            "strategy": strategy.cfg.strategy,
            "config": resumable_config(strategy.cfg),
            "completed_tasks": task + 1,
            "server_round": strategy.server_round,
            "state": strategy.state_dict(),
            "stages": [asdict(s) for s in strategy.recorder.stages],
        }
    )


def restore(strategy: StagedStrategy) -> int:
    """Load the checkpoint of this run; returns the first task still to run."""
    payload = strategy.checkpoints.load(strategy.cfg)
    strategy.load_state_dict(payload["state"])
    strategy.recorder.stages = [StageRecord(**s) for s in payload["stages"]]
    strategy.server_round = int(payload.get("server_round", 0))
    done = int(payload["completed_tasks"])
    log(
        INFO,
        "Resuming %s from %s after stage %d/%d",
        strategy.cfg.strategy,
        strategy.checkpoints.path,
        done,
        strategy.num_tasks,
    )
    return done
