"""STAMP (spatio-temporal gradient matching with a prototypical coreset) as a Flower strategy.

Clients (phase ``stamp``, every round of every task; clients/stamp.py) train with CE + ProtoNet
and apply temporal gradient matching over their coreset's old tasks. The server replaces
FedAvg's mean with spatial gradient matching (SAM, Eq. 5): the client deltas
``Δ_u = θ_u − θ`` of the trainable parameters are combined by the CAGrad operator (radius
``gm-c``, FedAvg sample weights for g0 when ``weighted-fedavg``) and ``θ ← θ + d`` (server
η = 1). Normalisation statistics (BatchNorm buffers) are not parameters and keep FedAvg's
weighted mean. With ``gm-c = 0`` the server is exactly FedAvg.
"""

from __future__ import annotations

from typing import Any

import torch

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.fcl.stamp import gradient_match_result
from fcl_flower.models import load_trainable_state, trainable_state
from fcl_flower.results import ResultsRecorder
from strategies.base import Accepted, RoundPlan
from strategies.fedavg import fedavg_weights
from strategies.gradient import GradientStrategy


class STAMPStrategy(GradientStrategy):
    first_phase = "stamp"
    later_phase = "stamp"

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        if not cfg.gm_c >= 0:
            raise ConfigError(f"gm-c must be >= 0 (got {cfg.gm_c})")
        self._gaps: list[float] = []

    def parameter_keys(self) -> list[str]:
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    def aggregate_round(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        weights = fedavg_weights([r.num_examples for r in replies], self.cfg.weighted_fedavg)
        merged = self.fedavg.average([r.payload for r in replies], [r.num_examples for r in replies])  # buffers
        glob = trainable_state(self.model)
        keys = self.parameter_keys()
        base = torch.cat([glob[k].reshape(-1).to(torch.float64) for k in keys])
        deltas = torch.stack(
            [torch.cat([r.payload[k].reshape(-1).to(torch.float64) for k in keys]) - base for r in replies]
        )
        result = gradient_match_result(deltas, self.cfg.gm_c, weights=torch.tensor(weights, dtype=torch.float64))
        self._gaps.append(result.gap)
        new = base + result.direction
        offset = 0
        for k in keys:
            n = glob[k].numel()
            merged[k] = new[offset : offset + n].reshape(glob[k].shape).to(glob[k].dtype)
            offset += n
        load_trainable_state(self.model, merged)

    def end_stage(self, task: int) -> dict[str, Any]:
        extra = super().end_stage(task)
        if self._gaps:
            extra["sam_max_duality_gap"] = max(self._gaps)
        self._gaps = []
        return extra
