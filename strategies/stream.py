"""Streaming a round's replies: pulled from the grid as they arrive, handed on in client order,
never more than a bounded number held at once.

Flower's ``Grid.send_and_receive`` returns only when every reply is in (or the timeout), so the
server holds all K replies of a round at once, and on a real SuperLink it polls every 3 s.
:class:`ReplyStream` uses the grid's own ``push_messages`` / ``pull_messages`` instead:

* it pushes the round's messages, then pulls only the replies of the first ``window`` positions
  (the round's nodes sorted by the client they serve) that are not yet handed on; a reply that
  arrives for a later position waits at the SuperLink until the window reaches it;
* it hands replies on strictly in client order (:attr:`ReplyStream.ordered`), so a consumer that
  adds each one to running sums and drops it computes the very same float sums as adding the
  sorted list would: results do not depend on arrival order or on the window;
* it polls with a short interval that doubles while nothing arrives (``poll`` up to
  ``max_poll`` seconds): a round ends a few milliseconds after its last reply instead of up to
  Flower's pull interval later; a grid that can say that nothing more will come (``LocalGrid``'s
  ``outstanding``) is never waited on;
* a position whose node has not answered by the deadline is given up (the round goes on
  without it), or, with ``require-all-clients``, its node gets the round again as a new
  *attempt* (``round-retries`` times at most, then the run stops with one line): replies of an
  earlier attempt never parse as replies to the retry.

So a consumer holds at most ``window`` replies (the one it is reading and those of later
positions waiting for an earlier one), whatever the number of clients. A node that answers a
round twice has its first reply handed on and the second dropped, and named in
:attr:`ReplyStream.dropped` (the consumer records it in the stage's ``left_out``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from logging import WARNING

from flwr.app import Message
from flwr.common.logger import log
from flwr.serverapp import Grid

from fcl_flower import interrupt

#: how many replies a round may hold at once (the one being read and the ones waiting for it)
WINDOW = 4
FIRST_POLL = 0.002  # seconds: the first wait for a reply; doubled while nothing arrives
MAX_POLL = 0.1  # seconds: the longest wait between two pulls

#: build(attempt, nodes) -> the round's messages of ``attempt`` for ``nodes``
Build = Callable[[int, list[int]], list[Message]]
#: answered(reply) -> whether it is a well-formed answer (else ``require-all-clients`` re-sends)
Answered = Callable[[Message], bool]


class ReplyStream:
    """Iterate over one round's replies in the order of ``nodes``; see the module doc."""

    ordered = True

    def __init__(
        self,
        grid: Grid,
        build: Build,
        nodes: list[int],
        *,
        timeout: float,
        window: int = WINDOW,
        require_all: bool = False,
        retries: int = 0,
        answered: Answered | None = None,
        server_round: int = 0,
        missing_names: Callable[[list[int]], list[str]] | None = None,
        max_poll: float = MAX_POLL,
    ) -> None:
        self.grid = grid
        self.build = build
        self.nodes = list(nodes)
        self.timeout = timeout
        self.window = max(1, int(window))
        self.require_all = require_all
        self.retries = retries
        self.answered = answered or (lambda message: not message.has_error())
        self.server_round = server_round
        self.missing_names = missing_names or (lambda nodes: [f"node-{n}" for n in nodes])
        self.max_poll = max_poll
        self.max_held = 0  # the most replies held at once (tests, benchmarks)
        self.waited = 0.0  # seconds spent sleeping between pulls
        self.dropped: list[tuple[int, str]] = []  # (node, why) of replies not handed on: a second answer

    def __iter__(self) -> Iterator[Message]:
        count = len(self.nodes)
        pending: dict[str, int] = {}  # message id -> position, for every message not answered yet
        deadline = [0.0] * count
        attempts = [0] * count
        held: dict[int, Message] = {}  # position -> reply pulled, not yet handed on
        done = [False] * count
        good = [False] * count  # a well-formed answer was handed on
        answered: set[int] = set()  # nodes with a reply held or handed on
        self._send(0, list(range(count)), pending, deadline)
        head, wait = 0, FIRST_POLL
        while head < count:
            window = {mid: p for mid, p in pending.items() if p < head + self.window}
            for reply in self._pull(window) if window else []:
                p = pending.pop(self._match(reply, window), -1)
                if (p < 0 or done[p]) and reply.metadata.src_node_id in answered:
                    self.dropped.append(
                        (reply.metadata.src_node_id, "answered this round twice: the second reply dropped")
                    )
                    continue
                if p < 0 or done[p] or (self.require_all and reply.has_error()):
                    continue  # an error under require-all-clients: the node gets the round again
                held[p] = reply
                answered.add(reply.metadata.src_node_id)
            self.max_held = max(self.max_held, len(held))
            start = head
            while head < count and (head in held or done[head]):
                if head in held:
                    reply = held.pop(head)
                    good[head], done[head] = self.answered(reply), True
                    yield reply
                head += 1
            if head > start:
                wait = FIRST_POLL
                continue
            # the window is stuck at `head`: give up or re-send what is overdue or lost for good
            now, lost = time.monotonic(), self._lost(window)
            waiting = set(window.values())
            overdue = [
                p
                for p in range(head, min(count, head + self.window))
                if p not in held and not done[p] and (p in lost or p not in waiting or now >= deadline[p])
            ]
            if not overdue:
                interrupt.check()  # Ctrl-C: stop waiting for replies
                time.sleep(wait)
                self.waited += wait
                wait = min(self.max_poll, wait * 2)
                continue
            for message_id in [m for m, p in pending.items() if p in overdue]:
                del pending[message_id]
            if not self.require_all:
                for p in overdue:
                    done[p] = True
                continue
            spent = [p for p in overdue if attempts[p] >= self.retries]
            if spent:
                raise self._failure(spent, max(attempts[p] for p in spent) + 1)
            for p in overdue:
                attempts[p] += 1
            log(
                WARNING,
                "round %d: retry %d/%d for %d node(s)",
                self.server_round,
                max(attempts[p] for p in overdue),
                self.retries,
                len(overdue),
            )
            for attempt in sorted({attempts[p] for p in overdue}):
                self._send(attempt, [p for p in overdue if attempts[p] == attempt], pending, deadline)
        if self.require_all and not all(good):  # answers that came but were not well-formed
            raise self._failure([p for p in range(count) if not good[p]], self.retries + 1)

    def _send(self, attempt: int, positions: list[int], pending: dict[str, int], deadline: list[float]) -> None:
        position = {self.nodes[p]: p for p in positions}
        messages = self.build(attempt, [self.nodes[p] for p in positions])
        targets = [m.metadata.dst_node_id for m in messages]
        due = time.monotonic() + self.timeout
        for node, message_id in zip(targets, self.grid.push_messages(messages)):
            if message_id and node in position:
                pending[message_id] = position[node]
                deadline[position[node]] = due

    def _match(self, reply: Message, window: dict[str, int]) -> str:
        """The pending message ``reply`` answers: the one it names, else the one sent to the node it
        comes from (a reply that names another message, e.g. one replayed from an earlier round, is
        still handed on, so that the server parses it and rejects it by name)."""
        named = reply.metadata.reply_to_message_id
        if named in window:
            return named
        source = reply.metadata.src_node_id
        for message_id, p in window.items():
            if self.nodes[p] == source:
                return message_id
        return named

    def _failure(self, positions: list[int], attempts: int) -> RuntimeError:
        names = ", ".join(sorted(self.missing_names([self.nodes[p] for p in positions])))
        return RuntimeError(
            f"round {self.server_round}: no reply from {names} after {attempts} attempts (require-all-clients is set)"
        )

    # ------------------------------------------------------------------ grid calls
    def _pull(self, window: dict[str, int]) -> list[Message]:
        return list(self.grid.pull_messages(list(window)))

    def _lost(self, window: dict[str, int]) -> set[int]:
        """Positions in ``window`` whose reply the grid says will never come (LocalGrid knows)."""
        outstanding = getattr(self.grid, "outstanding", None)
        if outstanding is None:
            return set()
        still = set(outstanding(list(window)))
        return {p for mid, p in window.items() if mid not in still}


class InOrder:
    """Marks an iterable of replies as handed on in client order (a consumer may fold them)."""

    ordered = True

    def __init__(self, replies: Iterable[Message]) -> None:
        self.replies = replies

    def __iter__(self) -> Iterator[Message]:
        return iter(self.replies)


class Replies(list[Message]):
    """The replies :func:`exchange` collected, and (``dropped``) the nodes that answered twice."""

    dropped: list[tuple[int, str]]


def exchange(grid: Grid, messages: list[Message], timeout: float) -> Replies:
    """Send small messages (one per node) and collect every reply that arrives within ``timeout``,
    polling as :class:`ReplyStream` does (Flower's ``send_and_receive`` polls a SuperLink every 3 s)."""
    by_node = {m.metadata.dst_node_id: m for m in messages}

    def build(attempt: int, nodes: list[int]) -> list[Message]:
        return [by_node[n] for n in nodes]

    stream = ReplyStream(grid, build, list(by_node), timeout=timeout, window=max(1, len(by_node)))
    replies = Replies(stream)
    replies.dropped = stream.dropped
    return replies
