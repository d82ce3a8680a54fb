"""A SuperLink and N SuperNodes as real processes on this machine, with TLS and SuperNode auth.

    python deploy/local_federation.py --workdir /tmp/fcl-fed --data /tmp/fcl-data --num-nodes 3
    python deploy/local_federation.py --workdir /tmp/fcl-fed --data /tmp/fcl-data --num-nodes 3 \\
        --run "num-tasks=3 first-task-classes=4 num-clients=3 stage1-rounds=0 out='/tmp/fcl-out'"

The first form starts everything, prints how to submit a run, and stops every process on
Ctrl-C. The second submits one run of this app, waits until it finishes and stops everything;
Ctrl-C stops it within seconds: every process ended, results.json marked ``interrupted``, one
line (the stages saved, the command that resumes the run), exit code 130.
``--data`` is the output folder of ``experiments/export_partitions.py``: SuperNode k gets
``data-dir=<data>/client-k`` and nothing else; without ``--data`` SuperNode k gets
``partition-id=k num-partitions=N`` instead. ``--site FOLDER`` (once per site) federates the
sites' own images (``dataset = custom``, docs/own_data.md): SuperNode k gets
``data-dir=<k-th folder> partition-id=k``::

    python deploy/local_federation.py --workdir /tmp/fcl-fed --site /data/a --site /data/b --site /data/c \\
        --run "dataset='custom' class-names='cat,dog,fox' image-size=32 num-clients=3 evaluation='federated' ..."

What it does, in the order an operator would (deploy/README.md has the same steps by hand):

1. ``deploy/make_certs.sh``: a throw-away CA and a server certificate for 127.0.0.1/localhost;
2. ``deploy/make_keys.sh``: one ECDSA P-384 key pair per SuperNode;
3. ``flower-superlink --enable-supernode-auth`` with the certificate, on a free port;
4. ``flwr supernode register <key>.pub``: the SuperLink learns which public keys to admit;
5. ``flower-supernode --auth-supernode-private-key <key> --root-certificates ca.crt`` per node.

Everything the Flower CLI writes goes under ``<workdir>/flwr-home`` (``FLWR_HOME``), so the
user's own ``~/.flwr`` configuration is never touched. Every process is started in its own
session; :meth:`LocalFederation.stop` terminates the sessions and every descendant it can find
(ServerApp/ClientApp/SuperExec processes), then kills what is left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
APP_DIR = HERE.parent
CONNECTION = "fcl-local"


class FederationError(RuntimeError):
    """A process of the local federation did not start or a run did not finish."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def format_run_config(values: Mapping[str, Any]) -> str:
    """``{"num-tasks": 3, "out": "/x"}`` -> ``num-tasks=3 out='/x'`` (TOML values for flwr run)."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = json.dumps(str(value))  # a TOML basic string
        parts.append(f"{key}={text}")
    return " ".join(parts)


def descendants(pids: Sequence[int]) -> set[int]:
    """Every live descendant of ``pids`` (from /proc; Linux), not including ``pids``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@dataclass
