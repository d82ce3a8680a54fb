"""Deployment mode: real SuperLink / SuperNode processes, TLS, SuperNode auth, per-node data.

The fast tests check how a SuperNode finds its data (clients/node_data.py): an exported client
folder yields exactly the samples (and transformed tensors) the simulation's partition gives
that client, and a folder cut for another split is refused.

The end-to-end test (marked ``slow``, ~1-2 min on 2 cores) starts ``flower-superlink`` with TLS
and ``--enable-supernode-auth`` on a free loopback port, registers three SuperNode keys,
starts three ``flower-supernode`` processes, each reading only its own exported folder, and
submits ``flwr run`` for three STSA stages. It then checks that

* a SuperNode with an unregistered key, and one with no key, are refused and exit;
* the SuperLink speaks only TLS, with a certificate that our CA signed for 127.0.0.1;
* every stage aggregated all three clients, and the final ridge classifier W equals the one
  the Ray simulation (experiments/sim.py) computes for the same config and seed. The run uses
  the documented deployment's secure aggregation (a ``query.keys`` round, private keys kept
  in each SuperNode's context state, masked uploads), so W is compared within the fixed-point
  rounding bound (relative 1e-6; observed far below).

Every process is started in its own session and killed (group and descendants) in a
``finally``; every wait is bounded, so a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from clients.node_data import NodeConfigError, OwnSplit, load_folder, node_data, node_partition
from experiments.export_partitions import export_partitions
from fcl_flower.config import RunConfig
from fcl_flower.runtime import federated_split
from fcl_flower.state_io import load_state
from tests.deploy_support import ROOT, cannot_deploy, load_federation_module

federation_module = load_federation_module()

# Three stages of STSA with one FedAvg round first, so the broadcast of a trained backbone is
# part of what must match; secure aggregation on, as in the documented deployment.
RUN = dict(
    strategy="stsa",
    dataset="digits",
    num_tasks=3,
    first_task_classes=4,
    num_clients=3,
    beta=0.5,
    seed=0,
    stage1_rounds=1,
    local_epochs=1,
    rf_dim=200,
    ridge="100.0",
    wire_dtype="float64",
    batch_size=256,
    device="cpu",
    round_timeout=300.0,
    secure_aggregation=True,
)


def run_config(out: Path, **changes) -> RunConfig:
    return RunConfig(**{**RUN, "out": str(out), **changes}).validated()


# ------------------------------------------------------------------------------ node data
@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[RunConfig, Path]:
    out = tmp_path_factory.mktemp("client-data")
    cfg = run_config(out / "unused")
    export_partitions(cfg, out)
    return cfg, out


def test_exported_folder_holds_exactly_the_clients_partition(exported) -> None:
    """Same samples, same order, same tensors after train and eval transforms, every task."""
    cfg, out = exported
    for k in range(cfg.num_clients):
        folder = node_data({"data-dir": str(out / f"client-{k}")}, cfg)
        partition = node_data({"partition-id": k, "num-partitions": cfg.num_clients}, cfg)
        assert folder.partition == k
        assert folder.tasks == partition.tasks and folder.shape == partition.shape
        for t in range(cfg.num_tasks):
            for eval_transform in (False, True):
                xa, ya = folder.train(t, eval_transform=eval_transform).tensors()
                xb, yb = partition.train(t, eval_transform=eval_transform).tensors()
                assert torch.equal(ya, yb) and torch.equal(xa, xb)


def test_client_folders_partition_the_training_set(exported) -> None:
    """Together the folders hold every training sample of a task exactly once (as a multiset:
    digits has a few identical images), so no sample sits in two clients' folders."""
    cfg, out = exported
    from fcl_flower.runtime import federated_split

    split = federated_split(cfg)
    for t in range(cfg.num_tasks):
        held = Counter()
        for k in range(cfg.num_clients):
            images, _ = load_folder(out / f"client-{k}").train(t, eval_transform=False).tensors()
            held.update(map(bytes, images.reshape(len(images), -1).numpy()))
        pooled, _ = split.task_train(t).tensors()
        assert held == Counter(map(bytes, pooled.reshape(len(pooled), -1).numpy()))


def test_folder_node_serves_only_its_own_partition(exported) -> None:
    """Handlers that ask the split for data get their own partition and nothing else."""
    cfg, out = exported
    own = OwnSplit(node_data({"data-dir": str(out / "client-1")}, cfg))
    assert own.tasks == [range(4), range(4, 7), range(7, 10)]
    assert len(own.client_train(2, 1, eval_transform=True)) == len(
        node_data({"partition-id": 1}, cfg).train(2, eval_transform=True)
    )
    with pytest.raises(NodeConfigError, match="client 0's data is not on this node"):
        own.client_train(0, 0)
    with pytest.raises(NodeConfigError, match="needs the whole dataset"):
        own.seen_test(0)


