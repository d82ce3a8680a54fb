"""Client side of secure aggregation: keys, shares, the masked upload, unmasking (one round).

The node's secrets of one round live only in its Flower ``context.state`` (record
:data:`STATE_RECORD`), bound to the round's run, task, stage and round number:

* after the key round: the two private keys (c: share encryption, s: masks);
* after the shares round: also the self-mask seed b;
* after the masked upload: the private keys and the seed are deleted; only the shares that
  other participants sent this node (decrypted) remain, with what the unmask check needs;
* after the unmask round: nothing of the round. Where the unmask instruction names the next secure
  round's key step (keys ahead, ``UnmaskIns.prepare``), the node then makes that round's two fresh
  key pairs exactly as its key round would (:func:`handle_keys`: bound to that round's run, task,
  stage, round and attempt 0, signed the same way in signed-keys mode) and sends the public halves
  with its unmask reply; the next round starts at its shares step.

Shares ahead, one step further: where a masked upload's instruction names the next secure round's
key step (``SecAggRound.prepare``), the node makes that round's fresh key pairs as above but keeps
them apart (record :data:`NEXT_RECORD`: the current round's secrets stay until it is unmasked) and
sends the public halves with its masked upload. Where the unmask instruction then carries that
round's shares step (``UnmaskIns.ahead``), the node checks it exactly as a ``query.shares`` (its own
keys, every peer's signature, ``secagg-min-clients``, the threshold due) before it writes its ledger
or reveals anything, and after revealing deals its shares over those keys (:func:`_deal`, as
:func:`handle_shares`), returned in its unmask reply; the next round starts at its masked upload.
A node the shares step leaves out of U1 deals nothing (and drops the keys it made ahead).
A node deals the shares of one set of keys once: a second shares step for them (the server
re-asking over another U1) is refused, and the masked upload checks U1 against the one it dealt
over. Keys kept ahead that the unmask step does not use are dropped there.

Before it reveals anything a client checks the request (fcl_flower/privacy/secagg.py
``check_unmask_request``): never both secrets of one participant, survivors and dropped nodes
partitioning exactly the participants it masked over, at least the threshold of survivors, and for
every owed task whose statistics rode in the upload, at least ``secagg-min-clients`` owing
survivors (else a past task's class sums would open for one client). In signed-keys mode it also
refuses peers whose keys are not signed by a SuperNode key the operator listed, and an unmask
request that does not carry every survivor's signature over this node's own view (one view per
round). Then it writes the stage into its ledger (clients/ledger.py) and refuses if the stage was
already opened over another set: each input is opened once.

A share bundle that does not decrypt or match its dealer's commitment does not stop the node: it
masks as usual and accuses the dealer in its upload (with the reason; never with the bundle's
key, which would open the dealer's real bundle to a server that altered what it relayed).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from flwr.app import ConfigRecord, Context
from flwr.app.typing import ConfigRecordValues

from clients.ledger import FEDERATION_KEY, Key, Ledger, input_digest, ledger_folder, train_ledger_key
from clients.node_data import NodeConfigError, node_partition
from fcl_flower.config import RunConfig
from fcl_flower.privacy.secagg import (
    SecureAggregationError,
    check_unmask_request,
    generate_keypair,
    load_signing_key,
    load_trusted_keys,
    make_shares,
    mask_arrays,
    new_seed,
    open_shares,
    round_context,
    sign_keys,
    sign_view,
    threshold_for,
    verify_keys,
    verify_view,
    view_context,
)
from fcl_flower.protocol import (
    DealtShares,
    Header,
    KeysIns,
    KeysRes,
    MaskedReport,
    PublicKeys,
    SharesIns,
    SharesRes,
    StatsIns,
    TrainIns,
    TrainRes,
    UnmaskIns,
    UnmaskRes,
)

if TYPE_CHECKING:  # the masked upload's side (a model, torch); keys, shares and unmask import none of it
    import torch

    from clients.job import ClientJob

STATE_RECORD = "secagg"  # context.state record of this node's secrets of the current secure round
NEXT_RECORD = "secagg-next"  # its private keys of the next secure round (shares ahead), until they are dealt over
SIGNING_KEY, TRUSTED_KEYS = "secagg-signing-key", "secagg-trusted-keys"  # node-config keys (signed-keys mode)


def _round_id(header: Header) -> str:
    return f"{header.run_id}|{header.task}|{header.stage}|{header.server_round}"


def _state(context: Context, header: Header, record: str = STATE_RECORD) -> ConfigRecord:
    state = context.state.config_records.get(record)
    if state is None or state.get("round") != _round_id(header):
        raise SecureAggregationError(
            "no secure-aggregation keys for this round on this node "
            "(it restarted, or the round is not the one it joined)"
        )
    return state


def _list(state: ConfigRecord, key: str, kind: type) -> list[Any]:
    values = state.get(key, [])
    if not isinstance(values, list) or not all(isinstance(v, kind) for v in values):
        raise SecureAggregationError(f"this node's secure-aggregation state has a bad '{key}'")
    return values


def _bytes(state: ConfigRecord, key: str) -> bytes:
    value = state.get(key)
    if not isinstance(value, bytes):
        raise SecureAggregationError(f"this node's secure-aggregation state lacks '{key}' for this round")
    return value


def _key_context(header: Header) -> bytes:
    """What a signature over a round's keys binds: the round itself (no participants known yet)."""
    return round_context(header.run_id, header.task, header.stage, header.server_round, header.attempt, ())


