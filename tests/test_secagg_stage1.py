"""Stage 1 under secure aggregation (issue 31): the FedAvg uploads go through the secure rounds.

Attack: under ``secure-aggregation=true`` a stage-1 train reply used to carry the client's model
state in clear, so the server held every client's trained weights (and its sample count) although
the statistics of the same client were masked. Now every stage-1 round is a secure round: each
reply is the masked fixed-point vector of (n_k · w_k, n_k), the strategy reads ring elements only,
and opens the sum over the round's survivors; a plain train reply is refused by name.

What the tests assert:

* what the clients send and what the strategy reads, reply by reply, is uint64 ring elements only
  (no float array, no sample count, no loss in clear);
* the secure average equals the clear FedAvg average within the quantisation bound
  |Δ| ≤ P · 2^-(f+1) / N (P survivors, N their examples, f = secagg-fraction-bits) plus one float32
  rounding of the loaded weights, and the run's accuracy stays within a small tolerance of the plain
  run's (not equal: the rounding changes the later rounds' starting point);
* a plain train reply (a clear state, with or without the masked upload's record) is refused with
  its reason, and the round opens over the others;
* a node pinned to secure aggregation refuses a plain stage-1 round;
* a stage-1 round's ledger entry cannot collide with an analytic stage's, and a round opened once
  is never contributed again over another set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Message

from clients.app import app as client_app
from clients.ledger import Ledger
from fcl_flower.local_grid import LocalGrid
from fcl_flower.models import trainable_state
from fcl_flower.privacy.secagg import SecureAggregationError
from fcl_flower.tensors import tensor_record
from tests.conftest import NODE_BASE, build, in_process_grid, reply_partition, server_identity, small_config

SETTINGS = dict(num_tasks=1, num_clients=3, rf_dim=60, seed=0, stage1_rounds=2)


def run_spied(cfg, tamper=None) -> tuple[Any, list[Any], list[dict[str, torch.Tensor]], list[Message]]:
    """Run ``cfg``; returns (strategy, what read_reply returned for every stage-1 reply, the global
    state after every stage-1 round, the stage-1 replies as delivered)."""
    server_identity()
    strategy = build(cfg)
    reads: list[Any] = []
    states: list[dict[str, torch.Tensor]] = []
    delivered: list[Message] = []
    read_reply, aggregate_train = strategy.read_reply, strategy.aggregate_train

    def spy_read(plan, reply):
        payload = read_reply(plan, reply)
        if plan.phase == "fedavg":
            reads.append(payload)
        return payload

    def spy_aggregate(server_round, replies):
        out = aggregate_train(server_round, replies)
        if strategy._require_plan().phase == "fedavg":
            states.append(trainable_state(strategy.model))
        return out

    def hook(task, phase, replies):
        replies = tamper(task, phase, replies) if tamper is not None else replies
        if phase == "fedavg":
            delivered.extend(replies)
        return replies

    strategy.read_reply = spy_read
    strategy.aggregate_train = spy_aggregate
    strategy.start(in_process_grid(cfg.num_clients, hook))
    return strategy, reads, states, delivered


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return run_spied(small_config(Path(tmp_path_factory.mktemp("plain")), **SETTINGS))


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    return run_spied(small_config(Path(tmp_path_factory.mktemp("secure")), **SETTINGS, secure_aggregation=True))


def test_the_server_never_holds_one_clients_stage1_upload(secure) -> None:
    strategy, reads, _, delivered = secure
    assert len(delivered) == 2 * 3 and len(reads) >= 2 * 3  # screened, then summed: read twice
    for message in delivered:
        arrays = message.content.array_records["arrays"]
        assert set(arrays) == {"weights", "count"}
        assert {a.numpy().dtype for a in arrays.values()} == {np.dtype(np.uint64)}
        metrics = message.content.metric_records["metrics"]
        assert metrics["num-examples"] == 0 and metrics["train-loss"] == 0.0  # nothing per client in clear
        assert "train-seconds" not in metrics  # nor the training time, which grows with the sample count
    for payload in reads:  # what the strategy reads of one reply: ring elements, never a model state
        assert set(payload) == {"weights", "count"}
        assert all(isinstance(v, np.ndarray) and v.dtype == np.uint64 for v in payload.values())
    assert strategy.recorder.stages[0].clients == ["client-0", "client-1", "client-2"]


def test_the_secure_average_equals_the_clear_one_within_the_quantisation_bound(plain, secure) -> None:
    """Round 1 starts from the same global model on both sides, so the clients' trained states are
    the same: the two averages differ only by the fixed-point rounding (and one float32 cast)."""
    secure_strategy, _, secure_states, _ = secure
    _, _, plain_states, _ = plain
    f = secure_strategy.cfg.secagg_fraction_bits
    opened = secure_strategy.masked_fedavg.opened_examples  # N of the last round (every round: all clients)
    assert opened > 0
    bound = 3 * 2.0 ** -(f + 1) / opened
    for key, clear in plain_states[0].items():
        got = secure_states[0][key]
        assert got.dtype == clear.dtype and got.shape == clear.shape
        if clear.is_floating_point():
            ulp = torch.finfo(clear.dtype).eps * clear.abs().to(torch.float64)
            diff = (got.to(torch.float64) - clear.to(torch.float64)).abs()
            assert bool((diff <= bound + ulp).all()), key
        else:  # counters (num_batches_tracked): the rounded weighted mean, the clear FedAvg's max at most
            assert bool((got <= clear).all())
    plain_accuracy = plain[0].recorder.stages[0].accuracy
    assert abs(secure_strategy.recorder.stages[0].accuracy - plain_accuracy) <= 1.0


def plain_reply(keep_record: bool):
    """A tamper hook: client 1 sends a plain (clear) model state instead of its masked upload."""
    state = trainable_state(build(small_config(Path("unused"), **SETTINGS)).model)

    def tamper(task, phase, replies):
        if phase != "fedavg":
            return replies
        for m in replies:
            if not m.has_error() and reply_partition(m) == 1:
                m.content.array_records["arrays"] = tensor_record(state)
                if not keep_record:
                    del m.content.config_records["secagg"]
        return replies

    return tamper


@pytest.mark.parametrize("keep_record", [True, False], ids=["state-in-masked-reply", "plain-reply"])
def test_a_plain_train_reply_is_refused_under_secure_aggregation(tmp_path, keep_record) -> None:
    cfg = small_config(tmp_path, **{**SETTINGS, "stage1_rounds": 1}, secure_aggregation=True)
    strategy, reads, _, _ = run_spied(cfg, plain_reply(keep_record))
    stage = strategy.recorder.stages[0]
    why = strategy.accounting.rejected["client-1"]  # rejected in the FedAvg round (it joins the stats round)
    assert "masked" in why or "secagg" in why
    assert all(set(p) == {"weights", "count"} for p in reads)  # the plain state is never read
    assert "failed" not in stage.extra
    assert strategy.masked_fedavg.opened_examples > 0  # the round opened over clients 0 and 2


def test_a_node_pinned_to_secure_aggregation_refuses_a_plain_stage1_round(tmp_path) -> None:
    grid = LocalGrid(client_app, 3, first_node_id=NODE_BASE)
    for context in grid.contexts.values():
        context.node_config["secure-aggregation"] = True
    server_identity()
    strategy = build(small_config(tmp_path, **{**SETTINGS, "stage1_rounds": 1}))
    strategy.start(grid)
    refusals = [r.error.reason for r in grid.replies if r.has_error() and r.metadata.message_type == "train"]
    assert len(refusals) == 3 and all("only inside a secure round" in e for e in refusals)


def test_stage1_rounds_have_their_own_ledger_entries(tmp_path) -> None:
    from clients.ledger import train_ledger_key

    ledger = Ledger(tmp_path, "federation", 7)
    ledger.record("run", [0], [1, 2, 3])
    ledger.record("run", [train_ledger_key(1)], [1, 2])  # never the key of an analytic stage
    ledger.record("run", [train_ledger_key(2)], [2, 3])
    ledger.record("run", [train_ledger_key(2)], [2, 3])  # the identical set again: nothing new is learnt
    with pytest.raises(SecureAggregationError, match=r"stage-1 FedAvg round 2 was already opened over nodes \[2, 3\]"):
        ledger.record("run", [train_ledger_key(2)], [1, 2, 3])
    with pytest.raises(SecureAggregationError, match=r"stage 1 was already opened"):
        ledger.record("run", [0], [1, 2])
    assert ledger.contributed("run", 0) == [1, 2, 3]


def test_a_train_round_with_a_masked_count_in_clear_is_refused(tmp_path) -> None:
    """A masked reply must not report its examples in clear (num-examples 0, as for statistics)."""

    def leak(task, phase, replies):
        if phase == "fedavg":
            for m in replies:
                if not m.has_error() and reply_partition(m) == 2:
                    m.content.metric_records["metrics"]["num-examples"] = 123
        return replies

    cfg = small_config(tmp_path, **{**SETTINGS, "stage1_rounds": 1}, secure_aggregation=True)
    strategy, _, _, _ = run_spied(cfg, leak)
    assert "num-examples" in strategy.accounting.rejected["client-2"]


def test_the_fixed_point_average_stays_within_the_stated_bound_and_impossible_counts_are_refused() -> None:
    from fcl_flower.privacy.secagg import decode_fixed_point, encode_fixed_point
    from fcl_flower.privacy.secure_fedavg import (
        COUNT,
        WEIGHTS,
        OpenedSumRejected,
        flatten_state,
        opened_average,
        quantisation_bound,
        upload_vector,
    )

    gen = torch.Generator().manual_seed(0)
    like = {"w": torch.zeros(3, 4), "b": torch.zeros(5), "tracked": torch.zeros((), dtype=torch.long)}
    states = [
        {"w": 99 * torch.rand(3, 4, generator=gen), "b": -50 * torch.rand(5, generator=gen), "tracked": torch.tensor(7)}
        for _ in range(3)
    ]
    counts, f = [13, 250, 1], 24
    vectors = [upload_vector(s, c, weighted=True) for s, c in zip(states, counts, strict=True)]
    opened = {
        name: decode_fixed_point(np.stack([encode_fixed_point(v[name], f, 3) for v in vectors]).sum(axis=0), f)
        for name in (WEIGHTS, COUNT)
    }
    state, examples = opened_average(opened, 3, True, like)
    assert examples == 264 and state is not None
    clear = sum(c * flatten_state(s) for s, c in zip(states, counts, strict=True)) / 264
    got = flatten_state(state)
    ulp = np.finfo(np.float32).eps * np.abs(clear)
    assert np.all(np.abs(got - clear)[:-1] <= quantisation_bound(3, 264, f) + ulp[:-1])
    assert int(state["tracked"]) == 7
    with pytest.raises(OpenedSumRejected, match="not a non-negative integer"):
        opened_average({**opened, COUNT: np.array([264.5])}, 3, True, like)
    with pytest.raises(OpenedSumRejected, match="not the 3 survivors"):
        opened_average({**opened, COUNT: np.array([2.0])}, 3, False, like)
    assert opened_average({WEIGHTS: np.zeros(18), COUNT: np.zeros(1)}, 3, True, like) == (None, 0)


def test_a_stage1_round_rerun_over_another_set_is_refused_in_signed_mode(tmp_path) -> None:
    """Signed-keys mode: a second run (a new run id, a "resume" after a claimed crash) repeats stage
    1's first FedAvg round without the victim. The others train the very same weights from the same
    seeded model, so that sum less the first would be the victim's n · w: their ledgers know each
    upload by its digest, and every survivor refuses to reveal; the round is never opened."""
    from tests.test_secagg_malicious import run_on, signed_grid

    grid = signed_grid(tmp_path, LocalGrid(client_app, 5, first_node_id=NODE_BASE))
    settings = {**SETTINGS, "num_clients": 5, "stage1_rounds": 1}
    cfg = small_config(tmp_path / "a", **settings, secure_aggregation=True, secagg_signed_keys=True)
    assert run_on(grid, cfg).masked_fedavg.opened_examples > 0
    grid.replies.clear()
    grid.unavailable.add(NODE_BASE + 1)
    again = run_on(grid, small_config(tmp_path / "b", **settings, secure_aggregation=True, secagg_signed_keys=True))
    refusals = [r.error.reason for r in grid.replies if r.has_error() and r.metadata.message_type == "query.unmask"]
    assert len(refusals) == 4
    assert all("the upload of stage-1 FedAvg round 1 was already opened over nodes" in e for e in refusals)
    assert again.masked_fedavg.opened_examples == 0  # the model was left as it was


def test_a_stage1_round_that_cannot_open_leaves_the_model_as_it_was(tmp_path) -> None:
    """Two valid masked uploads where three are needed (secagg-min-clients=3): nothing is opened,
    the round leaves the global model as it was (as a plain round without replies does), and the
    stage goes on to its statistics round."""

    def lose(task, phase, replies):
        return [m for m in replies if m.has_error() or reply_partition(m) != 1] if phase == "fedavg" else replies

    cfg = small_config(tmp_path, **{**SETTINGS, "stage1_rounds": 1}, secure_aggregation=True, secagg_min_clients=3)
    initial = trainable_state(build(cfg).model)
    strategy, _reads, states, _ = run_spied(cfg, lose)
    assert states == []  # aggregate_train raised: no state after the round
    after = trainable_state(strategy.model)
    assert all(torch.equal(after[k], initial[k]) for k in initial)
    assert strategy.masked_fedavg.opened_examples == 0
    stage = strategy.recorder.stages[0]
    assert "failed" not in stage.extra and stage.clients == ["client-0", "client-1", "client-2"]


@pytest.mark.parametrize("lie", ["self-dropped", "no-signatures"])
def test_a_server_that_lies_in_a_stage1_unmask_request_is_refused(tmp_path, lie: str) -> None:
    """The stage-1 FedAvg rounds go through the same unmask checks as the statistics rounds: a
    server that asks node 0 to reveal as though node 0 had dropped, or that sends an unmask request
    without the survivors' view signatures (signed keys), is refused in the FedAvg round too."""
    from tests.test_secagg_malicious import SETTINGS as MALICIOUS
    from tests.test_secagg_malicious import NoSignaturesGrid, SelfDroppedGrid, run_on, signed_grid

    settings = {**MALICIOUS, "num_tasks": 1, "stage1_rounds": 1}
    if lie == "self-dropped":
        grid = SelfDroppedGrid(client_app, 5, first_node_id=NODE_BASE)
        run_on(grid, small_config(tmp_path, **settings))
        refused = [
            r for r in grid.replies if r.has_error() and "lists this node itself as dropped: refused" in r.error.reason
        ]
        assert {r.metadata.src_node_id for r in refused} == {NODE_BASE}
        assert len(refused) == 2  # the FedAvg round's unmask and the statistics round's
    else:
        grid = signed_grid(tmp_path, NoSignaturesGrid(client_app, 5, first_node_id=NODE_BASE))
        strategy = run_on(grid, small_config(tmp_path / "run", **settings, secagg_signed_keys=True))
        refusals = [r.error.reason for r in grid.replies if r.has_error() and r.metadata.message_type == "query.unmask"]
        assert len(refusals) == 10  # every node, in both rounds
        assert all("the unmask request carries no signature of survivor" in e for e in refusals)
        assert strategy.masked_fedavg.opened_examples == 0  # the FedAvg round never opened
