"""The minimum-count rule: which samples a client may put into a per-client statistics upload.

Why a count and why 3. A class sum over one sample *is* that sample's random feature Φ_i. More
generally, let a client hold n samples with features Φ (n × M, full row rank, n ≤ M) and
one-hot labels Y, and upload G = ΦᵀΦ and C = ΦᵀY (STSA, and FedRAN's truncated G with C).
Every Φ' with the same G is QΦ for an orthogonal Q, and the same C forces QᵀY = Y, i.e. Q fixes
each class indicator 1_c. Q is therefore free on the complement of the indicators *within*
each class: a class with n_c samples leaves an (n_c - 1)-dimensional orthogonal freedom.

* n_c = 1: no freedom, Φ_i is the class-sum column.
* n_c = 2: the freedom is one reflection, which swaps the two samples: both features are
  recovered exactly (as a set), from G and the class sum (tests/test_privacy.py shows this).
* n_c ≥ 3: a continuum of rotations; sample i's feature can be any Σ_j q_j Φ_j with q a unit
  vector summing to one, so no single sample's feature is determined.

Uploads of class sums alone (STSA-E) need n_c ≥ 2 per (dummy client, class) cell. The rule is
applied by the client before it computes anything, so withheld samples are excluded from G and
C alike; the count withheld is reported (never silent) and the classifier then equals ridge on
the samples that were uploaded. With secure aggregation (secagg.py) the server sees only sums
over clients and the rule is not needed for STSA.
"""

from __future__ import annotations

import torch


def per_class_counts(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Samples per class (labels relative to the task's first class)."""
    return torch.bincount(labels.reshape(-1).long(), minlength=num_classes)


def disclosable(labels: torch.Tensor, num_classes: int, min_count: int) -> torch.Tensor:
    """Boolean mask over samples: True where the sample's class has at least ``min_count``
    samples in this upload (``min_count`` 1 keeps everything)."""
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    counts = per_class_counts(labels, num_classes)
    return counts[labels.long()] >= min_count


def withheld_cells(counts: torch.Tensor, min_count: int) -> torch.Tensor:
    """Boolean mask over count cells (e.g. dummy client × class) with 0 < count < min_count."""
    return (counts > 0) & (counts < min_count)