def test_folder_for_another_split_is_refused(exported) -> None:
    """node_data refuses a folder that does not fit the run, and node_partition (query.info and the
    secure steps without a model: meta.json only, no samples) gives the same partitions and the
    same refusals."""
    cfg, out = exported
    for k in range(cfg.num_clients):
        folder = {"data-dir": str(out / f"client-{k}")}
        assert node_partition(folder, cfg) == node_data(folder, cfg).partition == k
        assert node_partition({"partition-id": k, "num-partitions": cfg.num_clients}, cfg) == k
    for read in (node_data, node_partition):
        with pytest.raises(NodeConfigError, match="exported for another split: seed"):
            read({"data-dir": str(out / "client-0")}, cfg.replace(seed=1))
        with pytest.raises(NodeConfigError, match="holds partition 0"):
            read({"data-dir": str(out / "client-0"), "partition-id": 1}, cfg)
        with pytest.raises(NodeConfigError, match=r"has no meta\.json"):
            read({"data-dir": str(out)}, cfg)
        with pytest.raises(NodeConfigError, match="names no data"):
            read({}, cfg)
        with pytest.raises(NodeConfigError, match="exported for another split: partition"):
            read({"data-dir": str(out / "client-0")}, cfg.replace(partition="class-subsets"))


@pytest.mark.parametrize(
    "protocol",
    [
        dict(partition="class-subsets", initial_clients=3, joining_per_task=1, old_only_fraction=0.4),  # LGA
        dict(
            strategy="stamp",
            secure_aggregation=False,
            partition="task-pool",
            first_task_classes=0,  # STAMP
            num_tasks=5,
            classes_per_task=2,
        ),
    ],
    ids=["lga", "stamp"],
)
def test_paper_protocol_folder_serves_that_protocols_partition(tmp_path, protocol) -> None:
    """A folder exported for a paper's protocol holds exactly that client's partition of every
    task, and is refused for the default Dirichlet run."""
    cfg = run_config(tmp_path / "unused", num_clients=4, **protocol)
    export_partitions(cfg, tmp_path / "folders")
    split = federated_split(cfg)
    for client in range(4):
        own = node_data({"data-dir": str(tmp_path / "folders" / f"client-{client}")}, cfg)
        for task in range(cfg.num_tasks):
            assert np.array_equal(
                own.train(task, eval_transform=False).targets, split.client_train(task, client).targets
            )
        assert own.tasks == split.tasks
    with pytest.raises(NodeConfigError, match="partition"):
        node_data({"data-dir": str(tmp_path / "folders" / "client-0")}, cfg.replace(partition="dirichlet"))


def test_folder_exported_before_the_protocol_keys_still_serves_default_runs(exported, tmp_path) -> None:
    cfg, out = exported
    old = tmp_path / "old-client-0"
    shutil.copytree(out / "client-0", old)
    meta = json.loads((old / "meta.json").read_text())
    for key in (
        "partition",
        "class-fraction",
        "initial-clients",
        "joining-per-task",
        "old-only-fraction",
        "classes-per-task",
    ):
        meta.pop(key)
    (old / "meta.json").write_text(json.dumps(meta))
    assert len(node_data({"data-dir": str(old)}, cfg).train(0, eval_transform=False)) > 0


# ------------------------------------------------------------------------------ processes


class FakeControl:
    """Flower's Control API client as wait_run sees it: the run's status per ListRuns call."""

    def __init__(self, phases: list[tuple[str, str]], missing: bool = False) -> None:
        self.phases, self.missing, self.asked, self.closed = phases, missing, [], False

    def ListRuns(self, request):
        from flwr.proto.control_pb2 import ListRunsResponse
        from flwr.proto.run_pb2 import Run, RunStatus

        self.asked.append(request.run_id)
        if self.missing:  # what Flower's HTTP client raises for a run id the SuperLink lacks
            raise _http_error(404)
        status, sub_status = self.phases[min(len(self.asked), len(self.phases)) - 1]
        run = Run(run_id=request.run_id, status=RunStatus(status=status, sub_status=sub_status))
        return ListRunsResponse(run_dict={request.run_id: run})

    def close(self) -> None:
        self.closed = True


