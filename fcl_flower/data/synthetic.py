"""A seeded, class-dependent synthetic image dataset for tests.

Each class has a random prototype image in [0, 1]; samples are the prototype plus Gaussian
noise, clipped to [0, 1]. Classes are therefore separable (a linear or analytic classifier
learns them) while the noise keeps the problem non-trivial. Counts per class are fixed, so
partition tests know exactly how many samples each class and task has.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .bundle import DatasetBundle, build_bundle
from .errors import DatasetError
from .transforms import tensor_resize


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of the synthetic dataset; ``data_seed`` fixes the images (not the class order)."""

    num_classes: int = 20
    train_per_class: int = 40
    test_per_class: int = 10
    channels: int = 1
    size: int = 8
    noise: float = 0.25
    data_seed: int = 0

    def validate(self) -> None:
        if self.num_classes < 1:
            raise DatasetError(f"synthetic num_classes must be >= 1, got {self.num_classes}")
        if self.train_per_class < 1 or self.test_per_class < 1:
            raise DatasetError("synthetic train_per_class and test_per_class must be >= 1")
        if self.channels not in (1, 3):
            raise DatasetError(f"synthetic channels must be 1 or 3, got {self.channels}")
        if self.size < 1:
            raise DatasetError(f"synthetic size must be >= 1, got {self.size}")
        if not (self.noise >= 0 and np.isfinite(self.noise)):
            raise DatasetError(f"synthetic noise must be a finite number >= 0, got {self.noise}")


@lru_cache(maxsize=16)
def synthetic_arrays(spec: SyntheticSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: float32 (N, C, S, S) in [0, 1], original labels."""
    spec.validate()
    rng = np.random.default_rng(spec.data_seed)
    shape = (spec.channels, spec.size, spec.size)
    protos = rng.random((spec.num_classes, *shape))

    def draw(per_class: int) -> tuple[np.ndarray, np.ndarray]:
        y = np.repeat(np.arange(spec.num_classes, dtype=np.int64), per_class)
        x = protos[y] + spec.noise * rng.standard_normal((y.size, *shape))
        x = np.clip(x, 0.0, 1.0).astype(np.float32)
        x.setflags(write=False)
        y.setflags(write=False)
        return x, y

    x_tr, y_tr = draw(spec.train_per_class)
    x_te, y_te = draw(spec.test_per_class)
    return x_tr, y_tr, x_te, y_te


def make_synthetic(
    spec: SyntheticSpec = SyntheticSpec(), *, seed: int = 0, image_size: int | None = None
) -> DatasetBundle:
    """Synthetic :class:`DatasetBundle`; ``seed`` sets the class order, ``spec`` the images."""
    x_tr, y_tr, x_te, y_te = synthetic_arrays(spec)
    tf = tensor_resize(image_size) if image_size is not None else None
    size = image_size if image_size is not None else spec.size
    return build_bundle(
        "synthetic",
        train_images=x_tr,
        train_labels=y_tr,
        test_images=x_te,
        test_labels=y_te,
        num_classes=spec.num_classes,
        image_shape=(spec.channels, size, size),
        seed=seed,
        train_transform=tf,
        eval_transform=tf,
    )
