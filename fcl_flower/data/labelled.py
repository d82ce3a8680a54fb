"""A labelled image dataset that is a cheap, picklable *view* over shared storage.

Why a view: the federated split hands every client a subset of the same training set, twice
(train and eval transforms), for every task. Copying images for each would multiply memory;
instead all views share one storage object and differ only in an index array and a transform.

Three kinds of storage are supported:

* ``float`` -- an in-memory float32 array ``(N, C, H, W)`` (digits, synthetic). Items reach the
  transform as float32 CHW tensors.
* ``uint8`` -- an in-memory (or memory-mapped) uint8 array ``(N, H, W, C)`` (CIFAR-100,
  Tiny-ImageNet). Items reach the transform as RGB PIL images, as torchvision transforms expect.
* ``paths`` -- a list of image files (ImageNet-R), opened lazily as RGB PIL images.
* ``reader`` -- an :class:`ImageReader` (a site's own images, fcl_flower/data/own.py): item ``j``
  is ``reader.read(j)``, a PIL image the reader decodes (and may cache) on first use.

Whatever the transform returns (PIL image, array or tensor) is converted to a float32 CHW tensor.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from .errors import DatasetError

Transform = Callable[[Any], Any]


@runtime_checkable
class ImageReader(Protocol):
    """Storage that decodes its images itself: ``read(j)`` is item ``j`` as a PIL image."""

    def __len__(self) -> int: ...

    def read(self, j: int) -> Image.Image: ...


class _Storage:
    """Images and labels shared by every view of one dataset split."""

    def __init__(self, images: np.ndarray | Sequence[str] | ImageReader, targets: np.ndarray) -> None:
        targets = np.asarray(targets)
        if targets.ndim != 1 or not np.issubdtype(targets.dtype, np.integer):
            raise DatasetError(
                f"targets must be a 1-D integer array, got shape {targets.shape} and dtype {targets.dtype}"
            )
        if isinstance(images, np.ndarray):
            if images.dtype == np.uint8:
                if images.ndim == 3:  # grey (N, H, W) -> (N, H, W, 1)
                    images = images[..., None]
                if images.ndim != 4:
                    raise DatasetError(f"uint8 images must have shape (N, H, W, C), got {images.shape}")
                self.kind = "uint8"
            elif np.issubdtype(images.dtype, np.floating):
                if images.ndim != 4:
                    raise DatasetError(f"float images must have shape (N, C, H, W), got {images.shape}")
                images = np.ascontiguousarray(images, dtype=np.float32)
                self.kind = "float"
            else:
                raise DatasetError(f"images must be uint8 or floating point, got dtype {images.dtype}")
        elif isinstance(images, ImageReader):
            self.kind = "reader"
        else:
            images = [str(p) for p in images]
            self.kind = "paths"
        if len(images) != len(targets):
            raise DatasetError(f"{len(images)} images but {len(targets)} targets")
        self.images: Any = images
        self.targets = targets.astype(np.int64, copy=False)
        self.targets.setflags(write=False)

    def raw(self, j: int) -> Any:
        """The untransformed item ``j`` in the form the transforms of its kind expect."""
        if self.kind == "float":
            return torch.from_numpy(np.array(self.images[j], dtype=np.float32, copy=True))
        if self.kind == "uint8":
            arr = np.asarray(self.images[j])
            return Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
        if self.kind == "reader":
            return self.images.read(j)
        with Image.open(self.images[j]) as img:
            return img.convert("RGB")


def _to_tensor(x: Any) -> torch.Tensor:
    """Float32 CHW tensor from whatever a transform produced."""
    if isinstance(x, Image.Image):
        from torchvision.transforms import functional as TF  # here: importing torchvision costs ~1 s

        return TF.to_tensor(x)
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise DatasetError(f"transform returned {type(x).__name__}; expected a PIL image, array or tensor")
    if x.dtype == torch.uint8:
        return x.to(torch.float32) / 255.0
    return x.to(torch.float32)


class LabelledDataset(Dataset):
    """Images with int64 labels (already remapped to class-order positions).

    ``targets`` holds the labels of this view, in order, so that label statistics (per-class
    counts, task masks) never need to touch the images.
    """

    def __init__(
        self,
        images: np.ndarray | Sequence[str] | ImageReader | _Storage,
        targets: np.ndarray | None = None,
        transform: Transform | None = None,
        *,
        indices: np.ndarray | None = None,
    ) -> None:
        if isinstance(images, _Storage):
            self._storage = images
        else:
            if targets is None:
                raise DatasetError("targets are required when building a LabelledDataset from images")
            self._storage = _Storage(images, targets)
        n = len(self._storage.targets)
        if indices is None:
            idx = np.arange(n, dtype=np.int64)
        else:
            idx = np.asarray(indices, dtype=np.int64).reshape(-1)
            if idx.size and (idx.min() < 0 or idx.max() >= n):
                raise DatasetError(f"subset indices must lie in [0, {n}), got range [{idx.min()}, {idx.max()}]")
        idx.setflags(write=False)
        self._indices = idx
        self.transform = transform
        self.targets: np.ndarray = self._storage.targets[idx]
        self.targets.setflags(write=False)

    # -- views -------------------------------------------------------------------------------
    @property
    def indices(self) -> np.ndarray:
        """Positions of this view's samples in the underlying storage."""
        return self._indices

    @property
    def storage_kind(self) -> str:
        """``"float"``, ``"uint8"``, ``"paths"`` or ``"reader"``."""
        return self._storage.kind

    def subset(self, indices: np.ndarray) -> LabelledDataset:
        """A view of ``self[indices]`` (positions relative to this view); keeps the transform."""
        idx = np.asarray(indices)
        if idx.dtype == bool:
            if idx.shape != (len(self),):
                raise DatasetError(f"boolean mask has shape {idx.shape}, expected ({len(self)},)")
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise DatasetError(f"subset indices must lie in [0, {len(self)}), got range [{idx.min()}, {idx.max()}]")
        return LabelledDataset(self._storage, transform=self.transform, indices=self._indices[idx])

    def with_transform(self, transform: Transform | None) -> LabelledDataset:
        """The same samples with another transform (e.g. eval transforms for statistics)."""
        return LabelledDataset(self._storage, transform=transform, indices=self._indices)

    def fingerprint(self) -> str | None:
        """SHA-256 of what this view feeds a model: the transform's ``repr``, the labels, and the
        exact samples (in-memory storage; a site's reader's decoded arrays, which it keeps for the
        pass that follows, fcl_flower/data/own.py) or each file's path, size and mtime
        (``paths``). None when it cannot be told faithfully: a transform whose ``repr`` is an
        object address (a lambda, a class without one), a reader that does not give its arrays."""
        described = repr(self.transform)
        images = self._storage.images
        if " at 0x" in described or (self._storage.kind == "reader" and not hasattr(images, "array")):
            return None
        h = hashlib.sha256(f"{self._storage.kind}\0{described}\0".encode())
        h.update(np.ascontiguousarray(self.targets, dtype=np.int64).data)
        if self._storage.kind == "paths":
            for j in self._indices:
                path = images[int(j)]
                st = os.stat(path)
                h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        elif self._storage.kind == "reader":
            for j in self._indices:
                array = np.ascontiguousarray(images.array(int(j)))
                h.update(f"{array.dtype.str}\0{array.shape}\0".encode())
                h.update(array.data)
        else:
            h.update(f"{images.dtype.str}\0{tuple(images.shape[1:])}\0".encode())
            for start in range(0, len(self._indices), 4096):  # a memory-mapped array is read in pieces
                h.update(np.ascontiguousarray(images[self._indices[start : start + 4096]]).data)
        return h.hexdigest()

    # -- Dataset protocol --------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._indices.size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        j = int(self._indices[i])
        x = self._storage.raw(j)
        if self.transform is not None:
            x = self.transform(x)
        return _to_tensor(x), int(self._storage.targets[j])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All samples stacked as ``(X float32 [N,C,H,W], y int64 [N])``; for small datasets.

        Untransformed float storage is sliced directly, which keeps the digits path fast.
        """
        y = torch.from_numpy(np.array(self.targets, dtype=np.int64))
        if self._storage.kind == "float" and self.transform is None:
            return torch.from_numpy(np.array(self._storage.images[self._indices], dtype=np.float32)), y
        if len(self) == 0:
            raise DatasetError("cannot stack an empty dataset")
        return torch.stack([self[i][0] for i in range(len(self))]), y

    def __repr__(self) -> str:
        return f"LabelledDataset(n={len(self)}, storage={self._storage.kind}, transform={self.transform!r})"
