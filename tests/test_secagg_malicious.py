"""Secure aggregation against a server that deviates from the protocol, and clients that misbehave.

Each test plays one attack of the secure-aggregation issue on the real strategy loop and the real
ClientApp (a LocalGrid whose ``deliver`` is the malicious server's hand on the messages), and
asserts on what the attacker *can compute*, not on a log line:

1. **Split view**: the victim is shown a smaller participant set ({victim, A}) than everyone else,
   A is then "dropped". Without signed keys the server rebuilds the victim's self-mask seed and
   A's mask key and reads the victim's Gram (the documented honest-but-curious limit); with signed
   keys every other client refuses to reveal, because the victim's view signature is not over
   theirs, and the server holds fewer than t shares of anything.
2. **A failed stage, then backfill**: an opened sum that fails its checks is never owed again by
   the clients that revealed for it; a server that asks them to "backfill" it is refused.
3. **Resume over another set**: a new run that asks for the same statistics over a set without the
   victim is refused by the ledger (signed-keys mode: the statistics are known by digest).
4. **False backfill**: a server that claims clients owe a stage they contributed is refused.
5. **Misbehaving clients**: garbage share bundles (accused with evidence, the dealer barred after
   the stage it spoiled) and wrong unmask shares (checked against the dealer's commitments: the
   liar is named and barred, the stage opens over the honest shares).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message

from clients.app import app as client_app
from fcl_flower.local_grid import LocalGrid
from fcl_flower.methods import Kind
from fcl_flower.privacy.secagg import (
    decode_fixed_point,
    pair_mask,
    reconstruct,
    round_context,
    self_mask,
    view_context,
)
from fcl_flower.protocol import MaskedReport, SecAggRound, StatsIns, UnmaskRes, parse_instruction, parse_reply
from fcl_flower.protocol.base import Header
from fcl_flower.restore import RestoreError
from strategies.secure import SecureRounds
from tests.conftest import (
    NODE_BASE,
    build,
    garbage_entries,
    reply_partition,
    run_in_process,
    server_identity,
    small_config,
    tamper_secagg_entries,
    zeroed_entries,
)
from tests.test_trust_boundaries import write_signing_keys

SETTINGS = dict(num_tasks=2, num_clients=5, rf_dim=60, seed=0, secure_aggregation=True)
VICTIM, PEER = NODE_BASE + 1, NODE_BASE + 3  # the split view shows the victim only {VICTIM, PEER}


def relative(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def signed_grid(tmp: Path, grid: LocalGrid) -> LocalGrid:
    for node, extra in write_signing_keys(tmp / "keys", list(grid.contexts)).items():
        grid.contexts[node].node_config.update(extra)
    return grid


def run_on(grid: LocalGrid, cfg):
    server_identity()
    strategy = build(cfg)
    strategy.start(grid)
    return strategy


def errors(grid: LocalGrid, kind: str) -> list[str]:
    return [r.error.reason for r in grid.replies if r.has_error() and r.metadata.message_type == kind]


# ------------------------------------------------------------------------------ 1. split view
class SplitViewGrid(LocalGrid):
    """A server that shows the victim a round of two ({VICTIM, PEER}) in stage 1 and drops PEER's
    upload, so that the others are asked for the victim's seed and PEER's mask key."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.victim_ins: StatsIns | None = None
        self.victim_upload: np.ndarray | None = None
        self.unmask_replies: list[Message] = []

    def deliver(self, messages):
        out = []
        for message in messages:
            kind, dst = message.metadata.message_type, message.metadata.dst_node_id
            ins = parse_instruction(message) if kind == "query.stats" and dst == VICTIM else None
            if isinstance(ins, StatsIns) and ins.header.task == 0:
                assert ins.secagg is not None
                sec = ins.secagg
                keep = (VICTIM, PEER)
                narrow = SecAggRound(
                    sec.round_nodes,
                    {n: sec.participants[n] for n in keep},
                    {n: sec.clients[n] for n in keep},
                    sec.threshold,
                    {n: sec.shares[n] for n in keep},
                    {n: sec.commitments[n] for n in keep},
                )
                self.victim_ins = dataclasses.replace(ins, secagg=narrow)
                message = self.victim_ins.to_message(dst)
            out.append(message)
        replies = super().deliver(out)
        kept = []
        for reply in replies:
            kind, src = reply.metadata.message_type, reply.metadata.src_node_id
            task = Header.from_record(reply.content.config_records["header"]).task if not reply.has_error() else 0
            if task:
                kept.append(reply)
                continue
            if kind == "query.stats" and src == VICTIM and not reply.has_error():
                self.victim_upload = reply.content.array_records["arrays"]["gram-packed"].numpy().copy()
            if kind == "query.stats" and src == PEER:
                continue  # "dropped": the others are asked for PEER's mask key
            if kind == "query.unmask":
                self.unmask_replies.append(reply)
            kept.append(reply)
        return kept


