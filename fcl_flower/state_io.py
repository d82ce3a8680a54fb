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

Authenticity. ``<name>.json`` begins with ``"hmac"``: an HMAC-SHA256 (fcl_flower/state_key.py) of
the rest of the file and of its name, under this installation's key, which lives outside the run
folder. The signature is checked on the file's bytes before anything is parsed; since the JSON holds
the tensors file's SHA-256, it covers the tensors too. A file without it, or changed by anyone who
does not hold the key (digests recomputed or not), is refused with one line. A file that is a
symbolic link is refused, and the files are written in a private staging folder (mode 0700) and
renamed into place, so nothing is ever written through a link planted in the run folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fcl_flower.state_key import KeyFileError, key_path, sign, signing_key, verify

FORMAT = "fcl-flower-state/2"
DIGEST = re.compile(r"[0-9a-f]{64}")
SIGNED = re.compile(rb'\{"hmac": "([0-9a-f]{64})", ')
MOVE_HINT = "to move a run folder between machines move the key file too (docs/federations.md)"


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


def _signing_key(key: bytes | None) -> bytes:
    try:
        return signing_key() if key is None else key
    except KeyFileError as err:
        raise StateError(str(err)) from None


def signed_bytes(name: str, document: dict[str, Any], key: bytes) -> bytes:
    """The bytes of ``<name>.json``: ``{"hmac": "<signature>", `` then the document's JSON."""
    body = json.dumps(document).encode("utf-8")
    return b'{"hmac": "' + sign(key, name, body).encode("ascii") + b'", ' + body[1:]


def save_state(folder: Path, name: str, state: Any, key: bytes | None = None) -> Path:
    """Write ``state`` as ``<folder>/<name>.json`` (+ its tensors file), signed with ``key``
    (default: this installation's, :func:`fcl_flower.state_key.signing_key`); returns the JSON path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = _signing_key(key)
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, "", tensors)
    staging = Path(tempfile.mkdtemp(dir=folder, prefix=f".{name}."))  # mode 0700: nobody else adds links in it
    try:
        staged = staging / "tensors.safetensors"
        save_file(tensors, str(staged))
        digest = hashlib.sha256(staged.read_bytes()).hexdigest()
        data_file = folder / f"{name}-{digest[:16]}.safetensors"
        document = {"format": FORMAT, "tensors": data_file.name, "sha256": digest, "state": tree}
        staged_json = staging / f"{name}.json"
        fd = os.open(staged_json, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(signed_bytes(name, document, key))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staged, data_file)
        path = folder / f"{name}.json"
        os.replace(staged_json, path)  # last: until here the previous state file stands
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for old in folder.glob(f"{name}-*.safetensors"):
        if old.name != data_file.name:
            old.unlink(missing_ok=True)
    return path


def _read_nofollow(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def load_state(path: Path, key: bytes | None = None) -> Any:
    """The state saved at ``path`` (a ``<name>.json``) and signed with ``key`` (default: this
    installation's); StateError (one line) if it is not one, or not signed with that key."""
    path = Path(path)
    advice = "delete it (and start without resume) or restore a backup"
    try:
        raw = _read_nofollow(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise StateError(f"{path} is a symbolic link, which fcl-flower never follows; {advice}") from None
        raise StateError(f"{path} is not a readable fcl-flower state file ({type(err).__name__}); {advice}") from None
    signed = SIGNED.match(raw)
    if signed is None:
        raise StateError(f"{path} {_unsigned(raw)}; {advice}")
    key = _signing_key(key)
    name = path.name.removesuffix(".json")
    if not verify(key, name, b"{" + raw[signed.end() :], signed.group(1).decode("ascii")):
        raise StateError(
            f"{path}: not signed by this installation's key ({key_path()}): it was changed after it was written, "
            f"or written with another key; {MOVE_HINT}; otherwise {advice}"
        )
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
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
    except RecursionError:
        raise StateError(f"{path} cannot be decoded (its state is nested too deeply); {advice}") from None
    except (SafetensorError, KeyError, TypeError, ValueError) as err:
        raise StateError(f"{path} cannot be decoded ({type(err).__name__}: {err}); {advice}") from None


def _unsigned(raw: bytes) -> str:
    """Why a state file without a signature is refused, in words (never parsed past a depth limit)."""
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        return f"is not a readable fcl-flower state file ({type(err).__name__})"
    if isinstance(document, dict) and str(document.get("format", "")).startswith("fcl-flower-state/"):
        return (
            "is not signed (written by an earlier version of fcl-flower, or rewritten by hand): fcl-flower "
            "resumes only state files signed with this installation's key"
        )
    return f"is not an fcl-flower state file of format {FORMAT}"
