"""Issue 33 on a real STSA run (in process, digits): clients keep their uploads on disk (atomic,
mode 0600), the server keeps a digest of every accepted upload, a site withdraws and W equals the
run that never had it (≤ 1e-10, γ re-selected by GCV), and removals that do not match what was
added are refused with their reason."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch
from flwr.app import Message

from clients.upload_store import load_upload, store_sizes, upload_path
from strategies.unlearning import ForgetRefused, as_upload
from tests.conftest import reply_partition, run_in_process, small_config

LEAVER = 1
TASKS = 5


def _drop(partition: int):
    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        return [r for r in replies if r.has_error() or reply_partition(r) != partition]

    return tamper


def _cfg(out_dir: Path, name: str):
    return small_config(out_dir, num_tasks=5, num_clients=3, ridge="auto", run_name=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """A run with every site keeping its uploads, and the run that never had site 1's statistics."""
    out = tmp_path_factory.mktemp("unlearning")
    store = out / "store"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FCL_UPLOAD_STORE", str(store))
        full = run_in_process(_cfg(out, "full"))
    never = run_in_process(_cfg(out, "never"), _drop(LEAVER))
    return full, never, store


def _kept(store: Path, partition: int, tasks: int):
    return {task: load_upload(store, partition, task)[:2] for task in range(tasks)}


def test_every_upload_is_kept_atomically_mode_0600_and_its_size_reported(runs) -> None:
    full, _, store = runs
    for partition in range(3):
        sizes = store_sizes(store, partition)
        assert sorted(sizes) == list(range(TASKS))
        for task, size in sizes.items():
            path = upload_path(store, partition, task)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert size == path.stat().st_size > 0
        assert stat.S_IMODE((store / f"partition-{partition}").stat().st_mode) == 0o700
        assert not list((store / f"partition-{partition}").glob(".*.tmp"))  # no temporary left behind
    _, samples, meta = load_upload(store, 0, 0)
    assert meta["run"] == full.run_id and meta["client"] == "client-0" and samples > 0


def test_the_server_commits_to_every_accepted_upload_and_the_kept_bytes_match(runs) -> None:
    full, _, store = runs
    assert sorted(full.commitments.entries) == [(f"client-{c}", t) for c in range(3) for t in range(TASKS)]
    for (client, task), entry in full.commitments.entries.items():
        stats, samples = _kept(store, int(client.rsplit("-", 1)[1]), TASKS)[task]
        assert entry.num_samples == samples
        assert full.commitments.verify(client, task, _upload(stats, samples)) == entry


def _upload(stats, samples):
    return as_upload(stats, samples)


def test_refused_removals_name_their_reason_and_change_nothing(runs) -> None:
    full, _, store = runs
    gram = full.ridge.gram.clone()
    other = _kept(store, 0, TASKS)
    mine = _kept(store, LEAVER, TASKS)
    # another site's upload sent as one's own: its digest is bound to client-0
    with pytest.raises(ForgetRefused, match="not the one the server accepted"):
        full.forget(f"client-{LEAVER}", 0, *other[0])
    # one's own upload, inflated (more samples than were added)
    stats, samples = mine[1]
    inflated = type(stats)(stats.gram_packed * 2, stats.class_sums * 2, stats.counts * 2)
    with pytest.raises(ForgetRefused, match="not the one the server accepted"):
        full.forget(f"client-{LEAVER}", 1, inflated, 2 * samples)
    # the right upload, but a 'kept' part with more than it: forgets a negative amount
    with pytest.raises(ForgetRefused, match="no dataset's statistics"):
        full.forget(f"client-{LEAVER}", 1, stats, samples, inflated, 2 * samples)
    # a whole-site removal must name every stage the site contributed to
    with pytest.raises(ForgetRefused, match=r"stage\(s\) \[3, 4, 5\]"):
        full.forget_client(f"client-{LEAVER}", {0: mine[0], 1: mine[1]})
    assert torch.equal(full.ridge.gram, gram)  # nothing was applied


def test_a_site_that_withdraws_leaves_the_weights_of_a_run_that_never_had_it(runs) -> None:
    full, never, store = runs
    mine = _kept(store, LEAVER, TASKS)
    before = full.weights.clone()
    events = full.forget_client(f"client-{LEAVER}", mine, what="client", requested_by="site")
    assert [e["task"] for e in events] == list(range(TASKS))
    assert sum(e["removed_samples"] for e in events) == sum(s for _, s in mine.values())
    record = full.resolve(TASKS - 1)
    weights, reference = full.weights, never.weights
    relative = float(torch.linalg.matrix_norm(weights - reference) / torch.linalg.matrix_norm(reference))
    assert relative <= 1e-10
    assert float(torch.linalg.matrix_norm(before - reference) / torch.linalg.matrix_norm(reference)) > 1e-6
    assert record["ridge_after"] == never.ridge.previous  # γ re-selected, the same as the run without it
    assert record["requests"] == events and len(record["per_task_after"]) == TASKS
    assert full.ridge.num_samples == never.ridge.num_samples
    # a second removal of the same site: nothing is committed any more
    with pytest.raises(ForgetRefused, match="no accepted upload"):
        full.forget(f"client-{LEAVER}", 0, *mine[0])
    saved = json.loads(full.recorder.path.read_text())["unlearning"][-1]
    assert saved["requests"][0]["who"] == f"client-{LEAVER}" and saved["accuracy_after"] == record["accuracy_after"]
