"""Backbone / classifier registry: one name -> one architecture, optionally seeded."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .base import Backbone, ModelError
from .cnn import SmallCNN
from .heads import IncrementalClassifier
from .resnet import ResNet18
from .vit import VIT_B16_TIMM_NAME, ViTAdapterBackbone, create_timm_vit

__all__ = ["BACKBONES", "build_backbone", "build_classifier", "seeded"]

BACKBONES: tuple[str, ...] = ("small-cnn", "resnet18-cifar", "resnet18", "vit-b16-adapter")

_VIT_PATCH = 16


@contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Run the block with torch's CPU RNG set to ``seed``, restoring the caller's RNG afterwards.

    Models are built on the CPU, so only the CPU generator matters; forking it keeps a seeded
    build from disturbing (or depending on) any other random stream of the process. ``None``
    leaves the global RNG untouched and in use.
    """
    if seed is None:
        yield
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ModelError(f"seed must be an int or None, got {seed!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _check_common(in_channels: int, image_size: int) -> None:
    if in_channels < 1:
        raise ModelError(f"in_channels must be >= 1, got {in_channels}")
    if image_size < 1:
        raise ModelError(f"image_size must be >= 1, got {image_size}")


def _build_vit(in_channels: int, image_size: int, pretrained: bool) -> Backbone:
    if image_size % _VIT_PATCH != 0:
        raise ModelError(f"vit-b16-adapter needs image_size divisible by {_VIT_PATCH}, got {image_size}")
    # img_size != 224 makes timm resample the position embeddings of pretrained weights; the
    # paper setting resizes images to 224.
    vit = create_timm_vit(
        VIT_B16_TIMM_NAME,
        pretrained=pretrained,
        num_classes=0,
        global_pool="token",
        img_size=image_size,
        in_chans=in_channels,
    )
    return ViTAdapterBackbone(vit)


def _builders() -> dict[str, Callable[[int, int, bool], Backbone]]:
    def no_weights(name: str, make: Callable[[int], Backbone]) -> Callable[[int, int, bool], Backbone]:
        def build(in_channels: int, image_size: int, pretrained: bool) -> Backbone:
            if pretrained:
                raise ModelError(f"{name} has no pretrained weights (trained from scratch); use pretrained=false")
            return make(in_channels)

        return build

    return {
        "small-cnn": no_weights("small-cnn", lambda c: SmallCNN(c)),
        "resnet18-cifar": no_weights("resnet18-cifar", lambda c: ResNet18(c, stem="cifar")),
        "resnet18": no_weights("resnet18", lambda c: ResNet18(c, stem="imagenet")),
        "vit-b16-adapter": _build_vit,
    }


def build_backbone(
    name: str,
    *,
    in_channels: int = 3,
    image_size: int = 32,
    pretrained: bool = False,
    seed: int | None = None,
) -> Backbone:
    """Build backbone ``name`` (one of :data:`BACKBONES`) on the CPU.

    With ``seed`` the random initialisation is a pure function of the seed (same weights in any
    process); the caller's RNG state is left as it was. ``pretrained`` is only meaningful for
    ``vit-b16-adapter``; the ResNets and the small CNN are trained from scratch as in STSA.
    """
    if name not in BACKBONES:
        raise ModelError(f"unknown backbone {name!r}; valid backbones: {', '.join(BACKBONES)}")
    _check_common(in_channels, image_size)
    with seeded(seed):
        return _builders()[name](in_channels, image_size, pretrained)


def build_classifier(
    backbone_name: str,
    num_classes: int,
    *,
    in_channels: int = 3,
    image_size: int = 32,
    pretrained: bool = False,
    head: str = "cosine",
    seed: int | None = None,
    anchor_dim: int = 0,
) -> IncrementalClassifier:
    """Backbone + head over all ``num_classes``; ``seed`` fixes backbone *and* head init.

    ``anchor_dim > 0`` adds an anchor head (LANDER), drawn after the head, so backbone and head
    start from the same weights as without it."""
    with seeded(seed):
        backbone = build_backbone(backbone_name, in_channels=in_channels, image_size=image_size, pretrained=pretrained)
        return IncrementalClassifier(backbone, num_classes, head=head, anchor_dim=anchor_dim)
