"""A cache of numpy arrays as ``.npy`` files that open memory-mapped, keyed by the source's content.

Why: on a real SuperNode Flower starts a fresh ClientApp process for every message, so whatever
a client does to get its data (import scikit-learn and cut the digits split, unpickle CIFAR-100,
unzip a client folder's ``.npz``) it does again every round. The cache does it once; later
processes map the ``.npy`` files (no parsing, no copy; pages shared between processes).

An entry is the folder ``<cache>/<name>-<key>/`` with one ``<array>.npy`` per array and a
``manifest.json`` written last. ``key`` is a hash of the *content* the arrays come from (the
caller's :func:`content_key`): changed source data gives another key, so a stale entry is never
used, only left behind. Safe against corruption:

* an entry is built in a temporary folder and renamed into place in one step, so a crashed or
  concurrent writer never leaves a half-written entry under its final name;
* on open every array's shape and dtype must match the manifest and every file its recorded
  size; an entry that fails is removed and rebuilt;
* a folder that cannot be written (read-only data) just means no cache: the arrays are built
  in memory as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np

FORMAT = "fcl-flower-array-cache/1"
MANIFEST = "manifest.json"
CACHE_DIR = ".fcl-cache"


def content_key(files: Iterable[str | os.PathLike[str]], *extra: object) -> str:
    """SHA-256 over the bytes of ``files`` (in order, with their names) and ``extra`` values."""
    digest = hashlib.sha256()
    for file in files:
        path = Path(file)
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    for value in extra:
        digest.update(repr(value).encode() + b"\0")
    return digest.hexdigest()[:32]


def source_key(
    cache: str | os.PathLike[str], name: str, files: Iterable[str | os.PathLike[str]], *extra: object
) -> str:
    """:func:`content_key` of ``files``, hashed again only when one of them changed size or
    modification time since the last call (``<cache>/<name>.source.json`` remembers both)."""
    paths = [Path(f) for f in files]
    stats = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths] + [[repr(v)] for v in extra]
    memo = Path(cache) / f"{name}.source.json"
    try:
        known = json.loads(memo.read_text())
        if known["stats"] == stats:
            return str(known["key"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    key = content_key(paths, *extra)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"stats": stats, "key": key}))
        os.replace(tmp, memo)
    except OSError:
        pass
    return key


def cached_arrays(
    cache: str | os.PathLike[str], name: str, key: str, build: Callable[[], Mapping[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """The arrays of entry ``name``/``key`` under ``cache``, memory-mapped read-only; ``build()``
    computes them (and the entry is written) when the entry is missing or fails its checks."""
    entry = Path(cache) / f"{name}-{key}"
    arrays = _open(entry, key)
    if arrays is not None:
        return arrays
    if entry.exists():  # present but broken: a later open must not find it again
        shutil.rmtree(entry, ignore_errors=True)
    built = {k: np.ascontiguousarray(v) for k, v in build().items()}
    if _write(entry, key, built):
        arrays = _open(entry, key)
        if arrays is not None:
            return arrays
    return built


def _open(entry: Path, key: str) -> dict[str, np.ndarray] | None:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        if manifest.get("format") != FORMAT or manifest.get("key") != key:
            return None
        arrays = {}
        for name, spec in manifest["arrays"].items():
            file = entry / f"{name}.npy"
            if file.stat().st_size != int(spec["bytes"]):
                return None
            array = np.load(file, mmap_mode="r", allow_pickle=False)
            if list(array.shape) != list(spec["shape"]) or array.dtype.str != spec["dtype"]:
                return None
            arrays[name] = array.view(np.ndarray)  # a plain (read-only) array backed by the map
        return arrays
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(entry: Path, key: str, arrays: Mapping[str, np.ndarray]) -> bool:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    except OSError:
        return False
    try:
        spec = {}
        for name, array in arrays.items():
            file = tmp / f"{name}.npy"
            with file.open("wb") as handle:
                np.save(handle, array, allow_pickle=False)
                handle.flush()
                os.fsync(handle.fileno())
            spec[name] = {"shape": list(array.shape), "dtype": array.dtype.str, "bytes": file.stat().st_size}
        (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "key": key, "arrays": spec}))
        os.rename(tmp, entry)  # atomic; fails if another process got there first, which is as good
        return True
    except OSError:
        return entry.is_dir()
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
