"""A warm worker per node: one long-lived process that answers this node's messages.

On a real SuperNode Flower starts a fresh ``flwr-clientapp`` process for every message; left to
itself that process imports torch, builds the model and opens the node's data every time, more
than half of a round. With ``warm-worker = true`` in the node config the ClientApp
(:func:`clients.app.handle`) stays thin: it hands the message and its Context to this node's
worker and returns the worker's reply. The worker keeps what the handlers cache between
messages (the model, the backbone's features, the node's data) and handles each message with the
very same code (:func:`clients.app.handle_here`), one at a time, so the replies are the same bit
for bit. The Context's state (secure-aggregation secrets between the steps of a round, the
memories of LwF/LGA/STAMP) travels both ways: the ClientApp hands Flower the state the worker
left, exactly as if it had handled the message itself.

* **Reachable only by the node's own user.** A Unix socket in a folder of this user's, mode
  0700 (``$XDG_RUNTIME_DIR`` or the system's temporary folder, or node config
  ``warm-worker-dir``); a folder or socket owned by another user, or open to group or others,
  is refused, and the worker answers only a peer of its own uid (``SO_PEERCRED``).
* **One per node and run configuration.** The socket's name is a hash of the node config, the
  run config, the app's folder and the interpreter; an operator's worker (started with
  ``python -m clients.worker --node-config "..."``) serves every run of that node config.
* **Started on first use.** A ClientApp that finds no worker starts one (detached, a session of
  its own, its output in ``<socket>.log``) and answers that message itself.
* **Gone with its node.** It exits when the process that started it (the SuperNode's executor,
  or ``--parent-pid``) is gone, or after ``warm-worker-idle`` seconds without a message
  (default 600).
* **Never in the way.** If the worker is absent, refused, or dies mid-message, the ClientApp
  logs one line and handles the message itself, as without a worker.

The ideas are those of Flower's own warm executors (flwr/supercore/superexec/executor/
warm_executor_pool.py): a warm process is found by a hash of everything that makes it fit
(there: image, FAB hash; here: node config, run config, app folder, interpreter), a pool never
serves an incompatible task, and a task that finds no ready one takes the cold path.

Frames are length-prefixed (8 bytes, big-endian) and carry Flower's own protobuf encoding of the
Message and the Context (``flwr.common.serde``) and one small JSON header: no pickle. This module
imports neither torch nor the protocol until it serves.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.common.logger import log
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.proto.message_pb2 import Message as ProtoMessage

from fcl_flower.private_paths import private_path_problem

ENABLE_KEY = "warm-worker"  # node config: true hands messages to the node's worker (clients/app.py)
IDLE_KEY = "warm-worker-idle"  # node config: seconds without a message before the worker exits
DIR_KEY = "warm-worker-dir"  # node config: the folder that holds the worker's private folder
DEFAULT_IDLE = 600.0
PROTOCOL = "fcl-flower-worker/1"
APP_ROOT = Path(__file__).resolve().parents[1]  # the app's folder: the worker imports the same code
FRAME = struct.Struct(">Q")
MAX_FRAME = 1 << 36  # 64 GiB: a length beyond it is a corrupt frame, not a message
SOCKET_PATH_MAX = 107  # sun_path's limit on Linux, less the terminating NUL

#: workers this process started (kept so that Python does not warn about a running child)
spawned: list[subprocess.Popen[bytes]] = []


class WorkerError(RuntimeError):
    """The worker's folder, socket or frames cannot be trusted or used; one line."""


class WorkerRaised(Exception):  # the base of the worker's handler errors, re-raised here
    """An exception the worker's handler raised, raised again in the ClientApp under its own
    module and name, so Flower's error reply to the server reads exactly as without a worker."""


# ------------------------------------------------------------------------------ where
def idle_seconds(node_config: Mapping[str, Any]) -> float:
    """The node config's idle timeout (``warm-worker-idle``), checked."""
    value = node_config.get(IDLE_KEY, DEFAULT_IDLE)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise WorkerError(f"node config {IDLE_KEY} must be a positive number of seconds, not {value!r}")
    return float(value)


