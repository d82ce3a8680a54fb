"""LGA proxy-server pieces (global anti-forgetting), [P-LGA] §4.2, docs/methods/lga_stamp.md A2.7.

Client side: pick one prototype image per new class (A2.7a), perturb it (Eqs. 13-14) and send
the gradient of the shared gradient-encoding LeNet Gamma on it (A2.7c).
Proxy side: infer the label from the gradient (iDLG, A2.7d), reconstruct an image by gradient
inversion (Eqs. 9-10), augment its features (Eqs. 11-12) and score every incoming global model
on them to keep the best old model (A2.7g).

Models need ``model.features(x) -> (B, d)`` and a classifier on features: ``model.head`` (as in
``fcl_flower.models.heads.IncrementalClassifier``) or an explicit ``head=`` callable.
Everything here is pure torch: no Flower, no I/O. Seeds come in through ``torch.Generator``.

Departures (from the paper, and where [CODE-LGA] is followed instead)
-------------------------------------------------------------------------------
* Gamma is the DLG-style LeNet of [CODE-LGA]: 3 x (Conv 5x5, 12 ch, Sigmoid) + Linear,
  strides (2, 2, 1), weights and biases ~ U(-0.5, 0.5). The paper says only "4-layer LeNet".
  Clients and proxy build the same Gamma from the same seed (Gamma itself is never sent).
* Eq. 13 noise: implemented as the paper says (eps = 0.1, sigma^2 = the class's per-dimension
  feature variance), drawn afresh at every step; [CODE-LGA] adds no noise and uses BCE. The
  softmax CE is used (``num_seen`` masks unseen classes). Default step size 0.2 and 50 steps
  follow [CODE-LGA] (the paper's mu = 1.0 gives no step count).
* Eq. 10: L-BFGS with lr 0.1 ([CODE-LGA]; the paper's 1.0 diverges easily), ``iterations`` outer
  steps of up to ``max_inner`` evaluations each; the number of iterations is an argument so CI
  can cap it. A non-finite loss stops the run and keeps the best iterate. ``keep_last`` keeps the
  last iterates as extra images ([CODE-LGA] keeps 20). ``optimizer="adam"`` is a cheaper option.
* iDLG label: ``argmin`` of the row sums of the last layer's weight gradient ([CODE-LGA]); it is
  exact for one image with a positive penultimate activation (Gamma's sigmoid guarantees that).
* Eq. 11: noise ``omega * N(0, sigma^2)`` with the Eq. 11 norm constraint enforced by rejection
  sampling as in [CODE-LGA]; after ``max_tries`` rejections the last draw is scaled onto the
  constraint boundary so the loop always ends. sigma^2 is the per-class feature variance of the
  reconstructed images under the scored model (the proxy has nothing else, docs/methods/lga_stamp.md A6.9);
  [CODE-LGA] uses the squared variance as the std (a quirk we do not copy).
* Eq. 12 is implemented as printed (recursive omega); [CODE-LGA] fixes the radius once.
* Best-model selection scores every candidate (no 6-round warm-up as in [CODE-LGA]); ties go to
  the later candidate, matching [CODE-LGA]'s ``cur >= best``. Candidates are scored with the
  same noise seed so that the comparison is fair.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import FCLInputError

__all__ = [
    "BestOldModelTracker",
    "GradientEncoder",
    "InversionResult",
    "augment_features",
    "class_feature_variance",
    "encoder_gradients",
    "gradient_encoder",
    "gradient_matching_loss",
    "infer_label",
    "invert_gradients",
    "perturb_prototype",
    "perturbed_prototype_gradient",
    "prototype_indices",
    "score_old_model",
    "select_best_old_model",
    "update_omega",
]

Head = Callable[[Tensor], Tensor]
T = TypeVar("T")


def _resolve_head(model: nn.Module, head: Head | None) -> Head:
    if head is not None:
        return head
    h = getattr(model, "head", None)
    if h is None or not callable(h):
        raise FCLInputError("model has no callable .head; pass head= (a classifier on features)")
    return h


def _as_labels(labels: Tensor | int, n: int) -> Tensor:
    y = torch.as_tensor(labels, dtype=torch.int64).reshape(-1)
    if y.shape[0] == 1 and n > 1:
        y = y.expand(n).clone()
    if y.shape[0] != n:
        raise FCLInputError(f"{y.shape[0]} labels for {n} images")
    return y


# --------------------------------------------------------------------------------------------
# gradient-encoding network Gamma and iDLG
# --------------------------------------------------------------------------------------------
class GradientEncoder(nn.Module):
    """The proxy's gradient-encoding network Gamma = {W_1..W_K}, K = 4 (DLG LeNet, A2.9).

    Sigmoid activations keep it twice differentiable (needed by the inversion of Eq. 10) and
    make the penultimate activation positive (needed by iDLG label inference).
    """

    def __init__(
        self,
        in_channels: int = 3,
        image_size: int = 32,
        num_classes: int = 100,
        *,
        channels: int = 12,
        kernel_size: int = 5,
        strides: Sequence[int] = (2, 2, 1),
        init_range: float = 0.5,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if min(in_channels, image_size, num_classes, channels, kernel_size) < 1 or len(strides) != 3:
            raise FCLInputError("GradientEncoder needs positive sizes and exactly three strides")
        layers: list[nn.Module] = []
        c, size = in_channels, image_size
        for s in strides:
            layers += [nn.Conv2d(c, channels, kernel_size, stride=s, padding=kernel_size // 2), nn.Sigmoid()]
            c = channels
            size = (size + 2 * (kernel_size // 2) - kernel_size) // s + 1
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(channels * size * size, num_classes)
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.rand(p.shape, generator=gen) * (2 * init_range) - init_range)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.body(x).flatten(1))


def features_of(model: nn.Module, x: Tensor) -> Tensor:
    """``model.features(x)`` of a backbone + head classifier (fcl_flower.models.IncrementalClassifier)."""
    return cast(Callable[[Tensor], Tensor], model.features)(x)


def gradient_encoder(image_shape: Sequence[int], num_classes: int, seed: int) -> GradientEncoder:
    """Γ, built identically on clients and the proxy from the run seed (it never travels)."""
    c, h, w = (int(s) for s in image_shape)
    if h != w:
        raise FCLInputError(f"the LGA gradient encoder needs square images, got {h}x{w}")
    return GradientEncoder(in_channels=c, image_size=h, num_classes=num_classes, seed=seed)


def encoder_gradients(encoder: nn.Module, x: Tensor, labels: Tensor | int) -> list[Tensor]:
    """``grad_W CE(Gamma(x), y)`` for every parameter of Gamma, detached (A2.7c)."""
    if x.ndim != 4:
        raise FCLInputError(f"images must be (n, C, H, W), got {tuple(x.shape)}")
    y = _as_labels(labels, x.shape[0]).to(x.device)
    params = [p for p in encoder.parameters() if p.requires_grad]
    loss = F.cross_entropy(encoder(x.detach()), y)
    return [g.detach().clone() for g in torch.autograd.grad(loss, params)]


def infer_label(gradients: Sequence[Tensor], weight_index: int = -2) -> int:
    """iDLG (A2.7d): the true class is the row of the last-layer weight gradient with the
    smallest sum. For one image, ``dCE/dW[j] = (p_j - y_j) h`` with ``h > 0``, so only the true
    class's row is negative."""
    if not gradients:
        raise FCLInputError("need the encoder's gradient list")
    g = gradients[weight_index]
    if g.ndim != 2:
        raise FCLInputError(f"gradient at index {weight_index} must be the last layer's (C, h) weight")
    return int(torch.argmin(g.sum(dim=1)))


