"""Exact unlearning (fcl_flower/analytic/unlearning.py, issue 33): after a client, a list of a
client's samples or a class is removed from the statistics, W equals the W of a run that never had
them, computed directly from the kept data, to ≤ 1e-10 relative in float64 with γ re-selected by
GCV (``ridge auto``); a removal of more than was added is refused with its reason."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord
from torch import Tensor

from fcl_flower.analytic.checks import NOT_PSD, StatisticsRejected
from fcl_flower.analytic.estimator import GramEstimator
from fcl_flower.analytic.lowrank import LowRankSummary, client_summary, merge_two_level
from fcl_flower.analytic.packing import pack_upper, packed_length
from fcl_flower.analytic.ridge import RidgeState, select_ridge_gcv, solve_ridge
from fcl_flower.analytic.statistics import StatisticsAccumulator
from fcl_flower.analytic.subspace import select_subspace_ridge_gcv, solve_subspace_ridge
from fcl_flower.analytic.unlearning import (
    Upload,
    check_removal,
    remerge_without,
    remove_from_estimator,
    remove_upload,
    replace_upload,
    swap_gram,
    upload_digest,
)
from fcl_flower.protocol import ProtocolError, StatsIns, UploadError, parse_instruction
from fcl_flower.protocol.payloads import ForgetStats, StsaStats
from tests.test_protocol import CFG, HEADER, _deliver

DIM, CLIENTS, TASKS, PER_TASK = 24, 4, 3, 2
CLASSES = TASKS * PER_TASK
TOL = 1e-10


def task_classes(task: int) -> range:
    return range(task * PER_TASK, (task + 1) * PER_TASK)


Data = dict[tuple[int, int], tuple[Tensor, Tensor]]


def make_data(seed: int = 0) -> Data:
    """(client, task) -> (Φ (n × M) float64, global labels): ReLU random features of class-shifted
    Gaussians, a different number of samples per client and task."""
    gen = torch.Generator().manual_seed(seed)
    means = torch.randn(CLASSES, 8, generator=gen, dtype=torch.float64) * 2.0
    proj = torch.randn(8, DIM, generator=gen, dtype=torch.float64)
    data = {}
    for client in range(CLIENTS):
        for task in range(TASKS):
            n = 18 + 5 * client + 3 * task
            labels = torch.tensor([task * PER_TASK + (i % PER_TASK) for i in range(n)], dtype=torch.int64)
            x = means[labels] + torch.randn(n, 8, generator=gen, dtype=torch.float64)
            data[(client, task)] = (torch.relu(x @ proj), labels)
    return data


def upload_of(phi: Tensor, labels: Tensor, task: int) -> Upload:
    """A client's STSA upload of one task: packed G, task-column class sums and counts (as the client computes them)."""
    acc = StatisticsAccumulator(DIM, PER_TASK)
    acc.update(phi, labels - task * PER_TASK)
    stats = acc.result()
    return Upload(acc.packed_gram(), stats.class_sums, stats.counts.to(torch.float64), stats.num_samples)


def federated(data: Data, clients: list[int], tasks: int) -> RidgeState:
    """The server's ridge state after ``tasks`` stages of the given clients, added in client order."""
    state = RidgeState.empty(DIM, CLASSES)
    for task in range(tasks):
        for client in clients:
            up = upload_of(*data[(client, task)], task)
            assert up.gram_packed is not None
            state.add_packed(task_classes(task), up.gram_packed, up.class_sums, up.num_samples)
    return state


def central_weights(rows: list[tuple[Tensor, Tensor]], num_seen: int) -> tuple[Tensor, float]:
    """W and γ (GCV) computed directly from the pooled features and labels (no statistics passed around)."""
    phi = torch.cat([r[0] for r in rows])
    labels = torch.cat([r[1] for r in rows])
    y = torch.nn.functional.one_hot(labels, CLASSES).to(torch.float64)[:, :num_seen]
    gram, sums = phi.T @ phi, phi.T @ y
    gamma, _ = select_ridge_gcv(gram, sums, int(phi.shape[0]), float(phi.shape[0]))
    return solve_ridge(gram, sums, gamma), gamma


def solved(state: RidgeState, num_seen: int) -> tuple[Tensor, float]:
    weights, gamma, _ = state.solve(num_seen, None, "exact")
    return weights, gamma


