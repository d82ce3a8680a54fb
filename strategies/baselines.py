"""Gradient baselines of the STSA paper's tables: Fed-LwF, Fed-EWC, and a pooled-training bound.

All three share ``finetune``'s schedule (``stage1-rounds`` FedAvg rounds on task 1, then
``rounds-per-task`` rounds per later task, cosine learning rate per round, ``local-epochs`` local
epochs, sample-weighted FedAvg). From task 2 on, ``lwf`` and ``ewc`` clients apply the
cross-entropy to the new task's classes only, as the TARGET/LANDER code does (see
clients/regularised.py), and add their regulariser:

* ``lwf`` (Li & Hoiem 2016, federated as in TARGET/LANDER): from task 2 on, clients add
  ``lwf-alpha · KD`` (temperature ``lwf-temperature``) towards the *teacher*, the global model at
  the end of the previous task. The server keeps the teacher and sends it with every round of
  the task (ArrayRecord ``teacher``, via :meth:`StagedStrategy.extra_arrays`).
* ``ewc`` (Kirkpatrick et al. 2017): after the last training round of every task but the last,
  one extra ``ewc-stats`` round in which clients upload the diagonal Fisher of the global model
  on their data of that task (counted in the stage's upload bytes). The server takes the
  sample-weighted mean, folds it into a class-count-weighted running average over tasks, and
  from then on sends Fisher + anchor (the end-of-task global model) with every training round;
  clients add ``ewc-lambda/2 · Σ F (θ − θ*)²``. Math: :mod:`fcl_flower.fcl.ewc`.
* ``joint-gradient``: the gradient-trained upper bound. No federated rounds: at stage t the
  server trains the same backbone + head, *continuing from the stage t−1 model* (the same
  seeded initialisation at t = 1), on the pooled training data of tasks 1..t, with the same
  per-stage schedule as the federated methods (``stage1-rounds`` or ``rounds-per-task``
  "rounds" of ``local-epochs`` epochs each, fresh SGD each round, the same cosine learning
  rate per round, same batch size, momentum, weight decay and loss). It is FedAvg with a
  single client that holds all data seen so far, i.e. the "centralised, one client" run of the
  STSA code applied stage by stage, so it also yields A_avg and F_T. It replays all old data,
  so it bounds what rehearsal-free methods can reach with this backbone and budget.

Hyper-parameters (spec stsa.md §4.5 names the baselines but gives no values; the STSA code
takes them from the TARGET/LANDER code): LwF T = 2, KD weight 3; EWC λ = 1000 with each
client's Fisher clamped at 1e-4. Differences from that code: the Fisher is that of the
*global* model, aggregated over clients on the server (the code keeps one per client, of its
local model), computed in eval mode without augmentation; the penalty acts on the model being
trained (in the copy of that code we read, the penalty is computed on the global network,
not on the local copy being optimised).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from clients.regularised import ANCHOR_RECORD, FISHER_RECORD, TEACHER_RECORD
from clients.training import local_sgd
from fcl_flower.config import ConfigError
from fcl_flower.fcl.ewc import aggregate_fishers, merge_task_fishers, trainable_parameters
from fcl_flower.models import trainable_state
from fcl_flower.wire import UploadError, cast_for_wire, read_tensor, to_record
from strategies.base import Reply, RoundPlan
from strategies.gradient import FedAvgStrategy


class LwFStrategy(FedAvgStrategy):
    """Fed-LwF: FedAvg + distillation from the previous task's global model."""

    name: ClassVar[str] = "lwf"
    later_phase: ClassVar[str] = "lwf"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.cfg.lwf_alpha < 0:
            raise ConfigError(f"lwf-alpha must be >= 0 (got {self.cfg.lwf_alpha})")
        if self.cfg.lwf_temperature <= 0:
            raise ConfigError(f"lwf-temperature must be > 0 (got {self.cfg.lwf_temperature})")
        self.teacher: dict[str, torch.Tensor] | None = None

    def end_stage(self, task: int) -> dict[str, Any]:
        extra = super().end_stage(task)
        self.teacher = trainable_state(self.model)  # the teacher of the next task
        return extra

    def extra_arrays(self, plan: RoundPlan) -> dict[str, ArrayRecord]:
        if plan.phase != self.later_phase:
            return {}
        if self.teacher is None:
            raise RuntimeError("LwF round planned before any task ended: no teacher")
        return {TEACHER_RECORD: to_record(self.teacher)}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "teacher": self.teacher}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.teacher = state["teacher"]


