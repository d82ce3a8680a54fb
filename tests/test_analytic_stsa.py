"""STSA / STSA-E math checked against direct centralised computations (float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fcl_flower.analytic import (
    AnalyticInputError,
    ClassStatistics,
    NotPositiveDefiniteError,
    StatisticsAccumulator,
    accumulate_over_stages,
    aggregate,
    bytes_for,
    default_ridge_grid,
    estimate_gram,
    fedran_upload_numbers,
    logits,
    pack_upper,
    packed_length,
    paper_table5,
    predict,
    random_features,
    random_projection,
    ridge_residual,
    select_ridge_gcv,
    solve_ridge,
    split_into_dummy_clients,
    stsa_e_upload_numbers,
    stsa_upload_numbers,
    unpack_upper,
)
from tests.conftest import seeded_generator

F64 = torch.float64


_gen = seeded_generator


def _make_data(n: int, in_dim: int, rf_dim: int, num_classes: int, seed: int):
    """Class-dependent float32 'backbone' features, random ReLU features Φ and labels."""
    g = _gen(seed)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    centres = torch.randn(num_classes, in_dim, generator=g)
    feats = (centres[labels] + 0.7 * torch.randn(n, in_dim, generator=g)).float()
    proj = random_projection(in_dim, rf_dim, seed=seed + 1)
    return random_features(feats, proj), labels


def _direct(phi: torch.Tensor, labels: torch.Tensor, num_classes: int):
    y = torch.nn.functional.one_hot(labels, num_classes).to(F64)
    return phi.T @ phi, phi.T @ y, y.sum(0).to(torch.int64)


def _stats(phi, labels, num_classes, with_gram=True, batch=64) -> ClassStatistics:
    acc = StatisticsAccumulator(phi.shape[1], num_classes, with_gram=with_gram)
    for start in range(0, phi.shape[0], batch):
        acc.update(phi[start : start + batch], labels[start : start + batch])
    return acc.result()


def _central_ridge(phi, labels, num_classes, gamma):
    g, c, _ = _direct(phi, labels, num_classes)
    return torch.linalg.solve(g + gamma * torch.eye(g.shape[0], dtype=F64), c)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _dirichlet_split(labels: torch.Tensor, num_clients: int, beta: float, seed: int) -> list[torch.Tensor]:
    """Per-class Dirichlet(β) label-skew partition of the sample indices."""
    rng = np.random.default_rng(seed)
    y = labels.numpy()
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for cls in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == cls))
        cuts = (np.cumsum(rng.dirichlet(beta * np.ones(num_clients))) * len(idx)).astype(int)[:-1]
        for k, piece in enumerate(np.split(idx, cuts)):
            parts[k].extend(piece.tolist())
    return [torch.tensor(sorted(p), dtype=torch.int64) for p in parts]


# ---------------------------------------------------------------- random features


def test_random_projection_is_seeded_and_standard_normal():
    a = random_projection(16, 300, seed=7)
    b = random_projection(16, 300, seed=7)
    c = random_projection(16, 300, seed=8)
    assert a.dtype == F64 and a.shape == (16, 300) and a.device.type == "cpu"
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # N(0,1): 4800 draws, mean within 5 s.e., variance within 10 %
    assert abs(float(a.mean())) < 5 / math.sqrt(a.numel())
    assert abs(float(a.var()) - 1.0) < 0.1


def test_no_projection_means_phi_equals_features():
    assert random_projection(16, 16, seed=0) is None
    assert random_projection(16, 0, seed=0) is None
    feats = torch.randn(5, 16, generator=_gen(0)).float()
    phi = random_features(feats, None)
    assert phi.dtype == F64 and torch.equal(phi, feats.double())


def test_random_features_are_relu_of_float64_product():
    feats = torch.randn(9, 6, generator=_gen(1)).float()
    proj = random_projection(6, 20, seed=3)
    phi = random_features(feats, proj)
    assert phi.dtype == F64
    assert torch.equal(phi, torch.clamp(feats.double() @ proj, min=0))
    with pytest.raises(AnalyticInputError):
        random_features(feats, random_projection(5, 20, seed=3))


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("batch", [1, 7, 64, 500])
def test_streaming_accumulator_equals_direct(batch):
    phi, labels = _make_data(300, 12, 40, 6, seed=0)
    stats = _stats(phi, labels, 6, batch=batch)
    g, c, n = _direct(phi, labels, 6)
    torch.testing.assert_close(stats.gram, g, rtol=1e-12, atol=0)
    torch.testing.assert_close(stats.class_sums, c, rtol=1e-12, atol=0)
    assert torch.equal(stats.counts, n) and stats.num_samples == 300
    assert torch.equal(stats.gram, stats.gram.T)


def test_accumulator_without_gram_and_bad_labels():
    phi, labels = _make_data(50, 4, 10, 3, seed=1)
    stats = _stats(phi, labels, 3, with_gram=False)
    assert stats.gram is None
    acc = StatisticsAccumulator(10, 3)
    with pytest.raises(AnalyticInputError):
        acc.update(phi[:5], torch.tensor([0, 1, 2, 3, 0]))  # label out of range
    with pytest.raises(AnalyticInputError):
        acc.update(phi[:5], torch.zeros(5))  # float labels
    with pytest.raises(AnalyticInputError):
        acc.update(phi[:5, :9], labels[:5])  # wrong feature dim
    with pytest.raises(AnalyticInputError):
        _ = stats + _stats(phi, labels, 3)  # with and without Gram


@pytest.mark.parametrize("num_clients", [1, 5, 20])
def test_federated_ridge_equals_centralised_for_any_partition(num_clients):
    num_classes, gamma = 8, 50.0
    phi, labels = _make_data(600, 10, 80, num_classes, seed=2)
    w_central = _central_ridge(phi, labels, num_classes, gamma)
    for beta in (0.1, 1.0):
        parts = _dirichlet_split(labels, num_clients, beta, seed=num_clients)
        assert sum(len(p) for p in parts) == 600
        client_stats = [_stats(phi[p], labels[p], num_classes, batch=32) for p in parts]
        pooled = aggregate(client_stats)
        g, c, n = _direct(phi, labels, num_classes)
        torch.testing.assert_close(pooled.gram, g, rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(pooled.class_sums, c, rtol=1e-12, atol=1e-9)
        assert torch.equal(pooled.counts, n) and pooled.num_samples == 600
        assert sum(client_stats).num_samples == 600  # built-in sum() works too
        w_fed = solve_ridge(pooled.gram, pooled.class_sums, gamma)
        assert _rel(w_fed, w_central) <= 1e-8


def test_temporal_aggregation_equals_joint_solve_in_any_order():
    num_tasks, per_task, gamma = 4, 3, 10.0
    num_classes = num_tasks * per_task
    phi, labels = _make_data(800, 10, 60, num_classes, seed=3)
    stage_stats = []
    for t in range(num_tasks):
        idx = torch.nonzero((labels // per_task) == t).flatten()
        parts = _dirichlet_split(labels[idx], 5, 0.5, seed=t)
        clients = [_stats(phi[idx[p]], labels[idx[p]], num_classes) for p in parts]
        stage_stats.append(aggregate(clients))
    w_joint = _central_ridge(phi, labels, num_classes, gamma)
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        total = accumulate_over_stages(stage_stats[i] for i in order)
        assert _rel(solve_ridge(total.gram, total.class_sums, gamma), w_joint) <= 1e-8
    # After stage t the seen-class block equals the joint solve on tasks 1..t only.
    seen = 2 * per_task
    mask = labels < seen
    partial = accumulate_over_stages(stage_stats[:2])
    w_partial = solve_ridge(partial.gram, partial.class_sums[:, :seen], gamma)
    assert _rel(w_partial, _central_ridge(phi[mask], labels[mask], seen, gamma)) <= 1e-8


# ---------------------------------------------------------------- STSA-E estimator


def _naive_eq9(sums: torch.Tensor, counts: torch.Tensor, k_mode: str) -> torch.Tensor:
    """Eq. 9 term by term, with the code's clipping (global) or K_i (per-class)."""
    num_clients, dim, num_classes = sums.shape
    out = torch.zeros(dim, dim, dtype=F64)
    for i in range(num_classes):
        n = float(counts[:, i].sum())
        if n == 0:
            continue
        s = sums[:, :, i].sum(0)
        holders = [k for k in range(num_clients) if counts[k, i] > 0]
        if k_mode == "global":
            k_eff = num_clients
            a = max(0.0, (n - 1) / (k_eff - 1))
            b = max(0.0, (n - k_eff) / ((k_eff - 1) * n))
        else:
            k_eff = len(holders)
            if k_eff < 2:
                out += torch.outer(s, s) / n
                continue
            a = (n - 1) / (k_eff - 1)
            b = (n - k_eff) / ((k_eff - 1) * n)
        for k in holders:
            ck = sums[k, :, i]
            out += a * torch.outer(ck, ck) / float(counts[k, i])
        out -= b * torch.outer(s, s)
    return out


