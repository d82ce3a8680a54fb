"""Sending one round and, with ``require-all-clients``, re-sending it to the nodes that did not answer.

A retry is a new *attempt* of the same round: its messages carry the next attempt number, so a
late reply to an earlier attempt can never be mistaken for an answer to the retry.
"""

from __future__ import annotations

from collections.abc import Callable
from logging import WARNING

from flwr.app import Message
from flwr.common.logger import log
from flwr.serverapp import Grid

#: build(attempt, exclude) -> the round's messages for ``attempt``, without the nodes in ``exclude``
Build = Callable[[int, set[int]], list[Message]]
#: missing(replies) -> the clients the round was sent to that have no reply among ``replies``
Missing = Callable[[list[Message]], set[str]]


def send_round(
    grid: Grid, build: Build, missing: Missing, *, timeout: float, require_all: bool, retries: int, server_round: int
) -> list[Message]:
    replies = list(grid.send_and_receive(build(0, set()), timeout=timeout))
    attempt = 0
    while require_all and missing(replies):
        if attempt >= retries:
            raise RuntimeError(
                f"round {server_round}: no reply from {', '.join(sorted(missing(replies)))} "
                f"after {attempt + 1} attempts (require-all-clients is set)"
            )
        attempt += 1
        replies = [m for m in replies if not m.has_error()]
        retry = build(attempt, {m.metadata.src_node_id for m in replies})
        log(WARNING, "round %d: retry %d/%d for %d node(s)", server_round, attempt, retries, len(retry))
        replies += list(grid.send_and_receive(retry, timeout=timeout))
    return replies
