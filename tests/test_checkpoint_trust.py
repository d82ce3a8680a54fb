"""Attacks on the run folder (issue 31): a checkpoint tampered with the way someone who can write the
run folder would (recomputing the digests in checkpoint.json), a run folder or lock file that is a
symbolic link, and the key that signs checkpoints.

Every tampered checkpoint is refused at resume with ONE line naming the file (and, where the
signature is right, the field), results.json is left as it was, and nothing resumes into a
silently wrong "completed" run. Two attackers are played:

* without the key (anyone who can write the run folder): the signature no longer matches;
* with the key (or a server bug that wrote nonsense and signed it): the restored state is checked
  as strictly as a fresh upload, field by field.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import strategies.loop
from fcl_flower.analytic import pack_upper, unpack_upper
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.state_io import StateError, load_state, save_state, signed_bytes
from fcl_flower.state_key import ENV, KeyFileError, signing_key
from strategies.checkpoint import CheckpointStore, check_run_folder, run_folder_lock
from tests.conftest import run_in_process, small_config

SETTINGS = dict(num_tasks=2, num_clients=3, rf_dim=60, seed=0)
F64 = torch.float64


class ServerKilled(Exception):
    """The server dies right after the checkpoint of stage 1 (of 2) was written."""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A run folder holding the checkpoint of stage 1 of a 2-stage STSA run."""
    cfg = small_config(tmp_path_factory.mktemp("pristine"), **SETTINGS, run_name="run")
    save = strategies.loop.save

    def save_then_die(strategy, task: int) -> None:
        save(strategy, task)
        if task == 0:
            raise ServerKilled

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(strategies.loop, "save", save_then_die)
        with pytest.raises(ServerKilled):
            run_in_process(cfg)
    return cfg.output_dir


@pytest.fixture
def cfg(pristine: Path, tmp_path: Path) -> RunConfig:
    """A fresh copy of the pristine run folder, to tamper with; the config resumes it."""
    cfg = small_config(tmp_path, **SETTINGS, run_name="run", resume=True)
    shutil.copytree(pristine, cfg.output_dir)
    return cfg


