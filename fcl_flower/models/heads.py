"""Classification heads and the backbone+head model used for gradient training."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Backbone, ModelError

__all__ = ["HEADS", "CosineHead", "IncrementalClassifier"]

HEADS: tuple[str, ...] = ("cosine", "linear")


class CosineHead(nn.Module):
    """``logits_c = sigma * <f/|f|, w_c/|w_c|>`` with a learnable scalar ``sigma`` (init 1).

    This is STSA [CODE]'s ``CosineLinear``: logits depend only on the direction of the feature,
    which keeps the scale of features from dominating training; ``sigma`` sets the softmax
    temperature. The same form is used at inference with the ridge weights as ``w``.
    """

    def __init__(self, in_features: int, num_classes: int, *, learn_sigma: bool = True) -> None:
        super().__init__()
        if in_features < 1 or num_classes < 1:
            raise ModelError(f"CosineHead needs positive sizes, got {in_features} x {num_classes}")
        self.in_features = int(in_features)
        self.num_classes = int(num_classes)
        self.weight = nn.Parameter(torch.empty(num_classes, in_features))
        self.sigma = nn.Parameter(torch.ones(1), requires_grad=learn_sigma)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / self.in_features**0.5
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            self.sigma.fill_(1.0)

    def forward(self, features: Tensor) -> Tensor:
        cos = F.linear(F.normalize(features, dim=1), F.normalize(self.weight, dim=1))
        return self.sigma * cos


class IncrementalClassifier(nn.Module):
    """Backbone + head over *all* ``num_classes`` of the run.

    Logits of classes not seen yet are still produced; trainers mask them (e.g. set to -inf)
    themselves, so the head never needs resizing between tasks.

    ``anchor_dim > 0`` adds LANDER's anchor head: a linear map of the backbone feature into the
    ``anchor_dim``-dimensional space of the label-text embeddings ([CODE-L]'s ``mapping``, whose
    output it calls ``att``), trained and averaged with the rest of the model;
    :meth:`forward_with_anchor` returns both outputs of one backbone pass.
    """

    def __init__(self, backbone: Backbone, num_classes: int, head: str = "cosine", anchor_dim: int = 0) -> None:
        super().__init__()
        if num_classes < 1:
            raise ModelError(f"num_classes must be >= 1, got {num_classes}")
        if head not in HEADS:
            raise ModelError(f"unknown head {head!r}; valid heads: {', '.join(HEADS)}")
        self.backbone = backbone
        self.num_classes = int(num_classes)
        dim = backbone.feature_dim
        self.head: nn.Module = CosineHead(dim, num_classes) if head == "cosine" else nn.Linear(dim, num_classes)
        if anchor_dim < 0:
            raise ModelError(f"anchor_dim must be >= 0, got {anchor_dim}")
        self.anchor: nn.Module | None = nn.Linear(dim, anchor_dim) if anchor_dim else None

    def features(self, x: Tensor) -> Tensor:
        return self.backbone(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def forward_with_anchor(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(logits, anchor embedding) of one backbone pass; needs ``anchor_dim > 0``."""
        if self.anchor is None:
            raise ModelError("this classifier has no anchor head (anchor_dim = 0)")
        features = self.backbone(x)
        return self.head(features), self.anchor(features)
