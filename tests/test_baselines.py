"""Fed-LwF, Fed-EWC and the pooled gradient bound: their math against hand computations, and
their server/client plumbing through the real strategy loop and client handlers (in-process
grid from conftest.py, no Ray)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord
from torch import nn

from clients.ewc import ewc_extra_loss
from clients.lwf import lwf_extra_loss
from fcl_flower.fcl.distill import frozen_teacher
from fcl_flower.fcl.errors import FCLInputError
from fcl_flower.fcl.ewc import (
    aggregate_fishers,
    diagonal_fisher,
    ewc_penalty,
    merge_task_fishers,
    squared_gradient_mean,
    trainable_parameters,
)
from fcl_flower.local_grid import LocalGrid
from fcl_flower.methods import Kind
from fcl_flower.models import trainable_state
from fcl_flower.protocol import Header, StatsRes, TrainIns, UploadError
from fcl_flower.protocol.messages import EWC_ANCHOR, EWC_FISHER, TEACHER
from fcl_flower.runtime import build_model, federated_split, make_loader
from fcl_flower.tensors import tensor_record
from strategies.base import RoundPlan
from tests.conftest import build, in_process_grid, round_messages, sent_header, server_identity, small_config


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny per-sample backward passes: thread hand-offs would cost more than the maths (and
    much more on a loaded machine); restored afterwards for the other test files."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ helpers
def linear_model(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 4).double()


def ce_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def hand_gradient(model: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> dict[str, np.ndarray]:
    """Gradient of the mean cross-entropy of a linear softmax model, by the closed form
    dL/dz = (softmax(z) - onehot(y)) / n, dL/dW = (dL/dz)^T x, dL/db = column sums."""
    w, b = model.weight.detach().numpy(), model.bias.detach().numpy()
    xs = x.numpy()
    z = xs @ w.T + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    onehot = np.eye(w.shape[0])[y.numpy()]
    dz = (p - onehot) / len(xs)
    return {"weight": dz.T @ xs, "bias": dz.sum(axis=0)}


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)


# ------------------------------------------------------------------------------ Fisher math
def test_fisher_equals_hand_computed_diagonal_fisher() -> None:
    model = linear_model()
    x, y = data(7, seed=1)
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]  # sizes 4 and 3: weights 4/7 and 3/7
    grads = [hand_gradient(model, xb, yb) for xb, yb in batches]
    expected = {k: (4 * grads[0][k] ** 2 + 3 * grads[1][k] ** 2) / 7 for k in ("weight", "bias")}

    fisher = diagonal_fisher(model, batches, ce_loss)
    for key, value in expected.items():
        assert fisher[key].dtype == torch.float64
        np.testing.assert_allclose(fisher[key].numpy(), value, rtol=1e-12, atol=1e-15)
    assert all(p.grad is None for p in model.parameters())  # the model is left untouched

    # the same estimator from precomputed gradients, and the clamp of the TARGET/LANDER code
    from_grads = squared_gradient_mean([{k: torch.from_numpy(v) for k, v in g.items()} for g in grads], [4, 3])
    cap = float(np.median(expected["weight"]))
    clamped = diagonal_fisher(model, batches, ce_loss, max_value=cap)
    for key, value in expected.items():
        np.testing.assert_allclose(from_grads[key].numpy(), value, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(clamped[key].numpy(), np.minimum(value, cap), rtol=1e-12, atol=1e-15)


def test_client_fishers_aggregate_to_the_pooled_fisher() -> None:
    """Per-sample Fishers of three clients, sample-weighted, equal the pooled data's Fisher."""
    model = linear_model(seed=3)
    x, y = data(12, seed=4)
    per_sample = lambda rows: [(x[i : i + 1], y[i : i + 1]) for i in rows]  # noqa: E731 (a one-line helper reads best as a lambda here)
    clients = [range(2), range(2, 7), range(7, 12)]
    fishers = [diagonal_fisher(model, per_sample(c), ce_loss) for c in clients]
    merged = aggregate_fishers(fishers, [len(c) for c in clients])
    pooled = diagonal_fisher(model, per_sample(range(12)), ce_loss)
    for key in pooled:
        torch.testing.assert_close(merged[key], pooled[key], rtol=1e-12, atol=1e-15)


