"""Fault handling through the real stage loop and ClientApp, in process (LocalGrid, no Ray).

Scenarios: a SuperNode down during a statistics round (the stage completes without it and
says so; with ``require-all-clients`` the round is retried), the late client's backfill (the
classifier then equals the fault-free run's), a server killed between stages and resumed (same
classifier and per-stage results as an uninterrupted run), atomic checkpoints, and malformed
*backfill* uploads (on-time NaN / wrong-shape / duplicate uploads: tests/test_stsa_pipeline.py).
References are either the fault-free run or a direct ridge on the data of the answering clients.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message

import fcl_flower.state_io
import strategies.loop
from clients.app import app as client_app
from clients.statistics import backfill_tasks
from fcl_flower.analytic import random_features, random_projection
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.local_grid import LocalGrid
from fcl_flower.protocol import Header, ProtocolError, StatsIns
from fcl_flower.protocol.messages import decode_backfill, encode_backfill
from fcl_flower.runtime import build_model, federated_split
from fcl_flower.state_io import load_state
from strategies.accounting import TIMING_EXTRAS
from strategies.base import StagedStrategy
from strategies.stsa import STSAStrategy
from tests.conftest import build, reply_partition, sent_header

GAMMA = 100.0
NEVER = 10**9  # attempts a node misses when it never comes back
F64 = torch.float64


def config(out: Path, **changes) -> RunConfig:
    """Digits, 5 tasks, 3 clients, seeded frozen backbone, M = 100, float64 on the wire."""
    base = RunConfig(
        strategy="stsa",
        dataset="digits",
        num_tasks=5,
        num_clients=3,
        beta=0.5,
        seed=0,
        stage1_rounds=0,
        rf_dim=100,
        ridge=str(GAMMA),
        wire_dtype="float64",
        batch_size=256,
        device="cpu",
        out=str(out),
        round_timeout=5.0,
    )
    return base.replace(**changes)


class FaultyGrid(LocalGrid):
    """LocalGrid whose SuperNodes go down for given statistics rounds.

    ``down[task][node]`` = how many attempts of stage ``task``'s rounds that node misses (it
    stays connected, its messages are lost: a SuperNode killed mid-round); ``tamper(task, reply)``
    may corrupt replies in flight.
    """

    def __init__(
        self,
        num_nodes: int,
        down: dict[int, dict[int, int]] | None = None,
        tamper: Callable[[int, Message], None] | None = None,
    ) -> None:
        super().__init__(client_app, num_nodes)
        self.down = {task: dict(nodes) for task, nodes in (down or {}).items()}
        self.tamper = tamper
        self.attempts: dict[tuple[int, int], int] = {}  # (task, node) -> messages addressed

    def deliver(self, messages: Sequence[Message]) -> list[Message]:
        delivered = []
        for message in messages:
            task, node = sent_header(message).task, message.metadata.dst_node_id
            self.attempts[task, node] = self.attempts.get((task, node), 0) + 1
            misses = self.down.get(task, {})
            if misses.get(node, 0) > 0:
                misses[node] -= 1
                continue
            delivered.append(message)
        replies = super().deliver(delivered)
        if self.tamper is not None and delivered:
            task = sent_header(delivered[0]).task
            for reply in replies:
                self.tamper(task, reply)
        return replies


def run(cfg: RunConfig, grid: LocalGrid | None = None) -> StagedStrategy:
    """The strategy's own ``start`` loop over ``grid``; ``stage_weights`` holds W after each stage."""
    grid = grid or FaultyGrid(cfg.num_clients)
    strategy = build(cfg)
    strategy.stage_weights = []
    end_stage = strategy.end_stage

    def recording(task: int):
        extra = end_stage(task)
        strategy.stage_weights.append(strategy.weights.clone())
        return extra

    strategy.end_stage = recording  # type: ignore[method-assign]  # the test spies on each solve
    strategy.start(grid)
    return strategy


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def direct_ridge(cfg: RunConfig, pieces: Iterable[tuple[int, int]]) -> torch.Tensor:
    """W = (G + γI)⁻¹ C on the (task, client) data ``pieces`` only, in one pass with
    ``torch.linalg.solve``: what the server should hold when exactly those uploads arrived."""
    split = federated_split(cfg)
    model = build_model(cfg, split).eval()
    projection = random_projection(model.backbone.feature_dim, cfg.rf_dim, seed=cfg.seed)
    pieces = list(pieces)
    seen = max(split.tasks[task].stop for task, _ in pieces)
    gram = torch.zeros(cfg.rf_dim, cfg.rf_dim, dtype=F64)
    sums = torch.zeros(cfg.rf_dim, seen, dtype=F64)
    for task, client in pieces:
        images, labels = split.client_train(task, client, eval_transform=True).tensors()
        with torch.no_grad():
            phi = random_features(model.features(images), projection)
        gram += phi.T @ phi
        sums += phi.T @ torch.nn.functional.one_hot(labels, seen).to(F64)
    return torch.linalg.solve(gram + GAMMA * torch.eye(cfg.rf_dim, dtype=F64), sums)