class LocalFederation:
    """SuperLink + SuperNodes on 127.0.0.1; use as a context manager so that it always stops."""

    workdir: Path
    node_configs: list[str]
    port: int = 0  # SuperLink (Fleet, Control and Runtime API share it in flwr 1.41); 0: a free one
    bin_dir: Path = field(default_factory=lambda: Path(sys.executable).parent)
    processes: list[subprocess.Popen] = field(default_factory=list)
    logs: dict[str, Path] = field(default_factory=dict)
    core: dict[str, subprocess.Popen] = field(default_factory=dict)  # must stay up: link + nodes

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).resolve()
        self.port = self.port or free_port()
        self.certs = self.workdir / "certs"
        self.keys = self.workdir / "keys"
        self.home = self.workdir / "flwr-home"
        self._known_pids: set[int] = set()
        self._stopped = False
        self._control: Any = None  # Flower's Control API client (control()), made on first use

    # ------------------------------------------------------------------ environment
    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["FLWR_HOME"] = str(self.home)
        env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"  # never `uv sync` at run time
        # The SuperNode's SuperExec checks for a message to start a ClientApp for every 1 s by
        # default; 0.1 s takes up to 0.9 s off every round for a few polls of a local socket.
        env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1")
        env["NO_COLOR"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def write_connection(self) -> Path:
        """The SuperLink connection `flwr` uses, in this federation's own Flower config file."""
        self.home.mkdir(parents=True, exist_ok=True)
        path = self.home / "config.toml"
        path.write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "{self.address}"\n'
            f'root-certificates = "{self.certs / "ca.crt"}"\n'
        )
        return path

    def flwr(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run the Flower CLI against this federation."""
        result = subprocess.run(
            [str(self.bin_dir / "flwr"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if check and result.returncode != 0:
            raise FederationError(
                f"flwr {' '.join(args)} failed ({result.returncode}): {(result.stdout + result.stderr).strip()[-800:]}"
            )
        return result

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.logs[name] = log
        with log.open("wb") as handle:
            process = subprocess.Popen(
                argv,
                env=self.env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def log_tail(self, name: str, chars: int = 1500) -> str:
        path = self.logs.get(name)
        return path.read_text(errors="replace")[-chars:] if path and path.exists() else ""

    # ------------------------------------------------------------------ start
    def make_credentials(self) -> None:
        """TLS certificates (deploy/make_certs.sh, or the same in Python without openssl) and one
        SuperNode key pair more than there are nodes (a spare, unregistered key for tests)."""
        if shutil.which("openssl"):
            subprocess.run(
                ["bash", str(HERE / "make_certs.sh"), str(self.certs)], check=True, capture_output=True, env=self.env
            )
        else:
            write_certificates(self.certs)
        subprocess.run(
            ["bash", str(HERE / "make_keys.sh"), str(self.keys), str(len(self.node_configs) + 1)],
            check=True,
            capture_output=True,
            env=self.env,
        )

    def write_trusted_keys(self) -> Path:
        """The operator's list of the federation's SuperNode public keys (the registered ones, not
        the spare): what every node checks its peers' secure-aggregation signatures against."""
        path = self.keys / "trusted.pub"
        lines = [(self.keys / f"supernode-{k}.pub").read_text().strip() for k in range(len(self.node_configs))]
        path.write_text("\n".join(lines) + "\n")
        return path

    def secagg_node_config(self, name: str, trusted: Path) -> str:
        """Node-config entries for signed keys by default (each node signs with the key it already has
        for SuperNode authentication) and the node's own secure-aggregation ledger folder."""
        entries = {
            "secagg-signing-key": self.keys / name,
            "secagg-trusted-keys": trusted,
            "secagg-ledger": self.workdir / "ledger" / name,
        }
        return " ".join(f"{key}={json.dumps(str(value))}" for key, value in entries.items())

    def start_superlink(self, timeout: float = 60.0) -> None:
        self.write_connection()
        self._spawn(
            "superlink",
            [
                str(self.bin_dir / "flower-superlink"),
                "--ssl-ca-certfile",
                str(self.certs / "ca.crt"),
                "--ssl-certfile",
                str(self.certs / "server.pem"),
                "--ssl-keyfile",
                str(self.certs / "server.key"),
                "--enable-supernode-auth",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
            ],
        )
        self.core["superlink"] = self.processes[-1]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.processes[-1].poll() is not None:
                raise FederationError(f"flower-superlink exited:\n{self.log_tail('superlink')}")
            if self.reachable():
                return
            time.sleep(0.5)
        raise FederationError(f"SuperLink not reachable at {self.address} after {timeout:.0f} s")

    def reachable(self) -> bool:
        """Whether the SuperLink answers the CLI: ``flwr supernode ls`` may exit 0 with
        ``"success": false`` while the SuperLink is still starting."""
        result = self.flwr("supernode", "ls", CONNECTION, "--format", "json", check=False, timeout=30)
        if result.returncode != 0 or "{" not in result.stdout:
            return False
        try:
            return json.loads(result.stdout[result.stdout.index("{") :]).get("success", True) is not False
        except ValueError:
            return False

    def register(self, public_key: Path) -> int:
        """Admit a SuperNode's public key; returns its node id."""
        out = self.flwr("supernode", "register", str(public_key), CONNECTION, "--format", "json").stdout
        try:
            return int(json.loads(out[out.index("{") :])["node-id"])
        except (ValueError, KeyError):
            raise FederationError(f"flwr supernode register {public_key.name} answered: {out.strip()[-500:]}") from None

    def start_supernode(
        self, name: str, node_config: str, private_key: Path | None, *, give_up_after: float | None = None
    ) -> subprocess.Popen:
        argv = [
            str(self.bin_dir / "flower-supernode"),
            "--superlink",
            self.address,
            "--root-certificates",
            str(self.certs / "ca.crt"),
            "--node-config",
            node_config,
            "--port",
            str(free_port()),  # each SuperNode's own local Runtime API
        ]
        if private_key is not None:
            argv += ["--auth-supernode-private-key", str(private_key)]
        if give_up_after is not None:
            argv += ["--max-retries", "3", "--max-wait-time", str(give_up_after)]
        return self._spawn(name, argv)

    def online_nodes(self) -> list[dict[str, Any]]:
        out = self.flwr("supernode", "ls", CONNECTION, "--format", "json", timeout=30).stdout
        return [n for n in json.loads(out[out.index("{") :])["nodes"] if n["status"] == "online"]

    def wait_online(self, count: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if len(self.online_nodes()) >= count:
                return
            time.sleep(0.5)
        raise FederationError(f"fewer than {count} SuperNodes online after {timeout:.0f} s")

    def start(self, say: Callable[[str], None] = lambda _: None) -> LocalFederation:
        """Credentials, SuperLink, registration of every node's key, SuperNodes; waits until online.
        ``say`` hears each step as it begins (the command line prints them)."""
        began = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        say("making the CA, the SuperLink's certificate and one key per SuperNode ...")
        self.make_credentials()
        say("starting the SuperLink (TLS, SuperNode authentication) ...")
        self.start_superlink()
        trusted = self.write_trusted_keys()
        for k, node_config in enumerate(self.node_configs):
            self.register(self.keys / f"supernode-{k}.pub")
            name = f"supernode-{k}"
            say(f"registered {name}'s key; starting it ({node_config})")
            signed = self.secagg_node_config(name, trusted)
            self.core[name] = self.start_supernode(name, f"{node_config} {signed}", self.keys / name)
        say(f"waiting for {len(self.node_configs)} SuperNodes to come online ...")
        self.wait_online(len(self.node_configs))
        say(f"federation up in {time.monotonic() - began:.0f} s")
        return self

    # ------------------------------------------------------------------ runs
    def app_folder(self, app: Path = APP_DIR) -> Path:
        """What ``flwr run`` gets: :func:`app_snapshot` of ``app`` in this federation's workdir;
        FederationError (one line) where it cannot be copied."""
        try:
            return app_snapshot(app, self.workdir / "app", skip=(self.workdir,))
        except OSError as err:
            raise FederationError(f"cannot copy the app {app} for flwr run: {err}") from None

    def submit(self, run_config: Mapping[str, Any], app: Path = APP_DIR, timeout: float = 120.0) -> int:
        """``flwr run <app> <connection> --run-config ...``; returns the run id. Every node here has a
        SuperNode key and signs its secure rounds, so a secure run must say
        ``secagg-signed-keys=true`` (the nodes refuse it otherwise, each with one line)."""
        out = self.flwr(
            "run",
            str(self.app_folder(app)),
            CONNECTION,
            "--run-config",
            format_run_config(run_config),
            "--format",
            "json",
            timeout=timeout,
        ).stdout
        return int(json.loads(out[out.index("{") :])["run-id"])

    @contextlib.contextmanager
    def _flwr_home(self) -> Iterator[None]:
        """This federation's FLWR_HOME in this process while Flower's CLI code reads its config."""
        before = os.environ.get("FLWR_HOME")
        os.environ["FLWR_HOME"] = str(self.home)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("FLWR_HOME", None)
            else:
                os.environ["FLWR_HOME"] = before

    def control(self) -> Any:
        """Flower's own Control API client for this federation -- the one ``flwr ls`` builds from
        the connection in ``<workdir>/flwr-home`` (TLS with our CA, the CLI's interceptors) -- made
        once in this process. A status query is then one HTTP request to the SuperLink
        (milliseconds), where a ``flwr ls`` process costs ~0.74 s of CPU."""
        if self._control is None:
            with self._flwr_home():
                from flwr.cli.flower_config import read_superlink_connection
                from flwr.cli.utils import init_http_client_from_connection

                self._control = init_http_client_from_connection(read_superlink_connection(CONNECTION))
        return self._control

    def run_status(self, run_id: int) -> str:
        """``pending``, ``starting``, ``running`` or ``finished:<completed|failed|stopped>`` (as
        ``flwr ls`` shows it), through :meth:`control`; ``unknown`` for a run the SuperLink lacks."""
        from flwr.proto.control_pb2 import ListRunsRequest

        with self._flwr_home():
            try:
                response = self.control().ListRuns(ListRunsRequest(run_id=run_id))
            except Exception as err:  # httpx's HTTPStatusError: 404 for a run id the SuperLink lacks
                if getattr(getattr(err, "response", None), "status_code", None) == 404:
                    return "unknown"
                raise
        run = response.run_dict.get(run_id)
        if run is None:
            return "unknown"
        status, sub_status = str(run.status.status), str(run.status.sub_status)
        return f"{status}:{sub_status}" if sub_status else status

    def wait_run(self, run_id: int, timeout: float, poll: float = 0.5) -> str:
        """Until the run is ``finished:<completed|failed|stopped>``; returns that status.

        Watched from this process through the Control API (:meth:`run_status`, every ``poll``
        seconds): no ``flwr`` CLI process while a run goes, so a benchmark that times the run's
        rounds is not loaded by its own polling (issue 32)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.remember_descendants()
            status = self.run_status(run_id)
            if status.startswith("finished"):
                return status
            self.check_alive()
            time.sleep(poll)
        raise FederationError(f"run {run_id} not finished after {timeout:.0f} s")

    def check_alive(self) -> None:
        """Raise if the SuperLink or one of the registered SuperNodes has exited."""
        for name, process in self.core.items():
            if process.poll() is not None:
                raise FederationError(f"{name} exited ({process.returncode}):\n{self.log_tail(name)}")

    def run_log(self, run_id: int) -> str:
        return self.flwr("log", str(run_id), CONNECTION, "--show", check=False, timeout=30).stdout

    def follow_run(self, run_id: int, timeout: float) -> str:
        """Stream the run's log to this process's stdout while waiting for it; returns its status."""
        streamer = subprocess.Popen(  # flwr log --stream prints the ServerApp's lines as they come
            [str(self.bin_dir / "flwr"), "log", str(run_id), CONNECTION, "--stream"],
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C is ours to handle: no "Exiting logstream" after it
        )
        try:
            status = self.wait_run(run_id, timeout)
            with contextlib.suppress(subprocess.TimeoutExpired):
                streamer.wait(timeout=5)  # the stream ends with the run; give it the last lines
            return status
        finally:
            if streamer.poll() is None:
                streamer.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    streamer.wait(timeout=5)

    # ------------------------------------------------------------------ stop
    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every process this federation started and all their descendants, then SIGKILL.
        Once: a second call (``__exit__`` after an explicit stop) does nothing."""
        if self._stopped:
            return
        self._stopped = True
        if self._control is not None:
            with contextlib.suppress(Exception):  # the SuperLink may be gone already
                self._control.close()
            self._control = None
        roots = [p.pid for p in self.processes]
        targets = set(roots) | descendants(roots) | self._known_pids
        for process in self.processes:
            _signal_group(process.pid, signal.SIGTERM)
        for pid in targets:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        targets |= descendants(roots)
        time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
        for process in self.processes:
            _signal_group(process.pid, signal.SIGKILL)
        for pid in targets:
            if _alive(pid):
                _signal(pid, signal.SIGKILL)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        targets |= descendants(roots)  # anything spawned while we were stopping
        settle = time.monotonic() + 15.0  # a SIGKILLed process can take a moment to go on a busy machine
        while time.monotonic() < settle and any(_alive(pid) for pid in targets):
            for pid in targets:
                if _alive(pid):
                    _signal(pid, signal.SIGKILL)
            time.sleep(0.2)

    def remember_descendants(self) -> None:
        """Note the current process tree (the SuperExec re-parents to init once its parent dies)."""
        self._known_pids |= descendants([p.pid for p in self.processes])

    def surviving(self) -> list[int]:
        """Processes started by this federation that are still alive (should be [] after stop)."""
        pids = {p.pid for p in self.processes} | self._known_pids
        return sorted(pid for pid in pids if _alive(pid))

    def __enter__(self) -> LocalFederation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def app_snapshot(app: Path, into: Path, skip: Sequence[Path] = ()) -> Path:
    """The files of ``app`` that its FAB can hold, copied to ``into`` (made afresh): every file but
    those its ``.gitignore`` excludes, ``.git`` and ``skip``. ``flwr run`` walks and resolves every
    file under the folder it is given before it keeps the few its FAB rules allow, a virtual
    environment inside the app folder included: 72,000 files and 6.7 s of each submission on this
    project's VM. Flower builds the very same FAB from the copy (tests/test_fab.py)."""
    from flwr.cli.utils import build_pathspec, load_gitignore_patterns

    app, into = app.resolve(), into.resolve()
    if not (app / "pyproject.toml").is_file():
        raise FileNotFoundError(f"{app} is not a Flower app folder (no pyproject.toml)")
    ignore = app / ".gitignore"
    spec = build_pathspec(load_gitignore_patterns(ignore.read_bytes() if ignore.is_file() else b""))
    pruned = {into, *(Path(p).resolve() for p in skip)}
    if into.exists():
        shutil.rmtree(into)
    for folder, subfolders, names in os.walk(app):
        here = Path(folder)
        relative = here.relative_to(app)
        subfolders[:] = [
            d
            for d in subfolders
            if d != ".git"
            and (here / d) not in pruned
            and not (here / d).is_symlink()
            and not spec.match_file(f"{(relative / d).as_posix()}/")
        ]
        for name in names:
            path, rel = here / name, (relative / name).as_posix()
            if path.is_symlink() or spec.match_file(rel):
                continue
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, into / rel)
    return into


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # each process leads its own session/group (start_new_session)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not reaped


def write_certificates(out: Path, hosts: Sequence[str] = ("localhost", "127.0.0.1", "::1"), days: int = 30) -> None:
    """What deploy/make_certs.sh writes (ca.crt, ca.key, server.pem, server.key), with the
    ``cryptography`` package that ships with Flower, for machines without openssl."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    now = datetime.datetime.now(datetime.UTC)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("fcl-flower local CA"))
        .issuer_name(name("fcl-flower local CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    server = (
        x509.CertificateBuilder()
        .subject_name(name("fcl-flower SuperLink"))
        .issuer_name(ca.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    for file, data, mode in (
        ("ca.key", pem_key(ca_key), 0o600),
        ("server.key", pem_key(server_key), 0o600),
        ("ca.crt", ca.public_bytes(serialization.Encoding.PEM), 0o644),
        ("server.pem", server.public_bytes(serialization.Encoding.PEM), 0o644),
    ):
        path = out / file
        path.write_bytes(data)
        path.chmod(mode)


def with_signed_keys(run_config: str) -> str:
    """Secure aggregation here signs with the SuperNode keys by default (a malicious server is in
    scope wherever SuperNodes authenticate): ``secagg-signed-keys=true`` unless the run names it."""
    if "secure-aggregation=true" in run_config.replace(" ", "") and "secagg-signed-keys" not in run_config:
        return f"{run_config} secagg-signed-keys=true"
    return run_config


def node_configs_for(
    num_nodes: int, data: Path | None, sites: Sequence[Path] = (), *, warm_worker: bool = False
) -> list[str]:
    """SuperNode k's node config: its own image folder ``sites[k]`` (``dataset = custom``) with client
    id k; else ``<data>/client-k`` (an exported folder); else partition k of the public dataset.
    ``warm_worker``: each node hands its messages to a warm worker (clients/worker.py)."""
    if sites:
        configs = [f"data-dir={json.dumps(str(Path(site).resolve()))} partition-id={k}" for k, site in enumerate(sites)]
    elif data is None:
        configs = [f"partition-id={k} num-partitions={num_nodes}" for k in range(num_nodes)]
    else:
        configs = [f"data-dir={json.dumps(str(Path(data).resolve() / f'client-{k}'))}" for k in range(num_nodes)]
    return [f"{c} warm-worker=true" for c in configs] if warm_worker else configs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="Folder for certificates, keys, logs and FLWR_HOME.")
    parser.add_argument("--num-nodes", type=int, default=3, help="SuperNodes to start (one per client).")
    parser.add_argument("--data", default=None, help="Output of experiments/export_partitions.py.")
    parser.add_argument(
        "--site",
        action="append",
        default=[],
        metavar="FOLDER",
        help="A site's own image folder (dataset custom), once per SuperNode: SuperNode k gets "
        "data-dir=<k-th folder> partition-id=k; replaces --data and --num-nodes.",
    )
    parser.add_argument("--port", type=int, default=0, help="SuperLink port (default: a free one).")
    parser.add_argument(
        "--run",
        default=None,
        metavar="RUN_CONFIG",
        help="Submit this run (flwr run --run-config syntax), wait for it, then stop.",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="Seconds to wait for --run.")
    parser.add_argument(
        "--warm-worker",
        action="store_true",
        help="Every SuperNode hands its messages to a warm worker per node (node config warm-worker=true; "
        "deploy/README.md, 'A warm worker per node').",
    )
    args = parser.parse_args(argv)
    if args.site and args.data:
        parser.error("--site (own image folders) and --data (exported folders) exclude each other")
    configs = node_configs_for(
        args.num_nodes, args.data, [Path(site) for site in args.site], warm_worker=args.warm_worker
    )
    federation = LocalFederation(Path(args.workdir), configs, args.port)
    stop = {"now": False}

    def on_signal(signum: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    run_id: int | None = None
    try:
        with federation:
            try:
                federation.start(say=lambda line: print(line, flush=True))
                env = f"FLWR_HOME={shlex.quote(str(federation.home))}"
                print(
                    f"SuperLink {federation.address} (TLS, SuperNode auth on); "
                    f"{len(federation.node_configs)} SuperNodes online; logs in {federation.workdir / 'logs'}"
                )
                if args.run is None:
                    print(f'submit a run:  {env} flwr run {APP_DIR} {CONNECTION} --run-config "..." --stream')
                    print("Ctrl-C stops the SuperLink and every SuperNode.")
                    while not stop["now"]:
                        time.sleep(0.5)
                        federation.remember_descendants()
                    return 0
                print("submitting the run (flwr run builds and ships the app) ...", flush=True)
                out = federation.flwr(
                    "run",
                    str(federation.app_folder()),
                    CONNECTION,
                    "--run-config",
                    with_signed_keys(args.run),
                    "--format",
                    "json",
                    timeout=300,
                ).stdout
                run_id = int(json.loads(out[out.index("{") :])["run-id"])
                print(f"run {run_id} submitted; its log follows ({env} flwr log {run_id} {CONNECTION})", flush=True)
                status = federation.follow_run(run_id, args.timeout)
                print(f"run {run_id}: {status}")
                return 0 if status.endswith("completed") else 1
            except KeyboardInterrupt:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
                federation.stop(grace=2.0)
            except FederationError as err:
                print(f"error: {err}", file=sys.stderr)
                return 1
            except subprocess.TimeoutExpired as err:
                print(
                    f"error: {' '.join(map(str, err.cmd[:3]))} ... did not answer within {err.timeout:.0f} s",
                    file=sys.stderr,
                )
                return 1
    except KeyboardInterrupt:  # Ctrl-C while stopping after an error: the stop goes on below
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        federation.stop(grace=2.0)
    print(interrupted_line(federation, args.run, run_id, argv), file=sys.stderr, flush=True)
    return 130


def interrupted_line(
    federation: LocalFederation, run_config: str | None, run_id: int | None, argv: list[str] | None
) -> str:
    """The one line after Ctrl-C: what was stopped, what the run saved (results.json marked
    ``interrupted``) and the command that resumes it."""
    nodes = f"the SuperLink and {len(federation.node_configs)} SuperNodes stopped"
    if run_config is None:
        return f"interrupted: {nodes}"
    if run_id is None:
        return f"interrupted before the run was submitted: {nodes}"
    try:  # the project's own parsing: the run folder the ServerApp wrote to
        from flwr.common.config import parse_config_args

        from fcl_flower.config import RunConfig
        from fcl_flower.results import mark_interrupted

        cfg = RunConfig.from_mapping(parse_config_args([with_signed_keys(run_config)]))
        stages = mark_interrupted(cfg.output_dir / "results.json", over_failed=True)  # SIGTERM may fail it
    except Exception as err:  # the line must never turn into a traceback
        return f"interrupted: run {run_id} stopped, {nodes} (results not read: {type(err).__name__})"
    args = list(sys.argv[1:] if argv is None else argv)
    if not stages:
        return (
            f"interrupted: run {run_id} stopped before stage 1 of {cfg.num_tasks} finished, {nodes}; nothing to resume"
        )
    if "resume=true" not in run_config.replace(" ", ""):
        for at, arg in enumerate(args):
            if arg.startswith("--run="):
                args[at] = f"{arg} resume=true"
            elif arg == "--run" and at + 1 < len(args):
                args[at + 1] = f"{args[at + 1]} resume=true"
    command = shlex.join(["python", "deploy/local_federation.py", *args])
    return (
        f"interrupted: run {run_id} stopped, {nodes}; {stages} of {cfg.num_tasks} stages saved in "
        f"{cfg.output_dir} (results.json, checkpoint); continue with: {command}"
    )


if __name__ == "__main__":
    sys.exit(main())
