"""A node's secure-aggregation ledger: each input is opened once.

A masked upload stays hidden until the node reveals its shares; once it has, the server can open a
sum that contains it. Two openings of the same input over two different participant sets give
one participant's statistics by difference (a stage re-run after a claimed crash, a "backfill" of a
stage already contributed, a failed stage asked for again, or the same view opened once with
everyone and once without the victim). So before a node reveals anything for a stage it writes
here, on its own disk, the set of survivors the sum is opened over; afterwards it contributes that
stage again only to a sum over the identical set, and refuses any other with one line naming the
stage.

Two keys per entry:

* **run**: (run id, task), or (run id, ``fedavg-round-<n>``) for a stage-1 FedAvg round under secure
  aggregation (:func:`train_ledger_key`: a string, never equal to a task's key), or (run id,
  ``forget-...``) for what a site removes in a secure forget round (:func:`forget_ledger_key`).
  Every run of a federation has its own entries; two runs never collide.
* **input** (signed-keys mode, where a malicious server is in scope): the SHA-256 of the statistics
  themselves. A server that claims a *new* run to ask for the same statistics over another set
  is refused too, whatever run id it names.

The file is per federation and node (``ledger-<hash>.json`` in the node config's
``secagg-ledger`` folder, else ``$FCL_SECAGG_LEDGER``, else ``$XDG_STATE_HOME/fcl-flower/secagg-ledger``),
written atomically (temporary file, fsync, rename) with mode 0600 in a 0700 folder, so it
survives a SuperNode restart. An unreadable ledger refuses: nothing is revealed until the operator
looks at it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from filelock import FileLock

from fcl_flower.privacy.secagg import SecureAggregationError

FORMAT = "fcl-flower-secagg-ledger/1"
LEDGER_KEY, FEDERATION_KEY = "secagg-ledger", "federation"  # node-config keys
ENV = "FCL_SECAGG_LEDGER"


def default_folder() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "fcl-flower" / "secagg-ledger"


def ledger_folder(node_config: Mapping[str, Any]) -> Path:
    """Where this node keeps its ledger: node config ``secagg-ledger``, else $FCL_SECAGG_LEDGER, else the
    user's state folder."""
    configured = node_config.get(LEDGER_KEY)
    if isinstance(configured, str) and configured:
        return Path(configured).expanduser()
    env = os.environ.get(ENV)
    return Path(env).expanduser() if env else default_folder()


def input_digest(*arrays: bytes) -> str:
    """The SHA-256 of one task's statistics as this node computed them (before masking)."""
    h = hashlib.sha256(b"fcl-flower/secagg-input")
    for part in arrays:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


Key = int | str  # an analytic stage (its task index) or a stage-1 FedAvg round (train_ledger_key)
TRAIN_PREFIX = "fedavg-round-"


def train_ledger_key(server_round: int) -> str:
    """The ledger key of a stage-1 FedAvg round under secure aggregation: a string, so it never
    equals an analytic stage's key (the task index, written as its digits)."""
    return f"{TRAIN_PREFIX}{int(server_round)}"


FORGET_PREFIX = "forget-"


def forget_ledger_key(request: str) -> str:
    """The ledger key of what a site removes in a secure forget round (docs/unlearning.md):
    ``forget-site`` for its whole contribution, ``forget-samples-<digest>`` for one sample request.
    A string, never equal to a stage's or a FedAvg round's key: the removal is opened over one set
    of survivors only, like any input."""
    return f"{FORGET_PREFIX}{request}"


def _label(key: Key) -> str:
    if isinstance(key, str) and key.startswith(FORGET_PREFIX):
        return f"the removal '{key.removeprefix(FORGET_PREFIX)}'"
    if isinstance(key, str):
        return f"stage-1 FedAvg round {key.removeprefix(TRAIN_PREFIX)}"
    return f"stage {key + 1}"


def _view_text(view: Iterable[Any]) -> list[int]:
    members = list(view)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in members):
        raise SecureAggregationError("the secure-aggregation ledger holds a damaged set: refusing to reveal")
    return sorted(members)


