"""The accepted uploads of one statistics round, kept until the round's sum is certified.

The server certifies one sum per stage (issue 30); a failing sum is bisected to its culprits,
which needs the uploads again. They are kept as received, in memory up to ``memory_bytes`` and
beyond that in a private temporary folder (mode 0700, files written with NumPy's non-pickled
format), and dropped when the round closes (:meth:`UploadSpool.close`, also on failure). In plain
mode the server sees every upload anyway; nothing here outlives the round or goes into a
checkpoint.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

DEFAULT_MEMORY_BYTES = 1 << 30  # 1 GiB of uploads in memory, the rest on disk


class UploadSpool:
    def __init__(self, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        self.memory_bytes = memory_bytes
        self.in_memory = 0
        self._kept: list[tuple[torch.Tensor, ...] | Path] = []
        self._folder: Path | None = None

    def put(self, tensors: tuple[torch.Tensor, ...]) -> int:
        """Keep ``tensors`` (not copied while in memory: the caller must not change them); a handle."""
        size = sum(t.numel() * t.element_size() for t in tensors)
        if self.in_memory + size <= self.memory_bytes:
            self.in_memory += size
            self._kept.append(tensors)
        else:
            if self._folder is None:
                self._folder = Path(tempfile.mkdtemp(prefix="fcl-uploads-"))  # 0700
            path = self._folder / f"{len(self._kept)}.npz"
            with path.open("wb") as out:
                np.savez(out, *[t.detach().cpu().numpy() for t in tensors])
            self._kept.append(path)
        return len(self._kept) - 1

    def get(self, handle: int) -> tuple[torch.Tensor, ...]:
        kept = self._kept[handle]
        if isinstance(kept, Path):
            with np.load(kept, allow_pickle=False) as data:
                return tuple(torch.from_numpy(data[f"arr_{i}"]) for i in range(len(data.files)))
        return kept

    def close(self) -> None:
        self._kept.clear()
        self.in_memory = 0
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
