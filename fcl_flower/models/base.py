"""Shared pieces of the backbone registry: the error type and the backbone base class."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["Backbone", "ModelError"]


class ModelError(ValueError):
    """Bad model request (unknown name, bad shape, unavailable weights, state mismatch)."""


class Backbone(nn.Module):
    """Feature extractor F: images (B, C, H, W) -> features (B, feature_dim).

    Every backbone exposes ``feature_dim`` so heads, random-feature maps and statistics can be
    sized without running a forward pass.
    """

    feature_dim: int

    def __init__(self, feature_dim: int) -> None:
        super().__init__()
        self.feature_dim = int(feature_dim)

    def forward(self, x: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError
