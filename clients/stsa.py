"""STSA client: one pass over the local data, no training; uploads G and C of the task.

The upload is the packed upper triangle of the Gram matrix G = ΦᵀΦ and the class sums C = ΦᵀY of
the task's classes (:class:`~fcl_flower.protocol.payloads.StsaStats`), accumulated batch by batch
in float64, plus the statistics of any earlier task the server says this client owes
(clients/statistics.py).

Privacy: with ``min-class-count`` k > 1 the client leaves out of every upload the samples of the
classes it holds fewer than k of (fcl_flower/privacy/disclosure.py: 3 keeps any single sample's
feature undetermined by G and C) and reports how many. With ``secure-aggregation`` the arrays
leave masked (clients/secure.py), the counts and the withheld count included; owed statistics
ride inside the same upload (see :func:`masked_stats`).

Factor form (``stats-form factor``, fcl_flower/analytic/factor.py): where it is smaller (fewer
samples than about M/2), the upload is F = O[Φ Y] instead, one row per kept sample, turned by a
Haar rotation O drawn with NumPy's PCG64 seeded with 128 bits of OS entropy (not a cryptographic
generator): FᵀF is the same statistics, and F reveals nothing beyond them while O stays secret.
It is never noised or masked (the configuration refuses both).

Noise (``noise-q``/``noise-s`` or ``dp-epsilon``, fcl_flower/privacy/noise.py): the client adds
i.i.d. Gaussian noise to the packed upper triangle of G (so G stays symmetric), to C and to the
counts, as the noise setting says, after computing them in float64 and before the wire cast
or the fixed-point encoding. With noised counts the reply reports 0 samples (the server sums
the noisy counts). In a masked upload the noise goes on the whole upload, owed columns
included; under differential privacy each client adds its share, variance σ²/t, so the sum the
server opens over ≥ t survivors carries at least σ² (fcl_flower/privacy/noise.py ``secure_share``).
"""

from __future__ import annotations

from logging import INFO

import torch
from flwr.common.logger import log

from clients.features import cache_for
from clients.job import ClientJob
from clients.ledger import input_digest
from clients.secure import masked_upload
from clients.statistics import (
    Statistics,
    backfill_tasks,
    effective_rf_dim,
    local_task_features,
    projection_for,
    reply_with_backfill,
    task_data,
    upload_noise,
)
from clients.upload_store import SecureUpload, as_received, keeping, save_secure_upload, store_folder
from fcl_flower.analytic import StatisticsAccumulator, random_features
from fcl_flower.analytic.factor import factor_is_smaller, rotated_factor
from fcl_flower.privacy.disclosure import per_class_counts
from fcl_flower.privacy.noise import noise_generator, secure_share
from fcl_flower.protocol import SecAggRound, StatsIns, StatsRes
from fcl_flower.protocol.payloads import MaskedStsaStats, StsaFactorStats, StsaStats
from fcl_flower.runtime import iter_features
from fcl_flower.tensors import WIRE_DTYPES

ROTATION_STREAM = 2  # the seeded generator key of a factor upload's rotation (0, 1: the noise's streams)


def stsa_statistics(job: ClientJob, task: int, wire: torch.dtype = torch.float64) -> Statistics:
    """Spatial statistics S_{t,k} = {G_{t,k}, C_{t,k}, n_c} of this client's data of ``task``.

    Samples of classes held fewer than ``min-class-count`` times are left out of G, C and the counts.
    G is accumulated in float64 and packed (upper triangle of the symmetrised G) straight into
    ``wire``: the float32 upload never exists as a float64 copy first.
    """
    classes = job.split.tasks[task]
    projection = projection_for(job)
    dim = effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    data = task_data(job, task)
    counts = per_class_counts(torch.as_tensor(data.targets - classes.start), len(classes))
    disclosed = counts >= job.cfg.min_class_count
    accumulator = StatisticsAccumulator(dim, len(classes), with_gram=True)
    for features, y in iter_features(job.model, data, job.cfg, job.device, cache_for(job, f"task {task}")):
        keep = disclosed[y - classes.start]
        accumulator.update(random_features(features[keep], projection, job.cfg.feature_clip), y[keep] - classes.start)
    gram = accumulator.packed_gram(wire)
    stats = accumulator.result(with_gram=False)
    kept = (counts * disclosed).to(torch.float64)
    return Statistics(StsaStats(gram, stats.class_sums, kept), stats.num_samples, int(counts[~disclosed].sum()))


def factor_statistics(job: ClientJob, task: int) -> Statistics:
    """``stats-form factor``: F = O[Φ Y] of the kept samples, O a Haar rotation drawn with NumPy's
    PCG64 seeded with 128 bits of OS entropy (or, with ``noise-seeded``, from (seed, client, task):
    reproducible, and a server that knows the seed can undo it; tests only), when it is smaller
    than the Gram upload (fcl_flower/analytic/factor.py); else the Gram upload."""
    classes = job.split.tasks[task]
    data = task_data(job, task)
    counts = per_class_counts(torch.as_tensor(data.targets - classes.start), len(classes))
    disclosed = counts >= job.cfg.min_class_count
    kept = counts * disclosed
    dim = effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    if not factor_is_smaller(int(kept.sum()), dim, len(classes)):
        return wire_statistics(job, task)
    phi, labels = local_task_features(job, task)
    keep = disclosed[labels]
    rng = noise_generator(job.cfg.noise_seeded, (job.cfg.seed, job.partition, task, ROTATION_STREAM))
    factor = rotated_factor(phi[keep], labels[keep], len(classes), rng)
    payload = StsaFactorStats(factor.to(WIRE_DTYPES[job.cfg.wire_dtype]), kept.to(torch.float64))
    return Statistics(payload, int(kept.sum()), int(counts[~disclosed].sum()))


