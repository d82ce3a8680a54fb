"""Backfill as a component: clients that missed a statistics round send those statistics later.

A client whose statistics of task s did not arrive (node down, timed out, upload rejected) is
recorded in ``missing`` and asked for them in every later statistics round
(:attr:`fcl_flower.protocol.StatsIns.backfill`). Its late statistics are checked against task
s's shapes and handed to the method to fold in; once every late upload is in, the classifier
equals the fault-free run's. Stage extras record who still owes which stage
(``statistics_missing``) and whose late statistics arrived (``backfilled``); ``missing`` is part
of the checkpoint.

Under secure aggregation late statistics ride inside the regular masked upload instead
(strategies/stsa.py); :meth:`Backfill.strike` records them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any, Generic, TypeVar

from flwr.app import ArrayRecord
from flwr.common.logger import log

from fcl_flower import restore as fields
from fcl_flower.protocol import StatsRes, UploadError
from fcl_flower.restore import RestoreError
from strategies.accounting import client_name
from strategies.base import Accepted

P = TypeVar("P")
Late = dict[int, tuple[P, int]]  # task -> (payload, number of examples)


class Backfill(Generic[P]):
    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.withdrawn: set[str] = set()  # forgotten wholly: never owes a stage
        self.missing: dict[str, list[int]] = {}  # client -> tasks whose statistics are not in yet
        self.arrived: dict[str, list[int]] = {}  # late statistics that arrived in this stage

    def request(self) -> dict[int, tuple[int, ...]]:
        """What a statistics round asks for: client id -> tasks it owes."""
        return {int(c.rsplit("-", 1)[1]): tuple(tasks) for c, tasks in self.missing.items() if tasks}

    def read(self, client: str, reply: StatsRes, read: Callable[[int, ArrayRecord], P]) -> Late[P]:
        """The late statistics in ``reply``, each read like an on-time upload of its task.

        Only tasks this client owes are accepted: anything else would count its data twice, so
        the whole reply is rejected (its on-time statistics included).
        """
        owed = self.missing.get(client, [])
        late: Late[P] = {}
        for task, upload in reply.backfill.items():
            name = f"backfill-{task}"
            if task not in owed:
                raise UploadError(f"record '{name}' was not asked for ({client} owes stages {[t + 1 for t in owed]})")
            try:
                late[task] = (read(task, upload.arrays), upload.num_examples)
            except UploadError as err:
                raise UploadError(f"record '{name}': {err}") from None
        return late

    def fold(
        self,
        accepted: Iterable[Accepted[Any]],
        late_of: Callable[[Accepted[Any]], Late[P]],
        add: Callable[[int, list[Accepted[P]]], None],
        release: Callable[[int], None],
    ) -> None:
        """Add the late statistics carried by this round's replies (``add(task, replies)``), strike
        them off, and ``release(task)`` once nobody owes ``task`` any more."""
        by_task: dict[int, list[Accepted[P]]] = {}
        for reply in accepted:
            for task, (payload, count) in late_of(reply).items():
                by_task.setdefault(task, []).append(Accepted(reply.client, count, payload))
        for task, replies in sorted(by_task.items()):
            add(task, replies)
            for reply in replies:
                self.strike(reply.client, task)
            if not any(task in owed for owed in self.missing.values()):
                release(task)

    def strike(self, client: str, task: int) -> None:
        """``client``'s statistics of ``task`` are in."""
        if task not in self.missing.get(client, []):
            return
        self.missing[client].remove(task)
        if not self.missing[client]:
            del self.missing[client]
        self.arrived.setdefault(client, []).append(task)
        log(INFO, "%s backfilled its statistics of stage %d", client, task + 1)

    def withdraw(self, client: str) -> None:
        """``client`` was forgotten wholly (docs/unlearning.md): it owes nothing, now or later."""
        self.withdrawn.add(client)
        self.missing.pop(client, None)

    def note_missing(self, task: int, answered: set[str]) -> list[str]:
        """Every client without an accepted upload in the task's statistics round owes ``task``
        (a withdrawn one owes nothing)."""
        absent = [
            client_name(i)
            for i in range(self.num_clients)
            if client_name(i) not in answered and client_name(i) not in self.withdrawn
        ]
        for client in absent:
            self.missing.setdefault(client, []).append(task)
        return absent

    def extras(self) -> dict[str, Any]:
        """Stage extras: whose late statistics arrived in this stage, and who still owes what."""
        extra: dict[str, Any] = {}
        if self.arrived:
            extra["backfilled"] = {c: [t + 1 for t in sorted(ts)] for c, ts in sorted(self.arrived.items())}
            self.arrived = {}
        if self.missing:
            extra["statistics_missing"] = {c: [t + 1 for t in ts] for c, ts in sorted(self.missing.items())}
        return extra

    def state_dict(self) -> dict[str, list[int]]:
        return {c: list(tasks) for c, tasks in self.missing.items()}

    def load_state_dict(self, missing: dict[str, list[int]], field: str = "state/missing") -> None:
        """Who owes which stages, from a checkpoint: clients of this run, stage numbers >= 0
        (RestoreError naming the field otherwise)."""
        names = {client_name(i) for i in range(self.num_clients)}
        restored: dict[str, list[int]] = {}
        for client, tasks in fields.mapping(missing, field).items():
            if client not in names:
                raise RestoreError(f"{field}/{client}", "is not a client of this run")
            restored[client] = fields.integers(tasks, f"{field}/{client}", 0)
        self.missing = restored

    def check_restored(self, completed: int, field: str = "state/missing") -> None:
        """Only stages already run can be owed."""
        for client, tasks in self.missing.items():
            late = [t for t in tasks if t >= completed]
            if late:
                raise RestoreError(
                    f"{field}/{client}", f"owes stage {late[0] + 1}, which has not run ({completed} have)"
                )
