"""STSA client: one pass over the local data, no training; uploads G and C of the task.

The upload is the packed upper triangle of the Gram matrix G = ΦᵀΦ and the class sums C = ΦᵀY of
the task's classes (:class:`~fcl_flower.protocol.payloads.StsaStats`), accumulated batch by batch
in float64, plus the statistics of any earlier task the server says this client owes
(clients/statistics.py).

Privacy: with ``min-class-count`` k > 1 the client leaves out of every upload the samples of the
classes it holds fewer than k of (fcl_flower/privacy/disclosure.py: 3 keeps any single sample's
feature undetermined by G and C) and reports how many. With ``secure-aggregation`` the arrays
leave masked (clients/secure.py), including zero-filled records for stages other clients owe,
so that the masks of every record cancel in the server's sum.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

from clients.job import ClientJob
from clients.secure import mask
from clients.statistics import Statistics, effective_rf_dim, projection_for, reply_with_backfill, task_data
from fcl_flower.analytic import StatisticsAccumulator, pack_upper, packed_length, random_features
from fcl_flower.privacy.disclosure import per_class_counts
from fcl_flower.protocol import StatsIns, StatsRes
from fcl_flower.protocol.payloads import MaskedStsaStats, StsaStats
from fcl_flower.runtime import iter_features


def stsa_statistics(job: ClientJob, task: int) -> Statistics:
    """Spatial statistics S_{t,k} = {G_{t,k}, C_{t,k}} of this client's data of ``task``.

    Samples of classes held fewer than ``min-class-count`` times are left out of G and C alike.
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
    assert stats.gram is not None
    return Statistics(
        StsaStats(pack_upper(stats.gram), stats.class_sums), stats.num_samples, int(counts[~disclosed].sum())
    )


def zero_statistics(job: ClientJob, task: int) -> Statistics:
    """What a secure participant sends for a stage it does not owe: zeros, masked like the rest."""
    dim = effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    return Statistics(
        StsaStats(
            torch.zeros(packed_length(dim), dtype=torch.float64),
            torch.zeros(dim, len(job.split.tasks[task]), dtype=torch.float64),
        ),
        0,
    )


def handle_stats(job: ClientJob) -> StatsRes:
    """STSA statistics of the current task (and of any owed earlier task), masked in a secure round."""
    assert isinstance(job.ins, StatsIns)
    if job.ins.secagg is None:
        return reply_with_backfill(job, stsa_statistics)
    asked = job.ins.owed_by_anyone()

    def masked(stats: dict[int, Statistics]) -> dict[int, tuple[ArrayRecord, int]]:
        every = {**stats, **{t: zero_statistics(job, t) for t in asked if t not in stats}}
        flat = {
            f"{t}/{key}": tensor
            for t, s in every.items()
            for key, tensor in (("gram-packed", s.payload.gram_packed), ("class-sums", s.payload.class_sums))
        }
        ring = mask(job, flat)
        return {
            t: (MaskedStsaStats(ring[f"{t}/gram-packed"], ring[f"{t}/class-sums"]).to_record(), s.num_samples)
            for t, s in every.items()
        }

    return reply_with_backfill(job, stsa_statistics, masked)
