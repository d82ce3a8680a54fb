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

Trust. The checkpoint is signed with this installation's key, kept outside the run folder
(fcl_flower/state_key.py): a checkpoint rewritten by anyone without the key is refused. Its fields
are type-checked on load (:meth:`CheckpointStore.load`: counts, rounds, the stage records) and the
strategy's state as strictly as a fresh upload (:meth:`~strategies.base.StagedStrategy.load_state_dict`
and ``check_restored``); every refusal is one line naming the file and the field. A run folder,
or its lock file, that is a symbolic link is refused: fcl-flower never writes through a link.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from fcl_flower import restore as fields
from fcl_flower.config import OPERATIONAL_KEYS, ConfigError, RunConfig
from fcl_flower.restore import RestoreError
from fcl_flower.results import StageRecord
from fcl_flower.state_io import StateError, load_state, save_state
from fcl_flower.state_key import KeyFileError, signing_key

NAME = "checkpoint"
LEGACY_FILE = "checkpoint.pt"  # pickled checkpoints of earlier versions: never loaded
LOCK_FILE = ".lock"
RESULTS_FILE = "results.json"


def resumable_config(cfg: RunConfig) -> dict[str, Any]:
    """The config keys that must match for a checkpoint to be resumed (the operational ones may differ)."""
    return cfg.result_config()


def differing_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Result knobs whose values differ (operational knobs never count). A knob that a folder of
    an earlier version does not record had its default there (knobs are added with the default
    that keeps the old behaviour), so it differs only where the current value is not that default."""
    defaults = RunConfig().to_mapping()
    keys = (set(saved) | set(current)) - OPERATIONAL_KEYS
    return sorted(k for k in keys if saved.get(k, defaults.get(k)) != current.get(k, defaults.get(k)))


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
        try:
            done = fields.integer(fields.entry(payload, "completed_tasks", ""), "completed_tasks", 1, cfg.num_tasks)
            fields.integer(fields.entry(payload, "server_round", ""), "server_round", 0)
            fields.mapping(fields.entry(payload, "state", ""), "state")
            stages = fields.entry(payload, "stages", "")
            pending = payload.get("pending_stage")  # the last stage, while its evaluation rides with the next
            scored = done - (pending is not None)
            if not isinstance(stages, list) or len(stages) != scored:
                raise RestoreError("stages", f"must be a list of the {scored} scored stages' records")
            payload["stages"] = [stage_record(s, f"stages/{i}", i + 1) for i, s in enumerate(stages)]
            if pending is not None:
                payload["pending_stage"] = stage_record(pending, "pending_stage", done)
        except RestoreError as err:
            raise self.refused(err) from None
        return payload

    def refused(self, err: RestoreError) -> ConfigError:
        """The one line for a checkpoint field that does not hold what the server wrote there."""
        return ConfigError(f"resume: {self.path}: {err}; delete it (and start without resume) or restore a backup")


def stage_record(value: Any, field: str, stage: int) -> StageRecord:
    """A stage record of a checkpoint, every field type-checked (``stage`` is its 1-based number)."""
    record = fields.mapping(value, field)
    names = {f.name for f in dataclasses.fields(StageRecord)}
    unknown = sorted(set(record) - names)
    if unknown:
        raise RestoreError(f"{field}/{unknown[0]}", "is not a field of a stage record")
    get = {name: fields.entry(record, name, field) for name in names}
    fields.integer(get["stage"], f"{field}/stage", stage, stage)
    fields.integers(get["classes"], f"{field}/classes", 0)
    percent(get["accuracy"], f"{field}/accuracy")
    if not isinstance(get["per_task_accuracy"], list) or len(get["per_task_accuracy"]) != stage:
        raise RestoreError(f"{field}/per_task_accuracy", f"must list {stage} accuracies")
    for i, value_ in enumerate(get["per_task_accuracy"]):
        percent(value_, f"{field}/per_task_accuracy/{i}")
    fields.number(get["seconds"], f"{field}/seconds", 0.0)
    fields.integer(get["rounds"], f"{field}/rounds", 0)
    for name in ("upload_bytes_per_client", "upload_message_bytes_per_client"):
        for client, nbytes in fields.mapping(get[name], f"{field}/{name}").items():
            fields.integer(nbytes, f"{field}/{name}/{client}", 0)
    fields.strings(get["clients"], f"{field}/clients")
    for client, why in fields.mapping(get["left_out"], f"{field}/left_out").items():
        if not isinstance(why, str):
            raise RestoreError(f"{field}/left_out/{client}", "must be a string")
    fields.mapping(get["extra"], f"{field}/extra")
    return StageRecord(**get)


def percent(value: Any, field: str) -> None:
    """An accuracy in percent: within [0, 100], or NaN (a stage with nothing to score)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RestoreError(field, f"must be a number, not {fields.kind(value)}")
    if not math.isnan(value) and not 0.0 <= value <= 100.0:
        raise RestoreError(field, f"is {value!r}, outside [0, 100]")


def writable_folder(folder: Path) -> Path:
    """Make ``folder`` (and its parents) and prove it writable; ConfigError (one line) if not."""
    folder = Path(folder)
    refuse_link(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ConfigError(f"cannot write the run folder {folder}: {reason}; choose another out") from None
    return folder


def refuse_link(folder: Path) -> None:
    """A run folder that is a symbolic link is refused (never written through); one line."""
    if folder.is_symlink():
        raise ConfigError(
            f"the run folder {folder} is a symbolic link (to {os.readlink(folder)}); fcl-flower does not write "
            "through links: give the real folder as out, or choose another run-name"
        )


def check_key() -> None:
    """The installation's checkpoint key can be read (or made) before the run starts; ConfigError if not."""
    try:
        signing_key()
    except KeyFileError as err:
        raise ConfigError(str(err)) from None


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
        check_key()
        check_not_foreign(cfg)
        if cfg.resume:
            CheckpointStore(cfg.output_dir).load(cfg)


@contextmanager
def open_run_folder(cfg: RunConfig) -> Iterator[Path]:
    """The run folder, writable, locked for this run and not another configuration's."""
    with run_folder_lock(writable_folder(cfg.output_dir)) as folder:
        check_key()
        check_not_foreign(cfg)
        yield folder


@contextmanager
def run_folder_lock(folder: Path) -> Iterator[Path]:
    """Hold the run folder's lock for the duration; ConfigError at once if another server holds it."""
    folder = Path(folder)
    refuse_link(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    if path.is_symlink():
        raise ConfigError(
            f"the lock file {path} is a symbolic link (to {os.readlink(path)}); fcl-flower does not write "
            "through links: remove it if no server is running in the folder"
        )
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ConfigError(
            f"another server is running in {folder} (it holds {path}); wait for it, or choose another out/run-name"
        ) from None
    except OSError as err:
        raise ConfigError(f"cannot lock the run folder with {path}: {err.strerror or type(err).__name__}") from None
    try:
        yield folder
    finally:
        lock.release()
