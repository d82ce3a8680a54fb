"""iCaRL herding and a fixed-budget exemplar memory (used by LGA; herding is reused by STAMP).

Herding (Welling, 2009; iCaRL, Rebuffi et al., 2017) picks samples one at a time so that the
running mean of the picked features tracks a target mean (the class mean) as closely as
possible. The order matters: the first ``m`` picks are the best ``m``-subset the greedy rule
found, so shrinking a class to a smaller quota is just keeping a prefix (iCaRL's
``ReduceExemplarSet``).

:class:`ExemplarMemory` stores *dataset indices* (not images) per class, with the iCaRL quota
``memory_size // num_classes`` [P-LGA §5.2, A1.5], and round-trips through a dict of plain
numpy arrays so a Flower client can keep it in ``Context.state`` between rounds.

Departures
----------
* Features are L2-normalised before herding by default, as in [CODE-LGA]
  (``compute_class_mean``); ``normalize=False`` herds on raw features.
* Herding picks without replacement (iCaRL's pseudo-code may re-pick a sample; the official
  LGA code can too). Without replacement the memory never holds duplicates.
* The per-class quota is ``memory_size // num_classes`` (floor), so the memory never exceeds
  ``memory_size``; [CODE-LGA] uses ``int(memory_size / num_classes)``, the same number.
* A memory smaller than the number of classes gives a quota of 0 (nothing stored) rather than
  an error, so ``memory_size=0`` is a valid "no replay" setting.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from .errors import FCLInputError

__all__ = ["ExemplarMemory", "herding_select", "herding_towards"]


def _check_features(features: Tensor) -> None:
    if not isinstance(features, Tensor) or features.ndim != 2:
        raise FCLInputError(f"features must be a 2-D tensor (n, d), got {getattr(features, 'shape', type(features))}")
    if not torch.isfinite(features).all():
        raise FCLInputError("features contain NaN or Inf")


def herding_towards(features: Tensor, target: Tensor, budget: int) -> Tensor:
    """Greedy herding: indices whose running mean tracks ``target`` (float64 arithmetic).

    At step k it picks, among unpicked rows, ``argmin_i || target - (S + f_i) / k ||`` with S the
    sum of the k-1 rows picked so far. Returns at most ``min(budget, n)`` distinct indices in
    pick order (dtype int64).
    """
    _check_features(features)
    if budget < 0:
        raise FCLInputError(f"budget must be >= 0, got {budget}")
    x = features.detach().to(torch.float64)
    tgt = target.detach().to(torch.float64).reshape(-1)
    if tgt.shape[0] != x.shape[1]:
        raise FCLInputError(f"target has dim {tgt.shape[0]}, features have dim {x.shape[1]}")
    n = x.shape[0]
    m = min(int(budget), n)
    picked: list[int] = []
    available = torch.ones(n, dtype=torch.bool)
    running = torch.zeros_like(tgt)
    for k in range(1, m + 1):
        dist = torch.linalg.vector_norm(tgt - (running + x) / k, dim=1)
        dist[~available] = float("inf")
        idx = int(torch.argmin(dist))
        picked.append(idx)
        available[idx] = False
        running += x[idx]
    return torch.tensor(picked, dtype=torch.int64)


def herding_select(features: Tensor, budget: int, *, normalize: bool = True) -> Tensor:
    """iCaRL herding of one class: up to ``budget`` indices approximating the class mean.

    Args:
        features: (n, d) features of the samples of ONE class (from the current model).
        budget: the class quota m; fewer indices are returned when n < m.
        normalize: L2-normalise features first (as [CODE-LGA] and iCaRL do).

    Returns:
        int64 tensor of distinct row indices in herding order (best prefix first).
    """
    _check_features(features)
    x = features.detach().to(torch.float64)
    if normalize:
        x = x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(1e-12)
    return herding_towards(x, x.mean(dim=0), budget)


class ExemplarMemory:
    """Per-client exemplar memory with a fixed total budget [P-LGA §5.2, A1.5].

    Holds, per class, dataset indices in herding order. Adding classes recomputes the quota
    ``m = memory_size // num_classes``, truncates every stored class to its first ``m``
    indices, and herds ``m`` exemplars for each new class. The total never exceeds
    ``memory_size`` and no class ever holds more than the current quota.
    """

    def __init__(self, memory_size: int) -> None:
        if int(memory_size) != memory_size or memory_size < 0:
            raise FCLInputError(f"memory_size must be a non-negative integer, got {memory_size}")
        self.memory_size = int(memory_size)
        self._store: dict[int, Tensor] = {}

    # --- queries -------------------------------------------------------------------------
    @property
    def classes(self) -> list[int]:
        """Classes held, in the order they were added."""
        return list(self._store)

    @property
    def num_classes(self) -> int:
        return len(self._store)

    def per_class_budget(self, num_classes: int | None = None) -> int:
        """``memory_size // num_classes`` (the current quota when ``num_classes`` is None)."""
        n = self.num_classes if num_classes is None else int(num_classes)
        if n < 0:
            raise FCLInputError(f"num_classes must be >= 0, got {n}")
        return self.memory_size if n == 0 else self.memory_size // n

    def class_indices(self, cls: int) -> Tensor:
        if cls not in self._store:
            raise FCLInputError(f"class {cls} is not in the memory (holds {self.classes})")
        return self._store[cls].clone()

    def indices(self) -> Tensor:
        """All stored dataset indices, class by class (int64)."""
        if not self._store:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat(list(self._store.values()))

    def labels(self) -> Tensor:
        """The class of each entry of :meth:`indices` (int64)."""
        if not self._store:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.full((len(v),), c, dtype=torch.int64) for c, v in self._store.items()])

    def __len__(self) -> int:
        return sum(len(v) for v in self._store.values())

    # --- updates -------------------------------------------------------------------------
    def reduce(self, per_class: int) -> None:
        """Keep only the first ``per_class`` exemplars of every class (iCaRL reduce)."""
        if per_class < 0:
            raise FCLInputError(f"per_class must be >= 0, got {per_class}")
        for c in self._store:
            self._store[c] = self._store[c][:per_class]

    def add_classes(
        self, features: Tensor, labels: Tensor, indices: Tensor | None = None, *, normalize: bool = True
    ) -> None:
        """Add every class present in ``labels`` (none may be held already).

        Args:
            features: (n, d) current-model features of the candidate samples.
            labels: (n,) integer class of each row.
            indices: (n,) dataset index of each row (defaults to ``arange(n)``); this is what
                gets stored.
            normalize: L2-normalise features before herding.
        """
        _check_features(features)
        labels = torch.as_tensor(labels).reshape(-1).to(torch.int64)
        if labels.shape[0] != features.shape[0]:
            raise FCLInputError(f"{labels.shape[0]} labels for {features.shape[0]} feature rows")
        if indices is None:
            indices = torch.arange(features.shape[0], dtype=torch.int64)
        indices = torch.as_tensor(indices).reshape(-1).to(torch.int64)
        if indices.shape[0] != features.shape[0]:
            raise FCLInputError(f"{indices.shape[0]} indices for {features.shape[0]} feature rows")
        new_classes = [int(c) for c in torch.unique(labels).tolist()]
        clash = [c for c in new_classes if c in self._store]
        if clash:
            raise FCLInputError(f"classes {clash} are already in the memory; tasks must bring new classes")
        if not new_classes:
            return
        m = self.per_class_budget(self.num_classes + len(new_classes))
        self.reduce(m)
        for c in new_classes:
            rows = torch.nonzero(labels == c).reshape(-1)
            sel = herding_select(features[rows], m, normalize=normalize)
            self._store[c] = indices[rows[sel]].clone()

    # --- (de)serialisation -----------------------------------------------------------------
    def to_state(self) -> dict[str, np.ndarray]:
        """Plain arrays (int64) for Flower's per-node state; inverse of :meth:`from_state`."""
        classes = np.array(self.classes, dtype=np.int64)
        counts = np.array([len(v) for v in self._store.values()], dtype=np.int64)
        return {
            "memory_size": np.array([self.memory_size], dtype=np.int64),
            "classes": classes,
            "counts": counts,
            "indices": self.indices().numpy().astype(np.int64),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, object]) -> ExemplarMemory:
        """Rebuild a memory from :meth:`to_state`'s dict (numpy arrays or tensors)."""
        try:
            size = np.asarray(state["memory_size"]).reshape(-1)
            classes = np.asarray(state["classes"]).reshape(-1).astype(np.int64)
            counts = np.asarray(state["counts"]).reshape(-1).astype(np.int64)
            flat = np.asarray(state["indices"]).reshape(-1).astype(np.int64)
        except KeyError as exc:
            raise FCLInputError(f"exemplar state lacks key {exc}") from None
        if size.shape[0] != 1 or classes.shape != counts.shape or counts.sum() != flat.shape[0]:
            raise FCLInputError("exemplar state is inconsistent (sizes of classes/counts/indices disagree)")
        mem = cls(int(size[0]))
        if len(classes) and counts.max() > mem.per_class_budget(len(classes)):
            raise FCLInputError("exemplar state holds a class over its quota")
        offsets = np.concatenate([[0], np.cumsum(counts)])
        for i, c in enumerate(classes.tolist()):
            mem._store[int(c)] = torch.from_numpy(flat[offsets[i] : offsets[i + 1]].copy())
        return mem
