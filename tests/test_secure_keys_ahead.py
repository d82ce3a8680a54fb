"""Keys and shares ahead: a secure round's key step rides with the previous secure round's masked
upload and its shares step with that round's unmask step (strategies/secure.py), so every secure
round after a run's first is two exchanges (the masked upload, unmask) instead of four, with the
same W and accuracies; with shares ahead off, keys ahead alone make it three (shares, the masked
upload, unmask). The keys stay fresh per round and bound to its context; a node asked that sent
none is not in U1; a restarted attempt, a node not asked and a resume exchange the key step as
before."""

from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message

from clients.app import app as client_app
from fcl_flower.local_grid import LocalGrid
from fcl_flower.methods import Kind
from fcl_flower.privacy.secagg import SecureAggregationError, load_trusted_keys, round_context, verify_keys
from fcl_flower.protocol import (
    DealtShares,
    Header,
    MaskedReport,
    ProtocolError,
    PublicKeys,
    UnmaskIns,
    UnmaskRes,
    parse_instruction,
    parse_reply,
)
from strategies import loop
from tests.conftest import (
    NODE_BASE,
    build,
    garbage_entries,
    record_stage_weights,
    reply_partition,
    sent_header,
    server_identity,
    small_config,
    tamper_secagg_entries,
    unmask_reply_without,
)
from tests.test_protocol import CFG, _deliver
from tests.test_trust_boundaries import write_signing_keys

SETTINGS = dict(num_clients=5, rf_dim=60, seed=0, secure_aggregation=True, first_task_classes=4)
SECURE_ROUND = ["query.stats", "query.unmask"]  # shares ahead: the masked upload and unmask
KEYS_AHEAD_ROUND = ["query.shares", *SECURE_ROUND]  # keys ahead alone


def run(cfg, grid: LocalGrid | None = None, *, ahead: bool = True, shares: bool = True, tamper=None):
    """(strategy, grid, W after each stage); ``ahead`` False: every secure round exchanges its key
    step; ``shares`` False: keys ahead only (every secure round exchanges its shares step)."""
    server_identity()
    strategy = build(cfg)
    if not ahead:
        strategy.next_secure_round = lambda plan: None  # type: ignore[method-assign]
    strategy.secure.shares_ahead = shares
    weights = record_stage_weights(strategy)
    if grid is None:
        grid = LocalGrid(client_app, cfg.num_clients, first_node_id=NODE_BASE)
    if tamper is not None:
        grid.tamper = by_header(tamper)
    strategy.start(grid)
    return strategy, grid, weights


def by_header(tamper):
    def hook(sent, replies):
        header = sent_header(sent[0])
        return tamper(header.task, header.phase, replies)

    return hook


