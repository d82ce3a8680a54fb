"""FedRAN client: one pass over the local data, a rank-r Gram summary and the exact B (docs/methods/fedran.md §2.5–2.6).

Per task the client extracts frozen backbone features Z, optionally pseudo-labels its unlabelled
samples on Z (FedRAN-SSL, Algorithm 4), maps the kept samples to random features
H = ReLU(Z̃ P) and uploads

    basis U (M × r_k), singular values σ (r_k), B = HᵀY (M × C_t),

with r_k = min(r, ñ, M) and C_t the number of classes seen so far: M·r_k + r_k + M·C_t numbers,
the docs/methods/fedran.md §3.1 count. G = HᵀH itself never leaves the client. The rank r is chosen by the server
(:attr:`StatsIns.rank`) because a byte budget makes it depend on C_t (Eq. 12).

The true labels of the unlabelled samples are read only to *report* how many accepted
pseudo-labels are right (a simulation diagnostic, docs/methods/fedran.md §6.10); they never enter H or B.

Noise (fcl_flower/privacy/noise.py): ``features`` noises G = HᵀH (symmetric, i.i.d. on and above
the diagonal) *before* the truncated eigendecomposition, and the current task's columns of B:
its other columns (the classes of earlier tasks) are zero for every dataset of this task, so they
reveal nothing and stay exact -- noising them would add each stage's noise again to every old
class. The sketch of a noised Gram keeps r_k = min(r, M) components, whatever ñ is. ``counts`` noises ñ: the reply reports
round(max(ñ + noise, 0)) samples, and its pseudo-label report carries nothing more exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from clients.features import cache_for
from clients.job import ClientJob
from clients.statistics import UploadNoise, effective_rf_dim, projection_for, upload_noise
from clients.upload_store import as_read, keep_upload, store_folder
from fcl_flower.analytic import random_features
from fcl_flower.analytic.lowrank import LowRankSummary, client_summary, client_summary_from_gram
from fcl_flower.analytic.pseudolabel import pseudo_label_client, pseudo_label_report, select_labelled
from fcl_flower.privacy.disclosure import disclosable
from fcl_flower.protocol import FedranReport, ProtocolError, StatsIns, StatsRes
from fcl_flower.protocol.payloads import FedranStats
from fcl_flower.runtime import iter_features


@dataclass(frozen=True)
class FedRANClientStats:
    """What one client computes for one task, before casting for the wire.

    ``summary``: rank-r_k sketch of HᵀH over the kept samples; ``label_corr``: B = HᵀY (M × C_t);
    ``num_labelled``: labelled samples; ``pseudo``: :func:`pseudo_label_report` over the
    unlabelled ones (total / accepted / correct / rates).
    """

    summary: LowRankSummary
    label_corr: Tensor
    num_labelled: int
    pseudo: dict[str, float]
    withheld: int = 0  # kept samples left out under min-class-count

    @property
    def num_samples(self) -> int:
        """ñ = labelled + accepted pseudo-labelled samples (the rows of H)."""
        return self.summary.num_samples


def labelled_mask(seed: int, task: int, partition: int, num_samples: int, ratio: float) -> Tensor:
    """Which local samples are labelled: a seeded ρ fraction per (seed, task, client) (docs/methods/fedran.md §1.3 [I]).

    Deterministic on every machine (CPU generator); ρ = 1 marks everything without drawing.
    """
    generator = torch.Generator().manual_seed(((seed * 1_000_003 + task) * 1_009 + partition) * 7 + 3)
    return select_labelled(num_samples, ratio, generator)


def random_feature_statistics(
    features: Tensor,
    labels: Tensor,
    projection: Tensor | None,
    num_classes: int,
    rank: int,
    chunk_size: int = 1024,
    clip: float = 0.0,
    noise: UploadNoise | None = None,
    noised_classes: range | None = None,
) -> tuple[LowRankSummary, Tensor]:
    """(rank-r sketch of HᵀH, B = HᵀY) for H = ReLU(Z P), Y = one-hot(labels, ``num_classes``).

    For ñ < M the thin SVD of H itself (Algorithm 2, exact); otherwise HᵀH and B are summed chunk
    by chunk so H (ñ × M) is never held at once, then eigendecomposed. B is accumulated class-wise
    (column c = sum of the rows with label c), all in float64. With ``noise`` on the features,
    HᵀH and the ``noised_classes`` columns of B (default: all) get their noise first and the
    sketch keeps min(r, M) components.
    """
    n = int(features.shape[0])
    dim = int(features.shape[1]) if projection is None else int(projection.shape[1])
    labels = labels.to(torch.int64)
    label_corr = torch.zeros(dim, num_classes, dtype=torch.float64)
    noised = noise is not None and noise.scale.gram + noise.scale.sums > 0
    if n < dim and not noised:
        h = random_features(features, projection, clip)
        label_corr.index_add_(1, labels, h.T)
        return client_summary(h, rank, method="svd"), label_corr
    gram = torch.zeros(dim, dim, dtype=torch.float64)
    for start in range(0, n, chunk_size):
        h = random_features(features[start : start + chunk_size], projection, clip)
        gram += h.T @ h
        label_corr.index_add_(1, labels[start : start + chunk_size], h.T)
    if noised:
        assert noise is not None
        columns = noised_classes if noised_classes is not None else range(num_classes)
        gram = noise.gram(gram)
        label_corr[:, columns.start : columns.stop] = noise.sums(label_corr[:, columns.start : columns.stop])
        keep = min(rank, dim) if noise.scale.gram > 0 else None
        return client_summary_from_gram(gram, n, rank, keep=keep), label_corr
    return client_summary_from_gram(gram, n, rank), label_corr


def fedran_client_update(
    features: Tensor,
    labels: Tensor,
    labelled: Tensor,
    projection: Tensor | None,
    *,
    num_classes: int,
    rank: int,
    threshold: float,
    min_count: int = 1,
    clip: float = 0.0,
    noise: UploadNoise | None = None,
    noised_classes: range | None = None,
) -> FedRANClientStats:
    """Algorithm 1, client side, on backbone features Z (n × d) with true ``labels``.

    ``labelled`` marks D^ℓ. Prototypes come from the labelled Z only; an unlabelled sample joins
    with its prototype class iff its best cosine over the client's labelled classes is ≥ τ;
    rejected ones are dropped (docs/methods/fedran.md §2.5). Labelled + accepted samples then enter both the Gram
    summary and B. With every sample labelled this is exactly plain FedRAN. Classes with fewer
    than ``min_count`` kept samples are then left out of both (fcl_flower/privacy/disclosure.py).
    """
    labels = labels.to(torch.int64)
    labelled = labelled.to(torch.bool)
    hidden = labels[~labelled]
    kept = pseudo_label_client(features[labelled], labels[labelled], features[~labelled], num_classes, threshold)
    disclosed = disclosable(kept.labels, num_classes, min_count)
    summary, label_corr = random_feature_statistics(
        kept.features[disclosed],
        kept.labels[disclosed],
        projection,
        num_classes,
        rank,
        clip=clip,
        noise=noise,
        noised_classes=noised_classes,
    )
    report = pseudo_label_report(kept.accepted, kept.predicted, hidden)
    return FedRANClientStats(summary, label_corr, kept.num_labelled, report, int((~disclosed).sum()))


def local_backbone_features(job: ClientJob) -> tuple[Tensor, Tensor]:
    """Z (n × d, float64) and global labels of this client's samples of the current task."""
    zs, ys = [], []
    data, cache = job.local_data(eval_transform=True), cache_for(job, f"task {job.task}")
    for features, y in iter_features(job.model, data, job.cfg, job.device, cache):
        zs.append(features)
        ys.append(y)
    if not zs:
        return torch.zeros(0, job.model.backbone.feature_dim, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    return torch.cat(zs), torch.cat(ys)


def handle_stats(job: ClientJob) -> StatsRes:
    """Upload (U, σ, B) of the labelled + accepted pseudo-labelled local samples."""
    assert isinstance(job.ins, StatsIns)
    if job.ins.rank < 1:
        raise ProtocolError("FedRAN statistics round without an upload rank: the server must set it")
    features, labels = local_backbone_features(job)
    mask = labelled_mask(job.cfg.seed, job.task, job.partition, int(labels.shape[0]), job.cfg.label_ratio)
    noise = upload_noise(job, job.task)
    stats = fedran_client_update(
        features,
        labels,
        mask,
        projection_for(job),
        num_classes=job.num_seen,
        rank=job.ins.rank,
        threshold=job.cfg.pseudo_threshold,
        min_count=job.cfg.min_class_count,
        clip=job.cfg.feature_clip,
        noise=noise,
        noised_classes=job.task_classes,
    )
    assert stats.summary.dim == effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    arrays = FedranStats(stats.summary.basis, stats.summary.singular_values, stats.label_corr)
    report = FedranReport(
        num_labelled=stats.num_labelled,
        pseudo_unlabelled=int(stats.pseudo["total"]),
        pseudo_accepted=int(stats.pseudo["accepted"]),
        pseudo_correct=int(stats.pseudo["correct"]),
    )
    num_samples = stats.num_samples
    folder = store_folder(job.context.node_config)
    if folder is not None:  # kept as the server reads it, so that the site can be forgotten exactly later
        keep_upload(job, folder, job.task, as_read(arrays.arrays(), job.cfg.wire_dtype), num_samples)
    if noise is not None and noise.on_counts:  # ñ noised; the report must not give it away
        num_samples = noisy_count(noise, num_samples)
        report = FedranReport(num_samples + stats.withheld, 0, 0, 0)
    return job.stats_reply(
        num_samples, arrays=arrays.to_record(job.cfg.wire_dtype), withheld=stats.withheld, fedran=report
    )


def noisy_count(noise: UploadNoise, count: int) -> int:
    """round(max(ñ + N(0, σ²), 0)): a reply carries a sample count as a non-negative integer."""
    value = float(noise.counts(torch.tensor([float(count)], dtype=torch.float64))[0])
    return max(round(value), 0)
