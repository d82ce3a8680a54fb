"""Clients send statistics only: an inspection of every reply the analytic clients send.

Each run goes through the real strategy loop and the real ClientApp dispatch (tests/conftest.py),
capturing every reply Message of the statistics rounds of STSA, STSA-E (two dummy clients
each) and FedRAN. For every reply, against the sending client's actual local samples X, their
backbone features f and their random features Φ (recomputed here from the same seed), we check

* shapes: every array's shape is fixed by (M, classes, K_D, rank) -- the same for all clients
  of a task although their sample counts n differ, and equal to the formula;
* no sample leaves: no array contains any row x_i, f_i or Φ_i (nor Φ_i / ‖Φ_i‖), along any
  axis or in its flat layout, to 1e-9 relative precision;
* metrics: only scalar numbers (counts, rank), with num-examples = n; no other records.

The plain uploads have a precondition that a later test makes explicit: a statistic summed over a
single sample *is* that sample. If a client holds exactly one sample of a class, the class-sum
column C[:, c] that STSA, STSA-E and FedRAN upload equals that sample's Φ_i. The runs above use
a partition where every class a client holds has several samples; the last test shows that
the inspection catches the singleton case on a skewed partition (so it is not vacuous).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord

from fcl_flower.analytic import packed_length, random_features, solve_ridge
from fcl_flower.models import trainable_state
from fcl_flower.protocol.arrays import unpack_state
from fcl_flower.runtime import iter_features
from fcl_flower.tensors import tensor_layout
from tests.conftest import reply_partition, run_in_process, small_config

M = 120  # random-feature dimension
RANK = 16  # FedRAN upload rank, below every client's sample count here
DUMMIES = 2  # STSA-E dummy clients per client
# beta=1 keeps every (client, class) count >= 9 on this split: no singleton sums (see module doc)
SETTINGS = dict(num_tasks=3, first_task_classes=4, beta=1.0, seed=0, rf_dim=M, stage1_rounds=0)
CASES = {
    "stsa": dict(strategy="stsa"),
    "stsa-e": dict(strategy="stsa-e", dummy_clients=DUMMIES),
    "fedran": dict(strategy="fedran", rank=RANK),
}


def expected_shapes(strategy: str, classes: int, seen: int) -> dict[str, tuple[int, ...]]:
    """What a reply may contain: sizes fixed by the method's settings, never by n."""
    if strategy == "stsa":
        return {"gram-packed": (packed_length(M),), "class-sums": (M, classes), "counts": (classes,)}
    if strategy == "stsa-e":
        return {"class-sums": (DUMMIES, M, classes), "counts": (DUMMIES, classes)}
    return {"basis": (M, RANK), "singular-values": (RANK,), "label-corr": (M, seen)}


# ------------------------------------------------------------------------------ inspection
def contains_vector(array: np.ndarray, vector: np.ndarray, rtol: float = 1e-9) -> bool:
    """Whether ``vector`` appears as a contiguous run along any axis of ``array`` or in its flat
    (C-order) layout. Anchored on the vector's largest entry, so the cost is one comparison of
    the array per vector, not one per window."""
    d = vector.size
    anchor = int(np.argmax(np.abs(vector)))
    value = vector[anchor]
    if value == 0:
        return False  # an all-zero vector says nothing about a sample
    atol = rtol * float(np.abs(vector).max())
    layouts = [array.reshape(1, -1)] + [
        np.moveaxis(array, axis, -1).reshape(-1, array.shape[axis]) for axis in range(array.ndim)
    ]
    for fibers in layouts:
        if fibers.shape[1] < d:
            continue
        rows, cols = np.nonzero(np.abs(fibers - value) <= atol)
        for row, col in zip(rows, cols):
            start = col - anchor
            if 0 <= start <= fibers.shape[1] - d and np.allclose(
                fibers[row, start : start + d], vector, rtol=rtol, atol=atol
            ):
                return True
    return False


def reply_arrays(message: Message) -> dict[str, np.ndarray]:
    return {
        f"{record_name}/{key}": np.asarray(array.numpy(), dtype=np.float64)
        for record_name, record in message.content.array_records.items()
        for key, array in record.items()
    }


def local_rows(strategy, task: int, partition: int) -> dict[str, torch.Tensor]:
    """x_i, f_i, Φ_i and Φ_i/‖Φ_i‖ of one client's samples of one task (rows, float64)."""
    data = strategy.split.client_train(task, partition, eval_transform=True)
    images, _ = data.tensors()
    features = torch.cat([f for f, _ in iter_features(strategy.model, data, strategy.cfg, torch.device("cpu"))])
    phi = random_features(features, strategy.projection)
    return {
        "x": images.reshape(len(images), -1).double(),
        "f": features,
        "phi": phi,
        "phi-direction": phi / phi.norm(dim=1, keepdim=True).clamp_min(1e-300),
    }


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> dict[str, tuple[object, list[tuple[int, str, list[Message]]]]]:
    """strategy name -> (strategy after the run, [(task, phase, replies)] of every round)."""
    return {
        name: run_capturing(Path(tmp_path_factory.mktemp(name)), **SETTINGS, **changes)
        for name, changes in CASES.items()
    }