# ------------------------------------------------------------------------------ tampering helpers
class Checkpoint:
    """checkpoint.json and its tensors, as an attacker edits them: the digests are recomputed."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "checkpoint.json"
        raw = self.path.read_bytes()
        self.signature = raw[: raw.index(b", ") + 2]  # '{"hmac": "<hex>", '
        self.document: dict[str, Any] = json.loads(raw)
        self.document.pop("hmac")
        self.tensors = load_file(str(folder / self.document["tensors"]))

    def node(self, *path: str) -> dict[str, Any]:
        """The encoded dict at ``path`` in the payload tree (state_io's ``__dict__`` nodes)."""
        node = self.document["state"]["__dict__"]
        for key in path:
            node = node[key]["__dict__"]
        return node

    def write_tensors(self) -> None:
        folder = self.path.parent
        staged = folder / "staged.safetensors"
        save_file(self.tensors, str(staged))
        digest = __import__("hashlib").sha256(staged.read_bytes()).hexdigest()
        name = f"checkpoint-{digest[:16]}.safetensors"
        staged.rename(folder / name)
        self.document["tensors"], self.document["sha256"] = name, digest

    def body(self) -> bytes:
        return json.dumps(self.document).encode()

    def unsigned(self, body: bytes | None = None) -> None:
        """Written back by someone without the key: the old signature, the new content."""
        self.write_tensors()
        self.path.write_bytes(self.signature + (body or self.body())[1:])

    def resigned(self, body: bytes | None = None) -> None:
        """Written back and signed with the installation's key."""
        self.write_tensors()
        if body is None:
            self.path.write_bytes(signed_bytes("checkpoint", self.document, signing_key()))
        else:
            from fcl_flower.state_key import sign

            self.path.write_bytes(b'{"hmac": "' + sign(signing_key(), "checkpoint", body).encode() + b'", ' + body[1:])


def ridge_gram(ck: Checkpoint) -> torch.Tensor:
    packed = ck.tensors["/state/ridge/gram_packed"]
    return unpack_upper(packed, int(ck.tensors["/state/ridge/class_sums"].shape[0]))


def nan_gram(ck: Checkpoint) -> None:
    ck.tensors["/state/ridge/gram_packed"][3] = math.nan


def swap_class_columns(ck: Checkpoint) -> None:
    sums = ck.tensors["/state/ridge/class_sums"]
    ck.tensors["/state/ridge/class_sums"] = sums[:, [1, 0, *range(2, sums.shape[1])]].contiguous()


def indefinite_gram(ck: Checkpoint) -> None:
    gram = ridge_gram(ck)
    vector = torch.linalg.eigh(gram).eigenvectors[:, -1:]
    top = float(torch.linalg.eigvalsh(gram)[-1])
    ck.tensors["/state/ridge/gram_packed"] = pack_upper(gram - 2.0 * top * (vector @ vector.T)).contiguous()


def slightly_indefinite_with_a_zero_bound(ck: Checkpoint) -> None:
    """λ_min(G) pushed just below 0, inside the upload checks' tolerance, and the bound set to 0:
    two features no sample activated get G_ii = G_jj = 1 and G_ij a millionth past Cauchy-Schwarz
    (every entry still >= 0, as ReLU features give). A lie only a factorisation exposes."""
    gram = ridge_gram(ck)
    i, j = (gram.diagonal() == 0).nonzero().flatten()[:2].tolist()
    gram[i, i] = gram[j, j] = 1.0
    gram[i, j] = gram[j, i] = 1.0 + 1e-6
    assert float(torch.linalg.eigvalsh(gram)[0]) < -4e-7  # the lie: λ_min(G) < 0 = -negative_bound
    ck.tensors["/state/ridge/gram_packed"] = pack_upper(gram).contiguous()
    ck.node("state", "ridge")["negative_bound"] = 0.0


def bound_x(ck: Checkpoint) -> None:
    ck.node("state", "ridge")["negative_bound"] = "x"


def completed_99(ck: Checkpoint) -> None:
    ck.node()["completed_tasks"] = 99


def short_packed_gram(ck: Checkpoint) -> None:
    ck.tensors["/state/ridge/gram_packed"] = ck.tensors["/state/ridge/gram_packed"][:-1].contiguous()


def swap_node_map(ck: Checkpoint) -> None:
    mapping = ck.node("state", "nodes", "client_of")
    nodes = sorted(mapping)
    mapping[nodes[0]], mapping[nodes[1]] = mapping[nodes[1]], mapping[nodes[0]]


def nan_model(ck: Checkpoint) -> None:
    name = next(k for k in ck.tensors if k.startswith("/state/model/") and ck.tensors[k].is_floating_point())
    ck.tensors[name].view(-1)[0] = math.nan


def accuracy_text(ck: Checkpoint) -> None:
    ck.node()["stages"][0]["__dict__"]["accuracy"] = "x"


def unseen_class_sums(ck: Checkpoint) -> None:
    ck.tensors["/state/ridge/class_sums"][:, -1] = 1.0


def node_map_two_to_one(ck: Checkpoint) -> None:
    mapping = ck.node("state", "nodes", "client_of")
    nodes = sorted(mapping)
    mapping[nodes[0]] = mapping[nodes[1]]


ATTACKS: dict[str, Callable[[Checkpoint], None]] = {
    "G set to NaN": nan_gram,
    "class-sum columns swapped": swap_class_columns,
    "G made indefinite": indefinite_gram,
    "negative_bound 0 under a slightly indefinite G": slightly_indefinite_with_a_zero_bound,
    "negative_bound 'x'": bound_x,
    "completed_tasks 99": completed_99,
    "a short packed G": short_packed_gram,
    "the node -> client map swapped": swap_node_map,
    "a model weight NaN": nan_model,
    "a stage accuracy 'x'": accuracy_text,
}

#: what a re-signed (key-holding) tamper is refused for: the field the one line names
FIELDS = {
    "G set to NaN": "field 'state/ridge/gram_packed' holds NaN or infinite entries",
    "G made indefinite": "field 'state/ridge' fails the upload checks",
    "negative_bound 0 under a slightly indefinite G": "field 'state/ridge/negative_bound' is 0, but G + 0·I has no Cholesky factor",
    "negative_bound 'x'": "field 'state/ridge/negative_bound' must be a number >= 0, not str 'x'",
    "completed_tasks 99": "field 'completed_tasks' is 99, outside [1, 2]",
    "a short packed G": "field 'state/ridge/gram_packed' has shape (1829,), the configuration gives (1830,)",
    "a model weight NaN": "holds NaN or infinite entries",
    "a stage accuracy 'x'": "field 'stages/0/accuracy' must be a number, not str 'x'",
    "class sums of a class not yet seen": "field 'state/ridge/class_sums' has statistics of classes not yet seen",
    "two nodes mapped to one client": "field 'state/nodes/client_of' maps two nodes to one client",
}
#: tampering no check on the numbers can tell from an honest state (a relabelling of the same
#: data, a permutation of the same nodes): only the signature catches it
UNDETECTABLE_BUT_SIGNED = {"class-sum columns swapped", "the node -> client map swapped"}


def refused(cfg: RunConfig) -> str:
    """Resume ``cfg``: it must be refused with one line, results.json untouched; returns the line."""
    results = cfg.output_dir / "results.json"
    before = results.read_bytes()
    with pytest.raises(ConfigError) as err:
        run_in_process(cfg)
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    assert results.read_bytes() == before  # never a "completed" run, nor a "failed" one on its behalf
    return message


# ------------------------------------------------------------------------------ without the key
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_checkpoint_tampered_without_the_key_is_refused_as_not_signed(cfg: RunConfig, attack: str) -> None:
    ck = Checkpoint(cfg.output_dir)
    ATTACKS[attack](ck)
    ck.unsigned()
    message = refused(cfg)
    assert message.startswith(f"resume: {cfg.output_dir / 'checkpoint.json'}: not signed by this installation's key")
    assert "move the key file too" in message


def test_200000_deep_json_is_one_line_signed_or_not(cfg: RunConfig) -> None:
    """Today's RecursionError: refused before parsing when unsigned, and parsed without a
    traceback when a key holder signed it."""
    ck = Checkpoint(cfg.output_dir)
    deep = ck.body().replace(b'"completed_tasks": 1', b'"completed_tasks": ' + b"[" * 200_000 + b"]" * 200_000)
    ck.unsigned(deep)
    assert "not signed by this installation's key" in refused(cfg)
    ck.resigned(deep)
    assert "is not a readable fcl-flower state file (RecursionError)" in refused(cfg)


def test_an_unsigned_checkpoint_of_an_earlier_version_is_refused_in_one_line(cfg: RunConfig) -> None:
    ck = Checkpoint(cfg.output_dir)
    ck.path.write_bytes(ck.body())  # the same content, no signature
    assert "is not signed (written by an earlier version of fcl-flower, or rewritten by hand)" in refused(cfg)


def test_a_signed_opened_sum_put_in_place_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    """The signature covers the file's name: the opened secure sum (also signed) is no checkpoint."""
    save_state(tmp_path, "secagg-opened", {"task": 0})
    os.replace(tmp_path / "secagg-opened.json", tmp_path / "checkpoint.json")
    with pytest.raises(StateError, match="not signed by this installation's key"):
        load_state(tmp_path / "checkpoint.json")


def test_the_opened_secure_sum_is_signed_too(tmp_path: Path) -> None:
    path = save_state(tmp_path, "secagg-opened", {"task": 0, "sums": {"counts": torch.ones(3, dtype=F64)}})
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"task": 0', b'"task": 1'))
    with pytest.raises(StateError, match=r"secagg-opened.json: not signed by this installation's key"):
        load_state(path)


# ------------------------------------------------------------------------------ with the key
@pytest.mark.parametrize("attack", sorted(set(ATTACKS) - UNDETECTABLE_BUT_SIGNED))
def test_a_checkpoint_tampered_and_re_signed_is_refused_naming_the_field(cfg: RunConfig, attack: str) -> None:
    ck = Checkpoint(cfg.output_dir)
    ATTACKS[attack](ck)
    ck.resigned()
    message = refused(cfg)
    assert message.startswith(f"resume: {cfg.output_dir / 'checkpoint.json'}: ")
    assert FIELDS[attack] in message, message


@pytest.mark.parametrize(
    ("attack", "change"),
    [
        ("class sums of a class not yet seen", unseen_class_sums),
        ("two nodes mapped to one client", node_map_two_to_one),
    ],
)
def test_inconsistent_restored_state_is_refused_naming_the_field(cfg: RunConfig, attack: str, change) -> None:
    ck = Checkpoint(cfg.output_dir)
    change(ck)
    ck.resigned()
    assert FIELDS[attack] in refused(cfg)


def test_the_honest_checkpoint_resumes_to_the_uninterrupted_classifier(
    cfg: RunConfig, pristine: Path, tmp_path: Path
) -> None:
    """The checks pass every honest state (its certified bound verified, not taken on trust): the
    copy resumes, runs stage 2 and ends with the classifier of a run never interrupted."""
    bound = load_state(pristine / "checkpoint.json")["state"]["ridge"]["negative_bound"]
    resumed = run_in_process(cfg)
    uninterrupted = run_in_process(small_config(tmp_path / "full", **SETTINGS, run_name="run"))
    assert [s.stage for s in resumed.recorder.stages] == [1, 2]
    assert torch.equal(resumed.weights, uninterrupted.weights)
    assert resumed.ridge.negative_bound == uninterrupted.ridge.negative_bound and 0 < bound < math.inf


# ------------------------------------------------------------------------------ moving a run folder
def test_a_run_folder_moves_between_machines_with_its_key(cfg: RunConfig, tmp_path: Path, monkeypatch) -> None:
    """Another installation (another key) refuses the folder; with the first key copied over it resumes."""
    original = Path(os.environ[ENV])
    other = tmp_path / "other-machine" / "checkpoint.key"
    monkeypatch.setenv(ENV, str(other))
    message = refused(cfg)
    assert f"not signed by this installation's key ({other})" in message
    assert "to move a run folder between machines move the key file too (docs/federations.md)" in message
    other.unlink()
    shutil.copy2(original, other)
    assert CheckpointStore(cfg.output_dir).load(cfg)["completed_tasks"] == 1


# ------------------------------------------------------------------------------ the key file
def test_the_key_is_made_once_with_mode_0600_under_the_config_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    key = signing_key()
    path = tmp_path / "config" / "fcl-flower" / "checkpoint.key"
    assert len(key) == 32 and signing_key() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.key"]  # no staging file left


def test_a_key_open_to_others_or_a_linked_key_is_refused_in_one_line(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "key"
    monkeypatch.setenv(ENV, str(path))
    signing_key()
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match=r"is open to group or others \(mode 0644\)"):
        signing_key()
    cfg = small_config(tmp_path / "out", **SETTINGS)
    with pytest.raises(ConfigError, match="is open to group or others") as err:
        check_run_folder(cfg)
    assert "\n" not in str(err.value)
    path.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    monkeypatch.setenv(ENV, str(link))
    with pytest.raises(KeyFileError, match="is a symbolic link, which fcl-flower refuses"):
        signing_key()
    with pytest.raises(StateError, match="is a symbolic link"):
        save_state(tmp_path / "state", "checkpoint", {"a": 1})
    assert not (tmp_path / "state" / "checkpoint.json").exists()


# ------------------------------------------------------------------------------ symbolic links
def test_a_run_folder_that_is_a_symlink_is_refused_and_nothing_written_through_it(tmp_path: Path) -> None:
    from experiments.sim import run_local

    cfg = small_config(tmp_path / "out", **SETTINGS, run_name="linked")
    target = tmp_path / "elsewhere"
    target.mkdir()
    cfg.output_dir.parent.mkdir(parents=True)
    cfg.output_dir.symlink_to(target)
    with pytest.raises(ConfigError, match=f"the run folder {cfg.output_dir} is a symbolic link") as err:
        run_local(cfg)
    assert "\n" not in str(err.value)
    assert list(target.iterdir()) == []


def test_a_lock_file_that_is_a_symlink_is_refused_in_one_line(tmp_path: Path) -> None:
    from experiments.sim import run_local

    cfg = small_config(tmp_path / "out", **SETTINGS, run_name="lock")
    cfg.output_dir.mkdir(parents=True)
    victim = tmp_path / "victim"
    (cfg.output_dir / ".lock").symlink_to(victim)
    for attempt in (lambda: run_local(cfg), lambda: check_run_folder(cfg)):
        with pytest.raises(ConfigError, match=r"the lock file .*\.lock is a symbolic link") as err:
            attempt()
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="is a symbolic link"), run_folder_lock(cfg.output_dir):
        pass
    assert not victim.exists() and not (cfg.output_dir / "results.json").exists()