def stage_results(strategy: StagedStrategy) -> list[dict]:
    """Per-stage records without the wall times (the only fields that may differ between runs)."""
    records = []
    for stage in strategy.recorder.stages:
        record = {k: v for k, v in asdict(stage).items() if k != "seconds"}
        record["extra"] = {k: v for k, v in record["extra"].items() if k not in TIMING_EXTRAS}
        records.append(record)
    return records


# node 2 = client-1 misses stage 2 (task 1) and is back for stage 3
LATE = {1: {2: NEVER}}


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def runs(out: Path):
    """runs(name, strategy, down, **changes): one run per name and strategy, shared by the tests."""
    cache: dict[tuple[str, str], StagedStrategy] = {}

    def get(name: str, strategy: str = "stsa", down=None, **changes) -> StagedStrategy:
        if (name, strategy) not in cache:
            cfg = config(out, strategy=strategy, run_name=f"{name}-{strategy}", dummy_clients=2, **changes)
            cache[name, strategy] = run(cfg, FaultyGrid(cfg.num_clients, down))
        return cache[name, strategy]

    return get


# --------------------------------------------------------------------------- the wire format
def test_backfill_request_round_trip_and_errors() -> None:
    owed = {3: [2, 1], 0: [1]}
    assert decode_backfill(encode_backfill(owed)) == {0: (1,), 3: (1, 2)}
    assert encode_backfill({}) == "" and decode_backfill("") == {}
    with pytest.raises(ProtocolError, match="cannot read backfill entry 'x'"):
        decode_backfill("0:1;x")
    cfg = RunConfig()

    def job(owed: dict[int, tuple[int, ...]]) -> SimpleNamespace:
        return SimpleNamespace(
            partition=1, task=2, ins=StatsIns(Header("r", "stsa-stats", 2, 3, 1), cfg, backfill=owed)
        )

    assert backfill_tasks(job({0: (1,), 1: (0, 1)})) == (0, 1)
    with pytest.raises(ProtocolError, match=r"only tasks 0\.\.1 are past"):
        backfill_tasks(job({1: (2,)}))  # the current task is not owed, it is due


# --------------------------------------------------------------------------- a node killed mid-round
def test_stage_completes_without_a_killed_node_and_says_whose_data_is_missing(runs) -> None:
    late, full = runs("late", down=LATE), runs("fault-free")
    stage = late.recorder.stages[1]
    assert stage.left_out == {"client-1": "no reply within round-timeout"}
    assert stage.clients == ["client-0", "client-2"]
    assert "client-1" not in stage.upload_bytes_per_client
    assert stage.extra["statistics_missing"] == {"client-1": [2]}
    # W of stage 2 is the ridge on exactly the data that arrived: task 1 of every client,
    # task 2 of the two that answered -- and not the fault-free W
    expected = direct_ridge(late.cfg, [(0, k) for k in range(3)] + [(1, k) for k in (0, 2)])
    assert rel_err(late.stage_weights[1], expected) <= 1e-8
    assert rel_err(late.stage_weights[1], full.stage_weights[1]) > 1e-6
    assert all(not s.left_out for i, s in enumerate(late.recorder.stages) if i != 1)


def test_require_all_clients_retries_the_node_that_did_not_answer(runs, out: Path) -> None:
    cfg = config(out, require_all_clients=True, round_retries=2, run_name="retry")
    grid = FaultyGrid(3, {1: {2: 1}})  # node 2 misses the first attempt of stage 2 only
    retried, full = run(cfg, grid), runs("fault-free")
    assert grid.attempts[1, 2] == 2 and grid.attempts[1, 1] == grid.attempts[2, 2] == 1
    for w, w_full in zip(retried.stage_weights, full.stage_weights, strict=True):
        assert rel_err(w, w_full) <= 1e-12  # only the order of the sum differs
    assert all(not s.left_out and len(s.clients) == 3 for s in retried.recorder.stages)
    assert [s.accuracy for s in retried.recorder.stages] == [s.accuracy for s in full.recorder.stages]