def _node_path(context: Context, key: str) -> str:
    path = context.node_config.get(key)
    if not isinstance(path, str) or not path:
        raise NodeConfigError(
            f"secagg-signed-keys is on but the node config names no {key} "
            f"(start the SuperNode with --node-config \"{key}='<path>'\")"
        )
    return path


def signed_mode(context: Context, cfg: RunConfig) -> bool:
    """Whether this round is signed. The run config comes from the server, so it cannot lower what
    the node's own config pins: a node given a signing key (node config ``secagg-signing-key``)
    signs every secure round and refuses a run that asks for unsigned keys; a node config
    ``secagg-min-clients`` is a floor the run cannot go below."""
    pinned = bool(context.node_config.get(SIGNING_KEY))
    if pinned and not cfg.secagg_signed_keys:
        raise SecureAggregationError(
            "this node signs its secure rounds (node config secagg-signing-key); the run asks for unsigned "
            "keys (secagg-signed-keys=false): refused"
        )
    floor = context.node_config.get("secagg-min-clients")
    if isinstance(floor, int) and cfg.secagg_min_clients < floor:
        raise SecureAggregationError(
            f"the run asks for secagg-min-clients={cfg.secagg_min_clients}, below this node's floor {floor}: refused"
        )
    return cfg.secagg_signed_keys


def handle_keys(ins: KeysIns, context: Context) -> KeysRes:
    """Make and keep two fresh key pairs; answer with the public halves (signed, in signed mode)."""
    context.state.config_records.pop(NEXT_RECORD, None)  # a key step: nothing kept ahead stays
    keys = _fresh_keys(context, ins.config, ins.header)
    return KeysRes(ins.header, node_partition(context.node_config, ins.config), 0, keys=keys)


def _fresh_keys(context: Context, cfg: RunConfig, header: Header, record: str = STATE_RECORD) -> PublicKeys:
    """Two fresh key pairs for the secure round of ``header`` (its key step, or an unmask
    instruction's ``prepare``): the private halves kept in this node's state for that round only,
    the public ones returned (signed over that round's context, in signed-keys mode)."""
    c_private, c_public = generate_keypair()
    s_private, s_public = generate_keypair()
    signer = signature = b""
    if signed_mode(context, cfg):
        key = load_signing_key(_node_path(context, SIGNING_KEY))
        signer, signature = sign_keys(key, c_public, s_public, _key_context(header))
    context.state.config_records[record] = ConfigRecord(
        {"round": _round_id(header), "c-private": c_private, "s-private": s_private}
    )
    return PublicKeys(c_public, s_public, signer, signature)


