"""Issue 33 on real STSA runs (in process, digits, through the real ClientApp): sites keep their
uploads on disk (atomic, mode 0600), the server keeps a digest of every accepted upload, a site
withdraws in a forget round between stages (run config ``forget``) and W equals the run that never
had it (≤ 1e-10, γ re-selected by GCV) at that stage and every later one; a site forgets some of
its samples (node config ``forget-samples``); removals that do not match what was added are
refused with their reason."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch
from flwr.app import Message

from clients.app import app as client_app
from clients.upload_store import load_upload, store_sizes, upload_path
from clients.upload_store import main as store_main
from fcl_flower import interrupt
from fcl_flower.analytic.packing import unpack_upper
from fcl_flower.analytic.ridge import select_ridge_gcv, solve_ridge
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.local_grid import LocalGrid
from fcl_flower.methods import Kind
from fcl_flower.runtime import federated_split
from strategies import loop
from strategies.nodes import NodeDirectory
from strategies.unlearning import ForgetRefused, as_upload
from tests.conftest import NODE_BASE, build, reply_partition, run_in_process, sent_header, server_identity, small_config

LEAVER, TASKS, CLIENTS, AFTER = 1, 5, 3, 3
TOL = 1e-10


def _drop(partition: int):
    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        return [r for r in replies if r.has_error() or reply_partition(r) != partition]

    return tamper


def _cfg(out_dir: Path, name: str, **changes):
    return small_config(
        out_dir, num_tasks=TASKS, num_clients=CLIENTS, ridge="auto", rf_dim=100, run_name=name, **changes
    )


def _run(cfg, node_configs: list[dict], weights: list[torch.Tensor] | None = None, tamper=None, after_stage=None):
    """Run ``cfg`` through the strategy's loop on nodes with these node configs; (the strategy, W
    after each stage's solve, appended to ``weights`` if given). ``tamper(task, phase, replies)``
    filters the replies; ``after_stage(strategy, task)`` runs after each stage's solve."""
    server_identity()
    strategy = build(cfg)
    weights = [] if weights is None else weights
    end_stage = strategy.end_stage

    def spy(task: int):
        extra = end_stage(task)
        weights.append(strategy.weights.clone())  # type: ignore[attr-defined]
        if after_stage is not None:
            after_stage(strategy, task)
        return extra

    def hook(sent: list[Message], replies: list[Message]) -> list[Message]:
        header = sent_header(sent[0])
        return tamper(header.task, header.phase, replies) if tamper is not None else replies

    strategy.end_stage = spy  # type: ignore[method-assign]
    grid = LocalGrid(client_app, cfg.num_clients, first_node_id=NODE_BASE, node_configs=node_configs, tamper=hook)
    strategy.start(grid)
    return strategy, weights


def _nodes(store: Path, **extra: dict) -> list[dict]:
    return [
        {"partition-id": k, "num-partitions": CLIENTS, "upload-store": str(store), **extra.get(str(k), {})}
        for k in range(CLIENTS)
    ]


@pytest.fixture(scope="module")
def withdrawal(tmp_path_factory: pytest.TempPathFactory):
    """Site 1 withdraws after stage 3 (forget = "3:1"), the run stopped after stage 4 and resumed
    (so every property below holds across a resume too), and the run that never had site 1."""
    out = tmp_path_factory.mktemp("unlearning")
    store = out / "store"
    cfg = _cfg(out, "withdraws", forget=f"{AFTER}:{LEAVER}")
    weights: list[torch.Tensor] = []
    full, _ = _stopped_then_resumed(cfg, _nodes(store), weights, AFTER)  # stage 4 checkpointed, then stopped
    never = run_in_process(_cfg(out, "never"), _drop(LEAVER))
    return full, weights, never, store


