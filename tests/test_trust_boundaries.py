"""Every attack and fault of the trust-boundaries issue, driven through the real strategy loop and
client handlers (LocalGrid, digits, M = 60). Each test asserts the outcome: the bad reply is
rejected with its reason, or the run completes with the fault-free result, or (secure mode) the
stage fails cleanly; and for secure aggregation, playing the server with every message it
received opens nothing but the survivors' sum.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from clients.app import app as client_app
from fcl_flower.analytic import pack_upper, random_features, random_projection, unpack_upper
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.local_grid import LocalGrid
from fcl_flower.privacy.secagg import (
    SecureAggregationError,
    decode_fixed_point,
    encode_fixed_point,
    pair_mask,
    reconstruct,
    round_context,
)
from fcl_flower.protocol import parse_instruction
from fcl_flower.protocol.secure import PublicKeys, SharesIns
from fcl_flower.runtime import build_model, federated_split
from strategies.checkpoint import run_folder_lock
from tests.conftest import NODE_BASE, build, reply_partition, run_in_process, sent_header, server_identity, small_config

SETTINGS = dict(num_tasks=5, num_clients=3, rf_dim=60, seed=0)
BAD_TASK = 1  # the tampered stage (the second)


def config(tmp: Path, **changes) -> RunConfig:
    return small_config(tmp, **{**SETTINGS, **changes})


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, object]:
    out = Path(tmp_path_factory.mktemp("clean"))
    return {
        name: run_in_process(small_config(out, **{**SETTINGS, "strategy": name, "dummy_clients": 2, "run_name": name}))
        for name in ("stsa", "stsa-e")
    }


def corrupt(victim: int, change, phase_suffix: str = "stats"):
    """Apply ``change(reply)`` to ``victim``'s statistics reply of stage BAD_TASK."""

    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if task == BAD_TASK and phase.endswith(phase_suffix):
            for m in replies:
                if not m.has_error() and reply_partition(m) == victim:
                    change(m)
        return replies

    return tamper


def array(m: Message, key: str) -> np.ndarray:
    return m.content.array_records["arrays"][key].numpy().copy()


def put(m: Message, key: str, value: np.ndarray) -> None:
    m.content.array_records["arrays"][key] = Array(np.ascontiguousarray(value))


def rejected_then_fault_free(strategy, clean_run, victim: int, reason: str) -> None:
    """The bad reply is named and rejected with ``reason``; the victim backfills the stage next,
    so from then on the classifier is the fault-free run's."""
    stage = strategy.recorder.stages[BAD_TASK]
    assert reason in stage.left_out[f"client-{victim}"], stage.left_out
    assert stage.extra["statistics_missing"] == {f"client-{victim}": [BAD_TASK + 1]}
    assert strategy.recorder.stages[BAD_TASK + 1].extra["backfilled"] == {f"client-{victim}": [BAD_TASK + 1]}
    for w, w_clean in zip(strategy.stage_weights[BAD_TASK + 1 :], clean_run.stage_weights[BAD_TASK + 1 :], strict=True):
        assert float((w - w_clean).norm() / w_clean.norm()) < 1e-9


# ------------------------------------------------------------------------------ poisoned plain uploads
def _gram(m: Message, dim: int, make) -> None:
    put(
        m,
        "gram-packed",
        pack_upper(
            make(torch.from_numpy(unpack_upper(torch.from_numpy(array(m, "gram-packed")), dim).numpy()))
        ).numpy(),
    )


def _entry(m: Message, index: int, value: float) -> None:
    """One entry of the packed upload set to ``value`` (index 1 and -2 are off-diagonal)."""
    packed = array(m, "gram-packed")
    packed[index] = value
    put(m, "gram-packed", packed)


