"""Clients of the regularised gradient baselines: Fed-LwF and Fed-EWC.

Both train with the ``finetune`` client's loop (``local_sgd``: same optimiser, schedule and
batches) and add a regulariser. As in the TARGET/LANDER code the STSA paper's baseline numbers
come from, from the second task on the cross-entropy covers the *new task's classes only*
(``ce_from``); the old classes are kept by the regulariser alone (``NEW_CLASSES_ONLY_CE``).
With the all-seen-classes cross-entropy of ``finetune`` the new data pushes every old logit
down, and LwF forgets as much as finetune (digits, 5 tasks, 5 clients, β = 0.5, seed 0: A_T
15.1 vs 15.3); with the new-class cross-entropy its A_T is 22.4.
In STAMP's limitless task pool (``partition = task-pool``) a client's task is a scattered set of
classes on one head over all classes, so the cross-entropy covers the whole head there and LwF
distils every logit of the previous task's global model.

* ``lwf``: ``+ α · KD(teacher ‖ student)`` on the old classes, temperature T. The teacher (the
  global model at the end of the previous task) arrives with every message in the ArrayRecord
  ``teacher``: clients stay stateless, so a node that missed a round, joined late or was
  restarted still has it (the price is one more model download per round; uploads are unchanged).
* ``ewc``: ``+ λ/2 Σ F (θ − θ*)²``; the aggregated Fisher and the anchor θ* arrive as the
  ArrayRecords ``ewc-fisher`` and ``ewc-anchor``.
* ``ewc-stats``: after a task's last round, the diagonal Fisher of the received global model on
  this client's data of that task (eval mode, test-time transforms, cross-entropy over the seen
  classes), uploaded like any other statistic so its bytes are counted.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from flwr.app import Message

from clients.fedavg import _round_seed  # same shuffling as finetune: lwf/ewc see its batches
from clients.job import ClientJob, make_reply
from clients.training import ExtraLoss, local_sgd
from fcl_flower.fcl.distill import kd_loss
from fcl_flower.fcl.ewc import diagonal_fisher, ewc_penalty, trainable_parameters
from fcl_flower.models import IncrementalClassifier, load_trainable_state, trainable_state
from fcl_flower.runtime import make_loader
from fcl_flower.wire import cast_for_wire, from_record

TEACHER_RECORD = "teacher"
FISHER_RECORD = "ewc-fisher"
ANCHOR_RECORD = "ewc-anchor"
NEW_CLASSES_ONLY_CE = True  # the new task's cross-entropy covers its own classes only


class MissingServerArrays(ValueError):
    """The server's message lacks an ArrayRecord this phase needs."""


def _server_arrays(message: Message, name: str, phase: str) -> dict[str, torch.Tensor]:
    if name not in message.content.array_records:
        raise MissingServerArrays(f"phase '{phase}' needs the ArrayRecord '{name}' in the server's message")
    return from_record(message.content.array_records[name])


