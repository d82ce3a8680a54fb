"""STAMP's "Limitless Task Pool" (LTP) protocol: every client its own task sequence (pure numpy).

Spec lga_stamp.md B1.1/B1.4 (and the STAMP co-author code it describes): client ``u`` draws its
own random permutation of *all* classes (generator ``default_rng([seed, u])``), and its task
``t`` is the block ``perm_u[t*cpt:(t+1)*cpt]`` of ``cpt`` classes. When ``T * cpt`` exceeds the
class count the permutation is tiled (repeated), so a client may meet a class again in a later
task -- that is how the code offers more tasks than ``classes / cpt``. A client holds **all**
training samples of its task's classes, so two clients that draw the same class hold identical
copies (replication, no sample split), and two clients may share no task at all.

Why per-client sequences matter: with a shared stream every client's "task i" covers the same
classes, so one test set per task is enough; in the pool, client ``u``'s task ``i`` is its own
class block, so it is scored on the test samples of exactly those classes
(:func:`fcl_flower.metrics.task_pool_accuracy`).
"""

from __future__ import annotations

import numbers

import numpy as np

from .errors import DatasetError


def _int_at_least(name: str, value: object, low: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise DatasetError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def resolve_classes_per_task(num_classes: int, num_tasks: int, classes_per_task: int) -> int:
    """``classes_per_task``, or ``num_classes // num_tasks`` when it is 0 (the papers' T * cpt = C)."""
    num_classes = _int_at_least("num_classes", num_classes, 1)
    num_tasks = _int_at_least("num_tasks", num_tasks, 1)
    cpt = _int_at_least("classes_per_task", classes_per_task, 0)
    if cpt == 0:
        if num_tasks > num_classes:
            raise DatasetError(
                f"num_tasks={num_tasks} exceeds the {num_classes} classes; set classes-per-task to tile "
                "each client's class permutation"
            )
        return num_classes // num_tasks
    if cpt > num_classes:
        raise DatasetError(f"classes_per_task={cpt} exceeds the {num_classes} classes")
    return cpt


def client_task_classes(num_classes: int, num_tasks: int, classes_per_task: int, seed: int, client: int) -> np.ndarray:
    """``(num_tasks, cpt)`` int64: client ``client``'s class block of every task.

    Row ``t`` is ``perm[t*cpt:(t+1)*cpt]`` of the client's own permutation (tiled as needed);
    ``classes_per_task = 0`` means ``num_classes // num_tasks``.
    """
    cpt = resolve_classes_per_task(num_classes, num_tasks, classes_per_task)
    seed = _int_at_least("seed", seed, 0)
    client = _int_at_least("client", client, 0)
    perm = np.random.default_rng([seed, client]).permutation(int(num_classes)).astype(np.int64)
    need = int(num_tasks) * cpt
    tiled = np.tile(perm, -(-need // len(perm)))[:need]
    return tiled.reshape(int(num_tasks), cpt)


def task_pool_classes(
    num_classes: int, num_tasks: int, classes_per_task: int, num_clients: int, seed: int
) -> np.ndarray:
    """``(num_clients, num_tasks, cpt)`` int64: every client's task sequence (read-only)."""
    num_clients = _int_at_least("num_clients", num_clients, 1)
    out = np.stack([client_task_classes(num_classes, num_tasks, classes_per_task, seed, u) for u in range(num_clients)])
    out.setflags(write=False)
    return out


def samples_of_classes(labels: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Sorted int64 positions of every sample whose label is in ``classes`` (all of them: LTP
    gives a client whole classes)."""
    return np.flatnonzero(np.isin(np.asarray(labels), np.asarray(classes))).astype(np.int64)
