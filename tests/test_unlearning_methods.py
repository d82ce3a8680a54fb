"""Issue 33's forget round for STSA-E and FedRAN on real runs (in process, digits, through the real
ClientApp and the strategy's own loop): site 1 withdraws after stage 2 (run config forget "2:1"),
the run is stopped after stage 3 and resumed, and W equals the run that never had site 1's
statistics at that stage and every later one (≤ 1e-10 relative, γ re-selected by GCV under
``ridge auto``). STSA-E takes the site's uploads out of every Eq. 9 input of each stage it
contributed to and swaps the stage's Ĝ; FedRAN merges the kept summaries again in the same order
(under truncation) and subtracts B. A removal whose upload is not the committed one is refused
with its reason and changes nothing; after the resume an honest removal still finds what it must
take out (the estimator state and the kept summaries survive the checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clients.upload_store import load_arrays, save_arrays, store_sizes
from fcl_flower.analytic.errors import AnalyticInputError
from fcl_flower.analytic.estimator import GramEstimator
from fcl_flower.analytic.lowrank import LowRankSummary, merge_two_level
from fcl_flower.analytic.subspace import pad_label_corr
from fcl_flower.protocol.payloads import FedranStats, StsaEStats
from strategies import loop
from strategies.unlearning import ForgetRefused
from tests.conftest import reply_partition, run_in_process, small_config
from tests.test_checkpoint_trust import Checkpoint, refused
from tests.test_unlearning_strategy import _drop, _run, _stopped_then_resumed, relative

LEAVER, TASKS, CLIENTS, AFTER = 1, 5, 3, 2
TOL = 1e-10
METHODS = {
    "stsa-e": ({"dummy_clients": 2}, StsaEStats),
    "fedran": ({"rank": 20}, FedranStats),  # r < M: the merges truncate
}


def _cfg(out: Path, strategy: str, name: str, **changes):
    knobs = {"num_tasks": TASKS, **METHODS[strategy][0], **changes}
    return small_config(out, strategy=strategy, num_clients=CLIENTS, ridge="auto", rf_dim=100, run_name=name, **knobs)


def _nodes(store: Path) -> list[dict]:
    return [{"partition-id": k, "num-partitions": CLIENTS, "upload-store": str(store)} for k in range(CLIENTS)]


def _kept(store: Path, strategy: str, partition: int) -> dict:
    """What a site kept of each stage, as the payloads the server reads."""
    payload = METHODS[strategy][1]
    uploads = {}
    for task in store_sizes(store, partition):
        arrays, _, _ = load_arrays(store, partition, task, payload.KEYS)
        uploads[task] = payload(*(arrays[key] for key in payload.KEYS))
    return uploads


@pytest.fixture(scope="module", params=sorted(METHODS))
def withdrawal(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Site 1 withdraws after stage 2, the run stops after stage 3 (checkpointed after the forget
    round) and resumes; the run that never had site 1's statistics; W right after the removal."""
    strategy = request.param
    out = tmp_path_factory.mktemp(f"unlearning-{strategy}")
    store = out / "store"
    cfg = _cfg(out, strategy, "withdraws", forget=f"{AFTER}:{LEAVER}")
    weights: list[torch.Tensor] = []
    resolved: list[torch.Tensor] = []

    def after_forget_round(running, task: int) -> None:
        if task == AFTER - 1:  # the forget round has just re-solved
            resolved.append(running.weights.clone())

    full, _ = _stopped_then_resumed(cfg, _nodes(store), weights, AFTER, after_forget_round)
    assert len(resolved) == 1
    never = run_in_process(_cfg(out, strategy, "never"), _drop(LEAVER))
    return strategy, full, weights, resolved[0], never, store