def _check_peers(
    context: Context, cfg: RunConfig, keys: Mapping[int, PublicKeys], header: Header, record: str = STATE_RECORD
) -> None:
    """My own keys are the ones I made; in signed mode every peer's are signed by a listed key."""
    state = _state(context, header, record)
    me = int(context.node_id)
    mine = keys.get(me)
    if mine is None:
        raise SecureAggregationError(f"this node ({me}) is not among the round's participants")
    if (mine.c, mine.s) != (_public_of(_bytes(state, "c-private")), _public_of(_bytes(state, "s-private"))):
        raise SecureAggregationError("the server relays keys for this node that this node did not make")
    if not signed_mode(context, cfg):
        return
    trusted = load_trusted_keys(_node_path(context, TRUSTED_KEYS))
    signers = [k.signer for k in keys.values()]
    if len(set(signers)) != len(signers):
        raise SecureAggregationError("two participants' keys are signed by the same SuperNode key")
    for node, k in keys.items():
        try:
            verify_keys(trusted, k.signer, k.signature, k.c, k.s, _key_context(header))
        except SecureAggregationError as err:
            raise SecureAggregationError(f"node {node}'s keys: {err}") from None


def _public_of(private: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def handle_shares(ins: SharesIns, context: Context) -> SharesRes:
    """Shamir-share a fresh self-mask seed and the mask key among the participants."""
    _check_dealing(context, ins.config, ins.keys, ins.header, ins.threshold)
    dealt = _deal(context, ins.keys, ins.header, ins.threshold)
    partition = node_partition(context.node_config, ins.config)
    return SharesRes(
        ins.header, partition, 0, shares=dealt.shares, commitments=dealt.commitments, secrets=dealt.secrets
    )


def _check_dealing(
    context: Context,
    cfg: RunConfig,
    keys: Mapping[int, PublicKeys],
    header: Header,
    threshold: int,
    record: str = STATE_RECORD,
) -> None:
    """What a shares step must pass before this node deals (a ``query.shares``, or shares ahead in
    an unmask step, over the keys kept in ``record``): its own keys, every peer's signature, enough
    participants, the threshold due, and no shares dealt over these keys before."""
    _check_peers(context, cfg, keys, header, record)
    if len(keys) < cfg.secagg_min_clients:
        raise SecureAggregationError(
            f"secure round with {len(keys)} participants; at least {cfg.secagg_min_clients} are required"
        )
    due = threshold_for(len(keys), cfg.secagg_min_clients, signed_mode(context, cfg))
    if threshold != due:
        raise SecureAggregationError(f"the server asks for threshold {threshold}; {due} is due")
    state = _state(context, header, record)
    if "seed" in state or "round-nodes" in state:
        raise SecureAggregationError(
            f"this node already dealt its shares for this round over nodes {_list(state, 'round-nodes', int)}; "
            "it does not deal them again: refused"
        )


def _deal(context: Context, keys: Mapping[int, PublicKeys], header: Header, threshold: int) -> DealtShares:
    """Shamir-share a fresh self-mask seed and the mask key over ``keys`` (checked:
    :func:`_check_dealing`), bound to the round's context with U1 = ``keys``' nodes."""
    state = _state(context, header)
    seed = new_seed()
    context_bytes = round_context(header.run_id, header.task, header.stage, header.server_round, header.attempt, keys)
    dealt = make_shares(
        int(context.node_id),
        seed,
        _bytes(state, "s-private"),
        _bytes(state, "c-private"),
        {n: k.c for n, k in keys.items()},
        threshold,
        context_bytes,
    )
    state["seed"] = seed
    state["round-nodes"] = sorted(keys)
    return DealtShares(dealt.bundles, dealt.commitments, dealt.secrets)


def node_ledger(context: Context, signed: bool) -> Ledger:
    """This node's ledger (clients/ledger.py) for the federation it serves: the node config's
    ``federation`` name, else in signed-keys mode the operator's list of SuperNode keys, which
    names the federation's members. In signed-keys mode the node is known by its own key, not by
    the node id the SuperLink assigns (a server that re-registers a node gets the same ledger)."""
    federation = context.node_config.get(FEDERATION_KEY)
    if not isinstance(federation, str) or not federation:
        federation = "default"
        if signed:
            federation = "keys:" + hashlib.sha256(Path(_node_path(context, TRUSTED_KEYS)).read_bytes()).hexdigest()
    identity = str(int(context.node_id))
    if signed:
        public = load_signing_key(_node_path(context, SIGNING_KEY)).public_key()
        identity = (
            "key:" + hashlib.sha256(public.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)).hexdigest()
        )
    return Ledger(ledger_folder(context.node_config), federation, identity)


