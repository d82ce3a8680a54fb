"""Issue 33 under secure aggregation: the forget round after a stage is its own secure round in
which a leaving site masks the negation of what it added and every other site masks zeros; the
server opens only the sum (in process, digits, through the real ClientApp and the strategy loop).

The attacker's view first: a server that names a site that never asked for a whole-site removal
would read that site's statistics (with the others masking zeros, the opened sum *is* them). A
site takes part as a leaving site only with its node config's ``forget-consent = true`` (or its own
``forget-samples`` request), and its ledger opens each removal over one set of survivors only. A
removal that is not some dataset's statistics within what was added is refused and changes nothing.

Then exactness: a secure run with ``forget = "S:C"`` ends, bit for bit in the ring, where a secure
run that never had site C's statistics ends (G, C and n equal; W equal), at stage S and after; a
site's own sample request leaves the server with exactly the sum of what every site now keeps."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Message

from clients import secure_forget
from clients import stsa as stsa_client
from clients.app import app as client_app
from clients.ledger import Ledger, forget_ledger_key
from clients.upload_store import load_secure_upload, secure_tasks, secure_upload_path
from clients.upload_store import main as store_main
from fcl_flower import interrupt
from fcl_flower.analytic.packing import unpack_upper
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.local_grid import LocalGrid
from fcl_flower.privacy.secagg import SecureAggregationError, decode_fixed_point, encode_fixed_point
from fcl_flower.protocol import MaskedReport, ProtocolError
from fcl_flower.restore import RestoreError
from strategies import loop
from strategies.stsa import STSAStrategy
from tests.conftest import NODE_BASE, build, reply_partition, sent_header, server_identity, small_config
from tests.test_trust_boundaries import write_signing_keys

LEAVER, TASKS, CLIENTS, AFTER = 1, 5, 3, 2
TOL = 1e-10
BATCH = 16  # the sample tests' batch size: several batches per stage


def _cfg(out_dir: Path, name: str, **changes):
    settings = dict(num_tasks=TASKS, num_clients=CLIENTS, ridge="auto", rf_dim=60, secure_aggregation=True)
    return small_config(out_dir, run_name=name, **{**settings, **changes})


def _nodes(store: Path, **extra: dict) -> list[dict]:
    """Node configs: each site keeps its uploads in ``store`` and its ledger beside it."""
    ledger = str(store.parent / f"{store.name}-ledger")
    return [
        {
            "partition-id": k,
            "num-partitions": CLIENTS,
            "upload-store": str(store),
            "secagg-ledger": ledger,
            **extra.get(str(k), {}),
        }
        for k in range(CLIENTS)
    ]


def _drop(partition: int):
    """Every reply of ``partition`` is lost: the run never has its statistics (nor its keys)."""

    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        return [r for r in replies if r.has_error() or reply_partition(r) != partition]

    return tamper


def _run(cfg, node_configs: list[dict], tamper=None, patch=None, collect=None):
    """Run ``cfg`` on nodes with these node configs; (the strategy, W after each stage's solve, the
    ridge G before and after each forget round, the headers of every secure step)."""
    server_identity()
    strategy = build(cfg)
    weights: list[torch.Tensor] = [] if collect is None else collect[0]
    forget_grams: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = [] if collect is None else collect[1]
    headers: list = [] if collect is None else collect[2]
    end_stage, between, header = strategy.end_stage, strategy.between_stages, strategy.header

    def spy_end(task: int):
        extra = end_stage(task)
        weights.append(strategy.weights.clone())  # type: ignore[attr-defined]
        return extra

    def spy_between(grid, task, timeout):
        before = strategy.ridge.gram.clone()  # type: ignore[attr-defined]
        between(grid, task, timeout)
        after = strategy.ridge.gram.clone()  # type: ignore[attr-defined]
        forget_grams.append((before, after, strategy.weights.clone()))  # type: ignore[attr-defined]

    def spy_header(plan, attempt):
        made = header(plan, attempt)
        headers.append(made)
        return made

    strategy.end_stage = spy_end  # type: ignore[method-assign]
    strategy.between_stages = spy_between  # type: ignore[method-assign]
    strategy.header = spy_header  # type: ignore[method-assign]
    if patch is not None:
        patch(strategy)

    def hook(sent, replies):
        return tamper(sent_header(sent[0]).task, sent_header(sent[0]).phase, replies) if tamper else replies

    strategy.start(
        LocalGrid(client_app, cfg.num_clients, first_node_id=NODE_BASE, node_configs=node_configs, tamper=hook)
    )
    return strategy, weights, forget_grams, headers


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


def _ledger_entries(store: Path, run_id: str, key: str) -> list[tuple[Path, list[int]]]:
    """(ledger file, the survivors it recorded) of every node ledger holding ``key`` for ``run_id``."""
    found = []
    for path in (store.parent / f"{store.name}-ledger").glob("ledger-*.json"):
        runs = json.loads(path.read_text())["runs"]
        if key in runs.get(run_id, {}):
            found.append((path, runs[run_id][key]))
    return found


# ------------------------------------------------------------------ the attacker's view
@pytest.fixture(scope="module")
def unconsented(tmp_path_factory: pytest.TempPathFactory):
    """The server names site 1 for a whole-site removal; site 1 never gave forget-consent."""
    out = tmp_path_factory.mktemp("unconsented")
    return _run(_cfg(out, "unconsented", forget=f"{AFTER}:{LEAVER}"), _nodes(out / "store")), out / "store"


def test_a_site_named_without_its_consent_refuses_and_the_server_learns_and_removes_nothing(unconsented) -> None:
    (strategy, _, forget_grams, _), store = unconsented
    record = strategy.unlearning_log[0]
    refusals = [r for r in record["requests"] if "refused" in r]
    assert [r["who"] for r in refusals] == [f"client-{LEAVER}"]
    assert "forget-consent=true: refused" in refusals[0]["refused"]
    assert not any("removed_samples" in r for r in record["requests"])
    before, after, _ = forget_grams[AFTER - 1]
    assert torch.equal(before, after)  # the opened sum of zeros changed nothing
    assert record["accuracy_before"] == record["accuracy_after"]
    # the site stays: it is not withdrawn and uploads in every later stage
    assert LEAVER not in strategy.nodes.withdrawn
    assert secure_tasks(store, LEAVER) == list(range(TASKS))
    # its statistics were never opened alone: no ledger holds a removal of it
    assert list((store.parent / f"{store.name}-ledger").glob("ledger-*.json"))  # the nodes' ledgers
    assert _ledger_entries(store, strategy.run_id, forget_ledger_key("site")) == []


@pytest.fixture(scope="module")
def withdrawal(tmp_path_factory: pytest.TempPathFactory):
    """Site 1 consents and is forgotten after stage 2, the run stopped after stage 3 and resumed (so
    every property below holds across a resume too); the secure run that never had site 1.
    Returns ((the resumed strategy, W per stage, the forget rounds' (G before, G after, W after),
    every header), (the same of the run that never had site 1), the store, the first strategy)."""
    out = tmp_path_factory.mktemp("secure-withdrawal")
    store = out / "store"
    nodes = _nodes(store, **{str(LEAVER): {"forget-consent": True}})
    cfg = _cfg(out, "withdraws", forget=f"{AFTER}:{LEAVER}")
    save = loop.save
    first: list = []

    def save_then_stop(strategy, task):
        save(strategy, task)
        if task == AFTER:  # stage 3 is checkpointed, after the forget round of stage 2
            first.append(strategy)
            interrupt.request_stop()

    grams: list = []
    weights: list = []
    headers: list = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "save", save_then_stop)
        try:
            with pytest.raises(interrupt.RunInterrupted):
                _run(cfg, nodes, collect=(weights, grams, headers))
        finally:
            interrupt.clear()
    assert len(weights) == AFTER + 1
    resumed, *_ = _run(cfg.replace(resume=True), nodes, collect=(weights, grams, headers))
    never = _run(_cfg(out, "never"), _nodes(out / "never-store"), _drop(LEAVER))
    return (resumed, weights, grams, headers), never, store, first[0]


def test_the_leaving_sites_ledger_opens_its_removal_over_one_set_only(withdrawal) -> None:
    _, _, store, strategy = withdrawal  # the forget round ran before the interruption
    entries = _ledger_entries(store, strategy.run_id, forget_ledger_key("site"))
    assert len(entries) == 1  # the leaving site alone recorded a removal; the others masked zeros
    path, survivors = entries[0]
    assert len(survivors) == CLIENTS
    ledger = Ledger(path.parent, "unused", 0)
    ledger.path = path
    ledger.check(strategy.run_id, [forget_ledger_key("site")], survivors)  # a retry over the same set: allowed
    other = survivors[:-1]  # a server asking again over another set would learn by difference
    with pytest.raises(SecureAggregationError, match="the removal 'site' was already opened over nodes"):
        ledger.check(strategy.run_id, [forget_ledger_key("site")], other)


def test_the_forget_round_masks_under_its_own_round_context(withdrawal) -> None:
    (_, _, _, headers), _, _, _ = withdrawal
    contexts = {(h.run_id, h.task, h.stage, h.server_round, h.attempt) for h in headers if h.phase == "stsa-stats"}
    forget = [(h.run_id, h.task, h.stage, h.server_round, h.attempt) for h in headers if h.phase == "stsa-forget"]
    assert forget and not set(forget) & contexts  # never a stage round's context: no mask is reused
    # every stage had its round (the set also holds keys-ahead guesses of the next round's header)
    assert {h.task for h in headers if h.phase == "stsa-stats"} == set(range(TASKS))


def test_a_removal_that_is_no_datasets_statistics_is_refused_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leaving site that "removes" twice what it added (more samples of a class than were added),
    or the negation of a removal (negative counts): refused with the reason, nothing subtracted, and
    the site is not withdrawn."""
    whole = secure_forget.whole_site_removal

    def doubled(job, folder, ring):
        samples = whole(job, folder, ring)
        ring.gram, ring.sums, ring.counts = (
            ring.gram * np.uint64(2),
            ring.sums * np.uint64(2),
            ring.counts * np.uint64(2),
        )
        return 2 * samples

    monkeypatch.setattr(secure_forget, "whole_site_removal", doubled)
    nodes = _nodes(tmp_path / "store", **{str(LEAVER): {"forget-consent": True}})
    strategy, _, forget_grams, _ = _run(_cfg(tmp_path, "doubled", forget=f"{AFTER}:{LEAVER}", num_tasks=AFTER), nodes)
    (refused,) = strategy.unlearning_log[0]["requests"]
    assert refused["who"] == f"client-{LEAVER}" and refused["secure"] is True
    assert "the opened removal fails its checks" in refused["refused"] and "were added" in refused["refused"]
    before, after, _ = forget_grams[AFTER - 1]
    assert torch.equal(before, after) and LEAVER not in strategy.nodes.withdrawn