def test_a_site_that_withdraws_leaves_the_weights_of_a_run_that_never_had_it(withdrawal) -> None:
    strategy, full, weights, resolved, never, store = withdrawal
    record = full.unlearning_log[0]
    assert record["after_stage"] == AFTER
    assert [(r["who"], r["task"], r["what"]) for r in record["requests"]] == [
        (f"client-{LEAVER}", t, "client") for t in range(AFTER)
    ]
    kept_samples = sum(load_arrays(store, LEAVER, t, METHODS[strategy][1].KEYS)[1] for t in range(AFTER))
    assert sum(r["removed_samples"] for r in record["requests"]) == kept_samples > 0
    # before the removal site 1 was in W; right after it, and at every later stage, W is the run without it
    assert relative(weights[AFTER - 1], never.stage_weights[AFTER - 1]) > 1e-6
    assert relative(resolved, never.stage_weights[AFTER - 1]) <= TOL
    assert record["ridge_after"] == never.recorder.stages[AFTER - 1].extra["ridge"]  # γ re-selected alike
    assert record["accuracy_after"] == pytest.approx(never.recorder.stages[AFTER - 1].accuracy, abs=1e-9)
    for task in range(AFTER, TASKS):
        assert relative(weights[task], never.stage_weights[task]) <= TOL
        assert full.recorder.stages[task].extra["ridge"] == never.recorder.stages[task].extra["ridge"]
    saved = json.loads(full.recorder.path.read_text())
    assert saved["unlearning"][0]["after_stage"] == AFTER
    for stage in saved["stages"][AFTER:]:  # the withdrawn site got no later round and owes nothing
        assert f"client-{LEAVER}" not in stage["clients"] and not stage["left_out"]
    assert sorted(store_sizes(store, LEAVER)) == list(range(AFTER))
    if strategy == "fedran":
        assert full.summary_state.discarded.trace > 0  # the merges truncated: exact only by re-merging
        assert full.num_samples == never.num_samples
    else:
        assert full.ridge.num_samples == never.ridge.num_samples


def test_a_removal_that_does_not_match_the_commitment_is_refused_and_an_honest_one_after_the_resume_is_exact(
    withdrawal,
) -> None:
    """On the resumed run's final state: a tampered, a foreign and a partial removal of site 2 are
    refused, nothing changes; its honest removal then leaves exactly site 0's statistics (the
    estimator state and the kept summaries came back from the checkpoint intact)."""
    strategy, full, _, _, _, store = withdrawal
    payload = METHODS[strategy][1]
    mine, other = _kept(store, strategy, 2), _kept(store, strategy, 0)
    before = {k: v.clone() for k, v in _state(full).items()}
    tampered = dict(mine)
    arrays = mine[1].arrays()
    first = next(iter(arrays))
    tampered[1] = payload(*(arrays[k] * (1.5 if k == first else 1.0) for k in payload.KEYS))
    with pytest.raises(ForgetRefused, match="not the one the server accepted"):
        full.forget_site("client-2", tampered)
    with pytest.raises(ForgetRefused, match="not the one the server accepted"):
        full.forget_site("client-2", other)  # another site's uploads: digests bound to client-0
    with pytest.raises(ForgetRefused, match=r"stage\(s\) \[3, 4, 5\]"):
        full.forget_site("client-2", {0: mine[0], 1: mine[1]})
    # the withdrawn site has nothing left to take out: its kept uploads remove nothing
    assert full.forget_site(f"client-{LEAVER}", _kept(store, strategy, LEAVER)) == []
    for name, value in _state(full).items():
        assert torch.equal(value, before[name]), name  # nothing was applied
    assert len(full.commitments.tasks_of("client-2")) == TASKS

    full.forget_site("client-2", mine)
    assert full.commitments.tasks_of("client-2") == []
    if strategy == "stsa-e":
        for task in range(TASKS):
            alone = GramEstimator(full.rf_dim, len(full.split.tasks[task]), k_mode=full.k_mode)
            alone.add(other[task].class_sums, other[task].counts)
            assert relative(full.estimators[task].result(), alone.result()) <= TOL
        gram = sum(
            _estimate(full, task, other[task]) for task in range(TASKS)
        )  # Σ over stages of site 0's own estimate
        assert relative(full.ridge.gram, gram) <= TOL
        return
    state = LowRankSummary.empty(full.rf_dim)
    corr = torch.zeros(full.rf_dim, 0, dtype=torch.float64)
    for task in range(TASKS):
        _, samples, _ = load_arrays(store, 0, task, FedranStats.KEYS)
        summary = LowRankSummary(other[task].basis, other[task].singular_values, samples)
        state = merge_two_level([summary], state, full.stage_ranks[task])
        corr = pad_label_corr(corr, full.num_seen(task)) + other[task].label_corr
    assert torch.equal(full.summary_state.basis, state.basis)  # the very merges of site 0 alone
    assert torch.equal(full.summary_state.singular_values, state.singular_values)
    assert relative(full.label_corr, corr) <= TOL


