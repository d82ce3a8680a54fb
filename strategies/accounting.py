"""Cost and participation accounting of one stage: bytes per client, who contributed, who is missing.

The stage loop resets it at the start of every stage; every accepted reply adds its bytes, every
rejected one its reason; :meth:`StageAccounting.left_out` then says, for every client some round
of the stage was sent to, why its data is not in the stage.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: the server's own work on a stage's replies (:meth:`StageAccounting.timed`): ``accept`` is the
#: whole of reading one reply (protocol header, ``parse`` of the arrays, ``check`` of the upload;
#: those two are parts of it, as far as the method times them), ``bytes`` counting its size,
#: ``add`` folding it into the running sums (a round that is not streamed: aggregating the kept
#: replies together), ``finish`` closing a streamed round's sums (once per round)
REPLY_STEPS = ("accept", "parse", "check", "bytes", "add", "finish")
#: stage extras that are wall-clock times (like a stage's ``seconds``: they differ between runs)
TIMING_EXTRAS = ("server_reply_seconds", "solve_seconds", "certificate_seconds", "sum_certificate_seconds")


def client_name(client: int) -> str:
    return f"client-{client}"


def client_order(name: str) -> tuple[int, str]:
    """``client-2`` before ``client-10``; other names (``node-*``) after."""
    head, _, tail = name.partition("-")
    return (int(tail), "") if head == "client" and tail.isdigit() else (1 << 30, name)


class StageAccounting:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.upload: dict[str, int] = {}  # numeric payload per client (all rounds of the stage)
        self.message: dict[str, int] = {}  # whole serialised replies per client
        self.clients: set[str] = set()  # clients with an accepted reply in the stage
        self.rejected: dict[str, str] = {}  # client (or node-<id>) -> why its reply was rejected
        self.duplicates: dict[str, str] = {}  # node-<id> -> the reply it sent twice (dropped)
        self.expected: set[str] = set()  # clients some round of the stage was sent to
        self.sampling: dict[int, dict[str, Any]] = {}  # server round -> sampled / contributed clients
        self.seconds: dict[str, float] = {}  # step (REPLY_STEPS) -> seconds summed over the stage
        self.replies = 0  # replies the server read in the stage (accepted or not)

    @contextmanager
    def timed(self, step: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to ``step``'s sum (also when it raises)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.perf_counter() - began

    def expect(self, clients: set[str]) -> None:
        self.expected |= clients

    def accept(self, client: str, payload_bytes: int, message_bytes: int) -> None:
        self.upload[client] = self.upload.get(client, 0) + payload_bytes
        self.message[client] = self.message.get(client, 0) + message_bytes

    def contributed(self, server_round: int, clients: list[str]) -> None:
        self.clients.update(clients)
        if server_round in self.sampling:
            self.sampling[server_round]["contributed"] = sorted(clients, key=client_order)

    def sampled(self, server_round: int, clients: list[str]) -> None:
        self.sampling.setdefault(server_round, {"round": server_round, "sampled": clients, "contributed": []})

    def reject(self, client: str, why: str) -> None:
        self.rejected[client] = why

    def retract(self, client: str, why: str) -> None:
        """An accepted reply is left out after all (its upload made the round's sum fail its
        certificate): no longer a contributor, rejected with ``why``."""
        self.clients.discard(client)
        for record in self.sampling.values():
            if client in record["contributed"]:
                record["contributed"] = [c for c in record["contributed"] if c != client]
        self.rejected[client] = why

    def duplicate(self, node: str, why: str) -> None:
        """A second reply of ``node`` in one round: dropped (its first counts), named in ``left_out``."""
        self.duplicates[node] = why

    def left_out(self, num_clients: int, rounds: int) -> dict[str, str]:
        """Client -> why its data is missing from the stage (a stage without rounds misses nobody)."""
        left_out = {c: why for c, why in self.rejected.items() if c not in self.clients}
        unattributed = any(c.startswith("node-") for c in left_out)  # rejected before we knew who
        if rounds:
            for i in range(num_clients):
                client = client_name(i)
                if client in self.expected and client not in self.clients and client not in left_out:
                    left_out[client] = (
                        "no reply within round-timeout"
                        if not unattributed
                        else "no accepted reply (timed out, or one of the rejected node-* uploads)"
                    )
        return {**left_out, **{n: why for n, why in self.duplicates.items() if n not in left_out}}

    def timing_extra(self) -> dict[str, Any]:
        """``extra.server_reply_seconds``: the server's work on the stage's replies, summed per step,
        with ``handling`` (accept + bytes + add: what one reply costs the server, summed) and
        ``replies``; empty for a stage without replies."""
        if not self.replies:
            return {}
        steps = {step: self.seconds.get(step, 0.0) for step in REPLY_STEPS}
        handling = steps["accept"] + steps["bytes"] + steps["add"]
        return {"server_reply_seconds": {**steps, "handling": handling, "replies": self.replies}}

    def sampling_extra(self) -> dict[str, Any]:
        return {"sampling": [self.sampling[r] for r in sorted(self.sampling)]} if self.sampling else {}
