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

Privacy: with ``min-class-count`` k > 1 a client leaves out of every upload the samples of the
classes it holds fewer than k of (fcl_flower/privacy/disclosure.py: 3 keeps any single sample's
feature undetermined by G and C, 2 suffices for sums alone) and reports how many in the metric
:data:`WITHHELD_METRIC`. With ``secure-aggregation`` (STSA) the arrays leave masked
(clients/secure.py), including zero-filled backfill records for stages the client does not owe,
so that the masks of every record cancel in the server's sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from flwr.app import ArrayRecord, Message

from clients.job import ClientJob, make_reply
from clients.secure import mask_records, secure_round
from fcl_flower.analytic import (
    StatisticsAccumulator,
    pack_upper,
    packed_length,
    random_features,
    random_projection,
    split_into_dummy_clients,
)
from fcl_flower.privacy.disclosure import per_class_counts, withheld_cells
from fcl_flower.runtime import iter_features
from fcl_flower.wire import cast_for_wire, to_record

BACKFILL_KEY = "backfill"  # round-config key: "partition:task,task;partition:task" still owed
BACKFILL_PREFIX = "backfill-"  # reply record "backfill-<task>", metric "backfill-<task>-num-examples"
WITHHELD_METRIC = "withheld-samples"  # samples left out under min-class-count (all records of a reply)


class Statistics(NamedTuple):
    """One task's upload: wire arrays, samples in them, samples withheld under min-class-count."""

    arrays: dict[str, torch.Tensor]
    num_samples: int
    withheld: int = 0


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
                        compute: Callable[[ClientJob, int], Statistics],
                        zeros: Callable[[ClientJob, int], Statistics] | None = None) -> Message:
    """``compute(job, task)`` for the current task, plus every owed earlier one.

    In a secure round every participant answers for every stage anybody owes (``zeros`` for
    the ones it does not owe) and all arrays are masked before they leave.
    """
    current = compute(job, job.task)
    owed = backfill_tasks(job)
    late = {task: compute(job, task) for task in owed}
    if secure_round(job):
        assert zeros is not None, "this method has no secure-aggregation path"
        asked = {t for ts in decode_backfill(str(job.round_config.get(BACKFILL_KEY, ""))).values() for t in ts}
        late.update({task: zeros(job, task) for task in sorted(asked - set(owed))})
    metrics = {f"{BACKFILL_PREFIX}{task}-num-examples": stats.num_samples for task, stats in late.items()}
    metrics[WITHHELD_METRIC] = current.withheld + sum(stats.withheld for stats in late.values())
    records = {"arrays": current.arrays, **{f"{BACKFILL_PREFIX}{task}": stats.arrays for task, stats in late.items()}}
    if secure_round(job):
        wire = {name: ArrayRecord(masked) for name, masked in mask_records(job, records).items()}
    else:
        wire = {name: to_record(arrays) for name, arrays in records.items()}
    return make_reply(message, job, wire.pop("arrays"), current.num_samples, metrics, extra_records=wire)


def stsa_statistics(job: ClientJob, task: int) -> Statistics:
    """Spatial statistics S_{t,k} = {G_{t,k}, C_{t,k}}, accumulated batch by batch in float64.

    Samples of classes held fewer than ``min-class-count`` times are left out of G and C alike.
    A secure round uploads float64 (it is encoded in the 64-bit ring anyway).
    """
    classes = job.split.tasks[task]
    projection = projection_for(job)
    dim = effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    data = task_data(job, task)
    counts = per_class_counts(torch.as_tensor(data.targets - classes.start), len(classes))
    disclosed = counts >= job.cfg.min_class_count
    accumulator = StatisticsAccumulator(dim, len(classes), with_gram=True)
    for features, y in iter_features(job.model, data, job.cfg, job.device):
        keep = disclosed[y - classes.start]
        accumulator.update(random_features(features[keep], projection), y[keep] - classes.start)
    stats = accumulator.result()
    wire = "float64" if secure_round(job) else job.cfg.wire_dtype
    arrays = {
        "gram-packed": cast_for_wire(pack_upper(stats.gram), wire),
        "class-sums": cast_for_wire(stats.class_sums, wire),
    }
    return Statistics(arrays, stats.num_samples, int(counts[~disclosed].sum()))


def stsa_zero_statistics(job: ClientJob, task: int) -> Statistics:
    """What a secure participant sends for a stage it does not owe: zeros, masked like the rest."""
    dim = effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    return Statistics({"gram-packed": torch.zeros(packed_length(dim), dtype=torch.float64),
                       "class-sums": torch.zeros(dim, len(job.split.tasks[task]), dtype=torch.float64)}, 0)


def handle_stsa_stats(message: Message, job: ClientJob) -> Message:
    """STSA statistics of the current task (and of any owed earlier task)."""
    return reply_with_backfill(message, job, stsa_statistics, stsa_zero_statistics)


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
    sums, counts, withheld = [], [], 0
    for chunk in chunks:
        accumulator = StatisticsAccumulator(phi.shape[1], num_classes, with_gram=False)
        if len(chunk):
            accumulator.update(phi[chunk], labels[chunk])
        stats = accumulator.result()
        small = withheld_cells(stats.counts, job.cfg.min_class_count)  # a sum over < k samples stays here
        withheld += int(stats.counts[small].sum())
        sums.append(stats.class_sums * ~small)
        counts.append(stats.counts.to(torch.float64) * ~small)
    arrays = {
        "class-sums": cast_for_wire(torch.stack(sums), job.cfg.wire_dtype),
        "counts": cast_for_wire(torch.stack(counts), job.cfg.wire_dtype),
    }
    return Statistics(arrays, len(labels) - withheld, withheld)
