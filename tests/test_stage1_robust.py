"""Stage 1 without secure aggregation: one client that sends scaled or sign-flipped weights in
every FedAvg round. With ``stage1-aggregation fedavg`` the backbone every analytic stage rests on
is ruined and the final accuracy falls; with Flower's robust rules (median, trimmed-mean, krum,
multikrum, bulyan) it stays within 2 points of the honest run (digits, real strategy loop and
client handlers through LocalGrid, as tests/test_trust_boundaries.py). Then the rules one by one
on crafted states, the FedAvg mean's bit-for-bit float64 sum, and the knobs' one-line errors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, Message

from fcl_flower.config import ConfigError, RunConfig
from strategies.base import RoundFailed
from strategies.fedavg import Aggregation, average_states
from tests.conftest import build, reply_partition, run_in_process, server_identity, small_config

SETTINGS = dict(num_tasks=2, num_clients=5, stage1_rounds=3, local_epochs=1, rf_dim=200, round_timeout=60.0)
VICTIM = 0  # the malicious client
ATTACKS = {"scaled-x-10": -10.0, "sign-flipped": -1.0}  # what it multiplies its trained weights by


def poison(factor: float, poisoned: list[int]):
    """VICTIM's FedAvg reply, every round: its floating weights times ``factor`` (BatchNorm
    statistics too, a negative running variance included: nothing in a reply's checks forbids it)."""

    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if phase == "fedavg":
            for m in replies:
                if not m.has_error() and reply_partition(m) == VICTIM:
                    record = m.content.array_records["arrays"]
                    for key in list(record.keys()):
                        values = record[key].numpy()
                        if values.dtype.kind == "f":
                            record[key] = Array(np.ascontiguousarray(values * factor))
                    poisoned.append(task)
        return replies

    return tamper


def final_accuracy(tmp: Path, rule: str, attack: str | None, **changes) -> tuple[float, list[int]]:
    """A_T of a short digits run (stsa) aggregating stage 1 by ``rule``, and the tasks whose
    FedAvg rounds carried a poisoned reply."""
    poisoned: list[int] = []
    name = f"{rule}-{attack or 'honest'}"
    cfg = small_config(tmp, **{**SETTINGS, **changes}, stage1_aggregation=rule, run_name=name)
    strategy = run_in_process(cfg, None if attack is None else poison(ATTACKS[attack], poisoned))
    stages = strategy.recorder.stages
    assert len(stages) == cfg.num_tasks
    return stages[-1].accuracy, poisoned


class HonestRuns(dict[int, float]):
    """A_T of the honest FedAvg run, by number of clients, each run on first use."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def __missing__(self, clients: int) -> float:
        self[clients] = final_accuracy(self.out, "fedavg", None, num_clients=clients)[0]
        return self[clients]


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> HonestRuns:
    return HonestRuns(Path(tmp_path_factory.mktemp("honest")))


# ------------------------------------------------------------------------------ the attack, end to end
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_one_poisoning_client_ruins_the_fedavg_backbone(honest, tmp_path, attack) -> None:
    accuracy, poisoned = final_accuracy(tmp_path, "fedavg", attack)
    assert poisoned == [0] * SETTINGS["stage1_rounds"]  # every stage-1 round, and only those
    assert accuracy < honest[5] - 20, (accuracy, honest[5])


@pytest.mark.parametrize(
    ("rule", "attack"),
    [
        pytest.param("median", "scaled-x-10", marks=pytest.mark.slow),  # the default suite: one attack per rule
        ("median", "sign-flipped"),
        ("trimmed-mean", "scaled-x-10"),
        pytest.param("krum", "scaled-x-10", marks=pytest.mark.slow),
        ("krum", "sign-flipped"),
        ("multikrum", "scaled-x-10"),
    ],
)
def test_a_robust_rule_keeps_the_honest_accuracy(honest, tmp_path, rule, attack) -> None:
    accuracy, poisoned = final_accuracy(tmp_path, rule, attack)
    assert poisoned == [0] * SETTINGS["stage1_rounds"]
    assert abs(accuracy - honest[5]) <= 2.0, (rule, accuracy, honest[5])


def test_bulyan_keeps_the_honest_accuracy_with_its_seven_clients(honest, tmp_path) -> None:
    """Bulyan needs n >= 4f + 3: seven clients for one attacker."""
    accuracy, poisoned = final_accuracy(tmp_path, "bulyan", "sign-flipped", num_clients=7)
    assert poisoned == [0] * SETTINGS["stage1_rounds"]
    assert abs(accuracy - honest[7]) <= 2.0, (accuracy, honest[7])


@pytest.mark.parametrize("strategy", ["stsa", "fedran", "joint", "finetune", "lwf", "ewc", "lga", "target"])
def test_every_method_with_fedavg_rounds_aggregates_by_the_knob(tmp_path, strategy) -> None:
    """Stage 1 of the analytic methods and every FedAvg round of the gradient baselines."""
    cfg = small_config(tmp_path, **SETTINGS, strategy=strategy, stage1_aggregation="krum", stage1_byzantine=1)
    assert build(cfg).fedavg.aggregation == Aggregation("krum", byzantine=1, trim_fraction=0.2, select=0)


# ------------------------------------------------------------------------------ the rules on crafted states
def _states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "conv.weight": torch.randn(4, 3, 3, 3, generator=g),
            "bn.running_var": torch.rand(4, generator=g) + 0.5,
            "bn.num_batches_tracked": torch.tensor(10 + i, dtype=torch.long),
            "head.weight": torch.randn(5, 4, generator=g, dtype=torch.float64),
        }
        for i in range(n)
    ]


def _poisoned(n: int, factor: float = -100.0) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """n honest states near a common model, then one attacker's (scaled, with a huge counter)."""
    honest = _states(1)[0]
    g = torch.Generator().manual_seed(1)
    states = [
        {
            k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v + i
            for k, v in honest.items()
        }
        for i in range(n)
    ]
    attacker = {k: v * factor if v.is_floating_point() else v + 10**12 for k, v in states[0].items()}
    return [*states, attacker], [100.0 + 10 * i for i in range(n)] + [5000.0]  # it claims many samples too


