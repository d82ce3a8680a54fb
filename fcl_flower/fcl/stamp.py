"""STAMP: spatio-temporal gradient matching with a prototypical coreset (pure torch pieces).

Nguyen, Nguyen, Pham, "Improving Generalization in Heterogeneous Federated Continual Learning
via Spatio-Temporal Gradient Matching with Prototypical Coreset" ([P-ST]); method notes:
``docs/methods/lga_stamp.md`` Part B. Equation numbers are the paper's.

Gradient matching (GM, Eq. 2 / Alg. 1 lines 19-20 and 30-31) is CAGrad (Liu et al., 2021):
given vectors g_1..g_N and their (weighted) mean g0, it returns

    d = g0 + (c ||g0|| / ||g_w||) g_w,   g_w = sum_i w_i g_i,
    w = argmin_{w in simplex} F(w),      F(w) = g_w . g0 + c ||g0|| ||g_w||,

the solution of the primal  max_d min_i <g_i, d>  s.t.  ||d - g0|| <= c ||g0||.

Guarantee (documented and tested). d is always feasible, ``||d - g0|| <= c ||g0||``, hence
``<g0, d> >= (1 - c) ||g0||^2``. For any simplex w, ``min_i <g_i, d>`` is a lower bound and
F(w) an upper bound on the primal optimum (weak duality); they meet at the dual optimum
(strong duality), and the solver reports ``gap = F(w) - min_i <g_i, d>``. So

    min_i <g_i, d>  >=  max_{||d' - g0|| <= c||g0||} min_i <g_i, d'>  -  gap
    min_i <g_i, d>  >=  min_i <g_i, g0>                  (g0 is feasible; exact, see safeguard)
    min_i <g_i, d>  >=  0                    if c >= 1   (0 is feasible; exact)

i.e. the worst-served input is never served worse than by plain averaging, and for c >= 1 the
direction conflicts with no input. (For c < 1 a conflict-free direction may not exist inside
the ball; then d is the least-conflicting one.) With ``rescale=True`` every inner product is
divided by ``1 + c^2`` (a positive scale), which keeps all signs.

Sign convention: the functions are linear in their inputs, so they work on gradients (apply
``theta <- theta - eta d``) and on model deltas (apply ``theta <- theta + eta d``) alike, as long
as all inputs use the same convention. :func:`spatial_match` takes client deltas
(``theta_u - theta``, Eq. 5) and returns the server update to ADD; :func:`temporal_match` takes
loss gradients (for the current task pass the pseudo-gradient ``theta_ref - theta_local``) and
returns a direction to SUBTRACT.

Departures
----------
* Eq. 2 prints GM without the g0 term; we use Alg. 1's full CAGrad form ``g0 + ...`` (docs/methods/lga_stamp.md B6.1)
  and the mean (Eq. 2), not Alg. 1 line 18's sum (docs/methods/lga_stamp.md B6.3; the sum only rescales).
* The paper's "g_G . g_i <= 0" is a sign typo for ">= 0" (docs/methods/lga_stamp.md B6.2); see the guarantee above.
* ``rescale=True`` (default) divides d by ``1 + c^2`` as [CODE-ST*] does (docs/methods/lga_stamp.md B6.1).
* Dual solver: accelerated projected gradient on the simplex in the N x N Gram space (float64)
  with backtracking and best-iterate tracking, instead of [CODE-ST*]'s SGD on softmax logits
  with lr 25 and StepLR; it stops on a relative duality gap of 1e-7 (``iterations`` is only a
  cap, default 1000 for both client and server, instead of the code's 25 / 100 SGD steps) and
  returns the gap as a certificate.
* Safeguard: the CAGrad point, g0 and (when c >= 1) the zero vector are all primal-feasible;
  the one with the largest ``min_i <g_i, d>`` is returned (the CAGrad point on ties). With an
  exact dual solution this is always the CAGrad point; the safeguard only matters when the
  dual is solved inexactly or is degenerate (0 in the convex hull of the inputs, so g_w = 0),
  and it makes the two bounds above hold by construction. Zero input vectors impose no
  constraint (``<0, d> = 0`` for every d) and are left out of the dual; they still count in g0.
  If ||g0|| = 0 the result is 0.
* Temporal matching normalises every task vector to the current-task vector's norm before the
  solve (docs/methods/lga_stamp.md B6.7, App. D.2.1's "gradient normalisation"); with no old task it returns the
  current vector unchanged (there is nothing to match).
* Spatial matching accepts optional FedAvg weights (example counts) for g0; Alg. 1 uses the
  uniform mean, the default. Optional normalisation of client deltas (Fig. 8) is off by default.
* Coreset (Eq. 6): the learnable coefficients A are read as a binary selection of exactly
  K = ``budget_per_class`` samples, chosen by greedy herding towards p^l, the running
  count-weighted class mean of Eq. 6 (docs/methods/lga_stamp.md B5.2/B6.8); herding is the greedy minimiser of Eq. 6's
  objective. MixStyle (Eq. 7) is provided as a function but not wired into the selection
  (its trigger and lambda are unspecified; docs/methods/lga_stamp.md B6.8).
* ProtoNet (Eq. 8): standard ProtoNet, softmax over ``-d`` (the printed ``exp(+d)`` is a typo,
  docs/methods/lga_stamp.md B6.9); support/query split within the batch: the last ``n_query`` samples of each class
  (default half of them) are queries, classes with a single sample are skipped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import FCLInputError
from .exemplars import herding_towards

__all__ = [
    "GMResult",
    "assign_flat_grads",
    "assign_flat_params",
    "flatten_grads",
    "flatten_params",
    "gradient_match",
    "gradient_match_result",
    "mixstyle",
    "project_to_simplex",
    "protonet_loss",
    "running_class_mean",
    "select_coreset",
    "solve_gm_dual",
    "spatial_match",
    "task_gradient",
    "temporal_match",
    "trainable_parameters",
    "unflatten_like",
]

_CHUNK = 1 << 20  # columns per float64 chunk when forming Gram matrices of long vectors


# --------------------------------------------------------------------------------------------
# flatten / unflatten a model's trainable parameters
# --------------------------------------------------------------------------------------------
def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters with ``requires_grad``, in ``model.parameters()`` order (the flat layout)."""
    return [p for p in model.parameters() if p.requires_grad]


