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

from typing import Any, ClassVar

import torch

from fcl_flower.averaging import average_states
from fcl_flower.config import ConfigError
from fcl_flower.fcl.stamp import gradient_match_result
from fcl_flower.models import load_trainable_state, trainable_state
from strategies.base import Reply, RoundPlan
from strategies.gradient import FedAvgStrategy


class STAMPStrategy(FedAvgStrategy):
    name: ClassVar[str] = "stamp"
    later_phase: ClassVar[str] = "stamp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.cfg.gm_c >= 0:
            raise ConfigError(f"gm-c must be >= 0 (got {self.cfg.gm_c})")
        self._gaps: list[float] = []

    def plan_stage(self, task: int) -> list[RoundPlan]:
        rounds = self.cfg.stage1_rounds if task == 0 else self.cfg.rounds_per_task
        return self.train_plans(task, self.later_phase, rounds)

    def parameter_keys(self) -> list[str]:
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    def aggregate_round(self, plan: RoundPlan, replies: list[Reply]) -> None:
        weights = [float(r.num_examples) if self.cfg.weighted_fedavg else 1.0 for r in replies]
        if sum(weights) == 0:
            weights = [1.0] * len(replies)
        merged = average_states([r.payload for r in replies], weights)  # buffers: FedAvg
        glob = trainable_state(self.model)
        keys = self.parameter_keys()
        base = torch.cat([glob[k].reshape(-1).to(torch.float64) for k in keys])
        deltas = torch.stack([torch.cat([r.payload[k].reshape(-1).to(torch.float64) for k in keys]) - base
                              for r in replies])
        result = gradient_match_result(deltas, self.cfg.gm_c, weights=torch.tensor(weights, dtype=torch.float64))
        self._gaps.append(result.gap)
        new = base + result.direction
        offset = 0
        for k in keys:
            n = glob[k].numel()
            merged[k] = new[offset:offset + n].reshape(glob[k].shape).to(glob[k].dtype)
            offset += n
        load_trainable_state(self.model, merged)

    def end_stage(self, task: int) -> dict[str, Any]:
        extra = super().end_stage(task)
        if self._gaps:
            extra["sam_max_duality_gap"] = max(self._gaps)
        self._gaps = []
        return extra