def test_a_sites_own_request_that_cannot_be_applied_is_recorded_with_its_reason(tmp_path: Path) -> None:
    rows = tmp_path / "forget.txt"
    rows.write_text("1,99999\n")  # a row the site does not have
    nodes = _nodes(tmp_path / "store", **{"2": {"forget-samples": str(rows)}})
    strategy, _, forget_grams, _ = _run(_cfg(tmp_path, "bad-row", forget=str(AFTER), num_tasks=AFTER), nodes)
    (refused,) = strategy.unlearning_log[0]["requests"]
    assert refused["who"] == "client-2" and "row 99999 is beyond the site's" in refused["refused"]
    before, after, _ = forget_grams[AFTER - 1]
    assert torch.equal(before, after)


def test_a_consenting_site_masks_one_whole_site_removal_per_run(tmp_path: Path) -> None:
    """A server that keeps the consenting site after its removal and names it again after the next
    stage (over the same set, which the ledger allows as a retry) would read its stage-2 statistics
    by difference: the site refuses any second, different whole-site removal in the run."""

    def keep_asking(strategy) -> None:
        strategy.withdraw = lambda client: None  # the server "forgets" to withdraw the site

    nodes = _nodes(tmp_path / "store", **{str(LEAVER): {"forget-consent": True}})
    cfg = _cfg(tmp_path, "twice", forget=f"1:{LEAVER},2:{LEAVER}", num_tasks=2)
    strategy, _, forget_grams, _ = _run(cfg, nodes, patch=keep_asking)
    first, second = strategy.unlearning_log
    assert first["requests"][0]["who"] == f"client-{LEAVER}" and first["requests"][0]["removed_samples"] > 0
    (refused,) = second["requests"]
    assert refused["who"] == f"client-{LEAVER}"
    assert "already masked another whole-site removal in this run: refused" in refused["refused"]
    before, after, _ = forget_grams[1]
    assert torch.equal(before, after)  # the second round removed nothing