PLAIN_ATTACKS = {
    # name: (how the upload is changed, words of the rejection)
    "gram-negative-identity": (lambda m: _gram(m, 60, lambda g: -1e4 * torch.eye(60, dtype=torch.float64)), "negative"),
    "gram-1e300": (lambda m: put(m, "gram-packed", array(m, "gram-packed") * 0 + 1e300), "magnitude"),
    # one off-diagonal entry: the parse leaves G to the screen, whose one pass must still catch it
    "gram-nan-off-diagonal": (lambda m: _entry(m, 1, float("nan")), "G contains NaN or inf"),
    "gram-inf-in-the-last-chunk": (lambda m: _entry(m, -2, float("inf")), "G contains NaN or inf"),
    "gram-2e150-off-diagonal": (lambda m: _entry(m, -2, 2e150), "G has an entry of magnitude 2e+150"),
    "gram-negative-off-diagonal": (lambda m: _entry(m, 1, -1.0), "negative entries"),
    "class-sums-x1000": (lambda m: put(m, "class-sums", array(m, "class-sums") * 1000), "Cauchy-Schwarz"),
    "label-columns-swapped": (lambda m: put(m, "class-sums", array(m, "class-sums")[:, ::-1]), "Cauchy-Schwarz"),
    "class-sums-1.7e308": (lambda m: put(m, "class-sums", np.full_like(array(m, "class-sums"), 1.7e308)), "magnitude"),
    "counts-complex": (lambda m: put(m, "counts", array(m, "counts").astype(np.complex128)), "dtype complex128"),
    "counts-uint64": (lambda m: put(m, "counts", array(m, "counts").astype(np.uint64)), "dtype uint64"),
}


@pytest.mark.parametrize("name", sorted(PLAIN_ATTACKS))
def test_a_poisoned_stsa_upload_is_rejected_and_the_run_ends_fault_free(clean, tmp_path, name) -> None:
    change, reason = PLAIN_ATTACKS[name]
    victim = 0 if name == "label-columns-swapped" else 1  # client 0 holds its two classes unevenly
    strategy = run_in_process(config(tmp_path), corrupt(victim, change))
    rejected_then_fault_free(strategy, clean["stsa"], victim, reason)


@pytest.mark.parametrize("dtype", [np.complex128, np.uint64])
def test_stsa_e_counts_of_a_foreign_dtype_are_rejected(clean, tmp_path, dtype) -> None:
    strategy = run_in_process(
        config(tmp_path, strategy="stsa-e", dummy_clients=2),
        corrupt(1, lambda m: put(m, "counts", array(m, "counts").astype(dtype))),
    )
    rejected_then_fault_free(strategy, clean["stsa-e"], 1, f"dtype {np.dtype(dtype)}")


def test_negative_stsa_e_class_sums_are_rejected(clean, tmp_path) -> None:
    """Random ReLU features are >= 0, so are their class sums."""
    strategy = run_in_process(
        config(tmp_path, strategy="stsa-e", dummy_clients=2),
        corrupt(1, lambda m: put(m, "class-sums", -array(m, "class-sums"))),
    )
    rejected_then_fault_free(strategy, clean["stsa-e"], 1, "negative entries")


FEDRAN_ATTACKS = {
    # name: (config changes, how the upload is changed, words of the rejection)
    "label-corr-x1000": ({}, lambda m: put(m, "label-corr", array(m, "label-corr") * 1000), "exceeds σ₁·√n"),
    "sigma-x1000-with-clip": (
        {"feature_clip": 1.0},
        lambda m: put(m, "singular-values", array(m, "singular-values") * 1000),
        "Σσ² exceeds n·B²",
    ),
}


@pytest.mark.parametrize("name", sorted(FEDRAN_ATTACKS))
def test_a_poisoned_fedran_upload_is_rejected_alone(tmp_path, name) -> None:
    """FedRAN does not backfill: the client is left out of that stage with the reason, the others
    are merged, and every stage is solved."""
    changes, change, reason = FEDRAN_ATTACKS[name]
    cfg = config(tmp_path, strategy="fedran", rank=20, **changes)
    strategy = run_in_process(cfg, corrupt(1, change))
    stages = strategy.recorder.stages
    assert reason in stages[BAD_TASK].left_out["client-1"]
    assert sorted(stages[BAD_TASK].extra["rank"]["clients"]) == ["client-0", "client-2"]
    assert len(strategy.stage_weights) == cfg.num_tasks
    assert all(not stage.left_out for t, stage in enumerate(stages) if t != BAD_TASK)


