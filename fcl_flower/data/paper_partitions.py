"""The LGA and STAMP papers' own client data protocols, as per-task partitions (pure numpy).

Spec lga_stamp.md A1.3/A1.4 (LGA), mapped onto the project's shared
class-incremental task stream (one growing head, central evaluation on the seen classes):

* :func:`class_subset_partition` (LGA A1.4): every client holds a random ``fraction`` of the
  task's classes with **all** training samples of those classes, as in the LGA code. Clients
  sharing a class therefore hold identical copies of its samples (duplication, no sample split),
  exactly like the code. The class count per client is ``floor(fraction * c_t)`` (the code's
  ``int(0.6 * task_size)``), at least 1. One deviation: the draw is *coverage-first* (each client
  takes still-uncovered classes before already-held ones, in random order), so every class of the
  task is held by some client whenever ``num_clients * k >= c_t``; the code's independent draws
  can leave a class unseen by the federation, which the central test would still score.
* STAMP's limitless task pool (per-client class sequences over all classes) is not a per-task
  partition of the shared stream; it lives in :mod:`.task_pool`.
* :func:`join_tasks` (LGA A1.3 Z_a): ``initial`` clients from task 0, ``per_task`` more at each
  later task. A client not yet joined holds no data of that task (empty partition).
* :func:`old_only_clients` (LGA A1.3 Z_o): at each task after the first, a seeded share of the
  clients that joined *before* the task gets no data of it (they train on their exemplar memory
  only); the task's samples are split over the other active clients.
* :func:`sample_clients` (LGA A1.2 "the server randomly selects some clients"): the seeded
  per-round sample among the active (joined) clients. Unlike the LGA code, which samples from
  the 30 initial clients only, joined clients are sampled too.
"""

from __future__ import annotations

import numbers

import numpy as np

from .errors import DatasetError