def test_a_checkpoint_that_is_a_symlink_is_refused(cfg: RunConfig, tmp_path: Path) -> None:
    path = cfg.output_dir / "checkpoint.json"
    moved = tmp_path / "moved.json"
    os.replace(path, moved)
    path.symlink_to(moved)
    assert "checkpoint.json is a symbolic link, which fcl-flower never follows" in refused(cfg)


# ------------------------------------------------------------------------------ the opened secure sum
def test_a_saved_opened_sum_is_checked_field_by_field(tmp_path: Path) -> None:
    """secagg-opened.json (signed like the checkpoint) is read back only with every field right;
    the sum itself then gets the upload checks when it is folded in."""
    from fcl_flower.analytic import packed_length
    from fcl_flower.restore import RestoreError
    from tests.conftest import build

    strategy = build(small_config(tmp_path, **{**SETTINGS, "num_clients": 5}, secure_aggregation=True))
    dim, classes = strategy.rf_dim, len(strategy.split.tasks[0])
    honest = {
        "task": 0,
        "survivors": ["client-0", "client-1", "client-2"],
        "tasks": [0],
        "threshold": 3,
        "sums": {
            "gram-packed": torch.zeros(packed_length(dim), dtype=F64),
            "class-sums": torch.zeros(dim * classes, dtype=F64),
            "counts": torch.zeros(classes + 1, dtype=F64),
        },
    }
    assert strategy.check_opening(honest, 0) is honest
    bad = {
        "survivors": (["client-0", "client-0", "client-9"], "field 'survivors' must name distinct clients of this run"),
        "tasks": ([1], "field 'tasks/0' is 1, outside [0, 0]"),
        "threshold": ("3", "field 'threshold' must be an integer, not str '3'"),
        "sums": (
            {**honest["sums"], "counts": torch.full((classes + 1,), math.nan, dtype=F64)},
            "field 'sums/counts' holds NaN or infinite entries",
        ),
    }
    for key, (value, says) in bad.items():
        with pytest.raises(RestoreError) as err:
            strategy.check_opening({**honest, key: value}, 0)
        assert str(err.value).startswith(says), str(err.value)