def test_statistics_of_task_0_replayed_in_task_1_are_rejected(clean, tmp_path) -> None:
    """The replayed reply carries task 0's header (it was built for that round): refused at parse."""
    stored: dict[int, Message] = {}

    def replay(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if phase != "stsa-stats":
            return replies
        if task == 0:
            stored.update({reply_partition(m): m for m in replies})
        if task == BAD_TASK:
            return [stored[1] if reply_partition(m) == 1 else m for m in replies]
        return replies

    strategy = run_in_process(config(tmp_path), replay)
    rejected_then_fault_free(strategy, clean["stsa"], 1, "reply is for task 0, this round is 1")


# ------------------------------------------------------------------------------ identity
def run_with_an_impostor(cfg: RunConfig) -> tuple[object, LocalGrid, int]:
    """Run ``cfg`` on a LocalGrid where an extra node (id NODE_BASE - 1) also serves client 0's
    partition and answers first; (the strategy, the grid, the impostor's node id)."""
    server_identity()
    grid = LocalGrid(client_app, cfg.num_clients, first_node_id=NODE_BASE)
    impostor = NODE_BASE - 1
    forged = Context(
        run_id=1,
        node_id=impostor,
        node_config={"partition-id": 0, "num-partitions": cfg.num_clients},
        state=RecordDict(),
        run_config={},
    )
    grid.contexts = {impostor: forged, **grid.contexts}  # it answers first
    strategy = build(cfg)
    strategy.start(grid)
    return strategy, grid, impostor


def test_a_node_claiming_another_clients_id_cannot_take_it_over(clean, tmp_path) -> None:
    """An extra node claims client 0 and answers first: at first contact both claim client 0, so
    neither is mapped and client 0 is left out, named as contested; the forged data is never used."""
    strategy, _, impostor = run_with_an_impostor(config(tmp_path))
    for stage in strategy.recorder.stages:
        assert stage.clients == ["client-1", "client-2"]
        assert stage.left_out["client-0"] == f"contested by nodes {impostor}, {NODE_BASE}"
    assert strategy.nodes.client_of == {NODE_BASE + 1: 1, NODE_BASE + 2: 2}


def test_under_secure_aggregation_the_key_step_is_the_first_contact_and_an_impostor_takes_nothing(tmp_path) -> None:
    """A secure run sends no ``query.info``: its first key step goes to the nodes not heard from and
    their key replies are their first contact, every claim settled before any key is identified. An
    extra node claiming client 0 and answering first gets client 0 contested, as in a plain run:
    neither node is mapped, neither's keys are in U1, no bundle is dealt to or by them, and the
    stages are those of clients 1..3 alone (the masked sums need no client 0)."""
    strategy, grid, impostor = run_with_an_impostor(config(tmp_path, num_clients=4, secure_aggregation=True))
    kinds = [m.metadata.message_type for m in grid.sent]
    assert "query.info" not in kinds and kinds[0] == "query.keys"
    for stage in strategy.recorder.stages:
        assert stage.clients == ["client-1", "client-2", "client-3"]
        assert stage.left_out["client-0"] == f"contested by nodes {impostor}, {NODE_BASE}"
        assert "failed" not in stage.extra
    assert strategy.nodes.client_of == {NODE_BASE + n: n for n in (1, 2, 3)}
    shares = [parse_instruction(m) for m in grid.sent if m.metadata.message_type == "query.shares"]
    assert shares and all(not {impostor, NODE_BASE} & set(ins.keys) for ins in shares if isinstance(ins, SharesIns))
    assert {m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "query.shares"} == {
        NODE_BASE + n for n in (1, 2, 3)
    }


def test_a_mapped_node_claiming_a_second_client_is_rejected_and_named(clean, tmp_path) -> None:
    def claim(m: Message) -> None:
        m.content.metric_records["metrics"]["partition-id"] = 2

    strategy = run_in_process(config(tmp_path), corrupt(1, claim))
    rejected_then_fault_free(
        strategy, clean["stsa"], 1, f"node {NODE_BASE + 1} serves client-1 and now claims client-2: rejected"
    )


# ------------------------------------------------------------------------------ checkpoints and folders
class Exploit:
    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))

    marker = ""


def test_a_crafted_pickle_checkpoint_is_never_loaded(tmp_path) -> None:
    cfg = config(tmp_path, resume=True)
    cfg.output_dir.mkdir(parents=True)
    Exploit.marker = str(tmp_path / "pwned")
    (cfg.output_dir / "checkpoint.pt").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(ConfigError, match="pickled checkpoint of an earlier version, which fcl-flower no longer loads"):
        run_in_process(cfg)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "tensors"])
