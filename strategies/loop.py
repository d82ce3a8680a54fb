"""The stage loop: every stage's rounds, then solve, evaluate, record and checkpoint.

After each stage the server state is checkpointed atomically, so ``resume`` continues from the
next stage and ends with the same classifier as an uninterrupted run.

Failures caused by clients never crash the run. A training round with no acceptable reply leaves
the model as it was; a stage that cannot produce a classifier (:class:`StageFailed`: no valid
statistics, a sum that fails its checks, a secure sum that cannot be opened) keeps the previous
classifier and is recorded as failed, with the reason, in results.json (``extra.failed``). With
``require-all-clients`` either stops the run with one line (:class:`RunFailed`).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fcl_flower import interrupt
from fcl_flower.methods import Kind
from fcl_flower.restore import RestoreError
from fcl_flower.results import StageRecord, format_stage_table
from strategies.base import RoundFailed, StageFailed
from strategies.checkpoint import resumable_config
from strategies.evaluation import Riding

if TYPE_CHECKING:
    from strategies.base import StagedStrategy


class RunFailed(RuntimeError):
    """A round or stage failed while ``require-all-clients`` asks for every client in every round."""


def run_stages(strategy: StagedStrategy, grid: Grid, *, timeout: float) -> Result:
    cfg = strategy.cfg
    log(INFO, "Starting %s", cfg.strategy)
    strategy.summary()
    result = Result()
    first_task = restore(strategy) if cfg.resume else 0
    strategy.recorder.start()
    for task in range(first_task, strategy.num_tasks):
        began = time.perf_counter()
        strategy.accounting.reset()
        plans = strategy.plan_stage(task)
        try:
            for plan in plans:
                run_one_round(strategy, grid, plan, timeout, result)
            extra = strategy.end_stage(task)
        except StageFailed as failure:
            if cfg.require_all_clients:
                raise RunFailed(f"stage {task + 1} failed: {failure} (require-all-clients is set)") from None
            log(
                WARNING,
                "[stage %d/%d] failed, the previous classifier is kept: %s",
                task + 1,
                strategy.num_tasks,
                failure,
            )
            extra = strategy.stage_failed(task, str(failure))
        if strategy.riding is not None:  # the previous stage's counts came with this stage's statistics
            add_record(strategy, strategy.riding.complete(strategy, grid))
            strategy.riding = None
        rides = strategy.evaluation_rides(task)  # scored with the next stage's statistics round
        record = stage_record(strategy, task, rounds=len(plans), began=began, extra=extra, grid=grid, pending=rides)
        if rides:
            strategy.riding = Riding.of(strategy, record)
        else:
            add_record(strategy, record)
        strategy.between_stages(grid, task, timeout)  # removals (docs/unlearning.md), where the run asks for them
        save(strategy, task)
    log(INFO, "\n%s", format_stage_table(strategy.recorder.stages))
    log(INFO, "results: %s", strategy.recorder.path)
    return result


STAGE_ROUND_MSG = "[stage %d/%d] round %d/%d (%s)"
STAGE_DONE_MSG = "[stage %d/%d] accuracy on %d seen classes: %.2f%% (%.1f s%s)"


def add_record(strategy: StagedStrategy, record: StageRecord) -> None:
    """A stage's record, scored: into results.json, and its line in the log."""
    strategy.recorder.add(record)
    log(
        INFO,
        STAGE_DONE_MSG,
        record.stage,
        strategy.num_tasks,
        strategy.num_seen(record.stage - 1),
        record.accuracy,
        record.seconds,
        eta(strategy.recorder.stages, strategy.num_tasks),
    )
    if record.left_out:
        log(
            WARNING,
            "[stage %d/%d] data missing from this stage: %s",
            record.stage,
            strategy.num_tasks,
            "; ".join(f"{c}: {why}" for c, why in record.left_out.items()),
        )


def eta(stages: list[StageRecord], num_tasks: int) -> str:
    """``; ETA 1 min 24 s``: the stages left times the mean time of the stages after the first.
    Stage 1 alone says nothing about the others (it also trains the backbone, or not), so until a
    second stage is done the ETA waits for it; empty after the last stage."""
    left = num_tasks - len(stages)
    if left <= 0 or not stages:
        return ""
    if len(stages) < 2:
        return "; ETA after stage 2"
    later = stages[1:]
    seconds = left * sum(s.seconds for s in later) / len(later)
    minutes, rest = divmod(round(seconds), 60)
    return f"; ETA {minutes} min {rest} s" if minutes else f"; ETA {rest} s"


