"""Rounds on real SuperNodes: a SuperLink and N SuperNodes on loopback, timed round by round.

    python experiments/bench_deployment.py                     # 3 SuperNodes, STSA, default CNN
    python experiments/bench_deployment.py --stage1-rounds 5 --num-tasks 5 --keep /tmp/fcl-bench

What it does (deploy/local_federation.py does the process work):

1. exports each client's share of the digits split into its own folder
   (experiments/export_partitions.py), as in the deploy/README walkthrough;
2. starts ``flower-superlink`` (TLS, SuperNode authentication) and ``--num-nodes``
   ``flower-supernode`` processes on 127.0.0.1, SuperNode k reading only ``data-dir=client-k``;
   ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``, so nothing is installed at run time;
3. submits one ``flwr run`` of STSA with the default CNN backbone (``small-cnn``), first
   ``--stage1-rounds`` FedAvg rounds of the backbone, then one analytic (statistics) round per
   stage, and waits until it finishes;
4. stops every process it started (by PID: the SuperLink, the SuperNodes and their descendants)
   and checks that none survived.

It reads the server's own clock from the run's results.json: ``rounds[i].seconds`` is one round
as the ServerApp sees it (send the instructions, every ClientApp process starts, loads the app and
its data, works and replies, the server checks and aggregates the replies); ``stages[t].seconds``
is a whole stage (its rounds, the solve, the evaluation). A *FedAvg round* is one of stage 1's
training rounds; an *analytic stage* is a later stage (one statistics round, the ridge solve and
the evaluation). The JSON (experiments/results/bench_deployment*.json) holds every round and
stage, the machine and the load average before and after; the table prints medians and maxima.
Targets (issue 16, 3 SuperNodes, 2 cores): analytic stage <= 3 s, FedAvg round <= 3 s.

Flower's floor (issue 32): the same federation also runs a minimal Flower app written by this
script (:data:`FLOOR_CLIENT`: a ClientApp that imports only flwr and replies at once;
:data:`FLOOR_SERVER`: one ``query`` message per node per round, timed by the server's clock), with
as many rounds as the project's run, alternating with it -- floor, project, floor, project, ...,
``--repeats`` (default 3) of each. The JSON records the floor's rounds (``floor``), the ratios of
the project's medians to the floor's median round (``ratios_to_floor``) and the load average
before and after every run. The run is watched through the Control API from this process
(deploy/local_federation.py ``wait_run``), never by a ``flwr`` CLI process while rounds are timed.

Issue 32's targets (``targets`` in the JSON, each with its ratio, target and verdict): a FedAvg
round less its local training <= 1.3 floors (``fedavg_round_minus_training``: each client times its
local epochs alone, inside the warm worker where there is one, and returns ``train-seconds`` in its
train reply; results.json ``rounds`` keeps the slowest client's, ``train_seconds_max``, which is
subtracted from the round), and an analytic stage <= 1.3 floors with plain uploads, <= 2.5 under
secure aggregation with federated evaluation::

    python experiments/bench_deployment.py --warm-worker --cold-repeats 0
    python experiments/bench_deployment.py --warm-worker --cold-repeats 0 --secure --evaluation federated

``--secure`` sets ``secure-aggregation=true secagg-signed-keys=true`` (the federation's SuperNodes
sign with their SuperNode keys, as in the walkthrough); a secure FedAvg round's replies carry no
``train-seconds`` (it would hint at the hidden sample count), so there the FedAvg target has no
verdict. ``--evaluation`` sets the run config's ``evaluation``. Each mode writes its own JSON:
bench_deployment[-warm-worker][-secure][-federated|-both].json. ``messages_to_node_0_per_run``
counts, per project run and message type, what SuperNode 0 received (its log), and
``exchanges_per_statistics_stage`` derives from them the exchanges of a stage's statistics round
(results.json does not record exchanges per stage). experiments/bench_walkthrough.py times deploy/README.md's
one-command walkthrough end to end.

Paper-size uploads (issue 16 item 3): ``--wire-dtype float32 float64`` runs the federation once
per wire dtype (each a fresh SuperLink and SuperNodes), e.g.::

    python experiments/bench_deployment.py --rf-dim 10000 --wire-dtype float32 float64 \
        --stage1-rounds 0 --num-tasks 2 --ridge 1.0 --cold-repeats 0

and reports, per dtype, the stage time, the upload bytes per client, the server's own work on the
replies (``extra.server_reply_seconds`` of results.json: accept = parse + check + the protocol
header, counting the bytes, adding to the running sums) against the ridge solve
(``extra.solve_seconds`` less ``extra.certificate_seconds``, the factorisation of
G + γ/2·I that certifies the fixed γ when the uploads' checks do not, reported beside it), and
the peak memory of every process (sampled only in these runs, unless ``--sample-interval``): a sampler thread walks the
process tree of the SuperLink and of each SuperNode every ``--sample-interval`` seconds and keeps
each process's VmHWM (its own peak RSS, from /proc/<pid>/status), by role: ``superlink``
(flower-superlink), ``serverapp`` (the flwr-serverapp process its SuperExec starts for the run),
``supernode`` and ``clientapp`` (the flwr-clientapp processes a SuperNode's SuperExec starts, one
per message), ``superexec``. A process's VmHWM is read while it lives, so a growth in its last
``--sample-interval`` seconds can be missed. Writes experiments/results/
bench_deployment-uploads-M<rf-dim>.json. Target: the server's handling of a reply costs less than
the solve. ``--stats-form factor`` runs the same with factor uploads (a client's rotated [Φ Y]
where smaller than the Gram; -factor is added to the JSON's name).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from experiments.benchlib import RESULTS_DIR, format_table, median, write_json
from experiments.export_partitions import export_partitions
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import DatasetError
from fcl_flower.runtime import federated_split

ROOT = Path(__file__).resolve().parents[1]

TARGET_SECONDS = {"fedavg_round": 3.0, "analytic_stage": 3.0}

# Issue 32's targets, as ratios to Flower's floor round (the median round of the minimal app): a
# FedAvg round less its local training (the slowest client's ``train-seconds``, measured inside the
# worker) <= 1.3 floors; an analytic stage <= 1.3 floors with plain uploads, <= 2.5 under secure
# aggregation with federated evaluation (a secure stage under central evaluation has no target).
TARGET_RATIOS = {"fedavg_round_minus_training": 1.3, "analytic_stage": 1.3, "analytic_stage_secure": 2.5}

# One message in a fresh interpreter, as a SuperNode's flwr-clientapp process handles it: Flower's
# own ClientApp runtime, then this app's module, then the handler; wall and CPU seconds of each.
COLD_PROCESS = """
import json, sys, time
def now():
    return time.perf_counter(), time.process_time()
