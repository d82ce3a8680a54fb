"""What one message costs a fresh ClientApp process with and without the node's warm worker.

A real SuperNode starts a fresh ``flwr-clientapp`` process per message. This script captures the
first ``query.stats`` message node 1 gets in a small in-process run (STSA, digits, small CNN),
then hands it, A B A B, to fresh interpreters that import the ClientApp and answer it:

* ``cold``: the node config has no ``warm-worker``: the process imports torch, builds the model,
  opens the node's data and computes the statistics, as every message does today;
* ``warm``: ``warm-worker = true`` and the node's worker (``python -m clients.worker``, started
  once and warmed by one message) answers; the process imports neither torch nor the protocol.

Per process: the wall seconds from the parent's start of the interpreter to its exit, and, inside
the process, from the first import to the reply (medians). Flower's own runtime (pulling the
message from the SuperNode, pushing the reply) comes on top of both, the same for both.

    python -m experiments.bench_warm_worker --repeats 5
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.benchlib import median, run_worker_bench

ROOT = Path(__file__).resolve().parents[1]

ONE_MESSAGE = """
import json, sys, time
t0 = time.perf_counter()
import clients.app
from flwr.common.serde import context_from_proto, message_from_proto
from flwr.proto.message_pb2 import Context, Message
message = message_from_proto(Message.FromString(open(sys.argv[1], "rb").read()))
context = context_from_proto(Context.FromString(open(sys.argv[2], "rb").read()))
reply = clients.app.app(message, context)
assert not reply.has_error(), reply.error.reason
print(json.dumps({"inside": time.perf_counter() - t0, "torch": "torch" in sys.modules}))
"""


def capture(folder: Path, rf_dim: int) -> Path:
    """The first ``query.stats`` message node 1 gets in a small in-process run, as Flower's protobuf."""
    from flwr.common.serde import message_to_proto

    from clients.app import app as client_app
    from fcl_flower.config import RunConfig
    from fcl_flower.local_grid import LocalGrid
    from strategies.app import run_experiment

    cfg = RunConfig(
        strategy="stsa", dataset="digits", num_tasks=2, num_clients=2, stage1_rounds=0, rf_dim=rf_dim,
        device="cpu", out=str(folder / "in-process"), round_timeout=600.0,
    )  # fmt: skip
    grid = LocalGrid(client_app, cfg.num_clients)
    run_experiment(grid, cfg)
    message = next(m for m in grid.sent if m.metadata.message_type == "query.stats" and m.metadata.dst_node_id == 1)
    message.metadata.__dict__["_message_id"] = message.object_id
    path = folder / "stats.pb"
    path.write_bytes(message_to_proto(message).SerializeToString())
    return path


def context_file(folder: Path, name: str, node_config: dict[str, Any]) -> Path:
    from flwr.app import Context, RecordDict
    from flwr.common.serde import context_to_proto

    context = Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})
    path = folder / f"{name}.pb"
    path.write_bytes(context_to_proto(context).SerializeToString())
    return path


def one_process(message: Path, context: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", ONE_MESSAGE, str(message), str(context)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: a ClientApp process failed:\n{proc.stderr[-2000:]}")
    return {"wall": wall, **json.loads(proc.stdout.strip().splitlines()[-1]), "fallback": "warm worker" in proc.stderr}


def bench(repeats: int, rf_dim: int, folder: Path) -> dict[str, Any]:
    message = capture(folder, rf_dim)
    base = {"partition-id": 0, "num-partitions": 2}
    spec_dir = tempfile.mkdtemp(prefix="fclw-")
    warm_config = {**base, "warm-worker": True, "warm-worker-dir": spec_dir}
    cold_ctx, warm_ctx = context_file(folder, "cold", base), context_file(folder, "warm", warm_config)
    spec = f"partition-id=0 num-partitions=2 warm-worker=true warm-worker-dir='{spec_dir}'"
    log = open(folder / "worker.log", "wb")  # noqa: SIM115  # open while the worker runs
    worker = subprocess.Popen(
        [sys.executable, "-m", "clients.worker", "--node-config", spec, "--idle", "600"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        from clients.worker import socket_path, worker_folder, worker_key

        path = socket_path(worker_folder(warm_config), worker_key(warm_config, None))
        deadline = time.monotonic() + 120
        while not path.exists():  # the worker binds its socket once flwr is imported
            if worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: the worker did not start (see {folder / 'worker.log'})")
            time.sleep(0.05)
        first = one_process(message, warm_ctx)  # the worker's first message: it opens the data, builds the model
        runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
        for _ in range(repeats):
            runs["cold"].append(one_process(message, cold_ctx))
            runs["warm"].append(one_process(message, warm_ctx))
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(30)
        log.close()
        shutil.rmtree(spec_dir, ignore_errors=True)
    worker_log = (folder / "worker.log").read_text()
    if first["fallback"] or any(r["fallback"] for r in runs["warm"]):
        raise SystemExit("error: the worker did not answer every warm message (see worker.log)")
    summary = {
        kind: {
            "wall_median_s": median([r["wall"] for r in rs]),
            "inside_median_s": median([r["inside"] for r in rs]),
            "imports_torch": sorted({r["torch"] for r in rs}),
        }
        for kind, rs in runs.items()
    }
    handled = [
        float(line.rsplit(" in ", 1)[1].split()[0]) for line in worker_log.splitlines() if " handled in " in line
    ]
    summary["warm"]["worker_handler_median_s"] = median(handled[1:])  # after its first message
    return {"rf_dim": rf_dim, "repeats": repeats, "worker_first_message": first, "worker_handled_s": handled,
            "runs": runs, "summary": summary}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    result, path = run_worker_bench("bench_warm_worker", __doc__ or "", bench, argv)
    for kind, row in result["summary"].items():
        print(
            f"{kind}: fresh process {row['wall_median_s']:.2f} s (inside {row['inside_median_s']:.2f} s), "
            f"imports torch: {row['imports_torch']}"
            + (f", the worker's handler {row['worker_handler_median_s']:.3f} s" if kind == "warm" else "")
        )
    print(f"load average after: {result['load_average_after']}; {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