def test_aggregate_fishers_is_the_sample_weighted_mean_and_checks_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    fishers = [{"a": torch.rand(2, 3, generator=g), "b": torch.rand(4, generator=g)} for _ in range(3)]
    weights = [10, 0, 30]
    merged = aggregate_fishers(fishers, weights)
    for key in ("a", "b"):
        expected = (10 * fishers[0][key].double() + 30 * fishers[2][key].double()) / 40
        torch.testing.assert_close(merged[key], expected)
    with pytest.raises(FCLInputError):
        aggregate_fishers(fishers, [0, 0, 0])
    with pytest.raises(FCLInputError):
        aggregate_fishers([fishers[0], {"a": fishers[1]["a"]}], [1, 1])
    with pytest.raises(FCLInputError):
        aggregate_fishers([fishers[0], {"a": torch.rand(3, 2), "b": fishers[1]["b"]}], [1, 1])


def test_task_fishers_are_a_class_weighted_running_average() -> None:
    f1 = {"w": torch.tensor([4.0, 0.0])}
    f2 = {"w": torch.tensor([0.0, 2.0])}
    first = merge_task_fishers(None, f1, 0, 2)
    torch.testing.assert_close(first["w"], f1["w"].double())
    second = merge_task_fishers(first, f2, 2, 6)  # 2 old classes, 4 new: 1/3 old + 2/3 new
    torch.testing.assert_close(second["w"], torch.tensor([4 / 3, 4 / 3], dtype=torch.float64))
    with pytest.raises(FCLInputError):
        merge_task_fishers(None, f1, 2, 4)


def test_ewc_penalty_by_hand_and_its_gradient_pulls_towards_the_anchor() -> None:
    theta = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
    anchor = {"p": torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64)}
    fisher = {"p": torch.tensor([2.0, 0.5, 3.0], dtype=torch.float64)}
    lam = 10.0
    penalty = ewc_penalty({"p": theta}, fisher, anchor, lam)
    assert float(penalty.detach()) == pytest.approx(lam / 2 * (2.0 * 1.0 + 0.5 * 9.0 + 3.0 * 0.0))
    penalty.backward()
    torch.testing.assert_close(theta.grad, lam * fisher["p"] * (theta.detach() - anchor["p"]))
    # one small gradient step brings every parameter with F > 0 closer to the anchor
    step = theta.detach() - 0.01 * theta.grad
    before = (theta.detach() - anchor["p"]).abs()
    after = (step - anchor["p"]).abs()
    assert torch.all(after[before > 0] < before[before > 0])
    assert float(ewc_penalty({"p": anchor["p"].clone()}, fisher, anchor, lam)) == 0.0
    with pytest.raises(FCLInputError):
        ewc_penalty({"q": theta}, fisher, anchor, lam)


def test_ewc_client_loss_is_the_penalty_of_the_model_parameters() -> None:
    model = linear_model()
    params = trainable_parameters(model)
    anchor = {k: torch.zeros_like(v) for k, v in params.items()}
    fisher = {k: torch.full_like(v, 0.25) for k, v in params.items()}
    loss = ewc_extra_loss(fisher, anchor, 8.0, torch.device("cpu"))(model, None, None, None).detach()
    expected = 4.0 * 0.25 * sum(float((v.detach().float() ** 2).sum()) for v in params.values())
    assert float(loss) == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------------------ LwF math
def test_lwf_loss_equals_hand_computed_kd_and_is_zero_for_the_teacher_itself() -> None:
    torch.manual_seed(0)
    teacher = nn.Linear(4, 5)
    images = torch.randn(3, 4)
    student_logits = torch.randn(3, 4, requires_grad=True)  # 4 seen classes, 2 of them old
    alpha, temperature, num_old = 3.0, 2.0, 2
    loss = lwf_extra_loss(teacher, num_old, alpha, temperature)(None, images, None, student_logits)

    def softmax(z: np.ndarray) -> np.ndarray:
        e = np.exp(z - z.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    q = softmax(teacher(images).detach().double().numpy()[:, :num_old] / temperature)
    p = softmax(student_logits.detach().double().numpy()[:, :num_old] / temperature)
    expected = alpha * np.mean(np.sum(q * (np.log(q) - np.log(p)), axis=1))
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())  # the teacher does not learn
    assert torch.all(student_logits.grad[:, num_old:] == 0)  # new classes are not distilled

    same = teacher(images).detach()[:, :4].clone().requires_grad_(True)
    zero = lwf_extra_loss(teacher, num_old, alpha, temperature)(None, images, None, same)
    assert float(zero.detach()) == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError):
        lwf_extra_loss(teacher, 0, alpha, temperature)