def _upload_sums(num_clients=6, dim=15, seed=4):
    """Uploads with: a class every client holds, one some lack, one with n < K, one held by a
    single client, and one absent everywhere."""
    g = _gen(seed)
    counts = torch.randint(1, 30, (num_clients, 5), generator=g)
    counts[0, 1] = 0
    counts[3, 1] = 0
    counts[:, 2] = 0
    counts[1, 2], counts[4, 2] = 2, 1  # n = 3 < K
    counts[:, 3] = 0
    counts[2, 3] = 9  # single holder
    counts[:, 4] = 0  # absent
    sums = torch.randn(num_clients, dim, 5, generator=g, dtype=F64).abs() * counts.unsqueeze(1)
    return sums, counts


@pytest.mark.parametrize("k_mode", ["global", "per-class"])
def test_eq9_vectorised_equals_naive_loop(k_mode):
    sums, counts = _upload_sums()
    fast = estimate_gram(sums, counts, k_mode=k_mode)
    slow = _naive_eq9(sums, counts, k_mode)
    assert _rel(fast, slow) <= 1e-12
    assert torch.equal(fast, fast.T)


def test_eq9_interpretable_form_and_psd():
    """Ĝ^(i) = n m mᵀ + (n−1)/(K−1) Σ_k n_k (m_k − m)(m_k − m)ᵀ."""
    g = _gen(5)
    num_clients, dim = 7, 12
    counts = torch.randint(1, 40, (num_clients, 1), generator=g)
    sums = (torch.randn(num_clients, dim, 1, generator=g, dtype=F64) + 2.0) * counts.unsqueeze(1)
    n = float(counts.sum())
    m_k = sums[:, :, 0] / counts.double()
    m = sums[:, :, 0].sum(0) / n
    dev = m_k - m
    expected = n * torch.outer(m, m) + (n - 1) / (num_clients - 1) * (dev.T @ (counts.double() * dev))
    for k_mode in ("global", "per-class"):  # every client holds the class: both modes agree
        got = estimate_gram(sums, counts, k_mode=k_mode)
        assert _rel(got, expected) <= 1e-12
        assert float(torch.linalg.eigvalsh(got).min()) >= -1e-9 * float(got.diagonal().sum())
    # rank(Ĝ^(i)) ≤ number of clients holding the class
    assert int(torch.linalg.matrix_rank(got)) <= num_clients


