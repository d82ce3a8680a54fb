"""The run folder: its checks before a run, its lock, and the server's checkpoint in it.

The checkpoint is written atomically after every stage (fcl_flower/state_io.py: tensors in
safetensors, everything else in JSON, nothing unpickled on load). ``resume`` continues from the
next stage and ends with the same classifier as an uninterrupted run, provided the
configuration is the same (operational keys such as the timeout may change). A checkpoint that
is corrupted, of another format or of another run is refused with one line naming the file.

:func:`open_run_folder` makes the folder and checks it before any work: it must be writable, and it
must not hold the results of another configuration (unless ``overwrite``; ``resume`` is checked
against the checkpoint instead). It then
holds an exclusive lock on the folder for the whole run: a second server on the same folder stops
at once with one line instead of overwriting the first's results. :func:`check_run_folder` runs
the same checks (and the resume's) without keeping the lock, for a launcher before its engine starts.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from fcl_flower.config import OPERATIONAL_KEYS, ConfigError, RunConfig
from fcl_flower.state_io import StateError, load_state, save_state

NAME = "checkpoint"
LEGACY_FILE = "checkpoint.pt"  # pickled checkpoints of earlier versions: never loaded
LOCK_FILE = ".lock"
RESULTS_FILE = "results.json"


def resumable_config(cfg: RunConfig) -> dict[str, Any]:
    """The config keys that must match for a checkpoint to be resumed (the operational ones may differ)."""
    return cfg.result_config()


def differing_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Result knobs whose values differ (operational knobs never count)."""
    keys = (set(saved) | set(current)) - OPERATIONAL_KEYS
    return sorted(k for k in keys if saved.get(k) != current.get(k))


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
        changed = differing_keys(payload["config"], resumable_config(cfg))
        if changed:
            raise ConfigError(f"resume: config differs from the checkpoint in: {', '.join(changed)}")
        return payload


def writable_folder(folder: Path) -> Path:
    """Make ``folder`` (and its parents) and prove it writable; ConfigError (one line) if not."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ConfigError(f"cannot write the run folder {folder}: {reason}; choose another out") from None
    return folder


def check_not_foreign(cfg: RunConfig) -> None:
    """Refuse a run folder that holds another configuration's results, unless overwrite.

    The configuration a folder holds is the one in its results.json (written when a run starts).
    A folder with the same result knobs is this configuration's: running it again replaces the
    same numbers. Under ``resume`` the checkpoint decides (:meth:`CheckpointStore.load` refuses
    another configuration's), so the hint offers only what can work: another folder, or overwrite.
    """
    path = cfg.output_dir / RESULTS_FILE
    if cfg.resume or cfg.overwrite or not path.exists():
        return
    try:
        saved = json.loads(path.read_text())["config"]
        assert isinstance(saved, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise ConfigError(
            f"{path} is not an fcl-flower results file; choose another out/run-name or pass overwrite"
        ) from None
    changed = differing_keys(saved, resumable_config(cfg))
    if changed:
        shown = ", ".join(f"{k}: {saved.get(k)!r} -> {resumable_config(cfg).get(k)!r}" for k in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        raise ConfigError(
            f"{cfg.output_dir} holds the results of another configuration ({shown}{more}); "
            "choose another out/run-name, or pass overwrite to replace them (resume continues only the same configuration)"
        )


def check_run_folder(cfg: RunConfig) -> None:
    """Everything :func:`open_run_folder` and a resume will check, checked now: for a launcher,
    before its engine starts (experiments/sim.py: seconds, not after Ray's start). The folder is
    writable, no other server holds its lock, it is not another configuration's, and under
    ``resume`` it holds a checkpoint of this configuration. The lock is released again: the
    server takes it (and checks all of this once more) when it starts."""
    with run_folder_lock(writable_folder(cfg.output_dir)):
        check_not_foreign(cfg)
        if cfg.resume:
            CheckpointStore(cfg.output_dir).load(cfg)


@contextmanager
def open_run_folder(cfg: RunConfig) -> Iterator[Path]:
    """The run folder, writable, locked for this run and not another configuration's."""
    with run_folder_lock(writable_folder(cfg.output_dir)) as folder:
        check_not_foreign(cfg)
        yield folder


@contextmanager
def run_folder_lock(folder: Path) -> Iterator[Path]:
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
        yield folder
    finally:
        lock.release()
