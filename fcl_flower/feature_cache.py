"""Backbone features of a node's data, cached by content hash (issue 32).

The analytic methods pass every sample of a task through the frozen backbone once per
statistics round, once more per federated evaluation, and again in the next run over the same
data. A long-lived process (the node's warm worker, clients/worker.py; an in-process simulation)
keeps what it computed; with node config ``feature-cache = "<folder>"`` a node also keeps it on
disk, so that a second run with the same data and the same backbone reads its features back.

**The key** is a SHA-256 over everything the features depend on:

* the backbone: its class, its ``repr`` (the architecture) and every tensor of its state
  (name, dtype, shape, bytes) -- a backbone that stage-1 training changed by one bit misses;
* the data: :meth:`LabelledDataset.fingerprint` (the exact samples and labels of the view, or
  the paths, sizes and mtimes of the files it reads, and the transform's ``repr``); data whose
  content cannot be fingerprinted (a transform without a faithful ``repr``, a site's own image
  reader) is never cached;
* how they are computed: the device, torch's version and thread count, the batch size (the
  same batches as without the cache, so a hit yields what the computation would).

A hit returns exactly the stored tensors, batch by batch (the batches the loader would give),
so every statistic built on them is the same bit for bit as without the cache, as long as the
backbone's forward pass is itself deterministic (it is on CPU).

**On disk** each entry is one ``<key>.npz`` (NumPy, read with ``allow_pickle=False``) holding
the features, the labels and a SHA-256 of both and of the key; it is written to a temporary file of mode 0600
and renamed into place. A file that fails to load, holds other arrays or whose digest does not
match is logged in one line, removed and recomputed: a cache file is never trusted blindly. The
folder must be this user's and closed to group and others (it is made 0700 when absent); any
other folder is refused in one line and the node goes on without a disk cache.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
import torch
from flwr.common.logger import log
from torch import nn

from fcl_flower.data import LabelledDataset
from fcl_flower.private_paths import private_path_problem

FORMAT = "fcl-flower-features/1"
DEFAULT_MEMORY_MIB = 256
ARRAYS = ("features", "labels", "digest")


class FeatureCacheError(RuntimeError):
    """The cache folder cannot be trusted (owner, permissions, kind); one line."""


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a buffer (no copy of a contiguous CPU tensor)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def backbone_digest(backbone: nn.Module) -> str:
    """SHA-256 of the backbone's class, architecture and every tensor of its state."""
    h = hashlib.sha256(FORMAT.encode())
    h.update(f"{type(backbone).__module__}.{type(backbone).__qualname__}\0{backbone!r}\0".encode())
    for name, tensor in backbone.state_dict().items():
        h.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        h.update(_tensor_bytes(tensor))
    return h.hexdigest()


