"""Soft-target knowledge distillation shared by LwF and LGA.

LwF (Li & Hoiem, 2016) keeps the new model's predictions on the *old* classes close to the
frozen old model's, softened by a temperature ``T``. We write it as the KL divergence
``KL(softmax(z_old / T) || softmax(z_new[:, :C_old] / T))``: this differs from LwF's
"modified cross-entropy" only by the old model's entropy, a constant, so the gradients are
identical and the loss is exactly 0 when the two models agree (handy for tests and logs).

Departures
----------
* KL instead of soft cross-entropy (same gradient, offset by a constant; see above).
* No Hinton ``T**2`` factor by default (LwF does not use it); ``scale_by_t2=True`` adds it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fcl_flower.models import load_trainable_state

from .errors import FCLInputError

__all__ = ["frozen_teacher", "kd_loss", "softmax_kl_per_sample"]


def frozen_teacher(model: nn.Module, state: Mapping[str, Tensor], device: torch.device) -> nn.Module:
    """A frozen copy of ``model`` carrying the teacher's trainable state (eval mode, no grads)."""
    teacher = copy.deepcopy(model)
    load_trainable_state(teacher, state)
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def _check_logits_pair(new_logits: Tensor, old_logits: Tensor) -> None:
    if new_logits.ndim != 2 or old_logits.ndim != 2:
        raise FCLInputError(f"logits must be 2-D (B, C), got {tuple(new_logits.shape)} and {tuple(old_logits.shape)}")
    if new_logits.shape[0] != old_logits.shape[0]:
        raise FCLInputError(f"batch sizes differ: {new_logits.shape[0]} vs {old_logits.shape[0]}")
    if old_logits.shape[1] < 1 or old_logits.shape[1] > new_logits.shape[1]:
        raise FCLInputError(
            f"old model has {old_logits.shape[1]} classes; new model must cover them, has {new_logits.shape[1]}"
        )


def softmax_kl_per_sample(target_logits: Tensor, logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Per-sample ``KL(softmax(target/T) || softmax(logits/T))``, shape (B,).

    The target is detached: the teacher is never trained through the distillation term.
    Computed with ``log_softmax`` on both sides, so it stays finite even for saturated logits.
    """
    if temperature <= 0:
        raise FCLInputError(f"temperature must be > 0, got {temperature}")
    if target_logits.shape != logits.shape or logits.ndim != 2:
        raise FCLInputError(
            f"target and logits must both be (B, C), got {tuple(target_logits.shape)} and {tuple(logits.shape)}"
        )
    log_q = F.log_softmax(target_logits.detach() / temperature, dim=1)
    log_p = F.log_softmax(logits / temperature, dim=1)
    return (log_q.exp() * (log_q - log_p)).sum(dim=1)


def kd_loss(new_logits: Tensor, old_logits: Tensor, T: float = 2.0, *, scale_by_t2: bool = False) -> Tensor:
    """LwF distillation over the old classes, averaged over the batch.

    Args:
        new_logits: (B, C_new) logits of the model being trained (seen classes only).
        old_logits: (B, C_old) logits of the frozen old model, C_old <= C_new; the first C_old
            columns of ``new_logits`` must be the same classes in the same order.
        T: softening temperature (LwF uses 2).
        scale_by_t2: multiply by ``T**2`` (Hinton et al.) so gradient magnitudes do not shrink
            with T; off by default to match LwF.

    Returns:
        Scalar ``mean_i KL(softmax(old_i/T) || softmax(new_i[:C_old]/T))``.
    """
    _check_logits_pair(new_logits, old_logits)
    c_old = old_logits.shape[1]
    loss = softmax_kl_per_sample(old_logits, new_logits[:, :c_old], T).mean()
    return loss * (T * T) if scale_by_t2 else loss