def test_a_corrupted_checkpoint_gives_one_line_naming_the_file(tmp_path, damage) -> None:
    cfg = config(tmp_path, num_tasks=2)
    run_in_process(cfg)
    path = cfg.output_dir / "checkpoint.json"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x80\x04not a checkpoint")
    else:
        tensors = next(cfg.output_dir.glob("checkpoint-*.safetensors"))
        tensors.write_bytes(tensors.read_bytes()[:-100])
    with pytest.raises(ConfigError) as err:
        run_in_process(cfg.replace(resume=True))
    message = str(err.value)
    assert "\n" not in message and "checkpoint" in message and "restore a backup" in message


def test_a_second_server_on_the_same_folder_stops_at_once(tmp_path) -> None:
    cfg = config(tmp_path, num_tasks=2)
    with run_folder_lock(cfg.output_dir), pytest.raises(ConfigError, match="another server is running in"):
        from experiments.sim import run_local

        run_local(cfg)
    assert not (cfg.output_dir / "results.json").exists()  # it wrote nothing


# ------------------------------------------------------------------------------ secure aggregation
def secure_capture(tmp_path: Path, **changes):
    """A secure run that records every message the server received, by step."""
    received: list[tuple[int, str, Message]] = []
    tamper = changes.pop("tamper", None)

    def keep(task: int, phase: str, replies: list[Message]) -> list[Message]:
        replies = replies if tamper is None else tamper(task, phase, replies)
        received.extend((task, phase, m) for m in replies)
        return replies

    strategy = run_in_process(config(tmp_path, num_clients=5, secure_aggregation=True, **changes), keep)
    return strategy, received


def direct_statistics(cfg: RunConfig, task: int, client: int) -> np.ndarray:
    """The true packed G of one client's data of one task (what must stay hidden)."""
    split = federated_split(cfg)
    model = build_model(cfg, split).eval()
    projection = random_projection(model.backbone.feature_dim, cfg.rf_dim, seed=cfg.seed)
    images, _ = split.client_train(task, client, eval_transform=True).tensors()
    with torch.no_grad():
        phi = random_features(model.features(images), projection)
    return pack_upper(phi.T @ phi).numpy()


