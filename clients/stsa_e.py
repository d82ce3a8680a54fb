"""STSA-E client: class sums and counts only, split over K_D dummy clients (no Gram matrix).

With ``min-class-count`` k > 1 a (dummy client, class) cell holding fewer than k samples is left
out of the upload (a class sum over one sample *is* that sample's feature) and its samples are
reported as withheld.

Noise (fcl_flower/privacy/noise.py, Eq. 64): i.i.d. Gaussian noise on every dummy client's class
sums (``noise-on`` features or both) and counts (counts or both); with noised counts the reply
reports 0 samples.
"""

from __future__ import annotations

import torch

from clients.job import ClientJob
from clients.statistics import Statistics, local_task_features, reply_with_backfill, upload_noise
from clients.upload_store import as_read, keeping, store_folder
from fcl_flower.analytic import StatisticsAccumulator, split_into_dummy_clients
from fcl_flower.privacy.disclosure import withheld_cells
from fcl_flower.protocol import StatsRes
from fcl_flower.protocol.payloads import StsaEStats


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
    return Statistics(StsaEStats(torch.stack(sums), torch.stack(counts)), len(labels) - withheld, withheld)


def noisy_stsa_e_statistics(job: ClientJob, task: int) -> Statistics:
    """:func:`stsa_e_statistics` with this client's noise on the class sums and counts (when on)."""
    stats = stsa_e_statistics(job, task)
    noise = upload_noise(job, task)
    if noise is None:
        return stats
    payload = StsaEStats(noise.sums(stats.payload.class_sums), noise.counts(stats.payload.counts))
    return Statistics(payload, 0 if noise.on_counts else stats.num_samples, stats.withheld)


def kept_arrays(payload: StsaEStats, wire_dtype: str) -> dict[str, torch.Tensor]:
    """What a site keeps of its upload (node config ``upload-store``): as the server reads it."""
    return as_read(payload.arrays(), wire_dtype)


def handle_stats(job: ClientJob) -> StatsRes:
    """STSA-E statistics of the current task (and of any owed earlier task); with node config
    ``upload-store`` each upload is also kept on this node's disk (clients/upload_store.py)."""
    folder = store_folder(job.context.node_config)
    return reply_with_backfill(job, keeping(folder, noisy_stsa_e_statistics, kept_arrays))
