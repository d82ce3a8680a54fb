"""Noise on the uploads through the real strategies and ClientApp (no Ray).

* The noise the clients add has the stated distribution: the paper's q·N(0, s²) and the DP
  Gaussian mechanism, in plain uploads and, distributed, in the opened secure sum (statistical
  tests with a fixed seed, against an exact run on the same data).
* With the noise off, results are bit-identical whatever the other noise knobs say, and no noise
  is ever drawn.
* Honest noisy uploads pass the server's checks (nothing is left out); gross poisoning is still
  rejected; the ε spent is in results.json and in the printed table.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, Message
from scipy import stats

import clients.statistics
from fcl_flower.analytic import pack_upper, unpack_upper
from fcl_flower.privacy.noise import secure_share, upload_scale
from fcl_flower.results import format_stage_table
from strategies.stsa import STSAStrategy
from tests.conftest import reply_partition, run_in_process, small_config

SETTINGS = dict(num_tasks=2, num_clients=3, rf_dim=40, seed=0, feature_clip=1.0)
PAPER = dict(noise_q=0.5, noise_s=2.0, noise_seeded=True)
DP = dict(dp_epsilon=2.0, noise_seeded=True)


def uploads(monkeypatch) -> dict[str, list]:
    """Record every plain STSA upload the server adds: client -> [StsaStats of stage 1, 2]."""
    seen: dict[str, list] = {}
    original = STSAStrategy.add_statistics

    def spy(self, task, replies, *factor):
        for r in replies:
            seen.setdefault(r.client, []).append(r.payload)
        return original(self, task, replies, *factor)

    monkeypatch.setattr(STSAStrategy, "add_statistics", spy)
    return seen


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    """The noise-free run on the same data: its uploads and its summed statistics."""
    mp = pytest.MonkeyPatch()
    try:
        seen = uploads(mp)
        strategy = run_in_process(small_config(Path(tmp_path_factory.mktemp("exact")), **SETTINGS))
    finally:
        mp.undo()
    return seen, strategy


def standardised(values: list[torch.Tensor], std: float) -> np.ndarray:
    return torch.cat([v.reshape(-1) for v in values]).numpy() / std


def assert_standard_normal(z: np.ndarray) -> None:
    """Mean, spread (each within 4 standard errors) and shape (Kolmogorov-Smirnov) of N(0, 1)."""
    assert z.size >= 300
    assert abs(float(z.mean())) < 4 / math.sqrt(z.size)
    assert float(z.std()) == pytest.approx(1.0, abs=4 / math.sqrt(2 * z.size))
    assert stats.kstest(z, "norm").pvalue > 1e-3


def assert_clean(strategy) -> None:
    for stage in strategy.recorder.stages:
        assert not stage.left_out, stage.left_out
        assert "failed" not in stage.extra


@pytest.mark.parametrize("mode", ["paper", "dp"])
def test_plain_uploads_carry_the_stated_noise(exact, monkeypatch, tmp_path, mode) -> None:
    changes = {**SETTINGS, **(PAPER if mode == "paper" else DP)}
    cfg = small_config(tmp_path, **changes)
    seen = uploads(monkeypatch)
    strategy = run_in_process(cfg)
    assert_clean(strategy)
    scale = upload_scale(cfg)
    assert scale is not None
    clean = exact[0]
    for block, field, std in (
        ("gram", "gram_packed", scale.gram),
        ("sums", "class_sums", scale.sums),
        ("counts", "counts", scale.counts),
    ):
        diffs = [getattr(a, field) - getattr(b, field) for c in seen for a, b in zip(seen[c], clean[c])]
        if block == "counts":  # few numbers per upload: their pooled spread only
            z = standardised(diffs, std)
            assert float(z.std()) == pytest.approx(1.0, rel=0.5)
            continue
        assert_standard_normal(standardised(diffs, std))
    if mode == "dp":  # the counts travel noisy and the clear count is gone
        assert all(float((a.counts - a.counts.round()).abs().max()) > 0 for c in seen for a in seen[c])
        assert strategy.ridge.num_samples > 0


@pytest.mark.parametrize("mode", ["paper", "dp"])
def test_the_opened_secure_sum_carries_the_stated_noise(exact, tmp_path, mode) -> None:
    """DP: each of the 3 clients adds variance σ²/t (t = 2), so the opened sum carries (3/2)σ²; the
    paper's noise is per client, 3σ². Both stages' noise is in the summed G."""
    changes = {**SETTINGS, **(PAPER if mode == "paper" else DP), "secure_aggregation": True}
    cfg = small_config(tmp_path, **changes)
    strategy = run_in_process(cfg)
    assert_clean(strategy)
    scale = upload_scale(cfg)
    assert scale is not None
    share = secure_share(cfg, 2)
    per_stage = math.sqrt(3) * share  # std of one opened sum's noise, in units of one client's full noise
    gram_noise = pack_upper(strategy.ridge.gram - exact[1].ridge.gram)  # two stages of noise
    assert_standard_normal(gram_noise.numpy() / (scale.gram * per_stage * math.sqrt(2)))
    sums_noise = strategy.ridge.class_sums - exact[1].ridge.class_sums  # each column noised once
    assert_standard_normal(sums_noise.reshape(-1).numpy() / (scale.sums * per_stage))
    if mode == "dp":
        privacy = strategy.recorder.stages[-1].extra["privacy"]
        assert privacy["epsilon_spent"] < cfg.dp_epsilon  # (3/2)σ² > σ²: less than planned is spent
        assert set(privacy["releases"]) == {"client-0", "client-1", "client-2"}


def test_noise_off_is_bit_identical_whatever_the_other_noise_knobs_say(monkeypatch, tmp_path) -> None:
    def never(*args, **kwargs):
        raise AssertionError("noise drawn while noise is off")

    irrelevant = dict(
        noise_on="counts", dp_delta=1e-3, dp_scope="stage", dp_accountant="rdp", noise_seeded=True, noise_q=0.0
    )
    for strategy_name in ("stsa", "stsa-e", "fedran"):
        reference = run_in_process(small_config(tmp_path / strategy_name / "a", strategy=strategy_name, **SETTINGS))
        with monkeypatch.context() as patch:
            patch.setattr(clients.statistics, "noise_generator", never)
            changed = run_in_process(
                small_config(tmp_path / strategy_name / "b", strategy=strategy_name, **SETTINGS, **irrelevant)
            )
        for a, b in zip(reference.stage_weights, changed.stage_weights):
            assert torch.equal(a, b)
        for a, b in zip(reference.recorder.stages, changed.recorder.stages):
            assert a.accuracy == b.accuracy and a.upload_bytes_per_client == b.upload_bytes_per_client
            assert not {"privacy", "noise", "psd_projection"} & set(b.extra)


@pytest.mark.parametrize("strategy_name", ["stsa-e", "fedran"])
def test_dp_runs_pass_every_check_and_report_epsilon(tmp_path, strategy_name) -> None:
    cfg = small_config(tmp_path, strategy=strategy_name, ridge="auto", **SETTINGS, **DP)
    strategy = run_in_process(cfg)
    assert_clean(strategy)
    stages = strategy.recorder.stages
    spent = [s.extra["privacy"]["epsilon_spent"] for s in stages]
    assert all(a < b for a, b in itertools.pairwise(spent))  # composition over stages
    assert spent[-1] == pytest.approx(cfg.dp_epsilon, rel=1e-3)  # dp-scope run: the target, reached at the end
    assert all(s.extra["privacy"]["epsilon_stage"] < spent[-1] for s in stages)
    saved = json.loads(strategy.recorder.path.read_text())
    assert saved["stages"][-1]["extra"]["privacy"]["epsilon_spent"] == pytest.approx(spent[-1])
    table = format_stage_table(stages)
    assert "ε spent" in table and f"{spent[-1]:.3f}" in table
    with open(strategy.recorder.path.with_name("results.csv"), newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [float(r["epsilon_spent"]) for r in rows] == pytest.approx(spent)
    assert [float(r["epsilon_stage"]) for r in rows] == pytest.approx(
        [s.extra["privacy"]["epsilon_stage"] for s in stages]
    )


def test_gross_poisoning_is_rejected_under_dp_noise(tmp_path) -> None:
    def poison(task: int, phase: str, replies: list[Message]) -> list[Message]:
        for m in replies:
            if task == 0 and phase == "stsa-stats" and not m.has_error() and reply_partition(m) == 1:
                record = m.content.array_records["arrays"]
                sums = record["class-sums"].numpy()
                record["class-sums"] = Array(sums * 1e5)
        return replies

    strategy = run_in_process(small_config(tmp_path, **SETTINGS, **DP), tamper=poison)
    first = strategy.recorder.stages[0]
    assert set(first.left_out) == {"client-1"}
    assert "failed" not in first.extra
    # the server saw the rejected upload: it counts as a release of client-1's data
    assert first.extra["privacy"]["releases"]["client-1"] == 1


def test_the_unpacked_noisy_gram_is_symmetric(exact, tmp_path) -> None:
    strategy = run_in_process(small_config(tmp_path, **SETTINGS, **PAPER))
    gram = strategy.ridge.gram
    assert torch.equal(gram, gram.T)
    assert torch.equal(unpack_upper(pack_upper(gram), gram.shape[0]), gram)