def per_node(grid: LocalGrid) -> dict[int, dict[int, list[str]]]:
    """Stage -> node -> the message types pushed to it, in order (one message: one exchange)."""
    out: dict[int, dict[int, list[str]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for m in grid.sent:
        out[sent_header(m).stage][m.metadata.dst_node_id].append(m.metadata.message_type)
    return {stage: dict(nodes) for stage, nodes in out.items()}


def results(strategy) -> list[tuple[float, list[float]]]:
    return [(s.accuracy, s.per_task_accuracy) for s in strategy.recorder.stages]


@pytest.fixture(scope="module")
def fedavg_runs(tmp_path_factory):
    """Stage 1 with two secure FedAvg rounds, then two analytic stages: shares ahead, keys ahead
    only, and neither."""
    tmp = tmp_path_factory.mktemp("ahead")
    cfg = small_config(tmp, **SETTINGS, num_tasks=3, stage1_rounds=2, local_epochs=1, run_name="ahead")
    return (
        run(cfg),
        run(cfg.replace(run_name="exchanged"), ahead=False),
        run(cfg.replace(run_name="keys"), shares=False),
    )


def test_two_exchanges_per_secure_round_after_the_first_with_the_same_results(fedavg_runs) -> None:
    (ahead, grid, w_ahead), (exchanged, grid_before, w_before), (keys, grid_keys, w_keys) = fedavg_runs
    nodes = range(NODE_BASE, NODE_BASE + 5)
    after, before, keys_only = per_node(grid), per_node(grid_before), per_node(grid_keys)
    # stage 1: two secure FedAvg rounds (``train`` is the masked upload), then its statistics round
    for node in nodes:
        assert after[1][node] == [
            "query.keys",  # the run's first secure round exchanges its key step (first contact too) ...
            "query.shares",  # ... and its shares step
            "train",  # carries the keys of FedAvg round 2 ...
            "query.unmask",  # ... and this its shares
            "train",  # FedAvg round 2 starts at its masked upload
            "query.unmask",
            *SECURE_ROUND,  # stage 1's statistics round
        ]
        assert keys_only[1][node] == [
            "query.keys",
            "query.shares",
            "train",
            "query.unmask",  # carries the keys of FedAvg round 2
            "query.shares",
            "train",
            "query.unmask",
            *KEYS_AHEAD_ROUND,
        ]
        for stage in (2, 3):
            assert after[stage][node] == SECURE_ROUND  # two exchanges per analytic stage
            assert keys_only[stage][node] == KEYS_AHEAD_ROUND  # three with keys ahead alone
            assert before[stage][node] == ["query.keys", *KEYS_AHEAD_ROUND]  # four without either
        assert (len(after[1][node]), len(keys_only[1][node]), len(before[1][node])) == (8, 10, 12)
    assert results(ahead) == results(exchanged) == results(keys)
    assert all(not np.isnan(s.accuracy) and "failed" not in s.extra for s in ahead.recorder.stages)
    for a, b, c in zip(w_ahead, w_before, w_keys, strict=True):
        assert np.array_equal(a.numpy(), b.numpy()) and np.array_equal(a.numpy(), c.numpy())
    for (name, a), b in zip(ahead.model.state_dict().items(), exchanged.model.state_dict().values(), strict=True):
        assert np.array_equal(a.numpy(), b.numpy()), name  # the stage-1 FedAvg backbone too
    assert ahead.recorder.stages[1].clients == [f"client-{c}" for c in range(5)]
    assert not [r for r in grid.replies if r.has_error()]


def test_shares_ahead_are_the_next_round_s_keys_and_bundles_bound_to_it(fedavg_runs) -> None:
    """Every masked upload but the last round's names the next round's key step; every reply
    carries fresh keys for it; the unmask step relays exactly those keys as the next round's U1;
    every survivor's unmask reply deals one bundle per U1 node, and those very bundles and
    commitments are what the next round's masked upload relays to each node."""
    _, grid, _ = fedavg_runs[0]
    uploads = [m for m in grid.sent if m.metadata.message_type in ("train", "query.stats")]
    named = [parse_instruction(m).secagg.prepare for m in uploads]
    assert named.count(None) == 5  # the last round's, one per node
    upload_keys: dict[tuple[int, int], PublicKeys] = {}
    for reply in grid.replies:
        if reply.metadata.message_type not in ("train", "query.stats"):
            continue
        report = MaskedReport.from_entries(reply.content.config_records["secagg"])
        header = Header.from_record(reply.content.config_records["header"])
        if report.next_keys is not None:
            upload_keys[header.server_round, reply.metadata.src_node_id] = report.next_keys
    assert len({k.c for k in upload_keys.values()} | {k.s for k in upload_keys.values()}) == 2 * 5 * 4
    dealt: dict[tuple[int, int], DealtShares] = {}
    for m in grid.sent:
        if m.metadata.message_type != "query.unmask":
            continue
        ins = parse_instruction(m)
        assert (ins.ahead is not None and ins.prepare is not None) or ins.prepare is None
        if ins.ahead is not None:
            assert ins.ahead.keys == {n: upload_keys[ins.header.server_round, n] for n in ins.ahead.keys}
    for reply in grid.replies:
        if reply.metadata.message_type == "query.unmask":
            header = Header.from_record(reply.content.config_records["header"])
            parsed = parse_reply(reply, header, Kind.UNMASK)
            assert parsed.next_keys is None
            if parsed.next_shares is not None:
                dealt[header.server_round, reply.metadata.src_node_id] = parsed.next_shares
    assert len(dealt) == 5 * 4
    for m in uploads:
        ins = parse_instruction(m)
        previous = [r for (r, _) in dealt if r < ins.header.server_round]
        if not previous:
            continue  # the run's first secure round: dealt in its own shares step
        last, node = max(previous), m.metadata.dst_node_id
        assert ins.secagg.shares == {src: dealt[last, src].shares[node] for (r, src) in dealt if r == last}
        assert ins.secagg.commitments == {src: dealt[last, src].commitments[node] for (r, src) in dealt if r == last}


def test_keys_ahead_are_fresh_and_bound_to_the_round_they_are_for(fedavg_runs) -> None:
    """Shares ahead off: every unmask instruction but the last names the next round's key step
    (attempt 0, a later round), every survivor answers with two public keys of its own, and those
    are the very keys relayed in that round's shares step: new ones every round."""
    _, grid, _ = fedavg_runs[2]
    unmasks = [parse_instruction(m) for m in grid.sent if m.metadata.message_type == "query.unmask"]
    shares = {}
    for m in grid.sent:
        if m.metadata.message_type == "query.shares":
            ins = parse_instruction(m)
            shares[ins.header.server_round] = ins.keys
    assert [ins.prepare is None for ins in unmasks].count(True) == 5  # the last round's, one per node
    seen: set[bytes] = set()
    replies = [r for r in grid.replies if r.metadata.message_type == "query.unmask"]
    for reply in replies:
        header = Header.from_record(reply.content.config_records["header"])
        parsed = parse_reply(reply, header, Kind.UNMASK)
        assert isinstance(parsed, UnmaskRes)
        if parsed.next_keys is None:
            continue
        (prepare,) = {ins.prepare for ins in unmasks if ins.header == header}
        assert prepare is not None and prepare.attempt == 0 and prepare.server_round == header.server_round + 1
        assert shares[prepare.server_round][reply.metadata.src_node_id] == parsed.next_keys
        assert parsed.next_keys.c not in seen and parsed.next_keys.s not in seen
        seen |= {parsed.next_keys.c, parsed.next_keys.s}
    assert len(seen) == 2 * 5 * 4  # five nodes, four rounds with keys ahead


def signed_grid(tmp: Path) -> LocalGrid:
    grid = LocalGrid(client_app, 5, first_node_id=NODE_BASE)
    for node, extra in write_signing_keys(tmp / "keys", list(grid.contexts)).items():
        grid.contexts[node].node_config.update(extra)
    return grid


def test_signed_keys_ahead_are_signed_over_the_round_they_are_for(tmp_path) -> None:
    cfg = small_config(tmp_path / "signed", **SETTINGS, num_tasks=2, secagg_signed_keys=True)
    strategy, grid, weights = run(cfg, signed_grid(tmp_path))
    assert not [r for r in grid.replies if r.has_error()]
    assert per_node(grid)[2][NODE_BASE] == SECURE_ROUND
    assert strategy.recorder.stages[1].clients == [f"client-{c}" for c in range(5)]
    trusted = grid.contexts[NODE_BASE].node_config["secagg-trusted-keys"]
    (upload,) = [
        r
        for r in grid.replies
        if r.metadata.message_type == "query.stats" and r.metadata.src_node_id == NODE_BASE + 2
        if Header.from_record(r.content.config_records["header"]).task == 0
    ]
    header = Header.from_record(upload.content.config_records["header"])
    keys = MaskedReport.from_entries(upload.content.config_records["secagg"]).next_keys
    assert keys is not None
    h = (header.run_id, 1, 2, header.server_round + 1)
    verify_keys(load_trusted_keys(trusted), keys.signer, keys.signature, keys.c, keys.s, round_context(*h, 0, ()))
    with pytest.raises(SecureAggregationError, match="does not verify"):  # bound to that round, no other
        verify_keys(load_trusted_keys(trusted), keys.signer, keys.signature, keys.c, keys.s, round_context(*h, 1, ()))
    plain, _, plain_weights = run(small_config(tmp_path / "plain", **SETTINGS, num_tasks=2))
    assert results(strategy) == results(plain)
    for a, b in zip(weights, plain_weights, strict=True):
        assert np.array_equal(a.numpy(), b.numpy())


def test_a_node_that_dealt_no_shares_ahead_is_not_in_the_next_round_and_back_after(tmp_path) -> None:
    """Client 2's stage-1 unmask reply is lost: stage 1 opens over the others' shares; stage 2
    starts at its masked upload without client 2 (asked, no shares: in U1, not in U2); stage 2's
    unmask step does not ask client 2 (not a survivor), so stage 3 exchanges its key step and
    client 2 is back."""

    def lose_unmask(task, phase, replies):
        if task == 0 and phase == "secagg-unmask":
            return [m for m in replies if m.has_error() or reply_partition(m) != 2]
        return replies

    cfg = small_config(tmp_path, **SETTINGS, num_tasks=3)
    strategy, grid, _ = run(cfg, tamper=lose_unmask)
    first, second, third = strategy.recorder.stages
    assert "failed" not in first.extra and "client-2" in first.clients
    assert "failed" not in second.extra and "client-2" not in second.clients
    assert NODE_BASE + 2 not in per_node(grid)[2]
    stats = parse_instruction(next(m for m in grid.sent if sent_header(m).stage == 2))
    assert NODE_BASE + 2 in stats.secagg.round_nodes and NODE_BASE + 2 not in stats.secagg.participants
    assert (
        strategy.recorder.stages[1].left_out["client-2"] == "dealt no shares for this round with its last unmask reply"
    )
    assert per_node(grid)[2][NODE_BASE] == SECURE_ROUND
    assert per_node(grid)[3][NODE_BASE] == ["query.keys", *KEYS_AHEAD_ROUND]
    assert "failed" not in third.extra and "client-2" in third.clients


def test_a_restarted_attempt_exchanges_fresh_keys_and_a_barred_dealer_s_keys_ahead_are_dropped(tmp_path) -> None:
    """Client 2 deals garbage bundles for stage 2 ahead (with its stage-1 unmask reply): the
    attempt is restarted without it, with key and shares steps of its own (attempt 1); stage 3
    takes shares ahead, without client 2."""

    garbage = tamper_secagg_entries("secagg-unmask", 2, "next-shares", garbage_entries)
    cfg = small_config(tmp_path, **SETTINGS, num_tasks=3)
    strategy, grid, _ = run(cfg, tamper=garbage)
    _, second, third = strategy.recorder.stages
    assert per_node(grid)[2][NODE_BASE] == [
        "query.stats",  # accusations: client 2 is barred before anything is revealed
        "query.keys",  # attempt 1
        *KEYS_AHEAD_ROUND,
    ]
    attempts = {(sent_header(m).attempt, m.metadata.message_type) for m in grid.sent if sent_header(m).stage == 2}
    assert (1, "query.keys") in attempts and (0, "query.keys") not in attempts
    assert second.clients == third.clients == ["client-0", "client-1", "client-3", "client-4"]
    assert "barred" in third.left_out["client-2"] and "failed" not in third.extra
    assert per_node(grid)[3][NODE_BASE] == SECURE_ROUND
    assert NODE_BASE + 2 not in {m.metadata.dst_node_id for m in grid.sent if sent_header(m).stage == 3}


def test_a_resume_exchanges_the_key_step_and_ends_the_same(tmp_path, monkeypatch) -> None:
    """Keys ahead are never in the checkpoint: the first secure round after a resume exchanges its
    key step (the nodes' keys made for it are replaced), and the run ends as an uninterrupted one."""
    cfg = small_config(tmp_path, **SETTINGS, num_tasks=3)
    whole, _, whole_weights = run(cfg.replace(run_name="whole"))
    save = loop.save

    def save_then_crash(strategy, task):
        save(strategy, task)
        if task == 0:
            raise RuntimeError("server crash")

    monkeypatch.setattr(loop, "save", save_then_crash)
    grid = LocalGrid(client_app, 5, first_node_id=NODE_BASE)
    with pytest.raises(RuntimeError, match="server crash"):
        run(cfg, grid)
    monkeypatch.setattr(loop, "save", save)
    grid.sent.clear()
    resumed, grid, weights = run(cfg.replace(resume=True), grid)
    assert per_node(grid)[2][NODE_BASE] == ["query.keys", *KEYS_AHEAD_ROUND]
    assert per_node(grid)[3][NODE_BASE] == SECURE_ROUND
    assert results(resumed) == results(whole)
    assert np.array_equal(weights[-1].numpy(), whole_weights[-1].numpy())


def test_keys_nobody_asked_for_reject_the_unmask_reply(tmp_path) -> None:
    """The last secure round asks for no keys ahead: an unmask reply that carries some is refused
    (its shares are not used; the sum opens over the other survivors')."""

    def unasked(task, phase, replies):
        if task == 1 and phase == "secagg-unmask":
            for m in replies:
                if not m.has_error() and reply_partition(m) == 1:
                    m.content.config_records["secagg"].update(
                        {"next-c": b"c" * 32, "next-s": b"s" * 32, "next-signer": b"", "next-signature": b""}
                    )
        return replies

    strategy, _, _ = run(small_config(tmp_path, **SETTINGS, num_tasks=2), tamper=unasked)
    assert "failed" not in strategy.recorder.stages[1].extra
    assert strategy.accounting.rejected["client-1"] == "secure unmask round: keys that were not asked for"


# ------------------------------------------------------------------------------ the messages
HEADER = Header("run-a", "secagg-unmask", 1, 2, 7, 0)
NEXT = Header("run-a", "secagg-keys", 2, 3, 8, 0)


def unmask_message(**prepare_entries) -> Message:
    message = _deliver(UnmaskIns(HEADER, CFG, survivors=(1, 2, 3), prepare=NEXT))
    message.content.config_records["round"].update(prepare_entries)
    return message


def test_an_unmask_instruction_carries_the_next_key_step_and_a_bad_one_is_refused() -> None:
    parsed = parse_instruction(unmask_message())
    assert isinstance(parsed, UnmaskIns) and parsed.prepare == NEXT
    plain = parse_instruction(dataclasses.replace(parsed, prepare=None).to_message(1))
    assert isinstance(plain, UnmaskIns) and plain.prepare is None
    for entries, error in [
        ({"prepare-run-id": "run-b"}, "keys asked for run 'run-b', this is 'run-a'"),
        ({"prepare-round": 7}, "keys asked for round 7 of stage 3, not after this round 7 of stage 2"),
        ({"prepare-task": 0, "prepare-stage": 1}, "not after this round 7 of stage 2"),
        ({"prepare-attempt": 1}, "keys asked for a retry or a stage that is not its task's"),
        ({"prepare-stage": 5}, "keys asked for a retry or a stage that is not its task's"),
        ({"prepare-round": "8"}, "header round is '8', expected a non-negative integer"),
        ({"prepare-extra": 1}, "unexpected round entries: prepare-extra"),
    ]:
        with pytest.raises(ProtocolError, match=re.escape(error)):
            parse_instruction(unmask_message(**entries))
    message = unmask_message()
    del message.content.config_records["round"]["prepare-phase"]
    with pytest.raises(ProtocolError, match=r"^unmask instruction: the next round's key step is named only in part$"):
        parse_instruction(message)


def test_an_unmask_reply_carries_the_next_keys_whole_or_not_at_all() -> None:
    keys = PublicKeys(b"c" * 32, b"s" * 32, b"signer", b"signature")
    reply = UnmaskRes(HEADER, 1, 0, seed_shares={2: b"x"}, next_keys=keys)
    message = unmask_reply_without(
        reply,
        HEADER,
        _deliver(UnmaskIns(HEADER, CFG)),
        "next-signature",
        r"^unmask reply: the next round's keys only in part$",
    )
    message.content.config_records["secagg"]["next-signature"] = "text"
    with pytest.raises(ProtocolError, match=r"^unmask reply: the next round's keys and signature must be bytes$"):
        parse_reply(message, HEADER, Kind.UNMASK)


def test_under_require_all_clients_a_missing_key_ahead_asks_every_node_again(tmp_path) -> None:
    """With ``require-all-clients`` a round without one client's keys would fail: its key step is
    exchanged instead, and every client is in."""

    def lose_unmask(task, phase, replies):
        if task == 0 and phase == "secagg-unmask":
            return [m for m in replies if m.has_error() or reply_partition(m) != 2]
        return replies

    cfg = small_config(tmp_path, **SETTINGS, num_tasks=2, require_all_clients=True)
    strategy, grid, _ = run(cfg, tamper=lose_unmask)
    assert per_node(grid)[2][NODE_BASE + 2] == ["query.keys", *KEYS_AHEAD_ROUND]
    assert strategy.recorder.stages[1].clients == [f"client-{c}" for c in range(5)]


@pytest.mark.parametrize(
    ("changes", "task", "after"),
    [
        ({}, 0, 1),  # the next stage's statistics round, one server round later
        ({"evaluation": "federated"}, 0, 1),  # stage 1's evaluation rides with it
        ({"evaluation": "both"}, 0, 2),  # stage 1 is scored in an exchange of its own first
        ({"forget": "1"}, 0, None),  # a forget round comes between: no guess
        ({}, 2, None),  # the last stage
    ],
)
def test_the_next_secure_round_is_named_by_its_key_step_header(tmp_path, changes, task, after) -> None:
    from strategies.secure import following_secure_round

    cfg = small_config(tmp_path, rf_dim=60, num_tasks=3, first_task_classes=4, **changes)
    strategy = build(cfg)
    strategy.server_round = 7
    plan = strategy.plan_stage(task)[-1]
    header = following_secure_round(strategy, plan, (strategy.stats_phase,))
    if after is None:
        assert header is None
        return
    assert header == Header(strategy.run_id, strategy.stats_phase, task + 1, task + 2, 7 + after, 0)
