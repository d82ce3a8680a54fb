"""experiments/bench_floor.py (issue 32): Flower's floor alone, its spread, and the SuperNode log
timestamps it decomposes a round with; checked without a SuperLink."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from experiments.bench_deployment import machine_cpu_seconds, own_cgroup_cpu_seconds, worker_cpu_seconds
from experiments.bench_floor import NODE_MARKS, decompose, log_events, quantiles


def _stamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def test_quantiles_of_the_rounds() -> None:
    q = quantiles([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (q["min"], q["q1"], q["median"], q["q3"], q["max"], q["n"]) == (1.0, 2.0, 3.0, 4.0, 5.0, 5)
    assert quantiles([]) == {}


def test_a_round_is_decomposed_from_the_supernode_and_superlink_logs(tmp_path: Path) -> None:
    start = 1_800_000_000.0
    node = [  # as Flower 1.41 writes them under FLWR_LOG_LEVEL=DEBUG, colours included
        (start - 60, "WARNING", "DEBUG logs enabled. Do not use this in production."),  # the SuperNode's own
        (start - 0.02, "INFO", "Sent successfully"),  # the previous round's reply, just before this round
        (start + 3.0, "INFO", "Receiving: query message (ID: ab)"),
        (start + 4.0, "WARNING", "DEBUG logs enabled. Do not use this in production."),  # the ClientApp's
        (start + 6.5, "INFO", "Start `flwr-clientapp` process"),
        (start + 6.9, "INFO", "Sending: query message (ID: cd)"),
        (start + 7.0, "INFO", "Sent successfully"),
    ]
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "supernode-0.log").write_text(
        'INFO:     127.0.0.1:1 - "POST /v1/runtime/acquire-task HTTP/1.1" 200 OK\n'
        + "".join(f"\x1b[92m{level} {_stamp(t)}\x1b[0m:      {text}\n" for t, level, text in node)
    )
    (logs / "superlink.log").write_text(
        f"DEBUG {_stamp(start + 0.01)}:     Runtime.PushMessages\n"
        f"INFO {_stamp(start + 6.95)}:      [Fleet.PushMessages] Push replies from node_id=1\n"
    )
    assert [m for _, m in log_events(logs / "supernode-0.log", NODE_MARKS)][1:] == [
        "sent",
        "pulled",
        "proc_up",
        "app_imported",
        "sending",
        "sent",
    ]
    (row,) = decompose(logs, [start], [7.1])
    assert row["supernode-0"] == {"pulled": 3.0, "proc_up": 4.0, "app_imported": 6.5, "sending": 6.9, "sent": 7.0}
    assert row["superlink"] == {"server_push": [0.01], "reply_in": [6.95]}


def test_the_cpu_counters_read_this_machine() -> None:
    before = machine_cpu_seconds()
    sum(i * i for i in range(200_000))
    assert machine_cpu_seconds() >= before > 0
    assert own_cgroup_cpu_seconds() is None or own_cgroup_cpu_seconds() >= 0
    assert all(t >= 0 for t in worker_cpu_seconds().values())


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--num-nodes", "-1"], "--num-nodes must be at least 1, got -1"),
        (["--federations", "0"], "--federations must be at least 1, got 0"),
        (["--decompose"], "--decompose reads the DEBUG log lines"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_and_start_nothing(argv: list[str], words: str, capsys) -> None:
    from experiments import bench_floor

    with pytest.raises(SystemExit) as stop:
        bench_floor.main(argv)
    assert stop.value.code == 2
    assert words in capsys.readouterr().err.strip().splitlines()[-1]
