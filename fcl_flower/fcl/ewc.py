"""Elastic Weight Consolidation (Kirkpatrick et al., 2017) for federated class-incremental runs.

EWC keeps the parameters that mattered for earlier tasks close to where those tasks left them:

    penalty(θ) = λ/2 · Σ_i F_i (θ_i − θ*_i)²

with θ* the global model at the end of the previous task (the *anchor*) and F the diagonal of
the Fisher information, estimated on the previous tasks' training data.

Choices (and why)
-----------------
* **Fisher from per-batch gradients.** ``F = Σ_b n_b g_b² / Σ_b n_b`` where ``g_b`` is the
  gradient of the *mean* loss of batch ``b``. This is the estimator the TARGET/LANDER/PyCIL
  baselines use (one backward pass per batch, no per-sample gradients); with per-sample
  gradients (batch size 1) it is the usual empirical Fisher. Batches are weighted by their size
  so a short last batch does not count as much as a full one.
* **Optional clamp** ``max_value`` (the TARGET/LANDER code clamps each client's Fisher at 1e-4):
  it bounds the stiffness of any single parameter, which is what their λ = 1000 was tuned with.
* **Federated:** every client estimates F on its own data; the server takes the sample-weighted
  mean, i.e. the Fisher of the pooled data when every client's estimate is unbiased.
* **Over tasks:** a running average weighted by class counts,
  ``F_{1:t} = (C_{1:t-1}/C_{1:t}) F_{1:t-1} + (c_t/C_{1:t}) F_t`` (PyCIL / LANDER), with a single
  anchor, the latest end-of-task model ("online EWC"). One Fisher and one anchor travel, however
  many tasks have passed.

All statistics are float64. Nothing here knows about Flower.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from .errors import FCLInputError

__all__ = [
    "FisherAccumulator",
    "aggregate_fishers",
    "diagonal_fisher",
    "ewc_penalty",
    "merge_task_fishers",
    "squared_gradient_mean",
    "trainable_parameters",
]

# loss_fn(model, inputs, labels) -> scalar mean loss of the batch
BatchLoss = Callable[[nn.Module, Tensor, Tensor], Tensor]


def trainable_parameters(model: nn.Module) -> dict[str, Tensor]:
    """The parameters EWC regularises: those that train (``requires_grad``), by name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class FisherAccumulator:
    """Streaming ``Σ_b n_b g_b² / Σ_b n_b`` over batches, in float64."""

    def __init__(self, shapes: Mapping[str, Sequence[int] | torch.Size]) -> None:
        if not shapes:
            raise FCLInputError("nothing to accumulate: no parameter shapes given")
        self._sums = {k: torch.zeros(tuple(s), dtype=torch.float64) for k, s in shapes.items()}
        self.num_samples = 0

    def add(self, gradients: Mapping[str, Tensor | None], batch_size: int) -> None:
        """Add one batch: ``gradients`` of the batch's mean loss; a missing gradient counts as 0."""
        if batch_size < 0:
            raise FCLInputError(f"batch_size must be >= 0, got {batch_size}")
        unknown = set(gradients) - set(self._sums)
        if unknown:
            raise FCLInputError(f"gradient for unknown parameter(s): {sorted(unknown)[:3]}")
        for key, grad in gradients.items():
            if grad is None:
                continue
            if tuple(grad.shape) != tuple(self._sums[key].shape):
                raise FCLInputError(
                    f"gradient of {key!r} has shape {tuple(grad.shape)}, expected {tuple(self._sums[key].shape)}"
                )
            self._sums[key] += batch_size * grad.detach().to(device="cpu", dtype=torch.float64).square()
        self.num_samples += int(batch_size)

    def result(self, max_value: float | None = None) -> dict[str, Tensor]:
        """The diagonal Fisher (zeros if no sample was seen), optionally clamped at ``max_value``."""
        if max_value is not None and max_value <= 0:
            raise FCLInputError(f"max_value must be > 0 (or None for no clamp), got {max_value}")
        scale = 1.0 / self.num_samples if self.num_samples else 0.0
        fisher = {k: v * scale for k, v in self._sums.items()}
        if max_value is not None:
            fisher = {k: v.clamp(max=max_value) for k, v in fisher.items()}
        return fisher


def squared_gradient_mean(
    gradients: Sequence[Mapping[str, Tensor]], batch_sizes: Sequence[int], max_value: float | None = None
) -> dict[str, Tensor]:
    """``Σ_b n_b g_b² / Σ_b n_b`` from already computed per-batch gradients (float64)."""
    if not gradients:
        raise FCLInputError("no batch gradients given")
    if len(gradients) != len(batch_sizes):
        raise FCLInputError(f"{len(gradients)} gradients but {len(batch_sizes)} batch sizes")
    accumulator = FisherAccumulator({k: g.shape for k, g in gradients[0].items()})
    for grads, n in zip(gradients, batch_sizes):
        accumulator.add(grads, n)
    return accumulator.result(max_value)