def relative(a: Tensor, b: Tensor) -> float:
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


def test_stsa_forget_client_equals_a_run_that_never_had_it_at_every_later_stage() -> None:
    """Client 2 withdraws after stage 2: its uploads of stages 1–2 are subtracted; stage 3 then runs
    without it. At stages 2 and 3, W (and γ under GCV) equal the run that never had client 2."""
    data = make_data()
    state = federated(data, list(range(CLIENTS)), 2)
    for task in range(2):
        remove_upload(state, task_classes(task), upload_of(*data[(2, task)], task))
    kept = [0, 1, 3]
    weights, gamma = solved(state, 2 * PER_TASK)
    reference, ref_gamma = central_weights([data[(c, t)] for c in kept for t in range(2)], 2 * PER_TASK)
    assert gamma == ref_gamma
    assert relative(weights, reference) <= TOL
    for client in kept:  # stage 3 without client 2
        up = upload_of(*data[(client, 2)], 2)
        assert up.gram_packed is not None
        state.add_packed(task_classes(2), up.gram_packed, up.class_sums, up.num_samples)
    weights, gamma = solved(state, CLASSES)
    reference, ref_gamma = central_weights([data[(c, t)] for c in kept for t in range(3)], CLASSES)
    assert gamma == ref_gamma
    assert relative(weights, reference) <= TOL
    # and the removal changed something real: the run with client 2 has other weights
    full, _ = solved(federated(data, list(range(CLIENTS)), 3), CLASSES)
    assert relative(full, reference) > 1e-6


def test_stsa_forget_samples_by_replacing_an_upload_with_the_kept_samples_statistics() -> None:
    """Client 1 forgets a list of its samples of stages 1 and 3 (replace A by the kept part K)."""
    data = make_data(1)
    state = federated(data, list(range(CLIENTS)), TASKS)
    forget = {0: [0, 3, 4, 11], 2: [1, 2, 7]}

    def keep_of(client: int, task: int, labels: torch.Tensor) -> torch.Tensor | None:
        if client != 1 or task not in forget:
            return None
        keep = torch.ones(len(labels), dtype=torch.bool)
        keep[forget[task]] = False
        return keep

    rows = forget_where(data, state, keep_of)
    weights, gamma = solved(state, CLASSES)
    reference, ref_gamma = central_weights(rows, CLASSES)
    assert gamma == ref_gamma
    assert relative(weights, reference) <= TOL
    assert state.num_samples == sum(int(r[1].numel()) for r in rows)


def forget_where(data, state, keep_of):
    """Every site's upload whose ``keep_of(client, task, labels)`` mask is not None is replaced by
    that of its kept samples (``replace_upload``); returns every site's kept rows, for the reference."""
    rows = []
    for (client, task), (phi, labels) in sorted(data.items()):
        keep = keep_of(client, task, labels)
        if keep is None:
            keep = torch.ones(len(labels), dtype=torch.bool)
        else:
            replace_upload(
                state, task_classes(task), upload_of(phi, labels, task), upload_of(phi[keep], labels[keep], task)
            )
        rows.append((phi[keep], labels[keep]))
    return rows


def test_stsa_forget_a_class_leaves_its_column_zero_and_the_rest_exact() -> None:
    """Class 3 (stage 2) is forgotten: every holder replaces its upload by that of its other samples."""
    data = make_data(2)
    state = federated(data, list(range(CLIENTS)), TASKS)
    before = float(state.class_sums[:, 3].norm())
    rows = forget_where(data, state, lambda _client, task, labels: labels != 3 if task == 1 else None)
    weights, gamma = solved(state, CLASSES)
    reference, ref_gamma = central_weights(rows, CLASSES)
    assert gamma == ref_gamma
    assert relative(weights, reference) <= TOL
    # C's column of class 3 is zero up to the subtraction's rounding: what is left of the class is rounding
    assert float(state.class_sums[:, 3].norm()) <= TOL * before
    assert float(weights[:, 3].norm()) <= TOL * float(weights.norm())


