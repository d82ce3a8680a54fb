"""experiments/bench_gpu.py: what it measures and writes (here without a GPU: the CPU rows only)."""

from __future__ import annotations

import json

import pytest
import torch

from experiments import bench_gpu


def test_bad_flags_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert bench_gpu.main(["--num-gpus", "0", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert not (tmp_path / "x.json").exists()


def test_an_unknown_flag_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bench_gpu.main(["--only", "stsa-nope"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "stsa-nope" in err


def test_a_failure_while_measuring_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    def broken(**_: object) -> list[dict[str, object]]:
        raise RuntimeError("CUDA error: device-side assert")

    monkeypatch.setattr(bench_gpu, "throughput", broken)
    assert bench_gpu.main(["--skip-runs", "--out", str(tmp_path / "x.json")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: bench_gpu failed: RuntimeError: CUDA error: device-side assert"
    assert not (tmp_path / "x.json").exists()


def test_a_cpu_run_records_every_stage_and_no_gpu_row(tmp_path) -> None:
    out = tmp_path / "bench.json"
    code = bench_gpu.main(["--quick", "--skip-throughput", "--only", "stsa-default-cpu", "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["gpu_visible"] == torch.cuda.is_available()
    assert "throughput" not in data
    (run,) = data["runs"]
    assert run["label"] == "stsa-default-cpu" and run["exit_code"] == 0
    assert [stage["stage"] for stage in run["stages"]] == [1, 2]  # --quick: two tasks
    assert all(stage["seconds"] > 0 and 0 <= stage["accuracy"] <= 100 for stage in run["stages"])
    assert sum(stage["seconds"] for stage in run["stages"]) < run["wall_seconds"]
