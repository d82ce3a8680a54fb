"""Fewer exchanges per stage: the federated evaluation of stage t rides with stage t+1's
statistics round (strategies/evaluation.py, ``Riding``), the last stage's alone, and the nodes'
first contact with the first round (no ``query.info`` exchange), with the same stage records as
separate exchanges; untrusted counts and claims are checked as ever."""

from __future__ import annotations

import collections
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, Message

from fcl_flower.local_grid import LocalGrid
from fcl_flower.protocol import EvaluateRes, Header, StatsRes, UploadError, to_record
from fcl_flower.protocol.base import COUNTS
from fcl_flower.results import StageRecord
from strategies import loop
from strategies.evaluation import Riding
from tests.conftest import (
    build,
    in_process_grid,
    record_stage_weights,
    reply_partition,
    sent_header,
    server_identity,
    small_config,
)

STATS = "stsa-stats"


def config(tmp: Path, name: str, **changes):
    base = {"rf_dim": 60, "num_tasks": 3, "first_task_classes": 4, "evaluation": "federated", "run_name": name}
    return small_config(tmp, **{**base, **changes})


def run(cfg, *, rides: bool = True, tamper=None):
    """(strategy, grid, W after each stage) of an in-process run; ``rides`` False: as before, every
    evaluation in an exchange of its own and a ``query.info`` exchange before the first round."""
    server_identity()
    strategy = build(cfg)
    if not rides:
        strategy.evaluation_rides = lambda task: False  # type: ignore[method-assign]
        strategy.first_contact_rides = lambda plan: False  # type: ignore[method-assign]
    weights = record_stage_weights(strategy)
    grid = in_process_grid(cfg.num_clients, tamper)
    strategy.start(grid)
    return strategy, grid, weights


