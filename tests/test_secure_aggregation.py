"""Secure STSA through the real strategy loop and ClientApp dispatch (no Ray).

* The classifier equals plain STSA's (and so centralised ridge) up to the fixed-point rounding
  bound, and the uploads the server receives are uint64 ring elements.
* A participant that drops out (or sends a bad upload) makes the round run again with the
  survivors; the dropped client owes the stage and backfills it in a later secure round
  (masked, with zero records from everybody else), after which W equals the fault-free run's.
* With require-all-clients the round is retried with everybody after a fresh key round.
* The key round: a node without a valid public key is left out, with the reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message

from fcl_flower.config import ConfigError
from tests.conftest import reply_partition, run_in_process, small_config

SETTINGS = dict(num_tasks=5, rf_dim=120, seed=0)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return run_in_process(small_config(Path(tmp_path_factory.mktemp("plain")), **SETTINGS))


def drop_first_attempt(victim: int, stage: int, corrupt: bool = False):
    """A tamper hook: in the first stats attempt of ``stage``, client ``victim`` is lost or corrupted."""
    calls = {"n": 0}

    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if task != stage or phase != "stsa-stats" or calls["n"]:
            return replies
        calls["n"] += 1
        if not corrupt:
            return [m for m in replies if reply_partition(m) != victim]
        for m in replies:
            if reply_partition(m) == victim:
                m.content.array_records["arrays"] = ArrayRecord(
                    {
                        "gram-packed": Array(np.zeros(3, dtype=np.uint64)),
                        "class-sums": Array(np.zeros(3, dtype=np.uint64)),
                    }
                )
        return replies

    return tamper


def test_secure_stsa_equals_plain_stsa_within_the_rounding_bound(plain, tmp_path) -> None:
    seen: list[Message] = []

    def capture(task, phase, replies):
        if phase == "stsa-stats":
            seen.extend(replies)
        return replies

    secure = run_in_process(small_config(tmp_path, **SETTINGS, secure_aggregation=True), capture)
    for w_secure, w_plain in zip(secure.stage_weights, plain.stage_weights):
        assert relative(w_secure, w_plain) < 1e-6
    assert [s.accuracy for s in secure.recorder.stages] == [s.accuracy for s in plain.recorder.stages]
    # G itself: within clients * 2^-(f+1) of the plain float64 sum, entry by entry
    assert (
        float((secure.ridge.gram - plain.ridge.gram).abs().max())
        <= 3 * 2.0 ** -(secure.cfg.secagg_fraction_bits + 1) * 5
    )
    assert len(seen) == 3 * 5
    for message in seen:
        for array in message.content.array_records["arrays"].values():
            assert array.numpy().dtype == np.uint64
    assert all(s.extra.get("secure_aggregation") for s in secure.recorder.stages)


@pytest.mark.parametrize("corrupt", [False, True], ids=["dropped", "bad-upload"])
def test_a_lost_participant_is_rerun_without_and_backfills_later(plain, tmp_path, corrupt) -> None:
    cfg = small_config(tmp_path, **SETTINGS, secure_aggregation=True)
    strategy = run_in_process(cfg, drop_first_attempt(victim=1, stage=1, corrupt=corrupt))
    stage2, stage3 = strategy.recorder.stages[1], strategy.recorder.stages[2]
    assert stage2.clients == ["client-0", "client-2"]
    assert "client-1" in stage2.left_out and stage2.extra["statistics_missing"] == {"client-1": [2]}
    assert relative(strategy.stage_weights[1], plain.stage_weights[1]) > 1e-3  # stage 2 lacks client 1
    assert stage3.extra["backfilled"] == {"client-1": [2]} and "statistics_missing" not in stage3.extra
    for w_secure, w_plain in zip(strategy.stage_weights[2:], plain.stage_weights[2:]):
        assert relative(w_secure, w_plain) < 1e-6


def test_require_all_clients_retries_with_everybody(plain, tmp_path) -> None:
    cfg = small_config(tmp_path, **SETTINGS, secure_aggregation=True, require_all_clients=True)
    strategy = run_in_process(cfg, drop_first_attempt(victim=0, stage=2))
    assert all(s.clients == ["client-0", "client-1", "client-2"] for s in strategy.recorder.stages)
    assert relative(strategy.weights, plain.weights) < 1e-6


def test_a_node_without_a_valid_key_is_left_out(tmp_path) -> None:
    def bad_key(task, phase, replies):
        if phase == "secagg-keys" and task == 0:
            for m in replies:
                if reply_partition(m) == 2:
                    m.content.config_records["secagg"]["public-key"] = b"short"
        return replies

    strategy = run_in_process(small_config(tmp_path, **SETTINGS, secure_aggregation=True), bad_key)
    first = strategy.recorder.stages[0]
    assert first.clients == ["client-0", "client-1"]
    assert any("public key" in why for why in first.left_out.values())
    assert strategy.recorder.stages[1].extra["backfilled"] == {"client-2": [1]}


def test_secure_aggregation_is_refused_where_the_server_needs_single_uploads(tmp_path) -> None:
    for name in ("stsa-e", "fedran", "finetune"):
        with pytest.raises(ConfigError, match="needs per-client uploads"):
            small_config(tmp_path, strategy=name, secure_aggregation=True)