t0 = now()
import flwr.supernode.runtime.run_clientapp
t1 = now()
import clients.app
t2 = now()
from flwr.app import Context, RecordDict
from flwr.common.serde import message_from_proto
from flwr.proto.message_pb2 import Message
proto = Message()
proto.ParseFromString(open(sys.argv[1], "rb").read())
context = Context(run_id=1, node_id=1, node_config={"data-dir": sys.argv[2]}, state=RecordDict(), run_config={})
reply = clients.app.app(message_from_proto(proto), context)
t3 = now()
assert not reply.has_error(), reply.error.reason
peak = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0] / 1024
span = lambda a, b: [b[0] - a[0], b[1] - a[1]]
print(json.dumps({"flwr_runtime": span(t0, t1), "clients_app": span(t1, t2), "handle": span(t2, t3),
                  "total": span(t0, t3), "peak_rss_mib": peak}))
"""


# ------------------------------------------------------------------------------ Flower's floor
# A minimal Flower app (issue 32), written next to the run by write_floor_app: the ClientApp imports
# only flwr and replies at once; the ServerApp sends one ``query`` message per node per round (and
# pulls the replies as the project's ServerApp does, strategies/stream.py) and
# writes each round's seconds by its own clock (as the project's results.json does) to the run
# config's ``out``. A round of it is what any app pays on this federation: Flower's floor, against
# which the project's rounds are measured, on the same SuperLink and SuperNodes, runs alternating.
FLOOR_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fcl-flower-floor"
version = "1.0.0"
description = "Flower's floor: a ClientApp that imports only flwr and replies at once"
license = "Apache-2.0"
dependencies = ["flwr==1.41.0"]

[tool.flwr.app]
publisher = "fcl-flower"

[tool.flwr.app.components]
serverapp = "floor_server:app"
clientapp = "floor_client:app"

[tool.flwr.app.config]
num-rounds = 3
num-nodes = 3
out = ""
"""

FLOOR_CLIENT = '''"""Flower's floor: a ClientApp that imports only flwr and answers at once."""

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def query(message: Message, context: Context) -> Message:
    asked = message.content.config_records["ask"]["round"]
    return Message(RecordDict({"answer": ConfigRecord({"round": asked})}), reply_to=message)
'''

FLOOR_SERVER = '''"""Flower's floor: one ``query`` message per node per round, each round timed by the server."""

import json
import os
import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


def online(grid: Grid, count: int, timeout: float = 120.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= count:
            return nodes
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(nodes)} of {count} SuperNodes online after {timeout:.0f} s")
        time.sleep(0.2)


def exchange(grid: Grid, asks: list, timeout: float = 600.0) -> list:
    """Push, then pull as replies come (2 ms doubling to 0.1 s between pulls): what the project's
    ServerApp does (strategies/stream.py), not send_and_receive's 3 s poll of the SuperLink."""
    pending = list(grid.push_messages(asks))
    replies, wait, deadline = [], 0.002, time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        got = list(grid.pull_messages(pending))
        done = {m.metadata.reply_to_message_id for m in got}
        replies += got
        pending = [m for m in pending if m not in done]
        wait = 0.002 if got else min(2 * wait, 0.1)
        if pending:
            time.sleep(wait)
    return replies


def write(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as file:
        json.dump(record, file)
    os.replace(path + ".tmp", path)


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    nodes = online(grid, int(config["num-nodes"]))
    record = {"status": "running", "nodes": len(nodes), "rounds": []}
    for server_round in range(1, int(config["num-rounds"]) + 1):
        began, wall = time.perf_counter(), time.time()
        asks = [
            Message(RecordDict({"ask": ConfigRecord({"round": server_round})}), dst_node_id=node, message_type="query")
            for node in nodes
        ]
        replies = exchange(grid, asks)
        seconds = time.perf_counter() - began
        answered = sorted(
            m.metadata.src_node_id
            for m in replies
            if not m.has_error() and m.content.config_records["answer"]["round"] == server_round
        )
        if answered != nodes:
            raise RuntimeError(f"round {server_round}: answers from {answered}, expected {nodes}")
        record["rounds"].append({"round": server_round, "seconds": seconds, "start": wall})
    record["status"] = "completed"
    write(str(config["out"]), record)
'''


