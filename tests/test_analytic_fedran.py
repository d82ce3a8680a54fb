"""FedRAN math: low-rank Gram summaries, QR-SVD merges, subspace ridge, pseudo-labelling.

Every check compares against a direct centralised computation written here (exact Gram, dense
ridge solve, dense SVD, explicit cosine loop), or against the bounds of docs/methods/fedran.md §2.11.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fcl_flower.analytic.communication import fedran_upload_numbers as upload_numbers
from fcl_flower.analytic.lowrank import (
    LowRankError,
    LowRankSummary,
    TailEnergy,
    client_summary,
    client_summary_from_gram,
    discarded_energy,
    merge_pair,
    merge_summaries,
    merge_two_level,
    rank_for_budget,
)
from fcl_flower.analytic.pseudolabel import (
    class_prototypes,
    pseudo_label,
    pseudo_label_client,
    pseudo_label_report,
    select_labelled,
)
from fcl_flower.analytic.subspace import (
    outside_subspace_norm,
    pad_label_corr,
    solve_subspace_ridge,
    subspace_coefficients,
    weight_error_bound,
)
from tests.conftest import seeded_generator

F64 = torch.float64


# ----------------------------------------------------------------------------- helpers


generator = seeded_generator


def relu_features(n: int, in_dim: int, projection: torch.Tensor, gen: torch.Generator, labels=None):
    """ReLU random features of Gaussian inputs; class-dependent means when labels are given."""
    z = torch.randn(n, in_dim, generator=gen, dtype=F64)
    if labels is not None:
        means = torch.randn(int(labels.max()) + 1, in_dim, generator=generator(1234), dtype=F64)
        z = z + 2.0 * means[labels]
    return torch.relu(z @ projection)


def decaying_features(n: int, dim: int, gen: torch.Generator, decay: float = 0.8) -> torch.Tensor:
    """Rows with a geometrically decaying covariance spectrum in a fixed random basis."""
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator(99), dtype=F64))
    scales = decay ** torch.arange(dim, dtype=F64)
    return (torch.randn(n, dim, generator=gen, dtype=F64) * scales) @ basis.T


def one_hot(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(labels, num_classes).to(F64)


def centralised_ridge(features: torch.Tensor, targets: torch.Tensor, ridge: float) -> torch.Tensor:
    """(XᵀX + γI)⁻¹ XᵀY by Cholesky."""
    gram = features.T @ features + ridge * torch.eye(features.shape[1], dtype=F64)
    factor = torch.linalg.cholesky(gram)
    return torch.cholesky_solve(features.T @ targets, factor)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def split(n: int, num_clients: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Skewed random partition of range(n); some clients may get few or no samples."""
    weights = torch.rand(num_clients, generator=gen, dtype=F64) ** 3 + 0.02
    owner = torch.multinomial(weights / weights.sum(), n, replacement=True, generator=gen)
    return [torch.nonzero(owner == k).flatten() for k in range(num_clients)]


def projector(basis: torch.Tensor) -> torch.Tensor:
    return basis @ basis.T