# --------------------------------------------------------------------------------------------
# client side: prototype choice and perturbation (A2.7a-b)
# --------------------------------------------------------------------------------------------
def prototype_indices(features: Tensor, labels: Tensor, *, normalize: bool = True) -> dict[int, int]:
    """Per class, the row whose feature is closest to the class-mean feature (A2.7a)."""
    if features.ndim != 2 or labels.reshape(-1).shape[0] != features.shape[0]:
        raise FCLInputError("features must be (n, d) with one label per row")
    x = features.detach().to(torch.float64)
    if normalize:
        x = x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(1e-12)
    labels = labels.reshape(-1)
    out: dict[int, int] = {}
    for c in torch.unique(labels).tolist():
        rows = torch.nonzero(labels == c).reshape(-1)
        xc = x[rows]
        out[int(c)] = int(rows[torch.argmin(torch.linalg.vector_norm(xc - xc.mean(0), dim=1))])
    return out


def class_feature_variance(features: Tensor, labels: Tensor) -> dict[int, Tensor]:
    """Per class, the per-dimension (unbiased) feature variance sigma^2 in float64.

    A class with a single sample gets zeros (no spread can be estimated)."""
    if features.ndim != 2 or labels.reshape(-1).shape[0] != features.shape[0]:
        raise FCLInputError("features must be (n, d) with one label per row")
    x = features.detach().to(torch.float64)
    labels = labels.reshape(-1)
    out: dict[int, Tensor] = {}
    for c in torch.unique(labels).tolist():
        xc = x[labels == c]
        out[int(c)] = xc.var(dim=0, correction=1) if xc.shape[0] > 1 else torch.zeros(x.shape[1], dtype=torch.float64)
    return out


