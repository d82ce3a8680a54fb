"""Run in a fresh interpreter by tests/test_client_startup.py: one secure round of three nodes
through the ClientApp's own entry (``clients.app.handle``) for the messages without a model
(``query.info``, ``query.keys``, ``query.shares``, ``query.unmask``), and the masked upload in
between through ``clients.secure.masked_upload`` with NumPy statistics (a real node computes them
in a ``query.stats`` message, which needs the model). Prints, as JSON, each reply's partition and
whether torch was loaded after each step. argv: a folder for the nodes' ledgers."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

started = time.perf_counter()
import numpy as np  # noqa: E402
from flwr.app import Context, Message, RecordDict  # noqa: E402
from flwr.common.constant import SUPERLINK_NODE_ID  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from clients import secure  # noqa: E402
from clients.app import handle  # noqa: E402
from fcl_flower.config import RunConfig  # noqa: E402
from fcl_flower.methods import Kind  # noqa: E402
from fcl_flower.privacy.secagg import threshold_for  # noqa: E402
from fcl_flower.protocol import (  # noqa: E402
    Header,
    InfoIns,
    KeysIns,
    SecAggRound,
    SharesIns,
    StatsIns,
    UnmaskIns,
    parse_reply,
)

TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
NODES = (11, 12, 13)
cfg = RunConfig(num_clients=3, secure_aggregation=True, secagg_min_clients=2)
contexts = {
    n: Context(1, n, {"partition-id": i, "num-partitions": 3, "secagg-ledger": sys.argv[1]}, RecordDict(), {})
    for i, n in enumerate(NODES)
}
steps: dict[str, object] = {}


def deliver(ins, node: int):
    message = ins.to_message(node)
    message = Message(message.content, dst_node_id=node, message_type=message.metadata.message_type)
    reply = handle(message, contexts[node])
    return parse_reply(reply, ins.header, Kind(message.metadata.message_type))


def header(phase: str) -> Header:
    return Header("run", phase, 0, 1, 1)


info = {n: deliver(InfoIns(header("info"), cfg), n).client for n in NODES}
steps["info"] = {"partitions": [info[n] for n in NODES], "torch": "torch" in sys.modules}
keys = {n: deliver(KeysIns(header("stats"), cfg), n) for n in NODES}
steps["keys"] = {"partitions": [keys[n].client for n in NODES], "torch": "torch" in sys.modules}
public = {n: keys[n].keys for n in NODES}
threshold = threshold_for(len(NODES), cfg.secagg_min_clients, False)
shares = {n: deliver(SharesIns(header("stats"), cfg, public, info, threshold), n) for n in NODES}
steps["shares"] = {"partitions": [shares[n].client for n in NODES], "torch": "torch" in sys.modules}
for n in NODES:  # the masked upload (a query.stats message on a real node), NumPy statistics only
    sec = SecAggRound(
        NODES,
        public,
        info,
        threshold,
        {src: shares[src].shares[n] for src in NODES},
        {src: shares[src].commitments[n] for src in NODES},
    )
    ins = StatsIns(header("stats"), cfg, num_seen=2, secagg=sec)
    job = SimpleNamespace(ins=ins, context=contexts[n], cfg=cfg)
    secure.masked_upload(job, {"x": np.arange(3.0)}, (), {0: ""})  # type: ignore[arg-type]
unmask = {n: deliver(UnmaskIns(header("stats"), cfg, survivors=NODES), n) for n in NODES}
steps["unmask"] = {
    "partitions": [unmask[n].client for n in NODES],
    "seed_shares": [sorted(unmask[n].seed_shares) for n in NODES],
    "torch": "torch" in sys.modules,
}
steps["seconds"] = time.perf_counter() - started
print(json.dumps(steps))