# ------------------------------------------------ exactness without truncation (Prop. 1/2, Thm 2)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("stacked", [False, True])
def test_no_truncation_equals_centralised_ridge_over_tasks(seed: int, stacked: bool) -> None:
    dim, in_dim, num_clients, per_task, classes_per_task, ridge = 24, 10, 4, 70, 3, 0.3
    gen = generator(seed)
    projection = torch.randn(in_dim, dim, generator=gen, dtype=F64)
    all_h, all_y = [], []
    state: LowRankSummary | None = None
    label_corr = torch.zeros(dim, 0, dtype=F64)
    saw_small = saw_large = False
    for task in range(3):
        num_classes = classes_per_task * (task + 1)
        labels = task * classes_per_task + torch.randint(0, classes_per_task, (per_task,), generator=gen)
        h = relu_features(per_task, in_dim, projection, gen, labels)
        summaries, task_corr = [], torch.zeros(dim, num_classes, dtype=F64)
        for idx in split(per_task, num_clients, gen):
            saw_small |= 0 < len(idx) < dim
            saw_large |= len(idx) >= dim
            summary = client_summary(h[idx], rank=dim)
            assert summary.rank == min(len(idx), dim)
            summaries.append(summary)
            task_corr += h[idx].T @ one_hot(labels[idx], num_classes)
        label_corr = pad_label_corr(label_corr, num_classes) + task_corr
        state = merge_two_level(summaries, state, rank=dim, stacked=stacked)
        all_h.append(h)
        all_y.append(labels)

        h_all, y_all = torch.cat(all_h), torch.cat(all_y)
        exact_gram = h_all.T @ h_all
        assert rel_err(state.gram(), exact_gram) <= 1e-10
        assert state.num_samples == h_all.shape[0]
        assert state.discarded == TailEnergy(0.0, 0.0)
        # B summed over clients and zero-padded over tasks is exactly the centralised HᵀY.
        assert rel_err(label_corr, h_all.T @ one_hot(y_all, num_classes)) <= 1e-12
        expected = centralised_ridge(h_all, one_hot(y_all, num_classes), ridge)
        assert rel_err(solve_subspace_ridge(state, label_corr, ridge), expected) <= 1e-8
    assert saw_small and saw_large  # both ClientSVD branches were exercised


def test_no_truncation_merge_is_order_invariant() -> None:
    dim, gen = 16, generator(5)
    blocks = [decaying_features(n, dim, gen, decay=0.9) for n in (5, 11, 30, 7)]
    summaries = [client_summary(b, rank=dim) for b in blocks]
    forward = merge_summaries(summaries, rank=dim)
    backward = merge_summaries(summaries[::-1], rank=dim)
    assert rel_err(forward.gram(), backward.gram()) <= 1e-12
    assert torch.allclose(forward.singular_values, backward.singular_values, rtol=1e-12, atol=0)
    b = torch.randn(dim, 3, generator=gen, dtype=F64)
    assert rel_err(solve_subspace_ridge(forward, b, 0.1), solve_subspace_ridge(backward, b, 0.1)) <= 1e-10


# ------------------------------------------------------------------ client summary routes


@pytest.mark.parametrize("n", [9, 20, 45])
def test_client_summary_routes_agree_and_match_truncated_svd(n: int) -> None:
    dim, rank, gen = 20, 6, generator(n)
    h = decaying_features(n, dim, gen)
    full = torch.linalg.svd(h, full_matrices=False)
    by_svd = client_summary(h, rank, method="svd")
    by_gram = client_summary(h, rank, method="gram")
    auto = client_summary(h, rank)
    # Streaming: Gram accumulated in batches of 7 rows.
    gram = sum(h[i : i + 7].T @ h[i : i + 7] for i in range(0, n, 7))
    streamed = client_summary_from_gram(gram, n, rank)
    reference = full.Vh[:rank].T
    for summary in (by_svd, by_gram, auto, streamed):
        assert summary.rank == min(rank, n, dim) and summary.num_samples == n
        assert torch.allclose(summary.singular_values, full.S[:rank], rtol=1e-9, atol=0)
        assert torch.allclose(projector(summary.basis), projector(reference), atol=1e-9)
        assert torch.allclose(summary.basis.T @ summary.basis, torch.eye(rank, dtype=F64), atol=1e-12)
        assert summary.discarded.spectral == pytest.approx(float(full.S[rank] ** 2), rel=1e-8)
        assert summary.discarded.trace == pytest.approx(float((full.S[rank:] ** 2).sum()), rel=1e-8)
    # Deterministic sign convention: identical calls give identical numbers.
    assert torch.equal(client_summary(h, rank).basis, auto.basis)


