"""STAMP's limitless task pool (docs/methods/lga_stamp.md B1.1-B1.4): data, metrics, config and one run.

Checks: every client's task sequence is its own seeded permutation of all classes (tiled when
T * cpt exceeds the classes), tasks of a client are disjoint, clients differ; a client holds
exactly all training samples of its task's classes and is scored on exactly the test samples of
them; the per-client accuracy matrix and the run's A_avg / A_T / F_T (means over clients of each
client's own) equal direct computations; strategies that need a shared task stream are refused
with one line; and short in-process STAMP / finetune / EWC runs through the real Flower hooks
(LocalGrid) record per-client results that match a direct evaluation of the final model, with
STAMP's coreset made of each client's own earlier tasks and finetune forgetting.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fcl_flower import methods
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import DatasetError, FederatedSplit, load_dataset
from fcl_flower.data.task_pool import client_task_classes, resolve_classes_per_task, task_pool_classes
from fcl_flower.metrics import forgetting, summarise_clients, task_pool_accuracy
from fcl_flower.protocol import parse_instruction
from fcl_flower.state_io import load_state
from tests.conftest import round_messages, run_locally


# ------------------------------------------------------------------------------ sequences
def test_each_client_has_its_own_seeded_permutation():
    classes = task_pool_classes(12, 4, 3, 5, seed=7)
    assert classes.shape == (5, 4, 3) and not classes.flags.writeable
    for u in range(5):
        flat = classes[u].reshape(-1)
        np.testing.assert_array_equal(flat, np.random.default_rng([7, u]).permutation(12))
        assert len(set(flat.tolist())) == 12  # tasks of one client are disjoint and cover all
    sequences = {tuple(classes[u].reshape(-1).tolist()) for u in range(5)}
    assert len(sequences) == 5  # no two clients share their sequence
    np.testing.assert_array_equal(classes, task_pool_classes(12, 4, 3, 5, seed=7))
    assert not np.array_equal(classes, task_pool_classes(12, 4, 3, 5, seed=8))
    np.testing.assert_array_equal(classes[2], client_task_classes(12, 4, 3, 7, 2))


def test_tiling_and_default_block_size():
    seq = client_task_classes(10, 7, 3, seed=1, client=4)  # 21 > 10 classes: the permutation repeats
    perm = np.random.default_rng([1, 4]).permutation(10)
    np.testing.assert_array_equal(seq.reshape(-1), np.concatenate([perm, perm, perm])[:21])
    assert all(len(set(row.tolist())) == 3 for row in seq)  # a task never holds a class twice
    assert resolve_classes_per_task(100, 5, 0) == 20 and resolve_classes_per_task(100, 50, 0) == 2
    for args in ((10, 11, 0), (10, 2, 11), (10, 2, -1)):
        with pytest.raises(DatasetError):
            resolve_classes_per_task(*args)


# ------------------------------------------------------------------------------ the split
@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


@pytest.fixture(scope="module")
def pool(digits):
    return FederatedSplit(digits, 4, 0, 3, seed=5, partition="task-pool", classes_per_task=2)


def test_split_serves_whole_classes_per_client(digits, pool):
    train_y, test_y = digits.train.targets, digits.test.targets
    np.testing.assert_array_equal(pool.client_classes, task_pool_classes(10, 4, 2, 3, 5))
    assert pool.is_task_pool and pool.tasks == [range(10)] * 4
    assert pool.num_seen_classes(0) == 10  # one head over all classes from the first task
    for t in range(4):
        union = set()
        for u in range(3):
            classes = pool.client_task_classes(t, u)
            union |= set(classes.tolist())
            np.testing.assert_array_equal(pool.client_indices(t, u), np.flatnonzero(np.isin(train_y, classes)))
            assert (
                np.bincount(pool.client_train(t, u).targets, minlength=10)[classes].tolist()
                == np.bincount(train_y, minlength=10)[classes].tolist()
            )  # all samples, replicated
            test = pool.client_task_test(t, u)
            assert sorted(set(test.targets.tolist())) == sorted(classes.tolist())
            assert len(test) == int(np.isin(test_y, classes).sum())
        assert pool.stage_classes(t) == sorted(union)
        assert pool.classes_through(t) == 2 * (t + 1)
        counts = pool.label_counts(t)
        assert counts.shape == (3, 10)
        assert set(np.flatnonzero(counts.sum(axis=0)).tolist()) == union


def test_split_refuses_shared_stream_options(digits):
    with pytest.raises(DatasetError, match="first task"):
        FederatedSplit(digits, 4, 4, 3, partition="task-pool")
    with pytest.raises(DatasetError, match="joining"):
        FederatedSplit(digits, 4, 0, 3, partition="task-pool", initial_clients=2, joining_per_task=1)


# ------------------------------------------------------------------------------ metrics
def test_task_pool_accuracy_is_accuracy_on_each_clients_classes():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 6, size=300)
    preds = np.where(rng.random(300) < 0.6, labels, rng.integers(0, 6, size=300))
    classes = np.array([[[0, 1], [2, 3], [4, 5]], [[5, 2], [1, 4], [0, 3]]])
    rows = task_pool_accuracy(preds, labels, classes, stage=1)
    assert rows.shape == (2, 2)
    for u in range(2):
        for i in range(2):
            hits = [p == y for p, y in zip(preds, labels) if y in classes[u, i]]
            assert rows[u, i] == pytest.approx(100.0 * sum(hits) / len(hits))


def test_per_client_summary_equals_hand_computation():
    # a_u[t][i] for two clients and three stages, chosen so that max/mean do not commute
    a = [[[80.0], [40.0, 90.0], [60.0, 30.0, 70.0]], [[50.0], [70.0, 60.0], [20.0, 65.0, 95.0]]]
    mean, each = summarise_clients(a)
    direct = []
    for rows in a:
        A_t = [np.mean(r) for r in rows]
        F = np.mean([max(rows[t][i] for t in range(i, 3)) - rows[2][i] for i in range(2)])
        direct.append((np.mean(A_t), A_t[-1], F))
        assert (each[len(direct) - 1].A_avg, each[len(direct) - 1].A_T, each[len(direct) - 1].F_T) == pytest.approx(
            direct[-1]
        )
    assert (mean.A_avg, mean.A_T, mean.F_T) == pytest.approx(tuple(np.mean(direct, axis=0)))
    averaged_matrix = [np.mean([a[0][t], a[1][t]], axis=0).tolist() for t in range(3)]
    assert forgetting(averaged_matrix) != pytest.approx(mean.F_T)  # why the clients are summarised first


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize("strategy", ["stsa", "stsa-e", "fedran", "joint", "lga", "joint-gradient"])
def test_shared_stream_strategies_are_refused(strategy):
    with pytest.raises(ConfigError) as err:
        RunConfig(strategy=strategy, partition="task-pool").validated()
    message = str(err.value)
    assert "\n" not in message and strategy in message
    assert all(name in message for name in methods.with_capability("task_pool"))
    with pytest.raises(ConfigError, match="first-task-classes"):
        RunConfig(strategy="stamp", partition="task-pool", first_task_classes=4).validated()


# ------------------------------------------------------------------------------ runs
NUM_CLIENTS, NUM_TASKS = 3, 4


def _config(strategy: str, out) -> RunConfig:
    return RunConfig(
        strategy=strategy,
        dataset="digits",
        num_tasks=NUM_TASKS,
        classes_per_task=2,
        num_clients=NUM_CLIENTS,
        partition="task-pool",
        stage1_rounds=3,
        rounds_per_task=2,
        local_epochs=1,
        batch_size=16,
        lr=0.05,
        memory_size=80,
        seed=0,
        out=str(out),
        run_name=strategy,
    ).validated()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("task-pool")
    return run_locally({strategy: _config(strategy, out) for strategy in ("finetune", "stamp", "ewc")})


@pytest.mark.parametrize("strategy", ["finetune", "stamp", "ewc"])
def test_run_records_per_client_results(runs, strategy):
    _cfg, grid, result = runs[strategy]
    stages = result["stages"]
    assert len(stages) == NUM_TASKS
    for t, stage in enumerate(stages):
        per_client = stage["extra"]["per_client"]
        assert sorted(per_client) == [f"client-{u}" for u in range(NUM_CLIENTS)]
        rows = np.array([per_client[f"client-{u}"] for u in range(NUM_CLIENTS)])
        assert rows.shape == (NUM_CLIENTS, t + 1)
        assert stage["per_task_accuracy"] == pytest.approx(rows.mean(axis=0).tolist())
        assert stage["accuracy"] == pytest.approx(rows.mean(axis=1).mean())
    mean, each = summarise_clients(
        [[s["extra"]["per_client"][f"client-{u}"] for s in stages] for u in range(NUM_CLIENTS)]
    )
    assert (result["A_avg"], result["A_T"], result["F_T"]) == pytest.approx((mean.A_avg, mean.A_T, mean.F_T))
    assert result["per_client"]["client-1"]["F_T"] == pytest.approx(each[1].F_T)
    # every training message offers the whole head
    assert {parse_instruction(m).num_seen for m in round_messages(grid.sent)} == {10}


def test_final_scores_equal_a_direct_evaluation(runs):
    from fcl_flower.runtime import build_model, federated_split, predict_logits

    cfg, _, result = runs["stamp"]
    split = federated_split(cfg)
    model = build_model(cfg, split)
    model.load_state_dict(load_state(cfg.output_dir / "checkpoint.json")["state"]["model"])
    final = result["stages"][-1]["extra"]["per_client"]
    for u in range(NUM_CLIENTS):
        for i in range(NUM_TASKS):
            preds, labels = predict_logits(model, split.client_task_test(i, u), cfg, torch.device("cpu"), 10)
            assert final[f"client-{u}"][i] == pytest.approx(100.0 * float((preds == labels).float().mean()))


def test_finetune_forgets(runs):
    assert runs["finetune"][2]["F_T"] > 0
    assert all(c["F_T"] >= 0 for c in runs["finetune"][2]["per_client"].values())


def test_stamp_coreset_holds_the_clients_own_earlier_tasks(runs):
    from clients.memory import load_memory
    from clients.stamp import CORESET_STATE
    from fcl_flower.runtime import federated_split

    cfg, grid, _ = runs["stamp"]
    split = federated_split(cfg)
    for node, context in grid.contexts.items():
        u = node - 1
        coreset = load_memory(context.state, CORESET_STATE, cfg.memory_size)
        earlier = {int(c): t for t in range(NUM_TASKS - 1) for c in split.client_task_classes(t, u)}
        assert sorted(coreset.classes) == sorted(earlier) and 0 < len(coreset) <= cfg.memory_size
        for cls in coreset.classes:
            own = split.client_train(earlier[cls], u)
            assert np.all(own.targets[coreset.class_indices(cls).numpy()] == cls)


def test_stamp_on_a_tiled_pool_keeps_a_returning_class_once(tmp_path):
    from clients.app import app as client_app
    from clients.memory import load_memory
    from clients.stamp import CORESET_STATE
    from fcl_flower.local_grid import LocalGrid
    from fcl_flower.runtime import federated_split
    from strategies.app import run_experiment

    cfg = _config("stamp", tmp_path).replace(num_tasks=6, stage1_rounds=1, rounds_per_task=1, num_clients=2)
    grid = LocalGrid(client_app, 2)
    result = json.loads(run_experiment(grid, cfg).path.read_text())
    split = federated_split(cfg)
    assert len(result["stages"]) == 6
    for node, context in grid.contexts.items():
        u = node - 1
        seq = split.client_classes[u].reshape(-1)
        assert seq[10] == seq[0]  # task 5 brings back task 0's classes
        coreset = load_memory(context.state, CORESET_STATE, cfg.memory_size)
        assert sorted(coreset.classes) == list(range(10))  # every class once, from its first task
        first = {int(c): t for t in reversed(range(5)) for c in split.client_task_classes(t, u)}
        for cls in coreset.classes:
            own = split.client_train(first[cls], u)
            assert np.all(own.targets[coreset.class_indices(cls).numpy()] == cls)
