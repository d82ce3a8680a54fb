"""experiments/sim.py on a Ray cluster of two nodes (``--ray-address``), on loopback.

The test starts a head (``ray start --head``) and a second node (``ray start --address``) on this
machine, each with its own ``--temp-dir``, its own ports and one CPU, so that the two simulated
clients (one CPU each) must run one on each node. It runs STSA on a tiny digits config through
``sim.py --ray-address`` and checks that

* a ClientAppActor ran on each node (each node's own worker logs name the actor class);
* the run equals the single-machine run of the same ``sim.py`` command without ``--ray-address``
  (a Ray instance of this machine alone): the same accuracies and the same final ridge
  classifier W, bit for bit.

Both nodes are stopped afterwards, pass or fail, by PID: every process whose command line names
one of this test's temp dirs, and their descendants; never ``ray stop``, which would stop every
Ray instance on the machine. Marked ``slow`` (two Ray nodes and two runs: 7.5 min on a 2-core machine at load average ~25).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from fcl_flower.config import RunConfig
from fcl_flower.state_io import load_state

ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).parent / "ray"

ARGS = dict(
    strategy="stsa",
    dataset="digits",
    num_tasks=2,
    num_clients=2,
    beta=0.5,
    seed=0,
    stage1_rounds=1,
    local_epochs=1,
    rf_dim=200,
    ridge="100.0",
    wire_dtype="float64",
    batch_size=256,
    device="cpu",
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _descendants(pids: set[int]) -> set[int]:
    spec = importlib.util.spec_from_file_location("local_federation", ROOT / "deploy" / "local_federation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module.descendants(sorted(pids))


def _processes_naming(paths: list[Path]) -> set[int]:
    """PIDs whose command line names one of ``paths`` (this test's Ray temp dirs)."""
    needles = [str(p).encode() for p in paths]
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if any(n in (entry / "cmdline").read_bytes() for n in needles):
                    found.add(int(entry.name))
    return found - {os.getpid()}


def _stop_nodes(temp_dirs: list[Path]) -> None:
    """SIGTERM, then SIGKILL, every process of this test's Ray nodes (by PID)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        ours = _processes_naming(temp_dirs)
        ours |= _descendants(ours)
        for pid in ours:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _processes_naming(temp_dirs):
            time.sleep(0.2)


def _ray_start(args: list[str], temp_dir: Path, env: dict[str, str]) -> None:
    node_ports = [
        "--node-manager-port",
        str(_free_port()),
        "--object-manager-port",
        str(_free_port()),
        "--metrics-export-port",
        str(_free_port()),
        "--dashboard-agent-listen-port",
        str(_free_port()),
        "--dashboard-agent-grpc-port",
        str(_free_port()),
        "--runtime-env-agent-port",
        str(_free_port()),
    ]
    argv = [str(RAY), "start", *args, "--num-cpus", "1", "--num-gpus", "0", "--temp-dir", str(temp_dir)]
    argv += ["--node-ip-address", "127.0.0.1", "--object-store-memory", str(100 * 2**20), "--disable-usage-stats"]
    proc = subprocess.run(
        argv + node_ports, env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def _actor_logs(temp_dir: Path) -> list[Path]:
    """Worker logs under one node's temp dir that name the ClientAppActor class."""
    return [p for p in temp_dir.glob("session_*/logs/worker-*.out") if b"ClientAppActor" in p.read_bytes()[:4096]]


def _flags(values: dict) -> list[str]:
    flags = []
    for key, value in values.items():
        flags += [f"--{RunConfig.key(key)}", str(value)]
    return flags


@pytest.mark.slow
@pytest.mark.skipif(not RAY.exists(), reason="the ray CLI is not installed next to this Python")
def test_stsa_across_two_ray_nodes_equals_the_single_machine_run(tmp_path: Path) -> None:
    # Ray keeps sockets under its temp dir and their paths must stay short (AF_UNIX): not tmp_path
    base = Path(tempfile.mkdtemp(prefix="fcl-ray-"))
    head_dir, node_dir = base / "head", base / "node"
    temp_dirs = [head_dir, node_dir]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    port = _free_port()
    address = f"127.0.0.1:{port}"
    cluster_cfg = RunConfig(**ARGS, out=str(tmp_path / "cluster"), run_name="cluster").validated()
    try:
        _ray_start(
            [
                "--head",
                "--port",
                str(port),
                "--include-dashboard",
                "false",
                "--ray-client-server-port",
                str(_free_port()),
            ],
            head_dir,
            env,
        )
        _ray_start(["--address", address], node_dir, env)
        argv = [*_flags(ARGS), "--out", str(tmp_path / "cluster"), "--run-name", "cluster", "--ray-address", address]
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.sim", *argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        on_head, on_node = _actor_logs(head_dir), _actor_logs(node_dir)
        assert on_head and on_node, (on_head, on_node)
    finally:
        _stop_nodes(temp_dirs)
        assert not _processes_naming(temp_dirs)
        shutil.rmtree(base, ignore_errors=True)

    # the single-machine run: the same sim.py command on a Ray instance of this machine alone
    local_cfg = cluster_cfg.replace(out=str(tmp_path / "local"), run_name="local")
    argv = [*_flags(ARGS), "--out", str(tmp_path / "local"), "--run-name", "local"]
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.sim", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cluster = json.loads((cluster_cfg.output_dir / "results.json").read_text())
    local = json.loads((local_cfg.output_dir / "results.json").read_text())
    assert cluster["status"] == local["status"] == "completed"
    assert [s["accuracy"] for s in cluster["stages"]] == [s["accuracy"] for s in local["stages"]]
    assert [s["clients"] for s in cluster["stages"]] == [["client-0", "client-1"]] * 2
    w_cluster = load_state(cluster_cfg.output_dir / "checkpoint.json")["state"]["weights"]
    w_local = load_state(local_cfg.output_dir / "checkpoint.json")["state"]["weights"]
    assert w_cluster.dtype == torch.float64 and torch.equal(w_cluster, w_local)


def test_joining_a_cluster_passes_its_address_and_no_resource_counts_to_ray_init() -> None:
    """ray.init refuses num_cpus/num_gpus when it connects to a running cluster: they must be absent."""
    from experiments.sim import build_parser, ray_init_args

    assert ray_init_args(address="10.0.0.5:6379") == {"address": "10.0.0.5:6379", "log_to_driver": False}
    alone = ray_init_args()
    assert "address" not in alone and alone["num_cpus"] == (os.cpu_count() or 1)
    args = build_parser().parse_args(["--ray-address", "10.0.0.5:6379"])
    assert args.ray_address == "10.0.0.5:6379" and build_parser().parse_args([]).ray_address == ""
