"""experiments/bench_deployment.py's memory sampler: every process of a tree, its own peak (VmHWM),
by the role its command line names."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.bench_deployment import PeakSampler, federation_module, process_role

ALLOCATE = "import sys, time; x = bytearray({mib} << 20); x[::4096] = b'1' * len(x[::4096]); print('ok', flush=True); time.sleep(30)"

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")


def test_the_sampler_keeps_each_processes_peak_under_its_root(tmp_path: Path) -> None:
    # a parent that starts a child holding 120 MiB: the child is found as a descendant of the root
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {ALLOCATE.format(mib=120)!r}])",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ok"  # the child allocated
        sampler = PeakSampler({"supernode-0": parent.pid}, 0.05, federation_module().descendants)
        sampler.start()
        time.sleep(0.3)
        sampler.stop()
    finally:
        for pid in federation_module().descendants([parent.pid]):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()
    report = sampler.report()
    assert sampler.samples >= 2
    other = report["by_role"]["other"]  # plain python processes: no Flower role
    assert other["processes"] == 2
    assert 120 <= other["peak_mib"] < 1024  # the child's peak, not the sum of both
    assert report["all_processes_summed_rss_peak_mib"] >= other["peak_mib"]
    assert report["per_supernode"] == {}  # no supernode or clientapp process among them


def test_roles_come_from_the_program_a_process_runs(tmp_path: Path) -> None:
    program = tmp_path / "flwr-clientapp"
    program.write_text("import time\ntime.sleep(30)\n")
    process = subprocess.Popen([sys.executable, str(program)])
    try:
        deadline = time.monotonic() + 10
        while process_role(process.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_role(process.pid) == "clientapp"
        assert process_role(os.getpid()) is None  # pytest names no Flower program
    finally:
        process.kill()
        process.wait()
    assert process_role(process.pid) is None  # gone: no role
