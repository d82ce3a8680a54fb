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

import numpy as np
import torch
from torch import Tensor

from .errors import AnalyticInputError
from .packing import gram_packed_, packed_length, unpack_upper

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

    Memory is O(M² + batch·M): the n × num_classes one-hot matrix is never formed, and G is kept
    as its packed upper triangle. ΦᵀY is accumulated with ``index_add_`` (row c of CᵀY += Σ Φ of
    class c, on contiguous rows: ~50x faster than adding strided columns of C) instead of
    multiplying by a one-hot matrix.

    G: feature rows are buffered (up to ``max(M // 2, 256)`` of them, no more memory than the packed
    G) and folded into the packed float64 upper triangle in blocks (packing.gram_packed_: each
    G_ij, i ≤ j, computed once, so G is symmetric by construction). A client with fewer rows than
    that (the usual case) never folds: :meth:`packed_gram` computes its upload straight into the
    wire dtype from the buffered rows, with no M × M matrix and no float64 copy of the upload.
    """

    def __init__(self, rf_dim: int, num_classes: int, with_gram: bool = True) -> None:
        if not isinstance(rf_dim, int) or rf_dim <= 0:
            raise AnalyticInputError(f"rf_dim must be a positive int, got {rf_dim!r}")
        if not isinstance(num_classes, int) or num_classes <= 0:
            raise AnalyticInputError(f"num_classes must be a positive int, got {num_classes!r}")
        self.rf_dim = rf_dim
        self.num_classes = num_classes
        self.with_gram = with_gram
        self._rows: list[Tensor] = []  # feature rows not yet folded into G
        self._buffered = 0
        self._fold_rows = max(rf_dim // 2, 256)
        self._packed: np.ndarray | None = None  # the folded part of G: packed upper triangle, float64
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
        if self.with_gram:
            # a copy: the caller may reuse its batch tensor before G is computed
            self._rows.append(phi.clone() if phi.data_ptr() == phi_batch.data_ptr() else phi)
            self._buffered += int(phi.shape[0])
            if self._buffered >= self._fold_rows:
                self._fold()
        self._class_sums_t.index_add_(0, labels, phi)
        self._counts += torch.bincount(labels, minlength=self.num_classes)
        self._num_samples += int(phi.shape[0])

    def _buffered_rows(self) -> Tensor:
        rows = self._rows[0] if len(self._rows) == 1 else torch.cat(self._rows)
        self._rows = [rows]
        return rows

    def _fold(self) -> np.ndarray:
        """Add the buffered rows' G to the packed float64 G; returns it."""
        if self._packed is None:
            self._packed = np.zeros(packed_length(self.rf_dim), dtype=np.float64)
        if self._rows:
            gram_packed_(self._packed, self._buffered_rows(), accumulate=True)
            self._rows, self._buffered = [], 0
        return self._packed

    def packed_gram(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """The upload form of G: its packed upper triangle in ``dtype`` (the same numbers as
        ``pack_upper(result().gram)``, each rounded once to ``dtype``). Without an earlier fold it
        is computed straight into ``dtype`` from the buffered rows."""
        if not self.with_gram:
            raise AnalyticInputError("this accumulator has no Gram matrix (with_gram=False)")
        if self._packed is None and dtype != torch.float64:
            out = torch.empty(packed_length(self.rf_dim), dtype=dtype, device="cpu")
            rows = (
                self._buffered_rows() if self._rows else torch.zeros(0, self.rf_dim, dtype=torch.float64, device="cpu")
            )
            gram_packed_(out.numpy(), rows, accumulate=False)
            return out
        return torch.from_numpy(self._fold()).to(dtype, copy=True)

    def result(self, with_gram: bool = True) -> ClassStatistics:
        """Copy of the statistics so far (``with_gram=False``: without G, e.g. after
        :meth:`packed_gram`)."""
        gram = unpack_upper(torch.from_numpy(self._fold()), self.rf_dim) if self.with_gram and with_gram else None
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
