"""TARGET client: cross-entropy on the new task's classes + KD from the previous global model on
the server's synthetic images (docs/method_notes_target_lander.md §2.3).

Per batch: ``CE(z[:, C_old:], y - C_old) + kd-weight · KD_T=2(z_syn[:, :C_old] ‖ teacher(x_syn)[:, :C_old])``
with z the logits over the seen classes, x_syn a synthetic batch. The KD is
:func:`fcl_flower.fcl.distill.kd_loss` (the KL form of the code's soft cross-entropy: same
gradient, 0 when student and teacher agree). Task 1 is plain FedAvg (clients/fedavg.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clients.generative import BatchLoss, replay_sgd, synthetic_pool
from clients.job import ClientJob
from clients.lwf import server_arrays
from fcl_flower.fcl.distill import frozen_teacher, kd_loss
from fcl_flower.models import IncrementalClassifier
from fcl_flower.protocol import TrainRes

KD_TEMPERATURE = 2.0  # [CODE-T] _KD_loss(..., 2)


def target_loss(teacher: nn.Module, num_old: int, num_seen: int, kd_weight: float) -> BatchLoss:
    def loss(model: IncrementalClassifier, images: Tensor, labels: Tensor, syn: Tensor | None) -> dict[str, Tensor]:
        if syn is None:
            raise ValueError("TARGET's later tasks need synthetic images")
        logits = model(images)[:, :num_seen]
        ce = F.cross_entropy(logits[:, num_old:], labels - num_old)
        with torch.no_grad():
            old = teacher(syn)[:, :num_old]
        kd = kd_loss(model(syn)[:, :num_seen], old, KD_TEMPERATURE)
        return {"loss": ce + kd_weight * kd, "ce": ce, "kd": kd}

    return loss


def handle_target(job: ClientJob) -> TrainRes:
    teacher = frozen_teacher(job.model, server_arrays(job, "teacher"), job.device)
    num_old = job.task_classes.start
    stats = replay_sgd(job, target_loss(teacher, num_old, job.num_seen, job.cfg.kd_weight), synthetic_pool(job))
    return job.train_reply(stats.num_examples, stats.mean_loss)
