"""Statistics clients of the analytic methods: one pass over the local data, no training.

STSA uploads the Gram matrix G = ΦᵀΦ (packed upper triangle) and the class sums C = ΦᵀY of the
task's classes; STSA-E uploads only class sums and counts, split over K_D dummy clients.
Features come from the frozen backbone in eval mode with test-time transforms (spec §2.4).

Backfill: a client that missed the statistics round of an earlier task (crashed, timed out,
rejected) is asked for it again in a later statistics round. The round config key
:data:`BACKFILL_KEY` lists, per partition, the tasks the server still lacks; the client
recomputes those tasks' statistics and returns them in extra ArrayRecords ``backfill-<task>``
(same arrays as "arrays") with ``backfill-<task>-num-examples`` in its metrics. Statistics are
sums over samples, so once every late upload is in, the aggregate -- and the ridge classifier --
equals the fault-free run's. Recomputing rather than caching is correct because the backbone
is frozen after stage 1 (the features of old data do not change) and a client that crashed
before uploading never had the statistics to cache. It requires the client to still hold its
old task's data, which the papers' protocol (data of task t only during stage t) does not
promise: a deployment that must delete old data cannot backfill, and its missing stages stay
recorded as missing in results.json.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import Message

from clients.job import ClientJob, make_reply
from fcl_flower.analytic import (
    StatisticsAccumulator,
    pack_upper,
    random_features,
    random_projection,
    split_into_dummy_clients,
)
from fcl_flower.runtime import iter_features
from fcl_flower.wire import cast_for_wire, to_record

BACKFILL_KEY = "backfill"  # round-config key: "partition:task,task;partition:task" still owed
BACKFILL_PREFIX = "backfill-"  # reply record "backfill-<task>", metric "backfill-<task>-num-examples"

Statistics = tuple[dict[str, torch.Tensor], int]  # (wire arrays, number of samples) of one task


class BackfillError(ValueError):
    """The server's backfill request cannot be read or names a task that is not in the past."""


def encode_backfill(owed: dict[int, list[int]]) -> str:
    """{partition: [task, ...]} -> "0:1,3;2:1" (a ConfigRecord carries scalars, not dicts)."""
    return ";".join(f"{p}:{','.join(str(t) for t in sorted(tasks))}"
                    for p, tasks in sorted(owed.items()) if tasks)


def decode_backfill(text: str) -> dict[int, list[int]]:
    """Inverse of :func:`encode_backfill`; raises BackfillError on anything else."""
    owed: dict[int, list[int]] = {}
    for entry in filter(None, text.strip().split(";")):
        try:
            partition, tasks = entry.split(":")
            owed[int(partition)] = sorted(int(t) for t in tasks.split(","))
        except ValueError:
            raise BackfillError(f"cannot read backfill entry '{entry}' (expected partition:task,task)") from None
    return owed


