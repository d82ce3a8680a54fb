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

from clients.upload_store import load_arrays, store_sizes
from fcl_flower.analytic.estimator import GramEstimator
from fcl_flower.analytic.lowrank import LowRankSummary, merge_two_level
from fcl_flower.analytic.subspace import pad_label_corr
from fcl_flower.protocol.payloads import FedranStats, StsaEStats
from strategies.unlearning import ForgetRefused
from tests.conftest import run_in_process, small_config
from tests.test_unlearning_strategy import _drop, _stopped_then_resumed, relative

LEAVER, TASKS, CLIENTS, AFTER = 1, 5, 3, 2
TOL = 1e-10
METHODS = {
    "stsa-e": ({"dummy_clients": 2}, StsaEStats),
    "fedran": ({"rank": 20}, FedranStats),  # r < M: the merges truncate
}


def _cfg(out: Path, strategy: str, name: str, **changes):
    knobs = METHODS[strategy][0]
    return small_config(
        out,
        strategy=strategy,
        num_tasks=TASKS,
        num_clients=CLIENTS,
        ridge="auto",
        rf_dim=100,
        run_name=name,
        **knobs,
        **changes,
    )


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


def _estimate(strategy, task: int, stats: StsaEStats) -> torch.Tensor:
    alone = GramEstimator(strategy.rf_dim, len(strategy.split.tasks[task]), k_mode=strategy.k_mode)
    alone.add(stats.class_sums, stats.counts)
    return alone.result()


def _state(strategy) -> dict[str, torch.Tensor]:
    if hasattr(strategy, "ridge"):
        return {"gram": strategy.ridge.gram, "class_sums": strategy.ridge.class_sums}
    return {"basis": strategy.summary_state.basis, "label_corr": strategy.label_corr}
