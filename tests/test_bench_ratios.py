"""experiments/bench_deployment.py's arithmetic on synthetic results.json (issue 32): no processes.

The FedAvg target is about a round less its slowest client's local training, the analytic target
about a whole stage; both as ratios to the floor's median round, 1.3 plain and 2.5 secure with
federated evaluation. The numbers below are chosen so that every median and ratio is exact.
"""

from __future__ import annotations

import argparse
import math

import pytest

from experiments.bench_deployment import (
    RESULTS_DIR,
    default_out,
    exchanges_per_statistics_stage,
    message_counts,
    messages_received,
    minus_training,
    summarise,
    target_check,
)

FLOOR = [3.0, 4.0, 5.0, 4.0]  # median 4.0


def results(fedavg: list[tuple[float, float | None]], analytic: list[float]) -> dict:
    """A run's results.json: FedAvg rounds (seconds, train_seconds_max or None), stage 1's statistics
    round (1.0 s), then one statistics round per later stage (its stage takes ``analytic[i]``)."""
    rounds = [
        {"round": i + 1, "seconds": s, **({} if t is None else {"train_seconds_max": t, "train_seconds_mean": t / 2})}
        for i, (s, t) in enumerate(fedavg)
    ]
    rounds.append({"round": len(rounds) + 1, "seconds": 1.0})
    rounds += [{"round": len(rounds) + 1 + i, "seconds": a - 0.5} for i, a in enumerate(analytic)]
    stages = [{"seconds": 99.0}] + [{"seconds": a} for a in analytic]
    return {"rounds": rounds, "stages": stages}


def test_the_fedavg_round_less_its_training_against_the_floor() -> None:
    runs = [
        results([(10.0, 6.0), (9.0, 4.0), (8.0, 4.0)], [5.0, 6.0]),  # less training: 4, 5, 4
        results([(11.0, 5.0), (12.0, 8.0), (7.0, 3.0)], [4.0, 5.0]),  # less training: 6, 4, 4
    ]
    out = summarise(runs, FLOOR, 3, secure=False, evaluation="central")
    assert out["floor_median_round_seconds"] == 4.0
    assert out["fedavg_round_minus_training_seconds"] == [4.0, 5.0, 4.0, 6.0, 4.0, 4.0]
    assert out["fedavg_training_seconds_max"] == [6.0, 4.0, 4.0, 5.0, 8.0, 3.0]
    ratios = out["ratios_to_floor"]
    assert ratios["fedavg_round_minus_training"] == 1.0  # median 4.0 / 4.0
    assert ratios["fedavg_round"] == 9.5 / 4.0  # the rounds with their training: median of 7..12
    assert ratios["analytic_stage"] == 5.0 / 4.0 and ratios["analytic_round"] == 4.5 / 4.0
    assert [r["fedavg_round_minus_training_median"] for r in out["per_run"]] == [4.0, 4.0]
    assert out["stage1_statistics_round_seconds"] == [1.0, 1.0]
    fedavg, stage = out["targets"]["fedavg_round_minus_training"], out["targets"]["analytic_stage"]
    assert (fedavg["target"], fedavg["met"]) == (1.3, True)
    assert (stage["target"], stage["met"]) == (1.3, True)  # 1.25 <= 1.3, plain


def test_a_slow_stage_misses_and_the_secure_target_is_2_5_with_federated_evaluation() -> None:
    runs = [results([(10.0, 2.0)], [6.0, 8.0, 10.0])]  # stage median 8.0 = 2 floors; round less training 8.0
    plain = summarise(runs, FLOOR, 1, secure=False, evaluation="federated")
    assert plain["targets"]["analytic_stage"]["met"] is False  # 2.0 > 1.3
    assert plain["targets"]["fedavg_round_minus_training"]["met"] is False  # 2.0 > 1.3
    secure = summarise(runs, FLOOR, 1, secure=True, evaluation="federated")
    assert secure["targets"]["analytic_stage"]["target"] == 2.5 and secure["targets"]["analytic_stage"]["met"] is True
    central = summarise(runs, FLOOR, 1, secure=True, evaluation="central")
    assert (
        central["targets"]["analytic_stage"]["target"] is None and central["targets"]["analytic_stage"]["met"] is None
    )


def test_rounds_without_training_seconds_give_no_ratio_not_a_wrong_one() -> None:
    """A secure FedAvg round's replies carry no train-seconds: the round is left out, and with none
    left the ratio is None and the target has no verdict (never the round's whole time)."""
    runs = [results([(10.0, None), (9.0, None)], [5.0])]
    out = summarise(runs, FLOOR, 2, secure=True, evaluation="federated")
    assert (
        out["fedavg_round_minus_training_seconds"] == []
        and out["ratios_to_floor"]["fedavg_round_minus_training"] is None
    )
    assert out["targets"]["fedavg_round_minus_training"]["met"] is None
    assert out["ratios_to_floor"]["fedavg_round"] == 9.5 / 4.0
    less, training = minus_training(results([(10.0, None), (9.0, 2.5)], [5.0])["rounds"], 2)
    assert (less, training) == ([6.5], [2.5])
    assert minus_training([{"seconds": 3.0, "train_seconds_max": float("nan")}], 1) == ([], [])