def wire_statistics(job: ClientJob, task: int) -> Statistics:
    """:func:`stsa_statistics` with G packed in the run's wire dtype (a plain upload)."""
    return stsa_statistics(job, task, WIRE_DTYPES[job.cfg.wire_dtype])


def noisy_stsa_statistics(job: ClientJob, task: int) -> Statistics:
    """A plain upload: :func:`stsa_statistics` with this client's noise on G, C and the counts when
    noise is on (added to the float64 statistics, before the wire cast), else G packed straight
    in the run's wire dtype (:func:`wire_statistics`)."""
    noise = upload_noise(job, task)
    if noise is None:
        return factor_statistics(job, task) if job.cfg.stats_form == "factor" else wire_statistics(job, task)
    stats = stsa_statistics(job, task)
    exact = stats.payload
    payload = StsaStats(noise.gram_packed(exact.gram_packed), noise.sums(exact.class_sums), noise.counts(exact.counts))
    return Statistics(payload, 0 if noise.on_counts else stats.num_samples, stats.withheld)


def kept_arrays(payload: StsaStats | StsaFactorStats, wire_dtype: str) -> dict[str, torch.Tensor] | None:
    """What a site keeps of a plain upload: a Gram upload as the server reads it; a factor none
    (its G is the server's own product, which the site cannot re-send bit for bit)."""
    return as_received(payload, wire_dtype).arrays() if isinstance(payload, StsaStats) else None


def handle_stats(job: ClientJob) -> StatsRes:
    """STSA statistics of the current task and of any owed earlier task; masked in a secure round.
    With node config ``upload-store`` a plain Gram upload is also kept on this node's disk
    (clients/upload_store.py), so that the site can be forgotten exactly later."""
    assert isinstance(job.ins, StatsIns)
    if job.ins.secagg is None:
        folder = store_folder(job.context.node_config)
        return reply_with_backfill(job, keeping(folder, noisy_stsa_statistics, kept_arrays))
    return masked_stats(job, job.ins.secagg)


def masked_stats(job: ClientJob, secagg: SecAggRound) -> StatsRes:
    """One masked upload: G of this task plus the included owed tasks' G, the class sums and counts
    of this task and of every included owed task (zeros where this client owes nothing), and the
    withheld count last. Nothing of it travels in clear; ``num-examples`` is 0."""
    assert isinstance(job.ins, StatsIns)
    included = secagg.backfill_tasks(job.ins.backfill, job.cfg.secagg_min_clients)
    owed = set(backfill_tasks(job))
    current = stsa_statistics(job, job.task)
    late = {task: stsa_statistics(job, task) for task in included if task in owed}
    dim = effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    gram = current.payload.gram_packed.clone()
    sums, counts = [current.payload.class_sums], [current.payload.counts]
    for task in included:
        if task in late:
            gram += late[task].payload.gram_packed
            sums.append(late[task].payload.class_sums)
            counts.append(late[task].payload.counts)
        else:
            width = len(job.split.tasks[task])
            sums.append(torch.zeros(dim, width, dtype=torch.float64))
            counts.append(torch.zeros(width, dtype=torch.float64))
    withheld = current.withheld + sum(stats.withheld for stats in late.values())
    all_sums, all_counts = torch.cat(sums, dim=1), torch.cat(counts)
    noise = upload_noise(job, job.task, share=secure_share(job.cfg, secagg.threshold), stream=1)
    if noise is not None:  # on everything but the withheld count (0 under differential privacy)
        gram, all_sums, all_counts = noise.gram_packed(gram), noise.sums(all_sums), noise.counts(all_counts)
    all_counts = torch.cat([all_counts, torch.tensor([float(withheld)], dtype=torch.float64)])
    mine = {job.task: current, **late}  # what this node itself puts in: its ledger must allow it over this view
    signed = job.cfg.secagg_signed_keys  # statistics are known by digest where a malicious server is in scope
    contributed = {task: _digest(stats) if signed else "" for task, stats in mine.items()}
    arrays = {"gram-packed": gram, "class-sums": all_sums, "counts": all_counts}
    ring, report = masked_upload(job, arrays, included, contributed)
    keep_secure_upload(job, arrays, (job.task, *included), sum(stats.num_samples for stats in mine.values()))
    payload = MaskedStsaStats(ring["gram-packed"], ring["class-sums"], ring["counts"])
    return job.stats_reply(0, arrays=payload.to_record(), secagg=report)


def keep_secure_upload(job: ClientJob, arrays: dict[str, torch.Tensor], layout: tuple[int, ...], samples: int) -> None:
    """With node config ``upload-store`` (clients/upload_store.py), keep what this site just masked
    (the float64 arrays before the deterministic fixed-point encoding), so that a secure forget
    round can later take out exactly the ring elements it added (clients/secure_forget.py). Never
    with noise (the configuration refuses ``forget`` with noise; a noised upload is not kept)."""
    folder = store_folder(job.context.node_config)
    if folder is None or job.cfg.upload_noise:
        return
    assert isinstance(job.ins, StatsIns)
    upload = SecureUpload(
        arrays["gram-packed"], arrays["class-sums"], arrays["counts"], layout, job.ins.header.run_id, samples
    )
    size = save_secure_upload(folder, job.partition, job.task, upload, client=f"client-{job.partition}")
    log(INFO, "client-%d keeps its secure upload of stage %d: %d bytes on disk", job.partition, job.task + 1, size)


def _digest(stats: Statistics) -> str:
    """What the node's ledger knows one task's statistics by (clients/ledger.py)."""
    p = stats.payload
    return input_digest(
        *(t.detach().cpu().double().contiguous().numpy().tobytes() for t in (p.gram_packed, p.class_sums, p.counts))
    )