def test_eq9_per_class_unbiased_global_biased_monte_carlo():
    """E[Ĝ] = E[G] = Σ_i n_i (Σ_i + μ_i μ_iᵀ) for Gaussian class-conditional features.

    Class 0 is missing on one of 5 clients, class 1 is on all. Client sums are drawn from their
    exact law C_k = n_k μ + √n_k L z. Tolerance: 2 % relative trace / 3 % Frobenius for the
    per-class mode (Monte-Carlo s.e. ≈ 0.5 %). The global mode must instead match its derived
    biased mean, n μμᵀ + (K_i(n−1) − (n−K))/(K−1) Σ per class (K_i holders of K, n ≥ K), which
    here under-estimates the trace by > 8 % (about 20 Monte-Carlo s.e.).
    """
    g = _gen(6)
    num_clients, dim, reps = 5, 4, 20000
    counts = torch.tensor([[0, 12], [25, 8], [10, 30], [18, 5], [30, 20]], dtype=torch.int64)
    mus = 0.5 * torch.randn(2, dim, generator=g, dtype=F64)
    chols = []
    expected = torch.zeros(dim, dim, dtype=F64)
    biased = torch.zeros(dim, dim, dtype=F64)
    for i in range(2):
        a = torch.randn(dim, dim, generator=g, dtype=F64) / math.sqrt(dim)
        cov = a @ a.T + 0.5 * torch.eye(dim, dtype=F64)
        chols.append(torch.linalg.cholesky(cov))
        n_i, k_i = float(counts[:, i].sum()), float((counts[:, i] > 0).sum())
        expected += n_i * (cov + torch.outer(mus[i], mus[i]))
        biased += n_i * torch.outer(mus[i], mus[i])
        biased += (k_i * (n_i - 1) - (n_i - num_clients)) / (num_clients - 1) * cov
    cnt = counts.double()
    z = torch.randn(reps, num_clients, dim, 2, generator=g, dtype=F64)
    sums = torch.empty_like(z)
    for i in range(2):
        noise = torch.einsum("de,rke->rkd", chols[i], z[..., i]) * cnt[:, i].sqrt().view(1, -1, 1)
        sums[..., i] = cnt[:, i].view(1, -1, 1) * mus[i] + noise
    sums = sums * (cnt > 0).view(1, num_clients, 1, 2)  # an empty client uploads zeros

    means = {}
    for k_mode in ("global", "per-class"):
        total = torch.zeros(dim, dim, dtype=F64)
        for r in range(reps):
            total += estimate_gram(sums[r], counts, k_mode=k_mode)
        means[k_mode] = total / reps
    trace_err = {k: float(v.trace() / expected.trace()) - 1 for k, v in means.items()}
    assert abs(trace_err["per-class"]) < 0.02
    assert _rel(means["per-class"], expected) < 0.03
    assert _rel(means["global"], biased) < 0.03
    assert trace_err["global"] < -0.08