def test_stsa_orders_of_requests_delete_both_ways_then_add_again() -> None:
    """Deleting 0 then 3, or 3 then 0, both equal the run without them; adding 3 back equals the run with it."""
    data = make_data(3)
    uploads = {(c, t): upload_of(*data[(c, t)], t) for c in range(CLIENTS) for t in range(TASKS)}
    results = []
    for order in ([0, 3], [3, 0]):
        state = federated(data, list(range(CLIENTS)), TASKS)
        for client in order:
            for task in range(TASKS):
                remove_upload(state, task_classes(task), uploads[(client, task)])
        results.append(solved(state, CLASSES))
    reference, ref_gamma = central_weights([data[(c, t)] for c in (1, 2) for t in range(TASKS)], CLASSES)
    for weights, gamma in results:
        assert gamma == ref_gamma
        assert relative(weights, reference) <= TOL
    for task in range(TASKS):  # client 3 joins again (the last state: both removed)
        up = uploads[(3, task)]
        assert up.gram_packed is not None
        state.add_packed(task_classes(task), up.gram_packed, up.class_sums, up.num_samples)
    weights, gamma = solved(state, CLASSES)
    reference, ref_gamma = central_weights([data[(c, t)] for c in (1, 2, 3) for t in range(TASKS)], CLASSES)
    assert gamma == ref_gamma
    assert relative(weights, reference) <= TOL


def test_after_a_removal_nothing_is_certified_and_the_next_solve_recertifies_by_a_factorisation() -> None:
    data = make_data(4)
    state = federated(data, list(range(CLIENTS)), 1)
    state.negative_bound = 0.0
    remove_upload(state, task_classes(0), upload_of(*data[(0, 0)], 0))
    assert state.negative_bound == math.inf
    state.solve(PER_TASK, 1.0)
    assert state.selection["certificate"] in ("float32 factorisation", "float64 factorisation")
    assert state.negative_bound <= 0.5


def test_a_removal_of_more_than_was_added_is_refused_with_its_reason() -> None:
    """The attack: 'forget' samples one never contributed. The removed part A − K must be the
    statistics of some dataset, so each of these is refused."""
    data = make_data(5)
    phi, labels = data[(0, 0)]
    added = upload_of(phi, labels, 0)
    tol = 2.0**-40
    # honest: forgetting three samples passes and returns their statistics
    keep = torch.ones(len(labels), dtype=torch.bool)
    keep[:3] = False
    removed = check_removal(added, upload_of(phi[keep], labels[keep], 0), relative_tolerance=tol)
    assert removed.num_samples == 3
    # a kept part with more samples than were added: negative removal
    bigger = upload_of(torch.cat([phi, phi[:2]]), torch.cat([labels, labels[:2]]), 0)
    with pytest.raises(StatisticsRejected, match="samples more than were added"):
        check_removal(added, bigger, relative_tolerance=tol)
    # removing more of class 0 than was added, while keeping the total right
    counts = added.counts.clone()
    counts[0] += 2.0
    counts[1] -= 2.0
    forged = Upload(added.gram_packed, added.class_sums, counts, added.num_samples)
    with pytest.raises(StatisticsRejected, match="negative"):
        check_removal(added, forged, relative_tolerance=tol)
    # a removal that takes out of G more than these samples had: the removed part G_S + s·R, R an
    # indefinite matrix with a positive diagonal whose every 2 × 2 minor is fine (only PSD tells)
    honest = upload_of(phi[keep], labels[keep], 0)
    assert honest.gram_packed is not None
    corr = torch.zeros(DIM, DIM, dtype=torch.float64)
    corr[:3, :3] = torch.tensor([[1.0, 0.9, 0.9], [0.9, 1.0, -0.9], [0.9, -0.9, 1.0]], dtype=torch.float64)
    scale = 10.0 * float(phi.square().sum())
    taken = Upload(honest.gram_packed - pack_upper(scale * corr), honest.class_sums, honest.counts, honest.num_samples)
    with pytest.raises(StatisticsRejected, match="positive semidefinite") as err:
        check_removal(added, taken, relative_tolerance=tol)
    # and one that takes a whole direction out (a negative diagonal entry of the removed G)
    outsider = torch.zeros(DIM, DIM, dtype=torch.float64)
    outsider[4, 4] = scale
    with pytest.raises(StatisticsRejected, match="negative diagonal"):
        check_removal(
            added,
            Upload(honest.gram_packed + pack_upper(outsider), honest.class_sums, honest.counts, honest.num_samples),
            relative_tolerance=tol,
        )
    assert NOT_PSD in str(err.value)