def test_client_summary_rank_is_capped_by_samples_and_dimension() -> None:
    gen = generator(3)
    assert client_summary(torch.randn(4, 10, generator=gen, dtype=F64), 100).rank == 4
    assert client_summary(torch.randn(40, 10, generator=gen, dtype=F64), 100).rank == 10
    empty = client_summary(torch.zeros(0, 10, dtype=F64), 5)
    assert empty.rank == 0 and empty.dim == 10 and empty.num_samples == 0
    float32 = client_summary(torch.randn(6, 10, generator=gen), 3)
    assert float32.basis.dtype == F64


# --------------------------------------------------------------------- QR-SVD merge (Alg. 3)


@pytest.mark.parametrize("rank", [3, 8, 14])
def test_merge_pair_equals_truncated_svd_of_stacked_factors(rank: int) -> None:
    dim, gen = 30, generator(rank)
    a = client_summary(decaying_features(25, dim, gen), 9)
    b = client_summary(decaying_features(12, dim, gen), 7)
    merged = merge_pair(a, b, rank)
    stacked = torch.cat([a.basis * a.singular_values, b.basis * b.singular_values], dim=1)
    u, s, _ = torch.linalg.svd(stacked, full_matrices=False)
    keep = min(rank, s.numel())
    assert merged.rank == keep and merged.num_samples == 37
    assert torch.allclose(merged.singular_values, s[:keep], rtol=1e-10, atol=0)
    assert torch.allclose(projector(merged.basis), projector(u[:, :keep]), atol=1e-9)
    if rank >= s.numel():  # Proposition 2, no truncation: exactly A Aᵀ
        assert rel_err(merged.gram(), a.gram() + b.gram()) <= 1e-12


def test_stacked_merge_equals_truncated_svd_of_all_factors() -> None:
    dim, rank, gen = 30, 10, generator(11)
    parts = [client_summary(decaying_features(n, dim, gen), 8) for n in (20, 9, 14)]
    merged = merge_summaries(parts, rank, stacked=True)
    u, s, _ = torch.linalg.svd(torch.cat([p.factor() for p in parts], dim=1), full_matrices=False)
    assert torch.allclose(merged.singular_values, s[:rank], rtol=1e-10, atol=0)
    assert torch.allclose(projector(merged.basis), projector(u[:, :rank]), atol=1e-9)


def test_merge_with_more_columns_than_dimension() -> None:
    # r_a + r_b > M: reduced QR gives a square Q; the merge must still be exact.
    dim, gen = 8, generator(2)
    a = client_summary(torch.randn(30, dim, generator=gen, dtype=F64), dim)
    b = client_summary(torch.randn(30, dim, generator=gen, dtype=F64), dim)
    merged = merge_pair(a, b, dim)
    assert merged.rank == dim
    assert rel_err(merged.gram(), a.gram() + b.gram()) <= 1e-12


def test_merge_two_level_is_spatial_then_temporal() -> None:
    dim, rank, gen = 20, 5, generator(4)
    previous = client_summary(decaying_features(30, dim, gen), rank)
    clients = [client_summary(decaying_features(n, dim, gen), rank) for n in (15, 22, 9)]
    expected = merge_pair(previous, merge_summaries(clients, rank), rank)
    got = merge_two_level(clients, previous, rank)
    assert torch.equal(got.basis, expected.basis)
    assert torch.equal(got.singular_values, expected.singular_values)
    assert got.discarded == expected.discarded
    # No clients this task: the running summary is unchanged.
    unchanged = merge_two_level([], previous, rank)
    assert torch.equal(unchanged.gram(), previous.gram())


# ------------------------------------------------------------------------ Theorem 1 / 2


