"""TARGET and LANDER: their math against hand computations, and both methods end to end through
the real ServerApp logic and ClientApp (in-process LocalGrid, digits, small generator).

End to end (module fixture, one torch thread):

* the server's generator makes class-conditional samples: the global model it was distilled from
  classifies the synthetic pool as the intended classes far above chance, every stage;
* the distillation losses decrease: the generator's objective within and across synthesis
  rounds, the server student's KD over the rounds, a client's KD towards the teacher over its
  local epochs;
* results.json is complete (every stage field, A_avg / A_T / F_T, the synthesis logs);
* two runs with the same seed give identical results.json numbers (wall times aside).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F
from flwr.common.logger import FLOWER_LOGGER
from torch import nn

from clients.generative import replay_sgd, synthetic_pool
from clients.job import make_job
from clients.lander import anchors_of
from clients.lwf import server_arrays
from fcl_flower import methods
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data.plan import custom_plan
from fcl_flower.fcl.distill import frozen_teacher, kd_loss
from fcl_flower.fcl.errors import FCLInputError
from fcl_flower.fcl.generative import (
    AnchorGenerator,
    BatchNormStatistics,
    ImageGenerator,
    adversarial_divergence,
    balanced_targets,
    bounding_loss,
    cycle_batches,
    distillation_kl,
    first_order_meta_grads,
    from_pool,
    lander_loss_weights,
    name_anchors,
    random_crop_flip,
    reinitialise,
    replay_augment,
    to_pool,
)
from fcl_flower.models import build_classifier, trainable_state
from fcl_flower.protocol import TrainIns, parse_instruction
from fcl_flower.protocol.messages import ANCHORS, SYNTHETIC
from fcl_flower.results import StageRecord
from fcl_flower.runtime import build_model, federated_split
from fcl_flower.tensors import tensor_record
from strategies.accounting import TIMING_EXTRAS
from strategies.anchors import NAME_HASH, class_names, label_text_embeddings
from tests.conftest import run_locally, seeded_generator, server_identity, small_config


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ networks
def test_generators_make_images_in_the_unit_range_of_the_dataset_shape() -> None:
    torch.manual_seed(0)
    for shape in ((1, 8, 8), (3, 32, 32)):
        g = ImageGenerator(16, 8, shape)
        out = g(torch.randn(5, 16)).detach()
        assert out.shape == (5, *shape) and float(out.min()) >= 0 and float(out.max()) <= 1
    anchors = name_anchors([f"c{i}" for i in range(4)], 12)
    lander = AnchorGenerator(anchors, 16, 8, (1, 8, 8), batch=25, chunk=10)
    assert len(lander.noise) == 3  # ceil(25 / 10) noisy layers
    lander.reset_noise(seeded_generator(1))
    first = [layer.weight.clone() for layer in lander.noise]
    lander.reset_noise(seeded_generator(1))
    assert all(torch.equal(a, layer.weight) for a, layer in zip(first, lander.noise))
    assert lander(torch.tensor([0, 1, 2, 3] * 6 + [0])).shape == (25, 1, 8, 8)
    with pytest.raises(FCLInputError):
        lander(torch.zeros(26, dtype=torch.int64))  # more samples than noisy layers cover
    with pytest.raises(FCLInputError):
        ImageGenerator(16, 8, (1, 10, 10))  # not divisible by 4


def test_reinitialise_redraws_conv_linear_and_bn_from_the_generator() -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2))
    a = reinitialise(model, seeded_generator(3))
    first = [p.clone() for p in a.parameters()]
    b = reinitialise(model, seeded_generator(3))
    assert all(torch.equal(x, y) for x, y in zip(first, b.parameters()))
    assert torch.equal(model[1].bias, torch.zeros(4))
    assert float((model[1].weight.detach() - 1).abs().max()) < 0.2  # N(1, 0.02)


def test_the_anchor_head_leaves_backbone_and_head_initialisation_unchanged() -> None:
    plain = build_classifier("small-cnn", 10, in_channels=1, image_size=8, seed=4)
    anchored = build_classifier("small-cnn", 10, in_channels=1, image_size=8, seed=4, anchor_dim=6)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, anchored.state_dict()[key]), key
    assert {"anchor.weight", "anchor.bias"} <= set(trainable_state(anchored))
    logits, emb = anchored.forward_with_anchor(torch.rand(3, 1, 8, 8))
    assert logits.shape == (3, 10) and emb.shape == (3, 6)
    lander = RunConfig(strategy="lander")
    assert build_model(lander, federated_split(lander)).anchor is not None
    assert methods.get("lander").anchor_dim == 512 and methods.get("target").anchor_dim == 0


# ------------------------------------------------------------------------------ losses
def test_batchnorm_statistics_loss_by_hand_and_its_momentum() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3)).eval()
    model[1].running_mean.copy_(torch.tensor([0.1, -0.2, 0.3]))
    model[1].running_var.copy_(torch.tensor([1.0, 2.0, 0.5]))
    x = torch.randn(4, 2, 5, 5, dtype=torch.float32)
    stats = BatchNormStatistics(momentum=0.9).attach(model)
    model(x)
    h = model[0](x).detach()
    mean, var = h.mean(dim=(0, 2, 3)), h.var(dim=(0, 2, 3), unbiased=False)
    expected = torch.linalg.vector_norm(model[1].running_var - var) + torch.linalg.vector_norm(
        model[1].running_mean - mean
    )
    torch.testing.assert_close(stats.loss(), expected)
    stats.end_round()  # the first round's statistics become the running average
    y = torch.randn(4, 2, 5, 5)
    model(y)
    h2 = model[0](y).detach()
    mean2 = 0.1 * h2.mean(dim=(0, 2, 3)) + 0.9 * mean
    var2 = 0.1 * h2.var(dim=(0, 2, 3), unbiased=False) + 0.9 * var
    expected2 = torch.linalg.vector_norm(model[1].running_var - var2) + torch.linalg.vector_norm(
        model[1].running_mean - mean2
    )
    torch.testing.assert_close(stats.loss(), expected2)
    stats.detach()
    model(x)  # detached: no new statistics
    torch.testing.assert_close(stats.loss(), expected2)
    with pytest.raises(FCLInputError):
        BatchNormStatistics().attach(nn.Linear(2, 2))


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p * (p.log() - q.log())).sum(dim=1)


def test_adversarial_and_distillation_terms_by_hand() -> None:
    g = seeded_generator(0)
    s, t = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    s[0], t[0] = torch.tensor([3.0, 0, 0, 0]), torch.tensor([2.0, 1, 0, 0])  # agree on class 0
    agree = (s.argmax(1) == t.argmax(1)).double()
    kl = _kl(F.softmax(t.double(), 1), F.softmax(s.double(), 1))
    assert agree.sum() >= 1
    torch.testing.assert_close(adversarial_divergence(s, t).double(), -(kl * agree).mean(), rtol=1e-5, atol=1e-6)
    disagree = torch.zeros(6, 4)
    disagree[:, 3] = 9.0
    assert float(adversarial_divergence(torch.eye(4)[[0, 1, 2, 0, 1, 2]], disagree)) == 0.0  # no agreement, no push
    T = 20.0
    kl_t = _kl(F.softmax(t.double() / T, 1), F.softmax(s.double() / T, 1)).mean() * T * T
    torch.testing.assert_close(distillation_kl(s, t, T).double(), kl_t, rtol=1e-4, atol=1e-7)
    assert float(distillation_kl(t, t, T)) == pytest.approx(0.0, abs=1e-6)


def test_bounding_loss_is_a_hinge_on_the_batch_mse() -> None:
    anchors = torch.zeros(2, 4)
    inside = torch.full((2, 4), 0.1)  # MSE 0.01 < r
    outside = torch.full((2, 4), 0.5)  # MSE 0.25
    assert float(bounding_loss(inside, anchors, 0.015)) == 0.0
    assert float(bounding_loss(outside, anchors, 0.015)) == pytest.approx(0.25 - 0.015)
    assert float(bounding_loss(outside, anchors, 0.0)) == pytest.approx(0.25)
    with pytest.raises(FCLInputError):
        bounding_loss(outside, anchors[:1], 0.0)


def test_lander_weights_by_hand() -> None:
    cur, pre = lander_loss_weights(4, 6, 0.2, 0.4)
    a, b = math.log2(6 / 2 + 1), math.sqrt(4 / 6)  # = 2, 0.816
    assert (cur, pre) == pytest.approx((0.2 * (1 + 1 / a) / b, 0.4 * a * b))
    later = lander_loss_weights(8, 10, 0.2, 0.4)
    assert later[1] > pre and later[0] < cur  # more old classes: distillation weighs more
    with pytest.raises(FCLInputError):
        lander_loss_weights(0, 2, 0.2, 0.4)


def test_balanced_targets_cycles_and_meta_grads_add_up() -> None:
    t = balanced_targets(10, 4, seeded_generator(0))
    assert t[:8].tolist() == [0, 1, 2, 3, 0, 1, 2, 3] and len(t) == 10 and int(t.max()) < 4
    seen = [next(b) for b in [cycle_batches(7, 3, seeded_generator(1))] for _ in range(3)]
    assert sorted(torch.cat(seen).tolist()) == list(range(7)) and [len(s) for s in seen] == [3, 3, 1]
    meta, fast = nn.Linear(2, 1), nn.Linear(2, 1)
    fast.weight.grad, fast.bias.grad = torch.ones(1, 2), torch.full((1,), 2.0)
    first_order_meta_grads(meta, fast)
    first_order_meta_grads(meta, fast)
    assert meta.weight.grad.tolist() == [[2.0, 2.0]] and meta.bias.grad.tolist() == [4.0]


def test_augmentation_crops_flips_and_keeps_gradients() -> None:
    x = torch.arange(2 * 1 * 4 * 4, dtype=torch.float32).reshape(2, 1, 4, 4).requires_grad_(True)
    same = random_crop_flip(x, 0, False, seeded_generator(0))
    assert torch.equal(same, x)
    out = random_crop_flip(x, 1, True, seeded_generator(0))
    out.sum().backward()
    assert out.shape == x.shape and x.grad is not None
    for b in range(2):  # every output pixel is an input pixel of the same image or the zero padding
        assert set(out[b].flatten().tolist()) <= set(x[b].flatten().tolist()) | {0.0}
    assert replay_augment("digits", 0).flip is False and replay_augment("cifar100", 0).mean is not None
    assert replay_augment("cifar100", 224).mean is None  # CIFAR-224 is not normalised


def test_name_anchors_and_the_eight_bit_pool() -> None:
    a = name_anchors(["cat", "dog", "truck"], 512)
    assert torch.equal(a, name_anchors(["cat", "dog", "truck"], 512))
    torch.testing.assert_close(torch.linalg.vector_norm(a, dim=1), torch.full((3,), 10.0))
    assert float((F.normalize(a) @ F.normalize(a).T - torch.eye(3)).abs().max()) < 0.2
    with pytest.raises(FCLInputError):
        name_anchors(["cat", "cat"], 8)
    images = torch.tensor([0.0, 0.5, 0.999, 1.0]).reshape(1, 1, 2, 2)
    pool = to_pool(images)
    assert pool.dtype == torch.uint8 and pool.shape == (1, 2, 2, 1)
    assert pool.flatten().tolist() == [0, 127, 254, 255]  # truncated, as the codes' PNG export
    assert float((from_pool(pool) - images).abs().max()) < 1 / 255 + 1e-6


def test_label_text_embeddings_fall_back_offline_with_one_log_line() -> None:
    names = class_names(RunConfig(), federated_split(RunConfig()).plan)
    assert sorted(names) == sorted(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"])
    custom = custom_plan(class_names="cat,sea_lion", plan_file="", num_tasks=1, first_task_classes=0, image_size=8)
    assert class_names(RunConfig(), custom) == ["cat", "sea lion"]  # dataset = custom: the plan's own names
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]  # collect the records
    FLOWER_LOGGER.addHandler(handler)
    try:
        emb, source = label_text_embeddings(names, "no-such-org/no-such-text-encoder", 512)
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    assert source == NAME_HASH and emb.shape == (10, 512)
    assert torch.equal(emb, label_text_embeddings(names, NAME_HASH, 512)[0])
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0] and "\n" not in warnings[0]


def test_new_train_fields_round_trip_through_the_protocol() -> None:
    from tests.test_protocol import CFG, HEADER, _deliver

    pool = tensor_record({"images": torch.arange(2 * 8 * 8, dtype=torch.uint8).reshape(2, 8, 8, 1)})
    anchors = tensor_record({"anchors": torch.ones(10, 4)})
    ins = TrainIns(
        HEADER, CFG, lr=0.1, num_seen=4, model=tensor_record({"w": torch.ones(2)}), synthetic=pool, anchors=anchors
    )
    message = _deliver(ins)
    assert {SYNTHETIC, ANCHORS} <= set(message.content.array_records)
    parsed = parse_instruction(message)
    assert isinstance(parsed, TrainIns) and parsed.synthetic is not None and parsed.anchors is not None
    assert parsed.synthetic["images"].numpy().dtype.name == "uint8"


def test_knobs_are_validated() -> None:
    for bad in ({"generator-rounds": 0}, {"generator-steps": 0}, {"synthesis-batch": 0}, {"kd-weight": -1.0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            RunConfig.from_mapping({"strategy": "target", **bad})
    assert RunConfig(strategy="lander", lander_radius=0.1).unused_knobs() == []
    assert RunConfig(strategy="target", lander_radius=0.1).unused_knobs() == ["lander-radius"]
    with pytest.raises(ConfigError, match="task-pool"):
        RunConfig(strategy="lander", partition="task-pool").validated()


# ------------------------------------------------------------------------------ end to end
TASKS, CLIENTS = 3, 3  # digits: tasks of 4, 3 and 3 classes
SEEN = (4, 7, 10)


def _config(strategy: str, out, run_name: str) -> RunConfig:
    return small_config(
        out,
        strategy=strategy,
        num_tasks=TASKS,
        first_task_classes=SEEN[0],
        num_clients=CLIENTS,
        beta=10.0,
        stage1_rounds=4,
        rounds_per_task=3,
        local_epochs=1,
        batch_size=16,
        lr=0.05,
        generator_rounds=4,
        generator_warmup=1,
        generator_steps=15,
        synthesis_batch=48,
        student_steps=8,
        text_encoder=NAME_HASH,
        run_name=run_name,
    ).validated()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("target-lander")
    configs = {f"{s}-{i}": _config(s, out, f"{s}-{i}") for s in ("target", "lander") for i in (1, 2)}
    threads = torch.get_num_threads()
    try:
        return run_locally(configs)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("method", ["target", "lander"])
def test_results_json_is_complete(runs, method) -> None:
    cfg, _, results = runs[f"{method}-1"]
    assert results["strategy"] == method and results["config"] == cfg.to_mapping()
    assert len(results["stages"]) == TASKS
    fields = {f.name for f in dataclasses.fields(StageRecord)}
    for t, stage in enumerate(results["stages"]):
        assert set(stage) == fields
        assert stage["stage"] == t + 1 and len(stage["per_task_accuracy"]) == t + 1
        assert sorted(stage["clients"]) == [f"client-{k}" for k in range(CLIENTS)] and stage["left_out"] == {}
        assert stage["rounds"] == (cfg.stage1_rounds if t == 0 else cfg.rounds_per_task)
        assert all(v > 0 for v in stage["upload_bytes_per_client"].values())
        assert ("synthesis" in stage["extra"]) == (t < TASKS - 1)  # no generator after the last task
    for key in ("A_avg", "A_T", "F_T", "total_seconds"):
        assert math.isfinite(results[key])
    assert 0 <= results["A_T"] <= 100 and results["A_avg"] > 100 / 10  # better than guessing
    if method == "lander":
        assert results["stages"][0]["extra"]["anchors"] == NAME_HASH
        assert all(1 <= s["extra"]["selected_round"] <= s["rounds"] for s in results["stages"])


@pytest.mark.parametrize("method", ["target", "lander"])
def test_generator_samples_are_classified_as_the_intended_classes(runs, method) -> None:
    """The global model each pool was distilled from recognises the class every synthetic image
    was generated for, far above chance (1 / seen classes), at every stage."""
    _, _, results = runs[f"{method}-1"]
    for t, stage in enumerate(results["stages"][:-1]):
        chance = 100.0 / SEEN[t]
        accuracy = stage["extra"]["synthesis"]["intended_accuracy"]
        assert accuracy > 1.5 * chance, (method, t + 1, accuracy, chance)


@pytest.mark.parametrize("method", ["target", "lander"])
def test_the_distillation_losses_decrease(runs, method) -> None:
    _, _, results = runs[f"{method}-1"]
    for stage in results["stages"][:-1]:
        log = stage["extra"]["synthesis"]
        first, last = log["generator_loss_first"], log["generator_loss_last"]
        assert all(b < a for a, b in zip(first, last)), (first, last)  # within every round
        assert last[-1] < first[0]  # and over the task
        kd = log["student_kd"]
        assert len(kd) >= 2 and kd[-1] < kd[0], kd  # the server student learns the teacher


@pytest.mark.parametrize("method", ["target", "lander"])
def test_a_clients_distillation_loss_decreases_over_its_epochs(runs, method) -> None:
    """A client of the last task, given the server's teacher and pool, distils the teacher on the
    synthetic images: starting from a re-initialised model, its KD term falls epoch after epoch."""
    _, grid, _ = runs[f"{method}-1"]
    server_identity()
    message = next(m for m in reversed(grid.sent) if m.metadata.message_type == "train")
    ins = parse_instruction(message)
    assert isinstance(ins, TrainIns) and ins.header.task == TASKS - 1
    ins = dataclasses.replace(ins, config=ins.config.replace(local_epochs=5))
    node = message.metadata.dst_node_id
    job = make_job(ins, grid.contexts[node])
    teacher = frozen_teacher(job.model, server_arrays(job, "teacher"), job.device)
    reinitialise(job.model, seeded_generator(0))
    num_old = job.task_classes.start

    def kd_only(model, images, labels, syn):
        kd = kd_loss(model(syn)[:, : job.num_seen], teacher(syn)[:, :num_old].detach(), 2.0)
        return {"loss": kd, "kd": kd}

    stats = replay_sgd(job, kd_only, synthetic_pool(job))
    kd = stats.terms["kd"]
    assert len(kd) == 5 and kd[-1] < kd[0], kd
    if method == "lander":
        assert anchors_of(job).shape == (10, 512)


def _numbers(results: dict) -> dict:
    """results.json without wall times (rounds, stages, local training) and the server's timing extras (the only things two runs of
    one seed may differ in)."""
    text = json.dumps(results, sort_keys=True)
    numbers = json.loads(
        re.sub(r'"(seconds|total_seconds|train_seconds_max|train_seconds_mean)": [0-9.eE+-]+', r'"\1": 0', text)
    )
    for stage in numbers.get("stages", []):
        for key in TIMING_EXTRAS:
            stage.get("extra", {}).pop(key, None)
    return numbers


@pytest.mark.parametrize("method", ["target", "lander"])
def test_runs_are_deterministic_given_the_seed(runs, method) -> None:
    a, b = runs[f"{method}-1"][2], runs[f"{method}-2"][2]
    a["config"].pop("run-name"), b["config"].pop("run-name")
    assert _numbers(a) == _numbers(b)
