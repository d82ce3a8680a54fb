"""Secure STSA through the real strategy loop and ClientApp dispatch (no Ray).

* The classifier equals plain STSA's (and so centralised ridge) up to the fixed-point rounding
  bound; the uploads are uint64 ring elements and nothing of a client's statistics -- counts and
  withheld samples included -- travels in clear.
* A participant that drops after sharing its secrets, or whose upload is rejected, is recovered
  inside the same attempt: the sum opens over the survivors, there is no second attempt over the
  same inputs, and the rejected client's upload stays hidden by its self-mask.
* Late statistics ride inside a later regular upload only when at least secagg-min-clients
  participants owe that stage; a single late client's statistics are never opened alone.
* With require-all-clients a lost participant stops the run before anything is opened.
* The key round: a node without valid keys is left out, with the reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, Message

from fcl_flower.config import ConfigError
from strategies.loop import RunFailed
from tests.conftest import reply_partition, run_in_process, small_config

SETTINGS = dict(num_tasks=5, num_clients=5, rf_dim=120, seed=0)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return run_in_process(small_config(Path(tmp_path_factory.mktemp("plain")), **SETTINGS))


def lose(victims: set[int], stage: int, corrupt: bool = False, phase: str = "stsa-stats"):
    """A tamper hook: in ``stage``'s ``phase`` step, the victims' replies are lost (or corrupted)."""

    def tamper(task: int, step: str, replies: list[Message]) -> list[Message]:
        if task != stage or step != phase:
            return replies
        if not corrupt:
            return [m for m in replies if m.has_error() or reply_partition(m) not in victims]
        for m in replies:
            if not m.has_error() and reply_partition(m) in victims:
                record = m.content.array_records["arrays"]
                record["counts"] = Array(np.zeros(7, dtype=np.uint64))  # the wrong shape: rejected
        return replies

    return tamper


def test_secure_stsa_equals_plain_stsa_within_the_rounding_bound(plain, tmp_path) -> None:
    seen: list[Message] = []

    def capture(task, phase, replies):
        if phase == "stsa-stats":
            seen.extend(replies)
        return replies

    secure = run_in_process(small_config(tmp_path, **SETTINGS, secure_aggregation=True), capture)
    for w_secure, w_plain in zip(secure.stage_weights, plain.stage_weights, strict=True):
        assert relative(w_secure, w_plain) < 1e-6
    assert [s.accuracy for s in secure.recorder.stages] == [s.accuracy for s in plain.recorder.stages]
    # G itself: within clients * 2^-(f+1) of the plain float64 sum, entry by entry, over 5 stages
    bound = 5 * 2.0 ** -(secure.cfg.secagg_fraction_bits + 1) * 5
    assert float((secure.ridge.gram - plain.ridge.gram).abs().max()) <= bound
    assert secure.ridge.num_samples == plain.ridge.num_samples
    assert len(seen) == 5 * 5
    for message in seen:
        assert {a.numpy().dtype for a in message.content.array_records["arrays"].values()} == {np.dtype(np.uint64)}
        metrics = message.content.metric_records["metrics"]
        assert metrics["num-examples"] == 0 and metrics["withheld-samples"] == 0  # counts travel masked
    assert all(s.extra.get("secure_aggregation") for s in secure.recorder.stages)


@pytest.mark.parametrize("corrupt", [False, True], ids=["dropped", "rejected"])
def test_lost_participants_are_recovered_in_the_same_attempt(plain, tmp_path, corrupt) -> None:
    """Two of five drop (or are rejected) in stage 2: the sum opens over the three survivors in
    the one attempt; both owe stage 2, and since two owe it they backfill it together in stage 3."""
    uploads: list[tuple[int, int]] = []  # (task, client) of every masked upload the clients sent

    def tamper(task, phase, replies):
        if phase == "stsa-stats":
            uploads.extend((task, reply_partition(m)) for m in replies if not m.has_error())
        return lose({1, 3}, 1, corrupt)(task, phase, replies)

    cfg = small_config(tmp_path, **SETTINGS, secure_aggregation=True)
    strategy = run_in_process(cfg, tamper)
    stage2, stage3 = strategy.recorder.stages[1], strategy.recorder.stages[2]
    assert stage2.clients == ["client-0", "client-2", "client-4"]
    assert {"client-1", "client-3"} <= set(stage2.left_out)
    assert stage2.extra["statistics_missing"] == {"client-1": [2], "client-3": [2]}
    assert relative(strategy.stage_weights[1], plain.stage_weights[1]) > 1e-3  # stage 2 lacks two clients
    assert stage3.extra["backfilled"] == {"client-1": [2], "client-3": [2]}
    for w_secure, w_plain in zip(strategy.stage_weights[2:], plain.stage_weights[2:], strict=True):
        assert relative(w_secure, w_plain) < 1e-6
    # never a second attempt over the same inputs: every client uploaded exactly once per stage
    assert sorted(uploads) == [(task, client) for task in range(5) for client in range(5)]


def test_a_single_late_client_is_never_opened_alone(plain, tmp_path) -> None:
    """One client misses stage 2; nobody else owes it, so its statistics never ride: the stage
    stays missing (recorded) rather than opening one client's class sums."""
    strategy = run_in_process(small_config(tmp_path, **SETTINGS, secure_aggregation=True), lose({2}, 1))
    stages = strategy.recorder.stages
    assert stages[1].extra["statistics_missing"] == {"client-2": [2]}
    assert all("backfilled" not in s.extra for s in stages)
    assert stages[-1].extra["statistics_missing"] == {"client-2": [2]}


def test_require_all_clients_stops_before_anything_is_opened(tmp_path) -> None:
    cfg = small_config(tmp_path, **SETTINGS, secure_aggregation=True, require_all_clients=True)
    with pytest.raises(RunFailed, match=r"stage 3 failed: no valid masked upload from client-0"):
        run_in_process(cfg, lose({0}, 2))


def test_a_node_without_valid_keys_is_left_out(tmp_path) -> None:
    def bad_key(task, phase, replies):
        if phase == "secagg-keys" and task == 0:
            for m in replies:
                if reply_partition(m) == 2:
                    m.content.config_records["secagg"]["s"] = b"short"
        return replies

    strategy = run_in_process(small_config(tmp_path, **SETTINGS, secure_aggregation=True), bad_key)
    first = strategy.recorder.stages[0]
    assert first.clients == ["client-0", "client-1", "client-3", "client-4"]
    assert any("32-byte public keys" in why for why in first.left_out.values())
    assert first.extra["statistics_missing"] == {"client-2": [1]}


def test_secure_aggregation_is_refused_where_the_server_needs_single_uploads(tmp_path) -> None:
    for name in ("stsa-e", "fedran", "finetune"):
        with pytest.raises(ConfigError, match="needs per-client uploads"):
            small_config(tmp_path, strategy=name, secure_aggregation=True)
