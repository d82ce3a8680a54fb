"""The ClientApp (``[tool.flwr.app.components] clientapp``): one entry per Flower message type.

``train`` messages carry local-SGD rounds, ``query.stats`` the one-shot statistics of the
analytic methods (and EWC's Fisher), ``query.keys`` / ``query.shares`` / ``query.unmask`` the
steps of a secure statistics round (clients/secure.py), ``query.info`` which client this node
serves, ``evaluate`` the federated evaluation after each stage (clients/evaluate.py). Every message
is parsed into its typed instruction (fcl_flower/protocol); the handler of the instruction's
phase comes from the method's registry entry and is imported only when first needed, so a
process that answers a statistics message never imports the training code, and one that answers
a message without a model (``query.info``, ``query.keys``, ``query.shares``, ``query.unmask``)
never imports torch (the protocol is NumPy only; tests/test_client_startup.py). Raw samples never
leave this process: handlers reply with model weights or aggregate statistics only.

Nor does anything about this machine's files: a failure that involves the site's own files or
node config (a missing folder, an unreadable image, a node config that does not fit the run) is
logged here in full, one line naming the file, and reaches the server as one generic line
(:class:`SiteError`): a server cannot use its error replies to probe the site's file system. A
run config that names a file for the client to open (``task-plan``) is refused at parse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cache
from logging import ERROR
from typing import TYPE_CHECKING

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from fcl_flower import methods
from fcl_flower.quiet import quiet_known_noise

if TYPE_CHECKING:
    from fcl_flower.protocol import Reply

quiet_known_noise()
app = ClientApp()

Handler = Callable[..., "Reply"]
#: node config: hand each message to this node's warm worker (clients/worker.py) instead of
#: importing torch, building the model and opening the data again in every ClientApp process
WARM_WORKER = "warm-worker"
SECURE_ONLY = "secure-aggregation"  # node config: this node's statistics and model leave it only masked
#: what the server is told when this site's own files or node config fail a round (the detail is logged here)
SITE_DATA_REASON = "this site cannot read its own data for this round (the detail is in the site's log)"
SITE_CONFIG_REASON = "this site's node config does not fit the run (the detail is in the site's log)"


class SiteError(RuntimeError):
    """A round failed on this site's own files or node config; the server gets this one line."""


def site_reason(err: BaseException) -> str | None:
    """The generic line for an error about the site's files or node config; None for any other."""
    from clients.node_data import NodeConfigError
    from fcl_flower.data.errors import DatasetError

    if isinstance(err, NodeConfigError):
        return SITE_CONFIG_REASON
    if isinstance(err, (DatasetError, OSError)):
        return SITE_DATA_REASON
    return None


@cache
def handler_for(strategy: str, phase: str) -> Handler:
    """The client handler of ``strategy``'s ``phase`` (registry reference, imported on first use)."""
    from fcl_flower.protocol import ProtocolError

    try:
        handler: Handler = methods.load(methods.get(strategy).phase(phase).handler)
    except methods.RegistryError as err:
        raise ProtocolError(str(err)) from None
    return handler


def handle(message: Message, context: Context) -> Message:
    """The reply to ``message``: from this node's warm worker when the node config asks for one
    (``warm-worker = true``) and it answers, else handled in this process (:func:`handle_here`).
    Until then this module imports neither torch nor the protocol: a ClientApp process whose
    worker answers stays thin."""
    if context.node_config.get(WARM_WORKER) is True:
        from clients.worker import forward

        reply = forward(message, context)  # None: no worker answered (logged); answer it here
        if reply is not None:
            return reply
    return handle_here(message, context)


def handle_here(message: Message, context: Context) -> Message:
    """Parse, dispatch, reply. Any exception becomes Flower's error reply to the server; one about
    the site's files or node config only as a generic line (the detail is logged here)."""
    try:
        return _handle(message, context)
    except (ValueError, OSError) as err:
        reason = site_reason(err)
        if reason is None:
            raise
        from fcl_flower.data.errors import one_line

        log(ERROR, "this round failed on the site's own data or node config: %s", one_line(err, limit=1000))
        raise SiteError(reason) from None


def _handle(message: Message, context: Context) -> Message:
    from fcl_flower.protocol import (
        EvaluateIns,
        InfoIns,
        InfoRes,
        KeysIns,
        ProtocolError,
        SharesIns,
        StatsIns,
        StatsRes,
        TrainIns,
        UnmaskIns,
        parse_instruction,
    )

    ins = parse_instruction(message)
    if isinstance(ins, InfoIns):
        from clients.node_data import node_partition

        reply: Reply = InfoRes(ins.header, node_partition(context.node_config, ins.config), 0)
    elif isinstance(ins, (KeysIns, SharesIns, UnmaskIns)):
        from clients import secure

        if isinstance(ins, KeysIns):
            reply = secure.handle_keys(ins, context)
        elif isinstance(ins, SharesIns):
            reply = secure.handle_shares(ins, context)
        else:
            reply = secure.handle_unmask(ins, context)
    elif isinstance(ins, EvaluateIns):
        from clients.evaluate import handle_evaluate
        from clients.job import make_job

        reply = handle_evaluate(make_job(ins, context))
    else:
        assert isinstance(ins, (TrainIns, StatsIns))
        from clients.job import make_job

        if ins.secagg is None and context.node_config.get(SECURE_ONLY) is True:
            what = "statistics" if isinstance(ins, StatsIns) else "its model"
            raise ProtocolError(
                f"this node uploads {what} only inside a secure round (node config secure-aggregation=true); "
                "the run asks for a plain upload: refused"
            )

        counts = None
        if isinstance(ins, StatsIns) and ins.evaluate is not None:  # the previous stage's evaluation rides along
            from clients.evaluate import riding_evaluation

            counts = riding_evaluation(ins, context)
        reply = handler_for(ins.config.strategy, ins.header.phase)(make_job(ins, context))
        if counts is not None and isinstance(reply, StatsRes):
            reply = dataclasses.replace(reply, evaluation=counts)
    return reply.reply_to(message)


@app.train()
def train(message: Message, context: Context) -> Message:
    """Local training rounds (FedAvg stage 1, fine-tuning, LwF, EWC, LGA, STAMP)."""
    return handle(message, context)


@app.query("stats")
def stats(message: Message, context: Context) -> Message:
    """One-shot statistics upload (STSA, STSA-E, FedRAN; EWC's Fisher)."""
    return handle(message, context)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Federated evaluation: per-class counts of the global model on this node's held-out data."""
    return handle(message, context)


@app.query("info")
def info(message: Message, context: Context) -> Message:
    """Which client (partition) this node serves; the server samples clients per round by it."""
    return handle(message, context)


@app.query("keys")
def keys(message: Message, context: Context) -> Message:
    """Fresh public keys: the first step of a secure statistics round (clients/secure.py)."""
    return handle(message, context)


@app.query("shares")
def shares(message: Message, context: Context) -> Message:
    """Shamir shares of this round's secrets, one encrypted bundle per participant."""
    return handle(message, context)


@app.query("unmask")
def unmask(message: Message, context: Context) -> Message:
    """The shares the server needs to open the sum, after checking the request."""
    return handle(message, context)
