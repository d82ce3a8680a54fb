"""Dataset registry: one entry point, :func:`load_dataset`, for every supported dataset.

Where data lives: ``root`` if given, else ``$FCL_DATA_ROOT``, else ``~/.cache/fcl-flower/data``
(an absolute default, because Flower client processes may run in any working directory).
Bundles are cached per (name, root, download, seed, image_size): clients call this on every
message, and the offline default (digits) must cost nothing after the first call.
"""

from __future__ import annotations

import numbers
import os
from functools import lru_cache
from pathlib import Path

from .array_cache import CACHE_DIR
from .bundle import DatasetBundle, build_bundle
from .cifar import cifar100_arrays
from .digits import digits_arrays
from .errors import DatasetError
from .imagenet_r import imagenet_r_files_at
from .synthetic import SyntheticSpec, make_synthetic
from .tiny_imagenet import TINY_SIZE, tiny_imagenet_arrays
from .transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    TINY_IMAGENET_MEAN,
    TINY_IMAGENET_STD,
    cifar_transforms,
    tensor_resize,
    tiny_imagenet_transforms,
    vit_transforms,
)

DATASETS: tuple[str, ...] = ("digits", "synthetic", "cifar100", "tiny-imagenet", "imagenet-r")
ROOT_ENV = "FCL_DATA_ROOT"
IMAGENET_R_DEFAULT_SIZE = 224


def default_root() -> Path:
    """Data folder used when ``root`` is None."""
    env = os.environ.get(ROOT_ENV)
    return Path(env).expanduser().resolve() if env else Path.home() / ".cache" / "fcl-flower" / "data"


def canonical_name(name: str) -> str:
    """Validated registry name (case and ``_``/``-`` insensitive); DatasetError otherwise."""
    key = str(name).strip().lower().replace("_", "-")
    if key == "tinyimagenet":
        key = "tiny-imagenet"
    if key not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    return key


def load_dataset(
    name: str,
    *,
    root: str | os.PathLike[str] | None = None,
    download: bool = True,
    seed: int = 0,
    image_size: int | None = None,
) -> DatasetBundle:
    """Load ``name`` with a seeded class order; targets are class-order positions.

    ``root`` None or "" means :func:`default_root`. Missing data with ``download=False`` (or a
    failed download) raises a one-line DatasetError naming the expected folder and the URL.

    ``image_size`` selects the ViT pipeline (e.g. 224) for cifar100 / tiny-imagenet; imagenet-r
    always uses it (default 224); digits / synthetic are resized to it.
    """
    key = canonical_name(name)
    if image_size is not None and (not _is_int(image_size) or image_size < 1):
        raise DatasetError(f"image_size must be a positive integer or None, got {image_size!r}")
    if not _is_int(seed):
        raise DatasetError(f"seed must be an integer, got {seed!r}")
    root_path = Path(root).expanduser().resolve() if root not in (None, "") else default_root()
    return _load(key, str(root_path), bool(download), int(seed), None if image_size is None else int(image_size))


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@lru_cache(maxsize=32)
def _load(name: str, root: str, download: bool, seed: int, image_size: int | None) -> DatasetBundle:
    base = Path(root)
    if name == "digits":
        x_tr, y_tr, x_te, y_te = digits_arrays(str(base / CACHE_DIR))
        tf = tensor_resize(image_size) if image_size is not None else None
        size = image_size or 8
        return build_bundle(
            name,
            train_images=x_tr,
            train_labels=y_tr,
            test_images=x_te,
            test_labels=y_te,
            num_classes=10,
            image_shape=(1, size, size),
            seed=seed,
            train_transform=tf,
            eval_transform=tf,
        )
    if name == "synthetic":
        return make_synthetic(SyntheticSpec(), seed=seed, image_size=image_size)
    if name == "cifar100":
        x_tr, y_tr, x_te, y_te = cifar100_arrays(base, download)
        if image_size is None:
            train_tf, eval_tf = cifar_transforms()
            size = 32
        else:  # CIFAR-224 has no normalisation in the STSA code (docs/methods/stsa.md §4.1)
            train_tf, eval_tf = vit_transforms(image_size)
            size = image_size
        return build_bundle(
            name,
            train_images=x_tr,
            train_labels=y_tr,
            test_images=x_te,
            test_labels=y_te,
            num_classes=100,
            image_shape=(3, size, size),
            seed=seed,
            train_transform=train_tf,
            eval_transform=eval_tf,
        )
    if name == "tiny-imagenet":
        x_tr, y_tr, x_te, y_te, k = tiny_imagenet_arrays(base, download)
        if image_size is None:
            train_tf, eval_tf = tiny_imagenet_transforms()
            size = TINY_SIZE
        else:
            train_tf, eval_tf = vit_transforms(image_size, TINY_IMAGENET_MEAN, TINY_IMAGENET_STD)
            size = image_size
        return build_bundle(
            name,
            train_images=x_tr,
            train_labels=y_tr,
            test_images=x_te,
            test_labels=y_te,
            num_classes=k,
            image_shape=(3, size, size),
            seed=seed,
            train_transform=train_tf,
            eval_transform=eval_tf,
        )
    # imagenet-r: ViT only, ImageNet mean/std as in the STSA code
    classes, tr_paths, tr_y, te_paths, te_y = imagenet_r_files_at(base, download)
    size = image_size or IMAGENET_R_DEFAULT_SIZE
    train_tf, eval_tf = vit_transforms(size, IMAGENET_MEAN, IMAGENET_STD)
    return build_bundle(
        name,
        train_images=tr_paths,
        train_labels=tr_y,
        test_images=te_paths,
        test_labels=te_y,
        num_classes=len(classes),
        image_shape=(3, size, size),
        seed=seed,
        train_transform=train_tf,
        eval_transform=eval_tf,
    )
