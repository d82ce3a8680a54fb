"""The warm worker per node (clients/worker.py): a thin ClientApp hands each message and its
Context to the node's long-lived worker and returns its reply.

* the replies are the same bit for bit with and without the worker (every array, metric and
  config entry), and so are W and every accuracy of the run;
* an absent, unreachable or dying worker costs one log line: the ClientApp answers itself;
* the worker's folder is private (0700) and a folder or socket of another user, or open to
  group or others, is refused;
* the worker exits when idle or when its parent is gone;
* a fresh ClientApp process whose worker answers never imports torch.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, Message, RecordDict
from flwr.common.serde import context_to_proto, message_to_proto

import clients.app
from clients import worker
from fcl_flower.local_grid import LocalGrid
from tests.conftest import build, server_identity, small_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path (a Unix socket's path has at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="fclw-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def node_configs(k: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"partition-id": i, "num-partitions": k, **extra} for i in range(k)]


@contextmanager
def worker_threads(configs: Sequence[dict[str, Any]], run_config: dict[str, Any]) -> Iterator[list[str]]:
    """Each node's worker, served by a thread of this process; yields the names of the threads
    that handled messages (one entry per message)."""
    handled: list[str] = []
    real = clients.app.handle_here

    def spying(message: Message, context: Context) -> Message:
        handled.append(threading.current_thread().name)
        return real(message, context)

    stop = threading.Event()
    threads = []
    clients.app.handle_here = spying  # serve_one looks it up per message
    try:
        for k, nc in enumerate(configs):
            path = worker.socket_path(worker.worker_folder(nc), worker.worker_key(nc, run_config))
            thread = threading.Thread(
                target=worker.serve, args=(path,), kwargs={"stop": stop, "preload": False}, name=f"worker-{k}"
            )
            thread.start()
            threads.append(thread)
            deadline = time.monotonic() + 10
            while not path.exists():
                assert time.monotonic() < deadline, "the worker never made its socket"
                time.sleep(0.01)
        yield handled
    finally:
        clients.app.handle_here = real
        stop.set()
        for thread in threads:
            thread.join(10)


def without_clock(content: RecordDict) -> dict[str, dict[str, Any]]:
    """A reply's metrics, less a train reply's ``train-seconds`` (the client's own clock, different on
    every run), which must be there in both or neither."""
    metrics = {k: dict(v) for k, v in content.metric_records.items()}
    for record in metrics.values():
        if "train-seconds" in record:
            assert record["train-seconds"] >= 0
            record["train-seconds"] = "a duration"
    return metrics


def assert_same_content(a: RecordDict, b: RecordDict) -> None:
    """Every array (dtype, shape, bytes), metric and config entry of two replies is the same (a
    train reply's ``train-seconds`` being present in both: the local epochs' wall time)."""
    assert sorted(a.array_records) == sorted(b.array_records)
    for name, rec in a.array_records.items():
        other = b.array_records[name]
        assert list(rec) == list(other)
        for key in rec:
            x, y = rec[key], other[key]
            assert (x.dtype, x.shape, x.stype) == (y.dtype, y.shape, y.stype) and x.data == y.data, (name, key)
    assert without_clock(a) == without_clock(b)
    assert {k: dict(v) for k, v in a.config_records.items()} == {k: dict(v) for k, v in b.config_records.items()}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> LocalGrid:
    """One small run without workers (info, a FedAvg round, statistics, federated evaluation):
    its messages and replies."""
    cfg = small_config(
        tmp_path_factory.mktemp("plain"),
        rf_dim=100,
        num_tasks=2,
        num_clients=2,
        evaluation="both",
        stage1_rounds=1,
        local_epochs=1,
    )
    return run_grid(cfg, node_configs(2))[1]


def run_grid(cfg, configs: list[dict[str, Any]]):
    server_identity()
    strategy = build(cfg)
    grid = LocalGrid(clients.app.app, cfg.num_clients, first_node_id=1, node_configs=configs)
    strategy.start(grid)
    return strategy, grid


# ------------------------------------------------------------------------------ (1) equality
def test_the_same_messages_get_the_same_replies_bit_for_bit_through_the_worker(
    plain: LocalGrid, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every message of a small run (FedAvg training with first contact, statistics with the previous
    stage's evaluation, the last evaluation), handled again by the nodes' workers: every reply is the
    same, array by array, metric by metric."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_dir))
    grid = plain
    kinds = [m.metadata.message_type for m in grid.sent]
    assert {"train", "query.stats", "evaluate"} <= set(kinds)  # (first contact rides with the first round)
    warm = node_configs(2, **{"warm-worker": True})
    contexts = {
        k + 1: Context(run_id=1, node_id=k + 1, node_config=nc, state=RecordDict(), run_config={})
        for k, nc in enumerate(warm)
    }
    with worker_threads(warm, run_config={}) as handled:
        replies = [clients.app.app(m, contexts[m.metadata.dst_node_id]) for m in grid.sent]
    assert handled == [f"worker-{m.metadata.dst_node_id - 1}" for m in grid.sent]  # all by the workers
    for message, a, b in zip(grid.sent, grid.replies, replies):
        assert not a.has_error() and not b.has_error()
        assert b.metadata.reply_to_message_id == message.metadata.message_id
        assert (b.metadata.message_type, b.metadata.dst_node_id) == (a.metadata.message_type, a.metadata.dst_node_id)
        assert_same_content(a.content, b.content)


def test_a_secure_round_keeps_its_state_through_the_worker(
    tmp_path: Path, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Secure aggregation keeps each node's secrets in context.state between its four messages:
    the worker gets the state and the ClientApp gets back what the worker left; W is the same."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_dir))
    cfg = small_config(tmp_path / "a", rf_dim=100, num_tasks=2, num_clients=3, secure_aggregation=True)
    direct, _ = run_grid(cfg, node_configs(3))
    warm = node_configs(3, **{"warm-worker": True})
    with worker_threads(warm, run_config={}) as handled:
        served, grid = run_grid(cfg.replace(out=str(tmp_path / "b")), warm)
    assert {"query.keys", "query.shares", "query.unmask"} <= {m.metadata.message_type for m in grid.sent}
    assert len(handled) == len(grid.sent) and not any(r.has_error() for r in grid.replies)
    assert torch.equal(direct.weights, served.weights)
    assert [s.accuracy for s in direct.recorder.stages] == [s.accuracy for s in served.recorder.stages]


def test_a_handler_error_reads_the_same_through_the_worker(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A message the handler refuses raises, in the ClientApp, an error of the same module, name
    and text as without the worker: Flower's error reply to the server is the same."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_dir))
    message = Message(RecordDict(), dst_node_id=1, message_type="query.stats")
    nc = {"partition-id": 0, "warm-worker": True}

    def error_of(config: dict[str, Any]) -> str:
        context = Context(run_id=1, node_id=1, node_config=config, state=RecordDict(), run_config={})
        with pytest.raises(Exception) as info:
            clients.app.app(message, context)
        return str(type(info.value)) + ":<'" + str(info.value) + "'>"  # how flwr-clientapp words it

    server_identity()
    direct = error_of({"partition-id": 0})
    with worker_threads([nc], run_config={}) as handled:
        assert error_of(nc) == direct and handled == ["worker-0"]


# ------------------------------------------------------------------------------ (2) fallback
def one_message(grid: LocalGrid) -> tuple[Message, Message]:
    """A statistics message for node 1 of the small run, and its reply without a worker."""
    index = next(
        i for i, m in enumerate(grid.sent) if m.metadata.message_type == "query.stats" and m.metadata.dst_node_id == 1
    )
    return grid.sent[index], grid.replies[index]


def worker_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "warm worker" in r.getMessage()]


def test_no_worker_means_one_line_a_start_and_the_same_reply(
    plain: LocalGrid, short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    message, expected = one_message(plain)
    started: list[Path] = []

    def start_worker(path: Path, node_config: Any) -> int:
        started.append(path)
        return 4242

    monkeypatch.setattr(worker, "start_worker", start_worker)
    nc: dict[str, Any] = {
        "partition-id": 0,
        "num-partitions": 2,
        "warm-worker": True,
        "warm-worker-dir": str(short_dir),
    }
    context = Context(run_id=1, node_id=1, node_config=nc, state=RecordDict(), run_config={"x": 1})
    with caplog.at_level(logging.INFO):
        reply = clients.app.app(message, context)
    assert_same_content(reply.content, expected.content)
    assert worker_lines(caplog) == [
        "warm worker: none ran for this node; started one (pid 4242), this message is handled here"
    ]
    assert started == [worker.socket_path(worker.worker_folder(nc), worker.worker_key(nc, {"x": 1}))]


def node_socket(short_dir: Path) -> tuple[dict[str, Any], Path]:
    """Node 0's config with the warm worker on, and the socket path its worker would use."""
    nc: dict[str, Any] = {
        "partition-id": 0,
        "num-partitions": 2,
        "warm-worker": True,
        "warm-worker-dir": str(short_dir),
    }
    return nc, worker.socket_path(worker.worker_folder(nc), worker.worker_key(nc, {}))


