"""STSA / STSA-E through the real Flower glue, without Ray.

Each run drives the strategy's own stage loop (``start``: configure_train -> ClientApp dispatch
-> aggregate_train -> ridge solve -> evaluation) over an in-process grid (tests/conftest.py), so
messages, reply validation, byte accounting and the results record are the production code.
The references are direct centralised computations on the pooled training data.
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, Message

from fcl_flower.analytic import (
    bytes_for,
    default_ridge_grid,
    stsa_e_upload_numbers,
    stsa_upload_numbers,
)
from fcl_flower.config import RunConfig
from fcl_flower.models import trainable_state
from fcl_flower.runtime import build_model, federated_split
from tests.conftest import NODE_BASE, build, reply_partition, run_in_process, small_config

F64 = torch.float64
GAMMA = 100.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# --------------------------------------------------------------------------- references
# The float32 backbone is not bit-for-bit batch-invariant (a batch of one sample takes another
# convolution path and can differ in the last bit). The references therefore come in two kinds:
# ``pooled_solve`` extracts features exactly as the clients batch them and then solves ONE ridge
# on the pooled Φ in float64 (isolates the glue's float64 path: agreement to ~1e-8 or better),
# ``centralised`` uses one full-batch pass over all the data (partition-free; agreement ~1e-6).


@lru_cache(maxsize=2)
def _model_and_projection(cfg: RunConfig) -> tuple[torch.nn.Module, torch.Tensor]:
    """A freshly built seeded backbone and W_rand regenerated from the seed (float64 N(0, 1))."""
    model = build_model(cfg, federated_split(cfg)).eval()
    proj = torch.randn(
        model.backbone.feature_dim, cfg.rf_dim, generator=torch.Generator().manual_seed(cfg.seed), dtype=F64
    )
    return model, proj


def _phi(cfg: RunConfig, images: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    model, proj = _model_and_projection(
        cfg.replace(num_clients=1, beta=0.5, out="/x", run_name="", strategy="stsa", wire_dtype="float64")
    )
    batch = batch or len(images)
    with torch.no_grad():
        feats = torch.cat([model.features(images[i : i + batch]) for i in range(0, len(images), batch)])
    return torch.relu(feats.to(F64) @ proj)


def _ridge(phi: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, ...]:
    """G, C and W = (G + γI)⁻¹C by ``torch.linalg.solve`` (not the code's Cholesky path)."""
    onehot = torch.nn.functional.one_hot(labels, num_classes).to(F64)
    gram, sums = phi.T @ phi, phi.T @ onehot
    return gram, sums, torch.linalg.solve(gram + GAMMA * torch.eye(phi.shape[1], dtype=F64), sums)


def _test_accuracy(cfg: RunConfig, weights: torch.Tensor, seen: int) -> float:
    test = federated_split(cfg).bundle.test
    images, labels = test.subset(np.flatnonzero(test.targets < seen)).tensors()
    phi = _phi(cfg, images, cfg.batch_size)  # the server's batching
    preds = (phi @ (weights / weights.norm(dim=0, keepdim=True))).argmax(dim=1)  # cosine head
    return 100.0 * float((preds == labels).double().mean())


@lru_cache(maxsize=2)
def _client_batched_phi(cfg: RunConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per task: (Φ, labels) of every client's samples, each client's features batched as the
    client batches them (``batch-size`` chunks of its own data, in its own order)."""
    split = federated_split(cfg)
    out = []
    for task in range(len(split.tasks)):
        phis, labels = [], []
        for client in range(cfg.num_clients):
            images, y = split.client_train(task, client, eval_transform=True).tensors()
            phis.append(_phi(cfg, images, cfg.batch_size))
            labels.append(y)
        out.append((torch.cat(phis), torch.cat(labels)))
    return out


def pooled_solve(cfg: RunConfig, upto_task: int) -> tuple[torch.Tensor, ...]:
    """One-shot ridge on ALL training samples of tasks 0..upto_task pooled into one Φ."""
    per_task = _client_batched_phi(cfg.replace(out="/x", run_name=""))[: upto_task + 1]
    phi = torch.cat([p for p, _ in per_task])
    labels = torch.cat([y for _, y in per_task])
    return _ridge(phi, labels, federated_split(cfg).tasks[upto_task].stop)


@lru_cache(maxsize=4)
def centralised(cfg: RunConfig, upto_task: int) -> tuple[torch.Tensor, float]:
    """(W, accuracy) from one full-batch pass over the pooled data: no partition involved."""
    split = federated_split(cfg)
    seen = split.tasks[upto_task].stop
    train = split.bundle.train_eval
    images, labels = train.subset(np.flatnonzero(train.targets < seen)).tensors()
    weights = _ridge(_phi(cfg, images), labels, seen)[2]
    return weights, _test_accuracy(cfg, weights, seen)


def partition_free(cfg: RunConfig) -> RunConfig:
    """The cache key of the centralised reference: partition knobs and output folder reset."""
    return cfg.replace(
        num_clients=1, beta=0.5, out="/x", run_name="", wire_dtype="float64", strategy="stsa", dummy_clients=1
    )


# --------------------------------------------------------------------------- spatial invariance
@pytest.mark.parametrize("num_clients", [1, 5, 20])
@pytest.mark.parametrize("beta", [0.1, 0.5, 1.0])
def test_federated_stsa_equals_centralised_ridge(out_dir: Path, beta: float, num_clients: int) -> None:
    """Every stage's W equals the ridge on the pooled data, whatever the partition, and so do
    the accuracies (float64 on the wire, so only summation order differs)."""
    # two 5-class tasks: 2-class tasks of ~270 digits cannot give 20 clients >= 1 sample each
    # at beta = 0.1 (the data layer refuses); many stages are the temporal test's business
    num_tasks = 2
    cfg = small_config(out_dir, beta=beta, num_clients=num_clients, num_tasks=num_tasks)
    strategy = run_in_process(cfg)
    stages = strategy.recorder.stages
    assert len(stages) == len(strategy.stage_weights) == num_tasks
    for task, (record, weights) in enumerate(zip(stages, strategy.stage_weights)):
        gram, sums, w_pooled = pooled_solve(cfg, task)
        w_central, acc_central = centralised(partition_free(cfg), task)
        assert weights.dtype == F64
        assert rel_err(weights, w_pooled) <= 1e-8
        assert rel_err(weights, w_central) <= 1e-6  # float32 backbone batching only
        assert record.accuracy == acc_central  # hence identical for every partition
        assert record.clients == sorted(f"client-{k}" for k in range(num_clients))
        assert record.left_out == {}
        assert record.extra["ridge"] == GAMMA
    assert rel_err(strategy.ridge.gram, gram) <= 1e-12
    assert rel_err(strategy.ridge.class_sums[:, : sums.shape[1]], sums) <= 1e-12


def test_temporal_aggregation_equals_one_shot_joint(out_dir: Path) -> None:
    """Summing per-stage statistics over T stages gives the one-shot statistics of all T tasks,
    and the same classifier as the joint (centrally pooled) strategy at every stage."""
    cfg = small_config(out_dir, num_clients=4, beta=0.3)
    stsa = run_in_process(cfg)
    joint = run_in_process(cfg.replace(strategy="joint", run_name="joint"))
    gram_all, sums_all, w_all = pooled_solve(cfg, len(stsa.split.tasks) - 1)
    assert rel_err(stsa.ridge.gram, gram_all) <= 1e-12
    assert rel_err(stsa.ridge.class_sums, sums_all) <= 1e-12
    assert stsa.ridge.num_samples == len(federated_split(cfg).bundle.train)
    assert rel_err(stsa.weights, w_all) <= 1e-8
    for w_fed, w_joint in zip(stsa.stage_weights, joint.stage_weights):
        assert rel_err(w_fed, w_joint) <= 1e-8
    assert [s.accuracy for s in stsa.recorder.stages] == [s.accuracy for s in joint.recorder.stages]
    assert all(s.upload_bytes_per_client == {} for s in joint.recorder.stages)  # nothing uploaded


@pytest.mark.parametrize("wire_dtype", ["float32", "float64"])
def test_the_check_tolerance_reaches_every_upload_check_and_leaves_an_honest_run_unchanged(
    out_dir: Path, wire_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """check-tolerance float32 (default) holds float64 uploads to the float32 threshold, wire to
    their own, in the per-upload screen and in the stage's certificate of the sum alike; honest
    uploads pass both, so every stage's W is the same, bit for bit."""
    import strategies.stsa as stsa_module

    seen: list[float] = []
    screened: list[float] = []
    bounds: list[float] = []
    real, real_screen = stsa_module.check_packed_statistics, stsa_module.screen_packed_statistics

    def spy(*args, **kwargs):
        seen.append(kwargs["relative_tolerance"])
        bounds.append(real(*args, **kwargs))
        return bounds[-1]

    def spy_screen(*args, **kwargs):
        screened.append(kwargs["relative_tolerance"])
        return real_screen(*args, **kwargs)

    monkeypatch.setattr(stsa_module, "check_packed_statistics", spy)
    monkeypatch.setattr(stsa_module, "screen_packed_statistics", spy_screen)
    runs = {}
    for tolerance in ("float32", "wire"):
        seen.clear()
        screened.clear()
        bounds.clear()
        cfg = small_config(out_dir, num_tasks=2, wire_dtype=wire_dtype, check_tolerance=tolerance, run_name=tolerance)
        runs[tolerance] = run_in_process(cfg)
        expected = 2.0**-24 if wire_dtype == "float32" or tolerance == "float32" else 2.0**-53
        assert len(screened) == 2 * cfg.num_clients and set(screened) == {expected}  # every upload, O(M²)
        assert len(seen) == 2 and set(seen) == {expected}  # one factorisation per stage, on the sum
        assert all(stage.left_out == {} for stage in runs[tolerance].recorder.stages)
        assert [s.extra["sum_certificate"] for s in runs[tolerance].recorder.stages] == [
            {"factorisations": 1, "culprits": []}
        ] * 2
        # what each stage's certificate certified of its sum's G, summed: the ridge state's
        # certificate, plus each float64 addition into it (2u·tr of its sum)
        ridge = runs[tolerance].ridge
        assert 0 < sum(bounds) <= ridge.negative_bound <= sum(bounds) + 2 * 2 * 2.0**-53 * float(ridge.gram.trace())
    for w_default, w_wire in zip(runs["float32"].stage_weights, runs["wire"].stage_weights, strict=True):
        assert torch.equal(w_default, w_wire)


def test_a_float32_upload_in_a_float64_run_is_held_to_the_run_s_tolerance(
    out_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The allowance follows the run's wire dtype, not the dtype a client chose to send: under
    check-tolerance wire a float32 upload in a float64 run gets float64's 2⁻⁵³, not float32's."""
    import strategies.stsa as stsa_module

    seen: list[tuple[torch.dtype, float]] = []
    real, real_screen = stsa_module.check_packed_statistics, stsa_module.screen_packed_statistics
    certified: list[float] = []

    def spy(gram_packed, *args, **kwargs):  # the per-upload screen sees the upload as it came
        seen.append((gram_packed.dtype, kwargs["relative_tolerance"]))
        return real_screen(gram_packed, *args, **kwargs)

    def spy_certificate(*args, **kwargs):  # the stage's certificate of the float64 sum
        certified.append(kwargs["relative_tolerance"])
        return real(*args, **kwargs)

    def to_float32(task: int, phase: str, replies: list[Message]) -> list[Message]:
        for m in replies:
            if phase.endswith("stats") and not m.has_error():
                arrays = m.content.array_records["arrays"]
                arrays["gram-packed"] = Array(arrays["gram-packed"].numpy().astype(np.float32))
        return replies

    monkeypatch.setattr(stsa_module, "screen_packed_statistics", spy)
    monkeypatch.setattr(stsa_module, "check_packed_statistics", spy_certificate)
    run_in_process(small_config(out_dir, num_tasks=2, check_tolerance="wire"), to_float32)
    assert any(dtype == torch.float32 for dtype, _ in seen)  # (late statistics ride in other records)
    assert {tolerance for _, tolerance in seen} == {2.0**-53}
    assert set(certified) <= {2.0**-53}  # (float32-rounded uploads may fail the wire tolerance itself)


# --------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("wire_dtype", ["float32", "float64"])
def test_stsa_upload_bytes_match_formula(out_dir: Path, wire_dtype: str) -> None:
    """Measured payload = packed formula M(M+1)/2 + M·c_t numbers × 4 or 8 bytes, per stage
    (a large first task makes c_t differ between stages); the message is only slightly larger."""
    cfg = small_config(out_dir, wire_dtype=wire_dtype, num_tasks=4, first_task_classes=4)
    strategy = run_in_process(cfg)
    for record in strategy.recorder.stages:
        expected = bytes_for(stsa_upload_numbers(cfg.rf_dim, len(record.classes), packed=True, counts=True), wire_dtype)
        assert record.upload_bytes_per_client == {f"client-{k}": expected for k in range(cfg.num_clients)}
        for nbytes in record.upload_message_bytes_per_client.values():
            assert expected < nbytes <= expected + 2048 and nbytes <= 1.02 * expected
    assert [len(s.classes) for s in strategy.recorder.stages] == [4, 2, 2, 2]


@pytest.mark.parametrize("wire_dtype", ["float32", "float64"])
def test_stsa_e_upload_bytes_match_formula(out_dir: Path, wire_dtype: str) -> None:
    """STSA-E sends (M + 1)·c_t·K_D numbers: class sums and counts of K_D dummy clients."""
    cfg = small_config(out_dir, strategy="stsa-e", wire_dtype=wire_dtype, dummy_clients=3, num_tasks=2)
    strategy = run_in_process(cfg)
    for record in strategy.recorder.stages:
        expected = bytes_for(stsa_e_upload_numbers(cfg.rf_dim, len(record.classes), 3), wire_dtype)
        assert record.upload_bytes_per_client == {f"client-{k}": expected for k in range(cfg.num_clients)}
        for nbytes in record.upload_message_bytes_per_client.values():
            assert expected < nbytes <= expected + 2048 and nbytes <= 1.05 * expected


# --------------------------------------------------------------------------- untrusted uploads
BAD_TASK, BAD_PARTITION = 1, 1  # the second client's reply in stage 2 is tampered with


def _set_array(reply: Message, key: str, value: np.ndarray) -> None:
    reply.content.array_records["arrays"][key] = Array(np.ascontiguousarray(value))


def _nan_class_sums(reply: Message) -> None:
    sums = reply.content.array_records["arrays"]["class-sums"].numpy().copy()
    sums[0, 0] = np.nan
    _set_array(reply, "class-sums", sums)


def _short_gram(reply: Message) -> None:
    gram = reply.content.array_records["arrays"]["gram-packed"].numpy()
    _set_array(reply, "gram-packed", gram[:-1].copy())


def _negative_count(reply: Message) -> None:
    counts = reply.content.array_records["arrays"]["counts"].numpy().copy()
    counts[0, 0], counts[0, 1] = -1.0, counts[0, 1] + counts[0, 0] + 1.0  # total unchanged
    _set_array(reply, "counts", counts)


def _claim_partition(partition: int):
    def tamper(reply: Message) -> None:
        reply.content.metric_records["metrics"]["partition-id"] = partition

    return tamper


BAD_UPLOADS = {
    # name: (strategy, whose reply, how it is corrupted, left_out key, words of the reason)
    "nan-class-sums": ("stsa", BAD_PARTITION, _nan_class_sums, f"client-{BAD_PARTITION}", "NaN"),
    "wrong-shape-gram": ("stsa", BAD_PARTITION, _short_gram, f"client-{BAD_PARTITION}", "shape"),
    "negative-count": ("stsa-e", BAD_PARTITION, _negative_count, f"client-{BAD_PARTITION}", "negative"),
    # client 2's node claims to serve client 1: identity comes from the node, the claim is rejected
    "duplicate-partition-id": (
        "stsa",
        2,
        _claim_partition(BAD_PARTITION),
        "client-2",
        f"node {NODE_BASE + 2} serves client-2 and now claims client-1",
    ),
    "out-of-range-partition-id": (
        "stsa",
        BAD_PARTITION,
        _claim_partition(7),
        f"client-{BAD_PARTITION}",
        "partition-id 7",
    ),
    "error-reply": ("stsa", BAD_PARTITION, None, f"client-{BAD_PARTITION}", "client failed"),
}


def _tamper_one(partition: int, corrupt):
    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if task != BAD_TASK:
            return replies
        if corrupt is None:  # drop the reply: the reference "aggregate without that client"
            return [r for r in replies if r.has_error() or reply_partition(r) != partition]
        for reply in replies:
            if not reply.has_error() and reply_partition(reply) == partition:
                corrupt(reply)
        return replies

    return tamper


def _bad_cfg(out_dir: Path, strategy: str, name: str) -> RunConfig:
    return small_config(out_dir, strategy=strategy, num_tasks=5, num_clients=3, dummy_clients=2, run_name=name)


_REFERENCE_RUNS: dict[tuple[str, int | None], object] = {}


def _reference_run(out_dir: Path, strategy: str, dropped: int | None):
    """The same run with client ``dropped``'s stage-2 reply never arriving (None: fault-free);
    cached, as it is the same for several kinds of bad upload."""
    key = (strategy, dropped)
    if key not in _REFERENCE_RUNS:
        tamper = None if dropped is None else _tamper_one(dropped, None)
        _REFERENCE_RUNS[key] = run_in_process(_bad_cfg(out_dir, strategy, f"ref-{dropped}"), tamper)
    return _REFERENCE_RUNS[key]


@pytest.mark.parametrize("kind", sorted(BAD_UPLOADS))
def test_bad_upload_is_rejected_and_the_rest_aggregated(out_dir: Path, kind: str, caplog, monkeypatch) -> None:
    """A bad reply is rejected by name and reason, the stage aggregates exactly the others, the
    client owes that stage's statistics and backfills them in the next stats round, after which
    the classifier is the fault-free one."""
    strategy_name, partition, corrupt, key, reason = BAD_UPLOADS[kind]
    cfg = _bad_cfg(out_dir, strategy_name, kind)
    if kind == "error-reply":  # the client's handler raises: Flower sends an error reply
        from clients import app as client_app_module

        original = client_app_module.handler_for

        def patched(strategy: str, phase: str):
            handler = original(strategy, phase)

            def failing(job):
                if job.task == BAD_TASK and job.partition == partition:
                    raise RuntimeError("disk full")
                return handler(job)

            return failing if phase == "stsa-stats" else handler

        monkeypatch.setattr(client_app_module, "handler_for", patched)
        tamper = None
    else:
        tamper = _tamper_one(partition, corrupt)
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="flwr"):
            bad = run_in_process(cfg, tamper)
    finally:
        flwr_logger.removeHandler(caplog.handler)
    monkeypatch.undo()
    dropped = _reference_run(out_dir, strategy_name, partition)
    fault_free = _reference_run(out_dir, strategy_name, None)

    # the stage's classifier is exactly the one without the bad client's statistics
    assert torch.equal(bad.stage_weights[BAD_TASK], dropped.stage_weights[BAD_TASK])
    assert rel_err(bad.stage_weights[BAD_TASK], fault_free.stage_weights[BAD_TASK]) > 1e-6
    missing = f"client-{partition}"
    stage = bad.recorder.stages[BAD_TASK]
    assert stage.accuracy == dropped.recorder.stages[BAD_TASK].accuracy
    assert stage.clients == sorted({"client-0", "client-1", "client-2"} - {missing})
    assert missing not in stage.upload_bytes_per_client
    assert stage.extra["statistics_missing"] == {missing: [BAD_TASK + 1]}
    # the record names the rejected upload and why, and the client whose data is missing
    assert reason in stage.left_out[key]
    assert missing in stage.left_out
    assert bad.recorder.to_dict()["stages"][BAD_TASK]["left_out"] == stage.left_out
    records = {id(r): r for r in caplog.records}.values()  # root and flwr handlers may both see one
    rejected = [r.getMessage() for r in records if "Rejected upload" in r.getMessage()]
    assert len(rejected) == 1
    assert f"node {NODE_BASE + partition}" in rejected[0] and reason in rejected[0] and key in rejected[0]
    # the next stats round brings the late statistics; from then on nothing is missing
    after = bad.recorder.stages[BAD_TASK + 1]
    assert after.extra["backfilled"] == {missing: [BAD_TASK + 1]}
    assert "statistics_missing" not in after.extra
    for other in bad.recorder.stages[:BAD_TASK] + bad.recorder.stages[BAD_TASK + 1 :]:
        assert other.left_out == {} and len(other.clients) == 3
    assert bad.ridge.num_samples == fault_free.ridge.num_samples == len(federated_split(cfg).bundle.train)
    assert rel_err(bad.ridge.gram, fault_free.ridge.gram) <= 1e-12
    assert rel_err(bad.weights, fault_free.weights) <= 1e-8
    assert [s.accuracy for s in bad.recorder.stages[BAD_TASK + 1 :]] == [
        s.accuracy for s in fault_free.recorder.stages[BAD_TASK + 1 :]
    ]


# --------------------------------------------------------------------------- backbone
def _test_features(strategy, task: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random features and labels of the test data of every class seen after ``task``."""
    from fcl_flower.analytic import random_features
    from fcl_flower.runtime import iter_features

    pairs = list(iter_features(strategy.model, strategy.split.seen_test(task), strategy.cfg, strategy.device))
    phi = torch.cat([random_features(f, strategy.projection, strategy.cfg.feature_clip) for f, _ in pairs])
    return phi, torch.cat([y for _, y in pairs])


def test_stage1_rounds_zero_keeps_the_seeded_backbone(out_dir: Path) -> None:
    """Without stage-1 training every strategy (any partition) sees the same test features,
    and the server model after the run is the seeded model, untouched."""
    a = run_in_process(small_config(out_dir, num_clients=2, beta=0.1, num_tasks=2, run_name="a"))
    b = build(
        small_config(out_dir, strategy="stsa-e", num_clients=6, beta=1.0, num_tasks=2, dummy_clients=2, run_name="b")
    )
    phi_a, y_a = _test_features(a, 1)
    phi_b, y_b = _test_features(b, 1)
    assert torch.equal(phi_a, phi_b) and torch.equal(y_a, y_b)
    seeded = trainable_state(build_model(a.cfg, a.split))
    state = trainable_state(a.model)
    assert state.keys() == seeded.keys()
    assert all(torch.equal(state[k], seeded[k]) for k in state)


# --------------------------------------------------------------------------- STSA-E
@pytest.mark.parametrize("k_mode", ["global", "per-class"])
def test_stsa_e_with_many_dummy_clients_approaches_stsa(out_dir: Path, k_mode: str) -> None:
    """Class sums are exact in STSA-E, only G is estimated (Eq. 9): the estimate is close to
    the exact G and the accuracy to STSA's, stage by stage."""
    base = small_config(out_dir, num_clients=5)
    exact = run_in_process(base)
    est = run_in_process(base.replace(strategy="stsa-e", dummy_clients=10, k_mode=k_mode, run_name=k_mode))
    assert torch.allclose(est.ridge.class_sums, exact.ridge.class_sums, rtol=1e-10, atol=1e-8)
    assert est.ridge.num_samples == exact.ridge.num_samples
    assert rel_err(est.ridge.gram, exact.ridge.gram) < 0.05
    for e, s in zip(est.recorder.stages, exact.recorder.stages):
        assert e.accuracy > 100.0 / est.num_seen(e.stage - 1)  # above chance
        assert abs(e.accuracy - s.accuracy) <= 3.0, (e.stage, e.accuracy, s.accuracy)


# --------------------------------------------------------------------------- ridge
def test_ridge_auto_picks_a_grid_gamma_and_matches_that_fixed_ridge(out_dir: Path) -> None:
    """GCV picks γ from the grid each stage; a run with that γ fixed gives the same classifier."""
    cfg = small_config(out_dir, ridge="auto", num_tasks=2)
    auto = run_in_process(cfg)
    grid = default_ridge_grid().tolist()
    for record in auto.recorder.stages:
        gamma = record.extra["ridge"]
        assert any(math.isclose(gamma, g, rel_tol=1e-12) for g in grid)
        assert record.extra["gcv"] == {"grid_min": grid[0], "grid_max": grid[-1], "method": "exact"}  # M < 2048
    final_gamma = auto.recorder.stages[-1].extra["ridge"]
    fixed = run_in_process(cfg.replace(ridge=repr(final_gamma), run_name="fixed"))
    assert rel_err(auto.weights, fixed.weights) <= 1e-12
    assert auto.recorder.stages[-1].accuracy == fixed.recorder.stages[-1].accuracy
    print(
        f"\nridge=auto on digits (2 tasks, 3 clients, seeded backbone): gamma per stage "
        f"{[r.extra['ridge'] for r in auto.recorder.stages]}, "
        f"A_t {[round(r.accuracy, 2) for r in auto.recorder.stages]}"
    )


def test_a_failed_solve_keeps_the_stage_statistics_once(out_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The solve of stage 1 fails after its statistics went into G (an eigendecomposition that does
    not converge, say): the stage fails cleanly, but nobody owes its statistics, so no backfill
    adds them a second time; the last stage's W is the uninterrupted run's."""
    import strategies.stsa as stsa_module
    from fcl_flower.analytic.errors import AnalyticInputError

    cfg = small_config(out_dir, num_tasks=5, run_name="uninterrupted")
    clean = run_in_process(cfg)
    real = stsa_module.solve_dense
    calls: list[int] = []

    def fails_once(ridge, num_seen, cfg):
        calls.append(num_seen)
        if len(calls) == 2:
            raise AnalyticInputError("the eigendecomposition of G failed: did not converge")
        return real(ridge, num_seen, cfg)

    monkeypatch.setattr(stsa_module, "solve_dense", fails_once)
    failed = run_in_process(cfg.replace(run_name="failed-solve"))
    stage = failed.recorder.stages[1]
    assert "did not converge" in stage.extra["failed"] and stage.extra["statistics_kept"] is True
    assert all(1 not in owed for owed in failed.backfill.missing.values())
    assert "backfilled" not in failed.recorder.stages[2].extra
    assert failed.ridge.num_samples == clean.ridge.num_samples == len(federated_split(cfg).bundle.train)
    assert rel_err(failed.weights, clean.weights) <= 1e-12
