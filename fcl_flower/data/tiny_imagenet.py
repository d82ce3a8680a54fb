"""Tiny-ImageNet-200: the train folders as training set, the official val set as test set.

Images are decoded once into uint8 (N, 64, 64, 3) arrays and cached as ``.npy`` files next
to the data. Why: decoding 110k JPEGs takes about a minute, and every client process would
otherwise repeat it; the cache is memory-mapped, so processes on one machine share pages.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

from .download import ensure_folder
from .errors import DatasetError

TINY_IMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINY_IMAGENET_FOLDER = "tiny-imagenet-200"
TINY_SIZE = 64
IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")
_CACHE_DIR = "fcl_cache"


def _present(folder: Path) -> bool:
    return (
        (folder / "wnids.txt").is_file()
        and (folder / "train").is_dir()
        and (folder / "val" / "val_annotations.txt").is_file()
    )


@lru_cache(maxsize=2)
def tiny_imagenet_files(folder: str) -> tuple[tuple[str, ...], list[str], np.ndarray, list[str], np.ndarray]:
    """``(wnids, train_paths, train_labels, test_paths, test_labels)``; class id = index in sorted wnids."""
    base = Path(folder)
    wnids = tuple(sorted({w.strip() for w in (base / "wnids.txt").read_text().splitlines() if w.strip()}))
    if not wnids:
        raise DatasetError(f"tiny-imagenet: {base / 'wnids.txt'} lists no classes; re-download the dataset")
    index = {w: i for i, w in enumerate(wnids)}
    train_paths: list[str] = []
    train_labels: list[int] = []
    for w in wnids:
        img_dir = base / "train" / w / "images"
        files = sorted(p for p in img_dir.glob("*") if p.suffix.lower() in IMAGE_SUFFIXES) if img_dir.is_dir() else []
        if not files:
            raise DatasetError(
                f"tiny-imagenet: no training images in {img_dir}; the extracted folder is incomplete, re-download it"
            )
        train_paths += [str(p) for p in files]
        train_labels += [index[w]] * len(files)
    test_paths: list[str] = []
    test_labels: list[int] = []
    for line in (base / "val" / "val_annotations.txt").read_text().splitlines():
        parts = line.split("\t")
        if len(parts) < 2:
            continue
        fname, wnid = parts[0].strip(), parts[1].strip()
        if wnid not in index:
            raise DatasetError(f"tiny-imagenet: val_annotations.txt names class {wnid!r} that is not in wnids.txt")
        test_paths.append(str(base / "val" / "images" / fname))
        test_labels.append(index[wnid])
    if not test_paths:
        raise DatasetError(
            f"tiny-imagenet: {base / 'val' / 'val_annotations.txt'} lists no images; re-download the dataset"
        )
    return wnids, train_paths, np.asarray(train_labels, np.int64), test_paths, np.asarray(test_labels, np.int64)


def _decode(paths: list[str]) -> np.ndarray:
    out = np.empty((len(paths), TINY_SIZE, TINY_SIZE, 3), dtype=np.uint8)
    for i, p in enumerate(paths):
        try:
            with Image.open(p) as img:
                rgb = img.convert("RGB")  # a few Tiny-ImageNet images are greyscale
        except OSError as exc:
            raise DatasetError(
                f"tiny-imagenet: cannot read image {p} ({type(exc).__name__}); re-download the dataset"
            ) from None
        if rgb.size != (TINY_SIZE, TINY_SIZE):
            rgb = rgb.resize((TINY_SIZE, TINY_SIZE), Image.Resampling.BILINEAR)
        out[i] = np.asarray(rgb)
    return out


def _cached_images(cache: Path, split: str, paths: list[str], labels: np.ndarray) -> np.ndarray:
    """Decoded images of one split, from the ``.npy`` cache when it matches ``labels``."""
    x_file, y_file = cache / f"{split}_x.npy", cache / f"{split}_y.npy"
    if x_file.is_file() and y_file.is_file():
        try:
            y = np.load(y_file)
            x = np.load(x_file, mmap_mode="r")
            if np.array_equal(y, labels) and x.shape == (len(paths), TINY_SIZE, TINY_SIZE, 3):
                return x
        except (OSError, ValueError):
            pass  # stale or truncated cache: rebuild it
    x = _decode(paths)
    try:  # write atomically; a read-only data folder just means no cache
        cache.mkdir(exist_ok=True)
        for arr, dest in ((x, x_file), (labels, y_file)):
            tmp = dest.with_name(dest.name + f".tmp{os.getpid()}.npy")
            np.save(tmp, arr)
            os.replace(tmp, dest)
    except OSError:
        pass
    return x


def tiny_imagenet_arrays(root: Path, download: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """``(x_train, y_train, x_test, y_test, num_classes)``; images uint8 (N, 64, 64, 3)."""
    folder = root / TINY_IMAGENET_FOLDER
    ensure_folder(
        "tiny-imagenet",
        root=root,
        expected=folder,
        present=lambda: _present(folder),
        url=TINY_IMAGENET_URL,
        download=download,
    )
    return _load_arrays(str(folder))


@lru_cache(maxsize=2)
def _load_arrays(folder: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    wnids, tr_paths, tr_y, te_paths, te_y = tiny_imagenet_files(folder)
    cache = Path(folder) / _CACHE_DIR
    x_tr = _cached_images(cache, "train", tr_paths, tr_y)
    x_te = _cached_images(cache, "val", te_paths, te_y)
    return x_tr, tr_y, x_te, te_y, len(wnids)