def masked_upload(
    job: ClientJob,
    arrays: Mapping[str, torch.Tensor | np.ndarray],
    included: tuple[int, ...],
    contributed: Mapping[int, str] | Mapping[str, str],
) -> tuple[dict[str, np.ndarray], MaskedReport]:
    """Encode and mask ``arrays`` for this round's participants; keep only what unmasking needs.

    ``included``: the owed tasks whose statistics ride in the upload (checked again at unmasking);
    ``contributed``: ledger key -> digest of what this node itself puts in (a statistics round: its
    current task and the owed ones it sends; a stage-1 FedAvg round: that round's key,
    :func:`~clients.ledger.train_ledger_key`), which its ledger must allow over this view.
    Returns the masked arrays and what rides beside them: the signature over the view (signed-keys
    mode) and the dealers this node accuses.
    """
    ins = job.ins
    assert isinstance(ins, (StatsIns, TrainIns)) and ins.secagg is not None
    backfill = ins.backfill if isinstance(ins, StatsIns) else {}
    sec, header = ins.secagg, ins.header
    signed = signed_mode(job.context, job.cfg)
    state = _state(job.context, header)
    _check_peers(job.context, job.cfg, sec.participants, header)
    if list(sec.round_nodes) != _list(state, "round-nodes", int):
        raise SecureAggregationError("the round's key-round participants changed since the shares round")
    if sec.threshold != threshold_for(len(sec.round_nodes), job.cfg.secagg_min_clients, signed):
        raise SecureAggregationError(f"the server asks for threshold {sec.threshold}")
    if set(sec.shares) != set(sec.participants) or set(sec.commitments) != set(sec.participants):
        raise SecureAggregationError("the shares or commitments of some participants are missing")
    view = sorted(sec.participants)
    digests = {task: digest for task, digest in contributed.items() if digest}
    ledger = node_ledger(job.context, signed)
    for task in contributed:  # a stage-1 round's key is checked when the node reveals (ledger.record)
        if not isinstance(task, int) or task == header.task:
            continue
        earlier = ledger.contributed(header.run_id, task)
        if earlier is not None:
            raise SecureAggregationError(
                f"the server asks this node to backfill stage {task + 1}, which it already contributed "
                f"(opened over nodes {earlier}): refused"
            )
    me = int(job.context.node_id)
    context = round_context(
        header.run_id, header.task, header.stage, header.server_round, header.attempt, sec.round_nodes
    )
    masks = view_context(context, view, sec.binding(backfill))
    received, accused = open_shares(
        me,
        _bytes(state, "c-private"),
        {n: k.c for n, k in sec.participants.items()},
        sec.shares,
        sec.commitments,
        context,
    )
    masked = mask_arrays(
        {name: _float64(values) for name, values in arrays.items()},
        me,
        _bytes(state, "s-private"),
        _bytes(state, "seed"),
        {n: k.s for n, k in sec.participants.items()},
        masks,
        job.cfg.secagg_fraction_bits,
        job.cfg.secagg_min_clients,
    )
    signature = sign_view(load_signing_key(_node_path(job.context, SIGNING_KEY)), masks) if signed else b""
    owing = [client for client, tasks in backfill.items() if set(tasks) & set(included)]
    tasks = sorted(t for t in contributed if isinstance(t, int))
    rounds = sorted(t for t in contributed if isinstance(t, str))
    entries: dict[str, ConfigRecordValues] = {
        "round": _round_id(header),
        "participants": view,
        "view": masks,
        "signers": [sec.participants[n].signer for n in view],
        "threshold": sec.threshold,
        "share-src": sorted(received),
        "seed-share": [received[src][0] for src in sorted(received)],
        "key-share": [received[src][1] for src in sorted(received)],
        "client-nodes": sorted(sec.clients),
        "clients": [sec.clients[n] for n in sorted(sec.clients)],
        "included": list(included),
        "owing": owing,
        "owed": [",".join(str(t) for t in backfill.get(c, ())) for c in owing],
        "tasks": tasks,
        "digests": [digests.get(t, "") for t in tasks],
        "rounds": rounds,
        "round-digests": [digests.get(t, "") for t in rounds],
        "signed": signed,
    }
    job.context.state.config_records[STATE_RECORD] = ConfigRecord(entries)  # the private keys and seed are gone
    # shares ahead: the next round's fresh keys, kept apart from this round's until its unmask step
    job.context.state.config_records.pop(NEXT_RECORD, None)
    next_keys = None if sec.prepare is None else _fresh_keys(job.context, job.cfg, sec.prepare, NEXT_RECORD)
    return masked, MaskedReport(signature, accused, next_keys=next_keys)


