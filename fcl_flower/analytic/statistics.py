"""Additive class statistics of STSA (docs/methods/stsa.md §2.4–2.6, Eqs. 2–5).

A client summarises its random features Φ (n × M) and labels by
    G = ΦᵀΦ (M × M),  C = ΦᵀY (M × num_classes),  counts = column sums of Y.
All three are sums over samples, so the statistics of any union of datasets is the sum of
the statistics of its parts. That single fact gives both aggregations:

* spatial (Eq. 2): summing over clients equals the centralised statistics of the task;
* temporal (Eq. 4): summing over stages equals the joint statistics of all tasks so far.

C uses *global* class columns (labels are global class ids 0..num_classes-1), so the
paper's column concatenation [C_{1:t-1}, C_t] is the same plain sum (docs/methods/stsa.md §6 item 11), and
``aggregate`` serves both aggregations.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import AnalyticInputError
from .packing import pack_symmetrised, symmetrised

__all__ = ["ClassStatistics", "StatisticsAccumulator", "accumulate_over_stages", "aggregate"]


@dataclass
class ClassStatistics:
    """Sufficient statistics of one dataset for the ridge classifier.

    gram: ΦᵀΦ (M × M, float64), or None for STSA-E uploads that omit it.
    class_sums: ΦᵀY (M × num_classes, float64); column c is the sum of Φ over class c.
    counts: samples per class (num_classes, int64).
    num_samples: n; also tr(YᵀY) for one-hot labels, used by the ridge residual and GCV.
    """

    gram: Tensor | None
    class_sums: Tensor
    counts: Tensor
    num_samples: int

    def __post_init__(self) -> None:
        if self.class_sums.dim() != 2:
            raise AnalyticInputError(
                f"class_sums must be 2-D (M, num_classes), got shape {tuple(self.class_sums.shape)}"
            )
        rf_dim, num_classes = self.class_sums.shape
        if self.gram is not None and tuple(self.gram.shape) != (rf_dim, rf_dim):
            raise AnalyticInputError(f"gram shape {tuple(self.gram.shape)} does not match rf_dim {rf_dim}")
        if tuple(self.counts.shape) != (num_classes,):
            raise AnalyticInputError(
                f"counts shape {tuple(self.counts.shape)} does not match num_classes {num_classes}"
            )
        if int(self.num_samples) < 0:
            raise AnalyticInputError(f"num_samples must be >= 0, got {self.num_samples}")

    @property
    def rf_dim(self) -> int:
        return int(self.class_sums.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.class_sums.shape[1])

    def __add__(self, other: ClassStatistics) -> ClassStatistics:
        if not isinstance(other, ClassStatistics):
            return NotImplemented
        if self.class_sums.shape != other.class_sums.shape:
            raise AnalyticInputError(
                f"cannot add statistics of shapes {tuple(self.class_sums.shape)} and {tuple(other.class_sums.shape)}"
            )
        if (self.gram is None) != (other.gram is None):
            raise AnalyticInputError("cannot add statistics with and without a Gram matrix")
        gram = None if self.gram is None or other.gram is None else self.gram + other.gram
        return ClassStatistics(
            gram=gram,
            class_sums=self.class_sums + other.class_sums,
            counts=self.counts + other.counts,
            num_samples=int(self.num_samples) + int(other.num_samples),
        )

    def __radd__(self, other: object) -> ClassStatistics:
        # Lets the built-in sum() start from 0.
        if isinstance(other, int) and other == 0:
            return self
        return NotImplemented


class StatisticsAccumulator:
    """Streaming ΦᵀΦ, ΦᵀY and counts over batches, in float64.

    Memory is O(M² + batch·M): the n × M feature matrix and the n × num_classes one-hot
    matrix are never formed. ΦᵀY is accumulated with ``index_add_`` (row c of CᵀY += Σ Φ of
    class c, on contiguous rows: ~50x faster than adding strided columns of C) instead of
    multiplying by a one-hot matrix. G += ΦᵀΦ runs at 85-95 % of the machine's float64 matmul
    peak even for 64-row batches (experiments/bench_gram_throughput.py).
    """

    def __init__(self, rf_dim: int, num_classes: int, with_gram: bool = True) -> None:
        if not isinstance(rf_dim, int) or rf_dim <= 0:
            raise AnalyticInputError(f"rf_dim must be a positive int, got {rf_dim!r}")
        if not isinstance(num_classes, int) or num_classes <= 0:
            raise AnalyticInputError(f"num_classes must be a positive int, got {num_classes!r}")
        self.rf_dim = rf_dim
        self.num_classes = num_classes
        self.with_gram = with_gram
        # allocated without zeroing: the first batch writes ΦᵀΦ into it (the same numbers as adding
        # ΦᵀΦ to zeros, one M² pass fewer, which is most of a small client's cost at large M)
        self._gram = torch.empty(rf_dim, rf_dim, dtype=torch.float64) if with_gram else None
        self._gram_written = False
        self._class_sums_t = torch.zeros(num_classes, rf_dim, dtype=torch.float64)  # Cᵀ: rows are contiguous
        self._counts = torch.zeros(num_classes, dtype=torch.int64)
        self._num_samples = 0

    def update(self, phi_batch: Tensor, labels: Tensor) -> None:
        """Add one batch: ``phi_batch`` (b, M) random features, ``labels`` (b,) global class ids."""
        if phi_batch.dim() != 2 or phi_batch.shape[1] != self.rf_dim:
            raise AnalyticInputError(f"phi_batch must have shape (b, {self.rf_dim}), got {tuple(phi_batch.shape)}")
        if labels.dim() != 1 or labels.shape[0] != phi_batch.shape[0]:
            raise AnalyticInputError(f"labels must have shape ({phi_batch.shape[0]},), got {tuple(labels.shape)}")
        if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise AnalyticInputError(f"labels must be an integer tensor, got {labels.dtype}")
        if phi_batch.shape[0] == 0:
            return
        labels = labels.to(device="cpu", dtype=torch.int64)
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= self.num_classes:
            raise AnalyticInputError(f"labels must lie in [0, {self.num_classes - 1}], got range [{low}, {high}]")
        phi = phi_batch.to(device="cpu", dtype=torch.float64)
        if self._gram is not None and self._gram_written:
            self._gram.addmm_(phi.T, phi)
        elif self._gram is not None:
            torch.mm(phi.T, phi, out=self._gram)
            self._gram_written = True
        self._class_sums_t.index_add_(0, labels, phi)
        self._counts += torch.bincount(labels, minlength=self.num_classes)
        self._num_samples += int(phi.shape[0])

    def packed_gram(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """The upload form of G: the packed upper triangle of 0.5·(G + Gᵀ) (the same numbers as
        ``pack_upper(result().gram)``), built straight from the accumulator in ``dtype`` without
        forming the symmetrised M × M matrix (packing.pack_symmetrised)."""
        if self._gram is None:
            raise AnalyticInputError("this accumulator has no Gram matrix (with_gram=False)")
        return pack_symmetrised(self._written_gram(), dtype)

    def _written_gram(self) -> Tensor:
        """G so far (zero before the first batch)."""
        assert self._gram is not None
        if not self._gram_written:
            self._gram.zero_()
            self._gram_written = True
        return self._gram

    def result(self, with_gram: bool = True) -> ClassStatistics:
        """Copy of the statistics so far; G is symmetrised to remove BLAS rounding asymmetry
        (``with_gram=False``: without G, e.g. after :meth:`packed_gram`)."""
        gram = None if self._gram is None or not with_gram else self._written_gram()
        gram = None if gram is None else symmetrised(gram)
        return ClassStatistics(
            gram=gram,
            class_sums=self._class_sums_t.T.contiguous(),
            counts=self._counts.clone(),
            num_samples=self._num_samples,
        )


def aggregate(stats: Iterable[ClassStatistics]) -> ClassStatistics:
    """Sum of statistics: spatial aggregation over clients (Eq. 2) and temporal over stages (Eq. 4).

    Both are the same sum because C has global class columns; the result equals the
    centralised statistics of the union of the underlying datasets.
    """
    items = list(stats)
    if not items:
        raise AnalyticInputError("aggregate needs at least one ClassStatistics")
    first = items[0]
    total = ClassStatistics(  # a copy, so the result never aliases an input
        gram=None if first.gram is None else first.gram.clone(),
        class_sums=first.class_sums.clone(),
        counts=first.counts.clone(),
        num_samples=int(first.num_samples),
    )
    for item in items[1:]:
        total = total + item
    return total


#: Temporal aggregation G_{1:t} = G_{1:t-1} + G_t, C_{1:t} = C_{1:t-1} + C_t (global columns).
accumulate_over_stages = aggregate
