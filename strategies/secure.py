"""Secure statistics rounds as a component: a key round, then a masked round re-run on dropouts.

With ``secure-aggregation`` the statistics round of a stage becomes two exchanges:

1. :class:`~fcl_flower.protocol.KeysIns`: every node makes a fresh X25519 key pair, keeps the
   private half in its Flower ``context.state`` and answers with the public half (32 bytes).
2. :class:`~fcl_flower.protocol.StatsIns` to the nodes that answered, with the participants'
   public keys (:attr:`StatsIns.secagg`) and the attempt number in the header: each client
   uploads its statistics masked (fcl_flower/privacy/secagg.py). Every reply is screened
   *before* aggregation; if any participant failed, timed out or sent a bad upload, the masked
   sum cannot be opened, so the round is sent again to the survivors (fresh masks, because the
   attempt and the participant set are bound into them) -- or, with ``require-all-clients``,
   again to everybody after a new key round. Nothing from an incomplete attempt is unmasked.

The component knows nothing of the method: the strategy (:class:`SecureHost`) builds the
messages and screens the replies; which arrays are masked and how the sum is read is the
method's business (strategies/stsa.py).
"""

from __future__ import annotations

import dataclasses
from logging import WARNING
from typing import Any, Protocol

from flwr.app import Message
from flwr.common.logger import log
from flwr.serverapp import Grid

from fcl_flower.config import RunConfig
from fcl_flower.methods import Kind
from fcl_flower.privacy.secagg import KEY_BYTES
from fcl_flower.protocol import Header, Instruction, KeysIns, ProtocolError, SecAggRound, StatsIns, parse_reply
from strategies.accounting import StageAccounting, client_name

KEYS_PHASE = "secagg-keys"


class SecureHost(Protocol):
    """What the secure rounds need from the strategy that runs them."""

    cfg: RunConfig
    run_id: str
    server_round: int
    accounting: StageAccounting

    def header(self, plan: Any, attempt: int) -> Header: ...

    def instruction(self, plan: Any, header: Header) -> Instruction: ...

    def messages(
        self,
        grid: Grid,
        plan: Any,
        attempt: int,
        exclude: set[int],
        instruction: Instruction | None = None,
        only: set[int] | None = None,
    ) -> list[Message]: ...

    def accept(self, plan: Any, message: Message, taken: set[str]) -> Any: ...

    def reject(self, message: Message, err: Any, server_round: int) -> None: ...

    def missing_clients(self, replies: list[Message]) -> set[str]: ...

    def client_id(self, reply: Any) -> int: ...


class SecureRounds:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.current: SecAggRound | None = None  # the attempt whose masked replies are being read

    def run(self, host: SecureHost, grid: Grid, plan: Any, timeout: float) -> list[Message]:
        """All replies of the first complete attempt (every participant's upload passed the checks)."""
        server_round = host.server_round
        peers: dict[int, bytes] = {}
        self.current = None
        for attempt in range(self.cfg.round_retries + 1):
            if attempt == 0 or self.cfg.require_all_clients:
                self.current = None
                peers = self._collect_keys(host, grid, plan, attempt, timeout)
            if len(peers) < self.cfg.secagg_min_clients:
                raise RuntimeError(
                    f"round {server_round}: secure aggregation needs at least {self.cfg.secagg_min_clients} "
                    f"participants, {len(peers)} left"
                )
            self.current = SecAggRound(dict(peers))
            ins = host.instruction(plan, host.header(plan, attempt))
            assert isinstance(ins, StatsIns)
            ins = dataclasses.replace(ins, secagg=self.current)
            messages = host.messages(grid, plan, attempt, set(), instruction=ins, only=set(peers))
            replies = list(grid.send_and_receive(messages, timeout=timeout))
            good = self._screen(host, plan, server_round, replies)
            dropped = sorted(set(peers) - set(good))
            missing = host.missing_clients(list(good.values())) if self.cfg.require_all_clients else set()
            if not dropped and not missing:
                return list(good.values())
            log(
                WARNING,
                "round %d: secure attempt %d cannot be opened (no valid upload from node(s) %s); %s",
                server_round,
                attempt + 1,
                ", ".join(map(str, dropped)) or "-",
                "asking every client again"
                if self.cfg.require_all_clients
                else f"re-running with the {len(good)} survivors",
            )
            peers = {node: key for node, key in peers.items() if node in good}
        raise RuntimeError(
            f"round {server_round}: no complete secure attempt after {self.cfg.round_retries + 1} attempts"
        )

    def _collect_keys(self, host: SecureHost, grid: Grid, plan: Any, attempt: int, timeout: float) -> dict[int, bytes]:
        """One fresh public key per answering node; malformed or duplicate answers are dropped."""
        header = dataclasses.replace(host.header(plan, attempt), phase=KEYS_PHASE)
        requests = host.messages(grid, plan, attempt, set(), instruction=KeysIns(header, self.cfg))
        peers: dict[int, bytes] = {}
        clients: set[str] = set()
        for message in grid.send_and_receive(requests, timeout=timeout):
            node = message.metadata.src_node_id
            try:
                reply = parse_reply(message, header, Kind.KEYS)
                client = client_name(host.client_id(reply))
                key = getattr(reply, "public_key", b"")
                if len(key) != KEY_BYTES:
                    raise ProtocolError(f"no {KEY_BYTES}-byte public key in the reply")
                if client in clients:
                    raise ProtocolError(f"duplicate key: {client} already answered")
            except ProtocolError as err:
                log(WARNING, "Rejected key from node %d in round %d: %s", node, host.server_round, err)
                host.accounting.reject(f"node-{node}", f"secure key round: {err}")
                continue
            clients.add(client)
            peers[node] = key
        return peers

    def _screen(self, host: SecureHost, plan: Any, server_round: int, replies: list[Message]) -> dict[int, Message]:
        """The replies that would be accepted, by node: the masked sum needs all of them."""
        good: dict[int, Message] = {}
        clients: set[str] = set()
        for message in replies:
            try:
                item = host.accept(plan, message, clients)
            except ProtocolError as err:
                host.reject(message, err, server_round)
                continue
            clients.add(item.client)
            good[message.metadata.src_node_id] = message
        return good