def test_without_a_floor_the_ratios_are_nan_and_no_target_is_judged() -> None:
    out = summarise([results([(10.0, 2.0)], [5.0])], [], 1, secure=False, evaluation="central")
    assert math.isnan(out["ratios_to_floor"]["analytic_stage"])
    assert all(check["met"] is None for check in out["targets"].values())
    assert target_check(None, 1.3, "x")["met"] is None and target_check(1.3, 1.3, "x")["met"] is True


def test_messages_per_run_from_a_supernode_log() -> None:
    log = "\n".join(
        [
            "INFO :      [RUN 7]",
            "INFO :      Receiving: query message (ID: a)",
            "INFO :      [RUN 9, ROUND 1]",
            "INFO :      Receiving: train message (ID: b)",
            "INFO :      Received successfully",
            "INFO :      [RUN 9]",
            "INFO :      Receiving: query.stats message (ID: c)",
            "INFO :      [RUN 9]",
            "INFO :      Receiving: query.stats message (ID: d)",
            "INFO :      [RUN 10]",
            "INFO :      Receiving: evaluate message (ID: e)",
        ]
    )
    assert messages_received(log, 9) == ["train", "query.stats", "query.stats"]
    assert messages_received(log, 7) == ["query"] and messages_received(log, 8) == []
    assert message_counts(messages_received(log, 9)) == {"query.stats": 2, "train": 1}


SECURE_ROUND = ["query.keys", "query.shares", "query.stats", "query.unmask"]
SHARES_AHEAD = ["query.stats", "query.unmask"]


@pytest.mark.parametrize(
    ("kinds", "num_tasks", "exchanges"),
    [
        # plain, federated evaluation: stage 1's evaluation rides with stage 2's statistics, the last alone
        (["train", "train", "query.stats", "query.stats", "query.stats", "evaluate"], 3, 1.0),
        # plain, central evaluation, a first contact of its own and no FedAvg round
        (["query.info", "query.stats", "query.stats"], 2, 1.0),
        # secure: two secure FedAvg rounds (keys, shares, train, unmask), then 2 secure statistics stages
        (["query.info", *(["query.keys", "query.shares", "train", "query.unmask"] * 2), *SECURE_ROUND * 2], 2, 4.0),
        # shares ahead: after the run's first secure round, masked upload and unmask only
        (["query.info", "query.keys", "query.shares", *(["train", "query.unmask"] * 2), *SHARES_AHEAD * 2], 2, 2.0),
        # every evaluation an exchange of its own: (1 + 2) / 2, the last stage's evaluate counted apart
        (["train", "query.stats", "evaluate", "query.stats", "evaluate"], 2, 1.5),
        ([], 2, None),
    ],
)
def test_exchanges_per_statistics_stage_from_the_order_of_a_nodes_messages(
    kinds: list[str], num_tasks: int, exchanges: float | None
) -> None:
    assert exchanges_per_statistics_stage(kinds, num_tasks) == exchanges


@pytest.mark.parametrize(
    ("warm", "secure", "evaluation", "name"),
    [
        (False, False, "central", "bench_deployment.json"),
        (True, False, "central", "bench_deployment-warm-worker.json"),
        (True, True, "federated", "bench_deployment-warm-worker-secure-federated.json"),
        (False, False, "federated", "bench_deployment-federated.json"),
    ],
)
def test_each_mode_writes_its_own_file(warm: bool, secure: bool, evaluation: str, name: str) -> None:
    args = argparse.Namespace(warm_worker=warm, secure=secure, evaluation=evaluation)
    assert default_out(args) == RESULTS_DIR / name


def test_the_walkthrough_splits_its_wall_time_by_the_launchers_lines(tmp_path) -> None:
    from experiments.bench_walkthrough import parse_run_config, split_times, walkthrough_run_config

    stamps = {"federation_up": 30.0, "submitting": 31.0, "submitted": 33.0}
    assert split_times(stamps, 10.0, 150.0, 140.0) == {
        "total_seconds": 140.0,
        "startup_seconds": 20.0,
        "run_seconds": 109.0,
        "stop_seconds": 10.0,
    }
    failed = split_times({}, 0.0, 5.0, None)  # the federation never came up
    assert failed["total_seconds"] == 5.0 and failed["startup_seconds"] is failed["run_seconds"] is None
    text = walkthrough_run_config(3, 5, 0, " stage1-rounds=1 ", tmp_path / "out dir")
    assert text == f'num-clients=3 num-tasks=5 seed=0 secure-aggregation=true stage1-rounds=1 out="{tmp_path}/out dir"'
    cfg = parse_run_config(text)  # what the ServerApp sees: the launcher adds signed keys to a secure run
    assert cfg.secure_aggregation and cfg.secagg_signed_keys and cfg.num_tasks == 5 and cfg.stage1_rounds == 1
    assert cfg.output_dir.parent == (tmp_path / "out dir").resolve()
