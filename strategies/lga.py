"""LGA (Dong et al., "No One Left Behind", TPAMI 2024) as a Flower strategy.

Global server: sample-weighted FedAvg of the clients' models, every round of every task (the
clients train with LGA's own loss from task 1 on; phase ``lga``, see clients/lga.py).

Proxy server (lives in this strategy object, as the method notes' Part C suggest (docs/methods/lga_stamp.md)):

* In a client's first round of a task it uploads, per new class, the gradient of the shared
  LeNet Γ on its perturbed prototype (ArrayRecord ``lga-proto``). The proxy infers the label by
  iDLG, checks it against the declared class, and reconstructs one image per (class, client)
  by L-BFGS gradient inversion (Eq. 10), capped at ``proxy-iterations`` steps. The
  reconstructions of all tasks so far form the monitor set; Eq. 12 updates ω.
* After every aggregation it scores the new global model on the Eq. 11 augmented features of
  the monitor set and keeps the best model of the task (:class:`BestOldModelTracker`). At the
  end of task t that model becomes the old model Θ^t every client distils from during task t+1
  (ArrayRecord ``lga-old-model``, sent with every round of the task; clients cache it).
* ``proxy-iterations = 0`` switches the proxy off (the paper's cheaper w/oPSR variant): the old
  model is the last global model of the previous task and no prototype gradients are sent.

Results extras per stage: the proxy's reconstructions, their inversion losses, iDLG label
accuracy, the selected model's round and score, and the Eq. 8 detector's agreement with the
server's task id (hits / misses / false alarms).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.fcl.lga_proxy import (
    BestOldModelTracker,
    class_feature_variance,
    gradient_encoder,
    infer_label,
    invert_gradients,
    score_old_model,
    update_omega,
)
from fcl_flower.models import trainable_state
from fcl_flower.protocol import Instruction, Reply, TrainIns, TrainRes, UploadError
from fcl_flower.protocol.payloads import read_prototypes
from fcl_flower.results import ResultsRecorder
from fcl_flower.tensors import tensor_record
from strategies.base import Accepted, RoundPlan
from strategies.gradient import GradientStrategy

XI, NUM_AUG = 0.1, 5  # Eq. 11 radius and augmentations per image (paper)


class LGAStrategy(GradientStrategy):
    """FedAvg of LGA-trained clients + the proxy's best-old-model selection."""

    first_phase = "lga"
    later_phase = "lga"

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        if self.cfg.proxy_iterations < 0:
            raise ConfigError(f"proxy-iterations must be >= 0 (got {self.cfg.proxy_iterations})")
        self.encoder = gradient_encoder(self.split.image_shape, self.split.num_classes, self.cfg.seed)
        self.encoder_shapes = [tuple(p.shape) for p in self.encoder.parameters()]
        self.teacher: dict[str, torch.Tensor] | None = None
        self.tracker: BestOldModelTracker[dict[str, torch.Tensor]] = BestOldModelTracker()
        self.monitor_images = torch.zeros(0, *self.split.image_shape)
        self.monitor_labels = torch.zeros(0, dtype=torch.int64)
        self.omega = 0.0
        self._stage_log: dict[str, Any] = {}

    # ---------------------------------------------------------------- messages
    def customise(self, plan: RoundPlan, ins: Instruction) -> Instruction:
        if plan.task == 0:
            return ins
        if self.teacher is None:
            raise RuntimeError("LGA round of a later task planned before any task ended: no old model")
        assert isinstance(ins, TrainIns)
        return dataclasses.replace(ins, old_model=tensor_record(self.teacher))

    # ---------------------------------------------------------------- replies
    def read_reply(self, plan: RoundPlan, reply: Reply) -> dict[str, Any]:
        state = super().read_reply(plan, reply)
        assert isinstance(reply, TrainRes)
        report = reply.lga
        if report is None:
            raise UploadError("LGA reply without its report")
        protos: dict[int, list[torch.Tensor]] = {}
        if report.prototypes is not None:
            protos = read_prototypes(report.prototypes, self.split.tasks[plan.task], self.encoder_shapes)
        return {"state": state, "protos": protos, "detected": int(report.detected), "new-task": int(report.new_task)}

    def aggregate_round(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        self.fedavg.aggregate([r.payload["state"] for r in replies], [r.num_examples for r in replies])
        log = self._stage_log
        for r in replies:  # Eq. 8 detector vs the server's task id
            d, n = r.payload["detected"], r.payload["new-task"]
            key = "hits" if d and n else "misses" if n else "false_alarms" if d else "quiet"
            log.setdefault("detector", {"hits": 0, "misses": 0, "false_alarms": 0, "quiet": 0})[key] += 1
        if self.cfg.proxy_iterations == 0:
            return
        self._reconstruct(plan, replies)
        if len(self.monitor_labels):
            score = score_old_model(
                self.model.eval(),
                self.monitor_images.to(self.device),
                self.monitor_labels,
                omega=self.omega,
                xi=XI,
                num_aug=NUM_AUG,
                seed=self.cfg.seed,
                num_seen=self.num_seen(plan.task),
            )
            if self.tracker.offer(score, trainable_state(self.model)):
                log["selected_round"], log["selected_score"] = plan.index + 1, score
            log.setdefault("scores", []).append(score)

    def _reconstruct(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        """Eqs. 9-10 per (class, client) with iDLG labels; Eq. 12's ω from the new classes."""
        log = self._stage_log
        images: list[torch.Tensor] = []
        labels: list[int] = []
        losses: list[tuple[float, float]] = []
        label_ok = 0
        for r in replies:
            for cls, grads in sorted(r.payload["protos"].items()):
                inferred = infer_label(grads)
                label_ok += int(inferred == cls)
                gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + cls * 31 + len(losses))
                result = invert_gradients(
                    self.encoder,
                    grads,
                    inferred,
                    self.split.image_shape,
                    iterations=self.cfg.proxy_iterations,
                    generator=gen,
                )
                images.append(result.images[-1:].detach().cpu())
                labels.append(inferred)  # the proxy only knows the inferred label; mismatches are counted
                losses.append((result.initial_loss, result.final_loss))
        if not images:
            return
        new_images, new_labels = torch.cat(images), torch.tensor(labels, dtype=torch.int64)
        with torch.no_grad():
            feats = self.model.eval().features(new_images.to(self.device)).double().cpu()
        var = class_feature_variance(feats, new_labels)
        num_old = int(torch.unique(self.monitor_labels).numel())
        traces = [float(v.sum()) for v in var.values()]
        self.omega = update_omega(self.omega, num_old, traces, feats.shape[1])
        self.monitor_images = torch.cat([self.monitor_images, new_images])
        self.monitor_labels = torch.cat([self.monitor_labels, new_labels])
        log["reconstructions"] = log.get("reconstructions", 0) + len(images)
        log["idlg_label_correct"] = log.get("idlg_label_correct", 0) + label_ok
        log.setdefault("inversion_loss", []).extend({"initial": a, "final": b} for a, b in losses)
        log["omega"] = self.omega

    # ---------------------------------------------------------------- stage end
    def end_stage(self, task: int) -> dict[str, Any]:
        extra = super().end_stage(task)
        if self.cfg.proxy_iterations > 0 and self.tracker.current is not None:
            self.teacher = self.tracker.current
            extra["old_model"] = "proxy-selected"
        else:
            self.teacher = trainable_state(self.model)
            extra["old_model"] = "last-global"
        self.tracker.start_new_task()
        inv = self._stage_log.pop("inversion_loss", [])
        if inv:
            self._stage_log["inversion_loss_mean"] = {
                "initial": float(np.mean([x["initial"] for x in inv])),
                "final": float(np.mean([x["final"] for x in inv])),
            }
        extra.update({"lga": self._stage_log, "monitor_set": len(self.monitor_labels)})
        self._stage_log = {}
        return extra

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "teacher": self.teacher,
            "omega": self.omega,
            "monitor_images": self.monitor_images,
            "monitor_labels": self.monitor_labels,
            "tracker": (self.tracker.previous, self.tracker.current, self.tracker.best_score),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.teacher, self.omega = state["teacher"], float(state["omega"])
        self.monitor_images, self.monitor_labels = state["monitor_images"], state["monitor_labels"]
        self.tracker.previous, self.tracker.current, best = state["tracker"]
        self.tracker.best_score = -math.inf if best is None else float(best)
