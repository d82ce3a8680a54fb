"""LGA's client protocol beyond the data split (docs/methods/lga_stamp.md A1.2, A1.3): per-round client
sampling among the joined clients and the Z_o clients that get no data of a task.

Checks: the per-round sample has the requested size, contains only joined clients, is seeded
(same seed -> same clients, different rounds -> different clients) and reaches every joined client
eventually; Z_o clients are drawn only among clients joined before the task, in the documented
number, seeded, and hold nothing of the task while the others hold exactly all of its samples;
and one in-process LGA run (LocalGrid, real Flower hooks) where the server must learn which node
serves which client shows that exactly the sampled clients contribute per round and that only a
sampled client can be reported left out.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import DatasetError, FederatedSplit, load_dataset
from fcl_flower.data.paper_partitions import join_tasks, old_only_clients, old_only_count, sample_clients
from tests.conftest import sent_header


# ------------------------------------------------------------------ per-round sampling
def test_sample_size_subset_and_seeded():
    active = np.array([0, 2, 3, 5, 8, 9, 11])
    draws = [sample_clients(active, 3, np.random.default_rng([7, r])) for r in range(40)]
    for d in draws:
        assert len(d) == 3 and len(set(d.tolist())) == 3
        assert set(d.tolist()) <= set(active.tolist())
        assert np.all(np.diff(d) > 0)
    again = [sample_clients(active, 3, np.random.default_rng([7, r])) for r in range(40)]
    assert all(np.array_equal(a, b) for a, b in zip(draws, again))
    assert len({tuple(d.tolist()) for d in draws}) > 1  # rounds differ
    assert set(np.concatenate(draws).tolist()) == set(active.tolist())  # everyone gets a turn
    other = [sample_clients(active, 3, np.random.default_rng([8, r])) for r in range(40)]
    assert any(not np.array_equal(a, b) for a, b in zip(draws, other))


def test_sample_uniform_frequency():
    """Uniform without replacement: each active client is drawn with probability k / n."""
    active = np.arange(10)
    counts = np.zeros(10)
    for r in range(2000):
        counts[sample_clients(active, 4, np.random.default_rng([1, r]))] += 1
    np.testing.assert_allclose(counts / 2000, 0.4, atol=0.05)


def test_sample_all_and_errors():
    active = np.array([4, 1, 3])
    np.testing.assert_array_equal(sample_clients(active, 0, np.random.default_rng(0)), [1, 3, 4])
    np.testing.assert_array_equal(sample_clients(active, 5, np.random.default_rng(0)), [1, 3, 4])
    with pytest.raises(DatasetError):
        sample_clients(active, -1, np.random.default_rng(0))
    with pytest.raises(DatasetError):
        sample_clients(np.array([], dtype=np.int64), 2, np.random.default_rng(0))


# ------------------------------------------------------------------ Z_o clients
def test_old_only_count_rule():
    assert old_only_count(0, 0.5) == 0
    assert old_only_count(30, 0.1) == 3 and old_only_count(40, 0.1) == 4  # the paper's scale
    assert old_only_count(6, 0.1) == 1  # rounded half up, not floored
    assert old_only_count(4, 0.1) == 0
    assert old_only_count(5, 0.9) == 4  # capped: one old client keeps the new classes
    for n in range(1, 30):
        for f in (0.0, 0.1, 0.25, 0.5, 0.99):
            assert 0 <= old_only_count(n, f) <= n - 1
            assert abs(old_only_count(n, f) - f * n) <= 0.5 or old_only_count(n, f) == n - 1


def test_old_only_only_earlier_joined_and_seeded():
    joins = join_tasks(12, 4, 6, 2)  # 6 at task 0, 2 more at tasks 1..3
    assert len(old_only_clients(joins, 0, 0.5, np.random.default_rng(0))) == 0  # task 0: no memory yet
    seen = set()
    for t in range(1, 4):
        for s in range(20):
            z = old_only_clients(joins, t, 0.3, np.random.default_rng([s, t, 1]))
            eligible = np.flatnonzero(joins < t)
            assert len(z) == old_only_count(len(eligible), 0.3)
            assert set(z.tolist()) <= set(eligible.tolist())  # never a client joining now or later
            np.testing.assert_array_equal(z, old_only_clients(joins, t, 0.3, np.random.default_rng([s, t, 1])))
            seen.add(tuple(z.tolist()))
    assert len(seen) > 3  # the draw depends on the seed
    with pytest.raises(DatasetError):
        old_only_clients(joins, 1, 1.0, np.random.default_rng(0))


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


@pytest.mark.parametrize("partition", ["dirichlet", "class-subsets"])
def test_split_old_only_clients_hold_nothing_and_task_is_covered(digits, partition):
    split = FederatedSplit(
        digits,
        5,
        0,
        10,
        beta=0.5,
        seed=3,
        partition=partition,
        class_fraction=0.5,
        initial_clients=6,
        joining_per_task=2,
        old_only_fraction=0.3,
    )
    assert len(split.old_only[0]) == 0
    for t in range(5):
        z = split.old_only[t]
        assert len(z) == old_only_count(int(np.sum(split.join_task < t)), 0.3)
        assert np.all(split.join_task[z] < t)
        r = split.tasks[t]
        y = digits.train.targets
        everything = np.flatnonzero((y >= r.start) & (y < r.stop))
        holders = [k for k in range(10) if len(split.client_indices(t, k))]
        assert set(holders) == set(split.active_clients(t).tolist()) - set(z.tolist())
        held = np.concatenate([split.client_indices(t, k) for k in holders])
        np.testing.assert_array_equal(np.unique(held), everything)  # no sample dropped
        if partition == "dirichlet":
            assert len(held) == len(everything)  # and none duplicated
        for k in z:
            assert split.label_counts(t)[k].sum() == 0
    # a task's Z_o draw does not change the draw of a split without Z_o at task 0
    plain = FederatedSplit(
        digits,
        5,
        0,
        10,
        beta=0.5,
        seed=3,
        partition=partition,
        class_fraction=0.5,
        initial_clients=6,
        joining_per_task=2,
    )
    for k in range(10):
        np.testing.assert_array_equal(plain.client_indices(0, k), split.client_indices(0, k))


def test_config_knobs_validated():
    RunConfig(num_clients=5, clients_per_round=5, old_only_fraction=0.1).validated()
    with pytest.raises(ConfigError, match="clients-per-round"):
        RunConfig(num_clients=5, clients_per_round=6).validated()
    with pytest.raises(ConfigError, match="clients-per-round"):
        RunConfig(clients_per_round=-1).validated()
    with pytest.raises(ConfigError, match="old-only-fraction"):
        RunConfig(old_only_fraction=1.0).validated()


# ------------------------------------------------------------------ one run through the hooks
def test_lga_run_samples_joined_clients_and_only_sampled_can_be_missing(tmp_path):
    """5 clients (3 at task 0, one joining per later task), 2 sampled per train round, one Z_o per
    later task. Node ids do not reveal partition ids (shuffled), and node 4 is down: the server
    must learn the mapping, send each round exactly to the sampled clients' nodes, get replies
    from exactly those (minus the dead one) and report only the dead client, and only in the
    stages where it was sampled."""
    from clients.app import app as client_app
    from fcl_flower.local_grid import LocalGrid
    from strategies.app import run_experiment

    torch.set_num_threads(1)
    cfg = RunConfig(
        strategy="lga",
        dataset="digits",
        num_tasks=3,
        first_task_classes=4,
        num_clients=5,
        partition="class-subsets",
        class_fraction=0.6,
        initial_clients=3,
        joining_per_task=1,
        clients_per_round=2,
        old_only_fraction=0.34,
        stage1_rounds=3,
        rounds_per_task=3,
        local_epochs=1,
        batch_size=32,
        lr=0.05,
        memory_size=30,
        proxy_iterations=2,
        seed=0,
        out=str(tmp_path),
        run_name="lga-sampled",
    ).validated()

    class HungNodeGrid(LocalGrid):  # an unavailable node stays connected but never answers
        def get_node_ids(self):
            return list(self.contexts)

    grid = HungNodeGrid(client_app, 5)
    partition_of_node = {1: 3, 2: 0, 3: 4, 4: 1, 5: 2}
    for node, pid in partition_of_node.items():
        grid.contexts[node].node_config["partition-id"] = pid
    dead = 4  # client 1: sampled in stages 1 and 3, not in stage 2 (sampling ignores liveness)
    grid.unavailable = {dead}
    result = json.loads(run_experiment(grid, cfg).path.read_text())
    split = FederatedSplit(
        load_dataset("digits", seed=0),
        3,
        4,
        5,
        seed=0,
        partition="class-subsets",
        class_fraction=0.6,
        initial_clients=3,
        joining_per_task=1,
        old_only_fraction=0.34,
    )

    train_sent: dict[int, set[int]] = {}
    for m in grid.sent:
        if m.metadata.message_type == "train":
            rnd = sent_header(m).server_round
            train_sent.setdefault(rnd, set()).add(partition_of_node[m.metadata.dst_node_id])
    dead_sampled_somewhere = False
    for t, stage in enumerate(result["stages"]):
        rounds = stage["extra"]["sampling"]
        assert len(rounds) == 3
        active = set(split.active_clients(t).tolist())
        expected_left_out = set()
        for r in rounds:
            sampled = {int(c.split("-")[1]) for c in r["sampled"]}
            assert len(sampled) == 2 and sampled <= active  # never a client that has not joined
            assert train_sent[r["round"]] == sampled - {partition_of_node[dead]}
            assert r["contributed"] == [f"client-{c}" for c in sorted(sampled - {partition_of_node[dead]})]
            if partition_of_node[dead] in sampled:
                expected_left_out.add(f"client-{partition_of_node[dead]}")
        dead_sampled_somewhere |= bool(expected_left_out)
        assert set(stage["left_out"]) == expected_left_out  # unsampled clients are not "missing"
        assert stage["extra"].get("old_only_clients", []) == [f"client-{c}" for c in split.old_only[t].tolist()]
        assert len(split.old_only[t]) == (1 if t else 0)
    assert dead_sampled_somewhere, "pick another dead node: this one was never sampled"
    assert any(not stage["left_out"] for stage in result["stages"]), "pick a dead node missed by a stage's samples"
    # the rounds differ in who is sampled, and every joined live client contributed at some point
    samples = [tuple(r["sampled"]) for s in result["stages"] for r in s["extra"]["sampling"]]
    assert len(set(samples)) > 1
    contributed = {c for s in result["stages"] for c in s["clients"]}
    assert contributed == {f"client-{c}" for c in range(5) if c != partition_of_node[dead]}
    # a Z_o client that was sampled trained on its exemplar memory only: examples > 0, no prototypes
    for m, reply in zip(grid.sent, grid.replies):
        if m.metadata.message_type != "train" or reply.has_error():
            continue
        task = sent_header(m).task
        metrics = reply.content.metric_records["metrics"]
        if int(metrics["partition-id"]) in split.old_only[task].tolist():
            assert int(metrics["num-examples"]) > 0 and int(metrics["lga-proto-classes"]) == 0


def test_require_all_clients_waits_only_for_the_sampled(tmp_path):
    """With require-all-clients and no retries, a round fails as soon as an expected client is
    missing: the run completes only because unsampled clients are not expected, and because a
    sampled Z_o client (no data, finetune has no memory) answers with 0 examples instead of failing."""
    from clients.app import app as client_app
    from fcl_flower.local_grid import LocalGrid
    from strategies.app import run_experiment

    torch.set_num_threads(1)
    cfg = RunConfig(
        strategy="finetune",
        dataset="digits",
        num_tasks=2,
        num_clients=4,
        clients_per_round=2,
        initial_clients=3,
        joining_per_task=1,
        old_only_fraction=0.34,
        stage1_rounds=2,
        rounds_per_task=3,
        local_epochs=1,
        batch_size=64,
        seed=0,
        require_all_clients=True,
        round_retries=0,
        out=str(tmp_path),
        run_name="ft",
    ).validated()
    grid = LocalGrid(client_app, 4)
    result = json.loads(run_experiment(grid, cfg).path.read_text())
    for stage in result["stages"]:
        assert stage["left_out"] == {}
        for r in stage["extra"]["sampling"]:
            assert len(r["sampled"]) == 2 and r["contributed"] == r["sampled"]
    train = [(m, r) for m, r in zip(grid.sent, grid.replies) if m.metadata.message_type == "train"]
    assert len(train) == 2 * 5  # 5 rounds x 2 sampled clients, nobody else trained
    zo = result["stages"][1]["extra"]["old_only_clients"]
    assert len(zo) == 1
    zo_replies = [
        int(r.content.metric_records["metrics"]["num-examples"])
        for m, r in train
        if f"client-{int(r.content.metric_records['metrics']['partition-id'])}" in zo and sent_header(m).task == 1
    ]
    assert zo_replies and all(n == 0 for n in zo_replies)