class EWCStrategy(FedAvgStrategy):
    """Fed-EWC: FedAvg + a Fisher-weighted penalty; the Fisher is aggregated over clients."""

    name: ClassVar[str] = "ewc"
    later_phase: ClassVar[str] = "ewc"
    stats_phase: ClassVar[str] = "ewc-stats"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.cfg.ewc_lambda < 0:
            raise ConfigError(f"ewc-lambda must be >= 0 (got {self.cfg.ewc_lambda})")
        if self.cfg.ewc_fisher_max < 0:
            raise ConfigError(f"ewc-fisher-max must be >= 0 (got {self.cfg.ewc_fisher_max})")
        self.fisher: dict[str, torch.Tensor] | None = None  # float64, running average over tasks
        self.anchor: dict[str, torch.Tensor] | None = None  # θ*: global parameters at the last task end

    def plan_stage(self, task: int) -> list[RoundPlan]:
        plans = super().plan_stage(task)
        if task < self.num_tasks - 1:  # the last task's Fisher would never be used
            plans.append(RoundPlan(task, self.stats_phase))
        return plans

    def parse_reply(self, plan: RoundPlan, content: RecordDict) -> Any:
        if plan.phase != self.stats_phase:
            return super().parse_reply(plan, content)
        if "arrays" not in content.array_records:
            raise UploadError("reply has no 'arrays' record")
        record = content.array_records["arrays"]
        expected = trainable_parameters(self.model)
        unexpected = sorted(set(record) - set(expected))
        if unexpected:
            raise UploadError(f"Fisher has unknown parameter(s): {', '.join(unexpected[:3])}")
        return {
            key: read_tensor(record, key, shape=tuple(p.shape), floating=True, nonnegative=True).to(torch.float64)
            for key, p in expected.items()
        }

    def aggregate_round(self, plan: RoundPlan, replies: list[Reply]) -> None:
        if plan.phase != self.stats_phase:
            super().aggregate_round(plan, replies)
            return
        weights = [float(r.num_examples) for r in replies]
        if sum(weights) == 0:
            weights = [1.0] * len(replies)
        task_fisher = aggregate_fishers([r.payload for r in replies], weights)
        previous = self.split.classes_through(plan.task - 1) if plan.task > 0 else 0  # task pool: per client
        self.fisher = merge_task_fishers(self.fisher, task_fisher, previous, self.split.classes_through(plan.task))
        self.anchor = {k: p.detach().cpu().clone() for k, p in trainable_parameters(self.model).items()}

    def extra_arrays(self, plan: RoundPlan) -> dict[str, ArrayRecord]:
        if plan.phase != self.later_phase:
            return {}
        if self.fisher is None or self.anchor is None:
            raise RuntimeError("EWC round planned before any Fisher was aggregated")
        return {
            FISHER_RECORD: to_record({k: cast_for_wire(v, self.cfg.wire_dtype) for k, v in self.fisher.items()}),
            ANCHOR_RECORD: to_record(self.anchor),
        }

    def end_stage(self, task: int) -> dict[str, Any]:
        extra = super().end_stage(task)
        if self.fisher is not None:
            values = torch.cat([v.flatten() for v in self.fisher.values()])
            extra["fisher"] = {"mean": float(values.mean()), "max": float(values.max())}
        return extra

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "fisher": self.fisher, "anchor": self.anchor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.fisher, self.anchor = state["fisher"], state["anchor"]


class JointGradientStrategy(FedAvgStrategy):
    """Upper bound: the same model and schedule, trained on the server on all seen data pooled."""

    name: ClassVar[str] = "joint-gradient"

    def plan_stage(self, task: int) -> list[RoundPlan]:
        return []  # no federated round: end_stage trains centrally

    def stage_rounds(self, task: int) -> int:
        return self.cfg.stage1_rounds if task == 0 else self.cfg.rounds_per_task

    def end_stage(self, task: int) -> dict[str, Any]:
        seen = self.num_seen(task)
        train = self.split.bundle.train
        pooled = train.subset(np.flatnonzero(train.targets < seen))  # tasks 1..t, training transform
        rounds = self.stage_rounds(task)
        losses = []
        for plan in self.train_plans(task, "central", rounds):
            seed = (self.cfg.seed * 100_003 + task * 1_000 + plan.index) * 1_009 + self.cfg.num_clients
            stats = local_sgd(self.model, pooled, self.cfg, lr=plan.lr, num_seen=seen,
                              device=self.device, seed=seed)
            losses.append(stats.mean_loss)
        extra = super().end_stage(task)
        extra.update({"pooled": True, "num_samples": len(pooled), "central_rounds": rounds,
                      "epochs": rounds * self.cfg.local_epochs,
                      "final_train_loss": losses[-1] if losses else None})
        return extra
