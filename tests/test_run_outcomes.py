"""Runs a user can trust and read: outcomes scripts can see, fail-fast checks, no silent overwrite,
a report per run, tracking, progress, and quiet output.

Runs go through the real ServerApp logic and ClientApp in this process (``run_local``) unless a
test needs the command line.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from clients.app import app as client_app
from experiments import check_config, local_superlink
from experiments.sim import RunIncomplete, completed_results, run_local
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.local_grid import LocalGrid
from fcl_flower.quiet import quiet_known_noise
from fcl_flower.results import StageRecord
from strategies.app import RunAborted, build_server_app
from strategies.loop import eta
from tests.conftest import small_config

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "experiments" / "sim.py"


def tiny(tmp: Path, **changes) -> RunConfig:
    return small_config(tmp, **{"num_tasks": 2, "rf_dim": 60, **changes})


def results(cfg: RunConfig) -> dict:
    return json.loads((cfg.output_dir / "results.json").read_text())


# ------------------------------------------------------------------------------ run folders
def test_the_default_run_folder_names_the_config_hash_of_result_knobs_only(tmp_path) -> None:
    cfg = tiny(tmp_path)
    assert cfg.output_dir.name == f"stsa-digits-seed0-{cfg.config_hash()}"
    assert cfg.replace(rf_dim=61).output_dir != cfg.output_dir  # a result knob: another folder
    for operational in ({"device": "auto"}, {"round_timeout": 9.0}, {"resume": True}, {"tracking": "tensorboard"}):
        assert cfg.replace(**operational).output_dir == cfg.output_dir, operational
    assert RunConfig().config_hash() == RunConfig(seed=0, rf_dim=RunConfig().rf_dim).config_hash()  # defaults


def test_a_run_never_writes_into_another_configurations_folder(tmp_path) -> None:
    first = tiny(tmp_path, run_name="shared")
    run_local(first)
    before = (first.output_dir / "results.json").read_bytes()
    other = first.replace(rf_dim=70)
    with pytest.raises(ConfigError, match=r"holds the results of another configuration \(rf-dim: 60 -> 70\)") as err:
        run_local(other)
    assert (first.output_dir / "results.json").read_bytes() == before  # untouched
    # the hint offers only what works: resume of another configuration is refused, overwrite is not
    assert "\n" not in str(err.value) and "pass overwrite" in str(err.value) and "pass resume" not in str(err.value)
    with pytest.raises(ConfigError, match="resume: config differs from the checkpoint in: rf-dim"):
        run_local(other.replace(resume=True))
    assert (first.output_dir / "results.json").read_bytes() == before
    run_local(other.replace(overwrite=True))
    assert results(other)["config"]["rf-dim"] == 70 and results(other)["status"] == "completed"


def test_a_resume_that_does_not_match_leaves_the_results_as_they_were(tmp_path) -> None:
    cfg = tiny(tmp_path, run_name="r")
    run_local(cfg)
    before = (cfg.output_dir / "results.json").read_bytes()
    with pytest.raises(ConfigError, match="resume: config differs from the checkpoint in: rf-dim"):
        run_local(cfg.replace(rf_dim=70, resume=True))
    assert (cfg.output_dir / "results.json").read_bytes() == before


def test_an_unwritable_output_folder_fails_before_anything_runs(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cfg = tiny(blocker / "sub")
    with pytest.raises(ConfigError, match=f"cannot write the run folder {cfg.output_dir}"):
        run_local(cfg)


# ------------------------------------------------------------------------------ outcomes
def test_results_say_completed_and_a_failed_run_says_failed_with_its_error(tmp_path) -> None:
    good = tiny(tmp_path)
    run_local(good)
    assert results(good)["status"] == "completed" and "error" not in results(good)
    assert completed_results(good) == good.output_dir / "results.json"

    # require-all-clients with a client that never answers: the run stops under way
    bad = tiny(tmp_path, require_all_clients=True, round_retries=0, round_timeout=1.0, run_name="bad")
    grid = LocalGrid(client_app, bad.num_clients)
    grid.unavailable.add(min(grid.get_node_ids()))
    from strategies.app import run_experiment

    with pytest.raises(Exception, match="require-all-clients"):
        run_experiment(grid, bad)
    data = results(bad)
    assert data["status"] == "failed" and "require-all-clients" in data["error"]
    with pytest.raises(RunIncomplete, match="status 'failed'"):
        completed_results(bad)


def _server_context(run_config: dict) -> Context:
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)


def test_the_server_app_raises_so_flower_records_a_failed_run(tmp_path) -> None:
    """Flower marks a run finished:failed when the ServerApp raises (flwr ls shows it): a config
    error is RunAborted with exit code 2 and the one-line reason, not a SystemExit."""
    app = build_server_app({"beta": 0.0, "out": str(tmp_path)})
    with pytest.raises(RunAborted, match=r"^beta must be > 0 \(got 0.0\)$") as err:
        app(LocalGrid(client_app, 1), _server_context({}))
    assert err.value.exit_code == 2
    assert list(tmp_path.iterdir()) == []  # nothing written


SIM_FLAGS = ["--num-tasks", "2", "--num-clients", "2", "--stage1-rounds", "0", "--rf-dim", "60", "--device", "cpu"]


def _sim_config(tmp_path: Path) -> RunConfig:
    return RunConfig(
        num_tasks=2, num_clients=2, stage1_rounds=0, rf_dim=60, device="cpu", out=str(tmp_path), run_name="r"
    )


def _sim(*flags: str) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.sim", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "CI": "true"},
    )
    return proc, time.monotonic() - began


def _engine_never_starts(monkeypatch) -> None:
    import flwr.simulation

    def refuse(**_: object) -> None:
        raise AssertionError("the simulation engine started")

    monkeypatch.setattr(flwr.simulation, "run_simulation", refuse)


def test_sim_exits_non_zero_and_prints_no_results_path_on_failure(tmp_path) -> None:
    """A resume that does not match the checkpoint: exit 2, one error line, no 'results:' line,
    the run folder untouched (that the engine never starts is tested in process, below, without
    timing anything)."""
    flags = [*SIM_FLAGS, "--out", str(tmp_path), "--run-name", "r"]
    run_local(_sim_config(tmp_path))
    before = (tmp_path / "r" / "results.json").read_bytes()
    proc, _ = _sim(*flags, "--rf-dim", "61", "--resume")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["error: resume: config differs from the checkpoint in: rf-dim"]
    assert "results:" not in proc.stdout
    assert (tmp_path / "r" / "results.json").read_bytes() == before


def test_sim_on_a_folder_another_server_holds_stops_before_the_engine_starts(tmp_path) -> None:
    """A second fcl-sim on a locked run folder: exit 2 and one line, nothing written (that the
    engine never starts is tested in process, below, without timing anything)."""
    from strategies.checkpoint import run_folder_lock

    cfg = _sim_config(tmp_path)
    with run_folder_lock(cfg.output_dir):  # the first server, in this process
        proc, _ = _sim(*SIM_FLAGS, "--out", str(tmp_path), "--run-name", "r")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: another server is running in {cfg.output_dir}")
    assert sorted(p.name for p in cfg.output_dir.iterdir()) == [".lock"]  # nothing written


def test_sim_checks_the_lock_and_the_resume_before_the_engine_starts(tmp_path, monkeypatch, capsys) -> None:
    """In process: the engine is never started for a locked folder or a resume of another
    configuration; checks that pass leave the lock to the server."""
    from experiments import sim
    from strategies.checkpoint import run_folder_lock

    cfg = _sim_config(tmp_path)
    flags = [*SIM_FLAGS, "--out", str(tmp_path), "--run-name", "r"]
    _engine_never_starts(monkeypatch)
    with run_folder_lock(cfg.output_dir):
        assert sim.main(flags) == 2
    assert capsys.readouterr().err.startswith("error: another server is running in")
    run_local(cfg)
    assert sim.main([*flags, "--rf-dim", "61", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err == "error: resume: config differs from the checkpoint in: rf-dim\n"

    # checks that pass leave the lock free: the server takes it when it starts and holds it while it
    # runs (tests/test_trust_boundaries.py: a second server on the same folder stops at once)
    sim.check_before_start(cfg.replace(resume=True))
    with run_folder_lock(cfg.output_dir):
        pass


# ------------------------------------------------------------------------------ a run reports itself
def test_every_run_writes_a_csv_and_a_plot_next_to_results_json(tmp_path) -> None:
    cfg = tiny(tmp_path)
    run_local(cfg)
    data = results(cfg)
    with open(cfg.output_dir / "results.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["stage"]) for r in rows] == [s["stage"] for s in data["stages"]]
    for row, stage in zip(rows, data["stages"], strict=True):
        assert float(row["accuracy"]) == pytest.approx(stage["accuracy"], abs=1e-4)
        assert [float(row[f"task_{k + 1}"]) for k in range(len(stage["per_task_accuracy"]))] == pytest.approx(
            stage["per_task_accuracy"], abs=1e-4
        )
        uploads = list(stage["upload_bytes_per_client"].values())
        assert int(row["upload_bytes_total"]) == sum(uploads)
        assert int(row["clients"]) == len(stage["clients"])
    assert rows[0]["task_2"] == ""  # task 2 not seen yet after stage 1
    # every round of the run, in order, with the replies it aggregated and its time inside its stage's
    assert [r["round"] for r in data["rounds"]] == list(range(1, sum(s["rounds"] for s in data["stages"]) + 1))
    assert all(r["replies"] == cfg.num_clients and r["seconds"] > 0 for r in data["rounds"])
    first = sum(s["rounds"] for s in data["stages"][:1])
    assert sum(r["seconds"] for r in data["rounds"][:first]) <= data["stages"][0]["seconds"]
    png = (cfg.output_dir / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5_000


def test_eta_is_the_mean_of_the_stages_after_the_first_times_the_stages_left() -> None:
    def stage(seconds: float) -> StageRecord:
        return StageRecord(1, [0], 50.0, [50.0], seconds, 1, {}, {})

    assert eta([stage(100.0)], 5) == "; ETA after stage 2"  # stage 1 alone says nothing of the rest
    assert eta([stage(100.0), stage(2.0), stage(4.0)], 5) == "; ETA 6 s"  # 2 left x mean(2, 4)
    assert eta([stage(100.0), stage(61.0)], 3) == "; ETA 1 min 1 s"
    assert eta([stage(1.0)] * 5, 5) == ""


# ------------------------------------------------------------------------------ tracking
def test_tensorboard_and_mlflow_get_the_config_and_every_stage(tmp_path) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny(tmp_path, tracking="both")
    run_local(cfg)
    data = results(cfg)
    accuracies = [s["accuracy"] for s in data["stages"]]

    events = EventAccumulator(str(cfg.output_dir / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert [e.value for e in events.Scalars("stage/accuracy")] == pytest.approx(accuracies, abs=1e-4)
    assert [e.step for e in events.Scalars("stage/accuracy")] == [1, 2]
    assert "round/upload_bytes" in scalars and "run/A_avg" in scalars
    assert events.Scalars("run/A_avg")[0].value == pytest.approx(data["A_avg"], abs=1e-4)

    client = MlflowClient((cfg.output_dir / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("fcl-flower").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == cfg.output_dir.name
    assert run.data.params == {k: str(v) for k, v in data["config"].items()}
    history = client.get_metric_history(run.info.run_id, "stage/accuracy")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(accuracies, abs=1e-4)
    assert run.data.metrics["A_T"] == pytest.approx(data["A_T"], abs=1e-4)
    rounds = client.get_metric_history(run.info.run_id, "round/upload_bytes")
    per_stage = [sum(s["upload_bytes_per_client"].values()) for s in data["stages"]]
    assert sum(m.value for m in rounds) == sum(per_stage)


# ------------------------------------------------------------------------------ checking a config
def test_fcl_config_names_unknown_keys_and_bad_values(capsys) -> None:
    assert check_config.main(["strategy='fedran' rnk=64"]) == 2
    assert capsys.readouterr().err.strip() == "error: unknown config key 'rnk' (did you mean 'rank'?)"
    assert check_config.main(["beta=0"]) == 2
    assert capsys.readouterr().err.strip() == "error: beta must be > 0 (got 0.0)"
    assert check_config.main(["strategy='fedran' rank=64"]) == 0
    assert capsys.readouterr().out.startswith("ok: fedran on digits, results in ")


# ------------------------------------------------------------------------------ stopping the local SuperLink
def test_stop_superlink_stops_only_the_local_superlink_of_this_flwr_home(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "bin" / "flower-superlink"
    fake.parent.mkdir()
    fake.write_text("import time\ntime.sleep(120)\n")
    home = tmp_path / "home"
    monkeypatch.setenv("FLWR_HOME", str(home))
    ours = local_superlink.local_superlink_log()
    assert ours == home / "local-superlink" / "superlink.log"
    started = [
        subprocess.Popen([sys.executable, str(fake), "--log-file", str(log)])
        for log in (ours, tmp_path / "other-home" / "superlink.log")
    ]
    try:
        deadline = time.monotonic() + 20
        while len(local_superlink.find_local_superlinks(ours)) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p.pid for p in local_superlink.find_local_superlinks(ours)] == [started[0].pid]
        assert local_superlink.main([]) == 0
        assert started[0].wait(timeout=20) is not None
        assert started[1].poll() is None  # another FLWR_HOME's SuperLink keeps running
    finally:
        for process in started:
            process.kill()
            process.wait()


# ------------------------------------------------------------------------------ quiet output
def test_only_the_known_noise_is_filtered() -> None:
    quiet_known_noise()
    logger = logging.getLogger("flwr")
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Catch()
    logger.addHandler(handler)
    try:
        logger.warning("Manually terminating %s", "ClientAppActor")
        logger.warning("DEPRECATED FEATURE: %s", "The `run_simulation` function is deprecated and will be removed")
        logger.warning("a client was left out")
    finally:
        logger.removeHandler(handler)
    assert seen == ["a client was left out"]