def test_estimator_input_errors():
    sums, counts = _upload_sums()
    with pytest.raises(AnalyticInputError):
        estimate_gram(sums, counts[:, :3])
    with pytest.raises(AnalyticInputError):
        estimate_gram(sums, counts, k_mode="local")
    with pytest.raises(AnalyticInputError):
        estimate_gram(sums[:1], counts[:1], k_mode="global")  # K − 1 = 0
    bad = counts.clone()
    bad[0, 0] = -1
    with pytest.raises(AnalyticInputError):
        estimate_gram(sums, bad)


def test_dummy_split_partitions_samples_reproducibly():
    chunks = split_into_dummy_clients(103, 10, seed=3)
    assert [len(c) for c in chunks] == [10] * 9 + [13]
    assert torch.equal(torch.sort(torch.cat(chunks)).values, torch.arange(103))
    again = split_into_dummy_clients(103, 10, generator=_gen(3))
    assert all(torch.equal(a, b) for a, b in zip(chunks, again))
    small = split_into_dummy_clients(3, 5, seed=0)
    assert [len(c) for c in small] == [0, 0, 0, 0, 3]
    with pytest.raises(AnalyticInputError):
        split_into_dummy_clients(10, 2)


def test_dummy_client_uploads_feed_estimator_and_sum_to_exact_class_sums():
    num_classes = 4
    phi, labels = _make_data(400, 8, 30, num_classes, seed=7)
    uploads = [
        _stats(phi[idx], labels[idx], num_classes, with_gram=False) for idx in split_into_dummy_clients(400, 8, seed=1)
    ]
    sums = torch.stack([u.class_sums for u in uploads])
    counts = torch.stack([u.counts for u in uploads])
    _, c, n = _direct(phi, labels, num_classes)
    torch.testing.assert_close(sums.sum(0), c, rtol=1e-12, atol=1e-9)  # C stays exact
    assert torch.equal(counts.sum(0), n)
    g_hat = estimate_gram(sums, counts, k_mode="per-class")
    assert _rel(g_hat, _naive_eq9(sums, counts, "per-class")) <= 1e-12


# ---------------------------------------------------------------- packing and communication


def test_pack_unpack_round_trip_and_errors():
    a = torch.randn(9, 9, generator=_gen(8), dtype=F64)
    sym = a + a.T
    packed = pack_upper(sym)
    assert packed.shape == (packed_length(9),) == (45,)
    assert torch.equal(packed[:9], sym[0])  # row-major: first row first
    assert torch.equal(unpack_upper(packed, 9), sym)
    with pytest.raises(AnalyticInputError):
        unpack_upper(packed[:-1], 9)
    with pytest.raises(AnalyticInputError):
        unpack_upper(packed, 8)
    with pytest.raises(AnalyticInputError):
        pack_upper(torch.zeros(3, 4))


def test_communication_formulas_reproduce_paper_table5():
    rows = paper_table5()
    assert [r.method for r in rows] == ["STSA", "STSA-E", "STSA", "STSA-E"]
    for row, printed in zip(rows, (955.58, 95.39, 60.08, 4.77)):
        assert abs(row.mib_total - printed) < 0.01
    # packed count is what pack_upper actually sends, plus C
    m, c_t = 37, 5
    assert stsa_upload_numbers(m, c_t, packed=True) == pack_upper(torch.zeros(m, m)).numel() + m * c_t
    assert stsa_upload_numbers(m, c_t, packed=False) == (m + c_t) * m
    assert stsa_e_upload_numbers(m, c_t, 3) == (m * c_t + c_t) * 3  # C_j plus n_j, K_D times
    assert fedran_upload_numbers(m, 4, 20) == m * 4 + 4 + m * 20
    assert bytes_for(10, "float64") == 2 * bytes_for(10, "float32") == 80
    with pytest.raises(AnalyticInputError):
        bytes_for(10, "float16")


# ---------------------------------------------------------------- ridge, residual, GCV