def _http_error(code: int) -> Exception:
    import httpx

    request = httpx.Request("POST", "https://127.0.0.1/v1/control/list-runs")
    return httpx.HTTPStatusError("not found", request=request, response=httpx.Response(code, request=request))


def test_wait_run_watches_the_control_api_and_starts_no_process(tmp_path, monkeypatch) -> None:
    """wait_run asks the SuperLink's Control API from this process, one ListRuns request per poll
    (no flwr CLI process while a run goes: each costs ~0.74 s of CPU, issue 32), returns the
    status as `flwr ls` shows it once the run is finished, reads a run the SuperLink lacks as
    unknown, gives up at its timeout, and closes the client when the federation stops."""
    fed = federation_module.LocalFederation(tmp_path, [])

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started while the run was watched: {args}")

    monkeypatch.setattr(federation_module.subprocess, "run", no_process)
    monkeypatch.setattr(federation_module.subprocess, "Popen", no_process)
    control = FakeControl([("pending", ""), ("starting", ""), ("running", ""), ("finished", "completed")])
    fed._control = control
    assert fed.wait_run(7, timeout=30, poll=0.001) == "finished:completed"
    assert control.asked == [7, 7, 7, 7]
    fed._control = FakeControl([("running", "")])
    with pytest.raises(federation_module.FederationError, match="run 8 not finished after 0 s"):
        fed.wait_run(8, timeout=0.05, poll=0.001)
    missing = FakeControl([], missing=True)
    fed._control = missing
    assert fed.run_status(9) == "unknown"
    fed.stop(grace=0.05)
    assert missing.closed and fed._control is None


@pytest.fixture(scope="module")
def federation(exported, tmp_path_factory):
    reason = cannot_deploy()
    if reason:
        pytest.skip(reason)
    _, data = exported
    workdir = tmp_path_factory.mktemp("federation")
    fed = federation_module.LocalFederation(workdir, federation_module.node_configs_for(3, data))
    try:
        fed.start()
        yield fed
    finally:
        fed.stop()
    assert not fed.surviving(), f"processes left running: {fed.surviving()}"


def _wait_exit(process: subprocess.Popen, timeout: float) -> int | None:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_supernode_without_registered_key_is_refused(federation) -> None:
    online_before = {n["node-id"] for n in federation.online_nodes()}
    assert len(online_before) == 3
    rogue_key = federation.keys / "supernode-3"  # generated, never registered
    assert rogue_key.exists()
    unregistered = federation.start_supernode(
        "rogue-unregistered", "partition-id=0 num-partitions=3", rogue_key, give_up_after=15
    )
    keyless = federation.start_supernode("rogue-keyless", "partition-id=1 num-partitions=3", None, give_up_after=15)
    codes = [_wait_exit(unregistered, 60), _wait_exit(keyless, 60)]
    assert all(code not in (None, 0) for code in codes), codes
    assert "Failed to activate SuperNode" in federation.log_tail("rogue-unregistered", 4000)
    assert "must be registered" in federation.log_tail("rogue-keyless", 4000)
    assert {n["node-id"] for n in federation.online_nodes()} == online_before