def _fedran_pipeline(tasks, rank: int):
    """Client summaries → two-level merge per task; also recomputes ε_G independently."""
    state, eps_g = None, 0.0
    for task in tasks:
        summaries = []
        for h in task:
            s = torch.linalg.svdvals(h)
            keep = min(rank, *h.shape)
            eps_g += float(s[keep] ** 2) if s.numel() > keep else 0.0  # local residual
            summaries.append(client_summary(h, rank))
        spatial = summaries[0]
        for summary in summaries[1:]:
            lam = torch.linalg.svdvals(torch.cat([spatial.factor(), summary.factor()], dim=1))
            eps_g += float(lam[rank] ** 2) if lam.numel() > rank else 0.0  # merge residual
            spatial = merge_pair(spatial, summary, rank)
        if state is not None:
            lam = torch.linalg.svdvals(torch.cat([state.factor(), spatial.factor()], dim=1))
            eps_g += float(lam[rank] ** 2) if lam.numel() > rank else 0.0
        got = merge_two_level(summaries, state, rank)
        state = merge_pair(state, spatial, rank) if state is not None else spatial
        assert torch.equal(got.singular_values, state.singular_values)
    return state, eps_g


def test_theorem1_gram_error_bound_and_monotone_in_rank() -> None:
    dim, in_dim, num_classes, ridge = 32, 12, 4, 1.0
    gen = generator(21)
    projection = torch.randn(in_dim, dim, generator=gen, dtype=F64) / math.sqrt(in_dim)
    tasks, labels = [], []
    for sizes in ((20, 45, 11), (38, 17, 26)):
        task = []
        for n in sizes:
            y = torch.randint(0, num_classes, (n,), generator=gen)
            task.append(relu_features(n, in_dim, projection, gen, y) @ torch.diag(0.85 ** torch.arange(dim, dtype=F64)))
            labels.append(y)
        tasks.append(task)
    h_all = torch.cat([h for task in tasks for h in task])
    y_all = one_hot(torch.cat(labels), num_classes)
    exact_gram = h_all.T @ h_all
    label_corr = h_all.T @ y_all
    w_star = centralised_ridge(h_all, y_all, ridge)

    gram_errors, losses = [], []
    for rank in (1, 2, 4, 8, 12, 16, 24, 32):
        state, eps_g = _fedran_pipeline(tasks, rank)
        residual = exact_gram - state.gram()
        spectral_error = float(torch.linalg.matrix_norm(residual, ord=2))
        scale = float(torch.linalg.matrix_norm(exact_gram, ord=2))
        # Theorem 1 with ε_G recomputed step by step here, and the summary's own bookkeeping.
        assert state.discarded.spectral == pytest.approx(eps_g, rel=1e-9, abs=1e-12 * scale)
        assert spectral_error <= eps_g + 1e-10 * scale
        # Eq. 58: all residuals are PSD, so G* − G̃ ⪰ 0 and its trace is the discarded trace.
        assert float(torch.linalg.eigvalsh(residual).min()) >= -1e-10 * scale
        assert float(residual.trace()) == pytest.approx(state.discarded.trace, rel=1e-8, abs=1e-10 * scale)
        # Theorem 2.
        w = solve_subspace_ridge(state, label_corr, ridge)
        assert float(torch.linalg.norm(w_star - w)) <= weight_error_bound(state, label_corr, ridge) * (1 + 1e-9) + 1e-12
        gram_errors.append(spectral_error)
        losses.append(float(((h_all @ w - y_all) ** 2).sum() + ridge * (w**2).sum()))

    tol = 1e-9
    assert all(b <= a * (1 + tol) + tol for a, b in itertools.pairwise(gram_errors)), gram_errors
    assert all(b <= a * (1 + tol) + tol for a, b in itertools.pairwise(losses)), losses
    assert gram_errors[0] > 10 * (gram_errors[-1] + 1e-6)  # truncation actually mattered
    best = float(((h_all @ w_star - y_all) ** 2).sum() + ridge * (w_star**2).sum())
    assert losses[-1] == pytest.approx(best, rel=1e-9)  # r = M: the exact ridge optimum