def test_require_all_clients_gives_up_after_round_retries(out: Path) -> None:
    cfg = config(out, require_all_clients=True, round_retries=2, run_name="give-up")
    grid = FaultyGrid(3, {1: {2: NEVER}})
    with pytest.raises(RuntimeError, match=r"no reply from client-1 after 3 attempts \(require-all-clients"):
        run(cfg, grid)
    assert grid.attempts[1, 2] == 3
    saved = load_state(cfg.output_dir / "checkpoint.json")
    assert saved["completed_tasks"] == 1  # stage 1 is safe: the run can be resumed


# --------------------------------------------------------------------------- backfill
@pytest.mark.parametrize("method", ["stsa", "stsa-e"])
def test_late_client_backfills_and_the_classifier_equals_the_fault_free_one(runs, method: str) -> None:
    late, full = runs("late", method, LATE), runs("fault-free", method)
    assert rel_err(late.stage_weights[1], full.stage_weights[1]) > 1e-6  # stage 2 lacked client-1
    for w, w_full in zip(late.stage_weights[2:], full.stage_weights[2:], strict=True):
        assert rel_err(w, w_full) <= 1e-8
    assert rel_err(late.ridge.gram, full.ridge.gram) <= 1e-10
    assert rel_err(late.ridge.class_sums, full.ridge.class_sums) <= 1e-10
    assert late.ridge.num_samples == full.ridge.num_samples
    assert [s.accuracy for s in late.recorder.stages[2:]] == [s.accuracy for s in full.recorder.stages[2:]]
    assert late.backfill.missing == {} and getattr(late, "held", {}) == {}  # STSA-E dropped the kept uploads

    # results.json tells the story: missing from stage 2, backfilled in stage 3
    stages = json.loads(late.recorder.path.read_text())["stages"]
    assert stages[1]["left_out"] == {"client-1": "no reply within round-timeout"}
    assert stages[1]["extra"]["statistics_missing"] == {"client-1": [2]}
    assert stages[2]["extra"]["backfilled"] == {"client-1": [2]}
    assert stages[2]["left_out"] == {} and "statistics_missing" not in stages[2]["extra"]
    assert all("backfilled" not in s["extra"] for i, s in enumerate(stages) if i != 2)
    # the late upload is billed to the stage it travelled in, at the size of a stage-2 upload
    bytes3, bytes2_full = stages[2]["upload_bytes_per_client"], full.recorder.stages[1].upload_bytes_per_client
    assert bytes3["client-1"] == bytes3["client-0"] + bytes2_full["client-1"]


def test_backfill_of_several_stages_and_a_client_missing_at_the_end(runs) -> None:
    """client-1 misses stages 2 and 3 and backfills both in stage 4; client-2 misses the last
    stage, after which no round is left to backfill: it stays recorded as missing."""
    down = {1: {2: NEVER}, 2: {2: NEVER}, 4: {3: NEVER}}
    late, full = runs("twice-late", down=down), runs("fault-free")
    stages = late.recorder.stages
    assert stages[2].extra["statistics_missing"] == {"client-1": [2, 3]}
    assert stages[3].extra["backfilled"] == {"client-1": [2, 3]}
    assert rel_err(late.stage_weights[3], full.stage_weights[3]) <= 1e-8
    assert stages[4].left_out == {"client-2": "no reply within round-timeout"}
    assert stages[4].extra["statistics_missing"] == {"client-2": [5]}
    everything_but = [(t, k) for t in range(5) for k in range(3) if (t, k) != (4, 2)]
    assert rel_err(late.weights, direct_ridge(late.cfg, everything_but)) <= 1e-8


# --------------------------------------------------------------------------- server killed and resumed
class ServerKilled(Exception):
    """Stands in for the server process dying right after a checkpoint was written."""


def crash_after(monkeypatch, stage: int) -> None:
    save = strategies.loop.save

    def save_then_die(strategy: StagedStrategy, task: int) -> None:
        save(strategy, task)
        if task + 1 == stage:
            raise ServerKilled(f"killed after stage {stage}")

    monkeypatch.setattr(strategies.loop, "save", save_then_die)