class Ledger:
    """The ledger file of one node of one federation."""

    def __init__(self, folder: Path, federation: str, node: int | str) -> None:
        key = hashlib.sha256(f"{federation}|{node}".encode()).hexdigest()[:24]
        self.folder = folder
        self.path = folder / f"ledger-{key}.json"

    # ------------------------------------------------------------------ reading
    def _read(self) -> dict[str, Any]:
        if not self.path.exists():
            return {"format": FORMAT, "runs": {}, "inputs": {}}
        if self.path.is_symlink() or not self.path.is_file():
            raise SecureAggregationError(
                f"secure-aggregation ledger {self.path} is not a regular file: refusing to reveal"
            )
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            ok = (
                isinstance(data, dict)
                and data.get("format") == FORMAT
                and isinstance(data.get("runs"), dict)
                and isinstance(data.get("inputs"), dict)
                and all(
                    isinstance(tasks, dict) and all(isinstance(v, list) for v in tasks.values())
                    for tasks in data["runs"].values()
                )
                and all(isinstance(v, list) for v in data["inputs"].values())
            )
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
            raise SecureAggregationError(
                f"secure-aggregation ledger {self.path} is unreadable ({type(err).__name__}): refusing to reveal"
            ) from None
        if not ok:
            raise SecureAggregationError(f"secure-aggregation ledger {self.path} is damaged: refusing to reveal")
        return data

    def contributed(self, run_id: str, task: Key) -> list[int] | None:
        """The set over which this node revealed its shares for ``task`` of ``run_id``, if it did."""
        view = self._read()["runs"].get(run_id, {}).get(str(task))
        return None if view is None else [int(n) for n in view]

    # ------------------------------------------------------------------ the rule
    @staticmethod
    def _conflicts(
        data: dict[str, Any], run_id: str, tasks: Iterable[Key], view: list[int], digests: Mapping[Key, str]
    ) -> str | None:
        runs = data["runs"].get(run_id, {})
        for task in tasks:
            earlier = runs.get(str(task))
            if earlier is not None and _view_text(earlier) != view:
                return (
                    f"{_label(task)} was already opened over nodes {_view_text(earlier)}; "
                    f"it is not contributed again over {view}: refused"
                )
        for task, digest in digests.items():
            earlier = data["inputs"].get(digest)
            if earlier is not None and _view_text(earlier) != view:
                what, were, they = (
                    ("upload", "was", "it is") if isinstance(task, str) else ("statistics", "were", "they are")
                )
                return (
                    f"the {what} of {_label(task)} {were} already opened over nodes {_view_text(earlier)} "
                    f"(in this or another run); {they} not contributed again over {view}: refused"
                )
        return None

    def check(
        self, run_id: str, tasks: Iterable[Key], view: Iterable[int], digests: Mapping[Key, str] | None = None
    ) -> None:
        """Raise SecureAggregationError (one line naming the stage) unless every task may be
        contributed over ``view``: never contributed in this run, or over this very set; and, for
        ``digests`` (signed-keys mode), the same statistics never opened over another set."""
        reason = self._conflicts(self._read(), run_id, list(tasks), _view_text(view), digests or {})
        if reason is not None:
            raise SecureAggregationError(reason)

    def record(
        self, run_id: str, tasks: Iterable[Key], view: Iterable[int], digests: Mapping[Key, str] | None = None
    ) -> None:
        """Check, then write (atomically, before anything is revealed) that ``tasks`` are opened over ``view``."""
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        with FileLock(str(self.path) + ".lock"):
            data = self._read()
            tasks, members = list(tasks), _view_text(view)
            reason = self._conflicts(data, run_id, tasks, members, digests or {})
            if reason is not None:
                raise SecureAggregationError(reason)
            runs = data["runs"].setdefault(run_id, {})
            for task in tasks:
                runs[str(task)] = members
            for digest in (digests or {}).values():
                data["inputs"][digest] = members
            self._write(data)

    def _write(self, data: dict[str, Any]) -> None:
        handle, temporary = tempfile.mkstemp(dir=self.folder, prefix=".ledger-", suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(data, out, sort_keys=True)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(temporary, 0o600)
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        directory = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
