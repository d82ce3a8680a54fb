"""Prototype pseudo-labelling of FedRAN-SSL (docs/methods/fedran.md §2.5, Eqs. 13–15, Algorithm 4).

Runs on a client, on frozen *backbone* features Z (not on the random features H), once per task:
ℓ2-normalised class means of the labelled features are the prototypes; an unlabelled feature
takes the class of its most cosine-similar prototype and is kept only if that cosine is ≥ τ
(τ = 0.5 in the paper). Candidates are restricted to the classes the client has labels for at
this task, so a client never invents a class it has not seen. Rejected samples are dropped.
Accepted samples join the labelled ones in both H (hence the Gram summary) and B.

Which samples are labelled is not specified by the paper; :func:`select_labelled` marks a seeded
uniformly random fraction ρ per client and task (docs/methods/fedran.md §1.3 [I]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import AnalyticInputError

__all__ = [
    "PseudoLabelError",
    "PseudoLabelOutput",
    "class_prototypes",
    "pseudo_label",
    "pseudo_label_client",
    "pseudo_label_report",
    "select_labelled",
]


class PseudoLabelError(AnalyticInputError):
    """A pseudo-labelling argument has the wrong shape, dtype or range."""


@dataclass(frozen=True)
class PseudoLabelOutput:
    """Algorithm 4's output (Z̃, ỹ) plus what is needed to log acceptance and accuracy.

    ``features``/``labels``: labelled rows first, then the accepted unlabelled rows in their
    original order. ``accepted``: bool mask over the unlabelled rows. ``predicted``: the
    pseudo-label of each unlabelled row, −1 where rejected.
    """

    features: Tensor
    labels: Tensor
    num_labelled: int
    num_accepted: int
    accepted: Tensor
    predicted: Tensor


def class_prototypes(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """ℓ2-normalised class means of labelled backbone features (Eq. 13).

    Returns ``(prototypes (C, d) float64, present (C,) bool)``. Rows of absent classes are zero
    and ``present`` is False there. A class whose mean is the zero vector keeps a zero prototype
    (cosine 0 with everything) rather than dividing by zero.
    """
    _check_features(features, "features")
    _check_num_classes(num_classes)
    if not isinstance(labels, Tensor) or labels.ndim != 1 or labels.shape[0] != features.shape[0]:
        raise PseudoLabelError("labels must be a 1-D tensor with one entry per feature row")
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise PseudoLabelError(f"labels must be an integer tensor, got {labels.dtype}")
    labels = labels.to(device=features.device, dtype=torch.int64)
    if labels.numel() and (int(labels.min().item()) < 0 or int(labels.max().item()) >= num_classes):
        raise PseudoLabelError(f"labels must lie in [0, {num_classes})")
    z = features.to(torch.float64)
    sums = z.new_zeros((num_classes, z.shape[1]))
    sums.index_add_(0, labels, z)
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    present = counts > 0
    means = sums / counts.clamp_min(1.0).unsqueeze(1)
    return _normalise_rows(means), present


def pseudo_label(
    features_unlabelled: Tensor, prototypes: Tensor, present_mask: Tensor, threshold: float = 0.5
) -> tuple[Tensor, Tensor]:
    """Cosine nearest-prototype labels, accepted when max cosine ≥ ``threshold`` (Eqs. 14–15).

    Only classes with ``present_mask`` True compete; ties go to the lowest class index. Returns
    ``(labels int64 (n,), accepted bool (n,))`` with label −1 on rejected rows, so a caller that
    forgets the mask fails loudly instead of training on a wrong class. With no present class
    every row is rejected. A zero feature row has cosine 0 with every prototype.
    """
    _check_features(features_unlabelled, "features_unlabelled")
    if not isinstance(prototypes, Tensor) or prototypes.ndim != 2:
        raise PseudoLabelError("prototypes must be a 2-D tensor (C, d)")
    if prototypes.shape[1] != features_unlabelled.shape[1]:
        raise PseudoLabelError(
            f"prototypes have dimension {prototypes.shape[1]}, features {features_unlabelled.shape[1]}"
        )
    if (
        not isinstance(present_mask, Tensor)
        or present_mask.dtype != torch.bool
        or present_mask.shape != (prototypes.shape[0],)
    ):
        raise PseudoLabelError("present_mask must be a bool tensor with one entry per prototype")
    threshold = float(threshold)
    if not math.isfinite(threshold):
        raise PseudoLabelError(f"threshold must be finite, got {threshold!r}")
    device = features_unlabelled.device
    n = features_unlabelled.shape[0]
    labels = torch.full((n,), -1, dtype=torch.int64, device=device)
    accepted = torch.zeros(n, dtype=torch.bool, device=device)
    present = present_mask.to(device)
    if n == 0 or not bool(present.any()):
        return labels, accepted
    # Re-normalise the prototypes: cheap, and callers may pass unnormalised class means.
    cosine = (
        _normalise_rows(features_unlabelled.to(torch.float64))
        @ _normalise_rows(prototypes.to(device=device, dtype=torch.float64)).T
    )
    cosine = cosine.masked_fill(~present.unsqueeze(0), float("-inf"))
    best, best_class = cosine.max(dim=1)
    accepted = best >= threshold
    labels = torch.where(accepted, best_class, labels)
    return labels, accepted


def pseudo_label_client(
    labelled_features: Tensor,
    labels: Tensor,
    unlabelled_features: Tensor | None,
    num_classes: int,
    threshold: float = 0.5,
) -> PseudoLabelOutput:
    """Algorithm 4 on one client: prototypes from the labelled rows, then (Z̃, ỹ).

    With no unlabelled rows (ρ = 1, or ``None``) the output is exactly the labelled data.
    """
    prototypes, present = class_prototypes(labelled_features, labels, num_classes)
    labels = labels.to(device=labelled_features.device, dtype=torch.int64)
    if unlabelled_features is None:
        unlabelled_features = labelled_features.new_zeros((0, labelled_features.shape[1]))
    predicted, accepted = pseudo_label(unlabelled_features, prototypes, present, threshold)
    extra = unlabelled_features[accepted.to(unlabelled_features.device)]
    return PseudoLabelOutput(
        features=torch.cat(
            [labelled_features, extra.to(device=labelled_features.device, dtype=labelled_features.dtype)], dim=0
        ),
        labels=torch.cat([labels, predicted[accepted].to(labels.device)], dim=0),
        num_labelled=int(labelled_features.shape[0]),
        num_accepted=int(accepted.sum().item()),
        accepted=accepted,
        predicted=predicted,
    )


def select_labelled(num_samples: int, ratio: float, generator: torch.Generator) -> Tensor:
    """Bool mask marking round(ρ·n) uniformly random samples as labelled, from ``generator``.

    ρ = 1 labels everything, ρ = 0 nothing; the same generator state gives the same mask.
    The mask is on the generator's device (use a CPU generator for device-independent masks).
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
        raise PseudoLabelError(f"num_samples must be a non-negative int, got {num_samples!r}")
    ratio = float(ratio)
    if not 0.0 <= ratio <= 1.0:
        raise PseudoLabelError(f"label ratio must lie in [0, 1], got {ratio!r}")
    if not isinstance(generator, torch.Generator):
        raise PseudoLabelError("generator must be a torch.Generator")
    # Half-up rounding with a guard so 0.2 * 50 = 10.000000000000002 still gives 10.
    count = min(num_samples, math.floor(ratio * num_samples + 0.5 + 1e-9))
    mask = torch.zeros(num_samples, dtype=torch.bool, device=generator.device)
    if count == num_samples:
        mask[:] = True
        return mask
    order = torch.randperm(num_samples, generator=generator, device=generator.device)
    mask[order[:count]] = True
    return mask


