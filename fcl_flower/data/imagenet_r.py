"""ImageNet-R (200 classes, ~30k images), lazily loaded from image files.

Two layouts are accepted under ``root/imagenet-r``:

* prepared: ``train/<class>/*`` and ``test/<class>/*`` (e.g. the APER split files);
* raw, as extracted from ``imagenet-r.tar``: ``<class>/*``. Then each class is split 80/20
  into train/test with a generator seeded by ``[SPLIT_SEED, class index]``. The split seed is
  fixed, not the run seed: like the benchmark's published split, the test set must not change
  between runs; the run seed only changes the class order and the partitions.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from .download import ensure_folder
from .errors import DatasetError

IMAGENET_R_URL = "https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar"
IMAGENET_R_FOLDER = "imagenet-r"
TRAIN_FRACTION = 0.8
SPLIT_SEED = 0
IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")


def _images(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _class_dirs(d: Path) -> list[Path]:
    return sorted(
        p for p in d.iterdir() if p.is_dir() and p.name not in ("train", "test") and not p.name.startswith(".")
    )


def _is_prepared(folder: Path) -> bool:
    return (folder / "train").is_dir() and (folder / "test").is_dir()


def _present(folder: Path) -> bool:
    return folder.is_dir() and (_is_prepared(folder) or bool(_class_dirs(folder)))


def split_counts(n: int, train_fraction: float = TRAIN_FRACTION) -> int:
    """Number of training images of a class with ``n`` images (at least one of each when n >= 2)."""
    n_train = round(train_fraction * n)
    return min(max(n_train, 1), n - 1) if n >= 2 else n


@lru_cache(maxsize=2)
def imagenet_r_files(folder: str) -> tuple[tuple[str, ...], list[str], np.ndarray, list[str], np.ndarray]:
    """``(classes, train_paths, train_labels, test_paths, test_labels)``; class id = index in sorted names."""
    base = Path(folder)
    tr_paths: list[str] = []
    tr_y: list[int] = []
    te_paths: list[str] = []
    te_y: list[int] = []
    if _is_prepared(base):
        classes = tuple(p.name for p in _class_dirs(base / "train"))
        unknown = sorted({p.name for p in _class_dirs(base / "test")} - set(classes))
        if unknown:
            raise DatasetError(
                f"imagenet-r: test classes {unknown[:3]} have no folder in {base / 'train'}; fix the prepared split"
            )
        for c, name in enumerate(classes):
            files = _images(base / "train" / name)
            tr_paths += [str(p) for p in files]
            tr_y += [c] * len(files)
            test_dir = base / "test" / name
            files = _images(test_dir) if test_dir.is_dir() else []
            te_paths += [str(p) for p in files]
            te_y += [c] * len(files)
    else:
        dirs = _class_dirs(base)
        classes = tuple(p.name for p in dirs)
        for c, d in enumerate(dirs):
            files = _images(d)
            perm = np.random.default_rng([SPLIT_SEED, c]).permutation(len(files))
            k = split_counts(len(files))
            tr_paths += [str(files[i]) for i in np.sort(perm[:k])]
            te_paths += [str(files[i]) for i in np.sort(perm[k:])]
            tr_y += [c] * k
            te_y += [c] * (len(files) - k)
    if not classes or not tr_paths or not te_paths:
        raise DatasetError(
            f"imagenet-r: {base} has no usable train and test images; re-download or re-extract the dataset"
        )
    return classes, tr_paths, np.asarray(tr_y, np.int64), te_paths, np.asarray(te_y, np.int64)


def imagenet_r_files_at(
    root: Path, download: bool
) -> tuple[tuple[str, ...], list[str], np.ndarray, list[str], np.ndarray]:
    """Locate (or download) ``root/imagenet-r`` and list its split."""
    folder = root / IMAGENET_R_FOLDER
    ensure_folder(
        "imagenet-r",
        root=root,
        expected=folder,
        present=lambda: _present(folder),
        url=IMAGENET_R_URL,
        download=download,
        archive_note="(or prepare root/imagenet-r/{train,test}/<class>/ folders)",
    )
    return imagenet_r_files(str(folder))
