"""Class-incremental metrics: A_avg, A_T and F_T as the STSA paper (and its code) define them.

``per_task[t][tau]`` is A_{t,tau}: accuracy on task tau's test classes after stage t (tau <= t).
``stage_accuracy[t]`` is A_t: top-1 accuracy over *all* test samples of the classes seen after
stage t (sample-weighted, as the STSA code and the FedRAN paper compute it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CILSummary:
    """The three headline numbers, in percent."""

    A_avg: float
    A_T: float
    F_T: float


def accuracy_by_task(
    predictions: np.ndarray, labels: np.ndarray, task_of_label: np.ndarray, num_tasks_seen: int
) -> tuple[float, list[float]]:
    """Return (stage accuracy over all samples, accuracy per task) in percent."""
    predictions = np.asarray(predictions)
    labels = np.asarray(labels)
    if predictions.shape != labels.shape:
        raise ValueError(f"predictions {predictions.shape} and labels {labels.shape} differ in shape")
    if labels.size == 0:
        raise ValueError("no test samples to evaluate")
    correct = predictions == labels
    tasks = np.asarray(task_of_label)[labels]
    per_task = []
    for tau in range(num_tasks_seen):
        mask = tasks == tau
        per_task.append(float(100.0 * correct[mask].mean()) if mask.any() else float("nan"))
    return float(100.0 * correct.mean()), per_task


def average_accuracy(stage_accuracy: Sequence[float]) -> float:
    """A_avg: the mean over stages of the stage accuracy (the paper's Eq. lacks the 1/T)."""
    if not stage_accuracy:
        raise ValueError("no stages")
    return float(np.mean(stage_accuracy))


def forgetting(per_task: Sequence[Sequence[float]]) -> float:
    """F_T: mean over old tasks of (best accuracy ever reached - final accuracy).

    Follows the STSA code: the max runs over every stage that saw the task, the final one
    included, so each term is >= 0. With one stage there is nothing to forget: 0.
    """
    final = len(per_task) - 1
    if final < 1:
        return 0.0
    drops = []
    for tau in range(final):
        history = [per_task[t][tau] for t in range(tau, final + 1)]
        drops.append(max(history) - per_task[final][tau])
    return float(np.mean(drops))


def summarise(stage_accuracy: Sequence[float], per_task: Sequence[Sequence[float]]) -> CILSummary:
    if len(stage_accuracy) != len(per_task):
        raise ValueError("stage_accuracy and per_task must have one entry per stage")
    return CILSummary(
        A_avg=average_accuracy(stage_accuracy),
        A_T=float(stage_accuracy[-1]),
        F_T=forgetting(per_task),
    )


# --------------------------------------------------------------------------- STAMP's task pool
def task_pool_accuracy(
    predictions: np.ndarray, labels: np.ndarray, client_classes: np.ndarray, stage: int
) -> np.ndarray:
    """``(clients, stage + 1)`` percent: ``a_u[stage][i]``, client ``u``'s accuracy on its task ``i``.

    In STAMP's limitless task pool every client has its own task sequence
    (``client_classes[u, i]`` = the classes of client u's task i), so task i's test set differs
    per client: the test samples whose label is one of those classes, predicted over the full
    head. NaN where a task has no test sample.
    """
    predictions = np.asarray(predictions)
    labels = np.asarray(labels)
    if predictions.shape != labels.shape:
        raise ValueError(f"predictions {predictions.shape} and labels {labels.shape} differ in shape")
    classes = np.asarray(client_classes)
    if classes.ndim != 3 or not 0 <= stage < classes.shape[1]:
        raise ValueError(
            f"client_classes must be (clients, tasks, classes) with stage < tasks, got "
            f"{classes.shape} and stage {stage}"
        )
    correct = predictions == labels
    out = np.full((classes.shape[0], stage + 1), np.nan)
    for u in range(classes.shape[0]):
        for i in range(stage + 1):
            mask = np.isin(labels, classes[u, i])
            if mask.any():
                out[u, i] = 100.0 * correct[mask].mean()
    return out


def summarise_clients(per_client: Sequence[Sequence[Sequence[float]]]) -> tuple[CILSummary, list[CILSummary]]:
    """(mean over clients, per client) of A_avg, A_T, F_T for per-client accuracy matrices.

    ``per_client[u][t][i]`` is ``a_u[t][i]``. Each client is summarised with the functions above,
    its stage accuracy being the mean over its tasks so far, ``A_t^u = mean_{i<=t} a_u[t][i]``;
    the headline numbers are the plain means over clients (forgetting is not linear in the
    matrix, so averaging the matrices first would give another F_T).
    """
    if not per_client:
        raise ValueError("no clients")
    each = [summarise([float(np.mean(row)) for row in rows], rows) for rows in per_client]
    mean = CILSummary(
        A_avg=float(np.mean([s.A_avg for s in each])),
        A_T=float(np.mean([s.A_T for s in each])),
        F_T=float(np.mean([s.F_T for s in each])),
    )
    return mean, each


# ---------------------------------------------------------------------------------- federated evaluation
def class_counts(predictions: np.ndarray, labels: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per class ``c < num_classes``: (correct predictions, test samples), int64 -- what a client
    reports under federated evaluation (no sample leaves it, only these counts)."""
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if predictions.shape != labels.shape:
        raise ValueError(f"predictions {predictions.shape} and labels {labels.shape} differ in shape")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    total = np.bincount(labels, minlength=num_classes).astype(np.int64)
    correct = np.bincount(labels[predictions == labels], minlength=num_classes).astype(np.int64)
    return correct, total


def accuracy_from_counts(
    correct: np.ndarray, total: np.ndarray, task_of_label: np.ndarray, num_tasks_seen: int
) -> tuple[float, list[float]]:
    """:func:`accuracy_by_task` from per-class counts summed over clients (sample-weighted: the
    same numbers as scoring the union of the clients' test sets at once)."""
    correct, total = np.asarray(correct, dtype=np.int64), np.asarray(total, dtype=np.int64)
    if total.sum() == 0:
        raise ValueError("no test samples to evaluate")
    tasks = np.asarray(task_of_label)[: len(total)]
    per_task = []
    for tau in range(num_tasks_seen):
        n = int(total[tasks == tau].sum())
        per_task.append(float(100.0 * (correct[tasks == tau].sum() / n)) if n else float("nan"))
    # 100 * (c / n), as 100 * mean(hits) in accuracy_by_task: bit-identical to central scoring
    return float(100.0 * (correct.sum() / total.sum())), per_task


def task_pool_rows_from_counts(
    correct: np.ndarray, total: np.ndarray, client_classes: np.ndarray, stage: int
) -> np.ndarray:
    """:func:`task_pool_accuracy` from each client's own per-class counts (``(clients, classes)``)."""
    correct, total, classes = np.asarray(correct), np.asarray(total), np.asarray(client_classes)
    out = np.full((classes.shape[0], stage + 1), np.nan)
    for u in range(classes.shape[0]):
        for i in range(stage + 1):
            n = int(total[u, classes[u, i]].sum())
            if n:
                out[u, i] = 100.0 * (correct[u, classes[u, i]].sum() / n)
    return out
