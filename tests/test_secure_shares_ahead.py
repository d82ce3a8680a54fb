"""Shares ahead (strategies/secure.py): the fallbacks to keys ahead or a full key step, a server that
deviates from what it dealt over, and the messages that carry the next round's keys and shares.

The exchange counts and the equality of W, backbone and accuracies with the feature off are in
tests/test_secure_keys_ahead.py (it runs shares ahead, keys ahead alone and neither)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from flwr.app import Message

from clients.app import app as client_app
from fcl_flower.local_grid import LocalGrid
from fcl_flower.methods import Kind
from fcl_flower.privacy.secagg import threshold_for
from fcl_flower.protocol import (
    DealtShares,
    Header,
    MaskedReport,
    ProtocolError,
    PublicKeys,
    SecAggRound,
    SharesAhead,
    SharesIns,
    StatsIns,
    UnmaskIns,
    UnmaskRes,
    parse_instruction,
    parse_reply,
)
from tests.conftest import (
    NODE_BASE,
    reply_partition,
    sent_header,
    small_config,
    tamper_secagg_entries,
    unmask_reply_without,
    zeroed_entries,
)
from tests.test_protocol import CFG, _deliver
from tests.test_secure_keys_ahead import KEYS_AHEAD_ROUND, SECURE_ROUND, SETTINGS, per_node, run, signed_grid

NEXT_ENTRIES = ("next-c", "next-s", "next-signer", "next-signature")


def errors(grid: LocalGrid, kind: str) -> list[str]:
    return [r.error.reason for r in grid.replies if r.has_error() and r.metadata.message_type == kind]


# ------------------------------------------------------------------------------ fallbacks
def test_fewer_keys_than_secagg_min_clients_with_the_uploads_fall_back_to_keys_ahead(tmp_path) -> None:
    """Four of stage 1's five masked uploads arrive without the next round's keys: one key is
    fewer than ``secagg-min-clients``, so stage 1's unmask step asks for keys ahead instead (no
    shares are dealt), stage 2 exchanges its shares step with every client, and stage 3 is two
    exchanges again."""

    def strip_keys(task, phase, replies):
        if task == 0 and not phase.startswith("secagg-"):
            for m in replies:
                if not m.has_error() and reply_partition(m) != 0 and "secagg" in m.content.config_records:
                    record = m.content.config_records["secagg"]
                    for name in NEXT_ENTRIES:
                        del record[name]
        return replies

    strategy, grid, _ = run(small_config(tmp_path, **SETTINGS, num_tasks=3), tamper=strip_keys)
    unmasks = [parse_instruction(m) for m in grid.sent if m.metadata.message_type == "query.unmask"]
    first = [ins for ins in unmasks if ins.header.task == 0]
    assert all(ins.ahead is None and ins.prepare is not None for ins in first)
    for node in range(NODE_BASE, NODE_BASE + 5):
        assert per_node(grid)[2][node] == KEYS_AHEAD_ROUND
        assert per_node(grid)[3][node] == SECURE_ROUND
    assert all("failed" not in s.extra for s in strategy.recorder.stages)
    assert strategy.recorder.stages[1].clients == [f"client-{c}" for c in range(5)]


def test_a_dealer_barred_at_the_unmask_step_makes_the_next_round_exchange_its_key_step(tmp_path) -> None:
    """Client 4 reveals zeroed shares in stage 1's unmask step, the one that also carried stage 2's
    shares step: it is barred there, after it was in stage 2's U1 and dealt for it. What was dealt
    ahead then does not serve (a barred node in U1): stage 2 exchanges fresh keys and shares without
    client 4, and stage 3 is two exchanges again."""

    zeroed = tamper_secagg_entries("secagg-unmask", 4, "seed-shares", zeroed_entries)
    strategy, grid, _ = run(small_config(tmp_path, **SETTINGS, num_tasks=3), tamper=zeroed)
    first, second, third = strategy.recorder.stages
    stage1_unmask = [parse_instruction(m) for m in grid.sent if sent_header(m).task == 0]
    assert any(isinstance(ins, UnmaskIns) and ins.ahead and NODE_BASE + 4 in ins.ahead.keys for ins in stage1_unmask)
    assert "failed" not in first.extra and "barred" in second.left_out["client-4"]
    assert per_node(grid)[2][NODE_BASE] == ["query.keys", *KEYS_AHEAD_ROUND]
    assert NODE_BASE + 4 not in per_node(grid)[2]
    assert per_node(grid)[3][NODE_BASE] == SECURE_ROUND
    assert second.clients == third.clients == ["client-0", "client-1", "client-2", "client-3"]


def test_signed_keys_ahead_that_do_not_verify_are_left_out_and_the_round_still_opens(tmp_path) -> None:
    """Signed-keys mode: client 2's keys ahead (with its stage-1 masked upload) carry a bad
    signature. Every node would refuse to deal over them, and so to answer the unmask step; the
    server checks the signature against the signer named and leaves client 2 out of stage 2's U1:
    stage 1 opens with client 2, stage 2 is two exchanges without it (asked, no shares)."""

    def bad_signature(task, phase, replies):
        if task == 0 and not phase.startswith("secagg-"):
            for m in replies:
                if not m.has_error() and reply_partition(m) == 2 and "secagg" in m.content.config_records:
                    m.content.config_records["secagg"]["next-signature"] = b"not a signature"
        return replies

    cfg = small_config(tmp_path, **SETTINGS, num_tasks=2, secagg_signed_keys=True)
    strategy, grid, _ = run(cfg, signed_grid(tmp_path), tamper=bad_signature)
    first, second = strategy.recorder.stages
    assert not errors(grid, "query.unmask")
    assert "failed" not in first.extra and "client-2" in first.clients
    aheads = [parse_instruction(m).ahead for m in grid.sent if m.metadata.message_type == "query.unmask"]
    asked = [ahead for ahead in aheads if ahead is not None]
    assert len(asked) == 5 and all(ahead == asked[0] for ahead in asked)  # one U1 for every survivor
    assert sorted(asked[0].keys) == [NODE_BASE + n for n in (0, 1, 3, 4)]
    (left,) = [
        r for r in grid.replies if r.metadata.message_type == "query.unmask" and r.metadata.src_node_id == NODE_BASE + 2
    ]
    parsed = parse_reply(left, Header.from_record(left.content.config_records["header"]), Kind.UNMASK)
    assert parsed.seed_shares and parsed.next_shares is None and parsed.next_keys is None  # reveals, deals nothing
    assert per_node(grid)[2][NODE_BASE] == SECURE_ROUND and NODE_BASE + 2 not in per_node(grid)[2]
    assert "failed" not in second.extra and "client-2" not in second.clients


def test_keys_nobody_asked_for_reject_the_masked_upload(tmp_path) -> None:
    """The last secure round's masked upload names no next key step: an upload that carries keys
    anyway is rejected (the sum opens over the other survivors')."""

    def unasked(task, phase, replies):
        if task == 1 and not phase.startswith("secagg-"):
            for m in replies:
                if not m.has_error() and reply_partition(m) == 1:
                    m.content.config_records["secagg"].update(dict.fromkeys(NEXT_ENTRIES, b"k" * 32))
        return replies

    strategy, _, _ = run(small_config(tmp_path, **SETTINGS, num_tasks=2), tamper=unasked)
    last = strategy.recorder.stages[1]
    assert "failed" not in last.extra and "client-1" not in last.clients
    assert "masked upload: keys that were not asked for" in strategy.accounting.rejected["client-1"]


# ------------------------------------------------------------------------------ a deviating server
class ChangedRoundGrid(LocalGrid):
    """A server whose stage-2 masked upload names a key round (U1) other than the one its stage-1
    unmask step had the nodes deal over: one node more."""

    def deliver(self, messages):
        out = []
        for m in messages:
            ins = parse_instruction(m) if m.metadata.message_type == "query.stats" else None
            if isinstance(ins, StatsIns) and ins.header.task == 1 and ins.secagg is not None:
                secagg = dataclasses.replace(ins.secagg, round_nodes=(*ins.secagg.round_nodes, NODE_BASE + 99))
                m = dataclasses.replace(ins, secagg=secagg).to_message(m.metadata.dst_node_id)
            out.append(m)
        return super().deliver(out)


def test_a_masked_upload_over_another_key_round_than_the_shares_dealt_ahead_is_refused(tmp_path) -> None:
    grid = ChangedRoundGrid(client_app, 5, first_node_id=NODE_BASE)
    strategy, grid, _ = run(small_config(tmp_path, **SETTINGS, num_tasks=2), grid)
    refusals = errors(grid, "query.stats")
    assert len(refusals) == 5
    assert all("the round's key-round participants changed since the shares round" in e for e in refusals)
    assert "failed" in strategy.recorder.stages[1].extra  # nothing opened


class WrongThresholdGrid(LocalGrid):
    """A server whose stage-1 unmask instruction asks the next round's shares for a threshold
    other than the one due for its U1."""

    def deliver(self, messages):
        out = []
        for m in messages:
            ins = parse_instruction(m) if m.metadata.message_type == "query.unmask" else None
            if isinstance(ins, UnmaskIns) and ins.header.task == 0 and ins.ahead is not None:
                ahead = dataclasses.replace(ins.ahead, threshold=ins.ahead.threshold + 1)
                m = dataclasses.replace(ins, ahead=ahead).to_message(m.metadata.dst_node_id)
            out.append(m)
        return super().deliver(out)


def test_a_bad_shares_step_ahead_is_refused_before_anything_is_revealed(tmp_path) -> None:
    """The shares step that rides with an unmask step is checked as a ``query.shares`` would be,
    before the node writes its ledger or reveals a share: every node refuses the whole unmask step,
    the server holds no share of stage 1 (it fails, nothing opened) and no ledger records it; stage
    2 then exchanges its key step and opens."""
    from clients.secure import node_ledger

    grid = WrongThresholdGrid(client_app, 5, first_node_id=NODE_BASE)
    strategy, grid, _ = run(small_config(tmp_path, **SETTINGS, num_tasks=2), grid)
    refusals = errors(grid, "query.unmask")
    assert len(refusals) == 5 and all(re.search(r"the server asks for threshold \d+; \d+ is due", e) for e in refusals)
    stage1 = [r for r in grid.replies if r.metadata.message_type == "query.unmask" and not r.has_error()]
    assert not [r for r in stage1 if Header.from_record(r.content.config_records["header"]).task == 0]
    first, second = strategy.recorder.stages
    assert "failed" in first.extra and "failed" not in second.extra
    for context in grid.contexts.values():
        ledger = node_ledger(context, False)
        assert ledger.contributed(strategy.run_id, 0) is None and ledger.contributed(strategy.run_id, 1) is not None
    assert per_node(grid)[2][NODE_BASE] == ["query.keys", *KEYS_AHEAD_ROUND]


class ReaskGrid(LocalGrid):
    """A server that, before stage 2's masked upload, asks every node again for stage 2's shares
    (dealt ahead with stage 1's unmask reply), over U1 without one other node."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reasked: list[Message] = []
        self.asked: set[int] = set()

    def deliver(self, messages):
        asks = []
        for m in messages:
            ins = parse_instruction(m) if m.metadata.message_type == "query.stats" else None
            dst = m.metadata.dst_node_id
            if not isinstance(ins, StatsIns) or ins.header.task != 1 or dst in self.asked:
                continue
            self.asked.add(dst)
            other = max(n for n in ins.secagg.participants if n != dst)
            keys = {n: k for n, k in ins.secagg.participants.items() if n != other}
            clients = {n: c for n, c in ins.secagg.clients.items() if n != other}
            header = dataclasses.replace(ins.header, phase="secagg-shares")
            threshold = threshold_for(len(keys), ins.config.secagg_min_clients, False)
            asks.append(SharesIns(header, ins.config, keys=keys, clients=clients, threshold=threshold).to_message(dst))
        if asks:
            self.reasked += super().deliver(asks)
        return super().deliver(messages)


def test_shares_asked_again_for_a_round_dealt_ahead_are_refused(tmp_path) -> None:
    """A node deals the shares of one set of keys once: asked again over another U1 (which would
    hand the server a second sharing of the same mask key and seed), every node refuses; the round
    then goes on over what was dealt ahead."""
    grid = ReaskGrid(client_app, 5, first_node_id=NODE_BASE)
    strategy, grid, _ = run(small_config(tmp_path, **SETTINGS, num_tasks=2), grid)
    assert len(grid.reasked) == 5
    for reply in grid.reasked:
        assert reply.has_error()
        assert re.search(
            r"this node already dealt its shares for this round over nodes \[.*\]; it does not deal "
            r"them again: refused",
            reply.error.reason,
        )
    assert "failed" not in strategy.recorder.stages[1].extra
    assert strategy.recorder.stages[1].clients == [f"client-{c}" for c in range(5)]


# ------------------------------------------------------------------------------ the messages
HEADER = Header("run-a", "stsa-stats", 1, 2, 7, 0)
NEXT = Header("run-a", "secagg-keys", 2, 3, 8, 0)
KEYS = {n: PublicKeys(bytes([n]) * 32, bytes([n + 1]) * 32, b"", b"") for n in (1, 2, 3)}
ROUND = SecAggRound((1, 2, 3), KEYS, {1: 0, 2: 1, 3: 2}, 2, prepare=NEXT)


def upload_message(**entries) -> Message:
    message = _deliver(StatsIns(HEADER, CFG, num_seen=4, rank=0, secagg=ROUND))
    message.content.config_records["round"].update(entries)
    return message


def test_a_masked_upload_names_the_next_key_step_and_a_bad_one_is_refused() -> None:
    parsed = parse_instruction(upload_message())
    assert isinstance(parsed, StatsIns) and parsed.secagg == ROUND
    plain = parse_instruction(
        dataclasses.replace(parsed, secagg=dataclasses.replace(ROUND, prepare=None)).to_message(5)
    )
    assert plain.secagg.prepare is None
    for entries, error in [
        ({"secagg-prepare-run-id": "run-b"}, "masked upload instruction: keys asked for run 'run-b', this is 'run-a'"),
        ({"secagg-prepare-round": 7}, "keys asked for round 7 of stage 3, not after this round 7 of stage 2"),
        ({"secagg-prepare-attempt": 1}, "keys asked for a retry or a stage that is not its task's"),
        ({"secagg-prepare-extra": 1}, "masked upload instruction: the next round's key step is named only in part"),
    ]:
        with pytest.raises(ProtocolError, match=re.escape(error)):
            parse_instruction(upload_message(**entries))


def test_a_masked_reply_carries_the_next_keys_whole_or_not_at_all() -> None:
    report = MaskedReport(b"sig", next_keys=KEYS[1])
    assert MaskedReport.from_entries(report.entries()) == report
    entries = report.entries()
    del entries["next-s"]
    with pytest.raises(ProtocolError, match=r"^masked upload: the next round's keys only in part$"):
        MaskedReport.from_entries(entries)


UNMASK = Header("run-a", "secagg-unmask", 1, 2, 7, 0)
AHEAD = SharesAhead(KEYS, {1: 0, 2: 1, 3: 2}, 2)


def test_an_unmask_instruction_carries_the_next_shares_step_only_with_its_key_step() -> None:
    ins = UnmaskIns(UNMASK, CFG, survivors=(1, 2, 3), prepare=NEXT, ahead=AHEAD)
    parsed = parse_instruction(_deliver(ins))
    assert isinstance(parsed, UnmaskIns) and parsed.ahead == AHEAD and parsed.prepare == NEXT
    message = _deliver(ins)
    for name in [n for n in message.content.config_records["round"] if n.startswith("prepare-")]:
        del message.content.config_records["round"][name]
    with pytest.raises(ProtocolError, match=r"^unmask instruction: the next round's shares step without its key step$"):
        parse_instruction(message)
    message = _deliver(ins)
    message.content.config_records["round"]["next-secagg-threshold"] = 1
    with pytest.raises(ProtocolError, match="next-secagg-threshold"):
        parse_instruction(message)


def test_an_unmask_reply_carries_the_next_shares_whole_or_not_at_all() -> None:
    dealt = DealtShares({1: b"a", 2: b"b"}, {1: b"c" * 64, 2: b"d" * 64}, b"s" * 64)
    reply = UnmaskRes(UNMASK, 1, 0, seed_shares={2: b"x"}, next_shares=dealt)
    unmask_reply_without(
        reply,
        UNMASK,
        _deliver(UnmaskIns(UNMASK, CFG)),
        "next-secrets",
        r"^unmask reply: the next round's shares only in part$",
    )