def test_discarded_energy_helper() -> None:
    s = torch.tensor([5.0, 3.0, 2.0, 1.0], dtype=F64)
    assert discarded_energy(s, 2) == TailEnergy(spectral=4.0, trace=5.0)
    assert discarded_energy(s, 4) == TailEnergy()
    assert discarded_energy(s, 0) == TailEnergy(spectral=25.0, trace=39.0)


# ------------------------------------------------------------------------ subspace solve


def test_subspace_solve_matches_sketched_objective_and_drops_complement() -> None:
    dim, rank, ridge, gen = 18, 5, 0.7, generator(8)
    summary = client_summary(decaying_features(40, dim, gen), rank)
    b = torch.randn(dim, 4, generator=gen, dtype=F64)
    u = summary.basis
    # Eq. 26 with the sketch: W̃ = (UᵀG̃U + γI)⁻¹ UᵀB, solved densely here.
    dense = torch.linalg.solve(u.T @ summary.gram() @ u + ridge * torch.eye(rank, dtype=F64), u.T @ b)
    assert rel_err(subspace_coefficients(summary, b, ridge), dense) <= 1e-10
    w = solve_subspace_ridge(summary, b, ridge)
    assert rel_err(w, u @ dense) <= 1e-10
    assert float(torch.linalg.norm(w - projector(u) @ w)) <= 1e-12 * float(torch.linalg.norm(w))
    # Eq. 73: the full sketched ridge adds exactly (1/γ)(I − UUᵀ)B, the part we drop.
    full = torch.linalg.solve(summary.gram() + ridge * torch.eye(dim, dtype=F64), b)
    outside = b - projector(u) @ b
    assert rel_err(full, w + outside / ridge) <= 1e-9
    assert outside_subspace_norm(summary, b) == pytest.approx(float(torch.linalg.norm(outside)), rel=1e-10)


def test_pad_label_corr_equals_wider_one_hot() -> None:
    gen = generator(6)
    # multiples of 1/64 below 8: every sum of products in HᵀY is exact whatever the order, so the
    # bit-for-bit comparison tests the padding, not how a BLAS kernel orders the sums (Gaussian
    # entries gave different roundings for 3 and 7 columns under MKL's AVX2 path)
    h = torch.randint(-512, 512, (12, 5), generator=gen).to(F64) / 64
    y = torch.randint(0, 3, (12,), generator=gen)
    assert torch.equal(pad_label_corr(h.T @ one_hot(y, 3), 7), h.T @ one_hot(y, 7))
    assert pad_label_corr(torch.zeros(5, 0, dtype=F64), 2).shape == (5, 2)
    with pytest.raises(ValueError):
        pad_label_corr(torch.zeros(5, 3, dtype=F64), 2)


# ------------------------------------------------------------------------- budget (Eq. 12)


def test_upload_numbers_reproduce_reported_mib() -> None:
    mib = lambda m, r, c: 8 * upload_numbers(m, r, c) / 2**20  # noqa: E731 (a one-line helper reads best as a lambda here)
    assert round(mib(2048, 512, 100), 2) == 9.57
    assert round(mib(2048, 512, 200), 2) == 11.13
    assert round(mib(8192, 2048, 100), 2) == 134.27
    assert round(mib(8192, 2048, 200), 2) == 140.52
    assert round(mib(8192, 512, 50), 2) == 35.13


