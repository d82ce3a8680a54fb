"""Small shared helpers of the bench_*.py scripts: machine description, peak memory, tables, JSON.

Timings are only comparable on the same machine: every JSON records the machine it ran on,
the load average when it started (a busy machine shows up there) and the library versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad flags end in one ``error: ...`` line on stderr and exit status 2, not argparse's usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]  # argparse says NoReturn; exit() does not return
        self.exit(2, f"error: {message} (see --help)\n")


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, GPU, library versions and the current load."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": memory_gib,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        import flwr

        info["flwr"] = flwr.__version__
    except Exception:  # pragma: no cover
        pass
    return info


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set size (Linux: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """Peak resident set size of this process since start or the last :func:`reset_peak_rss`."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def best_time(fn: Callable[[], Any], *, repeats: int = 3, min_seconds: float = 0.0) -> float:
    """Best wall time of ``repeats`` calls (after one warm-up): the least disturbed by other load."""
    fn()
    times = []
    began = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - began < min_seconds:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], *, floats: str = "{:.3g}") -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return floats.format(value)
        return str(value)

    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def write_json(name: str, data: dict[str, Any], out: str | Path | None = None) -> Path:
    """``experiments/results/<name>.json`` (or ``out``), with the machine description added."""
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine_info(), **data}
    path.write_text(json.dumps(payload, indent=2, default=_default) + "\n")
    return path


def _default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def run_worker_bench(
    name: str, doc: str, bench: Callable[[int, int, Path], dict[str, Any]], argv: list[str] | None
) -> tuple[dict[str, Any], Path]:
    """The command line of a warm-worker benchmark (``--repeats``, ``--rf-dim``, ``--out``): runs
    ``bench(repeats, rf_dim, a temporary folder)``, adds the machine and the load after, writes
    experiments/results/<name>.json; returns the result and its path."""
    import tempfile

    parser: argparse.ArgumentParser = OneLineErrorParser(description=doc.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rf-dim", type=int, default=200)
    parser.add_argument("--out", default=None, help="folder of the JSON (default experiments/results)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = bench(args.repeats, args.rf_dim, Path(tmp))
    result["machine"] = machine_info()
    result["load_average_after"] = list(os.getloadavg())
    return result, write_json(name, result, args.out)