# ------------------------------------------------------------------------------ losses
def frozen_teacher(model: IncrementalClassifier, state: dict[str, torch.Tensor],
                   device: torch.device) -> IncrementalClassifier:
    """A frozen copy of ``model`` carrying the teacher's trainable state (eval mode, no grads)."""
    teacher = copy.deepcopy(model)
    load_trainable_state(teacher, state)
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def lwf_extra_loss(teacher: IncrementalClassifier, num_old: int, alpha: float, temperature: float) -> ExtraLoss:
    """``α · KD`` between the teacher's and the student's logits over the ``num_old`` old classes."""
    if num_old < 1:
        raise ValueError("LwF needs at least one old class (it starts at the second task)")

    def loss(model: IncrementalClassifier, images: torch.Tensor, labels: torch.Tensor,
             logits_seen: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            old_logits = teacher(images)[:, :num_old]
        return alpha * kd_loss(logits_seen, old_logits, temperature)

    return loss


def ewc_extra_loss(fisher: dict[str, torch.Tensor], anchor: dict[str, torch.Tensor], lam: float,
                   device: torch.device) -> ExtraLoss:
    """``λ/2 Σ F (θ − θ*)²`` over the model's trainable parameters (a constant w.r.t. the batch)."""
    fisher = {k: v.to(device=device, dtype=torch.float32) for k, v in fisher.items()}
    anchor = {k: v.to(device=device, dtype=torch.float32) for k, v in anchor.items()}

    def loss(model: IncrementalClassifier, images: torch.Tensor, labels: torch.Tensor,
             logits_seen: torch.Tensor) -> torch.Tensor:
        return ewc_penalty(trainable_parameters(model), fisher, anchor, lam)

    return loss


# ------------------------------------------------------------------------------ handlers
def new_task_ce_from(job: ClientJob) -> int:
    """First class of the cross-entropy: the new task's (TARGET/LANDER LwF/EWC), see module doc.
    In STAMP's task pool a client's task is no label range (one head over all classes): all."""
    if job.cfg.partition == "task-pool":
        return 0
    return job.task_classes.start if NEW_CLASSES_ONLY_CE else 0


def old_classes(job: ClientJob) -> int:
    """Logits LwF distils: the classes before the task's (task pool: the whole head)."""
    return job.num_seen if job.cfg.partition == "task-pool" else job.task_classes.start


def handle_lwf(message: Message, job: ClientJob) -> Message:
    """Local SGD with distillation from the previous task's global model."""
    teacher = frozen_teacher(job.model, _server_arrays(message, TEACHER_RECORD, job.phase), job.device)
    extra = lwf_extra_loss(teacher, old_classes(job), job.cfg.lwf_alpha, job.cfg.lwf_temperature)
    stats = local_sgd(job.model, job.local_data(eval_transform=False), job.cfg, lr=job.lr,
                      num_seen=job.num_seen, device=job.device, seed=_round_seed(job), extra_loss=extra,
                      ce_from=new_task_ce_from(job))
    return make_reply(message, job, trainable_state(job.model), stats.num_examples,
                      {"train-loss": stats.mean_loss})


def handle_ewc(message: Message, job: ClientJob) -> Message:
    """Local SGD with the Fisher-weighted pull towards the previous task's global model."""
    fisher = _server_arrays(message, FISHER_RECORD, job.phase)
    anchor = _server_arrays(message, ANCHOR_RECORD, job.phase)
    extra = ewc_extra_loss(fisher, anchor, job.cfg.ewc_lambda, job.device)
    stats = local_sgd(job.model, job.local_data(eval_transform=False), job.cfg, lr=job.lr,
                      num_seen=job.num_seen, device=job.device, seed=_round_seed(job), extra_loss=extra,
                      ce_from=new_task_ce_from(job))
    return make_reply(message, job, trainable_state(job.model), stats.num_examples,
                      {"train-loss": stats.mean_loss})


def local_fisher(job: ClientJob) -> dict[str, torch.Tensor]:
    """Diagonal Fisher of the received global model on this client's data of the task."""
    model, device, num_seen = job.model.to(job.device).eval(), job.device, job.num_seen

    def cross_entropy(m: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(images.to(device))[:, :num_seen], labels.to(device))

    batches = make_loader(job.local_data(eval_transform=True), job.cfg, shuffle=False)
    max_value = job.cfg.ewc_fisher_max if job.cfg.ewc_fisher_max > 0 else None
    return diagonal_fisher(model, batches, cross_entropy, max_value=max_value)


def handle_ewc_stats(message: Message, job: ClientJob) -> Message:
    fisher = local_fisher(job)
    arrays = {k: cast_for_wire(v, job.cfg.wire_dtype) for k, v in fisher.items()}
    return make_reply(message, job, arrays, len(job.local_data(eval_transform=True)))