def _float64(values: torch.Tensor | np.ndarray) -> np.ndarray:
    torch = sys.modules.get("torch")  # a tensor implies torch is loaded; never import it for this
    if torch is not None and isinstance(values, torch.Tensor):
        return values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64)


def masked_train_reply(job: ClientJob, num_examples: int) -> TrainRes:
    """A stage-1 FedAvg round under secure aggregation: the trained state leaves only masked, as
    the fixed-point vector of (n_k · w_k, n_k) (fcl_flower/privacy/secure_fedavg.py); the reply's
    ``num-examples`` and ``train-loss`` are 0. The node's ledger knows the round by its own key
    (never an analytic stage's) and, in signed-keys mode, the upload by its digest."""
    from fcl_flower.models import trainable_state
    from fcl_flower.privacy.secure_fedavg import COUNT, WEIGHTS, upload_vector
    from fcl_flower.protocol.payloads import MaskedFedAvgState

    ins = job.ins
    assert isinstance(ins, TrainIns) and ins.secagg is not None
    vector = upload_vector(trainable_state(job.model), num_examples, job.cfg.weighted_fedavg)
    digest = input_digest(vector[WEIGHTS].tobytes(), vector[COUNT].tobytes()) if job.cfg.secagg_signed_keys else ""
    ring, report = masked_upload(job, vector, (), {train_ledger_key(ins.header.server_round): digest})
    model = MaskedFedAvgState(ring[WEIGHTS], ring[COUNT]).to_record()
    return TrainRes(ins.header, job.partition, 0, model=model, loss=0.0, secagg=report)


def _check_view(ins: UnmaskIns, state: ConfigRecord, participants: list[int]) -> None:
    """Signed-keys mode: every survivor signed the very view this node masked over."""
    view = _bytes(state, "view")
    signers = dict(zip(participants, _list(state, "signers", bytes), strict=True))
    for node in ins.survivors:
        signature = ins.signatures.get(node)
        if signature is None:
            raise SecureAggregationError(f"the unmask request carries no signature of survivor {node} over this view")
        try:
            verify_view(signers[node], signature, view)
        except SecureAggregationError as err:
            raise SecureAggregationError(f"survivor {node}: {err}: refused") from None