def test_cholesky_solve_matches_linalg_solve_and_rejects_non_pd():
    phi, labels = _make_data(40, 6, 60, 3, seed=9)  # M > n: G is singular
    g, c, _ = _direct(phi, labels, 3)
    w = solve_ridge(g, c, 1.0)
    assert _rel(w, torch.linalg.solve(g + torch.eye(60, dtype=F64), c)) <= 1e-10
    with pytest.raises(NotPositiveDefiniteError):
        solve_ridge(-g - torch.eye(60, dtype=F64), c, 0.5)
    with pytest.raises(AnalyticInputError):
        solve_ridge(g, c, -1.0)


def test_residual_from_statistics_equals_direct():
    phi, labels = _make_data(200, 8, 50, 5, seed=10)
    stats = _stats(phi, labels, 5)
    y = torch.nn.functional.one_hot(labels, 5).to(F64)
    for gamma in (0.1, 100.0):
        w = solve_ridge(stats.gram, stats.class_sums, gamma)
        direct = float(((y - phi @ w) ** 2).sum())
        # tr(YᵀY) = n for one-hot labels
        got = ridge_residual(stats.gram, stats.class_sums, w, stats.num_samples)
        assert abs(got - direct) <= 1e-8 * max(1.0, direct)


def _linear_problem(seed: int, n_train=150, n_test=3000, dim=60, outputs=3):
    g = _gen(seed)
    spectrum = torch.logspace(0, -2, dim, dtype=F64)  # decaying feature scales: ridge matters
    w_true = torch.randn(dim, outputs, generator=g, dtype=F64)
    x = torch.randn(n_train + n_test, dim, generator=g, dtype=F64) * spectrum
    y = x @ w_true + 0.3 * torch.randn(n_train + n_test, outputs, generator=g, dtype=F64)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def test_gcv_matches_direct_hat_matrix_formula():
    x, y, _, _ = _linear_problem(seed=11, n_train=80, dim=30)
    g, c = x.T @ x, x.T @ y
    grid = [1e-3, 0.1, 10.0]
    _, table = select_ridge_gcv(g, c, 80, float((y * y).sum()), grid=grid)
    for row in table:
        hat = x @ torch.linalg.solve(g + row.gamma * torch.eye(30, dtype=F64), x.T)
        rss = float(((y - hat @ y) ** 2).sum())
        df = float(hat.trace())
        assert abs(row.rss - rss) <= 1e-8 * rss
        assert abs(row.df - df) <= 1e-9 * 30
        assert abs(row.gcv - 80 * rss / (80 - df) ** 2) <= 1e-8 * row.gcv


@pytest.mark.parametrize("seed", [12, 13, 14])
def test_gcv_choice_is_near_best_held_out_gamma(seed):
    x, y, x_test, y_test = _linear_problem(seed)
    g, c = x.T @ x, x.T @ y
    grid = default_ridge_grid()
    best_gamma, table = select_ridge_gcv(g, c, x.shape[0], float((y * y).sum()), grid=grid)
    assert len(table) == len(grid) and best_gamma in grid.tolist()
    held_out = {gamma: float(((y_test - x_test @ solve_ridge(g, c, gamma)) ** 2).mean()) for gamma in grid.tolist()}
    assert held_out[best_gamma] <= 1.05 * min(held_out.values())
    # and the grid is not trivially flat: the worst γ is clearly worse
    assert max(held_out.values()) > 1.5 * min(held_out.values())


# ---------------------------------------------------------------- heads


def test_cosine_and_dot_heads_on_hand_example():
    # w_0 is long, w_1 short: dot favours class 0, cosine the better-aligned class 1.
    weights = torch.tensor([[10.0, 0.0], [0.0, 1.0]], dtype=F64)
    phi = torch.tensor([[1.0, 2.0], [3.0, 0.5]], dtype=F64)
    assert predict(phi, weights, "dot").tolist() == [0, 0]
    assert predict(phi, weights, "cosine").tolist() == [1, 0]
    dot = torch.tensor([[10.0, 2.0], [30.0, 0.5]], dtype=F64)
    torch.testing.assert_close(logits(phi, weights, "dot"), dot)
    cos = logits(phi, weights, "cosine")
    torch.testing.assert_close(cos[0], torch.tensor([1.0, 2.0], dtype=F64) / math.sqrt(5.0))
    # a zero (never-seen) class column scores 0, not NaN
    assert torch.isfinite(logits(phi, torch.cat([weights, torch.zeros(2, 1, dtype=F64)], 1))).all()
    with pytest.raises(AnalyticInputError):
        predict(phi, weights, "softmax")