# ------------------------------------------------------------------------------ honest resumes pass the checks
@pytest.mark.parametrize(
    "changes",
    [
        dict(strategy="stsa", dp_epsilon=2.0, noise_seeded=True, feature_clip=1.0),
        dict(strategy="stsa", stats_form="factor"),
        dict(strategy="stsa", ridge="auto"),
        dict(strategy="stsa-e", dummy_clients=2),
        dict(strategy="joint"),
        dict(strategy="fedran"),
    ],
    ids=["stsa-dp", "stsa-factor", "stsa-gcv", "stsa-e", "joint", "fedran"],
)
def test_every_honest_checkpoint_passes_the_checks_and_resumes_to_the_same_classifier(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    """The field checks never refuse what the server itself wrote (noise and its ledger, factor
    uploads, a GCV-chosen γ, STSA-E's kept uploads, joint, FedRAN's low-rank summary): killed after
    stage 1 and resumed, the run ends with the uninterrupted run's classifier."""
    cfg = small_config(tmp_path / "killed", **{**SETTINGS, **changes}, run_name="run")
    save = strategies.loop.save

    def save_then_die(strategy, task: int) -> None:
        save(strategy, task)
        raise ServerKilled

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(strategies.loop, "save", save_then_die)
        with pytest.raises(ServerKilled):
            run_in_process(cfg)
    resumed = run_in_process(cfg.replace(resume=True))
    uninterrupted = run_in_process(small_config(tmp_path / "full", **{**SETTINGS, **changes}, run_name="run"))
    assert [s.stage for s in resumed.recorder.stages] == [1, 2]
    assert torch.equal(resumed.weights, uninterrupted.weights)