def exchanges_per_stage(grid: LocalGrid) -> dict[int, list[str]]:
    """Stage -> the message types of its exchanges (one exchange: one round's messages to the nodes)."""
    seen: dict[tuple[int, str, int], int] = {}
    for m in grid.sent:
        h = sent_header(m)
        seen.setdefault((h.server_round, m.metadata.message_type, h.attempt), h.stage)
    out: dict[int, list[str]] = collections.defaultdict(list)
    for (_, kind, _), stage in seen.items():
        out[stage].append(kind)
    return dict(out)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The same run with separate evaluation exchanges, and with the evaluation riding along."""
    tmp = tmp_path_factory.mktemp("rides")
    return run(config(tmp, "separate"), rides=False), run(config(tmp, "riding"))


@pytest.fixture(scope="module")
def secure_runs(tmp_path_factory):
    """A secure run with separate evaluation exchanges, and with the evaluation riding along."""
    cfg = config(tmp_path_factory.mktemp("secure"), "secure", secure_aggregation=True, num_tasks=2)
    return run(cfg.replace(run_name="secure-separate"), rides=False), run(cfg)


def records(strategy) -> list[dict]:
    return [
        {"accuracy": s.accuracy, "per_task": s.per_task_accuracy, "evaluation": s.extra["evaluation"]}
        for s in strategy.recorder.stages
    ]


def test_the_evaluation_rides_with_the_next_statistics_and_the_records_are_the_same(clean) -> None:
    (separate, grid_before, w_before), (riding, grid_after, w_after) = clean
    assert exchanges_per_stage(grid_before) == {
        1: ["query.info", "query.stats", "evaluate"],
        2: ["query.stats", "evaluate"],
        3: ["query.stats", "evaluate"],
    }
    assert exchanges_per_stage(grid_after) == {
        1: ["query.stats"],  # the nodes' first contact rides with it
        2: ["query.stats"],  # carries stage 1's evaluation
        3: ["query.stats", "evaluate"],  # stage 2's evaluation rides; stage 3's alone
    }
    assert records(riding) == records(separate)
    assert all(not math.isnan(s.accuracy) for s in riding.recorder.stages)
    assert riding.recorder.stages[0].extra["evaluation"]["samples"] > 0
    for a, b in zip(w_before, w_after, strict=True):
        assert np.array_equal(a.numpy(), b.numpy())
    assert riding.riding is None and riding.held_out_sizes == separate.held_out_sizes
    # the statistics of stage 2 carried stage 1's W, the same as stage 1's own evaluate message did
    ridden = [m for m in grid_after.sent if m.metadata.message_type == "query.stats" and sent_header(m).stage == 2]
    alone = [m for m in grid_before.sent if m.metadata.message_type == "evaluate" and sent_header(m).stage == 1]
    assert ridden and alone
    w_sent = ridden[0].content.array_records["ridge"]["weights"].numpy()
    assert np.array_equal(w_sent, alone[0].content.array_records["ridge"]["weights"].numpy())


def test_bad_riding_counts_leave_the_client_out_of_the_evaluation_only(tmp_path, clean) -> None:
    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if phase == STATS and task == 1:
            for m in replies:
                if reply_partition(m) == 2:
                    record = m.content.array_records[COUNTS]
                    record["correct"] = Array(np.ascontiguousarray(record["total"].numpy() + 1))
        return replies

    strategy, _, weights = run(config(tmp_path, "bad"), tamper=tamper)
    riding, _, clean_weights = clean[1]
    evaluation = strategy.recorder.stages[0].extra["evaluation"]
    assert "more correct predictions than test samples" in evaluation["left_out"]["client-2"]
    assert evaluation["clients"] == ["client-0", "client-1"]
    assert strategy.recorder.stages[1].left_out == {}  # its statistics were read as ever
    assert np.array_equal(weights[1].numpy(), clean_weights[1].numpy())
    assert records(strategy)[1:] == records(riding)[1:]


def test_counts_nobody_asked_for_reject_the_reply(tmp_path) -> None:
    """Stage 1's statistics carry no evaluation: a reply with counts is refused (the reply, by
    name); where one rides, the counts go to the evaluation and the statistics are read."""
    strategy = build(config(tmp_path, "unasked"))
    plan = strategy.plan_stage(0)[-1]
    counts = EvaluateRes(Header("r", "x", 0, 1, 1), 1, 0, counts=to_record({"correct": np.zeros(4, np.int64)}))
    reply = StatsRes(Header("r", "x", 0, 1, 1), 1, 0, evaluation=counts)
    with pytest.raises(UploadError, match="evaluation counts that this round did not ask for"):
        strategy.take_evaluation(plan, "client-1", reply)
    record = StageRecord(1, [0, 1, 2, 3], 0.0, [0.0], 0.0, 1, {}, {})
    strategy.riding = Riding.of(strategy, record)
    strategy.take_evaluation(plan, "client-1", reply)
    assert "client-1" in strategy.riding.scores.left_out  # malformed counts: out of the evaluation only


def test_a_resume_with_a_pending_evaluation_ends_with_the_same_records(tmp_path, monkeypatch, clean) -> None:
    whole = clean[1][0]
    cfg = config(tmp_path, "crashed")
    save = loop.save

    def save_then_crash(strategy, task):  # the server dies right after stage 2's checkpoint
        save(strategy, task)
        if task == 1:
            raise RuntimeError("server crash")

    monkeypatch.setattr(loop, "save", save_then_crash)
    with pytest.raises(RuntimeError, match="server crash"):
        run(cfg)
    monkeypatch.setattr(loop, "save", save)
    payload = build(cfg).checkpoints.load(cfg)
    assert len(payload["stages"]) == 1 and payload["pending_stage"].stage == 2
    resumed, grid, _ = run(cfg.replace(resume=True))
    assert exchanges_per_stage(grid) == {3: ["query.stats", "evaluate"]}  # stage 2 rides, as uninterrupted
    assert records(resumed) == records(whole)


def test_the_ctrl_c_line_offers_a_resume_while_stage_1_waits_for_its_score(tmp_path) -> None:
    """Stage 1 is in the checkpoint but not yet in results.json (its evaluation rides with stage 2)."""
    import json

    from experiments.interrupt import sim_line

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"status": "running", "stages": []}))
    assert "nothing to resume" in sim_line(results, 3, [])
    (tmp_path / "checkpoint.json").write_text("{}")
    line = sim_line(results, 3, ["--num-tasks", "3"])
    assert line.startswith("interrupted: stage 1 of 3 saved in") and line.endswith("fcl-sim --num-tasks 3 --resume")


@pytest.mark.parametrize(("nodes", "info"), [(3, 0), (4, 0), (5, 5)])
def test_first_contact_rides_only_while_a_round_holds_no_more_replies_than_a_stream(tmp_path, nodes, info) -> None:
    """Up to the stream's window (4) of connected nodes, the first round goes to the unknown nodes
    directly; beyond it, a ``query.info`` exchange maps them first, as before."""
    from clients.app import app as client_app
    from tests.conftest import NODE_BASE

    server_identity()
    strategy = build(config(tmp_path, f"n{nodes}", num_clients=nodes))
    grid = LocalGrid(client_app, nodes, first_node_id=NODE_BASE)
    plan = strategy.plan_stage(0)[0]
    strategy.begin_round(plan)
    out = strategy.messages(grid, plan, 0, set())
    assert [m.metadata.message_type for m in grid.sent] == ["query.info"] * info
    assert sorted(m.metadata.dst_node_id for m in out) == list(range(NODE_BASE, NODE_BASE + nodes))
    assert {m.metadata.message_type for m in out} == {"query.stats"}
    assert len(strategy.nodes.client_of) == (nodes if info else 0)  # mapped by the discovery, or by the replies


def test_a_secure_stage_carries_the_evaluation_beside_its_masked_statistics(secure_runs) -> None:
    """Under secure aggregation the counts ride in clear beside the masked upload: one exchange
    fewer per stage (keys, shares, masked statistics, unmask; stage 2's keys came with stage 1's
    masked upload and its shares with stage 1's unmask step, strategies/secure.py), the same
    records and W."""
    (separate, grid_before, w_before), (riding, grid_after, w_after) = secure_runs
    secure = ["query.stats", "query.unmask"]
    first = ["query.keys", "query.shares", *secure]  # the key step is the first contact: no query.info
    assert exchanges_per_stage(grid_before) == {1: [*first, "evaluate"], 2: [*secure, "evaluate"]}
    assert exchanges_per_stage(grid_after) == {1: first, 2: [*secure, "evaluate"]}
    assert records(riding) == records(separate)
    assert all(s.extra["evaluation"]["left_out"] == {} for s in riding.recorder.stages)
    for a, b in zip(w_before, w_after, strict=True):
        assert np.array_equal(a.numpy(), b.numpy())


def test_a_resume_that_takes_the_opened_sum_scores_the_pending_stage_in_its_own_exchange(
    tmp_path, monkeypatch, secure_runs
) -> None:
    """The server dies right after opening stage 2's secure sum, whose round carried stage 1's
    evaluation. On resume nobody is asked for stage 2's statistics again, so stage 1's evaluation
    gets an ``evaluate`` exchange of its own, with stage 1's W: the records end the same."""
    from strategies.stsa import STSAStrategy

    cfg = config(tmp_path, "killed", secure_aggregation=True, num_tasks=2)
    whole = secure_runs[1][0]
    fold = STSAStrategy.fold_opened

    def die_at_stage_2(self, plan, *args):
        if plan.task == 1:
            raise RuntimeError("killed")
        return fold(self, plan, *args)

    monkeypatch.setattr(STSAStrategy, "fold_opened", die_at_stage_2)
    with pytest.raises(RuntimeError, match="killed"):
        run(cfg)
    monkeypatch.undo()
    resumed, grid, _ = run(cfg.replace(resume=True))
    assert exchanges_per_stage(grid) == {1: ["evaluate"], 2: ["evaluate"]}
    assert records(resumed) == records(whole)


def test_the_riding_request_and_counts_travel_and_a_malformed_request_is_refused(tmp_path) -> None:
    from fcl_flower.methods import Kind
    from fcl_flower.protocol import EvaluationRequest, ProtocolError, StatsIns, parse_instruction, parse_reply

    server_identity()
    cfg = config(tmp_path, "wire")
    header = Header("run", STATS, 1, 2, 3)
    ridge = to_record({"weights": np.ones((60, 4))})
    ins = StatsIns(header, cfg, num_seen=7, evaluate=EvaluationRequest(0, 4, ridge))
    message = ins.to_message(5)
    parsed = parse_instruction(message)
    assert isinstance(parsed, StatsIns) and parsed.evaluate is not None
    assert (parsed.evaluate.task, parsed.evaluate.num_seen) == (0, 4)
    assert np.array_equal(parsed.evaluate.ridge["weights"].numpy(), np.ones((60, 4)))
    assert parsed.evaluate.instruction(parsed).header.task == 0  # scored on stage 1's held-out data
    assert parse_instruction(StatsIns(header, cfg, num_seen=7).to_message(5)).evaluate is None

    counts = to_record({"correct": np.array([1, 2, 0, 3]), "total": np.array([2, 2, 1, 3])})
    reply = StatsRes(header, 1, 10, evaluation=EvaluateRes(header, 1, 8, counts=counts)).reply_to(message)
    read = parse_reply(reply, header, Kind.STATS)
    assert isinstance(read, StatsRes) and read.evaluation is not None and read.evaluation.num_examples == 8
    assert read.evaluation.counts["total"].numpy().tolist() == [2, 2, 1, 3]

    late = StatsIns(header, cfg, num_seen=7, evaluate=EvaluationRequest(1, 4)).to_message(5)
    with pytest.raises(ProtocolError, match="evaluate-task 1 is not a stage before this one"):
        parse_instruction(late)
    stray = StatsIns(header, cfg, num_seen=7).to_message(5)
    stray.content.array_records["ridge"] = ridge
    with pytest.raises(ProtocolError, match="without an evaluation request"):
        parse_instruction(stray)