def _stopped_then_resumed(cfg, nodes: list[dict], weights: list[torch.Tensor], stop: int, seen=None):
    """Run ``cfg`` until stage ``stop`` + 1 is checkpointed (after any forget round of the stage
    before), stop it there and resume it to the end: (the strategy, W after each stage).
    ``seen(strategy, task)`` looks at the strategy before each checkpoint."""
    save = loop.save

    def save_then_stop(strategy, task):
        if seen is not None:
            seen(strategy, task)
        save(strategy, task)
        if task == stop:
            interrupt.request_stop()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "save", save_then_stop)
        try:
            with pytest.raises(interrupt.RunInterrupted):
                _run(cfg, nodes, weights)
        finally:
            interrupt.clear()
    assert len(weights) == stop + 1
    return _run(cfg.replace(resume=True), nodes, weights)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


def test_every_upload_is_kept_atomically_mode_0600_and_its_size_reported(withdrawal, capsys) -> None:
    full, _, _, store = withdrawal
    for partition in range(CLIENTS):
        sizes = store_sizes(store, partition)
        assert sorted(sizes) == list(range(AFTER if partition == LEAVER else TASKS))  # no upload after leaving
        for task, size in sizes.items():
            path = upload_path(store, partition, task)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert size == path.stat().st_size > 0
        assert stat.S_IMODE((store / f"partition-{partition}").stat().st_mode) == 0o700
        assert not list((store / f"partition-{partition}").glob(".*.tmp"))  # no temporary left behind
    _, samples, meta = load_upload(store, 0, 0)
    assert meta["client"] == "client-0" and samples > 0
    assert meta["run"] != full.run_id == load_upload(store, 0, TASKS - 1)[2]["run"]  # stopped, resumed in a new process
    assert store_main([str(store)]) == 0  # the site operator's report: bytes per stage
    report = capsys.readouterr().out.splitlines()
    sizes = store_sizes(store, LEAVER)
    assert f"partition {LEAVER}: {AFTER} stage(s), {sum(sizes.values())} bytes" in report
    assert f"  stage 1: {sizes[0]} bytes" in report


def test_a_site_that_withdraws_leaves_the_weights_of_a_run_that_never_had_it(withdrawal) -> None:
    full, weights, never, _ = withdrawal
    record = full.unlearning_log[0]
    assert record["after_stage"] == AFTER
    assert [(r["who"], r["task"], r["what"]) for r in record["requests"]] == [
        (f"client-{LEAVER}", t, "client") for t in range(AFTER)
    ]
    removed = sum(r["removed_samples"] for r in record["requests"])
    assert removed == sum(load_upload(Path(full.cfg.output_dir).parent / "store", LEAVER, t)[1] for t in range(AFTER))
    assert record["ridge_after"] == never.recorder.stages[AFTER - 1].extra["ridge"]  # γ re-selected alike
    # before the removal site 1 was in W; right after it, and at every later stage, W is the run without it
    assert relative(weights[AFTER - 1], never.stage_weights[AFTER - 1]) > 1e-6
    saved = json.loads(full.recorder.path.read_text())
    after = saved["unlearning"][0]
    assert after["accuracy_after"] == pytest.approx(never.recorder.stages[AFTER - 1].accuracy, abs=1e-9)
    assert after["per_task_after"] == pytest.approx(never.recorder.stages[AFTER - 1].per_task_accuracy, abs=1e-9)
    for task in range(AFTER, TASKS):
        assert relative(weights[task], never.stage_weights[task]) <= TOL
    assert relative(full.weights, never.weights) <= TOL
    # the withdrawn site got no later round and owes nothing; the others never missed a stage
    for stage in saved["stages"][AFTER:]:
        assert f"client-{LEAVER}" not in stage["clients"] and not stage["left_out"]
        assert "statistics_missing" not in stage["extra"]
    assert full.ridge.num_samples == never.ridge.num_samples


