"""LGA local anti-forgetting: L_CB, L_SD, L_local and task-transition detection.

Dong et al., "No One Left Behind: Real-World Federated Class-Incremental Learning", TPAMI 2024
([P-LGA] §4.1), with the official code ``github.com/JiahuaDong/LGA`` ([CODE-LGA]) where the
paper is ambiguous. Method notes: ``docs/methods/lga_stamp.md`` Part A. Equation numbers are the
paper's. The proxy-server pieces (§4.2, Eqs. 9-14) live in :mod:`fcl_flower.fcl.lga_proxy`.

Conventions
-----------
* ``logits`` are over the classes seen so far only, shape (B, C_seen): the trainer slices
  ``logits[:, :num_seen]`` before calling these functions.
* Classes are numbered task by task, so task kappa owns the contiguous range
  ``[task_ends[kappa-1], task_ends[kappa])`` (with ``task_ends[-1] == C_seen``). The last
  range is the current task; the others are the old tasks.
* Per-sample weights are statistics of the batch, computed in float64 and detached (they are
  constants for the backward pass, as in [CODE-LGA] which uses ``pred.detach()``).

Equations implemented
---------------------
(2)  V_i = dCE/dz_{y_i} = p_i[y_i] - 1, so |V_i| = 1 - p_i[y_i]  (analytic, no autograd pass)
(3)  V_kappa = mean of |V_i| over batch samples whose label was learned in task kappa
(4)  V_kappa^s = mean of |V_i|^a over the same samples, a = C^o / (C^o + C^t)
(5)  L_CB = (1/B) sum_i w_i CE_i,  w_i = |V_i|^a / V^s_{kappa(i)}
(6)  L_SD = (1/B) sum_i w_i sum_kappa D(Yhat_i[S_kappa], P_i[S_kappa])   (safe form, see below)
(7)  L_local = gamma1 L_CB + gamma2 L_SD;  (1, 0) in task 1, (1, 1) afterwards  [docs/methods/lga_stamp.md A2.9]
(8)  H = mean_i entropy(P_i);  new task  <=>  H^r - H^{r-1} >= r_e = 1.2

Departures (from the paper, and where [CODE-LGA] is followed instead)
-------------------------------------------------------------------------------
* Eq. 5 weights are clamped to [0.5, 5] by default, as in [CODE-LGA]
  (``efficient_old_class_weight``); the paper has no clamp. ``clamp=None`` disables it.
* Eq. 5 groups with no sample in the batch are skipped (they would divide 0 by 0); a group
  whose sharpened mean is 0 gets weight 0 before the clamp (all its CE terms are 0 anyway).
* Eq. 6 as printed is ill-posed (KL(P || Yhat) with zero entries in the one-hot part of Yhat,
  unnormalised slices, garbled weight). We use the SAFE form of docs/methods/lga_stamp.md A6.4: per task slice,
  renormalise both slices and use ``KL(Yhat_slice || P_slice)``. For an old slice this is
  ``KL(softmax(z_old[S]) || softmax(z[S]))``; for the current slice Yhat is one-hot when the
  sample is a new-class sample (giving the within-slice CE) and all-zero for an exemplar of an
  old class (that term is skipped). ``include_current_slice=False`` drops the current slice.
  The weight w_i is the Eq. 5 weight.
* ``loss_form="sigmoid"`` reproduces [CODE-LGA]'s iCaRL-style losses instead of the paper's
  softmax ones: |V_i| = 1 - sigmoid(z_{y_i}); L_CB = mean over (B, C) of w_i BCE(z, onehot);
  L_SD = mean over (B, C) of w_i BCE(z, onehot with its first C^o columns replaced by
  sigmoid(z_old)).
* Exponent ``a``: the paper prints per-client counts C_l^o / (C_l^o + C_l^t); [CODE-LGA] uses
  the global t/(t+1). ``exponent=None`` uses the global counts from ``task_ends``; the client
  glue should pass :func:`sharpening_exponent` of its own class counts (docs/methods/lga_stamp.md A6.2).
* Eq. 8 prints I(p) = sum p log p (a sign typo): we use the entropy -sum p log p in nats with
  an exact ``log_softmax`` (the code adds 1e-5 inside the log). The paper's ``>=`` is used
  (the code has ``>``). By default the first observation counts as a transition, matching
  [CODE-LGA]'s ``last_entropy = 0`` start for any reasonably uncertain first model.
* Task-1 weights: with a = 0, |V|^0 = 1 and every weight is 1 (in [CODE-LGA] likewise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .distill import softmax_kl_per_sample
from .errors import FCLInputError

__all__ = [
    "DEFAULT_CLAMP",
    "ENTROPY_THRESHOLD",
    "LGALoss",
    "LossForm",
    "TaskTransitionDetector",
    "cb_loss",
    "compensation_weights",
    "lga_local_loss",
    "mean_prediction_entropy",
    "prediction_entropy",
    "sd_loss",
    "sharpening_exponent",
    "target_gradient_magnitude",
    "task_groups",
]

LossForm = Literal["softmax", "sigmoid"]
DEFAULT_CLAMP: tuple[float, float] = (0.5, 5.0)
ENTROPY_THRESHOLD: float = 1.2


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------
def _task_ends(task_ends: Sequence[int]) -> list[int]:
    ends = [int(e) for e in task_ends]
    if not ends:
        raise FCLInputError("task_ends must list at least one task")
    prev = 0
    for e in ends:
        if e <= prev:
            raise FCLInputError(f"task_ends must be strictly increasing positive class counts, got {ends}")
        prev = e
    return ends


def _check_logits_labels(logits: Tensor, labels: Tensor, num_seen: int | None = None) -> None:
    if logits.ndim != 2:
        raise FCLInputError(f"logits must be (B, C), got shape {tuple(logits.shape)}")
    if labels.ndim != 1 or labels.shape[0] != logits.shape[0]:
        raise FCLInputError(f"labels must be (B,) with B={logits.shape[0]}, got shape {tuple(labels.shape)}")
    if labels.dtype in (torch.float16, torch.float32, torch.float64, torch.bfloat16):
        raise FCLInputError("labels must be an integer tensor")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= logits.shape[1]):
        raise FCLInputError(
            f"labels must lie in [0, {logits.shape[1]}), got range [{int(labels.min())}, {int(labels.max())}]"
        )
    if num_seen is not None and logits.shape[1] != num_seen:
        raise FCLInputError(
            f"logits have {logits.shape[1]} columns but task_ends says {num_seen} classes are seen; "
            "slice logits[:, :num_seen] first"
        )


def _check_form(loss_form: str) -> None:
    if loss_form not in ("softmax", "sigmoid"):
        raise FCLInputError(f"loss_form must be 'softmax' or 'sigmoid', got {loss_form!r}")


# --------------------------------------------------------------------------------------------
# Eqs. 2-5: category-balanced gradient-adaptive compensation
# --------------------------------------------------------------------------------------------
def sharpening_exponent(num_old: int, num_new: int) -> float:
    """Eq. 4 exponent ``a = C^o / (C^o + C^t)``; 0 in the first task (all weights equal)."""
    if num_old < 0 or num_new < 0 or num_old + num_new == 0:
        raise FCLInputError(f"need num_old, num_new >= 0 and not both 0, got {num_old}, {num_new}")
    return float(num_old) / float(num_old + num_new)


def task_groups(labels: Tensor, task_ends: Sequence[int]) -> Tensor:
    """Index kappa (0-based) of the task that introduced each label: the groups of Eq. 3."""
    ends = _task_ends(task_ends)
    labels = torch.as_tensor(labels)
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= ends[-1]):
        raise FCLInputError(f"labels must lie in [0, {ends[-1]})")
    boundaries = torch.tensor(ends, dtype=labels.dtype, device=labels.device)
    return torch.bucketize(labels, boundaries, right=True).to(torch.int64)


def target_gradient_magnitude(logits: Tensor, labels: Tensor, loss_form: LossForm = "softmax") -> Tensor:
    """Eq. 2: |dLoss/dz_y| at the true class, analytically, float64 and detached.

    softmax CE: ``dCE/dz_y = p_y - 1`` so the magnitude is ``1 - softmax(z)_y``.
    sigmoid BCE ([CODE-LGA]): ``dBCE/dz_y = sigmoid(z_y) - 1``, magnitude ``1 - sigmoid(z_y)``.
    """
    _check_logits_labels(logits, labels)
    _check_form(loss_form)
    z = logits.detach().to(torch.float64)
    if loss_form == "softmax":
        p_y = F.softmax(z, dim=1).gather(1, labels.view(-1, 1)).squeeze(1)
    else:
        p_y = torch.sigmoid(z.gather(1, labels.view(-1, 1)).squeeze(1))
    return (1.0 - p_y).clamp_min(0.0)


def compensation_weights(
    grad_magnitudes: Tensor, groups: Tensor, exponent: float, *, clamp: tuple[float, float] | None = DEFAULT_CLAMP
) -> Tensor:
    """Per-sample L_CB weights ``w_i = |V_i|^a / V^s_{kappa(i)}`` (Eqs. 3-5), float64, detached.

    Each task group is normalised by its own batch mean of the sharpened magnitudes (Eq. 4),
    so within a group the weights average to 1 (before the clamp): samples the model still
    gets wrong (large |V_i|) weigh more than those it has already fitted, and a group that is
    forgotten fast (all |V| large) is not allowed to dominate the other groups.

    Args:
        grad_magnitudes: (B,) non-negative |V_i| (see :func:`target_gradient_magnitude`).
        groups: (B,) integer group of each sample (old task index, or the current task); a
            bool old-class mask also works (two groups).
        exponent: a in [0, 1] (Eq. 4); :func:`sharpening_exponent`.
        clamp: (low, high) bounds applied last, [CODE-LGA]'s (0.5, 5); None for none.
    """
    v = torch.as_tensor(grad_magnitudes).detach().to(torch.float64).reshape(-1)
    g = torch.as_tensor(groups).reshape(-1).to(torch.int64)
    if g.shape != v.shape:
        raise FCLInputError(f"{v.shape[0]} magnitudes but {g.shape[0]} group ids")
    if not torch.isfinite(v).all() or (v < 0).any():
        raise FCLInputError("gradient magnitudes must be finite and non-negative")
    if not 0.0 <= exponent <= 1.0 or math.isnan(exponent):
        raise FCLInputError(f"exponent must lie in [0, 1], got {exponent}")
    if clamp is not None and not 0.0 <= clamp[0] <= clamp[1]:
        raise FCLInputError(f"clamp must be (low, high) with 0 <= low <= high, got {clamp}")
    if v.numel() == 0:
        return v
    sharp = torch.pow(v, exponent)  # torch.pow(0, 0) == 1, so a = 0 gives all ones
    _, inverse = torch.unique(g, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, sharp)
    counts = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(sharp))
    means = sums / counts  # every group present has count >= 1
    denom = means[inverse]
    w = torch.where(denom > 0, sharp / denom.clamp_min(1e-300), torch.zeros_like(sharp))
    if clamp is not None:
        w = w.clamp(clamp[0], clamp[1])
    return w


def _default_exponent(ends: list[int]) -> float:
    c_old = ends[-2] if len(ends) > 1 else 0
    return sharpening_exponent(c_old, ends[-1] - c_old)


def _weights_for(
    logits: Tensor,
    labels: Tensor,
    ends: list[int],
    exponent: float | None,
    loss_form: LossForm,
    clamp: tuple[float, float] | None,
) -> Tensor:
    a = _default_exponent(ends) if exponent is None else float(exponent)
    mags = target_gradient_magnitude(logits, labels, loss_form)
    return compensation_weights(mags, task_groups(labels, ends), a, clamp=clamp)


def cb_loss(
    logits: Tensor,
    labels: Tensor,
    task_ends: Sequence[int],
    *,
    exponent: float | None = None,
    loss_form: LossForm = "softmax",
    clamp: tuple[float, float] | None = DEFAULT_CLAMP,
    weights: Tensor | None = None,
) -> Tensor:
    """Eq. 5: ``L_CB = (1/B) sum_i w_i CE(P(x_i), y_i)`` with the Eq. 3-4 weights.

    Args:
        logits: (B, C_seen) current-model logits; ``C_seen == task_ends[-1]``.
        labels: (B,) int64 labels in [0, C_seen).
        task_ends: cumulative class counts per task, e.g. [10, 20, 30] in task 3.
        exponent: Eq. 4's a; None uses the global C^o/(C^o+C^t) from ``task_ends``.
        loss_form: "softmax" (paper) or "sigmoid" ([CODE-LGA]'s BCE, averaged over (B, C)).
        clamp: weight clamp, see :func:`compensation_weights`.
        weights: precomputed (B,) weights (e.g. shared with L_SD); overrides the above.
    """
    ends = _task_ends(task_ends)
    _check_logits_labels(logits, labels, ends[-1])
    _check_form(loss_form)
    w = _weights_for(logits, labels, ends, exponent, loss_form, clamp) if weights is None else weights
    w = torch.as_tensor(w).detach().to(logits.dtype).reshape(-1)
    if w.shape[0] != logits.shape[0]:
        raise FCLInputError(f"{w.shape[0]} weights for a batch of {logits.shape[0]}")
    if loss_form == "softmax":
        return (w * F.cross_entropy(logits, labels, reduction="none")).mean()
    target = F.one_hot(labels, logits.shape[1]).to(logits.dtype)
    return (w[:, None] * F.binary_cross_entropy_with_logits(logits, target, reduction="none")).mean()


def sd_loss(
    logits: Tensor,
    old_logits: Tensor,
    labels: Tensor,
    task_ends: Sequence[int],
    *,
    weights: Tensor | None = None,
    exponent: float | None = None,
    loss_form: LossForm = "softmax",
    clamp: tuple[float, float] | None = DEFAULT_CLAMP,
    include_current_slice: bool = True,
) -> Tensor:
    """Eq. 6 (safe form): task-sliced soft-target distillation weighted by the Eq. 5 weights.

    The soft target Yhat_i is the one-hot label with its first C^o entries replaced by the old
    model's probabilities. Per task slice S_kappa both Yhat_i[S] and P_i[S] are renormalised and
    compared with ``KL(Yhat[S] || P[S])``:

    * old slice (inside the old model's C^o classes): ``KL(softmax(z_old[S]) || softmax(z[S]))``;
    * current slice: ``-log softmax(z[S])[y_i]`` for a new-class sample; skipped for an old-class
      exemplar, whose Yhat slice is all zeros.

    ``L_SD = (1/B) sum_i w_i sum_kappa KL_kappa,i``. With ``loss_form="sigmoid"`` it is
    [CODE-LGA]'s ``mean(w * BCE(z, Yhat))`` with Yhat's old columns = sigmoid(z_old).

    Args:
        logits: (B, C_seen) current-model logits.
        old_logits: (B, C^o) old-model logits; C^o must be a task boundary in ``task_ends``.
        labels, task_ends, exponent, loss_form, clamp, weights: as in :func:`cb_loss`.
        include_current_slice: keep the current-task slice term (the printed sum runs over
            every kappa = 1..t, so it is on by default).
    """
    ends = _task_ends(task_ends)
    _check_logits_labels(logits, labels, ends[-1])
    _check_form(loss_form)
    if old_logits.ndim != 2 or old_logits.shape[0] != logits.shape[0]:
        raise FCLInputError(f"old_logits must be (B={logits.shape[0]}, C_old), got {tuple(old_logits.shape)}")
    c_old = old_logits.shape[1]
    if c_old not in ends[:-1]:
        raise FCLInputError(f"old model covers {c_old} classes, which is not an old-task boundary of {ends}")
    w = _weights_for(logits, labels, ends, exponent, loss_form, clamp) if weights is None else weights
    w = torch.as_tensor(w).detach().to(logits.dtype).reshape(-1)
    if w.shape[0] != logits.shape[0]:
        raise FCLInputError(f"{w.shape[0]} weights for a batch of {logits.shape[0]}")
    old = old_logits.detach()
    if loss_form == "sigmoid":
        target = F.one_hot(labels, logits.shape[1]).to(logits.dtype)
        target[:, :c_old] = torch.sigmoid(old.to(logits.dtype))
        return (w[:, None] * F.binary_cross_entropy_with_logits(logits, target, reduction="none")).mean()
    per_sample = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
    start = 0
    for end in ends:
        if end <= c_old:
            per_sample = per_sample + softmax_kl_per_sample(old[:, start:end].to(logits.dtype), logits[:, start:end])
        elif include_current_slice:
            inside = (labels >= start) & (labels < end)
            local = (labels - start).clamp(0, end - start - 1)
            ce = -F.log_softmax(logits[:, start:end], dim=1).gather(1, local.view(-1, 1)).squeeze(1)
            per_sample = per_sample + torch.where(inside, ce, torch.zeros_like(ce))
        start = end
    return (w * per_sample).mean()


@dataclass(frozen=True)
class LGALoss:
    """Result of :func:`lga_local_loss`: the total to backpropagate and its parts for logging."""

    total: Tensor
    cb: Tensor
    sd: Tensor
    weights: Tensor
    gamma1: float
    gamma2: float


def lga_local_loss(
    logits: Tensor,
    labels: Tensor,
    task_ends: Sequence[int],
    *,
    old_logits: Tensor | None = None,
    exponent: float | None = None,
    loss_form: LossForm = "softmax",
    clamp: tuple[float, float] | None = DEFAULT_CLAMP,
    gamma1: float | None = None,
    gamma2: float | None = None,
    include_current_slice: bool = True,
) -> LGALoss:
    """Eq. 7: ``L_local = gamma1 L_CB + gamma2 L_SD`` with one shared set of Eq. 5 weights.

    Defaults follow docs/methods/lga_stamp.md A2.9: (gamma1, gamma2) = (1, 0) in the first task
    (``len(task_ends) == 1``) and (1, 1) afterwards. With no ``old_logits`` (no old model yet)
    gamma2 defaults to 0; asking for gamma2 > 0 without an old model is an error.
    """
    ends = _task_ends(task_ends)
    _check_logits_labels(logits, labels, ends[-1])
    g1 = 1.0 if gamma1 is None else float(gamma1)
    if gamma2 is None:
        g2 = 0.0 if (len(ends) == 1 or old_logits is None) else 1.0
    else:
        g2 = float(gamma2)
    if g2 != 0.0 and old_logits is None:
        raise FCLInputError("gamma2 > 0 needs old_logits from the old model")
    if g2 != 0.0 and len(ends) == 1:
        raise FCLInputError("L_SD needs at least one old task (task_ends has a single task)")
    w = _weights_for(logits, labels, ends, exponent, loss_form, clamp)
    cb = cb_loss(logits, labels, ends, loss_form=loss_form, weights=w)
    if g2 != 0.0 and old_logits is not None:
        sd = sd_loss(
            logits,
            old_logits,
            labels,
            ends,
            weights=w,
            loss_form=loss_form,
            include_current_slice=include_current_slice,
        )
    else:
        sd = torch.zeros((), dtype=logits.dtype, device=logits.device)
    return LGALoss(total=g1 * cb + g2 * sd, cb=cb, sd=sd, weights=w, gamma1=g1, gamma2=g2)


# --------------------------------------------------------------------------------------------
# Eq. 8: entropy-based task-transition detection
# --------------------------------------------------------------------------------------------
def prediction_entropy(logits: Tensor) -> Tensor:
    """Per-sample entropy ``-sum_j p_j log p_j`` (nats) of softmax(logits), float64."""
    if logits.ndim != 2 or logits.shape[1] < 1:
        raise FCLInputError(f"logits must be (B, C) with C >= 1, got {tuple(logits.shape)}")
    logp = F.log_softmax(logits.detach().to(torch.float64), dim=1)
    return -(logp.exp() * logp).sum(dim=1)


def mean_prediction_entropy(logits: Tensor) -> float:
    """Eq. 8's H: the mean prediction entropy of the received global model on local data."""
    if logits.shape[0] == 0:
        raise FCLInputError("need at least one sample to compute a mean entropy")
    return float(prediction_entropy(logits).mean())


class TaskTransitionDetector:
    """Eq. 8: flags new classes when the mean entropy rises by at least ``threshold`` (r_e).

    Feed it one mean entropy per evaluation (:func:`mean_prediction_entropy` of the received
    global model on the client's current training data). A model that meets unseen classes
    spreads its probability over the classes it knows, so H jumps; ordinary training only
    lowers H slowly, and round-to-round noise is far below r_e = 1.2 nats.

    The state is two floats, so it round-trips through Flower's ``Context.state`` via
    :meth:`to_state` / :meth:`from_state`.
    """

    def __init__(self, threshold: float = ENTROPY_THRESHOLD, *, fire_on_first: bool = True) -> None:
        if not math.isfinite(threshold) or threshold <= 0:
            raise FCLInputError(f"threshold must be a positive finite number, got {threshold}")
        self.threshold = float(threshold)
        self.fire_on_first = bool(fire_on_first)
        self.last_entropy: float | None = None

    def update(self, entropy: float) -> bool:
        """Record this round's mean entropy; True when it signals a new task."""
        h = float(entropy)
        if not math.isfinite(h) or h < 0:
            raise FCLInputError(f"entropy must be finite and non-negative, got {entropy}")
        fired = self.fire_on_first if self.last_entropy is None else (h - self.last_entropy >= self.threshold)
        self.last_entropy = h
        return fired

    def to_state(self) -> dict[str, float]:
        return {
            "threshold": self.threshold,
            "fire_on_first": float(self.fire_on_first),
            "last_entropy": float("nan") if self.last_entropy is None else self.last_entropy,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, float]) -> TaskTransitionDetector:
        try:
            det = cls(float(state["threshold"]), fire_on_first=bool(float(state["fire_on_first"])))
            last = float(state["last_entropy"])
        except KeyError as exc:
            raise FCLInputError(f"detector state lacks key {exc}") from None
        det.last_entropy = None if math.isnan(last) else last
        return det
