"""Paper-size statistics on the server: the cost of one reply against the solve, and peak memory
against the number of clients.

    python experiments/bench_paper_size.py reply --dims 2000 4096 10000
    python experiments/bench_paper_size.py memory --rf-dim 2000 --clients 5 20 50 200
    python experiments/bench_paper_size.py memory --rf-dim 8192 --clients 20

``reply``: one honest STSA upload (random ReLU features, n = M/2 samples, 10 classes) in float32
and float64, serialised as Flower does (an ArrayRecord of .npy buffers), then what the server
does with it, each step timed: ``parse`` (``StsaStats.read``: decode in place, dtype, shape,
finiteness), ``bytes`` (``payload_bytes`` + ``message_bytes``: counted without re-serialising),
``check`` (``check_packed_statistics``: the PSD test, float32-first at the default
``check-tolerance float32``; float64 uploads once more with ``wire``, their own 2⁻⁵³, in float64),
``add`` (into the running float64 sums); against ``solve`` (one Cholesky solve at M with 100
classes, ``solve_ridge``). Also the client side: ``pack`` (``packed_gram``: upper triangle of the
symmetrised G, straight into the wire dtype).

``memory``: for each client count, a fresh process runs STSA on the synthetic dataset (400
training images per class instead of its 40, so that each of 200 clients gets data), 2 tasks,
no FedAvg stage, γ by GCV, and reports its peak RSS (VmHWM). The server streams: it never holds more than
``stream.WINDOW`` replies. By default the ClientApps run in one child process (:class:`WorkerGrid`:
each message and reply crosses as Flower's protobuf bytes, as through a SuperLink, and the
clients answer one at a time as the server pulls them), so the peak RSS is the server's alone;
the child's peak is reported next to it. ``--clients-in-process`` runs them in the server's
process instead (LocalGrid, as ``sim.py --engine local``): that peak includes one client's work.
Writes experiments/results/bench_paper_size-memory-M<M>.json (machine, load average).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from experiments.benchlib import format_table, peak_rss_mib, write_json


def timed(fn: Any) -> tuple[float, Any]:
    began = time.perf_counter()
    out = fn()
    return time.perf_counter() - began, out


def reply_rows(dims: list[int], classes: int = 10) -> list[dict[str, Any]]:
    from fcl_flower.analytic import StatisticsAccumulator, packed_length, solve_ridge
    from fcl_flower.analytic.checks import check_packed_statistics, gram_check_epsilon
    from fcl_flower.protocol import message_bytes, payload_bytes
    from fcl_flower.protocol.payloads import StsaStats

    rows = []
    for dim in dims:
        gen = torch.Generator().manual_seed(dim)
        n = dim // 2
        phi = torch.relu(torch.randn(n, dim, generator=gen, dtype=torch.float64))
        labels = torch.randint(0, classes, (n,), generator=gen)
        acc = StatisticsAccumulator(dim, classes, with_gram=True)
        acc.update(phi, labels)
        del phi
        sums100 = torch.randn(dim, 100, generator=gen, dtype=torch.float64)
        gram_full = acc.result().gram
        assert gram_full is not None
        solve, _ = timed(lambda: solve_ridge(gram_full, sums100, 1.0))
        del gram_full
        for wire, tolerance in (("float32", "float32"), ("float64", "float32"), ("float64", "wire")):
            load = os.getloadavg()[0]
            dtype = getattr(torch, wire)
            pack, packed = timed(lambda: acc.packed_gram(dtype))
            stats = acc.result(with_gram=False)
            counts = stats.counts.to(torch.float64)
            record = StsaStats(packed, stats.class_sums, counts).to_record(wire)
            from flwr.app import RecordDict

            content = RecordDict({"arrays": record})
            parse, upload = timed(lambda: StsaStats.read(record, packed=packed_length(dim), dim=dim, classes=classes))
            count, _ = timed(lambda: (payload_bytes(content), message_bytes(content)))
            check, _ = timed(
                lambda: check_packed_statistics(
                    upload.gram_packed,
                    upload.class_sums,
                    upload.counts,
                    relative_tolerance=gram_check_epsilon(upload.gram_packed.dtype, tolerance),
                    nonnegative=True,
                )
            )
            total = torch.zeros(packed_length(dim), dtype=torch.float64)
            add, _ = timed(lambda: total.add_(upload.gram_packed))
            handling = parse + count + check + add
            rows.append(
                {
                    "M": dim,
                    "wire": wire,
                    "check tolerance": tolerance,
                    "load": load,
                    "upload MiB": payload_bytes(content) / 2**20,
                    "pack s (client)": pack,
                    "parse s": parse,
                    "bytes s": count,
                    "check s": check,
                    "add s": add,
                    "handling s": handling,
                    "solve s": solve,
                    "handling/solve": handling / solve,
                }
            )
            print(f"  {rows[-1]}", flush=True)
            del record, content, upload, total, packed
    return rows


#: synthetic training images per class in ``memory`` (the dataset's default 40 gives a task 400
#: samples, too few to give each of 200 clients one under the Dirichlet split)
TRAIN_PER_CLASS = 400


def use_synthetic_size(train_per_class: int) -> None:
    """Make this process's ``synthetic`` dataset hold ``train_per_class`` training images per class
    (same prototypes, noise and test set); the server and the client process both call it."""
    from fcl_flower.data import registry
    from fcl_flower.data.synthetic import SyntheticSpec

    registry.SyntheticSpec = lambda: SyntheticSpec(train_per_class=train_per_class)  # type: ignore[assignment,misc]


def _client_worker(conn: Any, num_nodes: int, train_per_class: int) -> None:
    """Child process of :class:`WorkerGrid`: the real ClientApp of every node (LocalGrid's contexts);
    protobuf bytes of a message in, of its reply out; empty bytes in: this process's peak RSS out."""
    from flwr.common.serde import message_from_proto, message_to_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage

    from clients.app import app
    from fcl_flower.local_grid import LocalGrid

    use_synthetic_size(train_per_class)
    grid = LocalGrid(app, num_nodes, record=False)
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        if not data:
            conn.send_bytes(json.dumps(peak_rss_mib()).encode())
            continue
        message = message_from_proto(ProtoMessage.FromString(data))
        del data
        replies = grid.deliver([message])
        del message
        conn.send_bytes(message_to_proto(replies[0]).SerializeToString() if replies else b"")


def worker_grid(num_nodes: int, train_per_class: int = TRAIN_PER_CLASS) -> Any:
    """A LocalGrid whose ClientApps run in one child process (see the module doc)."""
    import multiprocessing

    from flwr.app import Message
    from flwr.common.serde import message_from_proto, message_to_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage

    from fcl_flower.local_grid import LocalGrid

    class WorkerGrid(LocalGrid):
        def __init__(self) -> None:
            context = multiprocessing.get_context("spawn")
            self.conn, child = context.Pipe()
            self.process = context.Process(target=_client_worker, args=(child, num_nodes, train_per_class), daemon=True)
            self.process.start()
            child.close()
            super().__init__(lambda message, context: message, num_nodes, record=False)

        def deliver(self, messages: Any) -> list[Message]:
            replies = []
            for message in messages:
                if message.metadata.dst_node_id in self.unavailable:
                    continue
                self.conn.send_bytes(message_to_proto(message).SerializeToString())
                data = self.conn.recv_bytes()
                if data:
                    replies.append(message_from_proto(ProtoMessage.FromString(data)))
                del data
            return replies

        def client_peak_mib(self) -> float:
            self.conn.send_bytes(b"")
            peak = float(json.loads(self.conn.recv_bytes()))
            self.conn.close()
            self.process.join(timeout=30)
            return peak

    return WorkerGrid()


def memory_config(rf_dim: int, clients: int, out: str, ridge: str = "auto") -> Any:
    """The run of ``memory``: STSA on the synthetic dataset, 2 tasks, no FedAvg stage, γ by GCV
    (``ridge = auto``) or fixed."""
    from fcl_flower.config import RunConfig

    return RunConfig(
        strategy="stsa",
        dataset="synthetic",
        num_clients=clients,
        num_tasks=2,
        beta=0.5,
        seed=0,
        stage1_rounds=0,
        rf_dim=rf_dim,
        ridge=ridge,
        device="cpu",
        out=out,
        round_timeout=3600.0,
    )


def run_one(
    rf_dim: int,
    clients: int,
    out: str,
    in_process: bool = False,
    ridge: str = "auto",
    train_per_class: int = TRAIN_PER_CLASS,
) -> dict[str, Any]:
    """In this process: one STSA run (clients in a child process, or in this one), then the peak RSS."""
    from experiments.sim import run_local
    from strategies.app import run_experiment

    use_synthetic_size(train_per_class)
    cfg = memory_config(rf_dim, clients, out, ridge)
    began = time.perf_counter()
    grid = None if in_process else worker_grid(clients, train_per_class)
    recorder = run_local(cfg) if grid is None else run_experiment(grid, cfg)
    row = {
        "M": rf_dim,
        "clients": clients,
        "clients run": "in the server's process" if grid is None else "in a child process",
        "wall s": time.perf_counter() - began,
        "stage s": [round(s.seconds, 2) for s in recorder.stages],
        "clients per stage": [len(s.clients) for s in recorder.stages],
        "peak RSS MiB": peak_rss_mib(),
        "ridge selection per stage": [s.extra.get("gcv", {}) for s in recorder.stages],
    }
    if grid is not None:
        row["client process peak RSS MiB"] = grid.client_peak_mib()
    return row


def memory_rows(
    rf_dim: int,
    clients: list[int],
    timeout: float,
    in_process: bool = False,
    ridge: str = "auto",
    train_per_class: int = TRAIN_PER_CLASS,
) -> list[dict[str, Any]]:
    rows = []
    for k in clients:
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, "-m", "experiments.bench_paper_size", "_one", str(rf_dim), str(k), tmp]
            command += [ridge, str(train_per_class)] + (["in-process"] if in_process else [])
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
            except subprocess.TimeoutExpired:
                rows.append({"M": rf_dim, "clients": k, "load": load, "error": f"over {timeout:.0f} s"})
                print(f"  M = {rf_dim}, {k} clients: over {timeout:.0f} s", flush=True)
                continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
            rows.append({"M": rf_dim, "clients": k, "load": load, "error": tail[0]})
        else:
            rows.append({**json.loads(lines[-1]), "load": load})
        print(f"  {rows[-1]}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_one"]:
        ridge = argv[4] if len(argv) > 4 else "auto"
        per_class = int(argv[5]) if len(argv) > 5 else TRAIN_PER_CLASS
        in_process = argv[6:7] == ["in-process"]
        print(json.dumps(run_one(int(argv[1]), int(argv[2]), argv[3], in_process, ridge, per_class)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = parser.add_subparsers(dest="part", required=True)
    reply = parts.add_parser("reply")
    reply.add_argument("--dims", type=int, nargs="+", default=[2000, 4096, 10000])
    memory = parts.add_parser("memory")
    memory.add_argument("--rf-dim", type=int, default=2000)
    memory.add_argument("--clients", type=int, nargs="+", default=[5, 20, 50, 200])
    memory.add_argument("--timeout", type=float, default=3600.0, help="Seconds per run.")
    memory.add_argument("--ridge", default="auto", help="'auto' (GCV, the default) or a fixed γ.")
    memory.add_argument(
        "--train-per-class",
        type=int,
        default=TRAIN_PER_CLASS,
        help="Synthetic training images per class (20 classes, 2 tasks): n of a stage is 10 times it.",
    )
    memory.add_argument(
        "--clients-in-process",
        action="store_true",
        help="Run the ClientApps in the server's process (LocalGrid): the peak then includes a client's work.",
    )
    for part in (reply, memory):
        part.add_argument("--out", help="JSON path (default experiments/results/bench_paper_size-<part>.json).")
    args = parser.parse_args(argv)
    if args.part == "reply":
        rows = reply_rows(args.dims)
        columns = [
            "M",
            "wire",
            "check tolerance",
            "load",
            "upload MiB",
            "pack s (client)",
            "parse s",
            "bytes s",
            "check s",
            "add s",
        ]
        columns += ["handling s", "solve s", "handling/solve"]
        settings: dict[str, Any] = {"samples": "M/2", "classes per upload": 10, "solve classes": 100}
    else:
        rows = memory_rows(
            args.rf_dim, args.clients, args.timeout, args.clients_in_process, args.ridge, args.train_per_class
        )
        columns = ["M", "clients", "load", "wall s", "stage s", "clients per stage", "peak RSS MiB"]
        columns += ["client process peak RSS MiB", "error"]
        engine = "LocalGrid (clients in the server's process)" if args.clients_in_process else "WorkerGrid"
        settings = {
            "dataset": f"synthetic, {args.train_per_class} training images per class (20 classes)",
            "num_tasks": 2,
            "beta": 0.5,
            "stage1_rounds": 0,
            "ridge": "auto (GCV)" if args.ridge == "auto" else args.ridge,
            "wire_dtype": "float32",
            "engine": engine,
        }
    print(format_table(rows, columns, floats="{:.3g}"))
    name = f"bench_paper_size-{args.part}"
    if args.part == "memory":
        name += f"-M{args.rf_dim}" + ("" if args.ridge == "auto" else f"-ridge{args.ridge}")
        name += "" if args.train_per_class == TRAIN_PER_CLASS else f"-n{args.train_per_class}"
    path = write_json(name, {"settings": settings, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