def test_rank_for_budget_inverts_byte_formula() -> None:
    gen = generator(0)
    for trial in range(200):
        dim = int(torch.randint(1, 300, (1,), generator=gen))
        classes = int(torch.randint(0, 50, (1,), generator=gen))
        width = (4, 8)[trial % 2]
        floor_bytes = width * upload_numbers(dim, 1, classes)
        budget = floor_bytes + int(torch.randint(0, width * dim * (dim + 3), (1,), generator=gen))
        rank = rank_for_budget(budget, dim, classes, width)
        assert 1 <= rank <= dim
        assert width * upload_numbers(dim, rank, classes) <= budget
        assert rank == dim or width * upload_numbers(dim, rank + 1, classes) > budget
        # The budget that exactly fits rank r gives back r.
        assert rank_for_budget(width * upload_numbers(dim, rank, classes), dim, classes, width) == rank
    with pytest.raises(LowRankError, match="cannot hold B"):
        rank_for_budget(8 * 100 * 10 - 1, 100, 10, 8)
    with pytest.raises(LowRankError, match="rank-1"):
        rank_for_budget(8 * 100 * 10 + 8 * 100, 100, 10, 8)


# ---------------------------------------------------------------------- pseudo-labelling


def _ssl_problem(seed: int):
    gen = generator(seed)
    num_classes, dim = 6, 16
    centres = torch.randn(num_classes, dim, generator=gen, dtype=F64) * 2
    y_lab = torch.randint(0, 4, (40,), generator=gen)  # classes 4 and 5 have no labels
    y_unl = torch.randint(0, num_classes, (200,), generator=gen)
    z_lab = centres[y_lab] + torch.randn(40, dim, generator=gen, dtype=F64)
    z_unl = centres[y_unl] + torch.randn(200, dim, generator=gen, dtype=F64)
    return z_lab, y_lab, z_unl, y_unl, num_classes


@pytest.mark.parametrize("threshold", [-0.2, 0.3, 0.5, 0.8])
def test_pseudo_label_matches_direct_cosine_rule(threshold: float) -> None:
    z_lab, y_lab, z_unl, _, num_classes = _ssl_problem(0)
    prototypes, present = class_prototypes(z_lab, y_lab, num_classes)
    assert present.tolist() == [True] * 4 + [False] * 2
    labels, accepted = pseudo_label(z_unl, prototypes, present, threshold)
    for i in range(z_unl.shape[0]):
        cosines = {}
        for c in range(num_classes):
            members = z_lab[y_lab == c]
            if len(members):
                mean = members.mean(dim=0)
                cosines[c] = float(torch.dot(z_unl[i], mean) / (z_unl[i].norm() * mean.norm()))
        best = max(cosines, key=cosines.get)
        assert bool(accepted[i]) == (cosines[best] >= threshold)
        assert int(labels[i]) == (best if cosines[best] >= threshold else -1)
    assert set(labels[accepted].tolist()) <= {0, 1, 2, 3}


def test_pseudo_label_threshold_is_inclusive() -> None:
    z_lab = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=F64)
    y_lab = torch.tensor([0, 1])
    u = torch.tensor([[4.0, 3.0]], dtype=F64)  # cosines 0.8 and 0.6 exactly
    prototypes, present = class_prototypes(z_lab, y_lab, 2)
    assert pseudo_label(u, prototypes, present, 0.8)[1].tolist() == [True]
    assert pseudo_label(u, prototypes, present, 0.8 + 1e-12)[1].tolist() == [False]


def test_pseudo_label_never_uses_unlabelled_class() -> None:
    z_lab, y_lab, _, _, num_classes = _ssl_problem(1)
    prototypes, present = class_prototypes(z_lab, y_lab, num_classes)
    # Unlabelled points sitting exactly on a class-5 direction still get a labelled class or none.
    gen = generator(9)
    centre5 = torch.randn(1, z_lab.shape[1], generator=gen, dtype=F64)
    labels, accepted = pseudo_label(centre5.repeat(10, 1), prototypes, present, -1.0)
    assert bool(accepted.all()) and set(labels.tolist()) <= {0, 1, 2, 3}
    none_present = torch.zeros(num_classes, dtype=torch.bool)
    labels, accepted = pseudo_label(centre5, prototypes, none_present, -1.0)
    assert not bool(accepted.any()) and labels.tolist() == [-1]


