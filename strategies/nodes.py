"""Which SuperNodes are there, which client each serves, and which nodes a round goes to.

* Waiting: the first round waits up to ``round-timeout`` for ``num-clients`` SuperNodes (they are
  still connecting); later rounds wait at most :data:`RECONNECT_GRACE_S` for a node that went
  away, then go on without it (its missing statistics are backfilled when it comes back).
* Identity: a reply's client is the Flower node that sent it (the message metadata; with
  SuperNode authentication, a node id is bound to a registered key). A node is mapped to the
  client it claims once, at first contact -- the round itself where it goes to every node
  anyway and at most ``strategies.stream.WINDOW`` (4) nodes are connected (plain uploads, no
  sampling, no excluded site, no ``require-all-clients``: all of
  its replies are read and the claims settled before any is used,
  :meth:`~strategies.base.StagedStrategy.settle_first_contact`) or a secure round's key step
  that goes to every node (its small replies settled the same way), else a tiny ``query.info``
  message to every node the server has not heard from, before the round -- and the map is one-to-one
  and checkpointed (a resumed run keeps it while any of its nodes is still connected, and warns
  when none is; the simulation engine gives its nodes new ids every run, so there it starts
  afresh without a warning). A node claiming a second client, or a client already served by another
  node, is rejected (however many new nodes claim it at once: two cannot take a served client
  out); two unknown nodes claiming the same unserved client at the same first contact leave
  that client *contested*: neither node is mapped, both are named, and the client is left out
  (so an impostor that answers first cannot take over a client, it can only get it excluded).
* Sampling: train rounds with ``clients-per-round > 0`` go only to the nodes of a seeded sample
  of the clients joined by the task (LGA: 10 per round); every other round goes to every mapped
  node.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common.logger import log
from flwr.serverapp import Grid

from fcl_flower import interrupt
from fcl_flower import restore as fields
from fcl_flower.config import RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.data.paper_partitions import sample_clients
from fcl_flower.methods import Kind
from fcl_flower.protocol import UploadError
from fcl_flower.restore import RestoreError
from strategies.accounting import client_name

RECONNECT_GRACE_S = 30.0  # after the first round: how long to wait for a node that went away


def simulated(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's simulation engine (``run_simulation`` and ``flwr run`` on a
    simulation federation), whose nodes get new random ids on every run, resumed runs included."""
    from flwr.superlink.grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


@dataclass(frozen=True)
class Targets:
    """The nodes a round is sent to and the clients expected to answer it."""

    nodes: list[int]
    expected: set[str]
    sampled: list[str] | None = None  # the seeded sample, when the round samples clients


