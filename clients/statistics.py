"""What every statistics client shares: W_rand, local random features, and the backfill reply.

Features come from the frozen backbone in eval mode with test-time transforms (docs/methods/
docs/methods/stsa.md §2.4). Backfill: a client that missed the statistics round of an earlier task (crashed,
timed out, rejected) is asked for it again in a later statistics round
(:attr:`StatsIns.backfill`); the client recomputes those tasks' statistics and returns them as
:class:`~fcl_flower.protocol.Backfill` entries. Statistics are sums over samples, so once every
late upload is in, the aggregate -- and the ridge classifier -- equals the fault-free run's.
Recomputing rather than caching is correct because the backbone is frozen after stage 1 (the
features of old data do not change) and a client that crashed before uploading never had the
statistics to cache. It requires the client to still hold its old task's data, which the
papers' protocol (data of task t only during stage t) does not promise: a deployment that must
delete old data cannot backfill, and its missing stages stay recorded as missing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch
from flwr.app import ArrayRecord

from clients.features import cache_for
from clients.job import ClientJob
from fcl_flower.analytic import random_features, random_projection
from fcl_flower.data import LabelledDataset
from fcl_flower.privacy.noise import NoiseScale, add_gaussian, noise_generator, symmetric_gaussian, upload_scale
from fcl_flower.protocol import Backfill, ProtocolError, StatsRes
from fcl_flower.runtime import iter_features


class Statistics(NamedTuple):
    """One task's upload: the payload (fcl_flower/protocol/payloads.py), samples in it, samples
    withheld under min-class-count."""

    payload: Any  # a payload with .to_record(wire_dtype)
    num_samples: int
    withheld: int = 0


#: encode({task: statistics}) -> {task: (record, number of examples)}: what the reply carries
Encode = Callable[[dict[int, Statistics]], dict[int, tuple[ArrayRecord, int]]]


@dataclass
class UploadNoise:
    """The noise this client adds to one upload (fcl_flower/privacy/noise.py): the std of each
    block and the generator it draws from, block after block, element-wise i.i.d."""

    scale: NoiseScale
    rng: np.random.Generator

    def gram_packed(self, packed: torch.Tensor) -> torch.Tensor:
        """G's packed upper triangle (diagonal included): noise there keeps G symmetric."""
        return add_gaussian(packed, self.rng, self.scale.gram)

    def gram(self, gram: torch.Tensor) -> torch.Tensor:
        if self.scale.gram == 0:
            return gram
        return gram.to(torch.float64) + symmetric_gaussian(self.rng, int(gram.shape[0]), self.scale.gram)

    def sums(self, sums: torch.Tensor) -> torch.Tensor:
        return add_gaussian(sums, self.rng, self.scale.sums)

    def counts(self, counts: torch.Tensor) -> torch.Tensor:
        return add_gaussian(counts, self.rng, self.scale.counts)

    @property
    def on_counts(self) -> bool:
        """Counts are noised: the reply then reports no exact number of samples (0)."""
        return self.scale.counts > 0


def upload_noise(job: ClientJob, task: int, *, share: float = 1.0, stream: int = 0) -> UploadNoise | None:
    """This client's noise for an upload of ``task``'s statistics (None: noise is off).

    ``share`` multiplies every std (a masked upload's share of distributed noise); ``stream``
    separates two uploads of one task in seeded mode (a plain and a masked one).
    """
    scale = upload_scale(job.cfg)
    if scale is None:
        return None
    rng = noise_generator(job.cfg.noise_seeded, (job.cfg.seed, job.partition, task, stream))
    return UploadNoise(scale.scaled(share) if share != 1.0 else scale, rng)


def projection_for(job: ClientJob) -> torch.Tensor | None:
    """W_rand regenerated from the run seed; it never travels (kept per process: a simulated
    client answers many messages, and the current and owed tasks of one reply share it)."""
    return _projection(job.model.backbone.feature_dim, job.cfg.rf_dim, job.cfg.seed)


@lru_cache(maxsize=2)
def _projection(feature_dim: int, rf_dim: int, seed: int) -> torch.Tensor | None:
    projection = random_projection(feature_dim, rf_dim, seed=seed)
    if projection is not None:
        projection.requires_grad_(False)
    return projection


def effective_rf_dim(feature_dim: int, rf_dim: int) -> int:
    return feature_dim if rf_dim in (0, feature_dim) else rf_dim


def task_data(job: ClientJob, task: int) -> LabelledDataset:
    """This client's own partition of ``task`` (the current one, or an owed earlier one)."""
    return job.split.client_train(task, job.partition, eval_transform=True)


def local_task_features(job: ClientJob, task: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Φ of the local samples (n × M) of ``task`` (default: the current one) and their labels
    relative to the task's first class, one row per sample, in float64.

    For the uploads that need the samples themselves: STSA-E (per-sample grouping into dummy
    clients) and STSA's factor form (F = O[Φ Y], clients/stsa.py ``factor_statistics``). STSA's
    Gram upload streams instead (no n × M matrix).
    """
    task = job.task if task is None else task
    projection = projection_for(job)
    phis, labels = [], []
    data, cache = task_data(job, task), cache_for(job, f"task {task}")
    for features, y in iter_features(job.model, data, job.cfg, job.device, cache):
        phis.append(random_features(features, projection, job.cfg.feature_clip))
        labels.append(y - job.split.tasks[task].start)
    dim = effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    if not phis:
        return torch.zeros(0, dim, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    return torch.cat(phis), torch.cat(labels)


def backfill_tasks(job: ClientJob) -> tuple[int, ...]:
    """The earlier tasks whose statistics the server asks this client for (see module doc)."""
    assert hasattr(job.ins, "owed_by")
    owed = job.ins.owed_by(job.partition)
    if any(not 0 <= task < job.task for task in owed):
        raise ProtocolError(f"backfill asks for tasks {list(owed)}, but only tasks 0..{job.task - 1} are past")
    return owed


def reply_with_backfill(
    job: ClientJob, compute: Callable[[ClientJob, int], Statistics], encode: Encode | None = None
) -> StatsRes:
    """``compute(job, task)`` for the current task, plus every owed earlier one.

    ``encode`` turns them into the reply's records (default: each payload at ``wire-dtype``);
    a secure round's encoder also answers for every stage anybody owes, masked (clients/secure.py).
    """
    stats = {job.task: compute(job, job.task), **{task: compute(job, task) for task in backfill_tasks(job)}}
    withheld = sum(s.withheld for s in stats.values())
    if encode is None:
        records = {t: (s.payload.to_record(job.cfg.wire_dtype), s.num_samples) for t, s in stats.items()}
    else:
        records = encode(stats)
    arrays, num_samples = records.pop(job.task)
    return job.stats_reply(
        num_samples,
        arrays=arrays,
        withheld=withheld,
        backfill={task: Backfill(*records[task]) for task in sorted(records)},
    )
