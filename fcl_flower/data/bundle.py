"""Class order, label remapping and the :class:`DatasetBundle` every loader returns.

Why remap labels once, at load time: after remapping, label = position in the class order,
so task t is a contiguous label range and every consumer (partition, heads, metrics) can work
with ``range`` objects instead of carrying the permutation around.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import DatasetError

if TYPE_CHECKING:  # the datasets import torch; a task plan's checks (fcl_flower.data.plan) need none of it
    from .labelled import LabelledDataset, Transform


def class_order(num_classes: int, seed: int) -> np.ndarray:
    """Original class id at each position: ``default_rng(seed).permutation(num_classes)``."""
    if num_classes < 1:
        raise DatasetError(f"num_classes must be >= 1, got {num_classes}")
    return np.random.default_rng(seed).permutation(num_classes).astype(np.int64)


def remap_labels(labels: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Map original class ids to their positions in ``order`` (the inverse permutation)."""
    labels = np.asarray(labels, dtype=np.int64)
    k = len(order)
    if labels.size and (labels.min() < 0 or labels.max() >= k):
        raise DatasetError(f"labels must lie in [0, {k}), got range [{labels.min()}, {labels.max()}]")
    position = np.empty(k, dtype=np.int64)
    position[order] = np.arange(k, dtype=np.int64)
    return position[labels]


@dataclass(frozen=True, eq=False)
class DatasetBundle:
    """A dataset ready for class-incremental learning.

    ``train`` and ``train_eval`` hold the same samples; ``train`` uses the training
    (augmenting) transforms, ``train_eval`` the eval transforms used for statistics and
    feature extraction. All targets are class-order positions; ``class_order[p]`` is the
    original class id at position ``p``.
    """

    name: str
    train: LabelledDataset
    train_eval: LabelledDataset
    test: LabelledDataset
    num_classes: int
    image_shape: tuple[int, int, int]
    class_order: np.ndarray


def build_bundle(
    name: str,
    *,
    train_images: np.ndarray | Sequence[str],
    train_labels: np.ndarray,
    test_images: np.ndarray | Sequence[str],
    test_labels: np.ndarray,
    num_classes: int,
    image_shape: tuple[int, int, int],
    seed: int,
    train_transform: Transform | None,
    eval_transform: Transform | None,
) -> DatasetBundle:
    """Remap labels by the seeded class order and wrap both splits into views."""
    from .labelled import LabelledDataset

    order = class_order(num_classes, seed)
    order.setflags(write=False)
    train = LabelledDataset(train_images, remap_labels(train_labels, order), train_transform)
    test = LabelledDataset(test_images, remap_labels(test_labels, order), eval_transform)
    return DatasetBundle(
        name=name,
        train=train,
        train_eval=train.with_transform(eval_transform),
        test=test,
        num_classes=int(num_classes),
        image_shape=(int(image_shape[0]), int(image_shape[1]), int(image_shape[2])),
        class_order=order,
    )