def test_frozen_teacher_is_an_independent_frozen_copy(out_dir) -> None:
    cfg = small_config(out_dir)
    model = build_model(cfg, federated_split(cfg))
    state = {k: v + 1.0 if v.is_floating_point() else v for k, v in trainable_state(model).items()}
    teacher = frozen_teacher(model, state, torch.device("cpu"))

    def teacher_values() -> dict[str, torch.Tensor]:  # frozen: trainable_state() would now skip them
        return {k: v for k, v in teacher.state_dict().items() if k in state}

    torch.testing.assert_close(teacher_values(), state)
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    with torch.no_grad():
        next(model.parameters()).add_(5.0)
    torch.testing.assert_close(teacher_values(), state)


# ------------------------------------------------------------------------------ strategies
def _run(cfg) -> tuple[object, LocalGrid, list[dict[str, torch.Tensor]]]:
    """Run every stage through the real loop; also return the trainable state at each stage end."""
    server_identity()
    strategy = build(cfg)
    ends: list[dict[str, torch.Tensor]] = []
    end_stage = strategy.end_stage

    def recording(task: int):
        extra = end_stage(task)
        ends.append(trainable_state(strategy.model))
        return extra

    strategy.end_stage = recording
    grid = in_process_grid(cfg.num_clients)
    strategy.start(grid)
    return strategy, grid, ends


def _task_and_phase(message) -> tuple[int, str]:
    header = sent_header(message)
    return header.task, header.phase


def test_ewc_run_aggregates_the_pooled_fisher_and_sends_it_with_the_anchor(out_dir) -> None:
    """Batch size 1, no clamp, untrained stage 1: the server's Fisher after task 1 must be the
    per-sample Fisher of the initial model on task 1's pooled data, computed centrally."""
    cfg = small_config(
        out_dir,
        strategy="ewc",
        num_tasks=2,
        stage1_rounds=0,
        rounds_per_task=1,
        local_epochs=1,
        batch_size=1,
        ewc_fisher_max=0.0,
        ewc_lambda=1.0,
    )  # unclamped per-sample Fisher: keep the penalty step stable
    strategy, grid, _ = _run(cfg)
    split = federated_split(cfg)
    initial = build_model(cfg, split).eval()

    def ce(m, x, y):
        return F.cross_entropy(m(x)[:, : strategy.num_seen(0)], y)

    pooled = diagonal_fisher(initial, make_loader(split.task_train(0, eval_transform=True), cfg, shuffle=False), ce)
    assert list(strategy.fisher) == list(pooled)
    for key in pooled:
        torch.testing.assert_close(strategy.fisher[key], pooled[key], rtol=1e-5, atol=1e-12)
        torch.testing.assert_close(strategy.anchor[key], trainable_parameters(initial)[key].detach())

    phases = [_task_and_phase(m) for m in round_messages(grid.sent)]
    assert sorted(set(phases)) == [(0, "ewc-stats"), (1, "ewc")]  # no Fisher round after the last task
    for message in round_messages(grid.sent):
        task, _ = _task_and_phase(message)
        has = {EWC_FISHER, EWC_ANCHOR} <= set(message.content.array_records)
        assert has == (task == 1)
    # the Fisher upload is accounted: one float64 per trainable parameter, per client
    numel = sum(p.numel() for p in trainable_parameters(initial).values())
    stage1 = strategy.recorder.stages[0]
    for client in stage1.clients:
        assert stage1.upload_bytes_per_client[client] == 8 * numel


def test_ewc_rejects_malformed_fisher_uploads(out_dir) -> None:
    strategy = build(small_config(out_dir, strategy="ewc"))
    plan = RoundPlan(0, "ewc-stats", Kind.STATS)
    header = Header("run", "ewc-stats", 0, 1, 1)

    def reply(arrays: dict[str, torch.Tensor]) -> StatsRes:
        return StatsRes(header, 0, 10, arrays=tensor_record(arrays))

    good = {k: torch.zeros_like(p) for k, p in trainable_parameters(strategy.model).items()}
    strategy.read_reply(plan, reply(good))
    key = next(iter(good))
    bad_sign = {**good, key: good[key] - 1.0}
    with pytest.raises(UploadError, match="negative"):
        strategy.read_reply(plan, reply(bad_sign))
    with pytest.raises(UploadError, match="unknown"):
        strategy.read_reply(plan, reply({**good, "extra": torch.zeros(1)}))


