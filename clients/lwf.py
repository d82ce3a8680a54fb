"""Fed-LwF client: local SGD with distillation from the previous task's global model.

Training uses the ``finetune`` client's loop (``local_sgd``: same optimiser, schedule and
batches). As in the TARGET/LANDER code the STSA paper's baseline numbers come from, from the
second task on the cross-entropy covers the *new task's classes only* (:func:`new_task_ce_from`);
the old classes are kept by the regulariser alone. With the all-seen-classes cross-entropy of
``finetune`` the new data pushes every old logit down, and LwF forgets as much as finetune
(digits, 5 tasks, 5 clients, β = 0.5, seed 0: A_T 15.1 vs 15.3); with the new-class
cross-entropy its A_T is 22.4. In STAMP's limitless task pool (``partition = task-pool``) a
client's task is a scattered set of classes on one head over all classes, so the cross-entropy
covers the whole head there and LwF distils every logit of the previous task's global model.

The loss adds ``α · KD(teacher ‖ student)`` on the old classes, temperature T. The teacher (the
global model at the end of the previous task) arrives with every message
(:attr:`TrainIns.teacher`): clients stay stateless, so a node that missed a round, joined late or
was restarted still has it (the price is one more model download per round).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

from clients.fedavg import train_locally
from clients.job import ClientJob
from fcl_flower.fcl.distill import frozen_teacher, kd_loss
from fcl_flower.fcl.training import ExtraLoss
from fcl_flower.models import IncrementalClassifier
from fcl_flower.protocol import ProtocolError, TrainIns, TrainRes
from fcl_flower.tensors import record_tensors

NEW_CLASSES_ONLY_CE = True  # the new task's cross-entropy covers its own classes only


def server_arrays(job: ClientJob, attribute: str) -> dict[str, torch.Tensor]:
    """An ArrayRecord the server must send with this phase (e.g. the teacher), as tensors."""
    record: ArrayRecord | None = getattr(job.ins, attribute, None) if isinstance(job.ins, TrainIns) else None
    if record is None:
        raise ProtocolError(f"phase '{job.ins.header.phase}' needs the server's '{attribute}' arrays")
    return record_tensors(record)


def new_task_ce_from(job: ClientJob) -> int:
    """First class of the cross-entropy: the new task's (TARGET/LANDER LwF/EWC), see module doc.
    In STAMP's task pool a client's task is no label range (one head over all classes): all."""
    if job.cfg.partition == "task-pool":
        return 0
    return job.task_classes.start if NEW_CLASSES_ONLY_CE else 0


def old_classes(job: ClientJob) -> int:
    """Logits LwF distils: the classes before the task's (task pool: the whole head)."""
    return job.num_seen if job.cfg.partition == "task-pool" else job.task_classes.start


def lwf_extra_loss(teacher: torch.nn.Module, num_old: int, alpha: float, temperature: float) -> ExtraLoss:
    """``α · KD`` between the teacher's and the student's logits over the ``num_old`` old classes."""
    if num_old < 1:
        raise ValueError("LwF needs at least one old class (it starts at the second task)")

    def loss(
        model: IncrementalClassifier, images: torch.Tensor, labels: torch.Tensor, logits_seen: torch.Tensor
    ) -> torch.Tensor:
        with torch.no_grad():
            old_logits = teacher(images)[:, :num_old]
        return alpha * kd_loss(logits_seen, old_logits, temperature)

    return loss


def handle_lwf(job: ClientJob) -> TrainRes:
    """Local SGD with distillation from the previous task's global model."""
    teacher = frozen_teacher(job.model, server_arrays(job, "teacher"), job.device)
    extra = lwf_extra_loss(teacher, old_classes(job), job.cfg.lwf_alpha, job.cfg.lwf_temperature)
    return train_locally(job, extra, new_task_ce_from(job))