def read_victims_gram(grid: SplitViewGrid, threshold: int, fraction_bits: int) -> np.ndarray | None:
    """What the attacker computes: the victim's upload less PRG(b_victim) and its one pair mask."""
    ins = grid.victim_ins
    assert ins is not None and ins.secagg is not None and grid.victim_upload is not None
    seed_shares, key_shares = [], []
    for reply in grid.unmask_replies:
        if reply.has_error():
            continue
        header = Header.from_record(reply.content.config_records["header"])
        parsed = parse_reply(reply, header, Kind.UNMASK)
        assert isinstance(parsed, UnmaskRes)
        if VICTIM in parsed.seed_shares:
            seed_shares.append(parsed.seed_shares[VICTIM])
        if PEER in parsed.key_shares:
            key_shares.append(parsed.key_shares[PEER])
    if len(seed_shares) < threshold or len(key_shares) < threshold:
        return None
    seed, peer_key = reconstruct(seed_shares, threshold), reconstruct(key_shares, threshold)
    h, sec = ins.header, ins.secagg
    context = round_context(h.run_id, h.task, h.stage, h.server_round, h.attempt, sec.round_nodes)
    view = view_context(
        context, sec.participants, sec.binding(ins.backfill)
    )  # the victim's view: the attacker chose it
    upload = grid.victim_upload.reshape(-1)
    name = "gram-packed"
    ring = upload - self_mask(seed, upload.size, view, name)
    ring = ring + pair_mask(PEER, peer_key, VICTIM, sec.participants[VICTIM].s, upload.size, view, name)
    return decode_fixed_point(ring, fraction_bits)


def victims_plain_gram(tmp: Path) -> np.ndarray:
    captured: list[np.ndarray] = []

    def capture(task, phase, replies):
        if task == 0 and phase == "stsa-stats":
            captured.extend(
                m.content.array_records["arrays"]["gram-packed"].numpy().astype(np.float64)
                for m in replies
                if reply_partition(m) == VICTIM - NODE_BASE
            )
        return replies

    run_in_process(small_config(tmp, **{**SETTINGS, "secure_aggregation": False}), capture)
    return captured[0]


@pytest.fixture
def unscreened(monkeypatch):
    """The malicious server does not screen the victim's view signature (an honest one would reject
    the upload): it relays whatever the victim signed, as an attacker would."""
    monkeypatch.setattr(SecureRounds, "_screen", lambda self, host, message, node, *a: _report(message))


def _report(message: Message) -> MaskedReport:
    """What rides beside the upload as the node sent it (its view signature, the next round's keys)."""
    record = message.content.config_records.get("secagg")
    return MaskedReport() if record is None else MaskedReport.from_entries(record)


def test_split_view_reads_the_victims_gram_without_signed_keys(tmp_path, caplog, unscreened) -> None:
    """The attack is real: with unsigned keys the server reads the victim's G exactly (the
    documented honest-but-curious limit, said in the run log)."""
    cfg = small_config(tmp_path / "run", **SETTINGS)
    grid = SplitViewGrid(client_app, 5, first_node_id=NODE_BASE)
    with caplog.at_level(logging.WARNING):
        run_on(grid, cfg)
    assert any("honest-but-curious server only" in r.getMessage() for r in caplog.records)
    read = read_victims_gram(grid, 3, cfg.secagg_fraction_bits)
    assert read is not None
    assert relative(read, victims_plain_gram(tmp_path / "plain")) < 1e-6


