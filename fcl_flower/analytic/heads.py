"""Inference heads on random features (docs/methods/stsa.md §2.8).

The paper implies the dot-product head argmax_c Φᵀw_c; the reference code uses a cosine head
(class columns of W L2-normalised), which is what reproduces the paper's numbers. Normalising
Φ as well (true cosine) does not change the argmax, only the logit scale.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from .errors import AnalyticInputError

__all__ = ["HEADS", "logits", "predict"]

Head = Literal["cosine", "dot"]
HEADS: tuple[str, ...] = ("cosine", "dot")
_EPS = 1e-12  # zero columns/rows give zero logits instead of NaN


def logits(phi: Tensor, weights: Tensor, head: Head = "cosine") -> Tensor:
    """Class scores (n, c) in float64: Φ W (dot) or cos(Φ, w_c) (cosine)."""
    if phi.dim() != 2 or weights.dim() != 2 or phi.shape[1] != weights.shape[0]:
        raise AnalyticInputError(
            f"phi (n, M) and weights (M, c) do not match: {tuple(phi.shape)} vs {tuple(weights.shape)}"
        )
    x = phi.to(torch.float64)
    w = weights.to(device=x.device, dtype=torch.float64)
    if head == "dot":
        return x @ w
    if head == "cosine":
        w_unit = w / w.norm(dim=0, keepdim=True).clamp_min(_EPS)
        x_unit = x / x.norm(dim=1, keepdim=True).clamp_min(_EPS)
        return x_unit @ w_unit
    raise AnalyticInputError(f"head must be one of {HEADS}, got {head!r}")


def predict(phi: Tensor, weights: Tensor, head: Head = "cosine") -> Tensor:
    """Predicted class ids (n,), int64: argmax of ``logits``."""
    return logits(phi, weights, head).argmax(dim=1)