def test_resume_after_a_server_crash_ends_like_an_uninterrupted_run(runs, out: Path, monkeypatch) -> None:
    """Killed after stage 2 while client-1 still owes stage 2 (so the backfill bookkeeping and
    STSA-E's kept uploads must survive the checkpoint); restarted with resume=True. (STSA's
    resume is checked in the atomic-write test.)"""
    method = "stsa-e"
    cfg = config(out, strategy=method, dummy_clients=2, run_name=f"crash-{method}")
    crash_after(monkeypatch, 2)
    with pytest.raises(ServerKilled):
        run(cfg, FaultyGrid(3, LATE))
    monkeypatch.undo()
    assert len(json.loads((cfg.output_dir / "results.json").read_text())["stages"]) == 2
    grid = FaultyGrid(3)  # a fresh grid: the clients restarted too
    resumed, uninterrupted = run(cfg.replace(resume=True), grid), runs("late", method, LATE)
    assert min(task for task, _ in grid.attempts) == 2  # stages 1-2 were not re-run
    assert torch.equal(resumed.weights, uninterrupted.weights)
    assert stage_results(resumed) == stage_results(uninterrupted)
    assert resumed.recorder.stages[2].extra["backfilled"] == {"client-1": [2]}
    assert len(json.loads(resumed.recorder.path.read_text())["stages"]) == 5


def test_resume_refuses_a_changed_config_and_a_missing_checkpoint(out: Path, monkeypatch) -> None:
    cfg = config(out, num_tasks=2, run_name="changed")
    crash_after(monkeypatch, 1)
    with pytest.raises(ServerKilled):
        run(cfg, FaultyGrid(3))
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"config differs from the checkpoint in: rf-dim$"):
        run(cfg.replace(resume=True, rf_dim=50))
    with pytest.raises(ConfigError, match="config differs from the checkpoint in: beta, seed"):
        run(cfg.replace(resume=True, seed=1, beta=0.3))
    with pytest.raises(ConfigError, match="no checkpoint"):
        run(cfg.replace(resume=True, run_name="never-ran"))


def test_a_failing_checkpoint_write_leaves_the_previous_checkpoint_intact(runs, out: Path, monkeypatch) -> None:
    cfg = config(out, run_name="atomic")
    crash_after(monkeypatch, 2)
    with pytest.raises(ServerKilled):
        run(cfg, FaultyGrid(3))
    monkeypatch.undo()
    path = cfg.output_dir / "checkpoint.json"
    before = {p.name: p.read_bytes() for p in cfg.output_dir.iterdir() if p.name.startswith("checkpoint")}

    def torn_write(tensors, target, *args, **kwargs) -> None:
        Path(target).write_bytes(b"half a checkpoint")  # the disk fills up mid-write
        raise OSError("No space left on device")

    monkeypatch.setattr(fcl_flower.state_io, "save_file", torn_write)
    strategy = build(cfg)
    with pytest.raises(OSError, match="No space left"):
        strategies.loop.save(strategy, 4)
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in cfg.output_dir.iterdir() if p.name.startswith("checkpoint")}
    assert after == before and path.name in after
    assert not [p.name for p in cfg.output_dir.iterdir() if p.name.startswith(".") and p.name != ".lock"]
    resumed = run(cfg.replace(resume=True), FaultyGrid(3))
    assert torch.equal(resumed.weights, runs("fault-free").weights)


# --------------------------------------------------------------------------- malformed backfill uploads
# One statistics round (stage 3) replayed on the server state of a run in which client-1 missed
# stage 2; its stage-3 reply carries the backfill. The on-time NaN / wrong-shape / duplicate
# uploads are covered in tests/test_stsa_pipeline.py; here the late records are the bad ones.
def _nan_backfill(reply: Message) -> None:
    record = reply.content.array_records["backfill-1"]
    sums = record["class-sums"].numpy().copy()
    sums[0, 0] = np.nan
    record["class-sums"] = Array(sums)


def _short_backfill_gram(reply: Message) -> None:
    record = reply.content.array_records["backfill-1"]
    record["gram-packed"] = Array(record["gram-packed"].numpy()[:-1].copy())


def _negative_backfill_count(reply: Message) -> None:
    reply.content.metric_records["metrics"]["backfill-1-num-examples"] = -1


def _unasked_backfill(task: int):
    def tamper(reply: Message) -> None:  # a copy of the on-time statistics, passed off as old ones
        reply.content[f"backfill-{task}"] = ArrayRecord(dict(reply.content.array_records["arrays"].items()))
        reply.content.metric_records["metrics"][f"backfill-{task}-num-examples"] = 10

    return tamper


