"""scikit-learn's 8x8 digits: the offline default dataset (1797 images, 10 classes).

The train/test split is a stratified 75/25 split with a *fixed* seed (``SPLIT_SEED``), like the
fixed test sets of the real benchmarks: the run seed changes the class order and the client
partitions, not which images are test images. Arrays are cached in memory for the process and,
given a ``cache`` folder, on disk as memory-mapped ``.npy`` files (fcl_flower/data/array_cache.py)
keyed by the content of scikit-learn's ``digits.csv.gz``: on a real SuperNode every message is a
fresh process, and importing scikit-learn to cut the split costs more than the round's work.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np

from .array_cache import cached_arrays, source_key

SPLIT_SEED = 0
TEST_FRACTION = 0.25


@lru_cache(maxsize=2)
def digits_arrays(cache: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: float32 (N, 1, 8, 8) scaled to [0, 1], labels 0..9;
    read from (or written to) the on-disk cache in folder ``cache`` when one is given."""
    source = _source_file()
    if cache is None or source is None:
        return _split_digits()
    key = source_key(cache, "digits", [source], SPLIT_SEED, TEST_FRACTION, importlib.metadata.version("scikit-learn"))
    arrays = cached_arrays(cache, "digits", key, lambda: dict(zip(("x_tr", "y_tr", "x_te", "y_te"), _split_digits())))
    return arrays["x_tr"], arrays["y_tr"], arrays["x_te"], arrays["y_te"]


def _source_file() -> Path | None:
    """scikit-learn's bundled digits.csv.gz, found without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def _split_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # local import: sklearn is slow to import
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (np.asarray(data.images, dtype=np.float32) / 16.0)[:, None, :, :]
    y = np.asarray(data.target, dtype=np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED, shuffle=True
    )
    x_tr, y_tr, x_te, y_te = (np.ascontiguousarray(a) for a in (x_tr, y_tr, x_te, y_te))
    for a in (x_tr, y_tr, x_te, y_te):
        a.setflags(write=False)
    return x_tr, y_tr, x_te, y_te