def test_pseudo_label_client_and_report() -> None:
    z_lab, y_lab, z_unl, y_unl, num_classes = _ssl_problem(2)
    out = pseudo_label_client(z_lab, y_lab, z_unl, num_classes, threshold=0.5)
    assert out.num_labelled == 40 and out.num_accepted == int(out.accepted.sum())
    assert torch.equal(out.features, torch.cat([z_lab, z_unl[out.accepted]]))
    assert torch.equal(out.labels, torch.cat([y_lab, out.predicted[out.accepted]]))
    report = pseudo_label_report(out.accepted, out.predicted, y_unl)
    correct = sum(int(out.predicted[i] == y_unl[i]) for i in range(200) if out.accepted[i])
    assert report["accepted"] == out.num_accepted and report["correct"] == correct
    assert report["total"] == 200 and report["precision"] == pytest.approx(correct / out.num_accepted)
    assert 0 < out.num_accepted < 200  # the threshold does separate on this problem


def test_full_label_ratio_changes_nothing() -> None:
    z_lab, y_lab, z_unl, _, num_classes = _ssl_problem(3)
    z_all = torch.cat([z_lab, z_unl])
    mask = select_labelled(z_all.shape[0], 1.0, generator(0))
    assert bool(mask.all())
    out = pseudo_label_client(z_all[mask], torch.cat([y_lab, y_lab.new_zeros(200)])[mask], z_all[~mask], num_classes)
    assert out.num_accepted == 0 and out.accepted.numel() == 0
    assert torch.equal(out.features, z_all)
    none = pseudo_label_client(z_lab, y_lab, None, num_classes)
    assert torch.equal(none.features, z_lab) and torch.equal(none.labels, y_lab)


def test_select_labelled_fraction_and_seed() -> None:
    mask = select_labelled(50, 0.2, generator(7))
    assert mask.dtype == torch.bool and int(mask.sum()) == 10
    assert torch.equal(mask, select_labelled(50, 0.2, generator(7)))
    assert not torch.equal(mask, select_labelled(50, 0.2, generator(8)))
    assert int(select_labelled(50, 0.0, generator(7)).sum()) == 0
    assert int(select_labelled(0, 0.5, generator(7)).sum()) == 0
    with pytest.raises(ValueError):
        select_labelled(10, 1.5, generator(0))


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_value_errors() -> None:
    good = client_summary(torch.randn(10, 6, generator=generator(0), dtype=F64), 3)
    other_dim = client_summary(torch.randn(10, 7, generator=generator(0), dtype=F64), 3)
    cases = [
        lambda: client_summary(torch.randn(4, 3), 0),
        lambda: client_summary(torch.randn(4), 2),
        lambda: client_summary(torch.tensor([[float("nan"), 1.0]]), 1),
        lambda: client_summary_from_gram(torch.randn(4, 3, dtype=F64), 5, 2),
        lambda: client_summary_from_gram(torch.tensor([[1.0, 2.0], [0.0, 1.0]], dtype=F64), 5, 2),
        lambda: merge_pair(good, other_dim, 3),
        lambda: merge_summaries([], 3),
        lambda: merge_two_level([], None, 3),
        lambda: LowRankSummary(torch.zeros(4, 2, dtype=F64), torch.zeros(3, dtype=F64), 1),
        lambda: LowRankSummary(torch.zeros(4, 1, dtype=F64), torch.tensor([-1.0], dtype=F64), 1),
        lambda: solve_subspace_ridge(good, torch.zeros(5, 2, dtype=F64), 0.1),
        lambda: solve_subspace_ridge(good, torch.zeros(6, 2, dtype=F64), -1.0),
        lambda: class_prototypes(torch.randn(3, 2), torch.tensor([0, 1, 5]), 3),
        lambda: pseudo_label(torch.randn(3, 2), torch.randn(2, 3), torch.ones(2, dtype=torch.bool)),
    ]
    for case in cases:
        with pytest.raises(ValueError):
            case()
