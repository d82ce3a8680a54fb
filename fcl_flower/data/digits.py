"""scikit-learn's 8x8 digits: the offline default dataset (1797 images, 10 classes).

The train/test split is a stratified 75/25 split with a *fixed* seed (``SPLIT_SEED``), like the
fixed test sets of the real benchmarks: the run seed changes the class order and the client
partitions, not which images are test images. Arrays are cached because every client message
loads the dataset again.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

SPLIT_SEED = 0
TEST_FRACTION = 0.25


@lru_cache(maxsize=1)
def digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: float32 (N, 1, 8, 8) scaled to [0, 1], labels 0..9."""
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