def test_split_view_is_refused_with_signed_keys(tmp_path, unscreened) -> None:
    cfg = small_config(tmp_path / "run", **SETTINGS, secagg_signed_keys=True)
    grid = signed_grid(tmp_path, SplitViewGrid(client_app, 5, first_node_id=NODE_BASE))
    strategy = run_on(grid, cfg)
    refusals = errors(grid, "query.unmask")
    assert len(refusals) == 4  # every survivor that was asked: the three others and the victim
    signature = f"survivor {VICTIM}: its signature is not over this node's view of the round: refused"
    assert sum(signature in e for e in refusals) == 3
    assert read_victims_gram(grid, 3, cfg.secagg_fraction_bits) is None  # fewer than t shares of anything
    assert strategy.recorder.stages[0].extra["failed"].startswith("the secure sum cannot be opened")


# ------------------------------------------------------------------------------ 2 and 4. backfill of an opened stage
class RewritingGrid(LocalGrid):
    """A server that rewrites the instructions of one message type before they go out."""

    kind = ""

    def rewrite(self, ins):
        return ins

    def deliver(self, messages):
        out = [
            self.rewrite(parse_instruction(m)).to_message(m.metadata.dst_node_id)
            if m.metadata.message_type == self.kind
            else m
            for m in messages
        ]
        return super().deliver(out)


class BackfillClaimGrid(RewritingGrid):
    """A server that, in stage 2, claims every client owes stage 1 (which they all contributed)."""

    kind = "query.stats"

    def rewrite(self, ins):
        if isinstance(ins, StatsIns) and ins.header.task == 1:
            return dataclasses.replace(ins, backfill=dict.fromkeys(range(5), (0,)))
        return ins


def test_a_false_backfill_of_a_contributed_stage_is_refused(tmp_path) -> None:
    grid = BackfillClaimGrid(client_app, 5, first_node_id=NODE_BASE)
    strategy = run_on(grid, small_config(tmp_path, **SETTINGS))
    refusals = errors(grid, "query.stats")
    assert len(refusals) == 5
    assert all("backfill stage 1, which it already contributed (opened over nodes" in e for e in refusals)
    assert "failed" in strategy.recorder.stages[1].extra  # nothing of stage 2 was opened either


def test_a_failed_opened_stage_is_never_owed_again(tmp_path) -> None:
    """Route 2: stage 1's opened sum fails its checks (one garbage upload). The clients that
    revealed for it owe nothing (the honest server asks nobody); the statistics are recorded as
    lost; a server that asks anyway is refused (the false-backfill test)."""

    def garbage(task, phase, replies):
        if task == 0 and phase == "stsa-stats":
            for m in replies:
                if reply_partition(m) == 2:
                    counts = m.content.array_records["arrays"]["counts"].numpy()
                    rng = np.random.default_rng(0)
                    m.content.array_records["arrays"]["counts"] = type(m.content.array_records["arrays"]["counts"])(
                        rng.integers(0, 2**63, counts.shape, dtype=np.uint64)
                    )
        return replies

    strategy = run_in_process(small_config(tmp_path, **SETTINGS), garbage)
    first, second = strategy.recorder.stages
    assert first.extra["failed"].startswith("the opened secure sum fails its checks")
    assert first.extra["statistics_lost"] == [f"client-{c}" for c in range(5)]
    assert "statistics_missing" not in second.extra and "backfilled" not in second.extra
    assert "failed" not in second.extra


def test_secagg_failed_sum_stop_ends_the_run(tmp_path) -> None:
    from strategies.loop import RunFailed

    def garbage(task, phase, replies):
        if task == 0 and phase == "stsa-stats":
            for m in replies:
                if reply_partition(m) == 2:
                    record = m.content.array_records["arrays"]
                    shape = record["counts"].numpy().shape
                    record["counts"] = type(record["counts"])(np.full(shape, 2**62, dtype=np.uint64))
        return replies

    with pytest.raises(RunFailed, match=r"stage 1: the opened secure sum fails its checks.*secagg-failed-sum=stop"):
        run_in_process(small_config(tmp_path, **SETTINGS, secagg_failed_sum="stop"), garbage)