def test_playing_the_server_a_rejected_upload_stays_hidden(tmp_path) -> None:
    """Client 1's masked upload of stage 2 is rejected after all uploads are in. The server keeps
    every message: it rebuilds client 1's mask key (it is treated as dropped) and removes its
    pairwise masks, but no share of client 1's self-mask seed was ever revealed, so what is left
    is not client 1's statistics; and nothing was sent twice."""

    def reject(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if task == BAD_TASK and phase == "stsa-stats":
            for m in replies:
                if reply_partition(m) == 1:
                    m.content.metric_records["metrics"]["partition-id"] = 99  # fails identification
        return replies

    strategy, received = secure_capture(tmp_path, tamper=reject)
    cfg = strategy.cfg
    victim_node = NODE_BASE + 1
    stage = [(p, m) for t, p, m in received if t == BAD_TASK]
    # the round's keys came ahead, with the masked uploads of the stage before (shares ahead, strategies/secure.py)
    ahead = [m for t, p, m in received if t == BAD_TASK - 1 and p == "stsa-stats"]
    s_public = {m.metadata.src_node_id: m.content.config_records["secagg"]["next-s"] for m in ahead}
    assert not [m for p, m in stage if p == "secagg-keys"]
    unmask = [m for p, m in stage if p == "secagg-unmask"]
    upload = next(m for p, m in stage if p == "stsa-stats" and m.metadata.src_node_id == victim_node)
    seed_shares = [m.content.config_records["secagg"] for m in unmask]
    assert all(victim_node not in record["seed-nodes"] for record in seed_shares)  # b never revealed
    key_shares = [record["key-shares"][record["key-nodes"].index(victim_node)] for record in seed_shares]
    victim_key = reconstruct(key_shares, 3)  # the server can rebuild the dropped node's mask key ...
    nodes = sorted(s_public)
    header = sent_header(upload)
    context = round_context(header.run_id, header.task, header.stage, header.server_round, header.attempt, nodes)
    masked = upload.content.array_records["arrays"]["gram-packed"].numpy().reshape(-1)
    without_pairs = masked.copy()
    for peer in nodes:  # ... and strip every pairwise mask of the victim's upload
        if peer != victim_node:
            without_pairs -= pair_mask(
                victim_node, victim_key, peer, s_public[peer], masked.size, context, "gram-packed"
            )
    truth = encode_fixed_point(direct_statistics(cfg, BAD_TASK, 1), cfg.secagg_fraction_bits, 5)
    assert not np.any(without_pairs == truth)  # still hidden by PRG(b_1)
    assert np.abs(decode_fixed_point(without_pairs, cfg.secagg_fraction_bits)).mean() > 1e9  # noise
    with pytest.raises(SecureAggregationError):
        reconstruct([], 3)
    uploads_per_client = [reply_partition(m) for t, p, m in received if p == "stsa-stats" and t == BAD_TASK]
    assert sorted(uploads_per_client) == [0, 2, 3, 4, 99]  # one upload each, no second attempt
    assert strategy.recorder.stages[BAD_TASK].clients == ["client-0", "client-2", "client-3", "client-4"]


def test_playing_the_server_the_opened_sum_is_all_it_learns(tmp_path) -> None:
    """With every message the server received in a fault-free secure stage, the only thing that
    decodes is the sum over the participants: each upload alone, or any sum over fewer than all of
    them, is noise in every entry."""
    strategy, received = secure_capture(tmp_path)
    cfg = strategy.cfg
    uploads = {
        m.metadata.src_node_id: m.content.array_records["arrays"]["gram-packed"].numpy()
        for t, p, m in received
        if t == BAD_TASK and p == "stsa-stats"
    }
    bits = cfg.secagg_fraction_bits
    truth = {client: direct_statistics(cfg, BAD_TASK, client) for client in range(5)}
    total = sum(truth.values())
    for node, masked in uploads.items():
        decoded = decode_fixed_point(masked, bits)
        assert np.all(np.abs(decoded - truth[node - NODE_BASE]) > 1.0)
    partial = decode_fixed_point(sum(uploads[n] for n in sorted(uploads)[:4]), bits)
    assert np.all(np.abs(partial - (total - truth[4])) > 1.0)


def test_secure_garbage_fails_the_stage_cleanly(clean, tmp_path) -> None:
    """A masked upload of the right shape but made of garbage cannot be told apart before opening;
    the opened sum fails its checks: the stage fails, the previous classifier is kept, the run
    goes on (and stops with one line under require-all-clients)."""

    def garbage(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if task == BAD_TASK and phase == "stsa-stats":
            for m in replies:
                if reply_partition(m) == 1:
                    put(
                        m,
                        "counts",
                        np.random.default_rng(0).integers(0, 2**63, array(m, "counts").shape, dtype=np.uint64),
                    )
        return replies

    strategy = run_in_process(config(tmp_path, num_clients=5, secure_aggregation=True), garbage)
    stage = strategy.recorder.stages[BAD_TASK]
    assert stage.extra["failed"].startswith("the opened secure sum fails its checks")
    assert torch.equal(strategy.stage_weights[BAD_TASK - 1], strategy.stage_weights[BAD_TASK - 1])
    assert len(strategy.recorder.stages) == 5  # the run went on
    from strategies.loop import RunFailed

    with pytest.raises(RunFailed, match="stage 2 failed: the opened secure sum fails its checks"):
        run_in_process(
            config(tmp_path, num_clients=5, secure_aggregation=True, require_all_clients=True, run_name="strict"),
            garbage,
        )


# ------------------------------------------------------------------------------ signed keys
def write_signing_keys(folder: Path, nodes: list[int]) -> dict[int, dict[str, str]]:
    """One ECDSA P-384 SuperNode key per node (OpenSSH, as deploy/make_keys.sh writes) and the
    operator's list of their public halves; node -> its node config."""
    folder.mkdir(parents=True, exist_ok=True)
    lines, configs = [], {}
    for node in nodes:
        key = ec.generate_private_key(ec.SECP384R1())
        path = folder / f"supernode-{node}"
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
            )
        )
        lines.append(
            key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
        )
        configs[node] = {"secagg-signing-key": str(path)}
    (folder / "trusted.pub").write_text("\n".join(lines) + "\n")
    for node in nodes:
        configs[node]["secagg-trusted-keys"] = str(folder / "trusted.pub")
    return configs