def pseudo_label_report(accepted: Tensor, predicted: Tensor, true_labels: Tensor) -> dict[str, float]:
    """Acceptance and pseudo-label accuracy over the unlabelled rows (docs/methods/fedran.md §6.10 logging).

    Keys: ``total``, ``accepted``, ``correct`` (accepted and equal to the hidden true label),
    ``acceptance_rate`` (accepted/total) and ``precision`` (correct/accepted; 0 if none accepted).
    """
    for name, value in (("accepted", accepted), ("predicted", predicted), ("true_labels", true_labels)):
        if not isinstance(value, Tensor) or value.ndim != 1:
            raise PseudoLabelError(f"{name} must be a 1-D tensor")
    if not (accepted.shape == predicted.shape == true_labels.shape):
        raise PseudoLabelError("accepted, predicted and true_labels must have the same length")
    if accepted.dtype != torch.bool:
        raise PseudoLabelError("accepted must be a bool tensor")
    total = int(accepted.shape[0])
    n_accepted = int(accepted.sum().item())
    correct = int((accepted & (predicted.to(true_labels.device) == true_labels)).sum().item())
    return {
        "total": total,
        "accepted": n_accepted,
        "correct": correct,
        "acceptance_rate": n_accepted / total if total else 0.0,
        "precision": correct / n_accepted if n_accepted else 0.0,
    }


def _normalise_rows(matrix: Tensor) -> Tensor:
    norms = torch.linalg.vector_norm(matrix, dim=1, keepdim=True)
    return matrix / torch.where(norms > 0, norms, torch.ones_like(norms))


def _check_features(features: Tensor, name: str) -> None:
    if not isinstance(features, Tensor) or features.ndim != 2:
        raise PseudoLabelError(f"{name} must be a 2-D tensor (n, d)")
    if not features.is_floating_point():
        raise PseudoLabelError(f"{name} must be floating point, got {features.dtype}")
    if features.numel() and not bool(torch.isfinite(features).all()):
        raise PseudoLabelError(f"{name} contain NaN or Inf")


def _check_num_classes(num_classes: int) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes <= 0:
        raise PseudoLabelError(f"num_classes must be a positive int, got {num_classes!r}")
