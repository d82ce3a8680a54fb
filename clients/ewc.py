"""Fed-EWC client: local SGD with a Fisher-weighted pull towards the previous task's global model,
and the diagonal Fisher of the global model on this client's data after each task.

* phase ``ewc``: ``+ λ/2 Σ F (θ − θ*)²`` on top of LwF's new-task cross-entropy (clients/lwf.py);
  the aggregated Fisher and the anchor θ* arrive with every message
  (:attr:`TrainIns.ewc_fisher`, :attr:`TrainIns.ewc_anchor`).
* phase ``ewc-stats``: after a task's last round, the diagonal Fisher of the received global
  model on this client's data of that task (eval mode, test-time transforms, cross-entropy over
  the seen classes), uploaded like any other statistic so its bytes are counted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clients.fedavg import train_locally
from clients.job import ClientJob
from clients.lwf import new_task_ce_from, server_arrays
from fcl_flower.fcl.ewc import diagonal_fisher, ewc_penalty, trainable_parameters
from fcl_flower.fcl.training import ExtraLoss
from fcl_flower.models import IncrementalClassifier
from fcl_flower.protocol import StatsRes, TrainRes
from fcl_flower.runtime import make_loader
from fcl_flower.tensors import cast_for_wire, tensor_record


def ewc_extra_loss(
    fisher: dict[str, torch.Tensor], anchor: dict[str, torch.Tensor], lam: float, device: torch.device
) -> ExtraLoss:
    """``λ/2 Σ F (θ − θ*)²`` over the model's trainable parameters (a constant w.r.t. the batch)."""
    fisher = {k: v.to(device=device, dtype=torch.float32) for k, v in fisher.items()}
    anchor = {k: v.to(device=device, dtype=torch.float32) for k, v in anchor.items()}

    def loss(
        model: IncrementalClassifier, images: torch.Tensor, labels: torch.Tensor, logits_seen: torch.Tensor
    ) -> torch.Tensor:
        return ewc_penalty(trainable_parameters(model), fisher, anchor, lam)

    return loss


def handle_ewc(job: ClientJob) -> TrainRes:
    """Local SGD with the Fisher-weighted pull towards the previous task's global model."""
    fisher, anchor = server_arrays(job, "ewc_fisher"), server_arrays(job, "ewc_anchor")
    return train_locally(job, ewc_extra_loss(fisher, anchor, job.cfg.ewc_lambda, job.device), new_task_ce_from(job))


def local_fisher(job: ClientJob) -> dict[str, torch.Tensor]:
    """Diagonal Fisher of the received global model on this client's data of the task."""
    model, device, num_seen = job.model.to(job.device).eval(), job.device, job.num_seen

    def cross_entropy(m: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(images.to(device))[:, :num_seen], labels.to(device))

    batches = make_loader(job.local_data(eval_transform=True), job.cfg, shuffle=False)
    max_value = job.cfg.ewc_fisher_max if job.cfg.ewc_fisher_max > 0 else None
    return diagonal_fisher(model, batches, cross_entropy, max_value=max_value)


def handle_fisher(job: ClientJob) -> StatsRes:
    fisher = local_fisher(job)
    arrays = tensor_record({k: cast_for_wire(v, job.cfg.wire_dtype) for k, v in fisher.items()})
    return job.stats_reply(len(job.local_data(eval_transform=True)), arrays=arrays)