class SubstitutingGrid(LocalGrid):
    """A server that shows client 2's peers its own mask key instead of client 2's (substitution)."""

    def deliver(self, messages):
        out = []
        for message in messages:
            if message.metadata.message_type == "query.shares" and message.metadata.dst_node_id != NODE_BASE + 2:
                ins = parse_instruction(message)
                assert isinstance(ins, SharesIns)
                victim = NODE_BASE + 2
                keys = {
                    **ins.keys,
                    victim: PublicKeys(
                        ins.keys[victim].c, b"\x09" * 32, ins.keys[victim].signer, ins.keys[victim].signature
                    ),
                }
                message = SharesIns(
                    ins.header, ins.config, keys=keys, clients=ins.clients, threshold=ins.threshold
                ).to_message(message.metadata.dst_node_id)
            out.append(message)
        return super().deliver(out)


@pytest.mark.parametrize("signed", [True, False])
def test_signed_keys_stop_a_server_that_substitutes_a_key(tmp_path, signed) -> None:
    cfg = config(tmp_path, num_clients=5, num_tasks=2, secure_aggregation=True, secagg_signed_keys=signed)
    server_identity()
    grid = SubstitutingGrid(client_app, 5, first_node_id=NODE_BASE)
    for node, extra in write_signing_keys(tmp_path / "keys", list(grid.contexts)).items():
        grid.contexts[node].node_config.update(extra)
    strategy = build(cfg)
    strategy.start(grid)
    first = strategy.recorder.stages[0]
    errors = [r.error.reason for r in grid.replies if r.has_error()]
    if signed:  # every client refuses the substituted key: nothing is shared, the stage fails cleanly
        assert first.extra["failed"].startswith("1 node(s) shared their secrets")  # the victim alone
        assert any(
            f"node {NODE_BASE + 2}'s keys: the signature over the round's keys does not verify" in e for e in errors
        )
    else:  # without signatures no peer can notice the substitution (the docs say so)
        assert not any("signature" in e or "did not make" in e for e in errors)


# ------------------------------------------------------------------------------ records no method reads
LGA_REPORT = {
    "lga-cb": 0.0,
    "lga-sd": 0.0,
    "lga-detected": 0,
    "lga-new-task": 0,
    "lga-memory": 0,
    "lga-proto-classes": 0,
}