def test_refused_removals_name_their_reason_and_change_nothing(withdrawal) -> None:
    full, _, _, store = withdrawal
    gram = full.ridge.gram.clone()
    mine = {t: load_upload(store, 0, t)[:2] for t in range(TASKS)}
    other = load_upload(store, 2, 0)[:2]
    # another site's upload sent as one's own: its digest is bound to client-2
    with pytest.raises(ForgetRefused, match="not the one the server accepted"):
        full.forget("client-0", 0, *other)
    # one's own upload, inflated (claims more samples than were added)
    stats, samples = mine[1]
    inflated = type(stats)(stats.gram_packed * 2, stats.class_sums * 2, stats.counts * 2)
    with pytest.raises(ForgetRefused, match="not the one the server accepted"):
        full.forget("client-0", 1, inflated, 2 * samples)
    # the right upload, but a 'kept' part larger than it: would forget a negative amount
    with pytest.raises(ForgetRefused, match="no dataset's statistics"):
        full.forget("client-0", 1, stats, samples, inflated, 2 * samples)
    # a whole-site removal must name every stage the site contributed to
    with pytest.raises(ForgetRefused, match=r"stage\(s\) \[3, 4, 5\]"):
        full.forget_client("client-0", {0: mine[0], 1: mine[1]})
    # the withdrawn site has nothing left to forget
    with pytest.raises(ForgetRefused, match="no accepted upload"):
        full.forget(f"client-{LEAVER}", 0, *load_upload(store, LEAVER, 0)[:2])
    assert torch.equal(full.ridge.gram, gram)  # nothing was applied
    # every commitment matches what the sites kept
    for (client, task), entry in full.commitments.entries.items():
        stats, samples, _ = load_upload(store, int(client.rsplit("-", 1)[1]), task)
        assert full.commitments.verify(client, task, as_upload(stats, samples)) == entry


def test_a_site_forgets_some_of_its_samples_and_a_class_by_its_own_request(tmp_path: Path) -> None:
    """Site 2's node config lists rows of its stage-1 and stage-2 data and class 4 (stage 3); the
    forget round after stage 3 swaps those uploads for the kept samples' statistics. The server's G,
    C and n then equal the sum of what every site now keeps, and W the GCV ridge on it."""
    store = tmp_path / "store"
    rows = tmp_path / "forget.txt"
    rows.write_text("# stage,row\n1,0\n1,4\n2,3\nclass,4\n")
    cfg = _cfg(tmp_path / "out", "samples", forget="3")
    strategy, _ = _run(cfg, _nodes(store, **{"2": {"forget-samples": str(rows)}}))
    record = strategy.unlearning_log[0]
    requests = [(r["who"], r["task"], r["what"], r["removed_samples"]) for r in record["requests"]]
    assert requests[:2] == [("client-2", 0, "samples", 2), ("client-2", 1, "samples", 1)]
    class4 = record["requests"][2]
    assert (class4["who"], class4["task"], class4["what"]) == ("client-2", 2, "samples")
    assert class4["removed_counts"] == {"4": class4["removed_samples"]} and class4["removed_samples"] > 0
    kept, _, _ = load_upload(store, 2, 2)
    assert float(kept.counts[0]) == 0.0 and not bool(kept.class_sums[:, 0].any())  # class 4: nothing kept
    assert json.loads((store / "partition-2" / "forgotten.json").read_text()) == {
        "rows": {"0": [0, 4], "1": [3]},
        "classes": [4],
    }
    # after the last stage: the server's statistics are the sum of the kept uploads, exactly
    dim = strategy.rf_dim
    gram = torch.zeros(dim, dim, dtype=torch.float64)
    sums = torch.zeros(dim, strategy.split.num_classes, dtype=torch.float64)
    total = 0
    for partition in range(CLIENTS):
        for task in range(TASKS):
            stats, samples, _ = load_upload(store, partition, task)
            gram += unpack_upper(stats.gram_packed.to(torch.float64), dim)
            classes = strategy.split.tasks[task]
            sums[:, classes.start : classes.stop] += stats.class_sums
            total += samples
    assert strategy.ridge.num_samples == total
    assert relative(strategy.ridge.gram, gram) <= TOL and relative(strategy.ridge.class_sums, sums) <= TOL
    gamma, _ = select_ridge_gcv(gram, sums, total, float(total))
    assert relative(strategy.weights, solve_ridge(gram, sums, gamma)) <= TOL