def test_the_leaving_flag_is_typed_and_only_a_forget_round_takes_it() -> None:
    plain = MaskedReport(b"sig", {})
    assert "leaving" not in plain.entries()  # a stage round's masked report is as before
    assert MaskedReport.from_entries(MaskedReport(b"sig", {}, leaving=True).entries()).leaving is True
    with pytest.raises(ProtocolError, match="'leaving' must be a boolean"):
        MaskedReport.from_entries({**plain.entries(), "leaving": 1})


def test_a_stage_upload_that_claims_to_be_a_removal_is_rejected(tmp_path: Path) -> None:
    def claim(task: int, phase: str, replies: list[Message]) -> list[Message]:
        for m in replies:
            if phase == "stsa-stats" and task == 0 and not m.has_error() and reply_partition(m) == 2:
                m.content.config_records["secagg"]["leaving"] = True
        return replies

    strategy, *_ = _run(_cfg(tmp_path, "claims", num_tasks=2), _nodes(tmp_path / "store"), tamper=claim)
    left_out = strategy.recorder.stages[0].left_out
    assert "says it is a removal: only a forget round takes one" in left_out["client-2"]


def test_the_per_class_totals_a_removal_is_checked_against_survive_a_checkpoint(tmp_path: Path) -> None:
    server_identity()
    strategy = build(_cfg(tmp_path, "restore"))
    assert isinstance(strategy, STSAStrategy)
    state = strategy.state_dict()
    classes = strategy.split.num_classes
    state["secure_class_counts"] = torch.arange(classes, dtype=torch.float64)
    strategy.load_state_dict(state)
    assert torch.equal(strategy.secure_class_counts, torch.arange(classes, dtype=torch.float64))
    with pytest.raises(RestoreError, match="secure_class_counts"):
        strategy.load_state_dict({**state, "secure_class_counts": torch.zeros(classes + 1, dtype=torch.float64)})
    with pytest.raises(RestoreError, match="must hold non-negative integer counts"):
        strategy.load_state_dict({**state, "secure_class_counts": torch.full((classes,), -1.0, dtype=torch.float64)})