def test_the_fedavg_mean_is_the_float64_sum_bit_for_bit() -> None:
    """Flower's aggregate_arrayrecords, fed float64, is exactly the float64 sum of value·(w/total)
    in client order that the project always computed; integer counters take the max."""
    states, weights = _states(4), [113.0, 250.0, 97.0, 301.0]
    merged = average_states(states, weights)
    total = float(sum(weights))
    for key in ("conv.weight", "bn.running_var", "head.weight"):
        acc = torch.zeros_like(states[0][key], dtype=torch.float64)
        for state, weight in zip(states, weights, strict=True):
            acc += state[key].to(torch.float64) * (weight / total)
        assert merged[key].dtype == states[0][key].dtype
        assert torch.equal(merged[key], acc.to(states[0][key].dtype)), key
    assert int(merged["bn.num_batches_tracked"]) == 13


def test_one_attacker_moves_the_mean_anywhere_but_not_the_robust_rules() -> None:
    server_identity()  # Flower's strategies read replies (Messages) as a ServerApp does
    states, weights = _poisoned(6)
    honest = states[:-1]
    mean = average_states(states, weights)
    assert float(mean["conv.weight"].abs().max()) > 10 * float(
        torch.stack([s["conv.weight"] for s in honest]).abs().max()
    )
    for rule in ("median", "trimmed-mean", "bulyan"):  # coordinate-wise: inside the honest clients' range
        merged = average_states(states, weights, Aggregation(rule))
        for key in ("conv.weight", "bn.running_var", "head.weight"):
            stacked = torch.stack([s[key] for s in honest])
            assert bool(((merged[key] >= stacked.amin(0)) & (merged[key] <= stacked.amax(0))).all()), (rule, key)
        assert 10 <= int(merged["bn.num_batches_tracked"]) <= 15, rule  # an honest counter, not the attacker's
    krum = average_states(states, weights, Aggregation("krum"))
    assert any(all(torch.equal(krum[k], s[k]) for k in s if s[k].is_floating_point()) for s in honest)
    multikrum = average_states(states, weights, Aggregation("multikrum"))  # the n - f = 6 closest: the honest
    expected = average_states(honest, weights[:-1])
    for key in ("conv.weight", "bn.running_var", "head.weight"):
        torch.testing.assert_close(multikrum[key], expected[key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rule", ["median", "trimmed-mean", "krum", "multikrum", "bulyan"])
def test_chosen_clients_that_claim_no_samples_do_not_crash_the_server(rule) -> None:
    """Flower divides by the chosen replies' total count (the model of Krum and Multi-Krum, the
    metrics of every rule): honest clients that all claim 0 samples, next to an attacker that
    claims many, would end the server in a ZeroDivisionError. The chosen are then averaged
    plainly, as FedAvg does when a round reports no examples."""
    server_identity()
    states, weights = _poisoned(6)
    weights = [0.0] * 6 + [5000.0]
    merged = average_states(states, weights, Aggregation(rule))
    honest = torch.stack([s["conv.weight"] for s in states[:-1]])
    assert bool(((merged["conv.weight"] >= honest.amin(0)) & (merged["conv.weight"] <= honest.amax(0))).all())
    if rule == "multikrum":
        torch.testing.assert_close(merged["conv.weight"], honest.mean(0), rtol=1e-6, atol=1e-7)


def test_bulyan_below_four_f_plus_three_replies_fails_the_round_in_one_line() -> None:
    server_identity()
    states, weights = _poisoned(4)  # 5 replies, Bulyan with f = 1 needs 7
    with pytest.raises(
        RoundFailed,
        match=r"^stage1-aggregation bulyan withstands 1 malicious client\(s\) only among at least 7 \(got 5\)$",
    ):
        average_states(states, weights, Aggregation("bulyan"))


# ------------------------------------------------------------------------------ the knobs
@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"stage1_aggregation": "mean"}, "unknown stage1-aggregation 'mean'; choose one of: fedavg, median"),
        (
            {"stage1_aggregation": "median", "secure_aggregation": True},
            "under secure-aggregation the server sees only their sum",
        ),
        ({"stage1_aggregation": "median", "strategy": "stamp", "partition": "task-pool"}, "stamp has no FedAvg rounds"),
        ({"stage1_aggregation": "krum", "strategy": "joint-gradient"}, "joint-gradient has no FedAvg rounds"),
        ({"stage1_trim_fraction": 0.5}, "stage1-trim-fraction must be in [0, 0.5) (got 0.5)"),
        ({"stage1_byzantine": -1}, "stage1-byzantine and stage1-multikrum-select must be >= 0"),
        (
            {"stage1_aggregation": "bulyan"},
            "bulyan withstands 1 malicious client(s) only among at least 7 (got 5) per round",
        ),
        (
            {"stage1_aggregation": "krum", "clients_per_round": 4},
            "krum withstands 1 malicious client(s) only among at least 5 (got 4)",
        ),
        (
            {"stage1_aggregation": "median", "stage1_byzantine": 3},
            "median withstands 3 malicious client(s) only among at least 7",
        ),
        ({"stage1_aggregation": "trimmed-mean", "stage1_trim_fraction": 0.1}, "cuts 0 of 5 clients at each end"),
        ({"stage1_aggregation": "multikrum", "stage1_multikrum_select": 5}, "stage1-multikrum-select must be at most"),
    ],
)
def test_bad_stage1_aggregation_settings_are_one_line_errors(changes, words) -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig(num_clients=5, **changes).validated()
    message = str(err.value)
    assert words in message and "\n" not in message, message


def test_the_defaults_aggregate_by_fedavg_and_fit_five_clients() -> None:
    cfg = RunConfig()
    assert (cfg.stage1_aggregation, cfg.stage1_byzantine, cfg.stage1_trim_fraction) == ("fedavg", 1, 0.2)
    for rule in ("median", "trimmed-mean", "krum", "multikrum"):  # the default five clients suffice
        assert cfg.replace(stage1_aggregation=rule).stage1_aggregation == rule
    assert cfg.replace(stage1_aggregation="bulyan", num_clients=7).stage1_clients == 7
    assert cfg.replace(initial_clients=3, joining_per_task=1, num_clients=5).stage1_clients == 3


def test_a_folder_written_before_a_knob_existed_matches_a_run_at_that_knob_s_default() -> None:
    """Results of an earlier version record no ``stage1-aggregation``: they are the default's
    (fedavg), and another rule still differs."""
    from fcl_flower.config import RunConfig
    from strategies.checkpoint import differing_keys

    current = RunConfig().result_config()
    saved = {k: v for k, v in current.items() if not k.startswith("stage1-")}
    assert differing_keys(saved, current) == []
    assert differing_keys(saved, RunConfig(stage1_aggregation="median").result_config()) == ["stage1-aggregation"]
