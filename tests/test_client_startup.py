"""What a ClientApp process pays before it can answer: Flower starts one process per message on a
real SuperNode, so the import path and the data loading of one message must be lean.

* importing the ClientApp (and the client modules of a statistics or FedAvg message) does not
  import torchvision, timm, sklearn or torch._dynamo: each costs seconds per message;
* a message without a model (``query.info``, ``query.keys``, ``query.shares``, ``query.unmask``)
  is parsed, handled and answered without importing torch at all (the protocol is NumPy only,
  issue 32): about a second less per message on a real SuperNode;
* node data comes from an on-disk array cache (fcl_flower/data/array_cache.py) that gives the
  same arrays, builds once, and rebuilds a damaged entry;
* local SGD without ``torch.optim`` (fcl_flower/fcl/sgd.py) trains bit for bit like
  ``torch.optim.SGD``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fcl_flower.data.array_cache import cached_arrays, content_key, source_key
from fcl_flower.data.digits import digits_arrays
from fcl_flower.fcl.sgd import MomentumSGD

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torchvision", "timm", "sklearn", "scipy", "torch._dynamo", "sympy")


def _modules_after(code: str) -> set[str]:
    """Every module a fresh interpreter has imported after running ``code`` (from the repo root)."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_clientapp_import_path_leaves_heavy_packages_out() -> None:
    loaded = _modules_after(
        "import clients.app, clients.job, clients.stsa, clients.fedavg, clients.node_data, clients.evaluate"
    )
    assert "torch" in loaded  # the model needs it; the rest must wait until a message needs it
    assert not {m for m in loaded if m.split(".")[0] in HEAVY or m.startswith("torch._dynamo")}


def test_messages_without_a_model_never_import_torch(tmp_path: Path) -> None:
    """A fresh process answers query.info and a whole secure round's keys, shares and unmask
    (three nodes, through the ClientApp's own entry; tests/model_free_probe.py) with torch never
    imported, and the replies are the real ones: each node's partition, and at unmasking every
    survivor's seed share from each node."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.model_free_probe", str(tmp_path / "ledger")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    steps = json.loads(out.strip().splitlines()[-1])
    for step in ("info", "keys", "shares", "unmask"):
        assert steps[step]["torch"] is False, f"{step} imported torch"
        assert steps[step]["partitions"] == [0, 1, 2]
    assert steps["unmask"]["seed_shares"] == [[11, 12, 13]] * 3


def test_the_clientapp_imports_no_torch() -> None:
    loaded = _modules_after(
        "import clients.app, clients.secure, clients.node_data, fcl_flower.protocol, fcl_flower.data.plan"
    )  # the plan: what a custom-dataset run's instruction is checked against at parse
    assert "torch" not in loaded and "fcl_flower.protocol.payloads" not in loaded


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.9, 5e-4), (0.0, 0.0), (0.5, 0.0), (0.0, 1e-3)])
def test_momentum_sgd_equals_torch_sgd_bit_for_bit(momentum: float, weight_decay: float) -> None:
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))

    ours, theirs = model(), model()
    frozen = next(iter(theirs[2].parameters()))  # a frozen tensor: no grad, no update, no buffer
    frozen.requires_grad_(False)
    next(iter(ours[2].parameters())).requires_grad_(False)
    opt_ours = MomentumSGD(
        [p for p in ours.parameters() if p.requires_grad], lr=0.05, momentum=momentum, weight_decay=weight_decay
    )
    opt_theirs = torch.optim.SGD(
        [p for p in theirs.parameters() if p.requires_grad], lr=0.05, momentum=momentum, weight_decay=weight_decay
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(7):
        x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        for net, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()):
        assert torch.equal(a, b)


def test_momentum_sgd_refuses_negative_settings() -> None:
    with pytest.raises(ValueError, match="lr, momentum, weight_decay >= 0"):
        MomentumSGD([torch.zeros(2, requires_grad=True)], lr=-0.1)


# ------------------------------------------------------------------------------ array cache
def _counting_build(arrays: dict[str, np.ndarray]):
    calls = []

    def build() -> dict[str, np.ndarray]:
        calls.append(1)
        return {k: v.copy() for k, v in arrays.items()}

    return build, calls


def test_array_cache_builds_once_then_maps_the_same_arrays(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {"x": rng.random((5, 1, 3, 3), dtype=np.float32), "y": np.arange(5, dtype=np.int64)}
    build, calls = _counting_build(arrays)
    first = cached_arrays(tmp_path, "t", "k1", build)
    second = cached_arrays(tmp_path, "t", "k1", build)
    assert len(calls) == 1
    for got in (first, second):
        assert got.keys() == arrays.keys()
        for k in arrays:
            assert got[k].dtype == arrays[k].dtype and np.array_equal(got[k], arrays[k])
            assert not got[k].flags.writeable  # mapped read-only: nothing can change the cache
    assert isinstance(second["x"].base, np.memmap)


def test_array_cache_rebuilds_a_truncated_or_foreign_entry(tmp_path: Path) -> None:
    arrays = {"x": np.arange(12, dtype=np.float64).reshape(3, 4)}
    build, calls = _counting_build(arrays)
    cached_arrays(tmp_path, "t", "k", build)
    npy = tmp_path / "t-k" / "x.npy"
    npy.write_bytes(npy.read_bytes()[:-8])  # a crashed copy, a full disk
    assert np.array_equal(cached_arrays(tmp_path, "t", "k", build)["x"], arrays["x"]) and len(calls) == 2
    manifest = tmp_path / "t-k" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"key": "k"', '"key": "other"'))
    assert np.array_equal(cached_arrays(tmp_path, "t", "k", build)["x"], arrays["x"]) and len(calls) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".t-k")]  # no temporary folder left


def test_array_cache_that_cannot_be_written_still_gives_the_arrays(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-folder"  # a file where the cache folder should be (works as root too)
    blocked.write_text("")
    arrays = {"x": np.ones(3)}
    build, calls = _counting_build(arrays)
    assert np.array_equal(cached_arrays(blocked / "cache", "t", "k", build)["x"], arrays["x"])
    assert np.array_equal(cached_arrays(blocked / "cache", "t", "k", build)["x"], arrays["x"])
    assert len(calls) == 2  # nothing written, nothing reused


def test_source_key_follows_the_content(tmp_path: Path) -> None:
    source = tmp_path / "a.npz"
    source.write_bytes(b"one")
    key = source_key(tmp_path / "c", "a", [source])
    assert source_key(tmp_path / "c", "a", [source]) == key == content_key([source])
    source.write_bytes(b"two")
    os.utime(source, ns=(1, 1))  # a new mtime: hashed again
    assert source_key(tmp_path / "c", "a", [source]) == content_key([source]) != key
    assert content_key([source], 1) != content_key([source], 2)


def test_digits_from_the_cache_equal_the_split_without_it(tmp_path: Path) -> None:
    direct = digits_arrays(None)
    for _ in range(2):  # written, then mapped
        digits_arrays.cache_clear()
        cached = digits_arrays(str(tmp_path))
        for a, b in zip(cached, direct):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("digits-")]) == 1
    digits_arrays.cache_clear()