def test_lwf_run_sends_the_previous_task_model_as_teacher(out_dir) -> None:
    """Also: the new task's cross-entropy covers its own classes only (TARGET/LANDER), so with the
    distillation and weight decay switched off the head rows of all other classes stay put."""
    cfg = small_config(
        out_dir,
        strategy="lwf",
        num_tasks=5,
        stage1_rounds=1,
        rounds_per_task=1,
        local_epochs=1,
        lwf_alpha=0.0,
        weight_decay=0.0,
    )
    strategy, grid, ends = _run(cfg)
    for task in range(1, cfg.num_tasks):
        new = strategy.split.tasks[task]
        before, after = ends[task - 1]["head.weight"], ends[task]["head.weight"]
        others = [c for c in range(before.shape[0]) if c not in new]
        torch.testing.assert_close(after[others], before[others], rtol=1e-6, atol=1e-7)
        assert not torch.allclose(after[new.start : new.stop], before[new.start : new.stop])
    for message in round_messages(grid.sent):
        task, phase = _task_and_phase(message)
        records = message.content.array_records
        if task == 0:
            assert phase == "fedavg" and TEACHER not in records
            continue
        assert phase == "lwf"
        teacher = records[TEACHER].to_torch_state_dict()
        assert list(teacher) == list(ends[task - 1])
        for key, value in ends[task - 1].items():
            assert torch.equal(teacher[key], value)
    assert all(not stage.left_out for stage in strategy.recorder.stages)  # every client trained


def test_joint_gradient_trains_on_all_seen_data_without_federated_rounds(out_dir) -> None:
    cfg = small_config(
        out_dir, strategy="joint-gradient", num_tasks=5, stage1_rounds=1, rounds_per_task=1, local_epochs=1
    )
    strategy, grid, ends = _run(cfg)
    split = federated_split(cfg)
    assert grid.sent == []
    for task, stage in enumerate(strategy.recorder.stages):
        assert stage.rounds == 0 and stage.upload_bytes_per_client == {}
        assert stage.extra["num_samples"] == sum(len(split.task_train(t)) for t in range(task + 1))
        assert stage.extra["epochs"] == cfg.local_epochs
    # every stage changed the model (it trained), starting from the seeded initialisation
    initial = trainable_state(build_model(cfg, split))
    for before, after in zip([initial, *ends[:-1]], ends):
        assert any(not torch.equal(before[k], after[k]) for k in after if after[k].is_floating_point())


def test_checkpoint_state_keeps_teacher_fisher_and_anchor(out_dir) -> None:
    lwf = build(small_config(out_dir, strategy="lwf"))
    lwf.end_stage(0)
    restored = build(small_config(out_dir, strategy="lwf"))
    restored.load_state_dict(lwf.state_dict())
    for key, value in lwf.teacher.items():
        assert torch.equal(restored.teacher[key], value)

    ewc = build(small_config(out_dir, strategy="ewc"))
    ewc.fisher = {k: torch.rand(p.shape, dtype=torch.float64) for k, p in trainable_parameters(ewc.model).items()}
    ewc.anchor = {k: p.detach().clone() for k, p in trainable_parameters(ewc.model).items()}
    again = build(small_config(out_dir, strategy="ewc"))
    again.load_state_dict(ewc.state_dict())
    for key in ewc.fisher:
        assert torch.equal(again.fisher[key], ewc.fisher[key]) and torch.equal(again.anchor[key], ewc.anchor[key])
    base = TrainIns(Header("run", "ewc", 1, 2, 1), again.cfg, lr=0.1, num_seen=4, model=ArrayRecord())
    later = again.customise(RoundPlan(1, "ewc"), base)
    assert isinstance(later, TrainIns) and later.ewc_fisher is not None and later.ewc_anchor is not None
    assert again.customise(RoundPlan(0, "fedavg"), base) is base
