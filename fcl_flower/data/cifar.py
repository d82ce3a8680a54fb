"""CIFAR-100 through torchvision, held in memory as uint8 (N, 32, 32, 3)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from .download import download_failed_error, missing_error
from .errors import DatasetError, one_line

CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
CIFAR100_FOLDER = "cifar-100-python"


def cifar100_arrays(root: Path, download: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)`` with original CIFAR-100 fine labels."""
    expected = root / CIFAR100_FOLDER
    if not expected.is_dir():
        if not download:
            raise missing_error("cifar100", expected, root, CIFAR100_URL)
        from torchvision.datasets import CIFAR100

        try:
            root.mkdir(parents=True, exist_ok=True)
            CIFAR100(str(root), train=True, download=True)
        except Exception as exc:  # offline, DNS, disk, checksum: all "not available"
            raise download_failed_error("cifar100", expected, root, CIFAR100_URL, exc) from None
    return _read_cifar100(str(root))


@lru_cache(maxsize=2)
def _read_cifar100(root: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from torchvision.datasets import CIFAR100

    try:
        train = CIFAR100(root, train=True, download=False)
        test = CIFAR100(root, train=False, download=False)
    except Exception as exc:
        raise DatasetError(
            f"cifar100: {Path(root) / CIFAR100_FOLDER} is incomplete or corrupted ({one_line(exc, 120)}); "
            f"delete it and run load_dataset('cifar100', root='{root}', download=True)"
        ) from None
    out = (
        np.ascontiguousarray(train.data, dtype=np.uint8),
        np.asarray(train.targets, dtype=np.int64),
        np.ascontiguousarray(test.data, dtype=np.uint8),
        np.asarray(test.targets, dtype=np.int64),
    )
    for a in out:
        a.setflags(write=False)
    return out
