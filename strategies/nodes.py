"""Which SuperNodes are there, which client each serves, and which nodes a round goes to.

* Waiting: the first round waits up to ``round-timeout`` for ``num-clients`` SuperNodes (they are
  still connecting); later rounds wait at most :data:`RECONNECT_GRACE_S` for a node that went
  away, then go on without it (its missing statistics are backfilled when it comes back).
* Sampling: train rounds with ``clients-per-round > 0`` go only to the nodes of a seeded sample of
  the clients joined by the task (LGA: 10 per round); every other round goes to every node.
* Identity: the server only knows node ids, and clients are partitions. A node's client is
  learnt from its replies (and a tiny ``query.info`` message when sampling needs it before).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from logging import WARNING

import numpy as np
from flwr.common.logger import log
from flwr.serverapp import Grid

from fcl_flower.config import RunConfig
from fcl_flower.data import FederatedSplit
from fcl_flower.data.paper_partitions import sample_clients
from fcl_flower.methods import Kind
from strategies.accounting import client_name

RECONNECT_GRACE_S = 30.0  # after the first round: how long to wait for a node that went away


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
        split: FederatedSplit,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.cfg = cfg
        self.split = split
        self.clock = clock
        self.sleep = sleep
        self.client_of: dict[int, int] = {}  # node id -> client (partition), learnt from replies
        self._waited = False

    def connected(self, grid: Grid) -> list[int]:
        """All connected nodes, after waiting (bounded) for ``num-clients`` of them."""
        patience = self.cfg.round_timeout if not self._waited else min(self.cfg.round_timeout, RECONNECT_GRACE_S)
        self._waited = True
        deadline = self.clock() + patience
        while True:
            node_ids = sorted(grid.get_node_ids())
            if len(node_ids) >= self.cfg.num_clients or self.clock() > deadline:
                break
            self.sleep(0.5)
        if not node_ids:
            raise RuntimeError("no SuperNode connected")
        if len(node_ids) < self.cfg.num_clients:
            log(WARNING, "only %d of %d clients connected", len(node_ids), self.cfg.num_clients)
        return node_ids

    def learn(self, node: int, client: int) -> None:
        self.client_of[node] = client

    def targets(
        self, node_ids: list[int], task: int, phase: str, index: int, kind: Kind, discover: Callable[[list[int]], None]
    ) -> Targets:
        """Who a round goes to (see the module doc). ``discover`` asks unknown nodes who they serve."""
        everyone = {client_name(i) for i in range(self.cfg.num_clients)}
        if self.cfg.clients_per_round == 0 or kind is not Kind.TRAIN:
            return Targets(node_ids, everyone)
        # seeded by (seed, task, phase, round in stage): a rerun or a resumed run samples the same
        rng = np.random.default_rng([self.cfg.seed, task, zlib.crc32(phase.encode()), index])
        sampled = sample_clients(self.split.active_clients(task), self.cfg.clients_per_round, rng)
        unknown = [n for n in node_ids if n not in self.client_of]
        if unknown:
            discover(unknown)
        names = [client_name(c) for c in sampled.tolist()]
        wanted = set(sampled.tolist())
        return Targets([n for n in node_ids if self.client_of.get(n) in wanted], set(names), names)