class NodeDirectory:
    def __init__(
        self,
        cfg: RunConfig,
        split: FederationLayout,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.cfg = cfg
        self.split = split
        self.clock = clock
        self.sleep = sleep
        self.client_of: dict[int, int] = {}  # node id -> client (partition), one-to-one
        self.contested: dict[int, list[int]] = {}  # client -> the nodes that claimed it at once
        self._restored = False  # the map came from a checkpoint and has not met the federation yet
        self._waited = False
        self.withdrawn: set[int] = set()  # sites forgotten wholly (docs/unlearning.md): no later round
        self._stage1_excluded = cfg.stage1_excluded()

    # ---------------------------------------------------------------- identity
    def node_of(self, client: int) -> int | None:
        for node, mapped in self.client_of.items():
            if mapped == client:
                return node
        return None

    def claim(self, node: int, client: int) -> None:
        """Accept ``node``'s claim to serve ``client``, or raise UploadError naming both sides."""
        if client in self.contested:
            raise UploadError(f"client-{client} is contested by nodes {', '.join(map(str, self.contested[client]))}")
        mapped = self.client_of.get(node)
        if mapped is not None and mapped != client:
            raise UploadError(f"node {node} serves client-{mapped} and now claims client-{client}: rejected")
        holder = self.node_of(client)
        if holder is not None and holder != node:
            raise UploadError(f"client-{client} is served by node {holder}; node {node} claims it too: rejected")
        if mapped is None:
            self.client_of[node] = client

    def first_contact(self, claims: dict[int, int]) -> None:
        """Map the nodes of one discovery (node -> claimed client); clients claimed twice are
        contested, unless another node already serves them: then every new claim is rejected (two
        new nodes cannot take a served client out of the run by both claiming it)."""
        by_client: dict[int, list[int]] = {}
        for node, client in claims.items():
            by_client.setdefault(client, []).append(node)
        for client, nodes in sorted(by_client.items()):
            holder = self.node_of(client)  # (the nodes claiming here are all unmapped)
            if holder is not None:
                for node in nodes:
                    log(WARNING, "node %d: client-%d is served by node %d: rejected", node, client, holder)
                continue
            if len(nodes) > 1:
                self.contested[client] = sorted(nodes)
                log(
                    WARNING,
                    "client-%d is claimed by nodes %s at once: neither is mapped, the client is left out",
                    client,
                    ", ".join(map(str, sorted(nodes))),
                )
                continue
            try:
                self.claim(nodes[0], client)
            except UploadError as err:
                log(WARNING, "node %d: %s", nodes[0], err)

    def state_dict(self) -> dict[str, Any]:
        return {
            "client_of": {str(n): c for n, c in self.client_of.items()},
            "contested": {str(c): nodes for c, nodes in self.contested.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The node -> client map of a checkpoint: node ids (64-bit) to distinct clients of this
        run, contested clients to node lists; RestoreError naming the field otherwise. (Which node
        serves which client cannot be told from the file: the checkpoint's signature covers it.)"""
        where = "state/nodes"
        tree = fields.mapping(state, where)
        client_of: dict[int, int] = {}
        for node, client in fields.mapping(tree.get("client_of", {}), f"{where}/client_of").items():
            field = f"{where}/client_of/{node}"
            if not node.isdigit() or int(node) >= 2**64:
                raise RestoreError(field, "is not a node id (an unsigned 64-bit integer)")
            client_of[int(node)] = fields.integer(client, field, 0, self.cfg.num_clients - 1)
        if len(set(client_of.values())) != len(client_of):
            raise RestoreError(f"{where}/client_of", "maps two nodes to one client")
        contested: dict[int, list[int]] = {}
        for client, nodes in fields.mapping(tree.get("contested", {}), f"{where}/contested").items():
            field = f"{where}/contested/{client}"
            if not client.isdigit() or int(client) >= self.cfg.num_clients:
                raise RestoreError(field, "is not a client of this run")
            contested[int(client)] = fields.integers(nodes, field, 0, 2**64 - 1)
        self.client_of, self.contested = client_of, contested
        self._restored = True

    # ---------------------------------------------------------------- waiting
    def connected(self, grid: Grid) -> list[int]:
        """All connected nodes, after waiting (bounded) for ``num-clients`` of them."""
        patience = self.cfg.round_timeout if not self._waited else min(self.cfg.round_timeout, RECONNECT_GRACE_S)
        self._waited = True
        deadline = self.clock() + patience
        while True:
            node_ids = sorted(grid.get_node_ids())
            if len(node_ids) >= self.cfg.num_clients or self.clock() > deadline:
                break
            interrupt.check()  # Ctrl-C while waiting for nodes to connect
            self.sleep(0.5)
        if not node_ids:
            raise RuntimeError("no SuperNode connected")
        if len(node_ids) < self.cfg.num_clients:
            log(WARNING, "only %d of %d clients connected", len(node_ids), self.cfg.num_clients)
        if self._restored:
            self._restored = False
            if self.client_of and not set(self.client_of) & set(node_ids):
                if simulated(grid):  # the engine gives its nodes new ids every run: nothing to warn about
                    log(INFO, "resume: the simulated nodes have new ids, as in every run: clients are mapped afresh")
                else:
                    log(
                        WARNING,
                        "resume: none of the checkpoint's nodes is connected (a new federation): "
                        "the node -> client map starts afresh",
                    )
                self.client_of, self.contested = {}, {}
        return node_ids

    # ---------------------------------------------------------------- who a round goes to
    def excluded(self, task: int, phase: str) -> set[int]:
        """Sites a round does not go to: the withdrawn ones, and in stage 1's FedAvg rounds those of
        ``stage1-exclude`` (docs/unlearning.md)."""
        if task == 0 and phase == "fedavg":
            return self.withdrawn | set(self._stage1_excluded)
        return set(self.withdrawn)

    def targets(
        self, node_ids: list[int], task: int, phase: str, index: int, kind: Kind, discover: Callable[[list[int]], None]
    ) -> Targets:
        """Who a round goes to (see the module doc). ``discover`` asks unknown nodes who they serve."""
        unknown = [n for n in node_ids if n not in self.client_of]
        if unknown:
            discover(unknown)
        excluded = self.excluded(task, phase)
        mapped = [n for n in node_ids if n in self.client_of and self.client_of[n] not in excluded]
        everyone = {client_name(i) for i in range(self.cfg.num_clients) if i not in excluded}
        if self.cfg.clients_per_round == 0 or kind is not Kind.TRAIN:
            return Targets(mapped, everyone)
        # seeded by (seed, task, phase, round in stage): a rerun or a resumed run samples the same
        rng = np.random.default_rng([self.cfg.seed, task, zlib.crc32(phase.encode()), index])
        sampled = sample_clients(self.split.active_clients(task), self.cfg.clients_per_round, rng)
        sampled = sampled[~np.isin(sampled, sorted(excluded))] if excluded else sampled
        names = [client_name(c) for c in sampled.tolist()]
        wanted = set(sampled.tolist())
        return Targets([n for n in mapped if self.client_of[n] in wanted], set(names), names)