@pytest.mark.parametrize("data", [b"not an .npy buffer", b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f4'"])
def test_an_undecodable_array_in_a_record_the_method_ignores_is_rejected_not_a_crash(tmp_path, caplog, data) -> None:
    """A FedAvg client adds LGA's report and an ``lga-proto`` record whose array is no .npy buffer:
    the parse admits the record (LGA's own replies carry it) and FedAvg never reads it, but the
    server's byte count of the reply does. The reply is rejected with its reason, the round goes on."""
    victim = 1

    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if task == 0 and phase == "fedavg":
            for m in replies:
                if not m.has_error() and reply_partition(m) == victim:
                    m.content.metric_records["metrics"].update(LGA_REPORT)
                    m.content.array_records["lga-proto"] = ArrayRecord(
                        {"0/0": Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=data)}
                    )
        return replies

    strategy = run_in_process(config(tmp_path, stage1_rounds=1, num_tasks=2), tamper)
    fedavg_round = strategy.recorder.rounds[0]
    assert (fedavg_round["replies"], fedavg_round["rejected"]) == (2, 1), fedavg_round  # 2 kept, 1 rejected
    assert any(
        f"Rejected upload from client-{victim}" in r.getMessage()
        and "record 'lga-proto' cannot be decoded" in r.getMessage()
        for r in caplog.records
    )
    assert len(strategy.recorder.stages) == 2 and all(s.accuracy > 0 for s in strategy.recorder.stages)


def secure_run_with_first_key_reply_changed(tmp_path: Path, change) -> tuple[object, LocalGrid]:
    """A secure run of 4 clients, 2 tasks, in which ``change`` alters client 0's node's reply to the
    run's first key step (its first contact); (the strategy, the grid)."""
    changed: list[int] = []

    def tamper(delivered: list[Message], replies: list[Message]) -> list[Message]:
        if not changed and delivered[0].metadata.message_type == "query.keys":
            for m in replies:
                if m.metadata.src_node_id == NODE_BASE:
                    change(m)
                    changed.append(NODE_BASE)
        return replies

    server_identity()
    grid = LocalGrid(client_app, 4, first_node_id=NODE_BASE, tamper=tamper)
    strategy = build(config(tmp_path, num_tasks=2, num_clients=4, secure_aggregation=True))
    strategy.start(grid)
    assert changed
    return strategy, grid


def test_a_key_reply_from_a_node_that_was_not_asked_claims_nothing(tmp_path) -> None:
    """A reply to the first key step whose sender is a node the step was not sent to (a forged
    sender: Flower's SuperLink refuses one, a compromised one would not) is rejected before it is
    parsed: it maps no node and brings no keys into the round, and the client whose reply it was
    stays with its own node."""
    ghost = NODE_BASE - 5

    def forge(m: Message) -> None:  # client 0's node's reply, sent as from the ghost
        m.metadata.__dict__["_src_node_id"] = ghost

    strategy, grid = secure_run_with_first_key_reply_changed(tmp_path, forge)
    assert ghost not in strategy.nodes.client_of
    shares = [parse_instruction(m) for m in grid.sent if m.metadata.message_type == "query.shares"]
    assert all(isinstance(ins, SharesIns) and ghost not in ins.keys for ins in shares)
    left_out = strategy.recorder.stages[0].left_out  # client 0's own reply never came: it sits stage 1 out
    assert left_out[f"node-{ghost}"] == "secagg-keys: a reply from a node this step was not sent to"
    assert set(left_out) == {f"node-{ghost}", "client-0"}
    assert strategy.recorder.stages[1].clients == [f"client-{c}" for c in range(4)]
    assert strategy.nodes.client_of[NODE_BASE] == 0


def test_two_new_nodes_claiming_a_served_client_cannot_take_it_out(tmp_path) -> None:
    """Two nodes that join after client 0's node was mapped and both claim client 0 are rejected
    (a client already served by another node is not theirs to contest): client 0 keeps its node and
    every stage."""
    cfg = config(tmp_path, num_tasks=2)
    server_identity()
    grid = LocalGrid(client_app, cfg.num_clients, first_node_id=NODE_BASE)
    joined: list[int] = []

    def join(task: int) -> None:
        if task == 1 and not joined:
            for node in (NODE_BASE - 1, NODE_BASE - 2):
                grid.contexts[node] = Context(
                    run_id=1,
                    node_id=node,
                    node_config={"partition-id": 0, "num-partitions": cfg.num_clients},
                    state=RecordDict(),
                    run_config={},
                )
                joined.append(node)

    strategy = build(cfg)
    begin = strategy.begin_round

    def begin_round(plan):
        join(plan.task)
        return begin(plan)

    strategy.begin_round = begin_round
    strategy.start(grid)
    assert joined
    assert strategy.nodes.contested == {}
    assert strategy.nodes.client_of[NODE_BASE] == 0 and not set(joined) & set(strategy.nodes.client_of)
    for stage in strategy.recorder.stages:
        assert stage.clients == [f"client-{c}" for c in range(cfg.num_clients)]


def _drop_header(m: Message) -> None:
    del m.content.config_records["header"]


def _earlier_round(m: Message) -> None:
    m.content.config_records["header"]["round"] = 0  # a reply to another round, replayed


@pytest.mark.parametrize(
    ("change", "reason"),
    [(_drop_header, "message has no 'header' record"), (_earlier_round, "reply is for server round 0")],
)
def test_a_bad_key_reply_at_first_contact_maps_nothing_and_the_node_joins_later(tmp_path, change, reason) -> None:
    """The first key step is a node's first contact under secure aggregation: a reply to it that
    does not parse (no header, or a replay of another round) maps nobody, brings no keys and is
    named with its reason; the round runs on the others and the node is mapped at the next key step."""
    strategy, grid = secure_run_with_first_key_reply_changed(tmp_path, change)
    first = strategy.recorder.stages[0]
    assert "client-0" not in first.clients and reason in first.left_out[f"node-{NODE_BASE}"]
    shares = [parse_instruction(m) for m in grid.sent if m.metadata.message_type == "query.shares"]
    assert isinstance(shares[0], SharesIns) and NODE_BASE not in shares[0].keys
    assert strategy.recorder.stages[1].clients == [f"client-{c}" for c in range(4)]
    assert strategy.nodes.client_of[NODE_BASE] == 0