def perturb_prototype(
    model: nn.Module,
    image: Tensor,
    label: int,
    *,
    feature_var: Tensor | None = None,
    eps: float = 0.1,
    steps: int = 50,
    lr: float = 0.2,
    weight_decay: float = 0.0,
    num_seen: int | None = None,
    head: Head | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Eqs. 13-14: SGD on the prototype image against CE of its noisy feature.

    ``L_PC = CE(head(F(x) + eps * N(0, sigma^2)), y)`` and ``x <- x - lr * grad_x L_PC``, with
    sigma^2 = ``feature_var`` (the class's per-dimension feature variance; None = no noise).
    The model is run in eval mode and its parameters are not changed.

    Returns the perturbed image with the input's shape.
    """
    if steps < 0 or lr < 0 or eps < 0:
        raise FCLInputError("steps, lr and eps must be non-negative")
    single = image.ndim == 3
    x = (image.unsqueeze(0) if single else image).detach().clone()
    if x.ndim != 4 or x.shape[0] != 1:
        raise FCLInputError(f"expected one image (C, H, W) or (1, C, H, W), got {tuple(image.shape)}")
    h = _resolve_head(model, head)
    y = torch.tensor([int(label)], dtype=torch.int64, device=x.device)
    std = None
    if feature_var is not None and eps > 0:
        var = torch.as_tensor(feature_var, dtype=torch.float64).reshape(-1)
        if (var < 0).any() or not torch.isfinite(var).all():
            raise FCLInputError("feature_var must be finite and non-negative")
        std = (eps * var.sqrt()).to(x.dtype)
    was_training = model.training
    model.eval()
    try:
        for _ in range(steps):
            x.requires_grad_(True)
            f = features_of(model, x)
            if std is not None:
                if std.shape[0] != f.shape[1]:
                    raise FCLInputError(f"feature_var has {std.shape[0]} dims, features have {f.shape[1]}")
                noise = torch.randn(f.shape, generator=generator, dtype=f.dtype).to(f.device)
                f = f + std.to(f.device) * noise
            z = h(f)
            if num_seen is not None:
                z = z[:, :num_seen]
            (gx,) = torch.autograd.grad(F.cross_entropy(z, y), x)
            with torch.no_grad():
                x = x - lr * (gx + weight_decay * x)
    finally:
        model.train(was_training)
    x = x.detach()
    return x[0] if single else x


def perturbed_prototype_gradient(
    model: nn.Module,
    encoder: nn.Module,
    image: Tensor,
    label: int,
    *,
    feature_var: Tensor | None = None,
    eps: float = 0.1,
    steps: int = 50,
    lr: float = 0.2,
    num_seen: int | None = None,
    head: Head | None = None,
    generator: torch.Generator | None = None,
) -> list[Tensor]:
    """Client payload for the proxy (A2.7b-c): Gamma's gradient on the perturbed prototype."""
    x = perturb_prototype(
        model,
        image,
        label,
        feature_var=feature_var,
        eps=eps,
        steps=steps,
        lr=lr,
        num_seen=num_seen,
        head=head,
        generator=generator,
    )
    if x.ndim == 3:
        x = x.unsqueeze(0)
    return encoder_gradients(encoder, x, int(label))


# --------------------------------------------------------------------------------------------
# proxy side: gradient inversion (Eqs. 9-10)
# --------------------------------------------------------------------------------------------
def gradient_matching_loss(encoder: nn.Module, x: Tensor, labels: Tensor, target_gradients: Sequence[Tensor]) -> Tensor:
    """Eq. 9: ``L_IR = sum_i || grad_{W_i} CE(Gamma(x), y) - target_i ||^2`` (differentiable in x)."""
    params = [p for p in encoder.parameters() if p.requires_grad]
    if len(params) != len(target_gradients):
        raise FCLInputError(f"{len(target_gradients)} target gradients for {len(params)} encoder parameters")
    loss = F.cross_entropy(encoder(x), labels)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    total = x.new_zeros(())
    for g, t in zip(grads, target_gradients):
        if g.shape != t.shape:
            raise FCLInputError(f"target gradient shape {tuple(t.shape)} does not match parameter {tuple(g.shape)}")
        total = total + ((g - t.to(g.device, g.dtype)) ** 2).sum()
    return total


@dataclass(frozen=True)
class InversionResult:
    """Output of :func:`invert_gradients`.

    images: (k * n, C, H, W), the last k = ``keep_last`` iterates (or the best one after a
    divergence) of the n-image dummy batch; labels: their labels; losses: L_IR after every
    outer step; initial_loss: L_IR at the random start.
    """

    images: Tensor
    labels: Tensor
    losses: list[float]
    initial_loss: float

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else self.initial_loss


def invert_gradients(
    encoder: nn.Module,
    target_gradients: Sequence[Tensor],
    labels: Tensor | int | None,
    shape: Sequence[int],
    *,
    iterations: int = 250,
    lr: float = 0.1,
    optimizer: Literal["lbfgs", "adam"] = "lbfgs",
    max_inner: int = 20,
    keep_last: int = 1,
    generator: torch.Generator | None = None,
) -> InversionResult:
    """Eq. 10: reconstruct images whose Gamma-gradient matches ``target_gradients``.

    Args:
        encoder: Gamma (its parameters are not changed).
        target_gradients: the received gradient list (one per Gamma parameter).
        labels: class of each image; None infers it with :func:`infer_label` (one image only).
        shape: (n, C, H, W) of the dummy batch (n = 1 for a prototype gradient), or (C, H, W).
        iterations: outer optimiser steps (the cost cap; [CODE-LGA] uses 250).
        lr: step size (L-BFGS 0.1 as [CODE-LGA]).
        optimizer: "lbfgs" (paper/code) or "adam".
        max_inner: L-BFGS function evaluations per outer step.
        keep_last: how many final iterates to return ([CODE-LGA]: 20).
        generator: seeds the N(0, 1) start image.
    """
    if iterations < 0 or keep_last < 1 or max_inner < 1 or lr <= 0:
        raise FCLInputError("need iterations >= 0, keep_last >= 1, max_inner >= 1 and lr > 0")
    shp = tuple(int(s) for s in shape)
    if len(shp) == 3:
        shp = (1, *shp)
    if len(shp) != 4 or min(shp) < 1:
        raise FCLInputError(f"shape must be (n, C, H, W) or (C, H, W), got {tuple(shape)}")
    device = next(encoder.parameters()).device
    if labels is None:
        if shp[0] != 1:
            raise FCLInputError("label inference (labels=None) needs a single-image shape")
        labels = infer_label(target_gradients)
    y = _as_labels(labels, shp[0]).to(device)
    targets = [t.detach().to(device) for t in target_gradients]
    x = torch.randn(shp, generator=generator).to(device).requires_grad_(True)

    def loss_at(z: Tensor) -> Tensor:
        return gradient_matching_loss(encoder, z, y, targets)

    with torch.enable_grad():
        initial = float(loss_at(x).detach())
        if optimizer == "lbfgs":
            opt: torch.optim.Optimizer = torch.optim.LBFGS([x], lr=lr, max_iter=max_inner)
        elif optimizer == "adam":
            opt = torch.optim.Adam([x], lr=lr)
        else:
            raise FCLInputError(f"optimizer must be 'lbfgs' or 'adam', got {optimizer!r}")

        def closure() -> Tensor:
            opt.zero_grad()
            loss = loss_at(x)
            (x.grad,) = torch.autograd.grad(loss, x)
            return loss.detach()

        losses: list[float] = []
        kept: list[Tensor] = []
        best_loss, best_x = initial, x.detach().clone()
        for it in range(iterations):
            opt.step(closure)  # type: ignore[arg-type]  # L-BFGS's closure returns the loss tensor, as torch documents
            cur = float(loss_at(x).detach())
            if not math.isfinite(cur):
                break
            losses.append(cur)
            if cur <= best_loss:
                best_loss, best_x = cur, x.detach().clone()
            if it >= iterations - keep_last:
                kept.append(x.detach().clone())
    if len(kept) == 0 or len(losses) < iterations:  # no steps, or diverged: return the best iterate
        kept = [best_x]
    images = torch.cat(kept, dim=0)
    return InversionResult(images=images, labels=y.repeat(len(kept)), losses=losses, initial_loss=initial)


# --------------------------------------------------------------------------------------------
# proxy side: feature augmentation (Eqs. 11-12) and best-old-model selection (A2.7g)
# --------------------------------------------------------------------------------------------
def update_omega(omega_prev: float, num_old: int, new_class_traces: Sequence[float], dim: int) -> float:
    """Eq. 12: ``omega^t = (C^o omega^{t-1} + sum_c Tr(Delta_c)/d) / (C^o + C^t)``."""
    if num_old < 0 or dim < 1 or not new_class_traces:
        raise FCLInputError("need num_old >= 0, dim >= 1 and at least one new-class trace")
    if any(t < 0 or not math.isfinite(t) for t in new_class_traces) or omega_prev < 0:
        raise FCLInputError("traces and omega must be finite and non-negative")
    total = num_old * float(omega_prev) + sum(float(t) / dim for t in new_class_traces)
    return total / (num_old + len(new_class_traces))


def augment_features(
    features: Tensor,
    labels: Tensor,
    class_var: Mapping[int, Tensor],
    omega: float,
    *,
    xi: float = 0.1,
    num_aug: int = 5,
    generator: torch.Generator | None = None,
    max_tries: int = 100,
) -> tuple[Tensor, Tensor]:
    """Eq. 11: ``num_aug`` noisy copies ``f + omega * N(0, sigma^2)`` of every feature.

    The noise obeys ``||noise||^2 <= xi * sum_i sigma_i^2`` (rejection sampling, then a rescale
    onto the boundary after ``max_tries``). Returns (n * num_aug, d) float64 features and their
    labels, copies of row i at rows ``i * num_aug .. i * num_aug + num_aug - 1``.
    """
    if features.ndim != 2 or labels.reshape(-1).shape[0] != features.shape[0]:
        raise FCLInputError("features must be (n, d) with one label per row")
    if omega < 0 or xi < 0 or num_aug < 1 or max_tries < 1:
        raise FCLInputError("need omega >= 0, xi >= 0, num_aug >= 1 and max_tries >= 1")
    f = features.detach().to(torch.float64).cpu()
    labels = labels.reshape(-1).to(torch.int64).cpu()
    d = f.shape[1]
    try:
        var = (
            torch.stack([torch.as_tensor(class_var[int(c)], dtype=torch.float64).reshape(-1) for c in labels.tolist()])
            if labels.numel()
            else torch.zeros(0, d, dtype=torch.float64)
        )
    except KeyError as exc:
        raise FCLInputError(f"class_var lacks class {exc}") from None
    if var.shape[1] != d or (var < 0).any():
        raise FCLInputError("class variances must be non-negative with the feature dimension")
    var = var.repeat_interleave(num_aug, dim=0)
    base = f.repeat_interleave(num_aug, dim=0)
    std = omega * var.sqrt()
    bound = xi * var.sum(dim=1)
    noise = torch.zeros_like(base)
    pending = torch.ones(base.shape[0], dtype=torch.bool)
    last = torch.zeros_like(base)
    for _ in range(max_tries):
        idx = torch.nonzero(pending).reshape(-1)
        if idx.numel() == 0:
            break
        draw = std[idx] * torch.randn((idx.numel(), d), generator=generator, dtype=torch.float64)
        ok = (draw**2).sum(dim=1) <= bound[idx]
        noise[idx[ok]] = draw[ok]
        last[idx] = draw
        pending[idx[ok]] = False
    idx = torch.nonzero(pending).reshape(-1)
    if idx.numel():
        norm = torch.linalg.vector_norm(last[idx], dim=1).clamp_min(1e-300)
        noise[idx] = last[idx] * (bound[idx].sqrt() / norm)[:, None]
    return base + noise, labels.repeat_interleave(num_aug)


@torch.no_grad()
def score_old_model(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    *,
    omega: float,
    xi: float = 0.1,
    num_aug: int = 5,
    seed: int = 0,
    num_seen: int | None = None,
    head: Head | None = None,
    batch_size: int = 256,
) -> float:
    """Accuracy of ``model``'s classifier on the Eq. 11 augmented features of the
    reconstructed images (A2.7g). Features come from ``model.features`` (the scored model's own
    extractor, as Eq. 11 says); sigma^2 is their per-class variance."""
    if images.ndim != 4 or labels.reshape(-1).shape[0] != images.shape[0] or images.shape[0] == 0:
        raise FCLInputError("images must be a non-empty (n, C, H, W) batch with one label each")
    h = _resolve_head(model, head)
    was_training = model.training
    model.eval()
    try:
        feats = torch.cat(
            [features_of(model, images[i : i + batch_size]) for i in range(0, images.shape[0], batch_size)]
        )
        labels = labels.reshape(-1).to(torch.int64).cpu()
        var = class_feature_variance(feats, labels)
        gen = torch.Generator().manual_seed(int(seed))
        aug, aug_labels = augment_features(feats, labels, var, omega, xi=xi, num_aug=num_aug, generator=gen)
        z = h(aug.to(device=feats.device, dtype=feats.dtype))
        if num_seen is not None:
            z = z[:, :num_seen]
        pred = z.argmax(dim=1).cpu()
    finally:
        model.train(was_training)
    return float((pred == aug_labels).to(torch.float64).mean())


def select_best_old_model(
    candidates: Sequence[nn.Module],
    images: Tensor,
    labels: Tensor,
    *,
    omega: float,
    xi: float = 0.1,
    num_aug: int = 5,
    seed: int = 0,
    num_seen: int | None = None,
    head: Callable[[nn.Module], Head] | None = None,
) -> tuple[int, list[float]]:
    """A2.7g: index of the candidate global model with the best augmented-feature accuracy
    (ties go to the later candidate, [CODE-LGA]'s ``>=``), and every candidate's score.

    ``head``, if given, maps a candidate to its classifier on features.
    """
    if not candidates:
        raise FCLInputError("need at least one candidate model")
    scores = [
        score_old_model(
            m,
            images,
            labels,
            omega=omega,
            xi=xi,
            num_aug=num_aug,
            seed=seed,
            num_seen=num_seen,
            head=None if head is None else head(m),
        )
        for m in candidates
    ]
    best = 0
    for i, s in enumerate(scores):
        if s >= scores[best]:
            best = i
    return best, scores


class BestOldModelTracker(Generic[T]):
    """Streaming version of A2.7g kept by the proxy across rounds.

    ``offer`` the score of every incoming global model; the best of the current task is Θ^t
    (``current``), the best of the previous task Θ^{t-1} (``previous``). ``start_new_task`` is
    called when a new gradient pool arrives. Payloads are opaque (e.g. lists of arrays).
    """

    def __init__(self) -> None:
        self.previous: T | None = None
        self.current: T | None = None
        self.best_score: float = -math.inf

    def offer(self, score: float, model: T) -> bool:
        """Keep ``model`` as Θ^t if ``score >= best_score``; True when it was kept."""
        if math.isnan(score):
            raise FCLInputError("score must not be NaN")
        if score >= self.best_score:
            self.best_score, self.current = float(score), model
            return True
        return False

    def start_new_task(self) -> None:
        """Θ^{t-1} <- Θ^t; the next offer of the new task is always kept."""
        self.previous = self.current
        self.best_score = -math.inf

    def old_model_for(self, detected_new_task: bool) -> T | None:
        """The old model a client distils from: Θ^t if it detects new classes now, else Θ^{t-1}
        (A2.7g, A6.11); falls back to whichever exists."""
        first, second = (self.current, self.previous) if detected_new_task else (self.previous, self.current)
        return first if first is not None else second