def feature_key(backbone: nn.Module, dataset: LabelledDataset, device: torch.device, batch_size: int) -> str | None:
    """The cache key of ``backbone``'s features of ``dataset`` (None: the data cannot be fingerprinted)."""
    data = dataset.fingerprint()
    if data is None:
        return None
    blob = json.dumps(
        {
            "format": FORMAT,
            "backbone": backbone_digest(backbone),
            "data": data,
            "device": str(device),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "batch": int(batch_size),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _content_digest(key: str, features: np.ndarray, labels: np.ndarray) -> str:
    """SHA-256 of an entry's key and arrays: a file renamed to another key does not pass either."""
    h = hashlib.sha256(f"{FORMAT}\0{key}\0".encode())
    for array in (features, labels):
        h.update(f"{array.dtype.str}\0{array.shape}\0".encode())
        h.update(np.ascontiguousarray(array).data)
    return h.hexdigest()


# ---------------------------------------------------------------------------- the folder
def check_folder(folder: Path) -> Path:
    """``folder`` made (0700) if absent, then refused unless it is a folder of this user's,
    closed to group and others, and not a symbolic link."""
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as err:
        raise FeatureCacheError(f"cannot make the feature cache folder {folder}: {err.strerror}") from None
    problem = private_path_problem(folder, "folder")
    if problem is not None:
        raise FeatureCacheError(f"feature cache folder {folder} {problem}: refused")
    return folder


def save_entry(folder: Path, key: str, features: torch.Tensor, labels: torch.Tensor) -> None:
    """``<key>.npz`` in ``folder``: written to a 0600 temporary file, then renamed into place."""
    f, y = features.numpy(), labels.numpy()
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = np.frombuffer(_content_digest(key, f, y).encode(), dtype=np.uint8)
            np.savez(out, features=f, labels=y, digest=digest)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, folder / f"{key}.npz")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_entry(folder: Path, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The features and labels of ``<key>.npz``; None when there is none, or when it is damaged
    (then it is logged in one line and removed)."""
    path = folder / f"{key}.npz"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as err:
        log(WARNING, "feature cache file %s cannot be opened (%s): recomputed", path.name, err.strerror)
        return None
    try:
        with os.fdopen(fd, "rb") as file:
            st = os.fstat(file.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ValueError("not a regular file of this user's")
            raw = file.read()
        with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
            if sorted(npz.files) != sorted(ARRAYS):
                raise ValueError(f"it holds {sorted(npz.files)}")
            f, y, digest = npz["features"], npz["labels"], npz["digest"]
        if f.dtype != np.float64 or y.dtype != np.int64 or f.ndim != 2 or y.shape != (f.shape[0],):
            raise ValueError(f"arrays of dtype {f.dtype}/{y.dtype} and shape {f.shape}/{y.shape}")
        if digest.dtype != np.uint8 or digest.tobytes().decode("ascii", "replace") != _content_digest(key, f, y):
            raise ValueError("its contents do not match their SHA-256")
    except Exception as err:  # a truncated zip, a tampered array, another file under its name
        log(WARNING, "feature cache file %s is damaged (%s): removed and recomputed", path.name, err)
        path.unlink(missing_ok=True)
        return None
    return torch.from_numpy(np.array(f)), torch.from_numpy(np.array(y))


# ---------------------------------------------------------------------------- the cache
@dataclass
class FeatureCache:
    """Features by key, least recently used first out beyond ``max_bytes``; optionally backed by
    a folder (:func:`check_folder`). ``hits``/``misses`` count lookups (a disk hit is a hit)."""

    max_bytes: int = DEFAULT_MEMORY_MIB << 20
    hits: int = 0
    misses: int = 0
    _entries: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=OrderedDict)
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, key: str, folder: Path | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry
        entry = load_entry(folder, key) if folder is not None else None
        with self._lock:
            if entry is None:
                self.misses += 1
                return None
            self.hits += 1
        self._remember(key, entry)
        return entry

    def put(self, key: str, features: torch.Tensor, labels: torch.Tensor, folder: Path | None = None) -> None:
        if folder is not None:
            try:
                save_entry(folder, key, features, labels)
            except OSError as err:
                log(WARNING, "feature cache: cannot write to %s (%s); kept in memory only", folder, err.strerror)
        self._remember(key, (features, labels))

    def _remember(self, key: str, entry: tuple[torch.Tensor, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in entry)
        with self._lock:
            if key in self._entries or size > self.max_bytes:
                return
            self._entries[key] = entry
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (f, y) = self._entries.popitem(last=False)
                self._bytes -= f.numel() * f.element_size() + y.numel() * y.element_size()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self.hits = self.misses = 0


#: this process's cache (a warm worker's lives as long as the worker)
PROCESS_CACHE = FeatureCache()


@dataclass(frozen=True)
class CacheUse:
    """Where one call looks its features up: ``cache`` (memory), ``folder`` (disk, or None) and
    what the log line calls the data (e.g. "task 2 (client 1)")."""

    cache: FeatureCache
    folder: Path | None
    what: str


def cached_batches(
    use: CacheUse,
    key: str,
    batch_size: int,
    compute: Iterator[tuple[torch.Tensor, torch.Tensor]],
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of ``compute`` (float64 features on CPU, int64 labels), from the cache when it
    holds ``key`` (sliced into the loader's batches), else computed and then cached; one log line."""
    hit = use.cache.get(key, use.folder)
    if hit is not None:
        log(INFO, "features of %s: reused from cache %s", use.what, key[:12])
        features, labels = hit
        for start in range(0, int(labels.shape[0]), batch_size):
            yield features[start : start + batch_size].clone(), labels[start : start + batch_size].clone()
        return
    zs, ys = [], []
    for z, y in compute:
        zs.append(z.clone())
        ys.append(y.clone())
        yield z, y
    if zs:
        features, labels = torch.cat(zs), torch.cat(ys)
    else:
        features, labels = torch.zeros(0, 0, dtype=torch.float64), torch.zeros(0, dtype=torch.int64)
    use.cache.put(key, features, labels, use.folder)
    log(INFO, "features of %s: computed and cached %s", use.what, key[:12])
