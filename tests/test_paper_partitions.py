"""The LGA paper's data protocols (docs/methods/lga_stamp.md A1.3, A1.4); STAMP's task pool is in
tests/test_task_pool.py.

Checks: LGA class subsets give every client floor(fraction * c_t) whole classes of the task
(all their samples, duplicated across clients), covering the task, seeded; joining clients
hold nothing before they join; the default Dirichlet split is unchanged by the new knobs; and
one LGA run on class subsets with a joining client goes through the real Flower hooks
(in-process LocalGrid).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import DatasetError, FederatedSplit, load_dataset
from fcl_flower.data.paper_partitions import (
    class_subset_count,
    class_subset_partition,
    join_tasks,
)
from tests.conftest import round_messages


def _labels(num_classes: int = 10, per_class: int = 7, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes) + 20, per_class))


def _class_sets(labels, parts):
    return [set(np.unique(labels[p]).tolist()) for p in parts]


@pytest.mark.parametrize("num_clients, fraction", [(5, 0.6), (3, 0.4), (12, 0.5), (2, 0.7)])
def test_class_subsets_whole_classes_and_coverage(num_clients, fraction):
    y = _labels()
    parts = class_subset_partition(y, num_clients, fraction, np.random.default_rng(1))
    k = class_subset_count(10, fraction)
    assert k == int(np.floor(fraction * 10 + 1e-9))
    sets = _class_sets(y, parts)
    for p, s in zip(parts, sets):
        assert len(s) == k
        # all samples of each held class, each once
        expected = np.flatnonzero(np.isin(y, list(s)))
        np.testing.assert_array_equal(np.sort(p), expected)
    if num_clients * k >= 10:
        assert set().union(*sets) == set(np.unique(y).tolist())


def test_class_subsets_seeded():
    y = _labels()
    a = class_subset_partition(y, 5, 0.6, np.random.default_rng([3, 1]))
    b = class_subset_partition(y, 5, 0.6, np.random.default_rng([3, 1]))
    c = class_subset_partition(y, 5, 0.6, np.random.default_rng([4, 1]))
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert _class_sets(y, a) != _class_sets(y, c)


def test_join_tasks_and_errors():
    np.testing.assert_array_equal(join_tasks(5, 3, 0, 0), np.zeros(5))
    np.testing.assert_array_equal(join_tasks(7, 4, 3, 2), [0, 0, 0, 1, 1, 2, 2])
    with pytest.raises(DatasetError):
        join_tasks(8, 2, 3, 2)  # would need task 2 of 2
    with pytest.raises(DatasetError):
        join_tasks(5, 3, 2, 0)
    with pytest.raises(DatasetError):
        class_subset_partition(_labels(), 3, 0.0, np.random.default_rng(0))


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


def test_split_joining_clients_empty_before_join(digits):
    split = FederatedSplit(
        digits, 5, 0, 5, seed=0, partition="class-subsets", class_fraction=0.5, initial_clients=3, joining_per_task=1
    )
    np.testing.assert_array_equal(split.join_task, [0, 0, 0, 1, 2])
    y = digits.train.targets
    for t, r in enumerate(split.tasks):
        for k in range(5):
            ix = split.client_indices(t, k)
            if split.join_task[k] > t:
                assert len(ix) == 0 and len(split.client_train(t, k)) == 0
                assert split.label_counts(t)[k].sum() == 0
            else:
                classes = set(np.unique(y[ix]).tolist())
                assert len(classes) == class_subset_count(len(r), 0.5)
                assert classes <= set(r)


def test_default_split_unchanged(digits):
    a = FederatedSplit(digits, 5, 0, 4, 0.5, 7)
    b = FederatedSplit(
        digits, 5, 0, 4, 0.5, 7, partition="dirichlet", class_fraction=0.3, initial_clients=0, joining_per_task=0
    )
    for t in range(5):
        for k in range(4):
            np.testing.assert_array_equal(a.client_indices(t, k), b.client_indices(t, k))
    with pytest.raises(DatasetError):
        FederatedSplit(digits, 5, partition="iid")


def test_config_validation():
    with pytest.raises(ConfigError):
        RunConfig(partition="iid").validated()
    with pytest.raises(ConfigError):
        RunConfig(class_fraction=1.5).validated()
    with pytest.raises(ConfigError):
        RunConfig(num_clients=5, initial_clients=3, joining_per_task=0).validated()


def test_lga_class_subsets_with_joining_client_runs(tmp_path):
    """LGA on class subsets, client 2 joining at task 1: the run completes, and the late client
    answers task 0 with zero examples (so FedAvg gives it weight 0)."""
    from clients.app import app as client_app
    from fcl_flower.local_grid import LocalGrid
    from strategies.app import run_experiment

    torch.set_num_threads(1)
    cfg = RunConfig(
        strategy="lga",
        dataset="digits",
        num_tasks=2,
        num_clients=3,
        partition="class-subsets",
        class_fraction=0.6,
        initial_clients=2,
        joining_per_task=1,
        stage1_rounds=1,
        rounds_per_task=1,
        local_epochs=1,
        batch_size=32,
        lr=0.05,
        memory_size=40,
        proxy_iterations=2,
        seed=0,
        out=str(tmp_path),
        run_name="lga-cs",
    ).validated()
    grid = LocalGrid(client_app, 3)
    result = json.loads(run_experiment(grid, cfg).path.read_text())
    assert len(result["stages"]) == 2
    counts = {}
    for m in round_messages(grid.replies):
        metrics = m.content.metric_records.get("metrics")
        if metrics is not None:
            counts.setdefault(int(metrics["partition-id"]), []).append(int(metrics["num-examples"]))
    assert counts[2][0] == 0 and counts[0][0] > 0 and counts[1][0] > 0  # task 0: client 2 not joined
    assert counts[2][-1] > 0  # it holds data once joined