@pytest.mark.parametrize("strategy", sorted(METHODS))
def test_a_removal_whose_kept_upload_changed_is_refused_in_the_forget_round_and_changes_nothing(
    strategy: str, tmp_path: Path
) -> None:
    """Site 1's kept upload of stage 1 is altered on its disk before the forget round after stage 1
    (forget "1:1"): the server refuses the removal (its digest is not the commitment's), records
    why, W stays what it was, and the site is not withdrawn: it takes part in stage 2."""
    store = tmp_path / "store"
    keys = METHODS[strategy][1].KEYS
    solved: list[torch.Tensor] = []

    def alter(running, task: int) -> None:
        if task == 0:
            arrays, samples, meta = load_arrays(store, LEAVER, 0, keys)
            changed = "class-sums" if strategy == "stsa-e" else "label-corr"  # still a well-formed upload
            arrays[changed] = arrays[changed] * 1.5
            save_arrays(store, LEAVER, 0, arrays, samples, run=meta["run"], client=meta["client"])

    def resolved(running, task: int) -> None:
        solved.append(running.weights.clone())

    cfg = _cfg(tmp_path / "out", strategy, "altered", num_tasks=2, forget=f"1:{LEAVER}")
    with pytest.MonkeyPatch.context() as patch:
        save = loop.save
        patch.setattr(loop, "save", lambda running, task: (resolved(running, task), save(running, task)))
        full, weights = _run(cfg, _nodes(store), after_stage=alter)
    (refused,) = full.unlearning_log[0]["requests"]
    assert refused["who"] == f"client-{LEAVER}" and "not the one the server accepted" in refused["refused"]
    assert torch.equal(solved[0], weights[0])  # the re-solve found the state unchanged
    assert full.nodes.withdrawn == set() and f"client-{LEAVER}" in full.recorder.stages[1].clients
    assert full.commitments.tasks_of(f"client-{LEAVER}") == [0, 1]


def test_a_sites_own_sample_request_is_refused_with_its_reason_under_stsa_e(tmp_path: Path) -> None:
    """STSA-E forgets whole sites only: site 2's node config lists samples to forget, so its forget
    reply is an error whose reason the round records; site 1's withdrawal is applied all the same."""
    rows = tmp_path / "forget.txt"
    rows.write_text("1,0\n")
    nodes = _nodes(tmp_path / "store")
    nodes[2]["forget-samples"] = str(rows)
    cfg = _cfg(tmp_path / "out", "stsa-e", "samples", num_tasks=2, forget=f"1:{LEAVER}")
    full, _ = _run(cfg, nodes)
    requests = full.unlearning_log[0]["requests"]
    assert [(r["who"], r["what"]) for r in requests if "refused" not in r] == [(f"client-{LEAVER}", "client")]
    (refused,) = [r for r in requests if "refused" in r]
    assert refused["who"] == "client-2" and "stsa-e forgets whole sites only" in refused["refused"]
    assert full.nodes.withdrawn == {LEAVER} and "client-2" in full.recorder.stages[1].clients


class ServerKilled(Exception):
    """The server dies right after the checkpoint of stage 1 (of 2)."""


