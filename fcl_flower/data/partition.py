"""Label-skewed Dirichlet partition of one task's training samples over K clients.

This follows the procedure of the STSA code (``utils/data_manager.py::partition_data``,
docs/methods/stsa.md §1.2), step for step:

* for every class c (in ascending label order): shuffle its samples, draw p ~ Dir(beta * 1_K),
  zero p_k for every client that already holds >= N/K samples (the *balancing cap*), renormalise,
  and cut the class's samples at ``floor(cumsum(p) * n_c)``;
* repeat the whole draw until every client holds >= ``min_size`` samples (1 in the code);
* shuffle each client's list.

Why not Flower Datasets (flwr-datasets): its partitioners operate on Hugging Face ``datasets``
objects, while we partition our own in-memory / offline datasets (digits, synthetic, folders)
and need the STSA code's exact per-task draw including the N/K balancing cap; the procedure is
a few lines of numpy, so we implement it here rather than add a dependency.

Kept from the code on purpose: the cuts are ``floor(cumsum(p) * n_c)`` with the remainder going
to the last client, so when the float cumsum ends just below 1.0 a capped last client can get a
single sample of a class.

Two guarded deviations, both only in degenerate cases: (1) if every client that is still under
the cap drew p_k == 0 (possible through floating-point underflow for tiny beta), the code would
divide by zero; we count the draw as failed and retry instead; (2) the retry loop is capped at
``max_attempts`` and then raises a clear error instead of looping forever.
"""

from __future__ import annotations

import numbers

import numpy as np

from .errors import DatasetError

MAX_ATTEMPTS = 1000


def _draw_once(
    labels: np.ndarray, classes: np.ndarray, num_clients: int, beta: float, rng: np.random.Generator
) -> list[np.ndarray] | None:
    """One pass over all classes; None if the cap left no client with positive weight."""
    cap = len(labels) / num_clients
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    for c in classes:
        idx_c = rng.permutation(np.flatnonzero(labels == c))
        p = rng.dirichlet(np.full(num_clients, beta))
        p = p * (sizes < cap)
        total = p.sum()
        if not total > 0:
            return None
        p = p / total
        cuts = (np.cumsum(p) * len(idx_c)).astype(np.int64)[:-1]
        for k, piece in enumerate(np.split(idx_c, cuts)):
            pieces[k].append(piece)
            sizes[k] += len(piece)
    return [np.concatenate(ps) if ps else np.empty(0, dtype=np.int64) for ps in pieces]


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    beta: float,
    rng: np.random.Generator,
    min_size: int = 1,
    *,
    max_attempts: int = MAX_ATTEMPTS,
) -> list[np.ndarray]:
    """Split ``range(len(labels))`` over ``num_clients`` with Dir(beta) label skew (STSA code).

    Returns one int64 index array per client (positions in ``labels``), each shuffled; the
    arrays are disjoint and their union is every position exactly once. Smaller ``beta`` gives
    more skewed per-client label distributions.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not (labels.size == 0 or np.issubdtype(labels.dtype, np.integer)):
        raise DatasetError(f"labels must be a 1-D integer array, got shape {labels.shape} and dtype {labels.dtype}")
    if not isinstance(num_clients, numbers.Integral) or isinstance(num_clients, bool) or num_clients < 1:
        raise DatasetError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    if not isinstance(beta, numbers.Real) or not np.isfinite(beta) or beta <= 0:
        raise DatasetError(f"beta (Dirichlet concentration) must be a finite number > 0, got {beta!r}")
    if not isinstance(rng, np.random.Generator):
        raise DatasetError(f"rng must be a numpy Generator (np.random.default_rng(...)), got {type(rng).__name__}")
    if not isinstance(min_size, numbers.Integral) or min_size < 0:
        raise DatasetError(f"min_size must be an integer >= 0, got {min_size!r}")
    if max_attempts < 1:
        raise DatasetError(f"max_attempts must be >= 1, got {max_attempts}")
    n, k = len(labels), int(num_clients)
    if k > n:
        raise DatasetError(f"cannot partition {n} samples over {k} clients; use at most {n} clients")
    if min_size * k > n:
        raise DatasetError(
            f"cannot give each of {k} clients >= {min_size} samples out of {n}; lower min_size or num_clients"
        )
    classes = np.unique(labels)
    for _ in range(max_attempts):
        parts = _draw_once(labels, classes, k, float(beta), rng)
        if parts is not None and min(len(p) for p in parts) >= min_size:
            for p in parts:
                rng.shuffle(p)
            return [p.astype(np.int64, copy=False) for p in parts]
    raise DatasetError(
        f"no Dirichlet draw gave all {k} clients >= {min_size} samples in {max_attempts} attempts "
        f"({n} samples, {len(classes)} classes, beta={beta}); use fewer clients or a larger beta"
    )