def backfill_task_of(record_name: str) -> int | None:
    """The task of a ``backfill-<task>`` reply record, None for any other name."""
    rest = record_name[len(BACKFILL_PREFIX):] if record_name.startswith(BACKFILL_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def projection_for(job: ClientJob) -> torch.Tensor | None:
    """W_rand regenerated from the run seed; it never travels."""
    return random_projection(job.model.backbone.feature_dim, job.cfg.rf_dim, seed=job.cfg.seed)


def effective_rf_dim(feature_dim: int, rf_dim: int) -> int:
    return feature_dim if rf_dim in (0, feature_dim) else rf_dim


def task_data(job: ClientJob, task: int):
    """This client's own partition of ``task`` (the current one, or an owed earlier one)."""
    return job.split.client_train(task, job.partition, eval_transform=True)


def local_task_features(job: ClientJob, task: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Φ of the local samples (n × M) of ``task`` (default: the current one) and their labels
    relative to the task's first class.

    Only for STSA-E / FedRAN, whose uploads need per-sample grouping; STSA streams instead.
    """
    task = job.task if task is None else task
    projection = projection_for(job)
    phis, labels = [], []
    for features, y in iter_features(job.model, task_data(job, task), job.cfg, job.device):
        phis.append(random_features(features, projection))
        labels.append(y - job.split.tasks[task].start)
    dim = effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    if not phis:
        return torch.zeros(0, dim, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    return torch.cat(phis), torch.cat(labels)


def backfill_tasks(job: ClientJob) -> list[int]:
    """The earlier tasks whose statistics the server asks this client for (see module doc)."""
    owed = decode_backfill(str(job.round_config.get(BACKFILL_KEY, ""))).get(job.partition, [])
    if any(not 0 <= task < job.task for task in owed):
        raise BackfillError(f"backfill asks for tasks {owed}, but only tasks 0..{job.task - 1} are past")
    return owed


def reply_with_backfill(message: Message, job: ClientJob,
                        compute: Callable[[ClientJob, int], Statistics]) -> Message:
    """``compute(job, task) -> (arrays, n)`` for the current task, plus every owed earlier one."""
    arrays, num_samples = compute(job, job.task)
    late = {task: compute(job, task) for task in backfill_tasks(job)}
    metrics = {f"{BACKFILL_PREFIX}{task}-num-examples": n for task, (_, n) in late.items()}
    records = {f"{BACKFILL_PREFIX}{task}": to_record(late_arrays) for task, (late_arrays, _) in late.items()}
    return make_reply(message, job, arrays, num_samples, metrics, extra_records=records)


def stsa_statistics(job: ClientJob, task: int) -> Statistics:
    """Spatial statistics S_{t,k} = {G_{t,k}, C_{t,k}}, accumulated batch by batch in float64."""
    classes = job.split.tasks[task]
    projection = projection_for(job)
    dim = effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    accumulator = StatisticsAccumulator(dim, len(classes), with_gram=True)
    for features, y in iter_features(job.model, task_data(job, task), job.cfg, job.device):
        accumulator.update(random_features(features, projection), y - classes.start)
    stats = accumulator.result()
    arrays = {
        "gram-packed": cast_for_wire(pack_upper(stats.gram), job.cfg.wire_dtype),
        "class-sums": cast_for_wire(stats.class_sums, job.cfg.wire_dtype),
    }
    return arrays, stats.num_samples


def handle_stsa_stats(message: Message, job: ClientJob) -> Message:
    """STSA statistics of the current task (and of any owed earlier task)."""
    return reply_with_backfill(message, job, stsa_statistics)


def handle_stsa_e_stats(message: Message, job: ClientJob) -> Message:
    """STSA-E statistics of the current task (and of any owed earlier task)."""
    return reply_with_backfill(message, job, stsa_e_statistics)


def stsa_e_statistics(job: ClientJob, task: int) -> Statistics:
    """Class sums and counts of K_D dummy clients (random equal chunks of the local data).

    The chunking is seeded by (seed, task, partition), so a backfilled upload is the one the
    client would have sent in its own stage.
    """
    phi, labels = local_task_features(job, task)
    generator = torch.Generator().manual_seed((job.cfg.seed * 1_000_003 + task) * 1_009 + job.partition)
    chunks = split_into_dummy_clients(len(labels), job.cfg.dummy_clients, generator=generator)
    num_classes = len(job.split.tasks[task])
    sums, counts = [], []
    for chunk in chunks:
        accumulator = StatisticsAccumulator(phi.shape[1], num_classes, with_gram=False)
        if len(chunk):
            accumulator.update(phi[chunk], labels[chunk])
        stats = accumulator.result()
        sums.append(stats.class_sums)
        counts.append(stats.counts.to(torch.float64))
    arrays = {
        "class-sums": cast_for_wire(torch.stack(sums), job.cfg.wire_dtype),
        "counts": cast_for_wire(torch.stack(counts), job.cfg.wire_dtype),
    }
    return arrays, len(labels)