def write_floor_app(folder: Path) -> Path:
    """The minimal Flower app above, as a folder ``flwr run`` takes."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("pyproject.toml", FLOOR_PYPROJECT),
        ("floor_client.py", FLOOR_CLIENT),
        ("floor_server.py", FLOOR_SERVER),
    ):
        (folder / name).write_text(text)
    return folder


def machine_cpu_seconds() -> float:
    """CPU seconds every core of this machine has been busy since boot (/proc/stat: all but idle, iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cgroup_cpu_seconds() -> float | None:
    """CPU seconds used so far by this process's cpuacct cgroup (cgroup v1), None in the root one.
    Run the benchmark in a cgroup of its own and this counts it and every process it starts (the
    SuperLink, the SuperNodes, every flwr-clientapp process, however short-lived), nobody else."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(",") and path != "/":
            usage = Path("/sys/fs/cgroup/cpuacct") / path.lstrip("/") / "cpuacct.usage"
            if usage.is_file():
                return int(usage.read_text()) / 1e9
    return None


def worker_cpu_seconds() -> dict[int, float]:
    """CPU seconds so far of every live warm worker (``python -m clients.worker``) of this user."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"clients.worker" not in (entry / "cmdline").read_bytes():
                continue
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(entry.name)] = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return found


def floor_run(federation: Any, app: Path, rounds: int, nodes: int, out: Path, timeout: float) -> dict[str, Any]:
    """One run of the floor app on ``federation``: its rounds' seconds and the load around it, the
    CPU seconds the machine was busy during the run (every process: the federation's, this one's,
    anyone else's) and those the project's warm workers, alive from earlier runs, used meanwhile."""
    out.unlink(missing_ok=True)
    load_before = os.getloadavg()
    began, busy_before, workers_before = time.monotonic(), machine_cpu_seconds(), worker_cpu_seconds()
    ours_before = own_cgroup_cpu_seconds()
    run_id = federation.submit({"num-rounds": rounds, "num-nodes": nodes, "out": str(out)}, app=app)
    status = federation.wait_run(run_id, timeout=timeout)
    if status != "finished:completed" or not out.is_file():
        raise SystemExit(f"error: floor run {run_id} {status}:\n{federation.run_log(run_id)[-3000:]}")
    wall, busy = time.monotonic() - began, machine_cpu_seconds() - busy_before
    ours_after, workers_after = own_cgroup_cpu_seconds(), worker_cpu_seconds()
    record = json.loads(out.read_text())
    return {
        "wall_seconds": wall,
        "machine_busy_cpu_seconds": busy,
        # this benchmark's cgroup (when it runs in one of its own): the federation's processes and this one
        "own_cgroup_cpu_seconds": None if ours_before is None or ours_after is None else ours_after - ours_before,
        "warm_workers_alive": len(workers_before),
        "warm_workers_cpu_seconds": sum(workers_after.get(pid, t) - t for pid, t in workers_before.items()),
        "round_seconds": [r["seconds"] for r in record["rounds"]],
        "round_starts": [r.get("start") for r in record["rounds"]],  # epoch seconds, for log timestamps
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
    }


