"""Issue 30: per-upload checks at the cost of adding (O(M²)), one PSD certificate per stage on the
sum the solve uses, and a failing sum bisected to its culprit.

The attack tests play a client inside the O(M²) checks whose upload is indefinite: once where its
sum with the others stays PSD (accepted: what it can and cannot achieve is asserted), once where
it makes the sum fail (named by bisection, its reply left out, the stage solved on the rest)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, Message

from fcl_flower.analytic.bisect import find_culprit
from fcl_flower.analytic.checks import (
    NOT_PSD,
    StatisticsRejected,
    check_packed_statistics,
    screen_packed_statistics,
)
from fcl_flower.analytic.packing import pack_upper, unpack_upper
from tests.conftest import run_in_process
from tests.test_stsa_pipeline import BAD_PARTITION, BAD_TASK, _bad_cfg, _reference_run, _tamper_one

# --------------------------------------------------------------------------- halving


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 20, 33, 50])
def test_halving_finds_the_one_failing_item_in_log2_tests(size: int) -> None:
    """A union-monotone test (a group passes iff it holds no bad item) finds every position of
    the bad item in at most ⌈log₂ K⌉ + 1 tests (halving, then one confirmation)."""
    for bad in range(size):
        calls: list[list[int]] = []

        def passes(group, bad=bad, calls=calls) -> bool:
            calls.append(list(group))
            return bad not in group

        found, tests = find_culprit(list(range(size)), passes)
        assert found == [bad]
        assert tests == len(calls) <= math.ceil(math.log2(size)) + 1


def test_halving_names_nobody_where_every_item_passes_alone() -> None:
    """Not monotone (only rounding at the slack's edge can do that): nobody is named, and the
    caller tests each item alone."""
    found, tests = find_culprit([0, 1, 2, 3], lambda group: len(group) < 4 or False)
    assert found == [] and tests == 3


def test_halving_finds_one_of_two_bad_items() -> None:
    found, _ = find_culprit(list(range(9)), lambda group: not ({2, 7} & set(group)))
    assert found in ([2], [7])


# --------------------------------------------------------------------------- the O(M²) screen


def _statistics(rng: np.random.Generator, rows: int, dim: int, classes: int):
    phi = np.maximum(rng.standard_normal((rows, dim)), 0.0)
    labels = rng.integers(0, classes, rows)
    y = np.eye(classes)[labels]
    return phi.T @ phi, phi.T @ y, y.sum(axis=0)


def _indefinite_within_cauchy_schwarz(gram: np.ndarray, features: tuple[int, int, int], scale: float = 1.0):
    """G with features (a, b, c) rewired so their scaled block is [[1, 1, 0], [1, 1, 1], [0, 1, 1]]
    (λ_min = 1 − √2): every entry non-negative and inside Cauchy–Schwarz, the matrix indefinite."""
    bad = gram.copy()
    a, b, c = features
    d = np.sqrt(np.diag(gram))
    bad[a, b] = bad[b, a] = d[a] * d[b]
    bad[b, c] = bad[c, b] = d[b] * d[c]
    bad[a, c] = bad[c, a] = 0.0
    for i in (a, b, c):  # the three features see nothing else (their rows leave the rest PSD-neutral)
        others = [j for j in range(len(d)) if j not in features]
        bad[i, others] = bad[others, i] = 0.0
    return bad * scale


def test_the_screen_passes_an_indefinite_upload_inside_cauchy_schwarz_and_bounds_it_by_its_trace() -> None:
    """The screen is necessary conditions only: an indefinite J inside Cauchy–Schwarz passes it
    and fails the PSD test; what it can hide is bounded, λ_min(J) ≥ −tr J (‖J‖_F ≤ tr J)."""
    rng = np.random.default_rng(3)
    gram, sums, counts = _statistics(rng, 40, 12, 3)
    bad = _indefinite_within_cauchy_schwarz(gram, (1, 4, 7))
    sums[[1, 4, 7]] = 0.0
    args = (torch.from_numpy(sums), torch.from_numpy(counts))
    kwargs = {"relative_tolerance": 2.0**-53, "nonnegative": True}
    packed = pack_upper(torch.from_numpy(bad))
    screen_packed_statistics(packed, *args, **kwargs)  # passes
    with pytest.raises(StatisticsRejected, match="not positive semidefinite"):
        check_packed_statistics(packed, *args, **kwargs)
    joint = np.block([[bad, sums], [sums.T, np.diag(counts)]])
    assert np.linalg.eigvalsh(joint)[0] < 0
    assert np.linalg.eigvalsh(joint)[0] >= -np.trace(joint)
    # and everything the screen is for still fails it
    for broken, words in (
        (bad + np.diag(np.r_[-1.0, np.zeros(11)]) * (bad[0, 0] + 1), "negative diagonal"),
        (np.where(np.eye(12) > 0, bad, 1.01 * np.sqrt(np.outer(np.diag(bad), np.diag(bad)))), "Cauchy-Schwarz"),
    ):
        with pytest.raises(StatisticsRejected, match=words):
            screen_packed_statistics(pack_upper(torch.from_numpy(broken)), *args, relative_tolerance=2.0**-53)


def test_the_screen_is_cheaper_than_the_factorisation_it_replaces_in_work_not_time() -> None:
    """The screen never factorises: it runs with torch's Cholesky made to fail."""
    rng = np.random.default_rng(4)
    gram, sums, counts = _statistics(rng, 30, 20, 2)
    original = torch.linalg.cholesky_ex
    try:
        torch.linalg.cholesky_ex = None  # type: ignore[assignment]
        screen_packed_statistics(
            pack_upper(torch.from_numpy(gram)),
            torch.from_numpy(sums),
            torch.from_numpy(counts),
            relative_tolerance=2.0**-53,
        )
    finally:
        torch.linalg.cholesky_ex = original


# --------------------------------------------------------------------------- the attack in a run


def _rewire(scale: float, strongest: bool = True):
    """The tampering of BAD_PARTITION's stage-2 upload: three features rewired to an indefinite
    block inside Cauchy–Schwarz (its ``strongest`` three, or its weakest active ones), G scaled by
    ``scale``² and C by ``scale`` (so C stays inside it)."""

    def corrupt(reply: Message) -> None:
        arrays = reply.content.array_records["arrays"]
        classes = arrays["class-sums"].numpy().shape[-1]
        sums = arrays["class-sums"].numpy().reshape(-1, classes).copy()
        dim = sums.shape[0]
        gram = unpack_upper(torch.from_numpy(arrays["gram-packed"].numpy().copy()), dim).numpy()
        diagonal = np.diag(gram)
        order = np.argsort(-diagonal) if strongest else np.argsort(np.where(diagonal > 0, diagonal, np.inf))
        active = [int(i) for i in order[:3]]
        bad = _indefinite_within_cauchy_schwarz(gram, tuple(active), scale * scale)  # type: ignore[arg-type]
        sums[active] = 0.0
        arrays["gram-packed"] = Array(np.ascontiguousarray(pack_upper(torch.from_numpy(bad)).numpy()))
        arrays["class-sums"] = Array(np.ascontiguousarray(sums * scale).reshape(arrays["class-sums"].numpy().shape))

    return corrupt


def test_an_indefinite_upload_whose_sum_stays_psd_is_accepted_and_can_only_take_away_its_own_trace(
    out_dir: Path,
) -> None:
    """A client inside the O(M²) checks sends an indefinite upload small next to the others: the
    stage's sum is PSD, so it is accepted (one factorisation, nobody named). What it achieved: W
    differs from the honest run's. What it cannot: make the solve's G indefinite (the stage is
    certified), or take away more than its own trace (the sum's G stays ⪰ the others' G minus
    tr J_k · I)."""
    cfg = _bad_cfg(out_dir, "stsa", "inside")
    sent: list[dict[str, np.ndarray]] = []
    rewire = _rewire(0.01, strongest=False)

    def corrupt(reply: Message) -> None:
        rewire(reply)
        sent.append({key: array.numpy().copy() for key, array in reply.content.array_records["arrays"].items()})

    bad = run_in_process(cfg, _tamper_one(BAD_PARTITION, corrupt))
    upload = sent[0]  # on its own, the upload is no dataset's statistics
    classes = upload["class-sums"].shape[-1]
    with pytest.raises(StatisticsRejected, match="not positive semidefinite"):
        check_packed_statistics(
            torch.from_numpy(upload["gram-packed"]),
            torch.from_numpy(upload["class-sums"].reshape(-1, classes)),
            torch.from_numpy(upload["counts"].reshape(-1)),
            relative_tolerance=2.0**-53,
        )
    honest = _reference_run(out_dir, "stsa", None)
    stage = bad.recorder.stages[BAD_TASK]
    assert stage.left_out == {}
    assert stage.extra["sum_certificate"] == {"factorisations": 1, "culprits": []}
    assert not torch.equal(bad.stage_weights[BAD_TASK], honest.stage_weights[BAD_TASK])
    assert float(torch.linalg.eigvalsh(bad.ridge.gram)[0]) >= -bad.ridge.negative_bound
    difference = bad.ridge.gram - honest.ridge.gram  # what the client changed, all in stage 2
    assert float(torch.linalg.matrix_norm(difference, ord=2)) <= 2 * float(torch.diagonal(honest.ridge.gram).sum())


def test_an_indefinite_upload_that_breaks_the_sum_is_named_by_bisection_and_the_stage_solved_on_the_rest(
    out_dir: Path,
) -> None:
    """Scaled up, the same upload makes the stage's sum indefinite: halving names the client in a
    few factorisations, its whole reply is left out with the reason, the stage's W is exactly the
    one of a run where that reply never came, the client owes the stage and backfills it later."""
    cfg = _bad_cfg(out_dir, "stsa", "breaks")
    bad = run_in_process(cfg, _tamper_one(BAD_PARTITION, _rewire(1e4)))
    dropped = _reference_run(out_dir, "stsa", BAD_PARTITION)
    fault_free = _reference_run(out_dir, "stsa", None)
    stage = bad.recorder.stages[BAD_TASK]
    name = f"client-{BAD_PARTITION}"
    certificate = stage.extra["sum_certificate"]
    assert certificate["culprits"] == [name]
    clients = cfg.num_clients
    assert certificate["factorisations"] <= 2 + 2 * math.ceil(math.log2(clients))  # first, halving, the rest
    assert "PSD certificate" in stage.left_out[name] and NOT_PSD in stage.left_out[name]
    assert name not in stage.clients
    assert torch.equal(bad.stage_weights[BAD_TASK], dropped.stage_weights[BAD_TASK])
    assert stage.accuracy == dropped.recorder.stages[BAD_TASK].accuracy
    assert stage.extra["statistics_missing"] == {name: [BAD_TASK + 1]}
    after = bad.recorder.stages[BAD_TASK + 1]
    assert after.extra["backfilled"] == {name: [BAD_TASK + 1]}
    assert [s.accuracy for s in bad.recorder.stages[BAD_TASK + 1 :]] == [
        s.accuracy for s in fault_free.recorder.stages[BAD_TASK + 1 :]
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_screen_s_cauchy_schwarz_matches_a_dense_computation_entry_by_entry(dtype: torch.dtype) -> None:
    """Every entry of G and C, pushed 1 % beyond √(J_ii J_jj), is caught; exactly at the bound, passed."""
    rng = np.random.default_rng(5)
    gram, sums, counts = _statistics(rng, 25, 9, 3)
    d = np.r_[np.diag(gram), counts]
    kwargs = {"relative_tolerance": 2.0**-24 if dtype == torch.float32 else 2.0**-53}
    for i in range(9):
        for j in range(i + 1, 12):
            g, c = gram.copy(), sums.copy()
            for scale, rejected in ((1.0, False), (1.01, True)):
                bound = scale * math.sqrt(d[i] * d[j])
                if j < 9:
                    g[i, j] = g[j, i] = bound
                else:
                    c[i, j - 9] = bound
                args = (pack_upper(torch.from_numpy(g)).to(dtype), torch.from_numpy(c), torch.from_numpy(counts))
                if rejected:
                    with pytest.raises(StatisticsRejected, match="Cauchy-Schwarz"):
                        screen_packed_statistics(*args, **kwargs)
                else:
                    screen_packed_statistics(*args, **kwargs)


def test_the_float32_screen_finds_a_subnormal_entry_of_a_feature_without_energy_in_every_chunk() -> None:
    """The screen's one pass (Cauchy–Schwarz and zero energy together, zero-energy weights +inf)
    over a float32 upload of M = 800, two chunks of rows: the smallest float32 (a subnormal) in
    the row or column of an empty feature, in either chunk, is refused as zero energy; an honest
    upload with the same empty features, and the same entry between two features with energy, pass."""
    rng = np.random.default_rng(8)
    dim = 800
    gram, sums, counts = _statistics(rng, 40, dim, 2)
    empty = [3, 799]
    gram[empty, :] = 0.0
    gram[:, empty] = 0.0
    sums[empty] = 0.0
    args = (torch.from_numpy(sums), torch.from_numpy(counts))
    tol = 2.0**-24
    screen_packed_statistics(pack_upper(torch.from_numpy(gram), torch.float32), *args, relative_tolerance=tol)
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    for i, j, refused in ((3, 10, True), (10, 799, True), (700, 799, True), (3, 799, True), (10, 700, False)):
        touched = gram.copy()
        touched[i, j] = touched[j, i] = tiny
        packed = pack_upper(torch.from_numpy(touched), torch.float32)
        assert float(packed.abs().max()) > 0 and (packed != pack_upper(torch.from_numpy(gram), torch.float32)).any()
        if refused:
            with pytest.raises(StatisticsRejected, match="zero energy"):
                screen_packed_statistics(packed, *args, relative_tolerance=tol)
        else:
            screen_packed_statistics(packed, *args, relative_tolerance=tol)


def test_the_screen_finds_any_non_zero_entry_in_the_row_or_column_of_a_feature_without_energy() -> None:
    """Zero energy, in contiguous passes: with features 2, 5 and 6 empty, a non-zero entry anywhere
    in their rows or columns (but the diagonal) is refused; the same entry elsewhere is not the
    zero-energy rule's business."""
    rng = np.random.default_rng(6)
    gram, sums, counts = _statistics(rng, 30, 8, 2)
    empty = [2, 5, 6]
    gram[empty, :] = 0.0
    gram[:, empty] = 0.0
    sums[empty] = 0.0
    args = (torch.from_numpy(sums), torch.from_numpy(counts))
    screen_packed_statistics(pack_upper(torch.from_numpy(gram)), *args, relative_tolerance=2.0**-53)
    for i in range(8):
        for j in range(i + 1, 8):
            touched = gram.copy()
            touched[i, j] = touched[j, i] = 1e-200  # inside Cauchy-Schwarz for any non-empty pair
            packed = pack_upper(torch.from_numpy(touched))
            if i in empty or j in empty:
                with pytest.raises(StatisticsRejected, match="zero energy"):
                    screen_packed_statistics(packed, *args, relative_tolerance=2.0**-53)
            else:
                screen_packed_statistics(packed, *args, relative_tolerance=2.0**-53)