def test_superlink_speaks_only_tls_with_our_certificate(federation) -> None:
    context = ssl.create_default_context(cafile=str(federation.certs / "ca.crt"))
    with (
        socket.create_connection(("127.0.0.1", federation.port), timeout=10) as sock,
        context.wrap_socket(sock, server_hostname="127.0.0.1") as tls,
    ):
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
        names = [v for k, v in tls.getpeercert()["subjectAltName"] if k == "IP Address"]
        assert "127.0.0.1" in names
    untrusted = ssl.create_default_context()  # the system CAs do not know our self-signed CA
    with (
        socket.create_connection(("127.0.0.1", federation.port), timeout=10) as sock,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        untrusted.wrap_socket(sock, server_hostname="127.0.0.1")
    with socket.create_connection(("127.0.0.1", federation.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        sock.settimeout(10)
        try:
            answer = sock.recv(64)
        except (TimeoutError, ConnectionError):
            answer = b""
        assert not answer.startswith(b"HTTP/")  # plain HTTP gets no HTTP answer


@pytest.mark.slow  # ~2.5-3 min of real SuperNodes (secure rounds at Flower's ~7 s floor per exchange)
def test_deployed_run_equals_simulation(federation, tmp_path) -> None:
    # the deployment signs its secure rounds with the SuperNode keys (every node insists on it);
    # the simulation has no keys to sign with, and signing changes no number
    cfg = run_config(tmp_path / "deployed").replace(secagg_signed_keys=True)
    sim_cfg = cfg.replace(out=str(tmp_path / "simulated"), secagg_signed_keys=False)
    began = time.monotonic()
    run_id = federation.submit(cfg.to_mapping())
    simulation = _start_simulation(sim_cfg, tmp_path / "simulation.log")  # overlaps the deployed run
    try:
        status = federation.wait_run(run_id, timeout=1200)  # generous: CI machines may be busy
        assert status == "finished:completed", f"{status}\n{federation.run_log(run_id)[-3000:]}"
        deployed_seconds = time.monotonic() - began
        _finish_simulation(simulation, tmp_path / "simulation.log", timeout=300)
    finally:
        _kill_tree(simulation)

    results = json.loads((cfg.output_dir / "results.json").read_text())
    assert [s["stage"] for s in results["stages"]] == [1, 2, 3]
    for stage in results["stages"]:
        assert stage["clients"] == ["client-0", "client-1", "client-2"] and not stage["left_out"]
    deployed, simulated = _final_weights(cfg), _final_weights(sim_cfg)
    assert deployed.dtype == simulated.dtype == torch.float64
    assert deployed.shape == simulated.shape == (cfg.rf_dim, 10)
    error = float((deployed - simulated).norm() / simulated.norm())
    assert error < 1e-6, error
    assert all(stage["extra"].get("secure_aggregation") for stage in results["stages"])
    sim_results = json.loads((sim_cfg.output_dir / "results.json").read_text())
    assert [s["accuracy"] for s in results["stages"]] == [s["accuracy"] for s in sim_results["stages"]]
    print(f"deployed run: {deployed_seconds:.1f} s, relative difference of W to the simulation: {error:.1e}")


def _final_weights(cfg: RunConfig) -> torch.Tensor:
    """W after the last stage, from the server's checkpoint in the run's output folder."""
    checkpoint = load_state(cfg.output_dir / "checkpoint.json")
    assert checkpoint["completed_tasks"] == cfg.num_tasks
    return checkpoint["state"]["weights"]


def _start_simulation(cfg: RunConfig, log: Path) -> subprocess.Popen:
    """experiments/sim.py (Ray) for ``cfg``, in its own session, output to ``log``."""
    flags = []
    for key, value in cfg.to_mapping().items():
        if isinstance(value, bool):
            flags.append(f"--{key}" if value else f"--no-{key}")
        else:
            flags += [f"--{key}", str(value)]
    with log.open("wb") as handle:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "experiments" / "sim.py"), *flags],
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _finish_simulation(process: subprocess.Popen, log: Path, timeout: float) -> None:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(process)
        pytest.fail(f"simulation did not finish in {timeout:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")
    assert process.returncode == 0, log.read_text(errors="replace")[-3000:]


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a still-running process and everything it started (Ray's workers included)."""
    if process.poll() is None:
        for pid in [process.pid, *federation_module.descendants([process.pid])]:
            federation_module._signal(pid, 9)
        process.wait(timeout=30)


def test_the_local_federation_signs_secure_rounds_by_default(tmp_path) -> None:
    """Wherever SuperNodes authenticate, a malicious server is in scope: the deployment signs the
    secure rounds with the keys the nodes already have, unless the run says otherwise, and gives
    each node its own ledger folder."""
    sign = federation_module.with_signed_keys
    assert (
        sign("num-clients=3 secure-aggregation=true") == "num-clients=3 secure-aggregation=true secagg-signed-keys=true"
    )
    assert sign("secure-aggregation=true secagg-signed-keys=false").endswith("secagg-signed-keys=false")
    assert sign("num-clients=3") == "num-clients=3"
    federation = federation_module.LocalFederation(tmp_path, ["partition-id=0 num-partitions=2"] * 2, 0)
    federation.keys.mkdir(parents=True)
    for k in range(3):  # two nodes and the spare key
        (federation.keys / f"supernode-{k}.pub").write_text(f"ecdsa-sha2-nistp384 KEY{k} fcl-flower supernode-{k}\n")
    trusted = federation.write_trusted_keys()
    assert trusted.read_text().splitlines() == [
        f"ecdsa-sha2-nistp384 KEY{k} fcl-flower supernode-{k}" for k in range(2)
    ]
    entries = federation.secagg_node_config("supernode-1", trusted)
    assert f'secagg-signing-key="{federation.keys / "supernode-1"}"' in entries
    assert f'secagg-trusted-keys="{trusted}"' in entries
    assert f'secagg-ledger="{tmp_path / "ledger" / "supernode-1"}"' in entries
