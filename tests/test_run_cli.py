"""fcl-run (experiments/run_cli.py): the run config checked before anything is submitted, and the
outcome of ``flwr run`` as an exit status, against a fake ``flwr`` on PATH (no SuperLink)."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import run_cli

FAKE = """#!{python}
import json, os, sys
with open(os.environ["FAKE_FLWR_CALLS"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
command = sys.argv[1]
if command == "run":
    print(os.environ.get("FAKE_FLWR_RUN", '{{"success": true, "run-id": 42}}'))
elif command == "log":
    print("INFO :      [stage 1/2] round 1/1 (stsa-stats)")
elif command == "ls":
    count = os.environ["FAKE_FLWR_CALLS"] + ".ls"
    n = int(open(count).read()) + 1 if os.path.exists(count) else 1
    open(count, "w").write(str(n))
    statuses = os.environ["FAKE_FLWR_STATUS"].split(",")
    status = statuses[min(n, len(statuses)) - 1]
    print(json.dumps({{"success": True, "runs": [{{"run-id": 42, "status": status, "status-details": "boom"}}]}}))
"""


@pytest.fixture
def fake_flwr(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    exe = folder / "flwr"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_FLWR_CALLS", str(calls))
    monkeypatch.setenv("FAKE_FLWR_STATUS", "finished:completed")

    def seen() -> list[list[str]]:
        return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []

    return seen


def test_a_completed_run_exits_0_after_one_line(fake_flwr, capsys) -> None:
    code = run_cli.main([".", "--federation-config", "num-supernodes=5", "--run-config", "beta=0.1", "--stream"])
    err = capsys.readouterr().err
    assert code == 0
    assert err.strip().splitlines()[-1] == "fcl-run: run 42 finished:completed"
    calls = fake_flwr()
    assert calls[0] == [
        "run",
        ".",
        "--federation-config",
        "num-supernodes=5",
        "--run-config",
        "beta=0.1",
        "--format",
        "json",
    ]
    assert calls[1] == ["log", "42", "--stream"]
    assert calls[2] == ["ls", "--run-id", "42", "--format", "json"]


def test_a_failed_run_exits_1_with_flowers_details(fake_flwr, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FAKE_FLWR_STATUS", "finished:failed")
    assert run_cli.main([".", "my-link", "-c", "beta=0.1", "--no-log"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == "fcl-run: run 42 finished:failed (boom)"
    calls = fake_flwr()
    assert [c[0] for c in calls] == ["run", "ls"]  # --no-log: no flwr log
    assert calls[1] == ["ls", "my-link", "--run-id", "42", "--format", "json"]


def test_it_waits_with_the_given_interval_until_the_run_is_finished(fake_flwr, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FAKE_FLWR_STATUS", "running,running,finished:stopped")
    sleeps: list[float] = []
    monkeypatch.setattr(run_cli.time, "sleep", sleeps.append)
    assert run_cli.main([".", "--no-log", "--poll", "30"]) == 1
    assert sleeps == [30.0, 30.0]
    assert [c[0] for c in fake_flwr()] == ["run", "ls", "ls", "ls"]


@pytest.mark.parametrize(
    "config, reason",
    [
        ("rnk=64", "unknown config key 'rnk' (did you mean 'rank'?)"),
        ("beta=0.0", "beta must be > 0 (got 0.0)"),
        ("strategy='fedran", "cannot parse the run config: The provided configuration string is in an invalid format"),
    ],
)
def test_a_bad_configuration_exits_2_before_anything_is_submitted(fake_flwr, capsys, config, reason) -> None:
    assert run_cli.main([".", "--run-config", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fcl-run: error: ") and reason in err[0]
    assert fake_flwr() == []


def test_flwr_refusing_the_run_config_is_a_bad_configuration(fake_flwr, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FAKE_FLWR_RUN", "Invalid run configuration.")
    assert run_cli.main(["."]) == 2
    assert (
        capsys.readouterr().err.strip() == "fcl-run: error: flwr run did not start the run: Invalid run configuration."
    )


def test_arguments_are_split_as_flwr_run_reads_them() -> None:
    positional, configs, passed = run_cli.split_args(
        ["app", "link", "--run-config=a=1", "-c", "b=2", "--format", "default", "--stream", "--federation", "@x/y"]
    )
    assert positional == ["app", "link"]
    assert configs == ["a=1", "b=2"]
    assert passed == ["app", "link", "--run-config=a=1", "-c", "b=2", "--federation", "@x/y"]
    with pytest.raises(ValueError, match="needs a value"):
        run_cli.split_args(["-c"])
    assert run_cli.outcome("running") == -1 and run_cli.outcome("finished:completed") == 0


def test_fcl_run_is_a_console_script() -> None:
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'fcl-run = "experiments.run_cli:main"' in text
    proc = subprocess.run([sys.executable, "-m", "experiments.run_cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "flwr run" in proc.stdout


def test_fcl_config_answers_an_unparseable_string_with_one_line(capsys) -> None:
    from experiments import check_config

    assert check_config.main(["strategy='fedran"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot parse the run config: ")


def test_flowers_traceback_of_an_error_the_app_logged_in_one_line_is_left_out(tmp_path) -> None:
    """Under flwr run a ServerApp that raises RunAborted is logged by Flower with its traceback and
    an Exit Code notice (flwr/simulation/app.py, flwr/superlink/runtime/run_serverapp.py); the
    app's filter leaves its own one line only, and Flower still records the run as failed."""
    from flwr.app import Context, RecordDict
    from flwr.supercore import log

    from clients.app import app as client_app
    from fcl_flower.local_grid import LocalGrid
    from fcl_flower.quiet import quiet_known_noise
    from strategies.app import RunAborted, build_server_app

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    quiet_known_noise()
    try:
        app = build_server_app({"beta": 0.0, "out": str(tmp_path)})
        with pytest.raises(RunAborted) as err:
            app(
                LocalGrid(client_app, 1),
                Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
            )
        log(logging.ERROR, "%s raised an exception", "Simulation", exc_info=err.value)  # what Flower does next
        log(logging.ERROR, "Exit Code: 700\nAn unhandled exception occurred in the simulation.")
        log(logging.ERROR, "Exit Code: 700\nanother failure is still shown")
        try:
            raise RuntimeError("a bug")
        except RuntimeError as bug:
            log(logging.ERROR, "%s raised an exception", "Simulation", exc_info=bug)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "fcl-flower: error: beta must be > 0 (got 0.0)",
        "Exit Code: 700\nanother failure is still shown",
        "Simulation raised an exception",
    ]
    assert records[-1].exc_info is not None  # a bug keeps its traceback


def test_ctrl_c_stops_waiting_with_one_line_and_130(fake_flwr, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FAKE_FLWR_STATUS", "running")

    def interrupted(_seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_cli.time, "sleep", interrupted)
    assert run_cli.main([".", "--no-log"]) == 130
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert said[-1] == "fcl-run: stopped waiting; run 42 goes on (stop it with: flwr stop 42)"
