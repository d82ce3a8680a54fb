"""Secure statistics rounds as a component: keys, shares, masked upload, unmasking -- one attempt.

With ``secure-aggregation`` the statistics round of a stage is four exchanges
(fcl_flower/privacy/secagg.py has the math, fcl_flower/protocol/secure.py the messages):

1. ``query.keys``: every node makes two fresh key pairs and answers with the public halves
   (signed with its SuperNode key in signed-keys mode). U1: the nodes that answered.
2. ``query.shares``: U1's keys to every node of U1; each answers with Shamir shares of its
   self-mask seed and mask key, one encrypted bundle per participant. U2: the nodes that did.
3. ``query.stats`` to U2, each node with the bundles addressed to it: every client uploads its
   statistics masked. Every reply is screened (parsed, identified, shapes checked); U3: the
   ones that passed. A reply that fails is treated like a dropout.
4. ``query.unmask`` to U3: survivors reveal their shares of U3's self-mask seeds and of the
   mask keys of U2 \\ U3. With ≥ t shares the server rebuilds them and opens Σ_{U3} x_k (the
   method does, from :attr:`SecureRounds.opening`).

Dropouts and rejected uploads are recovered inside the attempt: there is never a second attempt
over the same inputs, and nothing is opened unless at least ``threshold`` (a majority, and at
least ``secagg-min-clients``) survive. A round that cannot be opened fails the stage cleanly
(:class:`~strategies.base.StageFailed`): the previous classifier is kept.

The component knows nothing of the method: the strategy (:class:`SecureHost`) builds the
instructions, identifies nodes and screens replies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging import WARNING
from typing import Any, Protocol

from flwr.app import Message
from flwr.common.logger import log
from flwr.serverapp import Grid

from fcl_flower.config import RunConfig
from fcl_flower.methods import Kind
from fcl_flower.privacy.secagg import KEY_BYTES, SecureAggregationError, reconstruct, round_context, threshold_for
from fcl_flower.protocol import (
    Header,
    Instruction,
    KeysIns,
    KeysRes,
    ProtocolError,
    PublicKeys,
    Reply,
    SecAggRound,
    SharesIns,
    SharesRes,
    StatsIns,
    UnmaskIns,
    UnmaskRes,
    message_bytes,
    parse_reply,
)
from strategies.accounting import StageAccounting
from strategies.base import StageFailed
from strategies.nodes import NodeDirectory

KEYS_PHASE, SHARES_PHASE, UNMASK_PHASE = "secagg-keys", "secagg-shares", "secagg-unmask"


class SecureHost(Protocol):
    """What the secure rounds need from the strategy that runs them."""

    cfg: RunConfig
    server_round: int
    accounting: StageAccounting
    nodes: NodeDirectory

    def header(self, plan: Any, attempt: int) -> Header: ...

    def instruction(self, plan: Any, header: Header) -> Instruction: ...

    def messages(
        self,
        grid: Grid,
        plan: Any,
        attempt: int,
        exclude: set[int],
        build: Callable[[int], Instruction] | None = None,
        only: set[int] | None = None,
        side: bool = False,
    ) -> list[Message]: ...

    def accept(self, plan: Any, message: Message, taken: set[str]) -> Any: ...

    def reject(self, message: Message, err: Any, server_round: int) -> None: ...

    def identify(self, node: int, reply: Reply) -> str: ...


@dataclass(frozen=True)
class Opening:
    """What opening the masked sum of one round needs (fcl_flower.privacy.secagg.unmask_sum)."""

    seeds: Mapping[int, bytes]  # survivor node -> its rebuilt self-mask seed
    dropped_keys: Mapping[int, bytes]  # dropped or rejected node -> its rebuilt mask key
    s_publics: Mapping[int, bytes]  # every U2 node's mask public key
    context: bytes


class SecureRounds:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.current: SecAggRound | None = None  # the round whose masked replies are being read
        self.opening: Opening | None = None

    def run(self, host: SecureHost, grid: Grid, plan: Any, timeout: float) -> list[Message]:
        """The screened masked replies of the survivors; :attr:`opening` opens their sum."""
        self.current, self.opening = None, None
        header = host.header(plan, 0)
        keys = self._collect_keys(host, grid, plan, header, timeout)
        if len(keys) < self.cfg.secagg_min_clients:
            raise StageFailed(
                f"secure aggregation needs at least {self.cfg.secagg_min_clients} participants, {len(keys)} sent keys"
            )
        threshold = threshold_for(len(keys), self.cfg.secagg_min_clients)
        clients = {node: host.nodes.client_of[node] for node in keys}  # identified in the key round
        bundles = self._collect_shares(host, grid, plan, header, keys, clients, threshold, timeout)
        if len(bundles) < threshold:
            raise StageFailed(f"{len(bundles)} node(s) shared their secrets, the threshold is {threshold}")
        context = round_context(header.run_id, header.task, header.stage, header.server_round, header.attempt, keys)
        participants = {node: keys[node] for node in bundles}
        self.current = SecAggRound(tuple(sorted(keys)), participants, {n: clients[n] for n in bundles}, threshold)
        stats_ins = host.instruction(plan, header)
        assert isinstance(stats_ins, StatsIns)

        def build(node: int) -> Instruction:
            assert self.current is not None
            shares = {src: bundles[src][node] for src in bundles}
            return dataclasses.replace(stats_ins, secagg=dataclasses.replace(self.current, shares=shares))

        replies = list(
            grid.send_and_receive(host.messages(grid, plan, 0, set(), build=build, only=set(bundles)), timeout=timeout)
        )
        good = self._screen(host, plan, replies)
        if len(good) < threshold:
            raise StageFailed(f"{len(good)} valid masked upload(s), the threshold is {threshold}: nothing is opened")
        dropped = sorted(set(bundles) - set(good))
        if self.cfg.require_all_clients:
            expected = {f"client-{c}" for c in range(self.cfg.num_clients)}
            missing = expected - {f"client-{clients[n]}" for n in good}
            if missing:  # never re-run over the same inputs: stop before anything is opened
                raise StageFailed(f"no valid masked upload from {', '.join(sorted(missing))}")
        if dropped:
            log(
                WARNING,
                "round %d: node(s) %s dropped or were rejected; their masks are removed in this "
                "attempt, their statistics stay hidden",
                host.server_round,
                ", ".join(map(str, dropped)),
            )
        seeds, dropped_keys = self._unmask(host, grid, plan, header, sorted(good), dropped, threshold, timeout)
        self.opening = Opening(seeds, dropped_keys, {n: k.s for n, k in participants.items()}, context)
        return list(good.values())

    # ---------------------------------------------------------------- the steps
    def _exchange(
        self,
        host: SecureHost,
        grid: Grid,
        plan: Any,
        build: Callable[[int], Instruction],
        only: set[int] | None,
        timeout: float,
        kind: Kind,
        header: Header,
    ) -> dict[int, Reply]:
        """Send one step, parse and identify every reply; bad ones are logged and left out."""
        answers: dict[int, Reply] = {}
        for message in grid.send_and_receive(
            host.messages(grid, plan, 0, set(), build=build, only=only, side=True), timeout=timeout
        ):
            node = message.metadata.src_node_id
            try:
                reply = parse_reply(message, header, kind)
                client = host.identify(node, reply)
            except ProtocolError as err:
                log(WARNING, "Rejected %s from node %d in round %d: %s", header.phase, node, host.server_round, err)
                host.accounting.reject(self._name(host, node), f"{header.phase}: {err}")
                continue
            host.accounting.accept(client, 0, message_bytes(message.content))
            answers[node] = reply
        return answers

    @staticmethod
    def _name(host: SecureHost, node: int) -> str:
        client = host.nodes.client_of.get(node)
        return f"node-{node}" if client is None else f"client-{client}"

    def _collect_keys(
        self, host: SecureHost, grid: Grid, plan: Any, header: Header, timeout: float
    ) -> dict[int, PublicKeys]:
        keys_header = dataclasses.replace(header, phase=KEYS_PHASE)
        instruction = KeysIns(keys_header, self.cfg)
        answers = self._exchange(host, grid, plan, lambda node: instruction, None, timeout, Kind.KEYS, keys_header)
        keys: dict[int, PublicKeys] = {}
        for node, reply in answers.items():
            assert isinstance(reply, KeysRes)
            if len(reply.keys.c) != KEY_BYTES or len(reply.keys.s) != KEY_BYTES:
                log(WARNING, "node %d sent keys that are not %d-byte X25519 keys; it is left out", node, KEY_BYTES)
                host.accounting.reject(self._name(host, node), f"secure key round: no {KEY_BYTES}-byte public keys")
                continue
            keys[node] = reply.keys
        return keys

    def _collect_shares(
        self,
        host: SecureHost,
        grid: Grid,
        plan: Any,
        header: Header,
        keys: dict[int, PublicKeys],
        clients: dict[int, int],
        threshold: int,
        timeout: float,
    ) -> dict[int, Mapping[int, bytes]]:
        shares_header = dataclasses.replace(header, phase=SHARES_PHASE)
        instruction = SharesIns(shares_header, self.cfg, keys=keys, clients=clients, threshold=threshold)
        answers = self._exchange(
            host, grid, plan, lambda node: instruction, set(keys), timeout, Kind.SHARES, shares_header
        )
        bundles = {}
        for node, reply in answers.items():
            assert isinstance(reply, SharesRes)
            if set(reply.shares) != set(keys):
                host.accounting.reject(self._name(host, node), "secure shares round: not one share per participant")
                continue
            bundles[node] = reply.shares
        return bundles

    def _screen(self, host: SecureHost, plan: Any, replies: list[Message]) -> dict[int, Message]:
        """The masked replies that would be accepted, by node."""
        good: dict[int, Message] = {}
        clients: set[str] = set()
        for message in replies:
            try:
                item = host.accept(plan, message, clients)
            except ProtocolError as err:
                host.reject(message, err, host.server_round)
                continue
            clients.add(item.client)
            good[message.metadata.src_node_id] = message
        return good

    def _unmask(
        self,
        host: SecureHost,
        grid: Grid,
        plan: Any,
        header: Header,
        survivors: list[int],
        dropped: list[int],
        threshold: int,
        timeout: float,
    ) -> tuple[dict[int, bytes], dict[int, bytes]]:
        unmask_header = dataclasses.replace(header, phase=UNMASK_PHASE)
        instruction = UnmaskIns(unmask_header, self.cfg, survivors=tuple(survivors), dropped=tuple(dropped))
        answers = self._exchange(
            host, grid, plan, lambda node: instruction, set(survivors), timeout, Kind.UNMASK, unmask_header
        )
        seed_shares: dict[int, list[bytes]] = {node: [] for node in survivors}
        key_shares: dict[int, list[bytes]] = {node: [] for node in dropped}
        for node, reply in answers.items():
            assert isinstance(reply, UnmaskRes)
            if set(reply.seed_shares) != set(survivors) or set(reply.key_shares) != set(dropped):
                host.accounting.reject(self._name(host, node), "secure unmask round: not the shares asked for")
                continue
            for target, share in reply.seed_shares.items():
                seed_shares[target].append(share)
            for target, share in reply.key_shares.items():
                key_shares[target].append(share)
        try:
            seeds = {node: reconstruct(shares, threshold) for node, shares in seed_shares.items()}
            keys = {node: reconstruct(shares, threshold) for node, shares in key_shares.items()}
        except SecureAggregationError as err:
            raise StageFailed(f"the secure sum cannot be opened: {err}") from None
        return seeds, keys
