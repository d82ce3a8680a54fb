"""The installation's key that signs the server's state files (checkpoints), kept outside the run folder.

Every state file the server writes (fcl_flower/state_io.py: ``checkpoint.json``, the opened secure
sum) carries an HMAC-SHA256 of its content under a key of 32 random bytes that never leaves this
machine's user account: ``$FCL_CHECKPOINT_KEY_FILE`` if set, else
``$XDG_CONFIG_HOME/fcl-flower/checkpoint.key`` (``~/.config/fcl-flower/checkpoint.key``). Whoever can
write the run folder but cannot read that file cannot produce a state file the server accepts.

The key file is made on first use, with mode 0600 in a folder of mode 0700, atomically (written
under a private name, then linked into place: two servers starting at once end with one key). A key
file that is a symbolic link, not a regular file, not the user's own, or readable or writable by
group or others is refused with one line (:class:`KeyFileError`): fcl-flower does not sign with a
key somebody else may know. To resume a run folder on another machine, copy the key file there too
(docs/federations.md, "Moving a run folder to another machine").
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

ENV = "FCL_CHECKPOINT_KEY_FILE"
KEY_BYTES = 32


class KeyFileError(ValueError):
    """The key file cannot be used; one line naming it and what to do."""


def key_path() -> Path:
    """Where this installation's key lives (module doc)."""
    named = os.environ.get(ENV)
    if named:
        return Path(named).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "fcl-flower" / "checkpoint.key"


def signing_key(path: Path | None = None) -> bytes:
    """The key at ``path`` (default :func:`key_path`), made on first use; KeyFileError (one line) if unusable."""
    path = key_path() if path is None else Path(path)
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    _create(path)
    return _read(path)


def sign(key: bytes, name: str, body: bytes) -> str:
    """HMAC-SHA256 of a state file named ``name`` with content ``body`` (hex): a signed file moved
    under another name (an opened sum put in place of a checkpoint) no longer verifies."""
    return hmac.new(key, name.encode() + b"\0" + body, hashlib.sha256).hexdigest()


def verify(key: bytes, name: str, body: bytes, signature: str) -> bool:
    return hmac.compare_digest(sign(key, name, body), signature)


def _read(path: Path) -> bytes:
    advice = f"set {ENV} to another file, or remove it (a new key is made; checkpoints signed with the old one are then refused)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise KeyFileError(
                f"the checkpoint key {path} is a symbolic link, which fcl-flower refuses; {advice}"
            ) from None
        raise KeyFileError(f"cannot read the checkpoint key {path}: {err.strerror or type(err).__name__}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"the checkpoint key {path} is not a regular file; {advice}")
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise KeyFileError(f"the checkpoint key {path} belongs to another user; {advice}")
        if info.st_mode & 0o077:
            raise KeyFileError(
                f"the checkpoint key {path} is open to group or others (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"run chmod 600 {path} if nobody else has read it, else {advice}"
            )
        data = os.read(fd, 4 * KEY_BYTES)
    finally:
        os.close(fd)
    text = data.strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"the checkpoint key {path} does not hold {KEY_BYTES} bytes in hex; {advice}")
    return key


def _create(path: Path) -> None:
    """Write a new key at ``path`` with mode 0600, atomically; another process's key wins a race."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        staging = path.parent / f".{path.name}.{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(staging, flags, 0o600)
        try:
            os.write(fd, (secrets.token_hex(KEY_BYTES) + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(staging, path)  # fails if a key appeared meanwhile: that one is used
        except FileExistsError:
            pass
        finally:
            os.unlink(staging)
    except OSError as err:
        raise KeyFileError(
            f"cannot create the checkpoint key {path}: {err.strerror or type(err).__name__}; set {ENV} to a writable place"
        ) from None