def diagonal_fisher(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    loss_fn: BatchLoss,
    *,
    max_value: float | None = None,
) -> dict[str, Tensor]:
    """Diagonal Fisher of ``model``'s trainable parameters at their current values.

    One backward pass per batch of ``loss_fn``; the model's parameters are not changed (its
    ``.grad`` fields are cleared afterwards). The caller picks train/eval mode.
    """
    params = trainable_parameters(model)
    if not params:
        raise FCLInputError("the model has no trainable parameters")
    accumulator = FisherAccumulator({k: p.shape for k, p in params.items()})
    names, tensors = list(params), list(params.values())
    for inputs, labels in batches:
        if len(labels) == 0:
            continue
        loss = loss_fn(model, inputs, labels)
        grads = torch.autograd.grad(loss, tensors, allow_unused=True)
        accumulator.add(dict(zip(names, grads)), len(labels))
    return accumulator.result(max_value)


def _check_same_layout(reference: Mapping[str, Tensor], other: Mapping[str, Tensor], what: str) -> None:
    if list(other) != list(reference):
        missing = [k for k in reference if k not in other]
        extra = [k for k in other if k not in reference]
        raise FCLInputError(f"{what}: parameter names differ (missing {missing[:3]}, extra {extra[:3]})")
    for key, value in reference.items():
        if tuple(other[key].shape) != tuple(value.shape):
            raise FCLInputError(f"{what}: {key!r} has shape {tuple(other[key].shape)}, expected {tuple(value.shape)}")


def aggregate_fishers(fishers: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """Weighted mean of client Fishers (weights = client sample counts), in float64.

    With each client's Fisher being a per-sample average over its data, the sample-weighted mean
    is the same average over the union of the clients' data.
    """
    if not fishers:
        raise FCLInputError("no client Fisher to aggregate")
    if len(fishers) != len(weights):
        raise FCLInputError(f"{len(fishers)} Fishers but {len(weights)} weights")
    if any(w < 0 for w in weights) or float(sum(weights)) <= 0:
        raise FCLInputError("weights must be non-negative with a positive sum")
    reference = fishers[0]
    for fisher in fishers[1:]:
        _check_same_layout(reference, fisher, "client Fishers")
    total = float(sum(weights))
    return {
        key: sum(
            (f[key].to(torch.float64) * (w / total) for f, w in zip(fishers, weights)),
            torch.zeros(tuple(reference[key].shape), dtype=torch.float64),
        )
        for key in reference
    }


def merge_task_fishers(
    previous: Mapping[str, Tensor] | None, current: Mapping[str, Tensor], previous_classes: int, total_classes: int
) -> dict[str, Tensor]:
    """Running average over tasks weighted by class counts (PyCIL / LANDER).

    ``previous`` is the Fisher accumulated over the first ``previous_classes`` classes (None
    before the first task ends); ``current`` is the new task's; ``total_classes`` counts both.
    """
    if not 0 <= previous_classes < total_classes:
        raise FCLInputError(f"need 0 <= previous_classes < total_classes, got {previous_classes} and {total_classes}")
    current64 = {k: v.to(torch.float64) for k, v in current.items()}
    if previous is None:
        if previous_classes != 0:
            raise FCLInputError("previous Fisher is missing but previous_classes > 0")
        return current64
    _check_same_layout(previous, current64, "task Fishers")
    alpha = previous_classes / total_classes
    return {k: alpha * previous[k].to(torch.float64) + (1.0 - alpha) * current64[k] for k in previous}


def ewc_penalty(
    params: Mapping[str, Tensor], fisher: Mapping[str, Tensor], anchor: Mapping[str, Tensor], lam: float
) -> Tensor:
    """``λ/2 · Σ_i F_i (θ_i − θ*_i)²`` over the parameters named in ``fisher``.

    Differentiable in ``params``; ``fisher`` and ``anchor`` are constants (detached). Every name
    in ``fisher`` must be in ``params`` and ``anchor`` with the same shape.
    """
    if lam < 0:
        raise FCLInputError(f"lambda must be >= 0, got {lam}")
    if not fisher:
        raise FCLInputError("empty Fisher")
    total: Tensor | None = None
    for key, f in fisher.items():
        if key not in params or key not in anchor:
            raise FCLInputError(f"parameter {key!r} is in the Fisher but not in the model or the anchor")
        theta = params[key]
        if not (tuple(theta.shape) == tuple(f.shape) == tuple(anchor[key].shape)):
            raise FCLInputError(
                f"{key!r}: parameter {tuple(theta.shape)}, Fisher {tuple(f.shape)}, anchor {tuple(anchor[key].shape)}"
            )
        f_ = f.detach().to(device=theta.device, dtype=theta.dtype)
        a_ = anchor[key].detach().to(device=theta.device, dtype=theta.dtype)
        term = (f_ * (theta - a_).square()).sum()
        total = term if total is None else total + term
    assert total is not None
    return 0.5 * lam * total
