"""Secure statistics rounds: a key round, then a masked round that is re-run on dropouts.

With ``secure-aggregation`` the statistics round of a stage becomes two exchanges:

1. ``query.keys``: every node makes a fresh X25519 key pair, keeps the private half in its
   Flower ``context.state`` and answers with the public half (32 bytes).
2. ``query.stats`` to the nodes that answered, with the participants' public keys and the
   attempt number in the round config: each client uploads its statistics masked
   (fcl_flower/privacy/secagg.py). Every reply is screened *before* aggregation; if any
   participant failed, timed out or sent a bad upload, the masked sum cannot be opened, so the
   round is sent again to the survivors (fresh masks, because the attempt and the participant
   set are bound into them) -- or, with ``require-all-clients``, again to everybody after a new
   key round. Nothing from an incomplete attempt is ever unmasked.

The mixin overrides only :meth:`StagedStrategy._run_round`; which arrays are masked, and how
the sums are read, is the strategy's business (strategies/analytic.py).
"""

from __future__ import annotations

from logging import WARNING
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from clients.secure import ATTEMPT_KEY, KEYS_PHASE, PEERS_KEY, PUBLIC_KEY, encode_peers
from fcl_flower.privacy.secagg import KEY_BYTES
from fcl_flower.wire import UploadError

KEYS_MESSAGE = "query.keys"  # -> @app.query("keys")


class SecureRounds:
    """Mixin for a StagedStrategy whose statistics rounds are summed under pairwise masks."""

    _secagg_step: tuple[str, dict[int, bytes], int] | None = None  # (step, participants, attempt)

    def secure_round(self, plan: Any) -> bool:
        return bool(self.cfg.secure_aggregation) and plan.phase.endswith("stats")

    def round_config(self, plan: Any) -> dict[str, Any]:
        config = super().round_config(plan)
        if self._secagg_step is not None:
            step, peers, attempt = self._secagg_step
            if step == "keys":
                config["phase"] = KEYS_PHASE
            else:
                config[PEERS_KEY] = encode_peers(peers)
                config[ATTEMPT_KEY] = attempt
        return config

    def _run_round(self, grid: Grid, server_round: int, config: ConfigRecord, timeout: float) -> list[Message]:
        plan = self._require_plan()
        self._secagg_step = None  # the step of the last secure attempt stays set for aggregate_train
        if not self.secure_round(plan):
            return super()._run_round(grid, server_round, config, timeout)
        return self._secure_attempts(grid, server_round, config, timeout)

    def _secure_attempts(self, grid: Grid, server_round: int, config: ConfigRecord,
                         timeout: float) -> list[Message]:
        plan = self._require_plan()
        peers: dict[int, bytes] = {}
        for attempt in range(self.cfg.round_retries + 1):
            if attempt == 0 or self.cfg.require_all_clients:
                peers = self._collect_keys(grid, server_round, config, timeout)
            if len(peers) < self.cfg.secagg_min_clients:
                raise RuntimeError(
                    f"round {server_round}: secure aggregation needs at least {self.cfg.secagg_min_clients} "
                    f"participants, {len(peers)} left")
            self._secagg_step = ("stats", peers, attempt)
            messages = [m for m in self.configure_train(server_round, self.global_arrays(), config, grid)
                        if m.metadata.dst_node_id in peers]
            replies = list(grid.send_and_receive(messages, timeout=timeout))
            good = self._screen(plan, server_round, replies)
            dropped = sorted(set(peers) - set(good))
            missing = self._missing_clients(list(good.values())) if self.cfg.require_all_clients else set()
            if not dropped and not missing:
                return list(good.values())
            log(WARNING, "round %d: secure attempt %d cannot be opened (no valid upload from node(s) %s); %s",
                server_round, attempt + 1, ", ".join(map(str, dropped)) or "-",
                "asking every client again" if self.cfg.require_all_clients else
                f"re-running with the {len(good)} survivors")
            peers = {node: key for node, key in peers.items() if node in good}
        raise RuntimeError(f"round {server_round}: no complete secure attempt after "
                           f"{self.cfg.round_retries + 1} attempts")

    def _collect_keys(self, grid: Grid, server_round: int, config: ConfigRecord,
                      timeout: float) -> dict[int, bytes]:
        """One fresh public key per answering node; malformed or duplicate answers are dropped."""
        self._secagg_step = ("keys", {}, 0)
        requests = [Message(content=RecordDict({"config": m.content.config_records["config"]}),  # no model
                            message_type=KEYS_MESSAGE, dst_node_id=m.metadata.dst_node_id)
                    for m in self.configure_train(server_round, self.global_arrays(), config, grid)]
        peers: dict[int, bytes] = {}
        clients: set[str] = set()
        for message in grid.send_and_receive(requests, timeout=timeout):
            node = message.metadata.src_node_id
            try:
                if message.has_error():
                    raise UploadError(f"client failed: {message.error.reason}")
                client, _ = self._identify(message.content)
                record = message.content.config_records.get("secagg")
                key = None if record is None else record.get(PUBLIC_KEY)
                if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                    raise UploadError(f"no {KEY_BYTES}-byte public key in the reply")
                if client in clients:
                    raise UploadError(f"duplicate key: {client} already answered")
            except UploadError as err:
                log(WARNING, "Rejected key from node %d in round %d: %s", node, server_round, err)
                self._left_out[f"node-{node}"] = f"secure key round: {err}"
                continue
            clients.add(client)
            peers[node] = key
        return peers

    def _screen(self, plan: Any, server_round: int, replies: list[Message]) -> dict[int, Message]:
        """The replies that would be accepted, by node: the masked sum needs all of them."""
        good: dict[int, Message] = {}
        clients: set[str] = set()
        for message in replies:
            try:
                reply = self.check_reply(plan, message, clients)
            except UploadError as err:
                self.reject(message, err, server_round)
                continue
            clients.add(reply.client)
            good[message.metadata.src_node_id] = message
        return good
