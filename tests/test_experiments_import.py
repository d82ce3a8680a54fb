"""Every experiment script imports: a function a merge moved away (as ``average_states`` once
was, from ``fcl_flower.averaging`` to ``strategies.fedavg``) fails here, not on a user's first run.
``bench_server_cost`` re-executes the interpreter on import to set its allocator (by design)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

SCRIPTS = sorted(
    p.stem for p in (Path(__file__).parent.parent / "experiments").glob("*.py") if p.stem not in ("bench_server_cost",)
)


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_experiment_script_imports(name: str) -> None:
    module = importlib.import_module(f"experiments.{name}")
    assert module.__name__ == f"experiments.{name}"