def test_the_digest_binds_every_number_and_the_context() -> None:
    data = make_data(6)
    up = upload_of(*data[(1, 1)], 1)
    context: dict[str, str | int] = {"run": "r1", "client": "client-1", "task": 1}
    digest = upload_digest(context, up)
    assert digest == upload_digest(dict(context), upload_of(*data[(1, 1)], 1))  # recomputable
    assert len(digest) == 64
    sums = up.class_sums.clone()
    sums[5, 1] = torch.nextafter(sums[5, 1], torch.tensor(math.inf, dtype=torch.float64))
    assert upload_digest(context, Upload(up.gram_packed, sums, up.counts, up.num_samples)) != digest
    assert upload_digest({**context, "client": "client-2"}, up) != digest
    assert upload_digest({**context, "task": 2}, up) != digest
    assert upload_digest(context, Upload(up.gram_packed, up.class_sums, up.counts, up.num_samples + 1)) != digest
    as32 = Upload(
        up.gram_packed.to(torch.float32) if up.gram_packed is not None else None,
        up.class_sums,
        up.counts,
        up.num_samples,
    )
    assert upload_digest(context, as32) != digest  # another dtype is other bytes


def stsa_e_uploads(data: Data, client: int, task: int, dummies: int = 3) -> tuple[Tensor, Tensor]:
    """(D, M, c) class sums and (D, c) counts of a client's dummy clients (contiguous chunks)."""
    phi, labels = data[(client, task)]
    local = labels - task * PER_TASK
    chunks = torch.arange(len(labels)).chunk(dummies)
    sums = torch.stack(
        [phi[idx].T @ torch.nn.functional.one_hot(local[idx], PER_TASK).to(torch.float64) for idx in chunks]
    )
    counts = torch.stack([torch.bincount(local[idx], minlength=PER_TASK).to(torch.float64) for idx in chunks])
    return sums, counts


@pytest.mark.parametrize("k_mode", ["global", "per-class"])
def test_stsa_e_removing_a_clients_uploads_from_every_eq9_input_equals_a_run_without_it(k_mode: str) -> None:
    """Eq. 9's inputs (S_i, n_i, K_i, K, P_i) are additive; removing a client's K_D uploads from
    them gives the estimate of a stage that never had it, and the ridge state with the stage's Ĝ
    swapped equals the run without it (γ by GCV)."""
    data = make_data(7)
    estimators, ridge = [], RidgeState.empty(DIM, CLASSES)
    for task in range(TASKS):
        est = GramEstimator(DIM, PER_TASK, k_mode=k_mode)  # type: ignore[arg-type]
        for client in range(CLIENTS):
            est.add(*stsa_e_uploads(data, client, task))
        ridge.add(task_classes(task), est.result(), est.class_sums, int(est.counts.sum()))
        estimators.append(est)
    for task, est in enumerate(estimators):  # client 1 leaves every stage
        old = est.result()
        sums, counts = stsa_e_uploads(data, 1, task)
        remove_from_estimator(est, sums, counts)
        swap_gram(ridge, old, est.result())
        ridge.class_sums[:, task_classes(task).start : task_classes(task).stop] -= sums.sum(dim=0)
        ridge.num_samples -= int(counts.sum())
    never = RidgeState.empty(DIM, CLASSES)
    for task in range(TASKS):
        est = GramEstimator(DIM, PER_TASK, k_mode=k_mode)  # type: ignore[arg-type]
        for client in (0, 2, 3):
            est.add(*stsa_e_uploads(data, client, task))
        assert relative(estimators[task].result(), est.result()) <= TOL  # S_i lost its sum: rounding only
        never.add(task_classes(task), est.result(), est.class_sums, int(est.counts.sum()))
    weights, gamma = solved(ridge, CLASSES)
    reference, ref_gamma = solved(never, CLASSES)
    assert gamma == ref_gamma
    assert relative(weights, reference) <= TOL


