"""Stage-1 FedAvg under secure aggregation as a component: masked uploads in, the opened average out.

With ``secure-aggregation`` every stage-1 FedAvg round is a secure round
(:class:`~strategies.secure.SecureRounds`: keys, shares, the masked ``train`` upload, unmasking).
A reply carries only the masked fixed-point vector of (n_k · w_k, n_k)
(:class:`~fcl_flower.protocol.payloads.MaskedFedAvgState`; fcl_flower/privacy/secure_fedavg.py
has the encoding and the quantisation bound): the server reads ring elements, adds them mod 2⁶⁴
as they arrive and drops them, and opens only the sum over the round's survivors; the average
Σ n_k w_k / Σ n_k is loaded into the global model. A plain train reply (a clear state), one that
reports its sample count or loss in clear, or one whose arrays do not have the state's length is
refused by name, like a dropout: its self-mask stays, so it is never read.
"""

from __future__ import annotations

from collections.abc import Callable
from logging import WARNING
from typing import Any

import numpy as np
from flwr.common.logger import log
from torch import nn

from fcl_flower.models import load_trainable_state, trainable_state
from fcl_flower.privacy.secagg import add_ring
from fcl_flower.privacy.secure_fedavg import COUNT, WEIGHTS, opened_average, state_length
from fcl_flower.protocol import Reply, TrainRes, UploadError
from fcl_flower.protocol.payloads import MaskedFedAvgState
from strategies.base import Accepted

Opener = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]  # ring sums -> opened float64 sums


class MaskedFedAvg:
    def __init__(self, model: nn.Module, weighted: bool) -> None:
        self.model = model
        self.weighted = weighted
        self.length = state_length(trainable_state(model))
        self.opened_examples = 0  # N of the last opened round (the only per-round figure the server learns)

    def read(self, reply: Reply) -> dict[str, np.ndarray]:
        """One masked upload's ring elements (read in place, never decoded)."""
        if not isinstance(reply, TrainRes):
            raise UploadError("expected a training reply")
        if reply.num_examples != 0 or reply.loss != 0.0:
            raise UploadError(
                "a masked upload reports num-examples or train-loss in clear; under secure aggregation the "
                "count rides inside the mask and both must be 0"
            )
        masked = MaskedFedAvgState.read(reply.model, length=self.length)
        return {WEIGHTS: masked.weights, COUNT: masked.count}

    def fold(self, open_sum: Opener) -> MaskedFedAvgFold:
        return MaskedFedAvgFold(self, open_sum)

    def load(self, opened: dict[str, np.ndarray], survivors: int) -> None:
        """Load Σ n_k w_k / Σ n_k (raises OpenedSumRejected where the opened count is impossible)."""
        state, examples = opened_average(opened, survivors, self.weighted, trainable_state(self.model))
        self.opened_examples = examples
        if state is None:
            log(WARNING, "the opened secure FedAvg sum counts no examples: the model is left as it was")
            return
        load_trainable_state(self.model, state)


class MaskedFedAvgFold:
    """Adds each accepted masked upload into the round's ring sums (mod 2⁶⁴, exact and order-free);
    :meth:`finish` opens them once the unmask step has rebuilt the secrets."""

    def __init__(self, component: MaskedFedAvg, open_sum: Opener) -> None:
        self.component, self.open_sum = component, open_sum
        self.sums: dict[str, np.ndarray] = {}
        self.clients: set[str] = set()

    def add(self, item: Accepted[Any]) -> None:
        for name, ring in item.payload.items():
            add_ring(self.sums, name, ring)
        self.clients.add(item.client)

    def finish(self) -> None:
        self.component.load(self.open_sum(self.sums), len(self.clients))
