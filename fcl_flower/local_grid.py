"""A Flower Grid that delivers messages to ClientApps in this very process.

Ray's simulation engine costs ~15 s of start-up per run; tests of the strategies, the resume
path and fault handling do not need separate processes, only the same messages. This grid
serialises nothing and hides nothing: each message goes to the real ClientApp of its node,
with that node's own Context (node config and persistent state), and the reply comes back as
a Message. ``unavailable`` lets a test switch nodes off to simulate crashed SuperNodes, and
``tamper`` lets it change replies in flight (an attacker on a client, or on the wire). It is
also the "no framework" baseline of the framework-overhead benchmark and the in-process engine
of ``compare.py --engine local``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

#: tamper(messages delivered, their replies) -> the replies the server receives
Tamper = Callable[[Sequence[Message], list[Message]], list[Message]]


class LocalGrid(Grid):
    """``num_nodes`` in-process nodes with node ids ``first_node_id``.. and partition ids 0..K-1;
    ``node_configs`` (one per node) replaces those node configs, as ``--node-config`` does on a
    real SuperNode (e.g. a site's own ``data-dir``)."""

    def __init__(
        self,
        client_app: ClientApp | Callable[[Message, Context], Message],
        num_nodes: int,
        *,
        run_id: int = 1,
        first_node_id: int = 1,
        tamper: Tamper | None = None,
        node_configs: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        if node_configs is not None and len(node_configs) != num_nodes:
            raise ValueError(f"{len(node_configs)} node configs for {num_nodes} nodes")
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 0, run_id
        self.client_app = client_app
        self.tamper = tamper
        self.unavailable: set[int] = set()  # node ids that do not answer (crashed SuperNodes)
        self.sent: list[Message] = []  # every message delivered, for inspection in tests
        self.replies: list[Message] = []
        self.contexts = {
            first_node_id + k: Context(
                run_id=run_id,
                node_id=first_node_id + k,
                node_config=(
                    {"partition-id": k, "num-partitions": num_nodes} if node_configs is None else dict(node_configs[k])
                ),
                state=RecordDict(),
                run_config={},
            )
            for k in range(num_nodes)
        }
        self._run: Run | None = None

    # -- what the strategies use --------------------------------------------------------
    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.unavailable]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        delivered = []
        for message in messages:
            node_id = message.metadata.dst_node_id
            if node_id in self.unavailable or node_id not in self.contexts:
                continue  # like a SuperNode that never answers before the timeout
            self.sent.append(message)
            delivered.append(message)
            try:
                reply = self.client_app(message, self.contexts[node_id])
            except Exception as exc:  # the ClientApp raised: Flower replies with an Error
                reply = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=message)
            replies.append(reply)
        self.replies.extend(replies)
        if self.tamper is not None and delivered:
            replies = self.tamper(delivered, replies)
        return replies

    # -- the rest of the Grid interface -------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        if self._run is None:
            raise RuntimeError("no run set")
        return self._run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("LocalGrid delivers synchronously: use send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("LocalGrid delivers synchronously: use send_and_receive")
