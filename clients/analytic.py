"""Statistics clients of the analytic methods: one pass over the local data, no training.

STSA uploads the Gram matrix G = ΦᵀΦ (packed upper triangle) and the class sums C = ΦᵀY of the
task's classes; STSA-E uploads only class sums and counts, split over K_D dummy clients.
Features come from the frozen backbone in eval mode with test-time transforms (spec §2.4).
"""

from __future__ import annotations

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
from fcl_flower.wire import cast_for_wire


def projection_for(job: ClientJob) -> torch.Tensor | None:
    """W_rand regenerated from the run seed; it never travels."""
    return random_projection(job.model.backbone.feature_dim, job.cfg.rf_dim, seed=job.cfg.seed)


def effective_rf_dim(feature_dim: int, rf_dim: int) -> int:
    return feature_dim if rf_dim in (0, feature_dim) else rf_dim


def local_task_features(job: ClientJob) -> tuple[torch.Tensor, torch.Tensor]:
    """Φ of the local samples (n × M) and their labels relative to the task's first class.

    Only for STSA-E / FedRAN, whose uploads need per-sample grouping; STSA streams instead.
    """
    projection = projection_for(job)
    phis, labels = [], []
    for features, y in iter_features(job.model, job.local_data(eval_transform=True), job.cfg, job.device):
        phis.append(random_features(features, projection))
        labels.append(y - job.task_classes.start)
    dim = effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    if not phis:
        return torch.zeros(0, dim, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    return torch.cat(phis), torch.cat(labels)


def handle_stsa_stats(message: Message, job: ClientJob) -> Message:
    """Spatial statistics S_{t,k} = {G_{t,k}, C_{t,k}}, accumulated batch by batch in float64."""
    projection = projection_for(job)
    dim = effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    accumulator = StatisticsAccumulator(dim, len(job.task_classes), with_gram=True)
    for features, y in iter_features(job.model, job.local_data(eval_transform=True), job.cfg, job.device):
        accumulator.update(random_features(features, projection), y - job.task_classes.start)
    stats = accumulator.result()
    arrays = {
        "gram-packed": cast_for_wire(pack_upper(stats.gram), job.cfg.wire_dtype),
        "class-sums": cast_for_wire(stats.class_sums, job.cfg.wire_dtype),
    }
    return make_reply(message, job, arrays, stats.num_samples)


def handle_stsa_e_stats(message: Message, job: ClientJob) -> Message:
    """Class sums and counts of K_D dummy clients (random equal chunks of the local data)."""
    phi, labels = local_task_features(job)
    generator = torch.Generator().manual_seed((job.cfg.seed * 1_000_003 + job.task) * 1_009 + job.partition)
    chunks = split_into_dummy_clients(len(labels), job.cfg.dummy_clients, generator=generator)
    num_classes = len(job.task_classes)
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
    return make_reply(message, job, arrays, len(labels))