def flatten_params(model: nn.Module) -> Tensor:
    """Trainable parameters concatenated into one detached 1-D tensor."""
    params = trainable_parameters(model)
    if not params:
        raise FCLInputError("model has no trainable parameters")
    return torch.cat([p.detach().reshape(-1) for p in params])


def flatten_grads(model: nn.Module) -> Tensor:
    """``.grad`` of the trainable parameters as one 1-D tensor (zeros where grad is None)."""
    params = trainable_parameters(model)
    if not params:
        raise FCLInputError("model has no trainable parameters")
    return torch.cat([(p.grad.detach() if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def unflatten_like(flat: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    """Split a flat vector into views shaped like ``params`` (inverse of the flatteners)."""
    total = sum(p.numel() for p in params)
    if flat.ndim != 1 or flat.numel() != total:
        raise FCLInputError(f"flat vector has {flat.numel()} entries, parameters need {total}")
    out, offset = [], 0
    for p in params:
        out.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return out


@torch.no_grad()
def assign_flat_params(model: nn.Module, flat: Tensor) -> None:
    """Copy a flat vector into the trainable parameters (in place)."""
    params = trainable_parameters(model)
    for p, v in zip(params, unflatten_like(flat, params)):
        p.copy_(v.to(p.dtype))


def assign_flat_grads(model: nn.Module, flat: Tensor) -> None:
    """Set ``.grad`` of the trainable parameters from a flat vector (then ``optimizer.step()``)."""
    params = trainable_parameters(model)
    for p, v in zip(params, unflatten_like(flat, params)):
        p.grad = v.detach().to(p.dtype).clone()


def task_gradient(model: nn.Module, x: Tensor, y: Tensor, *, num_seen: int | None = None) -> Tensor:
    """Flat gradient of the mean CE of ``model`` on one batch (Alg. 1 line 16, Eq. 4 with coreset
    images through the full network, docs/methods/lga_stamp.md B6.6). Does not touch ``.grad``."""
    params = trainable_parameters(model)
    if not params:
        raise FCLInputError("model has no trainable parameters")
    z = model(x)
    if num_seen is not None:
        z = z[:, :num_seen]
    grads = torch.autograd.grad(F.cross_entropy(z, y), params, allow_unused=True)
    return torch.cat(
        [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)]
    ).detach()


# --------------------------------------------------------------------------------------------
# gradient matching (Eq. 2): CAGrad dual on the simplex
# --------------------------------------------------------------------------------------------
def project_to_simplex(v: Tensor) -> Tensor:
    """Euclidean projection onto the probability simplex (Duchi et al., 2008)."""
    if v.ndim != 1 or v.numel() == 0:
        raise FCLInputError("project_to_simplex needs a non-empty 1-D tensor")
    u, _ = torch.sort(v, descending=True)
    css = torch.cumsum(u, 0) - 1.0
    k = torch.arange(1, v.numel() + 1, dtype=v.dtype, device=v.device)
    rho = int(torch.nonzero(u - css / k > 0).reshape(-1)[-1])
    tau = css[rho] / (rho + 1)
    return (v - tau).clamp_min(0.0)


def _gram(grads: Tensor) -> Tensor:
    """G = grads grads^T in float64, chunked over columns to bound memory for long vectors."""
    n, p = grads.shape
    g = torch.zeros(n, n, dtype=torch.float64, device=grads.device)
    for s in range(0, p, _CHUNK):
        blk = grads[:, s : s + _CHUNK].to(torch.float64)
        g += blk @ blk.T
    return g


def _combine(coeffs: Tensor, grads: Tensor) -> Tensor:
    """sum_i coeffs_i grads_i, accumulated in float64 chunk by chunk, returned in grads' dtype."""
    out = torch.empty(grads.shape[1], dtype=grads.dtype, device=grads.device)
    c = coeffs.to(device=grads.device, dtype=torch.float64)
    for s in range(0, grads.shape[1], _CHUNK):
        out[s : s + _CHUNK] = (c @ grads[:, s : s + _CHUNK].to(torch.float64)).to(grads.dtype)
    return out


def _norm_and_inner(w: Tensor, grads: Tensor) -> tuple[float, Tensor]:
    """||g_w||^2 and the vector <g_i, g_w> for g_w = sum_i w_i g_i, in float64 by chunks.

    Computed from the vectors, not from the Gram matrix, because ``w^T G w`` loses all
    precision when g_w nearly cancels (0 close to the convex hull of the inputs)."""
    wc = w.to(device=grads.device, dtype=torch.float64)
    sq = 0.0
    inner = torch.zeros(grads.shape[0], dtype=torch.float64, device=grads.device)
    for s in range(0, grads.shape[1], _CHUNK):
        blk = grads[:, s : s + _CHUNK].to(torch.float64)
        gw = wc @ blk
        sq += float(gw @ gw)
        inner += blk @ gw
    return sq, inner.cpu()


def _solve_dual(G: Tensor, b: Tensor, r: float, *, iterations: int, tol: float, ref: float) -> Tensor:
    """Minimise ``F(w) = w.b + r sqrt(w^T G w)`` on the simplex (float64, FISTA + backtracking).

    Starts at the uniform point, restarts momentum whenever F stops decreasing, keeps the best
    iterate, and stops once the duality gap ``F(w) - min_i (b + r G w / ||g_w||)_i`` is below
    ``tol * ref``.
    """
    n = G.shape[0]
    w = torch.full((n,), 1.0 / n, dtype=torch.float64)
    scale = float(torch.diagonal(G).max())
    if n == 1 or r == 0.0 or scale <= 0.0:
        return w
    delta = 1e-18 * scale  # smooths sqrt at g_w = 0 without moving the optimum measurably

    def f(v: Tensor) -> float:
        return float(v @ b + r * torch.sqrt((v @ G @ v).clamp_min(0.0) + delta))

    def grad(v: Tensor) -> Tensor:
        return b + r * (G @ v) / torch.sqrt((v @ G @ v).clamp_min(0.0) + delta)

    def gap(v: Tensor, fv: float) -> float:
        gw = math.sqrt(max(float(v @ G @ v), 0.0))
        return math.inf if gw <= 0.0 else fv - float((b + (r / gw) * (G @ v)).min())

    best_w, best_f = w.clone(), f(w)
    z, t_mom = w.clone(), 1.0
    step = 1.0 / scale
    stalled = 0
    for _ in range(iterations):
        if gap(best_w, best_f) <= tol * ref or stalled >= 50:  # converged, or at rounding level
            break
        gz, fz = grad(z), f(z)
        while True:
            cand = project_to_simplex(z - step * gz)
            diff = cand - z
            if f(cand) <= fz + float(gz @ diff) + float(diff @ diff) / (2 * step) or step < 1e-30:
                break
            step *= 0.5
        t_next = (1 + math.sqrt(1 + 4 * t_mom * t_mom)) / 2
        z = cand + ((t_mom - 1) / t_next) * (cand - w)
        w, t_mom = cand, t_next
        fw = f(w)
        stalled = 0 if fw < best_f - 1e-13 * max(abs(best_f), ref) else stalled + 1
        if fw < best_f:
            best_w, best_f = w.clone(), fw
        else:  # restart momentum when the objective stops decreasing
            z, t_mom = best_w.clone(), 1.0
        step *= 2.0  # let the step grow back after backtracking
    return best_w


def solve_gm_dual(
    gram: Tensor, c: float, p: Tensor | None = None, *, iterations: int = 1000, tol: float = 1e-7
) -> Tensor:
    """Minimise ``F(w) = w^T G p + c sqrt(p^T G p) sqrt(w^T G w)`` over the simplex (float64).

    The CAGrad dual in the N x N Gram space: accelerated projected gradient (FISTA) with
    backtracking and momentum restarts, returning the best iterate. O(N^2) per iteration, so
    N <= 100 costs well under a millisecond per step. Stops early once the duality gap is below
    ``tol * max(|F|, ||g0||^2)``.
    """
    G = gram.to(torch.float64)
    n = G.shape[0]
    if G.ndim != 2 or G.shape[1] != n or n == 0:
        raise FCLInputError(f"gram must be a non-empty square matrix, got {tuple(gram.shape)}")
    p = torch.full((n,), 1.0 / n, dtype=torch.float64) if p is None else p.to(torch.float64)
    b = G @ p
    g0_sq = max(float(p @ b), 0.0)
    return _solve_dual(G, b, c * math.sqrt(g0_sq), iterations=iterations, tol=tol, ref=max(g0_sq, 1e-300))


@dataclass(frozen=True)
class GMResult:
    """Output of :func:`gradient_match_result`.

    direction: the matched vector d (already divided by ``1 + c^2`` when ``rescale``);
    weights: the dual simplex weights w; mean: g0;
    dual_value: F(w) (upper bound on the primal optimum, before rescale);
    min_inner: min_i <g_i, d_raw> (lower bound, before rescale; g_i after any normalisation);
    gap: dual_value - min_inner >= 0, the solver's optimality certificate;
    scale: the factor applied to d_raw (1 or 1/(1 + c^2)).
    """

    direction: Tensor
    weights: Tensor
    mean: Tensor
    dual_value: float
    min_inner: float
    gap: float
    scale: float


def _stack(vectors: Tensor | Sequence[Tensor]) -> Tensor:
    if isinstance(vectors, Tensor):
        g = vectors
    else:
        if len(vectors) == 0:
            raise FCLInputError("need at least one vector to match")
        g = torch.stack([torch.as_tensor(v).reshape(-1) for v in vectors])
    if g.ndim != 2 or g.shape[0] < 1 or g.shape[1] < 1:
        raise FCLInputError(f"gradients must be a non-empty (N, P) matrix, got shape {tuple(g.shape)}")
    if not torch.isfinite(g).all():
        raise FCLInputError("gradients contain NaN or Inf")
    return g


def _normalised(g: Tensor, target_norm: Tensor | float) -> Tensor:
    norms = torch.linalg.vector_norm(g.to(torch.float64), dim=1)
    factor = torch.where(
        norms > 0, torch.as_tensor(target_norm, dtype=torch.float64) / norms.clamp_min(1e-300), torch.zeros_like(norms)
    )
    return g * factor.to(g.dtype)[:, None]


def gradient_match_result(
    grads: Tensor | Sequence[Tensor],
    c: float = 0.5,
    *,
    weights: Tensor | None = None,
    iterations: int = 1000,
    rescale: bool = True,
    normalize: bool = False,
) -> GMResult:
    """GM operator (Eq. 2, CAGrad form of Alg. 1) with its optimality certificate.

    Args:
        grads: (N, P) stacked vectors (or a list of N 1-D tensors), one per task or client.
        c: the search radius kappa >= 0 (paper default 0.5); c = 0 returns g0 exactly.
        weights: optional non-negative averaging weights for g0 (normalised to sum 1);
            default uniform (Eq. 2's mean).
        iterations: cap on dual-solver iterations; the solver stops earlier once its relative
            duality gap is below 1e-7 (typically tens of iterations; hard rank-deficient
            instances with N > P and large c need a few hundred).
        rescale: divide d by ``1 + c^2`` ([CODE-ST*]).
        normalize: first scale every vector to the mean input norm (docs/methods/lga_stamp.md B5.2 / Fig. 8).
    """
    g = _stack(grads)
    if not math.isfinite(c) or c < 0:
        raise FCLInputError(f"c must be a finite number >= 0, got {c}")
    if iterations < 0:
        raise FCLInputError(f"iterations must be >= 0, got {iterations}")
    n = g.shape[0]
    if weights is None:
        p = torch.full((n,), 1.0 / n, dtype=torch.float64)
    else:
        p = torch.as_tensor(weights, dtype=torch.float64).reshape(-1).cpu()
        if p.shape[0] != n or (p < 0).any() or not torch.isfinite(p).all() or float(p.sum()) <= 0:
            raise FCLInputError(f"weights must be {n} finite non-negative numbers with a positive sum")
        p = p / p.sum()
    if normalize:
        g = _normalised(g, torch.linalg.vector_norm(g.to(torch.float64), dim=1).mean())
    G = _gram(g).cpu()
    b = G @ p  # <g_i, g0>
    g0_sq = max(float(p @ b), 0.0)
    r = c * math.sqrt(g0_sq)  # radius of the CAGrad ball
    norms = torch.diagonal(G).clamp_min(0.0).sqrt()
    active = norms > 1e-12 * float(norms.max()) if float(norms.max()) > 0 else torch.zeros(n, dtype=torch.bool)
    w = p.clone()  # reported as-is when the dual is not solved (c = 0 or g0 = 0)
    # feasible candidates as (preference, coefficients over the inputs, <g_i, d> for every i)
    candidates: list[tuple[int, Tensor, Tensor]] = [(1, p.clone(), b.clone())]  # d = g0
    dual = math.nan
    if r > 0 and bool(active.any()):
        idx = torch.nonzero(active).reshape(-1)
        w = torch.zeros(n, dtype=torch.float64)
        w[idx] = _solve_dual(G[idx][:, idx], b[idx], r, iterations=iterations, tol=1e-7, ref=max(g0_sq, 1e-300))
        gw_sq, g_gw = _norm_and_inner(w, g)  # ||g_w||^2 and <g_i, g_w>, straight from the vectors
        dual = float(w @ b) + r * math.sqrt(gw_sq)  # F(w): an upper bound on the primal optimum
        if gw_sq > 0:
            lam = r / math.sqrt(gw_sq)  # CAGrad: d = g0 + r g_w / ||g_w||
            candidates.append((2, p + lam * w, b + lam * g_gw))
        if c >= 1.0:  # d = 0 is feasible when the ball contains 0
            candidates.append((0, torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)))
    # keep the candidate serving the worst (non-zero) input best; ties: CAGrad, then g0, then 0
    scored = [(float(v[active].min()) if bool(active.any()) else 0.0, pref, coef) for pref, coef, v in candidates]
    min_inner, _, coeffs = max(scored, key=lambda item: (item[0], item[1]))
    if math.isnan(dual):
        dual = min_inner  # c = 0 or g0 = 0: the feasible set is {g0}, its value is exact
    scale = 1.0 / (1.0 + c * c) if rescale else 1.0
    direction = _combine(coeffs * scale, g)
    mean = _combine(p, g)
    return GMResult(
        direction=direction,
        weights=w,
        mean=mean,
        dual_value=dual,
        min_inner=min_inner,
        gap=max(dual - min_inner, 0.0),
        scale=scale,
    )


def gradient_match(
    grads: Tensor | Sequence[Tensor],
    c: float = 0.5,
    *,
    weights: Tensor | None = None,
    iterations: int = 1000,
    rescale: bool = True,
    normalize: bool = False,
) -> Tensor:
    """GM operator (Eq. 2): the conflict-averse direction d (P,), see :func:`gradient_match_result`."""
    return gradient_match_result(
        grads, c, weights=weights, iterations=iterations, rescale=rescale, normalize=normalize
    ).direction


def temporal_match(
    current_grad: Tensor,
    old_task_grads: Tensor | Sequence[Tensor],
    c: float = 0.5,
    *,
    normalize: bool = True,
    rescale: bool = True,
    iterations: int = 1000,
) -> Tensor:
    """TAM, client side (Eq. 3): match the current-task vector with one gradient per old task.

    All inputs are loss gradients (ascent directions); for the current task pass the
    pseudo-gradient ``theta_received - theta_after_local_training``. Apply the result as
    ``theta <- theta_received - eta * d``. With ``normalize`` every old-task gradient is scaled
    to the current vector's norm first (docs/methods/lga_stamp.md B6.7), so the step keeps the local step's size.
    With no old task the current vector is returned unchanged.
    """
    cur = torch.as_tensor(current_grad).reshape(-1)
    if isinstance(old_task_grads, Tensor):
        olds = old_task_grads if old_task_grads.numel() else cur.new_zeros(0, cur.numel())
        olds = olds[None] if olds.ndim == 1 else olds
        if olds.ndim != 2:
            raise FCLInputError(f"old-task gradients must be (N, P), got shape {tuple(old_task_grads.shape)}")
    else:
        olds = (
            torch.stack([torch.as_tensor(v).reshape(-1) for v in old_task_grads])
            if len(old_task_grads)
            else cur.new_zeros(0, cur.numel())
        )
    if olds.shape[1] != cur.numel():
        raise FCLInputError(f"old-task gradients have {olds.shape[1]} entries, current has {cur.numel()}")
    if olds.shape[0] == 0:
        return cur.clone()
    g = torch.cat([olds.to(cur.dtype), cur[None]], dim=0)
    if normalize:
        g = _normalised(g, torch.linalg.vector_norm(cur.to(torch.float64)))
    return gradient_match(g, c, iterations=iterations, rescale=rescale)


def spatial_match(
    client_updates: Tensor | Sequence[Tensor],
    c: float = 0.5,
    *,
    weights: Tensor | None = None,
    normalize: bool = False,
    rescale: bool = True,
    iterations: int = 1000,
) -> Tensor:
    """SAM, server side (Eq. 5): conflict-averse aggregate of client deltas ``theta_u - theta``.

    Returns the update to ADD to the global model (``theta <- theta + eta * d``, eta = 1 by
    default, docs/methods/lga_stamp.md B6.4). c = 0 gives (weighted) FedAvg exactly.
    """
    return gradient_match(
        client_updates, c, weights=weights, iterations=iterations, rescale=rescale, normalize=normalize
    )


# --------------------------------------------------------------------------------------------
# prototypical coreset (Eqs. 6-7) and ProtoNet (Eq. 8)
# --------------------------------------------------------------------------------------------
def running_class_mean(features: Tensor, prior_mean: Tensor | None = None, prior_count: int = 0) -> tuple[Tensor, int]:
    """Eq. 6's p^l: count-weighted mean of the stored prototype mean (over ``prior_count`` past
    samples) and the current task's features of the class. Returns (mean float64, count)."""
    if features.ndim != 2:
        raise FCLInputError(f"features must be (n, d), got {tuple(features.shape)}")
    if prior_count < 0:
        raise FCLInputError(f"prior_count must be >= 0, got {prior_count}")
    x = features.detach().to(torch.float64)
    total = x.sum(dim=0)
    count = x.shape[0] + int(prior_count)
    if prior_count > 0:
        if prior_mean is None:
            raise FCLInputError("prior_count > 0 needs prior_mean")
        pm = torch.as_tensor(prior_mean, dtype=torch.float64).reshape(-1).to(x.device)
        if pm.shape[0] != x.shape[1]:
            raise FCLInputError(f"prior_mean has {pm.shape[0]} dims, features have {x.shape[1]}")
        total = total + prior_count * pm
    if count == 0:
        raise FCLInputError("no samples and no prior: the class mean is undefined")
    return total / count, count


def select_coreset(
    features: Tensor,
    labels: Tensor,
    budget_per_class: int,
    *,
    prior_means: Mapping[int, Tensor] | None = None,
    prior_counts: Mapping[int, int] | None = None,
) -> Tensor:
    """Prototypical coreset (Eq. 6): per class, at most K = ``budget_per_class`` row indices
    whose mean tracks p^l (greedy herding; see the module's Departures).

    Args:
        features: (n, d) encoder embeddings g(x; phi) of the current task's samples.
        labels: (n,) their classes.
        budget_per_class: K >= 0.
        prior_means / prior_counts: for classes seen in earlier tasks, the stored prototype
            mean and how many samples it summarises (the ``g(x~^l)`` and ``sum_j |N_l^j|`` terms).

    Returns:
        int64 indices into ``features``, grouped by class (ascending) in herding order.
    """
    if features.ndim != 2 or labels.reshape(-1).shape[0] != features.shape[0]:
        raise FCLInputError("features must be (n, d) with one label per row")
    if budget_per_class < 0:
        raise FCLInputError(f"budget_per_class must be >= 0, got {budget_per_class}")
    labels = labels.reshape(-1)
    prior_means = prior_means or {}
    prior_counts = prior_counts or {}
    picked: list[Tensor] = []
    for cls in torch.unique(labels).tolist():
        rows = torch.nonzero(labels == cls).reshape(-1)
        target, _ = running_class_mean(features[rows], prior_means.get(int(cls)), int(prior_counts.get(int(cls), 0)))
        sel = herding_towards(features[rows], target, budget_per_class)
        picked.append(rows[sel.to(rows.device)])
    return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.int64)


def protonet_loss(embeddings: Tensor, labels: Tensor, *, n_query: int | None = None) -> Tensor:
    """Eq. 8 (standard ProtoNet): CE of ``softmax(-||e_q - p_l||^2)`` over in-batch prototypes.

    Per class with at least 2 samples in the batch, the last ``n_query`` samples (default half,
    at least 1, leaving at least 1 support) are queries and the rest form the prototype p_l.
    Returns a 0-D tensor (0 with a graph when no class qualifies).
    """
    if embeddings.ndim != 2 or labels.reshape(-1).shape[0] != embeddings.shape[0]:
        raise FCLInputError("embeddings must be (B, d) with one label per row")
    if n_query is not None and n_query < 1:
        raise FCLInputError(f"n_query must be >= 1, got {n_query}")
    labels = labels.reshape(-1)
    protos, queries, q_labels = [], [], []
    for cls in torch.unique(labels).tolist():
        rows = torch.nonzero(labels == cls).reshape(-1)
        if rows.numel() < 2:
            continue
        q = min(n_query if n_query is not None else rows.numel() // 2, rows.numel() - 1)
        q = max(q, 1)
        protos.append(embeddings[rows[:-q]].mean(dim=0))
        queries.append(embeddings[rows[-q:]])
        q_labels.append(torch.full((q,), len(protos) - 1, dtype=torch.int64, device=embeddings.device))
    if not protos:
        return embeddings.sum() * 0.0
    P = torch.stack(protos)
    Q = torch.cat(queries)
    d2 = ((Q[:, None, :] - P[None, :, :]) ** 2).sum(dim=2)
    return F.cross_entropy(-d2, torch.cat(q_labels))


def mixstyle(x_proto: Tensor, x_new: Tensor, lam: float, eps: float = 1e-6) -> Tensor:
    """Eq. 7: re-style ``x_proto`` with per-instance, per-channel statistics mixed with ``x_new``'s.

    ``gamma = lam sigma(x~) + (1-lam) sigma(x)``, ``beta = lam mu(x~) + (1-lam) mu(x)``,
    ``out = gamma (x~ - mu(x~)) / sigma(x~) + beta``; inputs are (B, C, H, W) of equal shape.
    """
    if x_proto.shape != x_new.shape or x_proto.ndim != 4:
        raise FCLInputError(
            f"need two (B, C, H, W) tensors of equal shape, got {tuple(x_proto.shape)}, {tuple(x_new.shape)}"
        )
    if not 0.0 <= lam <= 1.0:
        raise FCLInputError(f"lam must lie in [0, 1], got {lam}")
    mu_p = x_proto.mean(dim=(2, 3), keepdim=True)
    sd_p = (x_proto.var(dim=(2, 3), keepdim=True, correction=0) + eps).sqrt()
    mu_n = x_new.mean(dim=(2, 3), keepdim=True)
    sd_n = (x_new.var(dim=(2, 3), keepdim=True, correction=0) + eps).sqrt()
    gamma = lam * sd_p + (1 - lam) * sd_n
    beta = lam * mu_p + (1 - lam) * mu_n
    return gamma * (x_proto - mu_p) / sd_p + beta
