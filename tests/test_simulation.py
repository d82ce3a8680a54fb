"""ONE end-to-end run in Flower's Ray simulation engine, through experiments/sim.py.

Everything else is tested without Ray (tests/test_stsa_pipeline.py drives the same strategy
objects in-process); this proves the ServerApp/ClientApp wiring, the real message transport and
the results file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fcl_flower.analytic import bytes_for, stsa_upload_numbers
from fcl_flower.config import RunConfig
from fcl_flower.metrics import summarise
from fcl_flower.models import trainable_state
from fcl_flower.runtime import build_model, federated_split

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "experiments" / "sim.py"


def _config_of(argv: list[str]) -> RunConfig:
    """The RunConfig sim.py builds from ``argv``, via its own parser."""
    from experiments import sim

    return sim.config_from_args(sim.build_parser().parse_args(argv))


def test_stsa_ray_simulation_end_to_end(tmp_path: Path) -> None:
    argv = [
        "--strategy",
        "stsa",
        "--dataset",
        "digits",
        "--num-tasks",
        "2",
        "--num-clients",
        "3",
        "--stage1-rounds",
        "2",
        "--local-epochs",
        "1",
        "--rf-dim",
        "200",
        "--batch-size",
        "128",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "out"),
        "--run-name",
        "e2e",
    ]
    proc = subprocess.run([sys.executable, str(SIM), *argv], cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = tmp_path / "out" / "e2e" / "results.json"
    assert f"results: {path}" in proc.stdout
    results = json.loads(path.read_text())
    cfg = _config_of(argv)

    assert results["strategy"] == "stsa"
    assert results["config"] == cfg.to_mapping()
    stages = results["stages"]
    assert [s["stage"] for s in stages] == [1, 2]
    assert [s["rounds"] for s in stages] == [cfg.stage1_rounds + 1, 1]  # FedAvg rounds + stats round
    split = federated_split(cfg)
    clients = [f"client-{k}" for k in range(cfg.num_clients)]
    model_bytes = sum(v.numel() * v.element_size() for v in trainable_state(build_model(cfg, split)).values())
    for t, stage in enumerate(stages):
        seen = split.tasks[t].stop
        assert stage["classes"] == list(split.tasks[t])
        assert stage["accuracy"] > 100.0 / seen + 10  # clearly above chance
        assert len(stage["per_task_accuracy"]) == t + 1
        assert all(0.0 <= a <= 100.0 for a in stage["per_task_accuracy"])
        assert stage["seconds"] > 0
        assert stage["clients"] == clients and stage["left_out"] == {}
        stats = bytes_for(
            stsa_upload_numbers(cfg.rf_dim, len(split.tasks[t]), packed=True, counts=True), cfg.wire_dtype
        )
        fedavg = cfg.stage1_rounds * model_bytes if t == 0 else 0  # the trainable state, each round
        assert stage["upload_bytes_per_client"] == dict.fromkeys(clients, stats + fedavg)
        for c in clients:
            assert stats + fedavg < stage["upload_message_bytes_per_client"][c] <= 1.05 * (stats + fedavg) + 4096
    summary = summarise([s["accuracy"] for s in stages], [s["per_task_accuracy"] for s in stages])
    assert results["A_avg"] == pytest.approx(summary.A_avg)
    assert results["A_T"] == pytest.approx(summary.A_T) == stages[-1]["accuracy"]
    assert results["F_T"] == pytest.approx(summary.F_T)
    assert results["total_upload_bytes_per_client"] == {
        c: sum(s["upload_bytes_per_client"][c] for s in stages) for c in clients
    }
    assert "Traceback" not in proc.stderr