BAD_BACKFILL = {
    # name: (whose stage-3 reply, how it is corrupted, words of the reason)
    "nan": (1, _nan_backfill, "record 'backfill-1': array 'class-sums' contains NaN"),
    "wrong-shape": (1, _short_backfill_gram, "record 'backfill-1': array 'gram-packed' has shape"),
    "bad-count": (1, _negative_backfill_count, "metric 'backfill-1-num-examples' is -1"),
    "not-owed-by-client": (0, _unasked_backfill(1), "record 'backfill-1' was not asked for (client-0 owes stages [])"),
    "not-owed-stage": (1, _unasked_backfill(0), "record 'backfill-0' was not asked for (client-1 owes stages [2])"),
}


@pytest.fixture(scope="module")
def after_stage_2(out: Path) -> RunConfig:
    """The checkpoint of a STSA run killed after stage 2, client-1 having missed stage 2."""
    cfg = config(out, run_name="stage-3-replay")
    with pytest.MonkeyPatch.context() as patch:
        crash_after(patch, 2)
        with pytest.raises(ServerKilled):
            run(cfg, FaultyGrid(3, LATE))
    return cfg


def replay_stage_3(cfg: RunConfig, drop: int | None = None) -> tuple[STSAStrategy, list[Message]]:
    """The stage-2 server restored from its checkpoint, and the replies to its stage-3
    statistics request (without partition ``drop``'s); nothing aggregated yet."""
    strategy = build(cfg)
    assert isinstance(strategy, STSAStrategy)
    assert strategies.loop.restore(strategy) == 2 and strategy.backfill.missing == {"client-1": [1]}
    strategy.begin_round(strategy.round_plan(2, "stsa-stats"))
    grid = FaultyGrid(3)
    messages = strategy.configure_train(strategy.server_round, strategy.global_arrays(), ConfigRecord(), grid)
    replies = list(grid.send_and_receive(messages))
    return strategy, [r for r in replies if reply_partition(r) != drop]


@pytest.mark.parametrize("kind", sorted(BAD_BACKFILL))
def test_malformed_backfill_is_rejected_and_never_corrupts_the_aggregate(after_stage_2: RunConfig, kind: str) -> None:
    """The sender's whole reply is rejected, named, and the aggregate is exactly the one
    without that reply; whatever the sender owed it still owes."""
    partition, corrupt, reason = BAD_BACKFILL[kind]
    bad, replies = replay_stage_3(after_stage_2)
    for reply in replies:
        if reply_partition(reply) == partition:
            corrupt(reply)
    bad.aggregate_train(bad.server_round, replies)
    dropped, replies = replay_stage_3(after_stage_2, drop=partition)
    dropped.aggregate_train(dropped.server_round, replies)
    assert torch.equal(bad.ridge.gram, dropped.ridge.gram) and torch.equal(
        bad.ridge.class_sums, dropped.ridge.class_sums
    )
    assert bad.ridge.num_samples == dropped.ridge.num_samples
    assert bad.backfill.missing == dropped.backfill.missing
    assert bad.backfill.missing[f"client-{partition}"][-1] == 2  # it owes stage 3 now, too
    assert reason in bad.accounting.rejected[f"client-{partition}"]
    assert (
        bad.accounting.clients
        == dropped.accounting.clients
        == {f"client-{k}" for k in range(3)} - {f"client-{partition}"}
    )


def test_replayed_stage_3_round_backfills_when_nothing_is_wrong(after_stage_2: RunConfig, runs) -> None:
    """The replay itself is faithful: untouched, it gives the fault-free run's statistics."""
    good, replies = replay_stage_3(after_stage_2)
    good.aggregate_train(good.server_round, replies)
    full = runs("fault-free")
    assert good.backfill.missing == {} and good.backfill.arrived == {"client-1": [1]}
    good.end_stage(2)
    assert rel_err(good.weights, full.stage_weights[2]) <= 1e-8


def test_only_the_first_round_waits_the_whole_timeout_for_missing_nodes(tmp_path, monkeypatch) -> None:
    """A node that went away costs the first round up to round-timeout (nodes still connecting),
    and every later round at most the reconnect grace, not the whole timeout again."""
    from strategies.nodes import RECONNECT_GRACE_S, NodeDirectory

    cfg = RunConfig(dataset="digits", num_clients=3, out=str(tmp_path), round_timeout=1000.0).validated()
    clock = {"now": 0.0}
    nodes = NodeDirectory(
        cfg,
        federated_split(cfg),
        clock=lambda: clock["now"],
        sleep=lambda seconds: clock.__setitem__("now", clock["now"] + seconds),
    )
    grid = SimpleNamespace(get_node_ids=lambda: [11, 12])  # the third node is gone
    assert nodes.connected(grid) == [11, 12]
    first = clock["now"]
    assert 1000.0 <= first <= 1001.0
    assert nodes.connected(grid) == [11, 12]
    assert clock["now"] - first <= RECONNECT_GRACE_S + 1.0


