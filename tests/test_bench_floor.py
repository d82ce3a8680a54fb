"""Flower's floor in experiments/bench_deployment.py (issue 32): the minimal app the deployment
benchmark times against the project's rounds, checked without a SuperLink."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from flwr.app import Context, RecordDict
from flwr.cli.config_utils import load_and_validate

from experiments.bench_deployment import write_floor_app
from fcl_flower.local_grid import LocalGrid
from tests.conftest import server_identity


def _module(folder: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"floor_test_{name}", folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_floor_app_is_a_flower_app_that_sends_one_query_per_node_per_round(tmp_path) -> None:
    app = write_floor_app(tmp_path / "floor-app")
    config, _ = load_and_validate(app / "pyproject.toml", check_module=False)  # what flwr run checks
    assert config["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "floor_server:app",
        "clientapp": "floor_client:app",
    }
    client, server = _module(app, "floor_client"), _module(app, "floor_server")
    grid = LocalGrid(client.app, 3)
    server_identity()
    out = tmp_path / "floor.json"
    server.app(grid, Context(1, 0, {}, RecordDict(), {"num-rounds": 4, "num-nodes": 3, "out": str(out)}))
    record = json.loads(out.read_text())
    assert record["status"] == "completed" and record["nodes"] == 3
    assert [r["round"] for r in record["rounds"]] == [1, 2, 3, 4] and all(r["seconds"] > 0 for r in record["rounds"])
    starts = [r["start"] for r in record["rounds"]]  # epoch seconds, to place a round in the logs
    assert starts == sorted(starts) and all(s > 1.6e9 for s in starts)
    sent = [(m.metadata.message_type, m.metadata.dst_node_id) for m in grid.sent]
    assert sent == [("query", node) for _ in range(4) for node in (1, 2, 3)]
    assert all(not r.has_error() for r in grid.replies) and len(grid.replies) == 12


def test_the_floor_clientapp_imports_only_flwr(tmp_path) -> None:
    app = write_floor_app(tmp_path / "floor-app")
    probe = "import json, sys, floor_client; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=app, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    loaded = {m.split(".")[0] for m in json.loads(out.strip().splitlines()[-1])}
    assert "flwr" in loaded and not loaded & {"torch", "fcl_flower", "clients", "strategies", "experiments"}