# ------------------------------------------------------------------------------ 3. resume over another set
def test_a_rerun_over_another_set_is_refused_by_the_ledger(tmp_path) -> None:
    """Signed-keys mode: a second run (a "resume" after a claimed crash) asks for stage 1 over the
    set without the victim. Same data, same statistics: every other node refuses to reveal, so
    the difference of the two sums never exists."""
    grid = signed_grid(tmp_path, LocalGrid(client_app, 5, first_node_id=NODE_BASE))
    cfg = small_config(tmp_path / "a", **{**SETTINGS, "num_tasks": 1}, secagg_signed_keys=True)
    assert "failed" not in run_on(grid, cfg).recorder.stages[0].extra
    grid.replies.clear()
    grid.unavailable.add(VICTIM)
    again = run_on(grid, small_config(tmp_path / "b", **{**SETTINGS, "num_tasks": 1}, secagg_signed_keys=True))
    assert_refused_by_the_ledger(grid, again, 4)


def assert_refused_by_the_ledger(grid: LocalGrid, strategy, survivors: int) -> None:
    refusals = errors(grid, "query.unmask")
    assert len(refusals) == survivors
    assert all("the statistics of stage 1 were already opened over nodes" in e for e in refusals)
    assert not [r for r in grid.replies if r.metadata.message_type == "query.unmask" and not r.has_error()]
    assert "failed" in strategy.recorder.stages[0].extra


def test_the_same_view_opened_again_without_the_victim_is_refused(tmp_path) -> None:
    """The victim joins the key and share steps of the second run (so every survivor signs the same
    view as in the first), but its upload is 'lost': the survivors' sum would be the first sum
    less the victim. The ledger knows the set each input was opened over (the survivors, not the
    view), so every survivor refuses."""
    grid = signed_grid(tmp_path, LocalGrid(client_app, 5, first_node_id=NODE_BASE))
    cfg = small_config(tmp_path / "a", **{**SETTINGS, "num_tasks": 1}, secagg_signed_keys=True)
    assert "failed" not in run_on(grid, cfg).recorder.stages[0].extra
    grid.replies.clear()
    lose_victim = lose_client(VICTIM - NODE_BASE)
    grid.tamper = _by_header(
        lambda task, phase, replies: lose_victim(task, phase, replies) if phase == "stsa-stats" else replies
    )
    again = run_on(grid, small_config(tmp_path / "b", **{**SETTINGS, "num_tasks": 1}, secagg_signed_keys=True))
    assert_refused_by_the_ledger(grid, again, 4)


def test_the_same_set_may_open_a_stage_again(tmp_path) -> None:
    """A retry over the identical set opens the identical sum: nothing new is learnt, so the ledger
    allows it (an honest resume with everyone back)."""
    grid = signed_grid(tmp_path, LocalGrid(client_app, 5, first_node_id=NODE_BASE))
    for run in ("a", "b"):
        cfg = small_config(tmp_path / run, **{**SETTINGS, "num_tasks": 1}, secagg_signed_keys=True)
        assert "failed" not in run_on(grid, cfg).recorder.stages[0].extra
    assert not [r for r in grid.replies if r.has_error()]


# ------------------------------------------------------------------------------ 5. misbehaving clients
def test_wrong_unmask_shares_name_their_revealer_and_the_stage_opens(tmp_path) -> None:
    """Client 4 answers the unmask step with zeroed shares: the server checks every share against
    its dealer's commitment, names client 4, opens over the honest shares (4 >= t = 3), and bars it."""
    plain = run_in_process(small_config(tmp_path / "plain", **{**SETTINGS, "secure_aggregation": False}))

    zeroed = tamper_secagg_entries("secagg-unmask", 4, "seed-shares", zeroed_entries, task=None)
    strategy = run_in_process(small_config(tmp_path / "run", **SETTINGS), zeroed)
    first, second = strategy.recorder.stages
    assert "failed" not in first.extra
    assert relative(strategy.stage_weights[0], plain.stage_weights[0]) < 1e-6  # opened exactly
    assert all("not the one dealt" in why for why in first.extra["secagg_blame"]["client-4"])
    assert "client-4" not in second.clients and "barred" in second.left_out["client-4"]
    assert "failed" not in second.extra