def federation_module() -> Any:
    """deploy/local_federation.py (a script folder, not a package)."""
    spec = importlib.util.spec_from_file_location("local_federation", ROOT / "deploy" / "local_federation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def run_config(args: argparse.Namespace, out: Path) -> RunConfig:
    return RunConfig(
        strategy="stsa",
        dataset="digits",
        backbone="small-cnn",
        num_tasks=args.num_tasks,
        num_clients=args.num_nodes,
        stage1_rounds=args.stage1_rounds,
        local_epochs=args.local_epochs,
        rf_dim=args.rf_dim,
        ridge=args.ridge,
        **({"wire_dtype": args.wire} if getattr(args, "wire", None) else {}),
        stats_form=getattr(args, "stats_form", "gram"),
        secure_aggregation=bool(getattr(args, "secure", False)),
        # every SuperNode of the bench's federation signs with its SuperNode key (deploy/local_federation.py
        # secagg_node_config), so a secure run asks for signed keys, as the deployment walkthrough does
        secagg_signed_keys=bool(getattr(args, "secure", False)),
        evaluation=getattr(args, "evaluation", "central"),
        check_tolerance=getattr(args, "check_tolerance", "float32"),
        device="cpu",
        out=str(out),
        run_name="bench-deployment",
        round_timeout=600.0,
        overwrite=True,
    ).validated()


def process_rss_mib(pids: list[int]) -> float:
    """Summed resident memory of ``pids`` now (MiB; Linux /proc)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS"):
                    total += int(line.split()[1])
    return total / 1024


#: a process's role, from the program it runs (its command line)
ROLES = (
    ("flwr-serverapp", "serverapp"),
    ("flwr-clientapp", "clientapp"),
    ("flower-superexec", "superexec"),
    ("flower-superlink", "superlink"),
    ("flower-supernode", "supernode"),
)


def process_role(pid: int) -> str | None:
    """``serverapp``, ``clientapp``, ``superexec``, ``superlink``, ``supernode``, else None."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    names = {Path(a.decode(errors="replace")).name for a in argv[:3]}
    return next((role for program, role in ROLES if program in names), None)


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) of ``pid`` in KiB: its peak resident memory so far and now; (0, 0) once gone."""
    peak = now = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM"):
                peak = int(line.split()[1])
            elif line.startswith("VmRSS"):
                now = int(line.split()[1])
    return peak, now


class PeakSampler(threading.Thread):
    """Samples the process trees under ``roots`` (name -> pid: the SuperLink, each SuperNode) every
    ``interval`` seconds: every process's VmHWM (the highest seen), its role and the root it runs
    under, and the largest summed VmRSS of all of them at one sample."""

    def __init__(self, roots: dict[str, int], interval: float, descendants: Any) -> None:
        super().__init__(daemon=True)
        self.roots, self.interval, self.descendants = roots, interval, descendants
        self.seen: dict[int, dict[str, Any]] = {}  # pid -> {"root", "role", "peak_kib"}
        self.total_peak_kib = 0
        self.samples = 0
        self._stop_event = threading.Event()

    def sample(self) -> None:
        total = 0
        for root, pid in self.roots.items():
            for member in [pid, *sorted(self.descendants([pid]))]:
                peak, now = memory_kib(member)
                if not peak:
                    continue
                entry = self.seen.get(member)
                if entry is None:
                    entry = self.seen[member] = {"root": root, "role": process_role(member), "peak_kib": 0}
                entry["peak_kib"] = max(entry["peak_kib"], peak)
                total += now
        self.total_peak_kib = max(self.total_peak_kib, total)
        self.samples += 1

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)
        self.sample()  # the survivors' last word

    def report(self) -> dict[str, Any]:
        """Peak MiB per role (the largest single process, and how many processes had it), per
        SuperNode (the node process and its ClientApp processes), and the summed peak."""

        def mib(kib: int) -> float:
            return round(kib / 1024, 1)

        by_role: dict[str, dict[str, Any]] = {}
        per_node: dict[str, dict[str, float]] = {}
        for entry in self.seen.values():
            role = entry["role"] or "other"
            row = by_role.setdefault(role, {"processes": 0, "peak_mib": 0.0})
            row["processes"] += 1
            row["peak_mib"] = max(row["peak_mib"], mib(entry["peak_kib"]))
            if entry["root"].startswith("supernode") and role in ("supernode", "clientapp"):
                node = per_node.setdefault(entry["root"], {"supernode_peak_mib": 0.0, "clientapp_peak_mib": 0.0})
                key = f"{role}_peak_mib"
                node[key] = max(node[key], mib(entry["peak_kib"]))
        return {
            "by_role": dict(sorted(by_role.items())),
            "per_supernode": dict(sorted(per_node.items())),
            "all_processes_summed_rss_peak_mib": mib(self.total_peak_kib),
            "samples": self.samples,
            "interval_s": self.interval,
        }


def project_run(federation: Any, cfg: RunConfig, timeout: float) -> dict[str, Any]:
    """One run of this app (``cfg``) on ``federation``: its results.json and the load around it."""
    load_before = os.getloadavg()
    began = time.monotonic()
    run_id = federation.submit(cfg.to_mapping())
    submit_seconds = time.monotonic() - began
    print(f"  run {run_id} submitted; waiting for it ...", flush=True)
    status = federation.wait_run(run_id, timeout=timeout)
    run_seconds = time.monotonic() - began
    load_after = os.getloadavg()  # before anything below reads a log
    if status != "finished:completed":
        raise SystemExit(f"error: run {run_id} {status}:\n{federation.run_log(run_id)[-3000:]}")
    node_log = federation.logs.get("supernode-0")
    return {
        "results": json.loads((cfg.output_dir / "results.json").read_text()),
        "run_id": run_id,
        "submit_seconds": submit_seconds,
        "run_wall_seconds": run_seconds,
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "messages_to_node_0": (
            messages_received(Path(node_log).read_text(errors="replace"), run_id)
            if node_log and Path(node_log).is_file()
            else []
        ),
    }


def ratio(value: float, floor: float) -> float:
    return value / floor if floor > 0 else float("nan")


SIGNED_KEYS_NOTE = (
    "signed: every SuperNode of the bench's federation has secagg-signing-key and secagg-trusted-keys in its "
    "node config (deploy/local_federation.py secagg_node_config), so the run sets secagg-signed-keys=true"
)
EXCHANGES_NOTE = (
    "results.json does not record exchanges per stage; from SuperNode 0's log ('Receiving: <type> message' lines): "
    "messages_to_node_0_per_run counts its messages by type per project run, project_runs[i].messages_to_node_0 "
    "lists them in order, and exchanges_per_statistics_stage (per run) is the messages after its last train "
    "message, less query.info and the last stage's own evaluate, over num-tasks (the last stage adds that "
    "evaluate under federated evaluation)"
)


def messages_received(log_text: str, run_id: int) -> list[str]:
    """The types of the messages a SuperNode received for run ``run_id``, in order, from its log:
    Flower 1.41 logs ``[RUN <id>]`` (or ``[RUN <id>, ROUND <group>]``), then ``Receiving: <type> message``."""
    kinds: list[str] = []
    current: int | None = None
    for line in log_text.splitlines():
        if "[RUN " in line:
            head = line.split("[RUN ", 1)[1].split("]", 1)[0].split(",", 1)[0].strip()
            current = int(head) if head.isdigit() else None
        elif "Receiving: " in line and current == run_id:
            kinds.append(line.split("Receiving: ", 1)[1].split(" message", 1)[0].strip())
    return kinds


def message_counts(kinds: list[str]) -> dict[str, int]:
    return {kind: kinds.count(kind) for kind in sorted(set(kinds))}


def exchanges_per_statistics_stage(kinds: list[str], num_tasks: int) -> float | None:
    """Exchanges per stage's statistics round, from the messages one node received in order: those
    after its last ``train`` (stage 1's FedAvg rounds; under secure aggregation after that round's
    ``query.unmask``), less ``query.info`` (first contact) and the
    last stage's own ``evaluate`` at the end, over ``num_tasks`` statistics rounds (stage 1 has one
    too). Plain uploads with federated evaluation give 1 (the evaluation rides along), a secure stage
    2 after the run's first secure round (statistics, unmask: its keys and shares came ahead), 4
    without (keys, shares, statistics, unmask); None when the node received nothing."""
    if not kinds or num_tasks < 1:
        return None
    after = [i for i, kind in enumerate(kinds) if kind == "train"]
    tail = kinds[after[-1] + 1 if after else 0 :]
    if after and tail[:1] == ["query.unmask"]:  # a secure FedAvg round ends with its own unmask
        tail = tail[1:]
    tail = [kind for kind in tail if kind != "query.info"]
    if tail and tail[-1] == "evaluate":
        tail = tail[:-1]
    return len(tail) / num_tasks


def minus_training(rounds: list[dict[str, Any]], stage1_rounds: int) -> tuple[list[float], list[float]]:
    """A run's FedAvg rounds (its first ``stage1_rounds`` rounds in results.json): each round's
    seconds less its slowest client's local training (``train_seconds_max``, the clients' own
    ``train-seconds``), and those training seconds. A round without them (a secure round, whose
    replies carry no timing, or an older results.json) is left out of both."""
    less, training = [], []
    for entry in rounds[:stage1_rounds]:
        slowest = entry.get("train_seconds_max")
        if isinstance(slowest, (int, float)) and math.isfinite(slowest):
            less.append(float(entry["seconds"]) - float(slowest))
            training.append(float(slowest))
    return less, training


def target_check(value: float | None, target: float | None, what: str) -> dict[str, Any]:
    """``{"ratio", "target", "met", "what"}``; ``met`` None where either is missing (or not a number)."""
    met = None
    if value is not None and target is not None and math.isfinite(value):
        met = value <= target
    return {"ratio": value, "target": target, "met": met, "what": what}


def summarise(
    results: list[dict[str, Any]], floor_rounds: list[float], stage1_rounds: int, *, secure: bool, evaluation: str
) -> dict[str, Any]:
    """The project's runs (their results.json) against Flower's floor rounds: medians over every
    round of every run, their ratios to the floor's median round, and issue 32's target checks.

    * FedAvg round: stage 1's training rounds; ``fedavg_round_minus_training``: each less its
      slowest client's local training, the ratio the target (<= 1.3 floors) is about;
    * analytic stage: every stage after the first (its rounds, the solve, the evaluation); target
      <= 1.3 floors with plain uploads, <= 2.5 under secure aggregation with federated evaluation
      (none for a secure run under central evaluation)."""
    fedavg: list[float] = []
    less: list[float] = []
    training: list[float] = []
    stats_round_1: list[float] = []
    analytic: list[float] = []
    analytic_rounds: list[float] = []
    per_run = []
    for res in results:
        rounds, stages = res["rounds"], res["stages"]
        fedavg += [r["seconds"] for r in rounds[:stage1_rounds]]
        run_less, run_training = minus_training(rounds, stage1_rounds)
        less += run_less
        training += run_training
        stats_round_1.append(rounds[stage1_rounds]["seconds"])
        analytic += [s["seconds"] for s in stages[1:]]
        analytic_rounds += [r["seconds"] for r in rounds[stage1_rounds + 1 :]]
        per_run.append(
            {
                "fedavg_round_minus_training_seconds": run_less,
                "fedavg_round_minus_training_median": median(run_less) if run_less else None,
                "fedavg_training_seconds_max": run_training,
            }
        )
    floor = median(floor_rounds) if floor_rounds else float("nan")
    ratios = {
        "fedavg_round": ratio(median(fedavg), floor) if fedavg else None,
        "fedavg_round_minus_training": ratio(median(less), floor) if less else None,
        "analytic_stage": ratio(median(analytic), floor) if analytic else None,
        "analytic_round": ratio(median(analytic_rounds), floor) if analytic_rounds else None,
    }
    federated = evaluation != "central"
    if not secure:
        stage_target, stage_what = TARGET_RATIOS["analytic_stage"], "plain analytic stage <= 1.3 floors"
    elif federated:
        stage_target = TARGET_RATIOS["analytic_stage_secure"]
        stage_what = "secure analytic stage with federated evaluation <= 2.5 floors"
    else:
        stage_target, stage_what = None, "secure analytic stage under central evaluation: no target"
    return {
        "floor_round_seconds": list(floor_rounds),
        "floor_median_round_seconds": floor,
        "ratios_to_floor": ratios,
        "targets": {
            "fedavg_round_minus_training": target_check(
                ratios["fedavg_round_minus_training"],
                TARGET_RATIOS["fedavg_round_minus_training"],
                "FedAvg round less the slowest client's local training <= 1.3 floors"
                + ("" if less else " (no round reported train-seconds: a secure run's replies carry none)"),
            ),
            "analytic_stage": target_check(ratios["analytic_stage"], stage_target, stage_what),
        },
        "fedavg_round_seconds": fedavg,
        "fedavg_training_seconds_max": training,
        "fedavg_round_minus_training_seconds": less,
        "stage1_statistics_round_seconds": stats_round_1,
        "analytic_stage_seconds": analytic,
        "analytic_round_seconds": analytic_rounds,
        "per_run": per_run,
    }


def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start the federation, then alternate Flower's floor app (A) and this app (B), A B A B ...,
    ``--repeats`` times each on the same SuperLink and SuperNodes, the floor with as many rounds
    as the project's run; medians over every round of every repeat, and their ratios."""
    fed = federation_module()
    cfg = run_config(args, workdir / "out")
    data = workdir / "data"
    began = time.monotonic()
    export_partitions(cfg, data)
    export_seconds = time.monotonic() - began
    floor_app = write_floor_app(workdir / "floor-app")
    load_before = os.getloadavg()
    federation = fed.LocalFederation(
        workdir / "federation", fed.node_configs_for(args.num_nodes, data, warm_worker=args.warm_worker)
    )
    sampler: PeakSampler | None = None
    floors: list[dict[str, Any]] = []
    projects: list[dict[str, Any]] = []
    with federation:
        began = time.monotonic()
        federation.start(say=lambda line: print(f"  {line}", flush=True))
        startup_seconds = time.monotonic() - began
        if args.sample_interval > 0:
            roots = {name: process.pid for name, process in federation.core.items()}
            sampler = PeakSampler(roots, args.sample_interval, fed.descendants)
            sampler.start()
        try:
            for repeat in range(args.repeats):
                if args.floor:
                    print(f"  floor app, repeat {repeat + 1} of {args.repeats} ...", flush=True)
                    out = workdir / f"floor-{repeat}.json"
                    rounds = cfg.stage1_rounds + cfg.num_tasks  # as many rounds as the project's run
                    floors.append(floor_run(federation, floor_app, rounds, args.num_nodes, out, args.timeout))
                print(f"  this app, repeat {repeat + 1} of {args.repeats} ...", flush=True)
                run_cfg = cfg.replace(out=str(workdir / "out" / f"repeat-{repeat}"))
                projects.append(project_run(federation, run_cfg, args.timeout))
        finally:
            if sampler is not None:
                sampler.stop()
        core_rss = process_rss_mib([p.pid for p in federation.core.values()])
    survivors = federation.surviving()
    if survivors:
        raise SystemExit(f"error: processes survived the stop: {survivors}")
    load_after = os.getloadavg()
    summary = summarise(
        [run["results"] for run in projects],
        [t for run in floors for t in run["round_seconds"]],
        cfg.stage1_rounds,
        secure=cfg.secure_aggregation,
        evaluation=cfg.evaluation,
    )
    last = projects[-1]["results"]
    rounds, stages = last["rounds"], last["stages"]
    extra = {
        "peak_memory": sampler.report() if sampler is not None else None,
        "server_reply_seconds": [s["extra"].get("server_reply_seconds") for s in stages],
        "solve_seconds": [s["extra"].get("solve_seconds") for s in stages],
        # the part of solve_seconds that certified λ_min(G) >= -γ/2 by one more factorisation (0: the
        # uploads' checks certified it; fcl_flower/analytic/ridge.py)
        "certificate_seconds": [s["extra"].get("certificate_seconds", 0.0) for s in stages],
        "upload_bytes_per_client": [s["upload_bytes_per_client"] for s in stages],
        "upload_message_bytes_per_client": [s["upload_message_bytes_per_client"] for s in stages],
    }
    return {
        **extra,
        "config": {k: v for k, v in cfg.to_mapping().items() if k not in ("out",)},
        "num_nodes": args.num_nodes,
        "warm_worker": bool(args.warm_worker),
        "settings": {
            "secure_aggregation": cfg.secure_aggregation,
            "secagg_signed_keys": cfg.secagg_signed_keys,
            "signed_keys_note": SIGNED_KEYS_NOTE if cfg.secure_aggregation else None,
            "evaluation": cfg.evaluation,
            "warm_worker": bool(args.warm_worker),
            "stage1_rounds": cfg.stage1_rounds,
            "local_epochs": cfg.local_epochs,
            "num_tasks": cfg.num_tasks,
            "rf_dim": cfg.rf_dim,
        },
        "repeats": args.repeats,
        "order": "floor, this app, alternating (A B A B)" if args.floor else "this app only",
        "floor": {
            "app": "a ClientApp that imports only flwr and replies at once; one query message per node per round",
            "round_seconds": summary["floor_round_seconds"],
            "median_round_seconds": summary["floor_median_round_seconds"],
            "runs": floors,
        },
        "ratios_to_floor": summary["ratios_to_floor"],
        "targets": summary["targets"],
        "fedavg_round_seconds": summary["fedavg_round_seconds"],
        "fedavg_training_seconds_max": summary["fedavg_training_seconds_max"],
        "fedavg_round_minus_training_seconds": summary["fedavg_round_minus_training_seconds"],
        "stage1_statistics_round_seconds": summary["stage1_statistics_round_seconds"],
        "analytic_stage_seconds": summary["analytic_stage_seconds"],
        "analytic_round_seconds": summary["analytic_round_seconds"],
        "exchanges_per_statistics_stage": [
            exchanges_per_statistics_stage(run["messages_to_node_0"], cfg.num_tasks) for run in projects
        ],
        "exchanges_note": EXCHANGES_NOTE,
        "messages_to_node_0_per_run": [message_counts(run["messages_to_node_0"]) for run in projects],
        "stage_seconds": [s["seconds"] for s in stages],
        "rounds": rounds,
        "accuracy": [s["accuracy"] for s in stages],
        "accuracy_per_repeat": [[s["accuracy"] for s in run["results"]["stages"]] for run in projects],
        "project_runs": [
            {**{k: v for k, v in run.items() if k != "results"}, **per_run}
            for run, per_run in zip(projects, summary["per_run"], strict=True)
        ],
        "export_seconds": export_seconds,
        "federation_startup_seconds": startup_seconds,
        "submit_seconds": median([run["submit_seconds"] for run in projects]),
        "run_wall_seconds": median([run["run_wall_seconds"] for run in projects]),
        "superlink_supernodes_rss_mib_at_end": core_rss,
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "targets_seconds": TARGET_SECONDS,
        "target_ratios": TARGET_RATIOS,
    }