# ------------------------------------------------------------------ exactness
def test_a_withdrawn_site_leaves_the_secure_run_that_never_had_it_bit_for_bit(withdrawal) -> None:
    (full, weights, forget_grams, _), (never, never_weights, _, _), store, _ = withdrawal
    record = full.unlearning_log[0]
    assert record["after_stage"] == AFTER
    (event,) = record["requests"]
    assert (event["who"], event["what"], event["requested_by"]) == (f"client-{LEAVER}", "client", "server operator")
    assert event["secure"] is True and event["opened_over"] == CLIENTS and event["stages"] == list(range(1, AFTER + 1))
    kept = [load_secure_upload(store, LEAVER, t) for t in range(AFTER)]
    assert event["removed_samples"] == sum(u.num_samples for u in kept) > 0
    assert sum(event["removed_counts"].values()) == event["removed_samples"]
    assert record["ridge_after"] == never.recorder.stages[AFTER - 1].extra["ridge"]  # γ re-selected alike
    before, after, resolved = forget_grams[AFTER - 1]
    assert not torch.equal(before, after)
    # before the removal site 1 was in W; right after it and at every later stage, W is the run without it
    assert relative(weights[AFTER - 1], never_weights[AFTER - 1]) > 1e-6
    assert relative(resolved, never_weights[AFTER - 1]) <= TOL  # the re-solve after the forget round
    for stage in range(AFTER, TASKS):
        assert relative(weights[stage], never_weights[stage]) <= TOL
    # exact in the ring: the statistics are equal bit for bit, so W is too
    assert torch.equal(full.ridge.gram, never.ridge.gram)
    assert torch.equal(full.ridge.class_sums, never.ridge.class_sums)
    assert full.ridge.num_samples == never.ridge.num_samples
    assert torch.equal(weights[-1], never_weights[-1])
    assert LEAVER in full.nodes.withdrawn and secure_tasks(store, LEAVER) == list(range(AFTER))
    saved = json.loads(full.recorder.path.read_text())
    assert saved["unlearning"][0]["requests"][0]["secure"] is True


