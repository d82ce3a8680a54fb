"""The server's checkpoint, and the lock that keeps one server per run folder.

The checkpoint is written atomically after every stage (fcl_flower/state_io.py: tensors in
safetensors, everything else in JSON, nothing unpickled on load). ``resume`` continues from the
next stage and ends with the same classifier as an uninterrupted run, provided the
configuration is the same (operational keys such as the timeout may change). A checkpoint that
is corrupted, of another format or of another run is refused with one line naming the file.

:func:`run_folder_lock` takes an exclusive lock on the run folder for the whole run: a second
server on the same folder stops at once with one line instead of overwriting the first's results.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.state_io import StateError, load_state, save_state

NAME = "checkpoint"
LEGACY_FILE = "checkpoint.pt"  # pickled checkpoints of earlier versions: never loaded
LOCK_FILE = ".lock"
#: Keys that may differ between the run that wrote a checkpoint and the one that resumes it.
OPERATIONAL_KEYS = frozenset({"resume", "round-timeout", "require-all-clients", "round-retries", "device"})


def resumable_config(cfg: RunConfig) -> dict[str, Any]:
    """The config keys that must match for a checkpoint to be resumed."""
    return {k: v for k, v in cfg.to_mapping().items() if k not in OPERATIONAL_KEYS}


class CheckpointStore:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / f"{NAME}.json"

    def save(self, payload: dict[str, Any]) -> None:
        save_state(self.folder, NAME, payload)

    def load(self, cfg: RunConfig) -> dict[str, Any]:
        """The checkpoint of ``cfg``'s run; ConfigError (one line) if there is none, it cannot be
        read, or it is another run's."""
        if not self.path.exists():
            if (self.folder / LEGACY_FILE).exists():
                raise ConfigError(
                    f"resume: {self.folder / LEGACY_FILE} is a pickled checkpoint of an earlier "
                    "version, which fcl-flower no longer loads; run again without resume"
                )
            raise ConfigError(f"resume: no checkpoint at {self.path}; run once without --resume first")
        try:
            payload = load_state(self.path)
        except StateError as err:
            raise ConfigError(f"resume: {err}") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("config"), dict):
            raise ConfigError(f"resume: {self.path} holds no fcl-flower server state; delete it or restore a backup")
        if payload.get("strategy") != cfg.strategy:
            raise ConfigError(f"resume: checkpoint at {self.path} is for strategy '{payload.get('strategy')}'")
        saved, current = payload["config"], resumable_config(cfg)
        changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        if changed:
            raise ConfigError(f"resume: config differs from the checkpoint in: {', '.join(changed)}")
        return payload


@contextmanager
def run_folder_lock(folder: Path) -> Iterator[None]:
    """Hold the run folder's lock for the duration; ConfigError at once if another server holds it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder / LOCK_FILE))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ConfigError(
            f"another server is running in {folder} (it holds {folder / LOCK_FILE}); "
            "wait for it, or choose another out/run-name"
        ) from None
    try:
        yield
    finally:
        lock.release()
