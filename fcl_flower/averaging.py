"""FedAvg arithmetic: weighted averages of model states and the per-round learning rate."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch


def average_states(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """Weighted mean of model states, key by key, accumulated in float64.

    Floating tensors (parameters, BatchNorm running statistics) are averaged; integer
    buffers such as ``num_batches_tracked`` are counters, not estimates, so they take the max.
    """
    if not states:
        raise ValueError("nothing to average")
    if len(states) != len(weights):
        raise ValueError("one weight per state is needed")
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative with a positive sum")
    keys = list(states[0].keys())
    for state in states[1:]:
        if list(state.keys()) != keys:
            raise ValueError("states have different keys")
    averaged: dict[str, torch.Tensor] = {}
    for key in keys:
        first = states[0][key]
        if first.is_floating_point():
            acc = torch.zeros_like(first, dtype=torch.float64)
            for state, weight in zip(states, weights):
                acc += state[key].to(torch.float64) * (weight / total)
            averaged[key] = acc.to(first.dtype)
        else:
            averaged[key] = torch.stack([s[key] for s in states]).amax(dim=0)
    return averaged


def cosine_lr(base_lr: float, round_index: int, num_rounds: int) -> float:
    """Learning rate of round ``round_index`` (0-based): CosineAnnealingLR(T_max=R, eta_min=0)
    stepped once per round, as the STSA code does; a fresh optimiser uses it each round."""
    if num_rounds <= 0:
        raise ValueError("num_rounds must be positive")
    return 0.5 * base_lr * (1.0 + math.cos(math.pi * round_index / num_rounds))
