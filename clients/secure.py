"""Client side of secure aggregation: a fresh key pair per statistics round, masked uploads.

The private key lives only in this node's Flower ``context.state`` between the key round and the
statistics round that follows it (strategies/secure.py); the server sees the public half only.
"""

from __future__ import annotations

import torch
from flwr.app import Array, ConfigRecord, Message, MetricRecord, RecordDict

from clients.job import ClientJob
from fcl_flower.privacy.secagg import (
    SecureAggregationError,
    generate_keypair,
    mask_arrays,
    round_context,
)
STATE_RECORD = "secagg"  # context.state config record holding this node's private key
KEYS_PHASE = "secagg-keys"
PEERS_KEY = "secagg-peers"  # round config: "node:publickeyhex;..." of this attempt's participants
ATTEMPT_KEY = "secagg-attempt"
PUBLIC_KEY = "public-key"  # entry of the reply's "secagg" ConfigRecord


def encode_peers(peers: dict[int, bytes]) -> str:
    return ";".join(f"{node}:{key.hex()}" for node, key in sorted(peers.items()))


def decode_peers(text: str) -> dict[int, bytes]:
    """Inverse of :func:`encode_peers`; raises SecureAggregationError on anything else."""
    peers = {}
    for entry in filter(None, text.split(";")):
        node, _, key = entry.partition(":")
        try:
            peers[int(node)] = bytes.fromhex(key)
        except ValueError:
            raise SecureAggregationError(f"cannot read participant entry '{entry}'") from None
    return peers


def secure_round(job: ClientJob) -> bool:
    """Whether the server asked for masked uploads in this round."""
    return PEERS_KEY in job.round_config


def handle_keys(message: Message, job: ClientJob) -> Message:
    """Make and keep a fresh key pair; answer with the public key."""
    private, public = generate_keypair()
    job.context.state.config_records[STATE_RECORD] = ConfigRecord({"private-key": private})
    content = RecordDict({
        "secagg": ConfigRecord({PUBLIC_KEY: public}),
        "metrics": MetricRecord({"partition-id": job.partition, "num-examples": 0}),
    })
    return Message(content=content, reply_to=message)


def mask_records(job: ClientJob, records: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, Array]]:
    """Encode and mask every array of every record for this round's participants."""
    state = job.context.state.config_records.get(STATE_RECORD)
    if state is None or "private-key" not in state:
        raise SecureAggregationError("no secure-aggregation key on this node (it restarted after the key round)")
    peers = decode_peers(str(job.round_config[PEERS_KEY]))
    context = round_context(job.cfg.seed, int(job.round_config["server-round"]),
                            int(job.round_config[ATTEMPT_KEY]), peers)
    flat = {f"{record}/{key}": tensor.detach().cpu().double().numpy()
            for record, arrays in records.items() for key, tensor in arrays.items()}
    masked = mask_arrays(flat, int(job.context.node_id), bytes(state["private-key"]), peers, context,
                         job.cfg.secagg_fraction_bits, job.cfg.secagg_min_clients)
    out: dict[str, dict[str, Array]] = {record: {} for record in records}
    for name, values in masked.items():
        record, key = name.split("/", 1)
        out[record][key] = Array(values)
    return out