def handle_unmask(ins: UnmaskIns, context: Context) -> UnmaskRes:
    """Reveal the shares asked for, after checking the request and writing the ledger; then forget the round."""
    state = _state(context, ins.header)
    participants = _list(state, "participants", int)
    threshold = state.get("threshold")
    if not isinstance(threshold, int):
        raise SecureAggregationError("this node's secure-aggregation state has no threshold")
    check_unmask_request(ins.survivors, ins.dropped, participants, threshold)
    if int(context.node_id) in ins.dropped:
        raise SecureAggregationError("the unmask request lists this node itself as dropped: refused")
    signed = state.get("signed")
    if not isinstance(signed, bool):
        raise SecureAggregationError("this node's secure-aggregation state has no signed flag")
    if signed:  # as at the masked upload: the unmask request cannot switch it off
        _check_view(ins, state, participants)
    # shares ahead, where this node is in the next round's U1 (else it deals nothing and its keys
    # made ahead are dropped): checked as a shares step is, before anything is revealed
    deal_ahead = ins.ahead is not None and int(context.node_id) in ins.ahead.keys
    if deal_ahead:
        assert ins.ahead is not None and ins.prepare is not None  # parse: no shares step without its key step
        _check_dealing(context, ins.config, ins.ahead.keys, ins.prepare, ins.ahead.threshold, NEXT_RECORD)
    clients = dict(zip(_list(state, "client-nodes", int), _list(state, "clients", int), strict=True))
    alive = {clients[node] for node in ins.survivors}
    owed = {
        client: {int(t) for t in tasks.split(",") if t}
        for client, tasks in zip(_list(state, "owing", int), _list(state, "owed", str), strict=True)
    }
    for task in _list(state, "included", int):
        owing_alive = [c for c, tasks in owed.items() if task in tasks and c in alive]
        if len(owing_alive) < ins.config.secagg_min_clients:
            raise SecureAggregationError(
                f"only {len(owing_alive)} surviving participant(s) owe stage {task + 1}: "
                "its class sums would open for too few clients; refused"
            )
    sources = _list(state, "share-src", int)  # the dealers whose bundles opened (the accused are not among them)
    seed_share = dict(zip(sources, _list(state, "seed-share", bytes), strict=True))
    key_share = dict(zip(sources, _list(state, "key-share", bytes), strict=True))
    tasks: list[Key] = [*_list(state, "tasks", int), *_list(state, "rounds", str)]
    digests = {
        t: d
        for t, d in zip(tasks, [*_list(state, "digests", str), *_list(state, "round-digests", str)], strict=True)
        if d
    }
    # the set the sum is opened over is the survivors': each input is opened over one such set only
    node_ledger(context, signed).record(ins.header.run_id, tasks, ins.survivors, digests)
    del context.state.config_records[STATE_RECORD]  # nothing of the round stays on the node
    kept = context.state.config_records.pop(NEXT_RECORD, None)  # keys made ahead: used here or dropped
    next_keys, next_shares = None, None
    if deal_ahead:
        # shares ahead: the next round's shares over the keys sent with the masked upload (after the ledger)
        assert ins.ahead is not None and ins.prepare is not None and kept is not None  # _check_dealing read them
        context.state.config_records[STATE_RECORD] = kept
        next_shares = _deal(context, ins.ahead.keys, ins.prepare, ins.ahead.threshold)
    elif ins.ahead is None and ins.prepare is not None:
        # keys ahead: the next round's fresh keys, as its key step would make them (after the ledger)
        next_keys = _fresh_keys(context, ins.config, ins.prepare)
    partition = node_partition(context.node_config, ins.config)
    return UnmaskRes(
        ins.header,
        partition,
        0,
        seed_shares={n: seed_share[n] for n in ins.survivors if n in seed_share},
        key_shares={n: key_share[n] for n in ins.dropped if n in key_share},
        next_keys=next_keys,
        next_shares=next_shares,
    )