def test_a_state_that_shares_tensors_round_trips_and_shares_them_again(tmp_path: Path) -> None:
    """LGA keeps its teacher and trackers as the very tensors of the model: a checkpoint stores
    each once and loads them shared again; an overlapping view is stored as a copy."""
    from fcl_flower.state_io import save_state

    weight = torch.randn(4, 3)
    state = {"model": {"w": weight}, "teacher": {"w": weight}, "row": weight[1], "ids": torch.arange(5)}
    loaded = load_state(save_state(tmp_path, "ck", state))
    assert torch.equal(loaded["model"]["w"], weight) and loaded["model"]["w"] is loaded["teacher"]["w"]
    assert torch.equal(loaded["row"], weight[1]) and torch.equal(loaded["ids"], torch.arange(5))


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        ("malformed digest", "sha256 field is malformed ('not-a-digest', not 64 hex digits)"),
        ("altered digest", "its sha256 field does not match"),
        ("damaged tensors", "the tensors file is damaged"),
    ],
)
def test_a_digest_mismatch_names_the_side_that_is_wrong(tmp_path: Path, damage: str, says: str) -> None:
    """A damaged sha256 field in checkpoint.json is not reported as a corrupted tensors file (the
    JSON is re-signed with the key, as a damage before signing would be; unsigned, it is refused
    as not signed: tests/test_checkpoint_trust.py)."""
    from fcl_flower.state_io import StateError, save_state, signed_bytes
    from fcl_flower.state_key import signing_key

    path = save_state(tmp_path, "checkpoint", {"w": torch.randn(3, 2)})
    tensors = next(tmp_path.glob("checkpoint-*.safetensors"))
    document = json.loads(path.read_text())
    if damage == "malformed digest":
        document["sha256"] = "not-a-digest"
    elif damage == "altered digest":
        document["sha256"] = document["sha256"][:-1] + ("0" if document["sha256"][-1] != "0" else "1")
    else:
        tensors.write_bytes(tensors.read_bytes()[:-8] + b"\0" * 8)
    document.pop("hmac")
    path.write_bytes(signed_bytes("checkpoint", document, signing_key()))
    with pytest.raises(StateError) as err:
        load_state(path)
    message = str(err.value)
    assert "\n" not in message and says in message and "restore a backup" in message
    if damage == "damaged tensors":
        assert message.startswith(str(tensors))
    else:
        assert message.startswith(f"{path}: its sha256 field") and "tensors file is damaged" not in message


@pytest.mark.parametrize("engine", ["simulation", "supernodes"])
def test_a_resume_warns_of_a_new_federation_only_where_node_ids_persist(tmp_path, monkeypatch, engine: str) -> None:
    """The simulation engine gives its nodes new ids every run: a resumed simulation maps its
    clients afresh without a warning; real SuperNodes none of which is back still warn."""
    from flwr.superlink.grid import InMemoryGrid

    import strategies.nodes
    from strategies.nodes import NodeDirectory

    class SimulationGrid(InMemoryGrid):
        def __init__(self) -> None:  # no link state: only the node ids are asked for
            pass

        def get_node_ids(self) -> list[int]:
            return [21, 22]

    cfg = RunConfig(dataset="digits", num_clients=2, out=str(tmp_path)).validated()
    nodes = NodeDirectory(cfg, federated_split(cfg))
    nodes.load_state_dict({"client_of": {"11": 0, "12": 1}})
    logged: list[tuple[int, str]] = []
    monkeypatch.setattr(strategies.nodes, "log", lambda level, msg, *args: logged.append((level, msg % args)))
    grid = SimulationGrid() if engine == "simulation" else SimpleNamespace(get_node_ids=lambda: [21, 22])
    assert nodes.connected(grid) == [21, 22]
    assert nodes.client_of == {}  # mapped afresh either way
    warned = [msg for level, msg in logged if level >= logging.WARNING]
    if engine == "simulation":
        assert warned == [] and any("new ids" in msg for _, msg in logged)
    else:
        assert len(warned) == 1 and "none of the checkpoint's nodes is connected" in warned[0]
