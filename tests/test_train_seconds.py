"""A train reply's ``train-seconds``: the local epochs' wall time by the client's clock (issue 32).

A deployment benchmark subtracts it from a FedAvg round to compare the rest with Flower's floor.
The reply is untrusted: the server keeps a non-negative finite number and ignores anything else,
saying so in one line; the reply itself is accepted as ever and the model is the same. Each plain
FedAvg round's entry in results.json ``rounds`` holds the max over its clients (the round waits for
the slowest), the mean and how many clients reported one.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from flwr.app import Message

from fcl_flower.methods import Kind
from fcl_flower.protocol import TrainIns, TrainRes, parse_reply
from strategies.base import train_time
from tests.conftest import reply_partition, run_in_process, small_config
from tests.test_protocol import CFG, HEADER, MODEL, _deliver

TRAIN_INS = TrainIns(HEADER, CFG, lr=0.01, num_seen=4, model=MODEL)
REPLY = TrainRes(HEADER, 1, 10, model=MODEL, loss=0.5)


def _parsed(value: object | None) -> TrainRes:
    message = REPLY.reply_to(_deliver(TRAIN_INS))
    if value is not None:
        message.content.metric_records["metrics"]["train-seconds"] = value  # type: ignore[assignment]
    reply = parse_reply(message, HEADER, Kind.TRAIN)
    assert isinstance(reply, TrainRes)
    return reply


def test_an_honest_train_seconds_is_read_and_round_trips() -> None:
    sent = TrainRes(HEADER, 1, 10, model=MODEL, loss=0.5, train_seconds=1.25)
    reply = parse_reply(sent.reply_to(_deliver(TRAIN_INS)), HEADER, Kind.TRAIN)
    assert isinstance(reply, TrainRes)
    assert reply.train_seconds == 1.25 and reply.train_seconds_ignored == ""
    assert _parsed(0).train_seconds == 0.0  # an int is a number too
    none = _parsed(None)
    assert none.train_seconds is None and none.train_seconds_ignored == ""  # not reported: nothing to say


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (-1.0, "-1.0"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        ([1.0, 2.0], "a list of 2"),
        ([0.5] * 5000, "a list of 5000"),
    ],
)
def test_a_lying_or_garbage_train_seconds_is_ignored_and_the_reply_kept(value: object, shown: str) -> None:
    reply = _parsed(value)
    assert reply.train_seconds is None
    assert reply.train_seconds_ignored == f"metric 'train-seconds' is {shown}, not a non-negative finite number"
    assert (reply.client, reply.num_examples, reply.loss) == (1, 10, 0.5)  # the reply itself is read as ever
    assert set(reply.model) == set(MODEL)
    assert "train-seconds" not in reply.metrics()  # an ignored value is never sent on


def test_a_rounds_train_time_is_the_slowest_client_and_the_mean() -> None:
    assert train_time([]) == {}
    assert train_time([1.0, 3.0, 2.0]) == {
        "train-seconds-max": 3.0,
        "train-seconds-mean": 2.0,
        "train-seconds-reported": 3.0,
    }


# stage-1 round -> what client 0 claims in it: garbage the parser ignores, then a number it reads but
# the server does not believe (longer than the round it came back in)
LIES = {1: -5.0, 2: 1e9}
WHY = {
    1: "metric 'train-seconds' is -5.0, not a non-negative finite number",
    2: "metric 'train-seconds' is 1e+09, longer than the round so far",
}


def test_results_json_records_the_honest_clients_and_names_the_liar(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two FedAvg rounds; client 0 lies in both (each lie named once, with its reason). Each round records the max and mean of the other
    two clients' own times, one warning names the liar per round, and W and every accuracy equal
    those of the same run without the lie (the timing is a metric only)."""
    settings = dict(num_tasks=2, num_clients=3, rf_dim=60, seed=0, stage1_rounds=2)
    honest: dict[int, list[float]] = {}

    def lie(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if phase != "fedavg":
            return replies
        server_round = len(honest) + 1
        honest[server_round] = []
        for reply in replies:
            metrics = reply.content.metric_records["metrics"]
            assert float(metrics["train-seconds"]) >= 0  # every client reports its own
            if reply_partition(reply) == 0:
                metrics["train-seconds"] = LIES[server_round]
            else:
                honest[server_round].append(float(metrics["train-seconds"]))
        return replies

    clean = run_in_process(small_config(tmp_path / "clean", **settings))
    with caplog.at_level(logging.WARNING):
        lied = run_in_process(small_config(tmp_path / "lied", **settings), lie)
    assert torch.equal(clean.weights, lied.weights)
    assert [s.accuracy for s in clean.recorder.stages] == [s.accuracy for s in lied.recorder.stages]
    rounds = json.loads((lied.recorder.path).read_text())["rounds"]
    fedavg = rounds[: settings["stage1_rounds"]]
    assert len(honest) == 2
    for entry, (server_round, times) in zip(fedavg, sorted(honest.items()), strict=True):
        assert entry["replies"] == 3.0  # the liar's model still counts
        assert entry["train_seconds_reported"] == 2.0
        assert entry["train_seconds_max"] == max(times)
        assert math.isclose(entry["train_seconds_mean"], sum(times) / 2)
        said = [r.getMessage() for r in caplog.records if "train-seconds" in r.getMessage()]
        named = [line for line in said if line.startswith(f"client-0 in round {server_round}: ")]
        assert len(named) == 1 and named[0].startswith(f"client-0 in round {server_round}: {WHY[server_round]}")
        assert named[0].endswith(", ignored")
    assert all("train_seconds_max" not in r for r in rounds[settings["stage1_rounds"] :])  # statistics rounds
    assert all("train_seconds_max" in r for r in json.loads(clean.recorder.path.read_text())["rounds"][:2])