def test_with_signed_keys_the_removal_is_known_by_its_digest_and_stays_exact(tmp_path: Path) -> None:
    """Signed-keys mode (a malicious server in scope, threshold above two thirds): the withdrawal
    opens, the leaving site's ledger knows its removal by digest too (so no other run opens it over
    another set), and the state equals the signed run that never had the site."""
    keys = write_signing_keys(tmp_path / "keys", [NODE_BASE + k for k in range(CLIENTS)])
    signing = {str(k): keys[NODE_BASE + k] for k in range(CLIENTS)}
    store = tmp_path / "store"
    consent: dict[str, dict] = {**signing, str(LEAVER): {**signing[str(LEAVER)], "forget-consent": True}}
    full, *_ = _run(
        _cfg(tmp_path, "signed", forget=f"1:{LEAVER}", num_tasks=2, secagg_signed_keys=True), _nodes(store, **consent)
    )
    never, *_ = _run(
        _cfg(tmp_path, "signed-never", num_tasks=2, secagg_signed_keys=True),
        _nodes(tmp_path / "never-store", **signing),
        _drop(LEAVER),
    )
    (event,) = full.unlearning_log[0]["requests"]
    assert event["who"] == f"client-{LEAVER}" and event["removed_samples"] > 0
    ((path, survivors),) = _ledger_entries(store, full.run_id, forget_ledger_key("site"))
    saved = json.loads(path.read_text())
    stages = [key for key in saved["runs"][full.run_id] if not key.startswith("forget-")]
    assert stages == ["0"]  # the leaving site contributed stage 1 only, then withdrew
    assert len(saved["inputs"]) == len(stages) + 1  # and its removal is known by a digest of its own
    assert all(members == survivors for members in saved["inputs"].values())
    assert torch.equal(full.ridge.gram, never.ridge.gram) and torch.equal(full.weights, never.weights)


def test_secure_uploads_are_kept_atomically_mode_0600_and_their_sizes_reported(withdrawal, capsys) -> None:
    _, _, store, _ = withdrawal
    for partition in range(CLIENTS):
        for task in secure_tasks(store, partition):
            path = secure_upload_path(store, partition, task)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            upload = load_secure_upload(store, partition, task)
            assert upload.layout[0] == task and upload.counts.dtype == torch.float64
        assert stat.S_IMODE((store / f"partition-{partition}").stat().st_mode) == 0o700
        assert not list((store / f"partition-{partition}").glob(".*.tmp"))
    assert store_main([str(store)]) == 0  # the site operator's report: bytes per stage
    report = capsys.readouterr().out.splitlines()
    size = secure_upload_path(store, LEAVER, 0).stat().st_size
    assert f"  stage 1 (secure): {size} bytes" in report