def test_garbage_share_bundles_are_accused_and_the_dealer_barred(tmp_path) -> None:
    """Client 2 sends garbage bundles: every honest client accuses it (evidence checked), so too few
    hold its shares to open the sum. Before anything is revealed the server bars it and runs the
    round again without it (a fresh attempt): stage 1 opens over the four honest clients, exactly
    like a run without client 2, and client 2 stays out of stage 2."""

    garbage = tamper_secagg_entries("secagg-shares", 2, "shares", garbage_entries)
    strategy = run_in_process(small_config(tmp_path / "run", **SETTINGS), garbage)
    first, second = strategy.recorder.stages
    assert "failed" not in first.extra and first.clients == ["client-0", "client-1", "client-3", "client-4"]
    assert "barred" in first.left_out["client-2"]
    assert len([w for w in first.extra["secagg_blame"]["client-2"] if w.startswith("accused by")]) == 4
    assert "client-2" not in second.clients and "failed" not in second.extra
    without = run_in_process(small_config(tmp_path / "without", **SETTINGS), lose_client(2))
    assert relative(strategy.stage_weights[0], without.stage_weights[0]) < 1e-6


def lose_client(client: int):
    def tamper(task, phase, replies):
        return [m for m in replies if m.has_error() or reply_partition(m) != client]

    return tamper


def test_a_single_false_accusation_changes_nothing(tmp_path, monkeypatch) -> None:
    """Client 3 claims client 1's bundle did not open although it did. No key may travel as
    evidence, so a lone accusation cannot be proven either way: it is recorded, nobody is barred,
    and the stage opens over all five (client 3 simply does not reveal client 1's share)."""
    from clients import secure as client_secure

    real = client_secure.open_shares

    def lying(own_id, c_private, c_publics, received, commitments, context):
        good, bad = real(own_id, c_private, c_publics, received, commitments, context)
        if own_id == NODE_BASE + 3 and NODE_BASE + 1 in good:
            del good[NODE_BASE + 1]
            bad[NODE_BASE + 1] = "made up"
        return good, bad

    monkeypatch.setattr(client_secure, "open_shares", lying)
    strategy = run_in_process(small_config(tmp_path, **SETTINGS))
    first, second = strategy.recorder.stages
    assert first.extra["secagg_blame"] == {"client-1": ["accused by client-3: made up"]}
    assert first.clients == second.clients == [f"client-{c}" for c in range(5)]
    assert "failed" not in first.extra and "failed" not in second.extra


# ------------------------------------------------------------------------------ 3'. an honest resume asks nobody again
class Killed(Exception):
    """Stands in for the server process dying right after it opened a secure sum."""


def test_an_honest_resume_takes_the_opened_sum_from_the_checkpoint(tmp_path, monkeypatch) -> None:
    """The server dies right after opening stage 2's sum (before its stage checkpoint). On resume it
    takes the opened sum from the run folder: no secure round is run again for stage 2 (the
    clients' ledgers would refuse another set anyway), and the run ends exactly like an
    uninterrupted one."""
    from strategies.stsa import STSAStrategy

    settings = {**SETTINGS, "num_tasks": 5}
    uninterrupted = run_on(LocalGrid(client_app, 5, first_node_id=NODE_BASE), small_config(tmp_path / "u", **settings))
    fold = STSAStrategy.fold_opened

    def die_at_stage_2(self, plan, *args):
        if plan.task == 1:
            raise Killed
        return fold(self, plan, *args)

    monkeypatch.setattr(STSAStrategy, "fold_opened", die_at_stage_2)
    cfg = small_config(tmp_path / "r", **settings)
    grid = LocalGrid(client_app, 5, first_node_id=NODE_BASE)
    with pytest.raises(Killed):
        run_on(grid, cfg)
    monkeypatch.undo()
    grid.sent.clear()
    resumed = run_on(grid, cfg.replace(resume=True))  # the same nodes, their ledgers and all
    asked = {(Header.from_record(m.content.config_records["header"]).task, m.metadata.message_type) for m in grid.sent}
    assert (1, "query.stats") not in asked and (1, "query.keys") not in asked  # stage 2: nobody asked again
    assert (2, "query.stats") in asked
    assert np.array_equal(resumed.weights.numpy(), uninterrupted.weights.numpy())
    assert [s.accuracy for s in resumed.recorder.stages] == [s.accuracy for s in uninterrupted.recorder.stages]


