"""fcl_flower.metrics against hand-computed examples."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from fcl_flower.metrics import (
    CILSummary,
    accuracy_by_task,
    accuracy_from_counts,
    average_accuracy,
    class_counts,
    forgetting,
    summarise,
    summarise_clients,
    task_pool_accuracy,
    task_pool_rows_from_counts,
)


def test_accuracy_by_task_groups_samples_by_the_task_of_their_label() -> None:
    # 6 classes in 3 tasks of 2; task 2 has no test samples here
    task_of_label = np.array([0, 0, 1, 1, 2, 2])
    labels = np.array([0, 1, 2, 3, 2, 0, 1])
    preds = np.array([0, 0, 2, 3, 1, 0, 1])  # wrong: sample 1 (task 0), sample 4 (task 1)
    overall, per_task = accuracy_by_task(preds, labels, task_of_label, 3)
    assert overall == pytest.approx(100 * 5 / 7)  # sample-weighted over all seen classes
    assert per_task[0] == pytest.approx(75.0)  # labels 0, 1: samples 0, 1, 5, 6 -> 3 of 4
    assert per_task[1] == pytest.approx(100 * 2 / 3)  # labels 2, 3: samples 2, 3, 4 -> 2 of 3
    assert math.isnan(per_task[2])
    # only the tasks seen so far are reported
    assert len(accuracy_by_task(preds, labels, task_of_label, 2)[1]) == 2


def test_accuracy_is_sample_weighted_not_a_mean_of_task_accuracies() -> None:
    task_of_label = np.array([0, 1])
    labels = np.array([0, 0, 0, 1])
    preds = np.array([0, 0, 0, 0])  # task 0: 3/3, task 1: 0/1
    overall, per_task = accuracy_by_task(preds, labels, task_of_label, 2)
    assert overall == pytest.approx(75.0)
    assert per_task == [100.0, 0.0]  # their mean would be 50


def test_accuracy_by_task_bad_input() -> None:
    with pytest.raises(ValueError, match="shape"):
        accuracy_by_task(np.zeros(3), np.zeros(4, dtype=int), np.zeros(1, dtype=int), 1)
    with pytest.raises(ValueError, match="no test samples"):
        accuracy_by_task(np.zeros(0), np.zeros(0, dtype=int), np.zeros(1, dtype=int), 1)


def test_average_accuracy_is_the_mean_over_stages() -> None:
    assert average_accuracy([90.0, 80.0, 70.0]) == pytest.approx(80.0)
    assert average_accuracy([42.0]) == 42.0
    with pytest.raises(ValueError):
        average_accuracy([])


def test_forgetting_takes_the_max_over_every_stage_including_the_final_one() -> None:
    per_task = [
        [90.0],
        [80.0, 70.0],
        [60.0, 75.0, 50.0],
    ]
    # task 0: max(90, 80, 60) - 60 = 30; task 1: max(70, 75) - 75 = 0 (the best is the final
    # stage itself; excluding it would give 70 - 75 = -5); the last task is not averaged
    assert forgetting(per_task) == pytest.approx(15.0)


def test_forgetting_is_mean_of_drops_and_non_negative() -> None:
    per_task = [[100.0], [50.0, 90.0], [40.0, 80.0, 70.0], [30.0, 95.0, 20.0, 99.0]]
    # task 0: 100 - 30 = 70; task 1: max(90, 80, 95) - 95 = 0; task 2: 70 - 20 = 50
    assert forgetting(per_task) == pytest.approx(40.0)
    improving = [[10.0], [20.0, 30.0], [40.0, 50.0, 60.0]]
    assert forgetting(improving) == 0.0


def test_one_stage_has_nothing_to_forget() -> None:
    assert forgetting([[73.0]]) == 0.0
    assert summarise([73.0], [[73.0]]) == CILSummary(A_avg=73.0, A_T=73.0, F_T=0.0)


def test_summarise_combines_the_three_numbers() -> None:
    stage_acc = [90.0, 72.0, 61.0]
    per_task = [[90.0], [80.0, 70.0], [60.0, 75.0, 50.0]]
    summary = summarise(stage_acc, per_task)
    assert summary.A_avg == pytest.approx((90 + 72 + 61) / 3)
    assert summary.A_T == 61.0
    assert pytest.approx(15.0) == summary.F_T
    with pytest.raises(ValueError):
        summarise([90.0, 72.0], per_task)


# --------------------------------------------------------------------------- issue 19: edges
def test_bad_inputs_name_their_problem() -> None:
    cases = [
        (
            lambda: accuracy_by_task(np.zeros(3), np.zeros(4, dtype=int), np.zeros(1, dtype=int), 1),
            "predictions (3,) and labels (4,) differ in shape",
        ),
        (
            lambda: accuracy_by_task(np.zeros(0), np.zeros(0, dtype=int), np.zeros(1, dtype=int), 1),
            "no test samples to evaluate",
        ),
        (lambda: average_accuracy([]), "no stages"),
        (
            lambda: summarise([90.0], [[90.0], [80.0, 70.0]]),
            "stage_accuracy and per_task must have one entry per stage",
        ),
        (
            lambda: task_pool_accuracy(np.zeros(2), np.zeros(3, dtype=int), np.zeros((1, 1, 1), dtype=int), 0),
            "predictions (2,) and labels (3,) differ in shape",
        ),
        (
            lambda: task_pool_accuracy(np.zeros(2), np.zeros(2, dtype=int), np.zeros((1, 2), dtype=int), 0),
            "client_classes must be (clients, tasks, classes) with stage < tasks, got (1, 2) and stage 0",
        ),
        (
            lambda: task_pool_accuracy(np.zeros(2), np.zeros(2, dtype=int), np.zeros((1, 2, 1), dtype=int), 2),
            "client_classes must be (clients, tasks, classes) with stage < tasks, got (1, 2, 1) and stage 2",
        ),
        (
            lambda: task_pool_accuracy(np.zeros(2), np.zeros(2, dtype=int), np.zeros((1, 2, 1), dtype=int), -1),
            "client_classes must be (clients, tasks, classes) with stage < tasks, got (1, 2, 1) and stage -1",
        ),
        (lambda: summarise_clients([]), "no clients"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == message


def test_a_task_without_test_samples_is_nan_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, per_task = accuracy_by_task(np.array([0, 1]), np.array([0, 1]), np.array([0, 0, 1]), 2)
        _, from_counts = accuracy_from_counts(np.array([1, 1, 0]), np.array([1, 1, 0]), np.array([0, 0, 1]), 2)
        rows = task_pool_rows_from_counts(np.array([[1, 0]]), np.array([[1, 0]]), np.array([[[0], [1]]]), 1)
    assert per_task[0] == 100.0 and math.isnan(per_task[1])
    assert from_counts[0] == 100.0 and math.isnan(from_counts[1])  # no 0 / 0 computed (numpy would warn)
    assert rows[0, 0] == 100.0 and math.isnan(rows[0, 1])


def test_forgetting_with_two_stages() -> None:
    # the two-stage case: one old task, best 90 (stage 1), final 70
    assert forgetting([[90.0], [70.0, 80.0]]) == pytest.approx(20.0)
    assert forgetting([[60.0], [75.0, 80.0]]) == 0.0  # improved: nothing forgotten
    assert summarise([90.0, 75.0], [[90.0], [70.0, 80.0]]) == CILSummary(A_avg=82.5, A_T=75.0, F_T=20.0)


def test_task_pool_accuracy_by_hand() -> None:
    # client 0: task 0 = classes {0, 1}, task 1 = {2}; client 1: task 0 = {2, 3}, task 1 = {0}
    classes = np.array([[[0, 1], [2, 2]], [[2, 3], [0, 0]]])
    labels = np.array([0, 1, 1, 2, 3, 3])
    preds = np.array([0, 0, 1, 2, 3, 1])  # wrong: sample 1 (class 1), sample 5 (class 3)
    first = task_pool_accuracy(preds, labels, classes, stage=0)
    assert first.shape == (2, 1)
    assert first[0, 0] == pytest.approx(100 * 2 / 3) and first[1, 0] == pytest.approx(100 * 2 / 3)
    both = task_pool_accuracy(preds, labels, classes, stage=1)
    assert both.shape == (2, 2)
    assert both[0].tolist() == pytest.approx([100 * 2 / 3, 100.0])  # class 2: one sample, right
    assert both[1].tolist() == pytest.approx([100 * 2 / 3, 100.0])  # class 0: one sample, right
    # three tasks of one class each: the stage is checked against the tasks, not the classes per task
    assert task_pool_accuracy(preds, labels, np.array([[[0], [2], [3]]]), stage=2).tolist() == [[100.0, 100.0, 50.0]]
    with pytest.raises(ValueError, match="stage < tasks"):
        task_pool_accuracy(preds, labels, np.array([[[0, 1, 2], [3, 3, 3]]]), stage=2)
    none = task_pool_accuracy(preds, labels, np.array([[[5, 5], [4, 4]]]), stage=1)
    assert np.isnan(none).all() and none.shape == (1, 2)


def test_summarise_clients_by_hand() -> None:
    a = [[80.0], [60.0, 90.0]]  # stage accuracy 80, 75; forgetting 80 - 60 = 20
    b = [[50.0], [50.0, 70.0]]  # stage accuracy 50, 60; forgetting 0
    mean, each = summarise_clients([a, b])
    assert each == [CILSummary(A_avg=77.5, A_T=75.0, F_T=20.0), CILSummary(A_avg=55.0, A_T=60.0, F_T=0.0)]
    assert mean == CILSummary(A_avg=66.25, A_T=67.5, F_T=10.0)


# =============================================================================== federated evaluation
COUNTS_BAD = [
    (
        lambda: class_counts(np.zeros(3, dtype=int), np.zeros(2, dtype=int), 2),
        "predictions (3,) and labels (2,) differ in shape",
    ),
    (
        lambda: class_counts(np.zeros((1, 2), dtype=int), np.zeros(2, dtype=int), 2),
        "predictions (1, 2) and labels (2,) differ in shape",
    ),
    (lambda: class_counts(np.array([0, 0]), np.array([0, -1]), 3), "labels must lie in [0, 3)"),
    (lambda: class_counts(np.array([0, 0]), np.array([3, 0]), 3), "labels must lie in [0, 3)"),  # = num_classes
    (lambda: class_counts(np.array([0]), np.array([0]), 0), "labels must lie in [0, 0)"),
    (lambda: accuracy_from_counts([0, 0], [0, 0], [0, 0], 1), "no test samples to evaluate"),
    (lambda: accuracy_from_counts([], [], [0], 1), "no test samples to evaluate"),
]


@pytest.mark.parametrize("call, message", COUNTS_BAD, ids=[m for _, m in COUNTS_BAD])
def test_federated_evaluation_bad_inputs(call, message) -> None:
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == message


def test_class_counts_by_hand() -> None:
    labels = np.array([0, 2, 2, 1, 2, 0])
    preds = np.array([0, 2, 1, 1, 2, 7])  # wrong: sample 2 (a 2 called 1), sample 5 (a 0 called 7, no such class)
    correct, total = class_counts(preds, labels, 4)  # class 3 has no sample: a zero, not a shorter array
    assert correct.tolist() == [1, 1, 2, 0] and total.tolist() == [2, 1, 3, 0]
    assert correct.dtype == total.dtype == np.int64
    # the smallest and largest labels allowed, 0 and num_classes - 1
    assert [c.tolist() for c in class_counts(np.array([1, 0]), np.array([0, 1]), 2)] == [[0, 0], [1, 1]]
    # no test samples: zeros of every class (a client may hold none of a seen class)
    empty = class_counts(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 3)
    assert [c.tolist() for c in empty] == [[0, 0, 0], [0, 0, 0]] and empty[0].dtype == np.int64
    # one sample: a count of 1, so a "== 1" mutation of the emptiness test shows
    assert [c.tolist() for c in class_counts(np.array([1]), np.array([1]), 2)] == [[0, 1], [0, 1]]
    assert [c.tolist() for c in class_counts([2, 2], [2, 0], 3)] == [[0, 0, 1], [1, 0, 1]]  # lists are accepted


def test_accuracy_from_counts_by_hand_and_equal_to_central_scoring() -> None:
    # 5 classes, tasks (0, 1) (2, 3) (4); counts for the 4 seen classes only, the task table is longer
    task_of_label = np.array([0, 0, 1, 1, 2])
    correct, total = np.array([3, 0, 2, 1]), np.array([4, 1, 2, 3])
    overall, per_task = accuracy_from_counts(correct, total, task_of_label, 2)
    assert overall == 100.0 * (6 / 10)  # 6 right of 10
    assert per_task == [100.0 * (3 / 5), 100.0 * (3 / 5)]  # task 0: 3 of 5, task 1: 3 of 5
    # the samples the counts describe, scored centrally: the same numbers to the bit
    labels = np.repeat(np.arange(4), total)
    hits = np.concatenate([np.arange(n) < c for c, n in zip(correct, total, strict=True)])
    preds = np.where(hits, labels, 4)
    assert accuracy_from_counts(correct, total, task_of_label, 2) == accuracy_by_task(preds, labels, task_of_label, 2)
    # a task without samples is NaN; only num_tasks_seen tasks are reported
    overall, per_task = accuracy_from_counts([1, 0, 0, 0], [2, 0, 0, 0], task_of_label, 2)
    assert overall == 50.0 and per_task[0] == 50.0 and math.isnan(per_task[1]) and len(per_task) == 2
    overall, per_task = accuracy_from_counts([1, 0, 0, 0, 0], [1, 0, 0, 0, 0], task_of_label, 3)
    assert overall == 100.0 and per_task[0] == 100.0 and all(math.isnan(a) for a in per_task[1:])
    assert accuracy_from_counts([0], [1], [0], 1) == (0.0, [0.0])  # one sample, wrong
    # 100 * (c / n), not 100 * c / n: 100 * (1 / 3) differs from 100 / 3 in the last bit
    assert accuracy_from_counts([1], [3], [0], 1) == (100.0 * (1 / 3), [100.0 * (1 / 3)])
    assert 100.0 * (1 / 3) != 100.0 * 1 / 3


def test_task_pool_rows_from_counts_by_hand_and_equal_to_central_scoring() -> None:
    # the example of test_task_pool_accuracy_by_hand, as counts per client: both clients saw all six samples
    classes = np.array([[[0, 1], [2, 2]], [[2, 3], [0, 0]]])
    labels = np.array([0, 1, 1, 2, 3, 3])
    preds = np.array([0, 0, 1, 2, 3, 1])
    correct, total = class_counts(preds, labels, 4)
    assert correct.tolist() == [1, 1, 1, 1] and total.tolist() == [1, 2, 1, 2]
    rows = task_pool_rows_from_counts(np.stack([correct, correct]), np.stack([total, total]), classes, 1)
    assert rows.tolist() == [[100.0 * (2 / 3), 100.0], [100.0 * (2 / 3), 100.0]]
    assert rows.shape == task_pool_accuracy(preds, labels, classes, 1).shape
    assert np.array_equal(rows, task_pool_accuracy(preds, labels, classes, 1))
    # each client its own counts: client 1 holds no sample of its task 1 (class 0) -> NaN
    own = task_pool_rows_from_counts(
        np.array([[1, 0, 0, 0], [0, 0, 1, 0]]), np.array([[2, 0, 1, 0], [0, 0, 1, 3]]), classes, 1
    )
    assert own[0].tolist() == [50.0, 0.0] and own[1, 0] == 25.0 and math.isnan(own[1, 1])
    first = task_pool_rows_from_counts(np.array([[1, 0, 0, 0]]), np.array([[1, 1, 0, 0]]), classes[:1], 0)
    assert first.tolist() == [[50.0]] and first.dtype == np.float64
    # no client has a sample of any of its tasks: every entry is NaN, shape (clients, stage + 1)
    none = task_pool_rows_from_counts(np.zeros((2, 4), dtype=int), np.zeros((2, 4), dtype=int), classes, 1)
    assert none.shape == (2, 2) and np.isnan(none).all()
