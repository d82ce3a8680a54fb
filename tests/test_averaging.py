"""FedAvg arithmetic: weighted state averages (Flower's, strategies/fedavg.py) and the per-round cosine learning rate."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fcl_flower.averaging import cosine_lr
from strategies.fedavg import average_states
from tests.conftest import build, small_config


def _state(seed: int, batches: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(4, 3, 3, 3, generator=g),
        "bn.running_var": torch.rand(4, generator=g) + 0.5,
        "bn.num_batches_tracked": torch.tensor(batches, dtype=torch.long),
        "head.weight": torch.randn(5, 4, generator=g, dtype=torch.float64),
    }


def test_weighted_mean_equals_manual_computation() -> None:
    states = [_state(0, 3), _state(1, 7), _state(2, 5)]
    weights = [10, 30, 60]
    averaged = average_states(states, weights)
    assert list(averaged) == list(states[0])
    for key in ("conv.weight", "bn.running_var", "head.weight"):
        manual = sum(w * s[key].double() for w, s in zip(weights, states)) / sum(weights)
        assert averaged[key].dtype == states[0][key].dtype  # dtype kept
        assert torch.allclose(averaged[key].double(), manual, rtol=1e-6 if key != "head.weight" else 1e-12, atol=0)
    # integer buffers are counters: the max, not a weighted mean
    assert averaged["bn.num_batches_tracked"].dtype == torch.long
    assert int(averaged["bn.num_batches_tracked"]) == 7


def test_mean_properties() -> None:
    a, b = _state(0, 1), _state(1, 1)
    equal = average_states([a, b], [1.0, 1.0])
    assert torch.allclose(equal["conv.weight"], (a["conv.weight"] + b["conv.weight"]) / 2)
    # scaling all weights changes nothing; order of clients changes nothing (up to rounding)
    scaled = average_states([a, b], [5.0, 5.0])
    swapped = average_states([b, a], [1.0, 1.0])
    for key in a:
        assert torch.allclose(scaled[key], equal[key], rtol=1e-7)
        assert torch.allclose(swapped[key], equal[key], rtol=1e-7)
    # a zero weight drops a client; a single state is returned as is
    only_a = average_states([a, b], [2.0, 0.0])
    assert torch.equal(only_a["conv.weight"], a["conv.weight"])
    assert torch.equal(average_states([b], [3.0])["head.weight"], b["head.weight"])


def test_bad_inputs() -> None:
    a, b = _state(0, 1), _state(1, 1)
    c = dict(b)
    c.pop("head.weight")
    with pytest.raises(ValueError, match="different keys"):
        average_states([a, c], [1, 1])
    c["other.weight"] = b["head.weight"]
    with pytest.raises(ValueError, match="different keys"):
        average_states([a, c], [1, 1])
    with pytest.raises(ValueError, match="nothing"):
        average_states([], [])
    with pytest.raises(ValueError, match="one weight per state"):
        average_states([a, b], [1])
    with pytest.raises(ValueError, match="non-negative"):
        average_states([a, b], [1, -1])
    with pytest.raises(ValueError, match="positive sum"):
        average_states([a, b], [0, 0])


def _torch_schedule(base_lr: float, rounds: int) -> list[float]:
    """CosineAnnealingLR(T_max=rounds, eta_min=0) read before each of ``rounds`` steps."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimiser = torch.optim.SGD([param], lr=base_lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=rounds, eta_min=0.0)
    lrs = []
    for _ in range(rounds):
        lrs.append(optimiser.param_groups[0]["lr"])
        optimiser.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("rounds", [1, 2, 5, 10, 50])
def test_cosine_lr_matches_torch_cosine_annealing(rounds: int) -> None:
    base = 0.05
    expected = _torch_schedule(base, rounds)
    ours = [cosine_lr(base, i, rounds) for i in range(rounds)]
    assert ours == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert ours[0] == base  # round 0: the full rate
    if rounds % 2 == 0:
        assert ours[rounds // 2] == pytest.approx(base / 2, rel=1e-12)  # midway: half
    last = base * (1 + math.cos(math.pi * (rounds - 1) / rounds)) / 2  # closed form, > 0
    assert ours[-1] == pytest.approx(last, rel=1e-12) and ours[-1] > 0
    assert all(x > y for x, y in itertools.pairwise(ours))  # strictly decreasing


def test_cosine_lr_bad_rounds() -> None:
    with pytest.raises(ValueError):
        cosine_lr(0.1, 0, 0)


def test_strategy_rounds_carry_the_cosine_schedule(tmp_path) -> None:
    """What the clients receive per round is the torch schedule of the configured lr."""
    strategy = build(small_config(tmp_path, strategy="finetune", lr=0.1, stage1_rounds=4, rounds_per_task=3))
    plans = strategy.plan_stage(0)
    assert [p.lr for p in plans] == pytest.approx(_torch_schedule(0.1, 4), rel=1e-9)
    assert [(p.index, p.total, p.phase) for p in plans] == [(i, 4, "fedavg") for i in range(4)]
    assert [p.lr for p in strategy.plan_stage(1)] == pytest.approx(_torch_schedule(0.1, 3), rel=1e-9)