# ------------------------------------------------------------------------------ refusals, one by one
class NoSignaturesGrid(RewritingGrid):
    """A server that asks for the unmask shares without relaying the survivors' view signatures."""

    kind = "query.unmask"

    def rewrite(self, ins):
        return dataclasses.replace(ins, signatures={})


def test_an_unmask_request_without_the_survivors_signatures_is_refused(tmp_path) -> None:
    grid = signed_grid(tmp_path, NoSignaturesGrid(client_app, 5, first_node_id=NODE_BASE))
    strategy = run_on(grid, small_config(tmp_path / "run", **{**SETTINGS, "num_tasks": 1}, secagg_signed_keys=True))
    refusals = errors(grid, "query.unmask")
    assert len(refusals) == 5
    assert all("the unmask request carries no signature of survivor" in e for e in refusals)
    assert "cannot be opened" in strategy.recorder.stages[0].extra["failed"]


def test_an_upload_whose_view_signature_does_not_verify_is_left_out(tmp_path) -> None:
    """The server checks each upload's view signature too: a forged one is a rejected upload
    (recovered in the attempt like a dropout), named, and the stage opens over the others."""

    def forge(task, phase, replies):
        if phase == "stsa-stats":
            for m in replies:
                if not m.has_error() and reply_partition(m) == 0:
                    m.content.config_records["secagg"]["view-signature"] = b"forged"
        return replies

    grid = signed_grid(tmp_path, LocalGrid(client_app, 5, first_node_id=NODE_BASE, tamper=_by_header(forge)))
    strategy = run_on(grid, small_config(tmp_path / "run", **{**SETTINGS, "num_tasks": 1}, secagg_signed_keys=True))
    stage = strategy.recorder.stages[0]
    assert "failed" not in stage.extra and "client-0" not in stage.clients
    assert "its signature is not over this node's view of the round" in stage.left_out["client-0"]


def _by_header(tamper):
    def hook(sent, replies):
        header = Header.from_record(sent[0].content.config_records["header"])
        return tamper(header.task, header.phase, replies)

    return hook


def test_a_barred_client_stays_barred_after_a_resume(tmp_path) -> None:
    """The checkpoint keeps who was barred: a resumed run does not admit it again."""

    zeroed = tamper_secagg_entries("secagg-unmask", 4, "seed-shares", zeroed_entries)
    cfg = small_config(tmp_path, **{**SETTINGS, "num_tasks": 5})
    strategy = build(cfg)
    with pytest.raises(RestoreError, match=r"^field 'state/secagg_barred/x' must name a client of this run"):
        strategy.load_state_dict({**strategy.state_dict(), "secagg_barred": {"4": "revealed a wrong share", "x": "?"}})
    strategy.load_state_dict({**strategy.state_dict(), "secagg_barred": {"4": "revealed a wrong share"}})
    assert strategy.secure is not None and strategy.secure.barred == {4: "revealed a wrong share"}
    first = run_in_process(cfg, zeroed)
    assert first.state_dict()["secagg_barred"].keys() == {"4"}


# ------------------------------------------------------------------------------ what the node pins, not the server
def test_a_node_with_a_signing_key_refuses_an_unsigned_round(tmp_path) -> None:
    """The run config travels from the server with every message: a node configured to sign
    refuses a run that asks it to switch signatures off (a downgrade to the honest-but-curious
    protocol), at the first step."""
    grid = signed_grid(tmp_path, LocalGrid(client_app, 5, first_node_id=NODE_BASE))
    strategy = run_on(grid, small_config(tmp_path / "run", **{**SETTINGS, "num_tasks": 1}, secagg_signed_keys=False))
    refusals = errors(grid, "query.keys")
    assert len(refusals) == 5 and all("the run asks for unsigned keys" in e for e in refusals)
    assert "failed" in strategy.recorder.stages[0].extra


