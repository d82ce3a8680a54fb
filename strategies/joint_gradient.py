"""``joint-gradient``, the gradient-trained upper bound: no federated rounds.

At stage t the server trains the same backbone + head, *continuing from the stage t−1 model*
(the same seeded initialisation at t = 1), on the pooled training data of tasks 1..t, with the
same per-stage schedule as the federated methods (``stage1-rounds`` or ``rounds-per-task``
"rounds" of ``local-epochs`` epochs each, fresh SGD each round, the same cosine learning rate
per round, same batch size, momentum, weight decay and loss). It is FedAvg with a single client
that holds all data seen so far, i.e. the "centralised, one client" run of the STSA code applied
stage by stage, so it also yields A_avg and F_T. It replays all old data, so it bounds what
rehearsal-free methods can reach with this backbone and budget.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fcl_flower.averaging import cosine_lr
from fcl_flower.fcl.training import local_sgd
from strategies.base import RoundPlan
from strategies.gradient import GradientStrategy


class JointGradientStrategy(GradientStrategy):
    def plan_stage(self, task: int) -> list[RoundPlan]:
        return []  # no federated round: end_stage trains centrally

    def end_stage(self, task: int) -> dict[str, Any]:
        seen = self.num_seen(task)
        train = self.split.bundle.train
        pooled = train.subset(np.flatnonzero(train.targets < seen))  # tasks 1..t, training transform
        rounds = self.stage_rounds(task)
        losses = []
        for i in range(rounds):
            seed = (self.cfg.seed * 100_003 + task * 1_000 + i) * 1_009 + self.cfg.num_clients
            stats = local_sgd(
                self.model,
                pooled,
                self.cfg,
                lr=cosine_lr(self.cfg.lr, i, rounds),
                num_seen=seen,
                device=self.device,
                seed=seed,
            )
            losses.append(stats.mean_loss)
        extra = super().end_stage(task)
        extra.update(
            {
                "pooled": True,
                "num_samples": len(pooled),
                "central_rounds": rounds,
                "epochs": rounds * self.cfg.local_epochs,
                "final_train_loss": losses[-1] if losses else None,
            }
        )
        return extra