# FederatedSplit's client-protocol arguments (the papers' data protocols); the run config's knobs
# of the same names, so callers can pass ``{k: getattr(cfg, k) for k in PROTOCOL_ARGS}``. Here, not
# in federated.py, so that reading them imports no torch (clients/node_data.py).
PROTOCOL_ARGS = (
    "partition",
    "class_fraction",
    "initial_clients",
    "joining_per_task",
    "old_only_fraction",
    "classes_per_task",
)


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise DatasetError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _by_class(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    y = np.asarray(labels).reshape(-1)
    if y.size == 0:
        raise DatasetError("cannot partition an empty task")
    classes = np.unique(y)
    return classes, [np.flatnonzero(y == c) for c in classes]


def _gather(per_class: list[np.ndarray], held: list[list[int]], rng: np.random.Generator) -> list[np.ndarray]:
    """Concatenate the samples of each client's classes and shuffle each client's list."""
    out = []
    for cls in held:
        ix = np.concatenate([per_class[j] for j in sorted(cls)]).astype(np.int64)
        out.append(rng.permutation(ix))
    return out


def class_subset_count(num_classes: int, fraction: float) -> int:
    """Classes per client: ``floor(fraction * c)`` as in the LGA code, at least 1."""
    return max(1, int(np.floor(fraction * num_classes + 1e-9)))


def class_subset_partition(
    labels: np.ndarray, num_clients: int, fraction: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """LGA label skew: per client, all samples of a random ``fraction`` of the task's classes.

    Returns one int64 array of positions into ``labels`` per client (shuffled). Samples are
    duplicated across clients that share a class (LGA code, docs/methods/lga_stamp.md A1.4).
    """
    num_clients = _positive_int("num_clients", num_clients)
    if not isinstance(fraction, numbers.Real) or not 0.0 < float(fraction) <= 1.0:
        raise DatasetError(f"class fraction must be in (0, 1], got {fraction!r}")
    classes, per_class = _by_class(labels)
    c = len(classes)
    k = class_subset_count(c, float(fraction))
    uncovered = set(range(c))
    held: list[list[int]] = []
    for _ in range(num_clients):
        first = rng.permutation(sorted(uncovered)).tolist()
        rest = rng.permutation(sorted(set(range(c)) - uncovered)).tolist()
        mine = (first + rest)[:k]
        uncovered -= set(mine)
        held.append(mine)
    return _gather(per_class, held, rng)


def join_tasks(num_clients: int, num_tasks: int, initial: int, per_task: int) -> np.ndarray:
    """First task (0-based) at which each client holds data; LGA's joining clients (docs/methods/lga_stamp.md A1.3).

    ``initial == 0`` means no joining: every client is active from task 0. Otherwise clients
    ``0..initial-1`` join at task 0 and client ``initial + j`` at task ``1 + j // per_task``; every
    client must join by the last task.
    """
    num_clients = _positive_int("num_clients", num_clients)
    num_tasks = _positive_int("num_tasks", num_tasks)
    if not isinstance(initial, numbers.Integral) or isinstance(initial, bool) or initial < 0:
        raise DatasetError(f"initial-clients must be an integer >= 0, got {initial!r}")
    if initial == 0 or initial >= num_clients:
        return np.zeros(num_clients, dtype=np.int64)
    if not isinstance(per_task, numbers.Integral) or isinstance(per_task, bool) or per_task < 1:
        raise DatasetError(f"joining-per-task must be an integer >= 1 when clients join, got {per_task!r}")
    late = np.arange(num_clients - initial, dtype=np.int64)
    joins = np.concatenate([np.zeros(initial, dtype=np.int64), 1 + late // int(per_task)])
    if joins[-1] >= num_tasks:
        raise DatasetError(
            f"num-clients={num_clients} needs {int(joins[-1]) + 1} tasks to join with initial-clients="
            f"{initial} and joining-per-task={per_task}, but there are {num_tasks}; use fewer clients"
        )
    return joins


def _fraction(name: str, value: object) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0.0 <= float(value) < 1.0:
        raise DatasetError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def old_only_count(eligible: int, fraction: float) -> int:
    """How many of ``eligible`` old clients become Z_o: ``fraction * eligible`` rounded half up,
    capped at ``eligible - 1`` so at least one old client still receives the new classes.

    Rounding (not the floor) keeps Z_o non-empty in small federations (6 old clients at 10%
    give 1); at the paper's scale (30, 40, ... old clients at 10%) both rules agree.
    """
    if eligible <= 0:
        return 0
    return min(int(np.floor(fraction * eligible + 0.5)), eligible - 1)


def old_only_clients(join_task: np.ndarray, task: int, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """LGA's Z_o at ``task``: sorted ids of clients that joined before it and get none of its data.

    Only clients with ``join_task < task`` are eligible (they have an exemplar memory; a client
    joining at ``task`` is Z_a and always gets data). Task 0 has no Z_o. ``rng`` should be seeded
    per task, so every task's draw is independent and reproducible.
    """
    fraction = _fraction("old-only-fraction", fraction)
    joins = np.asarray(join_task, dtype=np.int64).reshape(-1)
    if not isinstance(task, numbers.Integral) or isinstance(task, bool) or task < 0:
        raise DatasetError(f"task must be an integer >= 0, got {task!r}")
    eligible = np.flatnonzero(joins < task)
    count = old_only_count(len(eligible), fraction)
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    return np.sort(rng.choice(eligible, size=count, replace=False)).astype(np.int64)


def sample_clients(active: np.ndarray, per_round: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted ids of ``per_round`` clients drawn uniformly without replacement from ``active``.

    ``per_round == 0`` or ``per_round >= len(active)`` selects every active client. Seed ``rng``
    per round (e.g. ``default_rng([seed, task, round])``) so a rerun, or a resumed run, selects
    the same clients.
    """
    pool = np.asarray(active, dtype=np.int64).reshape(-1)
    if not isinstance(per_round, numbers.Integral) or isinstance(per_round, bool) or per_round < 0:
        raise DatasetError(f"clients-per-round must be an integer >= 0, got {per_round!r}")
    if pool.size == 0:
        raise DatasetError("no active client to sample from")
    if per_round == 0 or per_round >= pool.size:
        return np.sort(pool)
    return np.sort(rng.choice(pool, size=int(per_round), replace=False)).astype(np.int64)
