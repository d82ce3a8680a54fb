"""Train / eval transforms per dataset, as in the STSA code (docs/methods/stsa.md §4.1).

Why two transforms per dataset: gradient training (stage 1) uses augmentation, while the
analytic statistics are computed with eval transforms (docs/methods/stsa.md §2.4), so every bundle carries both.

torchvision is imported when a transform is *built*, not with this module: importing it costs
about as much as importing torch itself (it pulls in its model zoo and detection ops), and a
ClientApp process that serves digits or synthetic data without resizing never needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchvision import transforms as T

CIFAR100_MEAN = (0.5071, 0.4867, 0.4408)
CIFAR100_STD = (0.2675, 0.2565, 0.2761)
TINY_IMAGENET_MEAN = (0.4802, 0.4481, 0.3975)
TINY_IMAGENET_STD = (0.2302, 0.2265, 0.2262)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def cifar_transforms() -> tuple[T.Compose, T.Compose]:
    """ResNet CIFAR-100 (32x32): crop + flip + brightness jitter, then normalise."""
    from torchvision import transforms as T

    norm = T.Normalize(CIFAR100_MEAN, CIFAR100_STD)
    train = T.Compose(
        [
            T.RandomCrop(32, padding=4),
            T.RandomHorizontalFlip(),
            T.ColorJitter(brightness=63 / 255),
            T.ToTensor(),
            norm,
        ]
    )
    return train, T.Compose([T.ToTensor(), norm])


def tiny_imagenet_transforms() -> tuple[T.Compose, T.Compose]:
    """ResNet Tiny-ImageNet (64x64): crop + flip; eval centre-crop; then normalise."""
    from torchvision import transforms as T

    norm = T.Normalize(TINY_IMAGENET_MEAN, TINY_IMAGENET_STD)
    train = T.Compose([T.RandomCrop(64, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    return train, T.Compose([T.CenterCrop(64), T.ToTensor(), norm])


def vit_transforms(
    image_size: int = 224, mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None
) -> tuple[T.Compose, T.Compose]:
    """ViT transforms: RandomResizedCrop(scale 0.05..1) + flip; eval bicubic resize + centre crop.

    The eval resize keeps the 256/224 ratio of the STSA code for any ``image_size``.
    ``mean``/``std`` = None gives inputs in [0, 1] (the code's CIFAR-224 quirk, docs/methods/stsa.md §4.1).
    """
    from torchvision import transforms as T
    from torchvision.transforms import InterpolationMode

    tail: list = [T.ToTensor()]
    if mean is not None and std is not None:
        tail.append(T.Normalize(mean, std))
    train = T.Compose(
        [T.RandomResizedCrop(image_size, scale=(0.05, 1.0), ratio=(3 / 4, 4 / 3)), T.RandomHorizontalFlip(), *tail]
    )
    resize = round(image_size * 256 / 224)
    test = T.Compose([T.Resize(resize, interpolation=InterpolationMode.BICUBIC), T.CenterCrop(image_size), *tail])
    return train, test


def tensor_resize(image_size: int) -> T.Resize:
    """Resize for float CHW tensors (digits / synthetic at a larger size, e.g. a ViT smoke test)."""
    from torchvision import transforms as T

    return T.Resize((image_size, image_size), interpolation=T.InterpolationMode.BILINEAR, antialias=True)


#: Training augmentations of a site's own images (node config ``augment``; fcl_flower/data/own.py).
AUGMENTATIONS = ("auto", "crop-flip", "crop", "none")
#: Above this side, own images are augmented like the ViT datasets (resized crops), else like CIFAR.
RESIZED_CROP_FROM = 96


def own_transforms(image_shape: tuple[int, int, int], augment: str = "auto") -> tuple[T.Compose, T.Compose]:
    """(train, eval) transforms of a site's own images, which arrive already converted to the plan's
    channels and resized to its height and width (fcl_flower/data/own.py), as PIL images.

    Eval: to a tensor, normalised with the ImageNet statistics for colour images (what pretrained
    backbones expect), left in [0, 1] for grayscale (like digits). Training, as for the public
    datasets: ``auto`` is ``crop-flip`` for colour images and ``none`` for grayscale (digits has no
    augmentation); ``crop-flip`` is a random crop (padding 1/8 of the side, like CIFAR's 4 of 32;
    resized crops of scale 0.05..1 above :data:`RESIZED_CROP_FROM` px, like the ViT datasets) and a
    horizontal flip; ``crop`` the crop alone (for images whose left and right differ, e.g. text).
    """
    from torchvision import transforms as T

    channels, height, width = image_shape
    if augment not in AUGMENTATIONS:
        raise ValueError(f"augment must be one of {', '.join(AUGMENTATIONS)} (got {augment!r})")
    tail: list = [T.ToTensor()]
    if channels == 3:
        tail.append(T.Normalize(IMAGENET_MEAN, IMAGENET_STD))
    if augment == "auto":
        augment = "crop-flip" if channels == 3 else "none"
    steps: list = []
    if augment != "none":
        if min(height, width) > RESIZED_CROP_FROM:
            steps.append(T.RandomResizedCrop((height, width), scale=(0.05, 1.0), ratio=(3 / 4, 4 / 3)))
        else:
            steps.append(T.RandomCrop((height, width), padding=max(1, min(height, width) // 8)))
        if augment == "crop-flip":
            steps.append(T.RandomHorizontalFlip())
    return T.Compose([*steps, *tail]), T.Compose(tail)