def test_a_node_pinned_to_secure_aggregation_refuses_a_plain_upload(tmp_path) -> None:
    grid = LocalGrid(client_app, 5, first_node_id=NODE_BASE)
    for context in grid.contexts.values():
        context.node_config.update({"secure-aggregation": True, "secagg-min-clients": 3})
    strategy = run_on(
        grid, small_config(tmp_path / "plain", **{**SETTINGS, "num_tasks": 1, "secure_aggregation": False})
    )
    refusals = errors(grid, "query.stats")
    assert len(refusals) == 5 and all("uploads statistics only inside a secure round" in e for e in refusals)
    assert "failed" in strategy.recorder.stages[0].extra
    grid.replies.clear()
    low = run_on(grid, small_config(tmp_path / "low", **{**SETTINGS, "num_tasks": 1}, secagg_min_clients=2))
    assert all("below this node's floor 3" in e for e in errors(grid, "query.keys"))
    assert "failed" in low.recorder.stages[0].extra


class SelfDroppedGrid(RewritingGrid):
    """A server that asks node 0 to reveal as though node 0 itself had dropped."""

    kind = "query.unmask"

    def rewrite(self, ins):
        return dataclasses.replace(
            ins, survivors=tuple(n for n in ins.survivors if n != NODE_BASE), dropped=(*ins.dropped, NODE_BASE)
        )


def test_a_node_refuses_to_reveal_as_though_it_had_dropped(tmp_path) -> None:
    grid = SelfDroppedGrid(client_app, 5, first_node_id=NODE_BASE)
    run_on(grid, small_config(tmp_path, **{**SETTINGS, "num_tasks": 1}))
    node0 = [r.error.reason for r in grid.replies if r.has_error() and r.metadata.src_node_id == NODE_BASE]
    assert any("lists this node itself as dropped: refused" in e for e in node0)


def test_a_low_order_key_is_barred_at_the_key_round(tmp_path) -> None:
    """An all-zero X25519 key would make every peer's key agreement fail (the round would stall):
    the server tries each key once and bars the client that sent an unusable one."""

    def zero_key(task, phase, replies):
        if phase == "secagg-keys" and task == 0:
            for m in replies:
                if not m.has_error() and reply_partition(m) == 2:
                    m.content.config_records["secagg"]["s"] = bytes(32)
        return replies

    strategy = run_in_process(small_config(tmp_path, **SETTINGS), zero_key)
    first, second = strategy.recorder.stages
    assert "failed" not in first.extra and "client-2" not in first.clients
    assert "unusable" in first.left_out["client-2"] and "barred" in second.left_out["client-2"]


# ------------------------------------------------------------------------------ garbage beside a masked upload, and in the shares step
@pytest.mark.parametrize("accused", [7, NODE_BASE], ids=["outside the round", "itself"])
def test_an_accusation_of_a_node_that_dealt_no_shares_is_a_rejected_upload(tmp_path, accused) -> None:
    """Client 0 accuses a node outside the round, or itself: its upload is rejected with the reason
    (recovered in the attempt like a dropout) and the stage opens over the others."""

    def accuse(task, phase, replies):
        if phase == "stsa-stats" and task == 0:
            for m in replies:
                if not m.has_error() and reply_partition(m) == 0:
                    record = m.content.config_records["secagg"]
                    record["accused"], record["accused-reasons"] = [accused], ["made up"]
        return replies

    strategy = run_in_process(small_config(tmp_path, **{**SETTINGS, "num_tasks": 1}), accuse)
    stage = strategy.recorder.stages[0]
    assert "failed" not in stage.extra and "client-0" not in stage.clients
    assert f"masked upload accuses node {accused}, which dealt it no shares" in stage.left_out["client-0"]


def test_commitments_of_the_wrong_size_leave_the_dealer_out_of_the_round(tmp_path) -> None:
    short = tamper_secagg_entries("secagg-shares", 1, "commits", lambda commits: [c[:10] for c in commits])
    strategy = run_in_process(small_config(tmp_path, **{**SETTINGS, "num_tasks": 1}), short)
    stage = strategy.recorder.stages[0]
    assert "failed" not in stage.extra and "client-1" not in stage.clients
    assert "commitments are not 64 bytes" in stage.left_out["client-1"]