def run_all(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    if args.wire_dtype:  # one fresh federation per wire dtype
        runs = {}
        for wire in args.wire_dtype:
            print(f"wire dtype {wire}:", flush=True)
            runs[wire] = bench(argparse.Namespace(**{**vars(args), "wire": wire}), workdir / wire)
        return {
            "rf_dim": args.rf_dim,
            "num_nodes": args.num_nodes,
            "stats_form": args.stats_form,
            "check_tolerance": args.check_tolerance,
            "runs": runs,
        }
    result = bench(args, workdir)
    if args.cold_repeats > 0:
        # plain messages (an in-process run here has no SuperNode keys to sign a secure round with)
        cfg = run_config(args, workdir / "out").replace(secure_aggregation=False, secagg_signed_keys=False)
        result["cold_clientapp_process"] = cold_processes(cfg, workdir / "data", workdir, args.cold_repeats)
    return result


def capture_messages(cfg: RunConfig, folder: Path) -> dict[str, Path]:
    """The first ``query.info``, ``train`` and ``query.stats`` message node 1 gets in an in-process
    run of ``cfg`` (the real ServerApp logic), each written as Flower's protobuf."""
    from flwr.common.serde import message_to_proto

    from clients.app import app as client_app
    from fcl_flower.local_grid import LocalGrid
    from strategies.app import run_experiment

    grid = LocalGrid(client_app, cfg.num_clients)
    run_experiment(grid, cfg.replace(out=str(folder / "in-process"), stage1_rounds=1))
    files: dict[str, Path] = {}
    for message in grid.sent:
        kind = message.metadata.message_type
        if message.metadata.dst_node_id == 1 and kind not in files:
            message.metadata.__dict__["_message_id"] = message.object_id
            files[kind] = folder / f"{kind}.pb"
            files[kind].write_bytes(message_to_proto(message).SerializeToString())
    return files


def cold_processes(cfg: RunConfig, data: Path, folder: Path, repeats: int) -> dict[str, Any]:
    """Each message type handled by fresh interpreters (``repeats`` times; the first also fills
    the data cache): wall and CPU seconds of Flower's runtime import, the app import, the handler."""
    files = capture_messages(cfg, folder)
    out: dict[str, Any] = {}
    for kind, file in files.items():
        runs = []
        for _ in range(repeats):
            proc = subprocess.run(
                [sys.executable, "-c", COLD_PROCESS, str(file), str(data / "client-0")],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600,
            )
            if proc.returncode != 0:
                raise SystemExit(f"error: a cold ClientApp process failed on {kind}:\n{proc.stderr[-2000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        out[kind] = {"runs": runs, "load_average": list(os.getloadavg())}
    return out


def uploads_table(result: dict[str, Any]) -> str:
    """Per wire dtype: the analytic stage, its upload, the server's reply handling against the
    solve, and the peak memory of each kind of process (the largest single process)."""
    rows = []
    for wire, run in result["runs"].items():
        timing, solve = run["server_reply_seconds"][-1], run["solve_seconds"][-1]
        certificate = (run.get("certificate_seconds") or [0.0])[-1]
        solve -= certificate  # the yardstick is the solve itself, not its certificate
        uploads = run["upload_bytes_per_client"][-1]
        memory = run["peak_memory"]["by_role"] if run["peak_memory"] else {}
        replies = max(1, timing["replies"])
        rows.append(
            {
                "wire": wire,
                "stage s": run["stage_seconds"][-1],
                "round s": run["analytic_round_seconds"][-1],
                "MiB/client": max(uploads.values()) / 2**20,
                "reply s": timing["handling"] / replies,
                "parse": timing["parse"] / replies,
                "check": timing["check"] / replies,
                "bytes": timing["bytes"] / replies,
                "add": timing["add"] / replies,
                "finish s": timing["finish"],
                "solve s": solve,
                "certificate s": certificate,
                "meets": "yes" if timing["handling"] / replies < solve else "no",
                **{f"{role} MiB": memory.get(role, {}).get("peak_mib", "") for role in PEAK_ROLES},
                "load": run["load_average_after"][0],
            }
        )
    return (
        f"M = {result['rf_dim']}, {result['num_nodes']} SuperNodes, last analytic stage "
        "(reply s and its steps: per reply, mean; target reply s < solve s):\n"
        + format_table(rows, list(rows[0]), floats="{:.2f}")
    )


PEAK_ROLES = ("superlink", "serverapp", "supernode", "clientapp")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-nodes", type=int, default=3, help="SuperNodes (one client each)")
    parser.add_argument("--num-tasks", type=int, default=5, help="stages: 1 with FedAvg rounds, the rest analytic")
    parser.add_argument("--stage1-rounds", type=int, default=3, help="FedAvg rounds of the backbone in stage 1")
    parser.add_argument("--local-epochs", type=int, default=2, help="local epochs per FedAvg round (default 2)")
    parser.add_argument("--rf-dim", type=int, default=1000, help="random-feature dimension M (default 1000)")
    parser.add_argument("--ridge", default="auto", help="ridge gamma, or 'auto' (GCV; default)")
    parser.add_argument(
        "--wire-dtype",
        nargs="+",
        choices=("float32", "float64"),
        default=None,
        help="paper-size uploads: one run per wire dtype, with peak memory and the server's reply handling",
    )
    parser.add_argument(
        "--stats-form",
        choices=("gram", "factor"),
        default="gram",
        help="STSA uploads: the packed Gram (default), or the rotated factor where smaller (stats-form factor)",
    )
    parser.add_argument(
        "--check-tolerance",
        choices=("float32", "wire"),
        default="float32",
        help="the PSD check's rounding allowance for Gram uploads (run config check-tolerance; default float32)",
    )
    parser.add_argument(
        "--sample-interval",
        type=float,
        default=None,
        help="seconds between memory samples (0: no sampling; default 0.1 with --wire-dtype, else 0: the "
        "sampler walks /proc ten times a second, ~7 ms of CPU each, which would load the rounds it times)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for each run")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of this app, each after one of Flower's floor app (default 3)"
    )
    parser.add_argument("--no-floor", dest="floor", action="store_false", help="skip Flower's floor app (no ratios)")
    parser.add_argument(
        "--warm-worker",
        action="store_true",
        help="every SuperNode hands its messages to a warm worker (node config warm-worker=true, clients/worker.py)",
    )
    parser.add_argument(
        "--secure",
        action="store_true",
        help="secure aggregation (run config secure-aggregation=true secagg-signed-keys=true: the bench's "
        "SuperNodes sign with their SuperNode keys)",
    )
    parser.add_argument(
        "--evaluation",
        choices=("central", "federated", "both"),
        default="central",
        help="who scores each stage (run config evaluation; default central); issue 32's secure target is "
        "with federated evaluation",
    )
    parser.add_argument(
        "--cold-repeats", type=int, default=3, help="fresh ClientApp processes per message type (0: skip)"
    )
    parser.add_argument("--keep", default=None, help="work folder to keep (default: a temporary one, removed)")
    parser.add_argument(
        "--out",
        default=None,
        help="JSON output (default experiments/results/bench_deployment[-warm-worker][-secure][-federated].json, "
        "one name per mode)",
    )
    args = parser.parse_args(argv)
    if args.wire_dtype:  # the upload runs measure bytes, memory and the server's work: one run each, no floor
        args.repeats, args.floor = 1, False
    if args.sample_interval is None:  # memory is reported for the upload runs; elsewhere sampling only loads the rounds
        args.sample_interval = 0.1 if args.wire_dtype else 0.0
    if args.repeats < 1:
        parser.error("need --repeats >= 1")
    if args.stage1_rounds < (0 if args.wire_dtype else 1) or args.num_tasks < 2:
        parser.error(
            "need --num-tasks >= 2 (an analytic stage) and --stage1-rounds >= 1 (a FedAvg round; 0 with --wire-dtype)"
        )
    try:  # a configuration that cannot run is one line here, not a traceback after the federation started
        federated_split(run_config(args, Path(tempfile.gettempdir()) / "fcl-bench-deploy-check"))
    except (ConfigError, DatasetError) as err:
        print(f"bench_deployment: error: {err}", file=sys.stderr)
        return 2
    print(f"bench_deployment: {args.num_nodes} SuperNodes on loopback, load average {os.getloadavg()}")
    if args.keep:
        workdir = Path(args.keep).expanduser().resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        result = run_all(args, workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="fcl-bench-deploy-") as tmp:
            result = run_all(args, Path(tmp))
    if args.wire_dtype:
        print(uploads_table(result))
        form = "" if args.stats_form == "gram" else f"-{args.stats_form}"
        form += "" if args.check_tolerance == "float32" else f"-check-{args.check_tolerance}"
        out = args.out or RESULTS_DIR / f"bench_deployment-uploads-M{args.rf_dim}{form}.json"
        print(f"wrote {write_json('bench_deployment_uploads', result, out)}")
        return 0
    rows = []
    floor = result["floor"]["median_round_seconds"]
    for name, values in (
        ("Flower's floor round (minimal app)", result["floor"]["round_seconds"]),
        ("FedAvg round (stage 1)", result["fedavg_round_seconds"]),
        ("  less its local training", result["fedavg_round_minus_training_seconds"]),
        ("  its local training (slowest client)", result["fedavg_training_seconds_max"]),
        ("analytic stage (stages 2..)", result["analytic_stage_seconds"]),
        ("  its statistics round", result["analytic_round_seconds"]),
    ):
        if not values:
            continue
        target = TARGET_SECONDS.get("fedavg_round" if "FedAvg" in name else "analytic_stage", float("nan"))
        rows.append(
            {
                "what": name,
                "n": len(values),
                "median s": median(values),
                "max s": max(values),
                "/ floor": ratio(median(values), floor),
                "target s": target if not name.startswith(("  ", "Flower")) else "",
            }
        )
    print(f"{result['repeats']} repeats, {result['order']}:")
    print(format_table(rows, ["what", "n", "median s", "max s", "/ floor", "target s"], floats="{:.2f}"))
    cold = result.get("cold_clientapp_process", {})
    if cold:
        rows = []
        for kind, entry in cold.items():
            last = entry["runs"][-1]  # the data cache is filled by then, as from a run's 2nd message on
            rows.append(
                {
                    "message": kind,
                    "flwr runtime s": f"{last['flwr_runtime'][0]:.2f} / {last['flwr_runtime'][1]:.2f}",
                    "clients.app s": f"{last['clients_app'][0]:.2f} / {last['clients_app'][1]:.2f}",
                    "handler s": f"{last['handle'][0]:.2f} / {last['handle'][1]:.2f}",
                    "total s": f"{last['total'][0]:.2f} / {last['total'][1]:.2f}",
                    "peak MiB": f"{last['peak_rss_mib']:.0f}",
                    "load": f"{entry['load_average'][0]:.1f}",
                }
            )
        print("one message in a fresh ClientApp process (wall / CPU seconds; last of the repeats):")
        print(format_table(rows, list(rows[0])))
    print(
        f"federation start {result['federation_startup_seconds']:.1f} s, flwr run submit {result['submit_seconds']:.1f} s, "
        f"whole run {result['run_wall_seconds']:.1f} s; load average before {result['load_average_before'][0]:.2f}, "
        f"after {result['load_average_after'][0]:.2f} (1 min)"
    )
    print(
        f"exchanges per statistics stage (SuperNode 0, per run): {result['exchanges_per_statistics_stage']}; "
        f"messages: {result['messages_to_node_0_per_run'][-1]} (last run)"
    )
    for name, check in result["targets"].items():
        shown = "n/a" if check["ratio"] is None else f"{check['ratio']:.2f}x"
        met = {True: "met", False: "NOT met", None: "no verdict"}[check["met"]]
        print(f"target {name}: {shown} of the floor ({check['what']}): {met}")
    print(f"wrote {write_json('bench_deployment', result, args.out or default_out(args))}")
    return 0


def default_out(args: argparse.Namespace) -> Path:
    """experiments/results/bench_deployment[-warm-worker][-secure][-federated|-both].json: each mode
    its own file, so a secure or federated-evaluation run never overwrites the plain figures."""
    name = "bench_deployment"
    name += "-warm-worker" if args.warm_worker else ""
    name += "-secure" if args.secure else ""
    name += "" if args.evaluation == "central" else f"-{args.evaluation}"
    return RESULTS_DIR / f"{name}.json"


if __name__ == "__main__":
    sys.exit(main())
