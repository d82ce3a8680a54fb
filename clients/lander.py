"""LANDER client: the current task around the label-text anchors, and distillation of the
previous global model on the server's synthetic images (docs/method_notes_target_lander.md §3.3).

With z, e = logits and anchor embedding of the model, A the label-text anchors (``TrainIns.anchors``):

* task 1: ``CE(z, y) + ltc · bound(e, A[y])``;
* later tasks: ``w_cur · (CE(z[:, C_old:], y - C_old) + ltc · bound(e, A[y]))
  + w_pre · (KD_T=2(z_syn[:, :C_old] ‖ teacher) + MSE(e_syn, e_teacher))``

where ``bound(e, a) = max(0, MSE(e, a) - r)`` and (w_cur, w_pre) LANDER's task-adaptive weights
(:func:`fcl_flower.fcl.generative.lander_loss_weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from clients.generative import BatchLoss, replay_sgd, synthetic_pool
from clients.job import ClientJob
from clients.lwf import server_arrays
from fcl_flower.fcl.distill import frozen_teacher, kd_loss
from fcl_flower.fcl.generative import bounding_loss, lander_loss_weights
from fcl_flower.models import IncrementalClassifier
from fcl_flower.protocol import ProtocolError, TrainRes

KD_TEMPERATURE = 2.0  # [CODE-L] tau


def first_task_loss(anchors: Tensor, num_seen: int, radius: float, ltc: float) -> BatchLoss:
    def loss(model: IncrementalClassifier, images: Tensor, labels: Tensor, syn: Tensor | None) -> dict[str, Tensor]:
        logits, emb = model.forward_with_anchor(images)
        ce = F.cross_entropy(logits[:, :num_seen], labels)
        bound = bounding_loss(emb, anchors[labels], radius)
        return {"loss": ce + ltc * bound, "ce": ce, "bound": bound}

    return loss


def later_task_loss(
    teacher: IncrementalClassifier,
    anchors: Tensor,
    num_old: int,
    num_seen: int,
    radius: float,
    ltc: float,
    weights: tuple[float, float],
) -> BatchLoss:
    w_cur, w_pre = weights

    def loss(model: IncrementalClassifier, images: Tensor, labels: Tensor, syn: Tensor | None) -> dict[str, Tensor]:
        if syn is None:
            raise ValueError("LANDER's later tasks need synthetic images")
        logits, emb = model.forward_with_anchor(images)
        ce = F.cross_entropy(logits[:, num_old:num_seen], labels - num_old)
        bound = bounding_loss(emb, anchors[labels], radius)
        s_logits, s_emb = model.forward_with_anchor(syn)
        with torch.no_grad():
            t_logits, t_emb = teacher.forward_with_anchor(syn)
        kd = kd_loss(s_logits[:, :num_seen], t_logits[:, :num_old], KD_TEMPERATURE)
        feat = F.mse_loss(s_emb, t_emb)
        total = w_cur * (ce + ltc * bound) + w_pre * (kd + feat)
        return {"loss": total, "ce": ce, "bound": bound, "kd": kd, "feature": feat}

    return loss


def anchors_of(job: ClientJob) -> Tensor:
    """The label-text anchors the server sent: (num_classes, anchor_dim), finite."""
    anchors = server_arrays(job, "anchors").get("anchors")
    head = job.model.anchor
    expected = (job.data.shape.num_classes, getattr(head, "out_features", -1))
    if anchors is None or tuple(anchors.shape) != expected or not bool(torch.isfinite(anchors).all()):
        raise ProtocolError(f"LANDER anchors must be a finite {expected} array")
    return anchors.float().to(job.device)


def handle_lander(job: ClientJob) -> TrainRes:
    cfg = job.cfg
    anchors = anchors_of(job)
    num_old = job.task_classes.start
    if job.task == 0 or num_old == 0:
        loss = first_task_loss(anchors, job.num_seen, cfg.lander_radius, cfg.lander_ltc)
        stats = replay_sgd(job, loss, None)
    else:
        teacher = frozen_teacher(job.model, server_arrays(job, "teacher"), job.device)
        assert isinstance(teacher, IncrementalClassifier)
        weights = lander_loss_weights(num_old, job.num_seen, cfg.lander_cur, cfg.lander_pre)
        loss = later_task_loss(teacher, anchors, num_old, job.num_seen, cfg.lander_radius, cfg.lander_ltc, weights)
        stats = replay_sgd(job, loss, synthetic_pool(job))
    return job.train_reply(stats.num_examples, stats.mean_loss)
