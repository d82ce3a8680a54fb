"""What the features cache saves a warm worker on one ``query.stats`` message (issue 32).

The first ``query.stats`` message node 1 gets in a small in-process run (STSA, digits, small CNN;
bench_warm_worker's ``capture``) goes, A B C A B C, to three warm workers of node 1 that differ
only in their node config:

* ``no-cache``: ``feature-cache-mib = 0``, every message passes the data through the backbone;
* ``memory``: the default in-memory cache: after the worker's first message every one is a hit;
* ``disk``: ``feature-cache = "<folder>"`` and ``feature-cache-mib = 0``: every message reads the
  features back from the folder (a second run's first message in a new worker).

Each worker is warmed by one message first. The figure is the worker's own handling time of
each message (its log's "handled in"), medians; the reply is checked to be the same bytes in all
three.

    python -m experiments.bench_feature_cache --repeats 5
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.bench_warm_worker import capture
from experiments.benchlib import median, run_worker_bench

ROOT = Path(__file__).resolve().parents[1]


def _spec(config: dict[str, Any]) -> str:
    return " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={str(v).lower()}" for k, v in config.items())


def bench(repeats: int, rf_dim: int, folder: Path) -> dict[str, Any]:
    from flwr.app import Context, Message, RecordDict
    from flwr.common.serde import message_from_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage

    import clients.app
    from clients.worker import socket_path, worker_folder, worker_key

    message: Message = message_from_proto(ProtoMessage.FromString(capture(folder, rf_dim).read_bytes()))
    spec_dir = tempfile.mkdtemp(prefix="fclf-")
    base = {"partition-id": 0, "num-partitions": 2, "warm-worker": True, "warm-worker-dir": spec_dir}
    configs = {
        "no-cache": {**base, "feature-cache-mib": 0},
        "memory": dict(base),
        "disk": {**base, "feature-cache": str(folder / "features"), "feature-cache-mib": 0},
    }
    workers, logs = {}, {}
    try:
        for name, config in configs.items():
            logs[name] = folder / f"{name}.log"
            with open(logs[name], "wb") as log:
                workers[name] = subprocess.Popen(
                    [sys.executable, "-m", "clients.worker", "--node-config", _spec(config), "--idle", "600"],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            path = socket_path(worker_folder(config), worker_key(config, None))
            deadline = time.monotonic() + 120
            while not path.exists():
                if workers[name].poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"error: the {name} worker did not start (see {logs[name]})")
                time.sleep(0.05)
        replies: dict[str, list[bytes]] = {name: [] for name in configs}
        for _ in range(repeats + 1):  # the first round warms each worker
            for name, config in configs.items():
                context = Context(run_id=1, node_id=1, node_config=config, state=RecordDict(), run_config={})
                reply = clients.app.app(message, context)
                if reply.has_error():
                    raise SystemExit(f"error: the {name} worker's reply is an error: {reply.error.reason}")
                arrays = reply.content.array_records
                replies[name].append(b"".join(a.data for rec in arrays.values() for a in rec.values()))
    finally:
        for proc in workers.values():
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        shutil.rmtree(spec_dir, ignore_errors=True)
    same = len({r for rs in replies.values() for r in rs}) == 1
    handled = {}
    for name, path in logs.items():
        text = path.read_text()
        if "handled here" in text or text.count(" handled in ") != repeats + 1:
            raise SystemExit(f"error: the {name} worker did not answer every message (see {path})")
        handled[name] = [
            float(line.rsplit(" in ", 1)[1].split()[0]) for line in text.splitlines() if " handled in " in line
        ]
    reused = {name: logs[name].read_text().count("reused from cache") for name in logs}
    summary = {
        name: {"handler_median_s": median(times[1:]), "handler_min_s": min(times[1:]), "reused_lines": reused[name]}
        for name, times in handled.items()
    }
    return {"rf_dim": rf_dim, "repeats": repeats, "same_reply_bytes": same, "handled_s": handled, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    result, path = run_worker_bench("bench_feature_cache", __doc__ or "", bench, argv)
    for name, row in result["summary"].items():
        print(f"{name}: the worker handles query.stats in {row['handler_median_s']:.3f} s (median; "
              f"min {row['handler_min_s']:.3f} s), "
              f"{row['reused_lines']} 'reused from cache' lines")  # fmt: skip
    print(f"same reply bytes in all: {result['same_reply_bytes']}; load average after: {result['load_average_after']}")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