def worker_key(node_config: Mapping[str, Any], run_config: Mapping[str, Any] | None) -> str:
    """The name of the worker of this node config and run config (``None``: every run's)."""
    blob = json.dumps(
        {
            "node": dict(node_config),
            "run": None if run_config is None else dict(run_config),
            "app": str(APP_ROOT),
            "python": sys.executable,
        },
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def check_private(path: Path, *, kind: str) -> None:
    """Refuse ``path`` unless it is a ``kind`` ("folder" or "socket") of this user's, closed to
    group and others, and not a symbolic link (fcl_flower/private_paths.py)."""
    problem = private_path_problem(path, kind)
    if problem is not None:
        raise WorkerError(f"warm worker {kind} {path} {problem}: refused")


def worker_folder(node_config: Mapping[str, Any]) -> Path:
    """This user's private folder of workers (made 0700 if absent; refused if not private)."""
    base = node_config.get(DIR_KEY) or os.environ.get("XDG_RUNTIME_DIR") or ""
    if not base or not Path(str(base)).is_dir():
        base = tempfile.gettempdir()
    folder = Path(str(base)) / f"fcl-flower-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as err:
        raise WorkerError(f"cannot make the warm worker folder {folder}: {err.strerror}") from None
    check_private(folder, kind="folder")
    return folder


def socket_path(folder: Path, key: str) -> Path:
    path = folder / f"{key}.sock"
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise WorkerError(f"warm worker socket path {path} is longer than {SOCKET_PATH_MAX} bytes")
    return path


# ------------------------------------------------------------------------------ frames
def send_frames(sock: socket.socket, *parts: bytes) -> None:
    for part in parts:
        sock.sendall(FRAME.pack(len(part)))
        sock.sendall(part)


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {size} bytes")
        got += n
    return buf


def recv_frame(sock: socket.socket) -> bytearray:
    """One frame's payload (read in place: a large statistics upload is not copied again)."""
    (size,) = FRAME.unpack(_recv_exact(sock, FRAME.size))
    if size > MAX_FRAME:
        raise WorkerError(f"a warm worker frame of {size} bytes: refused")
    return _recv_exact(sock, size)


def _header(raw: bytes | bytearray) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except ValueError:
        raise WorkerError("a warm worker frame header that is not JSON: refused") from None
    if not isinstance(header, dict) or header.get("protocol") != PROTOCOL:
        raise WorkerError(f"a warm worker frame of another protocol than {PROTOCOL}: refused")
    return header


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


# ------------------------------------------------------------------------------ the ClientApp's side
def _connect(path: Path) -> socket.socket | None:
    """A connection to the worker at ``path``; None when none listens there."""
    if not os.path.lexists(path):
        return None
    check_private(path, kind="socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):  # a stale socket: its worker is gone
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    if _peer_uid(sock) != os.getuid():
        sock.close()
        raise WorkerError(f"the warm worker at {path} runs as another user: refused")
    return sock


def raised(error: Mapping[str, Any]) -> WorkerRaised:
    """The worker's handler error as an exception of the same module, name and text."""
    module, qualname = str(error.get("module", "builtins")), str(error.get("qualname", "Exception"))
    cls = type(qualname.rsplit(".", 1)[-1], (WorkerRaised,), {"__module__": module, "__qualname__": qualname})
    return cls(str(error.get("text", "")))


def exchange(sock: socket.socket, message: Message, context: Context) -> tuple[Message | None, Context, dict]:
    """One message to the worker and back: (its reply or None, the Context it left, the header)."""
    send_frames(
        sock,
        json.dumps({"protocol": PROTOCOL}).encode(),
        message_to_proto(message).SerializeToString(),
        context_to_proto(context).SerializeToString(),
    )
    header = _header(recv_frame(sock))
    after = context_from_proto(ProtoContext.FromString(recv_frame(sock)))
    body = recv_frame(sock)
    reply = message_from_proto(ProtoMessage.FromString(body)) if header.get("ok") else None
    return reply, after, header


def forward(message: Message, context: Context) -> Message | None:
    """The worker's reply to ``message`` (``context.state`` updated as the worker left it), or
    None when no worker answered: then one line is logged, a worker is started if none runs,
    and the caller handles the message itself. An error of the worker's handler is raised here
    as that handler's error (:class:`WorkerRaised`), as the ClientApp would have raised it."""
    try:
        folder = worker_folder(context.node_config)
        own = socket_path(folder, worker_key(context.node_config, context.run_config))
        sock = _connect(own) or _connect(socket_path(folder, worker_key(context.node_config, None)))
        if sock is None:
            pid = start_worker(own, context.node_config)
            log(INFO, "warm worker: none ran for this node; started one (pid %d), this message is handled here", pid)
            return None
    except (WorkerError, OSError) as err:
        log(WARNING, "warm worker unavailable (%s); this message is handled here", err)
        return None
    try:
        with sock:
            reply, after, header = exchange(sock, message, context)
    except Exception as err:  # any failure of the worker or the wire: answer here
        log(WARNING, "warm worker failed mid-message (%s: %s); this message is handled here", type(err).__name__, err)
        return None
    context.state = after.state
    if reply is None:
        raise raised(header.get("error", {}))
    return reply


def start_worker(path: Path, node_config: Mapping[str, Any]) -> int:
    """Start the worker of ``path`` detached from this process (a session of its own, output
    in ``<socket>.log``); it exits with this process's parent (the SuperNode's executor)."""
    idle = idle_seconds(node_config)
    log_path = path.with_suffix(".log")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(APP_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    try:
        command = [sys.executable, "-m", "clients.worker", "--socket", str(path), "--idle", repr(idle)]
        proc = subprocess.Popen(
            [*command, "--parent-pid", str(os.getppid())],
            cwd=APP_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(fd)
    spawned.append(proc)
    return proc.pid


# ------------------------------------------------------------------------------ the worker's side
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _error_of(err: BaseException) -> dict[str, str]:
    return {"module": type(err).__module__, "qualname": type(err).__qualname__, "text": str(err)}


def serve_one(conn: socket.socket) -> None:
    """Read one message and its Context, handle it here, send back the reply and the Context."""
    from clients.app import handle_here

    _header(recv_frame(conn))
    message = message_from_proto(ProtoMessage.FromString(recv_frame(conn)))
    context = context_from_proto(ProtoContext.FromString(recv_frame(conn)))
    reply: Message | None = None
    error: dict[str, str] | None = None
    started = time.perf_counter()
    try:
        reply = handle_here(message, context)
    except Exception as err:  # the ClientApp raises it again, as Flower would see it
        log(ERROR, "the handler raised %s: %s", type(err).__name__, err, exc_info=err)
        error = _error_of(err)
    log(INFO, "warm worker: %s handled in %.3f s", message.metadata.message_type, time.perf_counter() - started)
    header = {"protocol": PROTOCOL, "ok": reply is not None, **({"error": error} if error else {})}
    send_frames(
        conn,
        json.dumps(header).encode(),
        context_to_proto(context).SerializeToString(),
        b"" if reply is None else message_to_proto(reply).SerializeToString(),
    )


def serve(
    path: Path,
    *,
    idle: float = DEFAULT_IDLE,
    parent_pid: int | None = None,
    stop: threading.Event | None = None,
    preload: bool = True,
) -> str:
    """Serve ``path`` until idle for ``idle`` seconds, ``parent_pid`` is gone or ``stop`` is set;
    returns why it stopped ("busy": another worker already serves ``path``)."""
    import fcntl

    check_private(path.parent, kind="folder")
    lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "busy"
        if os.path.lexists(path):
            os.unlink(path)  # we hold the lock: whoever made it is gone
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            server.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        inode = os.stat(path).st_ino
        server.listen(16)
        server.settimeout(0.2)
        log(INFO, "warm worker pid %d serves %s (idle timeout %g s, parent %s)", os.getpid(), path, idle, parent_pid)
        if preload:  # after bind: a ClientApp that connects now waits for this, less than a cold start
            import clients.job  # noqa: F401  # torch, the models, the node data
        last = time.monotonic()
        why = ""
        with server:
            while not why:
                if stop is not None and stop.is_set():
                    why = "stopped"
                    break
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    if parent_pid is not None and not _alive(parent_pid):
                        why = f"its parent {parent_pid} is gone"
                    elif time.monotonic() - last > idle:
                        why = f"idle for {idle:g} s"
                    continue
                with conn:
                    conn.settimeout(None)
                    try:
                        if _peer_uid(conn) != os.getuid():
                            log(WARNING, "warm worker: refused a peer of another uid")
                        else:
                            serve_one(conn)
                    except (OSError, WorkerError, ValueError) as err:
                        log(WARNING, "warm worker: a connection failed (%s: %s)", type(err).__name__, err)
                last = time.monotonic()
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except FileNotFoundError:
            pass
        log(INFO, "warm worker pid %d exits: %s", os.getpid(), why)
        return why
    finally:
        os.close(lock)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m clients.worker",
        description="This node's warm worker: answers the messages its ClientApps hand over (node config "
        "warm-worker=true). Start it next to the SuperNode with the SuperNode's own --node-config.",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--node-config", help='the SuperNode\'s --node-config, e.g. "partition-id=0 warm-worker=true"')
    where.add_argument("--socket", type=Path, help=argparse.SUPPRESS)  # a ClientApp's own start
    parser.add_argument("--idle", type=float, default=None, help="seconds without a message before it exits")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the SuperNode) is gone")
    args = parser.parse_args(argv)
    try:
        if args.socket is not None:
            path = args.socket
            idle = DEFAULT_IDLE if args.idle is None else args.idle
        else:
            from flwr.common.config import parse_config_args

            node_config = parse_config_args([args.node_config])
            idle = idle_seconds(node_config) if args.idle is None else args.idle
            path = socket_path(worker_folder(node_config), worker_key(node_config, None))
        if not idle > 0:
            raise WorkerError(f"--idle must be positive, not {idle}")
        stop = threading.Event()
        before = {}
        if threading.current_thread() is threading.main_thread():  # SIGTERM/SIGINT: finish, remove the socket
            before = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            why = serve(path, idle=idle, parent_pid=args.parent_pid, stop=stop)
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
    except (WorkerError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if why == "busy":
        print(f"a warm worker already serves {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
