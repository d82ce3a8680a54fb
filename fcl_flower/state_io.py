"""Saving and loading a server's state without pickle: tensors in safetensors, the rest in JSON.

A state is a tree of dicts, lists, tuples, numbers, strings, None, torch tensors and numpy
arrays. :func:`save_state` writes

* ``<name>-<digest>.safetensors``: every tensor and array, flat, under its path in the tree;
* ``<name>.json``: the tree with each tensor replaced by a reference, the format, and the
  SHA-256 of the tensors file.

The JSON file is replaced last and atomically, so a crash at any point leaves the previous
complete checkpoint; files of older checkpoints are removed afterwards. :func:`load_state`
never executes anything from disk: safetensors holds raw numbers, JSON holds data. A truncated,
garbled or foreign file raises :class:`StateError` with one line naming the file; a digest
mismatch says which side is wrong (the tensors file is named by its digest, so a damaged
``sha256`` field in the JSON is told apart from a damaged tensors file).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT = "fcl-flower-state/1"
DIGEST = re.compile(r"[0-9a-f]{64}")


class StateError(ValueError):
    """A state file that cannot be read back; one line naming the file and what to do."""


def _tensor_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor], seen: dict[Any, str] | None = None) -> Any:
    seen = {} if seen is None else seen
    if isinstance(value, torch.Tensor):
        # A state may hold one tensor under several paths (a model and its teacher share weights):
        # store it once and point every path at it, so loading shares it again. Overlapping views
        # of one storage that are not the same tensor are stored as copies (safetensors refuses
        # shared memory).
        tensor = value.detach().cpu()
        key = _tensor_key(tensor)
        if key in seen:
            return {"__tensor__": seen[key]}
        storages = {k[0] for k in seen}
        stored = tensor.clone() if key[0] in storages else tensor.contiguous()
        seen[key] = path
        tensors[path] = stored
        return {"__tensor__": path}
    if isinstance(value, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(value)).clone()
        return {"__ndarray__": path}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"__dict__": {k: _encode(v, f"{path}/{k}", tensors, seen) for k, v in value.items()}}
        return {
            "__items__": [
                [_encode(k, f"{path}/key{i}", tensors, seen), _encode(v, f"{path}/{i}", tensors, seen)]
                for i, (k, v) in enumerate(value.items())
            ]
        }
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors, seen) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors, seen) for i, v in enumerate(value)]
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store a {type(value).__name__} at {path or '/'} in a state file")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return tensors[value["__ndarray__"]].numpy()
    if "__dict__" in value:
        return {k: _decode(v, tensors) for k, v in value["__dict__"].items()}
    if "__items__" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    raise KeyError(f"unknown node {sorted(value)}")


def _atomic_write(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_state(folder: Path, name: str, state: Any) -> Path:
    """Write ``state`` as ``<folder>/<name>.json`` (+ its tensors file); returns the JSON path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, "", tensors)
    fd, staging = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".safetensors")
    os.close(fd)
    try:
        save_file(tensors, staging)
        digest = hashlib.sha256(Path(staging).read_bytes()).hexdigest()
        data_file = folder / f"{name}-{digest[:16]}.safetensors"
        os.replace(staging, data_file)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    document = {"format": FORMAT, "tensors": data_file.name, "sha256": digest, "state": tree}
    path = folder / f"{name}.json"

    def write_json(target: str) -> None:
        with open(target, "w", encoding="utf-8") as handle:
            json.dump(document, handle)
            handle.flush()
            os.fsync(handle.fileno())

    _atomic_write(path, write_json)
    for old in folder.glob(f"{name}-*.safetensors"):
        if old.name != data_file.name:
            old.unlink(missing_ok=True)
    return path


def load_state(path: Path) -> Any:
    """The state saved at ``path`` (a ``<name>.json``); StateError (one line) if it is not one."""
    path = Path(path)
    advice = "delete it (and start without resume) or restore a backup"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise StateError(f"{path} is not a readable fcl-flower state file ({type(err).__name__}); {advice}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise StateError(f"{path} is not an fcl-flower state file of format {FORMAT}; {advice}")
    data_file = path.parent / str(document.get("tensors", ""))
    if "/" in str(document.get("tensors", "")) or not data_file.is_file():
        raise StateError(f"{path} refers to a missing tensors file {data_file.name}; {advice}")
    digest = document.get("sha256")
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        shown = repr(digest) if len(repr(digest)) <= 20 else repr(digest)[:17] + "..."
        raise StateError(
            f"{path}: its sha256 field is malformed ({shown}, not 64 hex digits): {path.name} was edited "
            f"or damaged, not {data_file.name}; {advice}"
        )
    actual = hashlib.sha256(data_file.read_bytes()).hexdigest()
    if actual != digest:
        named = data_file.stem.rpartition("-")[2]  # save_state names the file by its digest's first 16 digits
        if len(named) == 16 and actual.startswith(named):
            raise StateError(
                f"{path}: its sha256 field does not match {data_file.name}, which is intact (its content "
                f"matches its name): the digest in {path.name} was altered; {advice}"
            )
        raise StateError(f"{data_file} does not match the sha256 in {path.name}: the tensors file is damaged; {advice}")
    try:
        tensors = load_file(str(data_file))
        return _decode(document.get("state"), tensors)
    except (SafetensorError, KeyError, TypeError, ValueError) as err:
        raise StateError(f"{path} cannot be decoded ({type(err).__name__}: {err}); {advice}") from None