def test_stage1_exclude_keeps_a_site_out_of_stage1_fedavg_only_and_withdrawn_sites_out_of_everything(
    tmp_path: Path,
) -> None:

    cfg = RunConfig(dataset="digits", num_clients=3, stage1_exclude="2", out=str(tmp_path)).validated()
    nodes = NodeDirectory(cfg, federated_split(cfg))
    nodes.client_of = {11: 0, 12: 1, 13: 2}
    fedavg = nodes.targets([11, 12, 13], 0, "fedavg", 0, Kind.TRAIN, lambda _: None)
    assert fedavg.nodes == [11, 12] and fedavg.expected == {"client-0", "client-1"}
    stats = nodes.targets([11, 12, 13], 0, "stsa-stats", 0, Kind.STATS, lambda _: None)
    assert stats.nodes == [11, 12, 13]  # its statistics still go in: the backbone alone never saw it
    nodes.withdrawn.add(0)
    later = nodes.targets([11, 12, 13], 3, "stsa-stats", 0, Kind.STATS, lambda _: None)
    assert later.nodes == [12, 13] and later.expected == {"client-1", "client-2"}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"forget": "9:1"}, "must start with a stage in 1..5"),
        ({"forget": "3:7"}, "not a client id in 0..2"),
        ({"stage1_exclude": "a"}, "not a client id"),
        ({"forget": "3:1", "strategy": "joint"}, "strategy joint has no forget round .*stsa, stsa-e, fedran"),
        ({"forget": "3:1", "strategy": "lwf"}, "strategy lwf has no forget round"),
        ({"forget": "3:1", "stats_form": "factor"}, "forget works with uploads in Gram form without noise"),
        ({"forget": "3:1", "strategy": "stsa-e", "noise_q": 0.1, "noise_s": 1.0}, "forget works with uploads in Gram"),
        (
            {"forget": "3:1", "secure_aggregation": True, "noise_q": 1.0, "noise_s": 0.1},
            "forget works with uploads in Gram form without noise",
        ),
        ({"forget": "3", "strategy": "stsa-e"}, "'3' .* works with strategy stsa; stsa-e forgets whole sites only"),
        ({"forget": "2:1,3", "strategy": "fedran"}, "'3' .* works with strategy stsa; fedran forgets whole sites"),
    ],
)
def test_bad_unlearning_knobs_are_refused_with_one_line(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig(dataset="digits", num_clients=3, num_tasks=5, out=str(tmp_path), **changes).validated()
    assert RunConfig(forget="3:1,5", num_tasks=5, num_clients=3).validated().forget_requests() == {3: (1,), 5: ()}
    for strategy in ("stsa-e", "fedran"):  # whole sites
        assert RunConfig(strategy=strategy, forget="3:1", num_tasks=5, num_clients=3).validated().forget == "3:1"


def test_the_resumed_run_keeps_the_site_out_and_its_commitments_and_record(withdrawal) -> None:
    """The fixture's run stopped after stage 4 and resumed: the withdrawn site stays out, every
    commitment (from before and after the stop) matches what the sites kept, the record is back."""
    full, weights, _, store = withdrawal
    assert len(weights) == TASKS and full.nodes.withdrawn == {LEAVER}
    assert sorted(full.commitments.entries) == [
        (f"client-{c}", t) for c in range(CLIENTS) for t in range(TASKS) if c != LEAVER
    ]
    for (client, task), entry in full.commitments.entries.items():
        stats, samples, meta = load_upload(store, int(client.rsplit("-", 1)[1]), task)
        assert entry.run == meta["run"] and (entry.run != full.run_id) == (task <= AFTER)
        assert full.commitments.verify(client, task, as_upload(stats, samples)) == entry
    saved = json.loads(full.recorder.path.read_text())
    assert len(saved["stages"]) == TASKS and saved["unlearning"][0]["after_stage"] == AFTER