def test_a_killed_workers_stale_socket_means_a_new_worker_and_one_line(
    plain: LocalGrid, short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker killed with SIGKILL leaves its socket file behind, with nobody listening: the
    ClientApp starts a new worker, answers itself and logs one line."""
    message, expected = one_message(plain)
    nc, path = node_socket(short_dir)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    os.chmod(path, 0o600)
    dead.close()  # the file stays: a connect is refused
    started: list[Path] = []

    def start_worker(where: Path, node_config: Any) -> int:
        started.append(where)
        return 4243

    monkeypatch.setattr(worker, "start_worker", start_worker)
    context = Context(run_id=1, node_id=1, node_config=nc, state=RecordDict(), run_config={})
    with caplog.at_level(logging.INFO):
        reply = clients.app.app(message, context)
    assert_same_content(reply.content, expected.content)
    assert started == [path] and len(worker_lines(caplog)) == 1


def test_a_worker_that_dies_mid_message_costs_one_line(
    plain: LocalGrid, short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    message, expected = one_message(plain)
    nc, path = node_socket(short_dir)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o600)
    server.listen(1)

    def die_after_the_header() -> None:  # reads the request's first frame, then the process is gone
        conn, _ = server.accept()
        worker.recv_frame(conn)
        conn.close()

    thread = threading.Thread(target=die_after_the_header)
    thread.start()
    monkeypatch.setattr(worker, "start_worker", lambda *a: pytest.fail("a worker was listening"))
    context = Context(run_id=1, node_id=1, node_config=nc, state=RecordDict(), run_config={})
    with caplog.at_level(logging.INFO):
        reply = clients.app.app(message, context)
    thread.join(10)
    server.close()
    assert_same_content(reply.content, expected.content)
    lines = worker_lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("warm worker failed mid-message (")


# ------------------------------------------------------------------------------ (3) private folder
def test_the_folder_is_private_and_a_foreign_or_open_one_is_refused(short_dir: Path) -> None:
    nc = {"warm-worker-dir": str(short_dir)}
    folder = worker.worker_folder(nc)
    assert folder.parent == short_dir and (os.stat(folder).st_mode & 0o777) == 0o700
    os.chmod(folder, 0o750)
    with pytest.raises(worker.WorkerError, match=r"open to group or others \(mode 750\): refused"):
        worker.worker_folder(nc)
    os.chmod(folder, 0o700)
    other_uid = os.getuid() + 1
    if os.getuid() == 0:
        os.chown(folder, other_uid, -1)
        with pytest.raises(worker.WorkerError, match=f"belongs to uid {other_uid}, not 0: refused"):
            worker.worker_folder(nc)
        os.chown(folder, 0, -1)
    real = folder.with_name("real")
    real.mkdir(mode=0o700)
    shutil.rmtree(folder)
    folder.symlink_to(real)  # someone else's link where the folder should be
    with pytest.raises(worker.WorkerError, match="is not a folder: refused"):
        worker.worker_folder(nc)


def test_a_foreign_uid_or_an_open_socket_is_refused(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = worker.worker_folder({"warm-worker-dir": str(short_dir)})
    path = folder / "k.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o666)
    with pytest.raises(worker.WorkerError, match=r"socket .* is open to group or others \(mode 666\): refused"):
        worker._connect(path)
    os.chmod(path, 0o600)
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 7)  # as if another user ran this ClientApp
    with pytest.raises(worker.WorkerError, match=f"belongs to uid {real_uid}, not {real_uid + 7}: refused"):
        worker._connect(path)
    server.close()


# ------------------------------------------------------------------------------ (4) lifetime
def test_the_worker_exits_when_idle_or_when_its_parent_is_gone(short_dir: Path) -> None:
    folder = worker.worker_folder({"warm-worker-dir": str(short_dir)})
    path = folder / "idle.sock"
    t0 = time.monotonic()
    assert worker.serve(path, idle=0.3, preload=False) == "idle for 0.3 s"
    assert 0.3 <= time.monotonic() - t0 < 5 and not path.exists()

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert worker.serve(path, idle=60, parent_pid=gone.pid, preload=False) == f"its parent {gone.pid} is gone"
    assert not path.exists()


def test_a_second_worker_for_the_same_socket_steps_aside(short_dir: Path) -> None:
    folder = worker.worker_folder({"warm-worker-dir": str(short_dir)})
    path = folder / "one.sock"
    stop = threading.Event()
    first = threading.Thread(target=worker.serve, args=(path,), kwargs={"stop": stop, "preload": False})
    first.start()
    try:
        while not path.exists():
            time.sleep(0.01)
        assert worker.serve(path, idle=60, preload=False) == "busy" and path.exists()
    finally:
        stop.set()
        first.join(10)


# ------------------------------------------------------------------------------ (5) thin ClientApp
THIN_CLIENT = """
import json, sys, time
t0 = time.perf_counter()
import clients.app
from flwr.app import Context, RecordDict
from flwr.common.serde import context_from_proto, message_from_proto
from flwr.proto.message_pb2 import Context as PC, Message as PM
message = message_from_proto(PM.FromString(open(sys.argv[1], "rb").read()))
context = context_from_proto(PC.FromString(open(sys.argv[2], "rb").read()))
reply = clients.app.app(message, context)
t1 = time.perf_counter()
arrays = {f"{n}/{k}": a.data.hex() for n, r in reply.content.array_records.items() for k, a in r.items()}
print(json.dumps({"torch": "torch" in sys.modules, "seconds": t1 - t0, "arrays": arrays,
                  "metrics": {n: dict(r) for n, r in reply.content.metric_records.items()}}))
"""


def test_a_fresh_clientapp_whose_worker_answers_never_imports_torch(
    plain: LocalGrid, tmp_path: Path, short_dir: Path
) -> None:
    """A fresh interpreter, as flwr-clientapp is for every message: the ClientApp hands the
    message to the node's worker (here served by a thread of this test's process) and gives
    back its reply, the same bit for bit, without importing torch."""
    message, expected = one_message(plain)
    nc: dict[str, Any] = {
        "partition-id": 0,
        "num-partitions": 2,
        "warm-worker": True,
        "warm-worker-dir": str(short_dir),
    }
    message.metadata.__dict__["_message_id"] = message.object_id
    (tmp_path / "m.pb").write_bytes(message_to_proto(message).SerializeToString())
    context = Context(run_id=1, node_id=1, node_config=nc, state=RecordDict(), run_config={"seed": 3})
    (tmp_path / "c.pb").write_bytes(context_to_proto(context).SerializeToString())
    with worker_threads([nc], run_config={"seed": 3}) as handled:
        out = subprocess.run(
            [sys.executable, "-c", THIN_CLIENT, str(tmp_path / "m.pb"), str(tmp_path / "c.pb")],
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert handled == ["worker-0"] and got["torch"] is False
    assert "warm worker" not in out.stderr  # answered by the worker: no fallback line
    want = {f"{n}/{k}": a.data.hex() for n, r in expected.content.array_records.items() for k, a in r.items()}
    assert got["arrays"] == want and want
    assert got["metrics"] == {n: dict(r) for n, r in expected.content.metric_records.items()}


def test_the_operators_command_serves_the_node_config_for_every_run(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``python -m clients.worker --node-config "..."`` (the SuperNode's own string) serves the
    socket a ClientApp of that node config tries for any run config, and exits when idle."""
    spec = f"partition-id=0 num-partitions=2 warm-worker=true warm-worker-dir='{short_dir}' warm-worker-idle=0.3"
    nc = {"partition-id": 0, "num-partitions": 2, "warm-worker": True, "warm-worker-dir": str(short_dir)}
    nc["warm-worker-idle"] = 0.3
    with caplog.at_level(logging.INFO):
        assert worker.main(["--node-config", spec]) == 0
    path = worker.socket_path(worker.worker_folder(nc), worker.worker_key(nc, None))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm worker pid")]
    assert lines[0].endswith(f"serves {path} (idle timeout 0.3 s, parent None)") and lines[1].endswith("idle for 0.3 s")
    assert worker.main(["--node-config", f"partition-id=0 warm-worker-idle=-1 warm-worker-dir='{short_dir}'"]) == 2
