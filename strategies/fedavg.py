"""FedAvg as a component: reading clients' model states and averaging them into the global model.

Stage 1 of every analytic method and every round of the gradient methods use it (spec: the
STSA method notes, docs/methods/stsa.md §2.2): sample-weighted averaging (``weighted-fedavg``)
of the trainable parameters and BatchNorm statistics; a round whose clients report no examples
at all falls back to the plain mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fcl_flower.averaging import average_states
from fcl_flower.models import load_trainable_state, trainable_state
from fcl_flower.protocol import Reply, TrainRes, UploadError
from fcl_flower.protocol.payloads import read_state


def fedavg_weights(num_examples: Sequence[int], weighted: bool) -> list[float]:
    weights = [float(n) if weighted else 1.0 for n in num_examples]
    return weights if sum(weights) > 0 else [1.0] * len(weights)


class FedAvg:
    def __init__(self, model: nn.Module, weighted: bool) -> None:
        self.model = model
        self.weighted = weighted

    def read(self, reply: Reply) -> dict[str, torch.Tensor]:
        """A client's trainable state, with exactly the global model's keys and shapes."""
        if not isinstance(reply, TrainRes):
            raise UploadError("expected a training reply")
        return read_state(reply.model, trainable_state(self.model))

    def average(
        self, states: Sequence[dict[str, torch.Tensor]], num_examples: Sequence[int]
    ) -> dict[str, torch.Tensor]:
        return average_states(list(states), fedavg_weights(num_examples, self.weighted))

    def aggregate(self, states: Sequence[dict[str, torch.Tensor]], num_examples: Sequence[int]) -> None:
        load_trainable_state(self.model, self.average(states, num_examples))