def test_stsa_e_removal_from_a_dense_outer_product_sum_and_a_refused_foreign_block() -> None:
    """Once P_i is dense (more columns than M) the block is subtracted (exact to rounding); a block
    the estimator never received is refused and changes nothing."""
    data = make_data(8)
    est = GramEstimator(DIM, PER_TASK)
    never = GramEstimator(DIM, PER_TASK)
    for client in range(CLIENTS):
        sums, counts = stsa_e_uploads(data, client, 0, dummies=8)
        est.add(sums, counts)
        if client != 0:
            never.add(sums, counts)
    assert est._dense[0] is not None  # 32 columns > M = 24
    foreign = stsa_e_uploads(make_data(99), 0, 0)
    before = est.result()
    sparse = GramEstimator(DIM, PER_TASK)
    sparse.add(*stsa_e_uploads(data, 0, 0))
    with pytest.raises(Exception, match="never received"):
        remove_from_estimator(sparse, *foreign)
    remove_from_estimator(est, *stsa_e_uploads(data, 0, 0, dummies=8))
    assert relative(est.result(), never.result()) <= TOL
    assert not torch.equal(before, est.result())


def test_fedran_truncated_merge_is_forgotten_exactly_by_remerging_the_kept_summaries() -> None:
    """With truncation (rank 6 < M) the merge cannot be undone, but re-merging the kept per-client
    summaries in the same order equals the run that never had the client, and B is a plain sum."""
    data = make_data(10)
    rank = 6
    summaries = [[(c, client_summary(data[(c, t)][0], rank)) for c in range(CLIENTS)] for t in range(TASKS)]
    corr = torch.zeros(DIM, CLASSES, dtype=torch.float64)
    for phi, labels in data.values():
        corr += phi.T @ torch.nn.functional.one_hot(labels, CLASSES).to(torch.float64)
    merged = remerge_without(summaries, {2}, [rank] * TASKS)
    never: LowRankSummary | None = None
    for t in range(TASKS):
        never = merge_two_level([s for c, s in summaries[t] if c != 2], never, rank)
    assert merged is not None and never is not None
    assert merged.discarded.trace > 0  # truncation did happen
    assert torch.equal(merged.basis, never.basis) and torch.equal(merged.singular_values, never.singular_values)
    for task in range(TASKS):
        phi, labels = data[(2, task)]
        corr -= phi.T @ torch.nn.functional.one_hot(labels, CLASSES).to(torch.float64)
    direct = sum(
        (
            phi.T @ torch.nn.functional.one_hot(labels, CLASSES).to(torch.float64)
            for (c, _), (phi, labels) in data.items()
            if c != 2
        ),
        torch.zeros(DIM, CLASSES, dtype=torch.float64),
    )
    n = sum(int(labels.numel()) for (c, _), (_, labels) in data.items() if c != 2)
    gamma, _ = select_subspace_ridge_gcv(merged, corr, n, float(n))
    ref_gamma, _ = select_subspace_ridge_gcv(never, direct, n, float(n))
    assert gamma == ref_gamma
    assert relative(solve_subspace_ridge(merged, corr, gamma), solve_subspace_ridge(never, direct, ref_gamma)) <= TOL


def test_fedran_at_full_rank_the_merge_is_the_dense_gram_and_equals_the_central_ridge_after_removal() -> None:
    data = make_data(11)
    summaries = [[(c, client_summary(data[(c, t)][0], DIM)) for c in range(CLIENTS)] for t in range(TASKS)]
    merged = remerge_without(summaries, {0}, [DIM] * TASKS)
    assert merged is not None and merged.discarded.trace < 1e-9 * float(merged.singular_values.square().sum())
    rows = [data[(c, t)] for c in (1, 2, 3) for t in range(TASKS)]
    corr = sum(
        (phi.T @ torch.nn.functional.one_hot(labels, CLASSES).to(torch.float64) for phi, labels in rows),
        torch.zeros(DIM, CLASSES, dtype=torch.float64),
    )
    n = sum(int(r[1].numel()) for r in rows)
    gamma, _ = select_subspace_ridge_gcv(merged, corr, n, float(n))
    reference, ref_gamma = central_weights(rows, CLASSES)
    assert gamma == ref_gamma
    assert relative(solve_subspace_ridge(merged, corr, gamma), reference) <= TOL


# --------------------------------------------------------------------------- the forget round's messages
def test_a_forget_instruction_names_its_sites_and_a_statistics_instruction_stays_as_before() -> None:
    plain = _deliver(StatsIns(HEADER, CFG, num_seen=2))
    assert "forget" not in plain.content.config_records["round"]  # the wire of a statistics round is unchanged
    parsed = parse_instruction(_deliver(StatsIns(HEADER, CFG, num_seen=2, forget=(1, 3))))
    assert isinstance(parsed, StatsIns) and parsed.forget == (1, 3)
    bad = _deliver(StatsIns(HEADER, CFG, num_seen=2, forget=(1,)))
    bad.content.config_records["round"]["forget"] = "1,x"
    with pytest.raises(ProtocolError, match="forget: '1,x' is not a list of client ids"):
        parse_instruction(bad)


