"""ClientApp: routes each message to the handler of the phase the strategy asked for.

``train`` messages carry local-SGD phases; ``query.stats`` messages carry the one-shot
statistics of the analytic methods; ``query.keys`` asks for a fresh public key before a
secure-aggregation statistics round. Raw samples never leave this process: handlers reply with
model weights or aggregate statistics only.
"""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients import HANDLERS
from clients.job import parse_job
from clients.node_data import node_data
from fcl_flower.config import RunConfig

app = ClientApp()


def _dispatch(message: Message, context: Context) -> Message:
    job = parse_job(message, context)
    handler = HANDLERS.get(job.phase)
    if handler is None:
        raise ValueError(f"unknown phase '{job.phase}'; this client knows: {', '.join(sorted(HANDLERS))}")
    return handler(message, job)


@app.train()
def train(message: Message, context: Context) -> Message:
    """Local training rounds (FedAvg stage 1, fine-tuning, LwF, EWC, ...)."""
    return _dispatch(message, context)


@app.query("stats")
def stats(message: Message, context: Context) -> Message:
    """One-shot statistics upload (STSA, STSA-E, FedRAN)."""
    return _dispatch(message, context)


@app.query("info")
def info(message: Message, context: Context) -> Message:
    """Which client (partition id) this node serves; the server samples clients per round by it."""
    cfg = RunConfig.from_mapping(dict(message.content.config_records["config"]))
    partition = node_data(context.node_config, cfg).partition
    return Message(RecordDict({"metrics": MetricRecord({"partition-id": partition})}), reply_to=message)


@app.query("keys")
def keys(message: Message, context: Context) -> Message:
    """A fresh public key before a secure statistics round (clients/secure.py)."""
    return _dispatch(message, context)
