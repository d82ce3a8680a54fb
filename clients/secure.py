"""Client side of secure aggregation: a fresh key pair per statistics round, masked uploads.

The private key lives only in this node's Flower ``context.state`` between the key round and the
statistics round that follows it (strategies/secure.py); the server sees the public half only.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ConfigRecord, Context

from clients.job import ClientJob
from clients.node_data import node_data
from fcl_flower.privacy.secagg import SecureAggregationError, generate_keypair, mask_arrays, round_context
from fcl_flower.protocol import KeysIns, KeysRes, StatsIns

STATE_RECORD = "secagg"  # context.state config record holding this node's private key


def handle_keys(ins: KeysIns, context: Context) -> KeysRes:
    """Make and keep a fresh key pair; answer with the public key."""
    private, public = generate_keypair()
    context.state.config_records[STATE_RECORD] = ConfigRecord({"private-key": private})
    return KeysRes(ins.header, node_data(context.node_config, ins.config).partition, 0, public_key=public)


def mask(job: ClientJob, arrays: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Encode and mask every named array for this round's participants (same names, uint64)."""
    assert isinstance(job.ins, StatsIns) and job.ins.secagg is not None
    state = job.context.state.config_records.get(STATE_RECORD)
    private = None if state is None else state.get("private-key")
    if not isinstance(private, bytes):
        raise SecureAggregationError("no secure-aggregation key on this node (it restarted after the key round)")
    peers = dict(job.ins.secagg.participants)
    header = job.ins.header
    context = round_context(job.cfg.seed, header.server_round, header.attempt, peers)
    flat = {name: tensor.detach().cpu().double().numpy() for name, tensor in arrays.items()}
    return mask_arrays(
        flat,
        int(job.context.node_id),
        private,
        peers,
        context,
        job.cfg.secagg_fraction_bits,
        job.cfg.secagg_min_clients,
    )