def run_one_round(strategy: StagedStrategy, grid: Grid, plan: Any, timeout: float, result: Result) -> None:
    interrupt.check()  # Ctrl-C: stop before sending another round
    strategy.begin_round(plan)
    began = time.perf_counter()
    uploaded = sum(strategy.accounting.upload.values())
    rejected = len(strategy.accounting.rejected)
    log(
        INFO,
        STAGE_ROUND_MSG,
        plan.task + 1,
        strategy.num_tasks,
        plan.index + 1,
        plan.total,
        plan.phase,
    )
    replies = strategy.run_round(grid, plan, timeout)
    try:
        arrays, metrics = strategy.aggregate_train(strategy.server_round, replies)
    except RoundFailed as failure:
        strategy.recorder.round(strategy.server_round, {"seconds": time.perf_counter() - began, "replies": 0.0})
        if strategy.cfg.require_all_clients:
            raise RunFailed(f"{failure} (require-all-clients is set)") from None
        if plan.kind is not Kind.TRAIN:  # a statistics round without statistics: no classifier
            raise StageFailed(f"{failure}: no statistics") from None
        log(WARNING, "%s: the model is left as it was", failure)
        return
    strategy.recorder.round(
        strategy.server_round,
        {
            "seconds": time.perf_counter() - began,
            "replies": float(metrics["num-clients"]) if metrics is not None else 0.0,  # type: ignore[arg-type]  # ints we put there
            "rejected": float(len(strategy.accounting.rejected) - rejected),
            "upload_bytes": float(sum(strategy.accounting.upload.values()) - uploaded),
            **train_seconds(metrics),
        },
    )
    if metrics is not None:
        result.train_metrics_clientapp[strategy.server_round] = metrics
    if arrays is not None:
        result.arrays = arrays


#: a round's metric (strategies/base.py train_time) -> its name in results.json's ``rounds``
TRAIN_SECONDS_FIELDS = {
    "train-seconds-max": "train_seconds_max",
    "train-seconds-mean": "train_seconds_mean",
    "train-seconds-reported": "train_seconds_reported",
}


def train_seconds(metrics: Any) -> dict[str, float]:
    """The clients' local-training seconds of a round, for its entry in results.json ``rounds``:
    ``train_seconds_max`` (what the round waited for), ``train_seconds_mean`` and how many clients
    reported one; nothing for a round without them (statistics, secure or unreported training)."""
    if metrics is None:
        return {}
    return {name: float(metrics[key]) for key, name in TRAIN_SECONDS_FIELDS.items() if key in metrics}


def stage_record(
    strategy: StagedStrategy,
    task: int,
    *,
    rounds: int,
    began: float,
    extra: dict[str, Any],
    grid: Grid | None = None,
    pending: bool = False,
) -> StageRecord:
    """Stage ``task``'s record; ``pending``: not scored yet (its evaluation rides with the next
    stage's statistics round, :class:`strategies.evaluation.Riding` scores it)."""
    scores: dict[str, Any] = {}
    if pending:
        accuracy, per_task = float("nan"), [float("nan")] * (task + 1)
    else:
        accuracy, per_task, scores = strategy.score_stage(task, grid)
    accounting = strategy.accounting
    extra = {**extra, **scores, **accounting.sampling_extra(), **accounting.timing_extra()}
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
    payload = {
        "strategy": strategy.cfg.strategy,
        "config": resumable_config(strategy.cfg),
        "completed_tasks": task + 1,
        "server_round": strategy.server_round,
        "state": strategy.state_dict(),
        "stages": [asdict(s) for s in strategy.recorder.stages],
    }
    if strategy.riding is not None:  # the last completed stage, its evaluation still to ride
        payload["pending_stage"] = asdict(strategy.riding.record)
    strategy.checkpoints.save(payload)


def restore(strategy: StagedStrategy) -> int:
    """Load the checkpoint of this run, every field checked; returns the first task still to run.
    A state that does not hold what the server wrote is refused with one line naming the field."""
    store = strategy.checkpoints
    payload = store.load(strategy.cfg)
    done = int(payload["completed_tasks"])
    try:
        strategy.load_state_dict(payload["state"])
        strategy.check_restored(done)
    except RestoreError as err:
        raise store.refused(err) from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise store.refused(
            RestoreError("state", f"cannot be restored ({type(err).__name__}: {reason[:200]})")
        ) from None
    strategy.recorder.stages = list(payload["stages"])
    strategy.server_round = int(payload["server_round"])
    pending = payload.get("pending_stage")
    if pending is not None:  # its evaluation rides with the next statistics round, as it would have
        strategy.riding = Riding(pending, strategy.evaluation_request(done - 1))
    log(
        INFO,
        "Resuming %s from %s after stage %d/%d",
        strategy.cfg.strategy,
        strategy.checkpoints.path,
        done,
        strategy.num_tasks,
    )
    return done