@pytest.mark.parametrize(
    ("strategy", "path", "field", "message"),
    [
        ("stsa-e", ("estimators", "0"), "num_uploads", "field 'state/estimators/0' is not an estimator state"),
        ("fedran", ("site_summaries", "0", "2"), "num_samples", "field 'state/site_summaries/0/2/num_samples'"),
    ],
)
def test_a_resigned_checkpoint_with_a_bad_kept_state_is_refused_with_its_field(
    strategy: str, path: tuple[str, ...], field: str, message: str, tmp_path: Path
) -> None:
    """What a removal needs after a resume (STSA-E's estimators, FedRAN's per-site summaries) is
    checked like every other field of a checkpoint, even one signed with the installation's key."""
    cfg = _cfg(tmp_path / "out", strategy, "killed", num_tasks=2, forget=f"1:{LEAVER}")
    save = loop.save

    def save_then_die(running, task: int) -> None:
        save(running, task)
        raise ServerKilled

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "save", save_then_die)
        with pytest.raises(ServerKilled):
            _run(cfg, _nodes(tmp_path / "store"))
    ck = Checkpoint(cfg.output_dir)
    ck.node("state", *path)[field] = -1
    ck.resigned()
    assert message in refused(cfg.replace(resume=True))


def test_stsa_e_late_statistics_go_into_the_kept_estimator_and_a_withdrawal_stays_exact(tmp_path: Path) -> None:
    """Site 2 misses stage 1 and sends it late with stage 2 (backfill); site 1 withdraws after
    stage 2. The late upload goes into stage 1's kept estimator and is committed, so W equals the
    run that never had site 1 (and got site 2's stage 1 late too) at stages 2 to 5."""

    def late(task: int, phase: str, replies: list) -> list:
        return [r for r in replies if r.has_error() or not (task == 0 and reply_partition(r) == 2)]

    def late_and_never(task: int, phase: str, replies: list) -> list:
        return _drop(LEAVER)(task, phase, late(task, phase, replies))

    store = tmp_path / "store"
    cfg = _cfg(tmp_path / "out", "stsa-e", "late", forget=f"{AFTER}:{LEAVER}")
    full, weights = _run(cfg, _nodes(store), tamper=late)
    never = run_in_process(_cfg(tmp_path / "out", "stsa-e", "late-never"), late_and_never)
    assert full.recorder.stages[0].extra["statistics_missing"] == {"client-2": [1]}  # owed, sent with stage 2
    assert never.recorder.stages[0].extra["statistics_missing"]["client-2"] == [1]
    assert full.commitments.tasks_of("client-2") == list(range(TASKS))  # the late one committed too
    assert relative(weights[AFTER - 1], never.stage_weights[AFTER - 1]) > 1e-6
    for task in range(AFTER, TASKS):
        assert relative(weights[task], never.stage_weights[task]) <= TOL


def test_an_estimator_state_round_trips_and_a_bad_one_is_refused_with_its_field() -> None:
    torch.manual_seed(0)
    estimator = GramEstimator(6, 2, k_mode="per-class")
    estimator.add(torch.rand(3, 6, 2), torch.tensor([[2.0, 0.0], [1.0, 3.0], [4.0, 1.0]]))
    back = GramEstimator.from_state(estimator.state_dict(), 6, 2)
    assert torch.equal(back.result(), estimator.result())
    bad = {**estimator.state_dict(), "holders": torch.tensor([9, 9])}
    with pytest.raises(AnalyticInputError, match="holders exceed its number of uploads"):
        GramEstimator.from_state(bad, 6, 2)
    with pytest.raises(AnalyticInputError, match=r"class_sums must be a torch\.float64 tensor of shape"):
        GramEstimator.from_state({**estimator.state_dict(), "class_sums": torch.zeros(5, 2)}, 6, 2)
    with pytest.raises(AnalyticInputError, match="columns and dense must be lists of 2 classes"):
        GramEstimator.from_state({**estimator.state_dict(), "dense": [None]}, 6, 2)


def _estimate(strategy, task: int, stats: StsaEStats) -> torch.Tensor:
    alone = GramEstimator(strategy.rf_dim, len(strategy.split.tasks[task]), k_mode=strategy.k_mode)
    alone.add(stats.class_sums, stats.counts)
    return alone.result()


def _state(strategy) -> dict[str, torch.Tensor]:
    if hasattr(strategy, "ridge"):
        return {"gram": strategy.ridge.gram, "class_sums": strategy.ridge.class_sums}
    return {"basis": strategy.summary_state.basis, "label_corr": strategy.label_corr}