def test_a_forget_reply_is_read_typed_and_every_malformed_one_refused() -> None:
    data = make_data(12)
    up = upload_of(*data[(0, 0)], 0)
    assert up.gram_packed is not None
    stats = StsaStats(up.gram_packed, up.class_sums, up.counts)
    shapes: dict[str, Any] = {"packed": packed_length(DIM), "dim": DIM, "classes_of": {0: PER_TASK, 1: PER_TASK}}
    record = ForgetStats({0: stats}, {0: stats}).to_record("float64")
    read = ForgetStats.read(record, **shapes)
    assert torch.equal(read.added[0].gram_packed, stats.gram_packed) and set(read.kept) == {0}
    assert ForgetStats.read(ForgetStats({}, {}).to_record("float64"), **shapes).added == {}

    def refused(arrays: dict, message: str) -> None:
        with pytest.raises(UploadError, match=message):
            ForgetStats.read(ArrayRecord(arrays), **shapes)

    arrays = dict(record.items())
    refused({**arrays, "added-0-extra": arrays["added-0-counts"]}, "unexpected array 'added-0-extra'")
    refused({k.replace("-0-", "-4-"): v for k, v in arrays.items()}, "names a stage that has not run")
    refused(
        {k: v for k, v in arrays.items() if k != "added-0-counts"}, r"the added upload of stage 1 lacks \['counts'\]"
    )
    refused({k: v for k, v in arrays.items() if k.startswith("kept")}, "a kept part of stage 1 without the upload")
    wrong = ForgetStats({1: stats}, {}).to_record("float64")
    with pytest.raises(
        UploadError
    ):  # task 1's class sums need PER_TASK columns: these fit, the shape of 'packed' does not
        ForgetStats.read(wrong, packed=packed_length(DIM) + 1, dim=DIM, classes_of={0: PER_TASK, 1: PER_TASK})


def test_stsa_e_and_fedran_orders_of_requests_delete_both_ways_then_add_again() -> None:
    """Removals commute and a site that joins again is as if it never left: STSA-E's Eq. 9 inputs
    after removing clients 1 then 2, or 2 then 1, are those of a stage of clients {0, 3}; adding
    both back gives the estimate of all four. FedRAN re-merges the kept summaries, so removing 1
    then 2 is removing {1, 2}, and with both back the merge is the original one, bit for bit."""
    data = make_data(12)
    task = 1
    uploads = {c: stsa_e_uploads(data, c, task) for c in range(CLIENTS)}

    def estimator(clients) -> GramEstimator:
        est = GramEstimator(DIM, PER_TASK)
        for client in clients:
            est.add(*uploads[client])
        return est

    everyone, kept = estimator(range(CLIENTS)).result(), estimator((0, 3)).result()
    for order in ((1, 2), (2, 1)):
        est = estimator(range(CLIENTS))
        for client in order:
            remove_from_estimator(est, *uploads[client])
        assert relative(est.result(), kept) <= TOL
        for client in order:  # both join again
            est.add(*uploads[client])
        assert relative(est.result(), everyone) <= TOL

    rank = 6
    summaries = [[(c, client_summary(data[(c, t)][0], rank)) for c in range(CLIENTS)] for t in range(TASKS)]
    original: LowRankSummary | None = None
    for t in range(TASKS):
        original = merge_two_level([s for _, s in summaries[t]], original, rank)
    both = remerge_without(summaries, {1, 2}, [rank] * TASKS)
    after_one = [[(c, s) for c, s in stage if c != 1] for stage in summaries]
    one_then_other = remerge_without(after_one, {2}, [rank] * TASKS)
    back = remerge_without(summaries, set(), [rank] * TASKS)
    assert original is not None and both is not None and one_then_other is not None and back is not None
    assert torch.equal(both.basis, one_then_other.basis)
    assert torch.equal(both.singular_values, one_then_other.singular_values)
    assert torch.equal(back.basis, original.basis) and torch.equal(back.singular_values, original.singular_values)
