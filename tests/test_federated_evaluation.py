"""Federated evaluation: the clients score the global model on their own held-out data and send
counts per class; the server sums them into the same metrics, and then holds no data at all."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, Message

from fcl_flower.config import ConfigError
from fcl_flower.data import DatasetError, FederatedSplit, FederationLayout
from fcl_flower.data.federated import apportion
from fcl_flower.metrics import accuracy_by_task, accuracy_from_counts, class_counts
from fcl_flower.runtime import federated_split, server_split
from tests.conftest import reply_partition, run_in_process, small_config

VARIANTS = {
    "stsa": {},
    "fedran": {"rank": 20},
    "finetune": {"stage1_rounds": 1, "rounds_per_task": 1, "num_tasks": 2},
    # TARGET/LANDER: the clients' model carries LANDER's anchor head (the registry's anchor_dim)
    **{
        name: {
            "stage1_rounds": 1,
            "rounds_per_task": 1,
            "num_tasks": 2,
            "generator_rounds": 1,
            "generator_steps": 2,
            "generator_warmup": 1,
            "synthesis_batch": 16,
            "student_steps": 2,
            "text_encoder": "name-hash",
        }
        for name in ("target", "lander")
    },
    "stamp": {
        "partition": "task-pool",
        "classes_per_task": 2,
        "num_tasks": 3,
        "stage1_rounds": 1,
        "rounds_per_task": 1,
    },
}


def config(tmp: Path, strategy: str, **changes):
    return small_config(tmp, strategy=strategy, rf_dim=60, **{**VARIANTS[strategy], **changes})


@pytest.mark.parametrize("strategy", sorted(VARIANTS))
def test_both_modes_give_identical_numbers(tmp_path, strategy) -> None:
    """In simulation the clients' held-out shares partition the test set: the counts they send
    sum to exactly the central scores, stage by stage (task pool: client by client)."""
    strategy_run = run_in_process(config(tmp_path, strategy, evaluation="both"))
    split = federated_split(strategy_run.cfg)
    for t, stage in enumerate(strategy_run.recorder.stages):
        federated = stage.extra["federated_evaluation"]
        assert federated["accuracy"] == stage.accuracy
        assert federated["per_task_accuracy"] == stage.per_task_accuracy
        assert federated["left_out"] == {} and len(federated["clients"]) == strategy_run.cfg.num_clients
        if split.is_task_pool:
            assert federated["per_client"] == stage.extra["per_client"]
        else:
            assert federated["samples"] == len(split.seen_test(t))


def test_a_federated_only_server_holds_no_data_and_scores_like_the_central_one(tmp_path) -> None:
    central = run_in_process(config(tmp_path, "stsa", run_name="central", num_tasks=2))
    cfg = config(tmp_path, "stsa", evaluation="federated", run_name="federated", num_tasks=2)
    layout = server_split(cfg)
    assert isinstance(layout, FederationLayout) and not isinstance(layout, FederatedSplit)
    with pytest.raises(
        DatasetError, match=r"split.seen_test needs the dataset, but this server holds only the task plan"
    ):
        layout.seen_test(0)
    federated = run_in_process(cfg)
    assert not isinstance(federated.split, FederatedSplit)
    for a, b in zip(central.recorder.stages, federated.recorder.stages, strict=True):
        assert (a.accuracy, a.per_task_accuracy) == (b.accuracy, b.per_task_accuracy)
        assert b.extra["evaluation"]["mode"] == "federated"
    for w_central, w_federated in zip(central.stage_weights, federated.stage_weights, strict=True):
        assert np.array_equal(w_central.numpy(), w_federated.numpy())


def test_the_clients_held_out_shares_partition_the_test_set_in_proportion_to_their_data(tmp_path) -> None:
    split = federated_split(small_config(tmp_path, num_clients=4, beta=0.3))
    last = split.num_tasks - 1
    shares = [split.client_test(last, k) for k in range(split.num_clients)]
    everything = np.concatenate([s.indices for s in shares])
    assert len(everything) == len(set(everything.tolist())) == len(split.seen_test(last))
    assert set(everything.tolist()) == set(split.seen_test(last).indices.tolist())
    test_y, train_y = split.bundle.test.targets, split.bundle.train.targets
    for t, r in enumerate(split.tasks):
        for c in r:
            held = np.array([np.count_nonzero(train_y[split.client_indices(t, k)] == c) for k in range(4)], float)
            got = [np.count_nonzero(s.targets == c) for s in shares]
            assert got == apportion(int(np.count_nonzero(test_y == c)), held).tolist()
            assert all(g == 0 for g, h in zip(got, held, strict=True) if h == 0)  # none where it holds none
    assert [len(split.client_test(0, k)) for k in range(4)] == [
        int(np.count_nonzero(s.targets < split.tasks[0].stop)) for s in shares
    ]


def test_apportion_by_largest_remainder() -> None:
    assert apportion(10, np.array([1.0, 1.0, 1.0])).tolist() == [4, 3, 3]  # tie: the lower index
    assert apportion(7, np.array([0.0, 5.0, 2.0])).tolist() == [0, 5, 2]
    assert apportion(5, np.array([1.0, 2.0])).tolist() == [2, 3]  # 5/3 = 1.67 and 3.33: remainders 0.67, 0.33
    rng = np.random.default_rng(0)
    for _ in range(50):
        w, n = rng.random(6) * (rng.random(6) > 0.3), int(rng.integers(0, 40))
        if w.sum() == 0:
            continue
        got = apportion(n, w)
        assert got.sum() == n and (got >= 0).all() and (np.abs(got - n * w / w.sum()) < 1).all()


def test_counts_give_exactly_the_metrics_of_the_predictions() -> None:
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 6, 500)
    preds = np.where(rng.random(500) < 0.6, labels, rng.integers(0, 6, 500))
    task_of_label = np.array([0, 0, 1, 1, 2, 2])
    correct, total = class_counts(preds, labels, 6)
    assert total.tolist() == np.bincount(labels, minlength=6).tolist()
    assert correct.tolist() == [int(((preds == labels) & (labels == c)).sum()) for c in range(6)]
    assert accuracy_from_counts(correct, total, task_of_label, 3) == accuracy_by_task(preds, labels, task_of_label, 3)
    halves = [class_counts(preds[:200], labels[:200], 6), class_counts(preds[200:], labels[200:], 6)]
    summed = (halves[0][0] + halves[1][0], halves[0][1] + halves[1][1])
    assert accuracy_from_counts(*summed, task_of_label, 3) == accuracy_by_task(preds, labels, task_of_label, 3)


def _counts(m: Message) -> dict[str, np.ndarray]:
    record = m.content.array_records["counts"]
    return {k: record[k].numpy().copy() for k in record}


BAD_COUNTS = {
    "more correct than samples": (
        lambda c: {**c, "correct": c["total"] + 1},
        "more correct predictions than test samples",
    ),
    "floating counts": (lambda c: {**c, "total": c["total"].astype(np.float64)}, "must be integer"),
    "negative": (lambda c: {**c, "correct": c["correct"] - 1000}, "negative entries"),
    "wrong length": (lambda c: {**c, "total": c["total"][:-1]}, "has shape"),
    "inflated total": (lambda c: {**c, "total": c["total"] * 2}, "the counts add up to"),
}


@pytest.mark.parametrize("name", sorted(BAD_COUNTS))
def test_bad_evaluation_counts_leave_the_client_out_of_the_score_and_name_it(tmp_path, name) -> None:
    change, reason = BAD_COUNTS[name]

    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if phase == "evaluate" and task == 1:
            for m in replies:
                if reply_partition(m) == 2:
                    arrays = change(_counts(m))
                    for key, value in arrays.items():
                        m.content.array_records["counts"][key] = Array(np.ascontiguousarray(value))
        return replies

    strategy = run_in_process(config(tmp_path, "stsa", evaluation="both", num_tasks=2), tamper)
    federated = strategy.recorder.stages[1].extra["federated_evaluation"]
    assert reason in federated["left_out"]["client-2"]
    assert federated["clients"] == ["client-0", "client-1"]
    assert strategy.recorder.stages[1].left_out == {}  # the model's data is complete; only the score lacks a client
    assert federated["samples"] == len(federated_split(strategy.cfg).seen_test(1)) - len(
        federated_split(strategy.cfg).client_test(1, 2)
    )


def test_custom_data_needs_federated_evaluation_and_pooled_bounds_need_a_server_dataset(tmp_path) -> None:
    with pytest.raises(ConfigError, match="dataset 'custom' has no test set on the server: use evaluation='federated'"):
        small_config(tmp_path, dataset="custom", class_names="a,b", image_size=8)
    with pytest.raises(ConfigError, match="joint pools every client's training data on the server"):
        small_config(tmp_path, strategy="joint", evaluation="federated")
    with pytest.raises(ConfigError, match="class-names and task-plan describe dataset 'custom'"):
        small_config(tmp_path, class_names="a,b")


def test_federated_evaluation_pulls_replies_as_they_arrive(tmp_path, monkeypatch) -> None:
    """The evaluation round goes through the grid's push/pull like every other round, never
    through ``send_and_receive`` (on a real SuperLink that polls every 3 s)."""
    from fcl_flower.local_grid import LocalGrid

    def refuse(self, messages, *, timeout=None):
        raise AssertionError("send_and_receive was called")

    monkeypatch.setattr(LocalGrid, "send_and_receive", refuse)
    strategy_run = run_in_process(config(tmp_path, "stsa", evaluation="both"))
    for stage in strategy_run.recorder.stages:
        assert stage.extra["federated_evaluation"]["accuracy"] == stage.accuracy
        assert stage.extra["federated_evaluation"]["left_out"] == {}
