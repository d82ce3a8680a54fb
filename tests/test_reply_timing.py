"""The server's own cost of reading replies, recorded per stage next to the solve.

``extra.server_reply_seconds`` (strategies/accounting.py) sums, over a stage's replies, the time the
server spends accepting each one (``accept``, which contains ``parse`` and ``check``), counting its
bytes and adding it to the running sums; ``extra.solve_seconds`` is the ridge solve. The benchmark
(experiments/bench_deployment.py --wire-dtype) reads both from results.json. These tests check the
structure and the sums' consistency, never a timing value.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, Message

from strategies.accounting import REPLY_STEPS, StageAccounting
from tests.conftest import build, in_process_grid, run_in_process, server_identity, small_config


def test_timed_sums_each_step_also_when_the_body_raises() -> None:
    accounting = StageAccounting()
    assert accounting.timing_extra() == {}  # no replies, no record
    with accounting.timed("parse"):
        time.sleep(0.002)
    first = accounting.seconds["parse"]
    with pytest.raises(ValueError), accounting.timed("parse"):
        time.sleep(0.002)
        raise ValueError("bad upload")
    assert first >= 0.002 and accounting.seconds["parse"] >= first + 0.002
    accounting.replies = 1
    extra = accounting.timing_extra()["server_reply_seconds"]
    assert set(extra) == {*REPLY_STEPS, "handling", "replies"}
    assert extra["parse"] == accounting.seconds["parse"] and extra["accept"] == 0.0
    accounting.reset()
    assert accounting.seconds == {} and accounting.replies == 0 and accounting.timing_extra() == {}


def check_stage(extra: dict, replies: int) -> None:
    timing = extra["server_reply_seconds"]
    assert set(timing) == {*REPLY_STEPS, "handling", "replies"}
    assert timing["replies"] == replies
    assert all(timing[step] >= 0.0 for step in REPLY_STEPS)
    assert timing["parse"] > 0.0 and timing["check"] > 0.0 and timing["accept"] > 0.0
    # parse and check run inside accept, so their sums never exceed its sum
    assert timing["parse"] + timing["check"] <= timing["accept"]
    assert timing["handling"] == pytest.approx(timing["accept"] + timing["bytes"] + timing["add"], rel=1e-12)
    assert extra["solve_seconds"] > 0.0


def test_every_stsa_stage_records_its_reply_handling_and_its_solve(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, num_tasks=2)
    strategy = run_in_process(cfg)
    assert len(strategy.recorder.stages) == 2
    for stage in strategy.recorder.stages:
        check_stage(stage.extra, cfg.num_clients)
        assert stage.extra["server_reply_seconds"]["add"] > 0.0  # each accepted upload was added
    written = json.loads((cfg.output_dir / "results.json").read_text())["stages"]
    assert [s["extra"]["server_reply_seconds"] for s in written] == [
        s.extra["server_reply_seconds"] for s in strategy.recorder.stages
    ]


def test_a_rejected_reply_is_counted_and_timed_but_never_added(tmp_path: Path) -> None:
    def strip_one(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if task == 1:  # the second stage: the first reply loses its statistics
            replies[0].content.array_records["arrays"] = ArrayRecord()
        return replies

    cfg = small_config(tmp_path, num_tasks=2)
    server_identity()
    strategy = build(cfg)
    strategy.start(in_process_grid(cfg.num_clients, strip_one))
    first, second = strategy.recorder.stages
    assert len(second.clients) == cfg.num_clients - 1 and second.left_out
    check_stage(second.extra, cfg.num_clients)  # three replies read, one of them rejected
    check_stage(first.extra, cfg.num_clients)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-tasks", "3"], "10 classes do not divide into 3 equal tasks"),
        (["--ridge", "foo"], "ridge must be a number or 'auto' (got 'foo')"),
    ],
)
def test_bench_deployment_refuses_a_bad_configuration_in_one_line_before_starting_anything(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from experiments import bench_deployment

    def no_federation(*args: object, **kwargs: object) -> None:
        raise AssertionError("a federation was started")

    monkeypatch.setattr(bench_deployment, "run_all", no_federation)
    assert bench_deployment.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_deployment: error: ") and message in err and err.count("\n") == 1


def test_bench_deployment_compares_the_reply_handling_with_the_solve_less_its_certificate() -> None:
    """The yardstick is the solve itself: a certificate factorisation the same stage paid (when the
    uploads' checks could not certify the fixed γ) is reported beside it, not counted in it."""
    from experiments.bench_deployment import uploads_table

    timing = {"handling": 9.0, "parse": 0.3, "check": 8.4, "bytes": 0.0, "add": 0.3, "finish": 0.1, "replies": 3}
    run = {
        "server_reply_seconds": [timing],
        "solve_seconds": [5.0],
        "certificate_seconds": [2.5],
        "upload_bytes_per_client": [{"client-0": 2**20}],
        "peak_memory": None,
        "stage_seconds": [20.0],
        "analytic_round_seconds": [15.0],
        "load_average_after": [1.0, 1.0, 1.0],
    }
    table = uploads_table({"rf_dim": 100, "num_nodes": 3, "runs": {"float64": run}})
    header, values = table.splitlines()[1], table.splitlines()[3].split()
    assert "solve s  certificate s  meets" in header
    # reply 3.00 s (9 s over 3 replies), solve 5.0 − 2.5 s, certificate 2.5 s: not met
    assert values[4] == "3.00" and values[10:13] == ["2.50", "2.50", "no"]
    run["certificate_seconds"] = [0.0]
    assert uploads_table({"rf_dim": 100, "num_nodes": 3, "runs": {"float64": run}}).splitlines()[3].split()[10:13] == [
        "5.00",
        "0.00",
        "yes",
    ]