def _kept_sum(strategy, store: Path, bits: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Σ over sites and stages of what each site keeps, through the fixed-point encoding (what a
    secure run whose sites had masked exactly these statistics would hold)."""
    dim, classes = strategy.rf_dim, strategy.split.num_classes
    gram = torch.zeros(dim * (dim + 1) // 2, dtype=torch.float64)
    sums = torch.zeros(dim, classes, dtype=torch.float64)
    total = 0
    for partition in range(CLIENTS):
        for task in secure_tasks(store, partition):
            upload = load_secure_upload(store, partition, task)
            enc = {
                k: decode_fixed_point(encode_fixed_point(v.numpy(), bits, 1), bits) for k, v in upload.arrays().items()
            }
            gram += torch.from_numpy(enc["gram-packed"])
            block = strategy.split.tasks[task]
            sums[:, block.start : block.stop] += torch.from_numpy(enc["class-sums"]).reshape(dim, -1)
            total += int(enc["counts"][:-1].sum())
    return unpack_upper(gram, dim), sums, total


def test_a_sites_own_sample_request_leaves_the_secure_run_that_never_had_those_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Site 2 lists rows of its stage-1 and stage-2 data; the secure forget round after stage 2
    removes them (requested by the site: no consent knob needed). Afterwards, and after the later
    stages, the server's G, C and n are exactly the fixed-point sum of what every site keeps, and
    equal, bit for bit, those of a secure run whose site 2 never had those rows (small batches, so
    the kept statistics are accumulated over several, as that run's are)."""
    store = tmp_path / "store"
    rows = tmp_path / "forget.txt"
    rows.write_text("1,0\n1,2\n2,1\n")
    strategy, weights, forget_grams, _ = _run(
        _cfg(tmp_path, "samples", forget=str(AFTER), batch_size=BATCH),
        _nodes(store, **{"2": {"forget-samples": str(rows)}}),
    )
    (event,) = strategy.unlearning_log[0]["requests"]
    assert (event["who"], event["what"], event["requested_by"], event["removed_samples"]) == (
        "client-2",
        "samples",
        "site",
        3,
    )
    assert json.loads((store / "partition-2" / "forgotten.json").read_text()) == {
        "rows": {"0": [0, 2], "1": [1]},
        "classes": [],
    }
    gram, sums, total = _kept_sum(strategy, store, strategy.cfg.secagg_fraction_bits)
    assert torch.equal(strategy.ridge.gram, gram) and torch.equal(strategy.ridge.class_sums, sums)
    assert strategy.ridge.num_samples == total
    # the run in which site 2 never had those rows (its data of stages 1 and 2 without them)
    dropped = {0: [0, 2], 1: [1]}
    original = stsa_client.task_data

    def without_rows(job, task):
        data = original(job, task)
        if job.partition != 2 or task not in dropped:
            return data
        keep = np.ones(len(data), dtype=bool)
        keep[dropped[task]] = False
        return data.subset(keep)

    monkeypatch.setattr(stsa_client, "task_data", without_rows)
    never, never_weights, _, _ = _run(
        _cfg(tmp_path, "never-had-them", batch_size=BATCH), _nodes(tmp_path / "never-store")
    )
    assert torch.equal(strategy.ridge.gram, never.ridge.gram)
    assert torch.equal(strategy.ridge.class_sums, never.ridge.class_sums)
    assert strategy.ridge.num_samples == never.ridge.num_samples
    _, _, resolved = forget_grams[AFTER - 1]
    assert relative(weights[AFTER - 1], never_weights[AFTER - 1]) > 0  # before the round: the rows were in
    assert relative(resolved, never_weights[AFTER - 1]) <= TOL
    for stage in range(AFTER, TASKS):
        assert relative(weights[stage], never_weights[stage]) <= TOL


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"noise_q": 1.0, "noise_s": 0.1}, "forget works with uploads in Gram form without noise"),
        ({"stats_form": "factor"}, "forget works with uploads in Gram form without noise"),
    ],
)
def test_forget_under_secure_aggregation_refuses_noise_and_the_factor_form(
    tmp_path: Path, changes: dict, message: str
) -> None:
    base: dict[str, Any] = dict(
        dataset="digits", num_clients=3, num_tasks=5, out=str(tmp_path), forget="3:1", secure_aggregation=True
    )
    assert RunConfig(**base).validated().forget_requests() == {3: (1,)}  # accepted on its own
    with pytest.raises(ConfigError, match=message):
        RunConfig(**base, **changes).validated()