def run_capturing(out: Path, **settings) -> tuple[object, list[tuple[int, str, list[Message]]]]:
    """Run in process and keep (task, phase, replies) of every statistics round."""
    rounds: list[tuple[int, str, list[Message]]] = []

    def keep(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if phase.endswith("stats"):
            rounds.append((task, phase, list(replies)))
        return replies

    return run_in_process(small_config(out, **settings), keep), rounds


@pytest.mark.parametrize("name", list(CASES))
def test_reply_shapes_do_not_depend_on_the_number_of_samples(captured, name) -> None:
    strategy, rounds = captured[name]
    assert [phase for _, phase, _ in rounds] == [f"{name}-stats"] * 3
    for task, _, replies in rounds:
        classes = strategy.split.tasks[task]
        wanted = {f"arrays/{k}": v for k, v in expected_shapes(name, len(classes), classes.stop).items()}
        sizes = {int(m.content.metric_records["metrics"]["num-examples"]) for m in replies}
        assert len(replies) == 3 and len(sizes) == 3  # three clients, three different n
        for message in replies:
            assert {k: v.shape for k, v in reply_arrays(message).items()} == wanted


def assert_no_sample_leaves(name: str, strategy, rounds: list[tuple[int, str, list[Message]]]) -> int:
    """Inspect every array of every reply against every row of the sender's samples; returns
    how many (array, row) pairs were checked."""
    checked = 0
    for task, _, replies in rounds:
        for message in replies:
            partition = reply_partition(message)
            rows = local_rows(strategy, task, partition)
            assert rows["phi"].shape[1] == M
            for array_name, array in reply_arrays(message).items():
                for kind, matrix in rows.items():
                    for i, row in enumerate(matrix.numpy()):
                        assert not contains_vector(array, row), (
                            f"{name}: client {partition}, task {task}: {array_name} contains {kind} of sample {i}"
                        )
                        checked += 1
    return checked


@pytest.mark.parametrize("name", list(CASES))
def test_no_raw_sample_or_per_sample_feature_leaves_a_client(captured, name) -> None:
    strategy, rounds = captured[name]
    checked = assert_no_sample_leaves(name, strategy, rounds)
    assert checked > 10_000  # every sample of every client of every task, four kinds, all arrays


@pytest.mark.parametrize("name", list(CASES))
def test_metrics_are_aggregate_scalars_only(captured, name) -> None:
    strategy, rounds = captured[name]
    for task, _, replies in rounds:
        for message in replies:
            content = message.content
            assert set(content.config_records) == {"header"}  # nothing free-form: the round it answers
            assert all(isinstance(v, (int, str)) for v in content.config_records["header"].values())
            assert set(content.array_records) == {"arrays"}
            assert set(content.metric_records) == {"metrics"}
            metrics: MetricRecord = content.metric_records["metrics"]
            for key, value in metrics.items():
                assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
            n = len(strategy.split.client_train(task, int(metrics["partition-id"])))
            assert metrics["num-examples"] == n
            assert all(isinstance(r, ArrayRecord) for r in content.array_records.values())


def test_inspection_catches_a_class_held_by_one_sample(tmp_path) -> None:
    """The limit of the guarantee, and a check that the inspection is not vacuous: on the skewed
    beta=0.5 split a client holds exactly one sample of some class, and its STSA class sum for that
    class is that sample's Φ_i -- which :func:`contains_vector` must (and does) find."""
    strategy, rounds = run_capturing(tmp_path, **{**SETTINGS, "beta": 0.5, "num_tasks": 3}, strategy="stsa")
    counts = strategy.split.label_counts(0)
    partition, column = map(int, np.argwhere(counts == 1)[0])
    message = next(m for m in rounds[0][2] if reply_partition(m) == partition)
    sums = reply_arrays(message)["arrays/class-sums"]
    data = strategy.split.client_train(0, partition, eval_transform=True)
    sample = int(np.flatnonzero(data.targets == column)[0])
    phi = local_rows(strategy, 0, partition)["phi"][sample].numpy()
    assert contains_vector(sums, phi)
    assert np.allclose(sums[:, column], phi, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------ the guards
# On the skewed split some clients hold one or two samples of a class. The documented guards:
# secure aggregation (STSA: every upload is masked) or min-class-count (3 with a Gram upload,
# 2 for sums only; see fcl_flower/privacy/disclosure.py for why these numbers).
GUARDED = {
    "stsa-secure": dict(strategy="stsa", secure_aggregation=True),
    "stsa-min3": dict(strategy="stsa", min_class_count=3),
    "stsa-e-min2": dict(strategy="stsa-e", dummy_clients=DUMMIES, min_class_count=2),
    "fedran-min3": dict(strategy="fedran", rank=RANK, min_class_count=3),
}
SKEWED = {**SETTINGS, "beta": 0.2}  # on this split some clients hold 1 (4 cases) or 2 (2 cases) samples of a class


@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> dict[str, tuple[object, list[tuple[int, str, list[Message]]]]]:
    return {
        name: run_capturing(Path(tmp_path_factory.mktemp(name)), **SKEWED, **changes)
        for name, changes in GUARDED.items()
    }


def test_the_skewed_split_has_classes_held_by_one_or_two_samples(guarded) -> None:
    strategy, _ = guarded["stsa-min3"]
    counts = np.concatenate([strategy.split.label_counts(t).ravel() for t in range(strategy.split.num_tasks)])
    assert (counts == 1).any() and (counts == 2).any()


@pytest.mark.parametrize("name", list(GUARDED))
def test_guarded_uploads_contain_no_sample_even_for_singleton_classes(guarded, name) -> None:
    strategy, rounds = guarded[name]
    assert len(rounds) == 3
    assert assert_no_sample_leaves(name, strategy, rounds) > 10_000


@pytest.mark.parametrize("name", ["stsa-min3", "fedran-min3"])
def test_withheld_samples_are_exactly_those_of_small_classes_and_reported(guarded, name) -> None:
    strategy, rounds = guarded[name]
    for (task, _, replies), stage in zip(rounds, strategy.recorder.stages):
        counts = strategy.split.label_counts(task)
        small = np.where(counts < 3, counts, 0).sum(axis=1)
        for message in replies:
            metrics = message.content.metric_records["metrics"]
            partition = reply_partition(message)
            assert metrics["withheld-samples"] == small[partition]
            assert metrics["num-examples"] == counts[partition].sum() - small[partition]
        reported = stage.extra.get("withheld_samples", {})
        assert reported == {f"client-{p}": int(n) for p, n in enumerate(small) if n}


def test_min_class_count_stsa_equals_centralised_ridge_on_the_disclosed_samples(guarded) -> None:
    strategy, _ = guarded["stsa-min3"]
    gram = torch.zeros(M, M, dtype=torch.float64)
    sums = torch.zeros(M, strategy.split.bundle.num_classes, dtype=torch.float64)
    for task in range(strategy.split.num_tasks):
        counts = strategy.split.label_counts(task)
        start = strategy.split.tasks[task].start
        for partition in range(strategy.cfg.num_clients):
            data = strategy.split.client_train(task, partition, eval_transform=True)
            keep = torch.as_tensor(counts[partition][data.targets - start] >= 3)
            phi = local_rows(strategy, task, partition)["phi"][keep]
            gram += phi.T @ phi
            sums.index_add_(1, torch.from_numpy(data.targets.copy())[keep], phi.T)
    expected = solve_ridge(gram, sums, strategy.cfg.ridge_value())
    assert float((strategy.weights - expected).norm() / expected.norm()) < 1e-8


def test_stage1_fedavg_replies_hold_weights_only(tmp_path) -> None:
    """Before the statistics, stage 1 uploads model weights: the same inspection finds no raw
    image row of the sender's task-1 samples in any of them, and they carry the model's trainable
    tensors only (names and shapes fixed by the architecture)."""
    rounds: list[tuple[int, str, list[Message]]] = []

    def keep(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if phase == "fedavg":
            rounds.append((task, phase, list(replies)))
        return replies

    strategy = run_in_process(small_config(tmp_path, **{**SETTINGS, "num_tasks": 3, "stage1_rounds": 1}), keep)
    ((task, _, replies),) = rounds
    state = trainable_state(strategy.model)
    for message in replies:
        assert list(message.content.array_records) == ["arrays"]  # the model, nothing else
        # packed one array per dtype (issue 32): exactly the model's tensors, split by its own layout
        model = unpack_state(message.content.array_records["arrays"], tensor_layout(state))
        assert {k: v.shape for k, v in model.items()} == {k: tuple(t.shape) for k, t in state.items()}
        arrays = {k: np.asarray(v, dtype=np.float64) for k, v in model.items()}
        images, _ = strategy.split.client_train(task, reply_partition(message)).tensors()
        for array in arrays.values():
            for row in images.reshape(len(images), -1).double().numpy():
                assert not contains_vector(array, row)
