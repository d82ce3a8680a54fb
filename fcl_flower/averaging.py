"""The per-round learning rate of the FedAvg rounds (the averaging itself is Flower's: strategies/fedavg.py)."""

from __future__ import annotations

import math


def cosine_lr(base_lr: float, round_index: int, num_rounds: int) -> float:
    """Learning rate of round ``round_index`` (0-based): CosineAnnealingLR(T_max=R, eta_min=0)
    stepped once per round, as the STSA code does; a fresh optimiser uses it each round."""
    if num_rounds <= 0:
        raise ValueError("num_rounds must be positive")
    return 0.5 * base_lr * (1.0 + math.cos(math.pi * round_index / num_rounds))
