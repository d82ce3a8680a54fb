"""Shared by the tests that start real Flower processes (tests/test_deployment.py,
tests/test_deployment_own_data.py): the launcher module and whether this machine can run it."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from experiments.bench_deployment import federation_module

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def load_federation_module() -> ModuleType:
    """deploy/local_federation.py (a script, not a package module), loaded by path."""
    module: ModuleType = federation_module()
    return module


def cannot_deploy() -> str | None:
    """Why real SuperLink/SuperNode processes cannot run here, or None."""
    for tool in ("flower-superlink", "flower-supernode", "flwr"):
        if not (BIN / tool).exists():
            return f"{tool} not next to {sys.executable}"
    if not Path("/proc").is_dir():
        return "needs Linux /proc to find and stop every child process"
    return None
