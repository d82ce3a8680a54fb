"""Tests of the STAMP pieces: gradient matching (CAGrad guarantee), temporal/spatial matching,
flatten utilities, prototypical coreset, ProtoNet loss and MixStyle."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fcl_flower.fcl.stamp as stamp
from fcl_flower.fcl.errors import FCLInputError
from fcl_flower.fcl.stamp import (
    assign_flat_grads,
    assign_flat_params,
    flatten_grads,
    flatten_params,
    gradient_match,
    gradient_match_result,
    mixstyle,
    project_to_simplex,
    protonet_loss,
    running_class_mean,
    select_coreset,
    spatial_match,
    task_gradient,
    temporal_match,
    unflatten_like,
)

torch.set_num_threads(2)


class TinyNet(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(5, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def random_instance(seed: int, conflict: bool) -> torch.Tensor:
    """N gradients in R^P; with ``conflict`` some pairs point in nearly opposite directions."""
    gen = torch.Generator().manual_seed(seed)
    n = [2, 3, 5, 10, 30, 100][seed % 6]
    g = torch.randn(n, 64, generator=gen, dtype=torch.float64)
    if conflict:
        g[1] = -0.8 * g[0] + 0.2 * torch.randn(64, generator=gen, dtype=torch.float64)
    else:
        g += 0.5 * torch.randn(64, generator=gen, dtype=torch.float64)  # a shared component
    return g * (10.0 ** (seed % 3 - 1))  # vary the scale too


# ------------------------------------------------------------------------------------------
# flatten / unflatten
# ------------------------------------------------------------------------------------------
def test_flatten_round_trip_and_grads() -> None:
    model = TinyNet()
    params = [p for p in model.parameters() if p.requires_grad]
    flat = flatten_params(model)
    assert flat.numel() == sum(p.numel() for p in params)  # the frozen parameter is excluded
    assign_flat_params(model, 2 * flat)
    assert torch.equal(flatten_params(model), 2 * flat)
    x, y = torch.randn(7, 5), torch.randint(0, 3, (7,))
    F.cross_entropy(model(x), y).backward()
    assert torch.equal(flatten_grads(model), torch.cat([p.grad.reshape(-1) for p in params]))
    parts = unflatten_like(flat, params)
    assert all(a.shape == p.shape for a, p in zip(parts, params))
    assign_flat_grads(model, torch.arange(flat.numel(), dtype=torch.float32))
    assert torch.equal(flatten_grads(model), torch.arange(flat.numel(), dtype=torch.float32))
    with pytest.raises(FCLInputError):
        unflatten_like(flat[:-1], params)


def test_task_gradient_matches_backward_and_leaves_grad_alone() -> None:
    model = TinyNet(1)
    x, y = torch.randn(9, 5), torch.randint(0, 2, (9,))
    g = task_gradient(model, x, y, num_seen=2)
    assert all(p.grad is None for p in model.parameters())
    F.cross_entropy(model(x)[:, :2], y).backward()
    assert torch.allclose(g, flatten_grads(model))


# ------------------------------------------------------------------------------------------
# gradient matching (Eq. 2) and its guarantee
# ------------------------------------------------------------------------------------------
def test_project_to_simplex() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        v = torch.randn(7, generator=gen, dtype=torch.float64) * 3
        w = project_to_simplex(v)
        assert torch.all(w >= 0) and math.isclose(float(w.sum()), 1.0, rel_tol=1e-12)
        # optimality (KKT): v - w = tau on the support, <= tau off it
        tau = float((v - w)[w > 0].mean())
        assert torch.allclose((v - w)[w > 0], torch.full_like(v[w > 0], tau), atol=1e-12)
        assert torch.all((v - w)[w == 0] <= tau + 1e-12)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("conflict", [False, True])
@pytest.mark.parametrize("c", [0.5, 1.0, 2.0])
def test_gradient_match_guarantee(seed: int, conflict: bool, c: float) -> None:
    g = random_instance(seed, conflict)
    res = gradient_match_result(g, c, rescale=False)
    d = res.direction
    g0 = g.mean(0)
    inner = g @ d  # recomputed here, independently of the solver's numbers
    scale = float((g**2).sum(1).max())
    tol = 1e-6 * scale
    # (1) d stays in the CAGrad ball around the mean, hence <g0, d> >= (1 - c)||g0||^2
    assert float((d - g0).norm()) <= c * float(g0.norm()) * (1 + 1e-9) + 1e-12
    assert float(g0 @ d) >= (1 - c) * float(g0 @ g0) - tol
    # (2) the worst-served input is served at least as well as by plain averaging
    assert float(inner.min()) >= float((g @ g0).min()) - tol
    # (3) the certificate is tight: min_i <g_i, d> equals the dual value F(w) up to the gap
    assert res.gap <= 1e-6 * scale and math.isclose(res.min_inner, float(inner.min()), rel_tol=1e-9, abs_tol=tol)
    # (4) optimality against 4000 random feasible directions of the primal problem
    gen = torch.Generator().manual_seed(100 + seed)
    u = torch.randn(4000, g.shape[1], generator=gen, dtype=torch.float64)
    u = u / u.norm(dim=1, keepdim=True) * (torch.rand(4000, 1, generator=gen, dtype=torch.float64) ** 0.02)
    cand = g0 + c * float(g0.norm()) * u
    assert float((cand @ g.T).min(dim=1).values.max()) <= float(inner.min()) + tol
    # (5) c >= 1: no conflict with any input at all
    if c >= 1.0:
        assert float(inner.min()) >= -tol
    # rescale divides by 1 + c^2 and changes nothing else
    assert torch.allclose(gradient_match(g, c), d / (1 + c * c), rtol=1e-10, atol=1e-12)


def test_gradient_match_removes_a_conflict_the_mean_has() -> None:
    g = torch.tensor([[1.0, 0.0], [-0.5, 0.2]], dtype=torch.float64)
    mean = g.mean(0)
    assert float(g[1] @ mean) < 0  # FedAvg's direction hurts input 2
    d = gradient_match(g, 1.0, rescale=False)
    assert torch.all(g @ d >= -1e-9)


def test_gradient_match_limits_and_invariances() -> None:
    g = random_instance(3, True)
    w = torch.rand(g.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    # c = 0: exactly the (weighted) mean, i.e. FedAvg
    assert torch.allclose(gradient_match(g, 0.0), g.mean(0), atol=1e-12)
    assert torch.allclose(gradient_match(g, 0.0, weights=w), (w / w.sum()) @ g, atol=1e-12)

    # positive scaling and permutation of the inputs
    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return float((a - b).norm()) <= 1e-6 * float(b.norm())

    d = gradient_match(g, 0.5)
    assert close(gradient_match(3.7 * g, 0.5), 3.7 * d)
    perm = torch.randperm(g.shape[0], generator=torch.Generator().manual_seed(1))
    assert close(gradient_match(g[perm], 0.5), d)
    # single input: CAGrad gives (1 + c) g, rescaled by 1 / (1 + c^2)
    assert torch.allclose(gradient_match(g[:1], 0.5), g[0] * 1.5 / 1.25, atol=1e-12)
    # identical inputs: nothing to trade off
    same = g[:1].repeat(4, 1)
    assert torch.allclose(gradient_match(same, 0.5, rescale=False), 1.5 * g[0], atol=1e-9)
    # a zero input imposes no constraint (it is left out of the dual, counted in g0)
    gz = torch.cat([g, torch.zeros(1, g.shape[1], dtype=g.dtype)])
    dz = gradient_match(gz, 1.0, rescale=False)
    assert float(dz.norm()) > 0 and float((g @ dz).min()) >= -1e-9 * float((g**2).sum(1).max())
    # zero mean: the ball is a point
    assert torch.allclose(gradient_match(torch.stack([g[0], -g[0]]), 0.5), torch.zeros_like(g[0]), atol=1e-12)


def test_gradient_match_chunked_gram_equals_unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    g = random_instance(4, True).to(torch.float32)
    full = gradient_match(g, 0.5)
    monkeypatch.setattr(stamp, "_CHUNK", 7)
    assert torch.allclose(gradient_match(g, 0.5), full, rtol=1e-5, atol=1e-6)


def test_gradient_match_bad_input() -> None:
    with pytest.raises(FCLInputError):
        gradient_match(torch.randn(3, 4), -0.1)
    with pytest.raises(FCLInputError):
        gradient_match(torch.tensor([[1.0, float("nan")]]), 0.5)
    with pytest.raises(FCLInputError):
        gradient_match(torch.randn(3, 4), 0.5, weights=torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(FCLInputError):
        gradient_match([], 0.5)


# ------------------------------------------------------------------------------------------
# temporal (Eq. 3) and spatial (Eq. 5) matching
# ------------------------------------------------------------------------------------------
def test_spatial_match_single_client_and_kappa_zero_is_fedavg() -> None:
    gen = torch.Generator().manual_seed(0)
    deltas = torch.randn(5, 40, generator=gen)
    counts = torch.tensor([10.0, 20.0, 5.0, 1.0, 64.0])
    assert torch.allclose(spatial_match(deltas, 0.0), deltas.mean(0), atol=1e-6)
    assert torch.allclose(spatial_match(deltas, 0.0, weights=counts), (counts / counts.sum()) @ deltas, atol=1e-6)
    assert torch.allclose(spatial_match(deltas[:1], 0.0), deltas[0])
    # conflict-averse aggregate: no client is served worse than by FedAvg (normalised or not)
    for normalize in (False, True):
        d = spatial_match(deltas, 0.5, rescale=False, normalize=normalize)
        ref = deltas / deltas.norm(dim=1, keepdim=True) * deltas.norm(dim=1).mean() if normalize else deltas
        assert float((ref @ d).min()) >= float((ref @ ref.mean(0)).min()) - 1e-4


def test_temporal_match_properties() -> None:
    gen = torch.Generator().manual_seed(2)
    cur = torch.randn(50, generator=gen, dtype=torch.float64)
    olds = torch.randn(3, 50, generator=gen, dtype=torch.float64)
    olds[0] = -cur + 0.3 * olds[0]  # an old task that the current step would hurt
    # nothing to match -> the local step unchanged
    assert torch.equal(temporal_match(cur, []), cur)
    d = temporal_match(cur, olds, 1.0, rescale=False)
    normed = torch.cat([olds / olds.norm(dim=1, keepdim=True) * cur.norm(), cur[None]])
    assert torch.all(normed @ d >= -1e-8)  # c = 1: no task (old or current) is hurt
    assert float(olds[0] @ d) >= -1e-8 and float(olds[0] @ cur) < 0
    # normalisation makes the old gradients' scale irrelevant, and the output scales with cur
    assert torch.allclose(temporal_match(cur, 50 * olds, 0.5), temporal_match(cur, olds, 0.5), rtol=1e-6)
    assert torch.allclose(temporal_match(2 * cur, olds, 0.5), 2 * temporal_match(cur, olds, 0.5), rtol=1e-6)
    with pytest.raises(FCLInputError):
        temporal_match(cur, torch.randn(2, 49, dtype=torch.float64))


# ------------------------------------------------------------------------------------------
# prototypical coreset (Eq. 6), ProtoNet (Eq. 8), MixStyle (Eq. 7)
# ------------------------------------------------------------------------------------------
def test_running_class_mean_by_hand() -> None:
    feats = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mean, count = running_class_mean(feats, torch.tensor([10.0, 0.0]), 3)
    # (3 * [10, 0] + [1, 2] + [3, 4]) / 5
    assert count == 5 and torch.allclose(mean, torch.tensor([34 / 5, 6 / 5], dtype=torch.float64))
    with pytest.raises(FCLInputError):
        running_class_mean(feats, None, 2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_select_coreset_respects_budget_and_tracks_prototype(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    sizes = {0: 3, 1: 25, 4: 40}
    labels = torch.cat([torch.full((n,), c) for c, n in sizes.items()])
    labels = labels[torch.randperm(len(labels), generator=gen)]
    feats = torch.randn(len(labels), 6, generator=gen, dtype=torch.float64) + labels[:, None]
    for k in (0, 1, 5, 20, 100):
        idx = select_coreset(feats, labels, k)
        assert len(set(idx.tolist())) == len(idx)
        for c, n in sizes.items():
            assert int((labels[idx] == c).sum()) == min(k, n)  # never over budget, never short
    # the K picked samples' mean tracks p^l; with a prior it moves towards the running mean
    k = 8
    idx = select_coreset(feats, labels, k)
    rows = labels == 4
    sel = idx[labels[idx] == 4]
    err = float((feats[sel].mean(0) - feats[rows].mean(0)).norm())
    rand = sorted(
        float((feats[rows][torch.randperm(40, generator=gen)[:k]].mean(0) - feats[rows].mean(0)).norm())
        for _ in range(200)
    )
    assert err < rand[100]
    prior = torch.full((6,), 10.0, dtype=torch.float64)
    idx_p = select_coreset(feats, labels, k, prior_means={4: prior}, prior_counts={4: 40})
    target = (feats[rows].sum(0) + 40 * prior) / 80
    sel_p = idx_p[labels[idx_p] == 4]
    assert float((feats[sel_p].mean(0) - target).norm()) < float((feats[sel].mean(0) - target).norm())


def test_protonet_loss_hand_computed() -> None:
    emb = torch.tensor(
        [
            [0.0, 0.0],
            [2.0, 0.0],
            [1.0, 1.0],  # class 0: support (0,0),(2,0); query (1,1)
            [5.0, 5.0],
            [4.0, 6.0],
        ],
        dtype=torch.float64,
    )  # class 1: support (5,5); query (4,6)
    labels = torch.tensor([0, 0, 0, 1, 1])
    p0, p1 = (1.0, 0.0), (5.0, 5.0)

    def d2(a: tuple[float, float], b: tuple[float, float]) -> float:
        return (a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2

    def ce(query: tuple[float, float], true: int) -> float:
        logits = [-d2(query, p0), -d2(query, p1)]
        m = max(logits)
        return -(logits[true] - m - math.log(sum(math.exp(v - m) for v in logits)))

    want = (ce((1.0, 1.0), 0) + ce((4.0, 6.0), 1)) / 2
    assert math.isclose(float(protonet_loss(emb, labels)), want, rel_tol=1e-12)
    assert math.isclose(float(protonet_loss(emb, labels, n_query=1)), want, rel_tol=1e-12)
    # a class with one sample has no support/query split and is skipped; gradients flow
    e = emb.clone().requires_grad_(True)
    loss = protonet_loss(e, torch.tensor([0, 0, 0, 1, 2]))
    loss.backward()
    assert e.grad is not None and torch.all(e.grad[3:] == 0)
    assert float(protonet_loss(emb[:2], torch.tensor([0, 1]))) == 0.0


def test_mixstyle_mixes_instance_statistics() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64) * 2 + 1
    b = torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64) * 0.5 - 3
    lam = 0.3
    out = mixstyle(a, b, lam, eps=0.0)
    mu = lambda x: x.mean(dim=(2, 3))  # noqa: E731 (a one-line helper reads best as a lambda here)
    sd = lambda x: x.var(dim=(2, 3), correction=0).sqrt()  # noqa: E731 (a one-line helper reads best as a lambda here)
    assert torch.allclose(mu(out), lam * mu(a) + (1 - lam) * mu(b), atol=1e-10)
    assert torch.allclose(sd(out), lam * sd(a) + (1 - lam) * sd(b), atol=1e-10)
    assert torch.allclose(mixstyle(a, b, 1.0, eps=0.0), a, atol=1e-10)
