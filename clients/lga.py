"""LGA client (Dong et al., TPAMI 2024): L_CB + L_SD on new data ∪ exemplars, Eq. 8 detection,
iCaRL herding memory and the perturbed prototype gradients for the proxy server.

One handler, phase ``lga``, runs every round of every task (LGA trains with its own loss from
task 1 on; in task 1 L_local = L_CB with all weights 1, i.e. plain CE). Per round:

1. Restore this node's state from Flower's per-node ``context.state``: the exemplar memory
   (ArrayRecord ``lga-memory``, dataset indices of this client's own past-task samples), the
   old model used for L_SD (ArrayRecord ``lga-teacher``) and the detector/bookkeeping
   (ConfigRecord ``lga-state``).
2. Eq. 8 on the received global model: the mean prediction entropy on the current local data;
   the detector's verdict is reported (``lga-detected``) next to the server's task id
   (``lga-new-task``), so the strategy can count hits, misses and false alarms.
3. When the task id is new to this client: herd the exemplars of the tasks just finished with
   the received model (the end-of-task global model), shrinking old classes to the new quota.
4. ``local-epochs`` of SGD on ``L_local = L_CB + L_SD`` (Eq. 7) over current data ∪ memory; the
   Eq. 4 exponent uses this client's own class counts (docs/methods/lga_stamp.md A6.2); the teacher is the old model
   the server's proxy selected (:attr:`TrainIns.old_model`, cached in the state).
5. In a client's first round of a task: per new class, the prototype (sample nearest the class
   mean) is perturbed (Eqs. 13-14) and the gradient of the shared LeNet Γ on it is uploaded in
   the :class:`~fcl_flower.protocol.LGAReport` (keys ``"<class>/<param index>"``).

Math: :mod:`fcl_flower.fcl.lga`, :mod:`fcl_flower.fcl.lga_proxy`, :mod:`fcl_flower.fcl.exemplars`.
"""

from __future__ import annotations

import numpy as np
import torch

from clients.job import ClientJob
from clients.memory import load_memory, load_meta, save_memory, save_meta, train_loader
from fcl_flower.data import LabelledDataset
from fcl_flower.fcl.distill import frozen_teacher
from fcl_flower.fcl.exemplars import ExemplarMemory
from fcl_flower.fcl.lga import TaskTransitionDetector, lga_local_loss, mean_prediction_entropy, sharpening_exponent
from fcl_flower.fcl.lga_proxy import (
    class_feature_variance,
    gradient_encoder,
    perturbed_prototype_gradient,
    prototype_indices,
)
from fcl_flower.fcl.training import seeded_global_rng
from fcl_flower.protocol import LGAReport, TrainRes
from fcl_flower.protocol.payloads import prototype_record
from fcl_flower.runtime import iter_features
from fcl_flower.tensors import record_tensors

MEMORY_STATE = "lga-memory"
TEACHER_STATE = "lga-teacher"
META_STATE = "lga-state"
PERTURB_STEPS = 50  # Eq. 14 SGD steps ([CODE-LGA]: lr 0.2, 50 steps)
PERTURB_LR = 0.2
PERTURB_EPS = 0.1  # Eq. 13 feature noise scale (paper)


class MissingOldModel(ValueError):
    """A later-task LGA round reached a client that has no old model to distil from."""


# ------------------------------------------------------------------------------ helpers
def memory_task_of(job: ClientJob, cls: int) -> int:
    """The task that introduced class ``cls`` (tasks own contiguous class ranges)."""
    for t, r in enumerate(job.data.tasks):
        if cls in r:
            return t
    raise ValueError(f"class {cls} belongs to no task")


def herd_finished_tasks(job: ClientJob, memory: ExemplarMemory, first: int, last: int, *, normalize: bool) -> None:
    """Add the classes of this client's tasks ``first..last-1`` to ``memory`` by herding on the
    received model's features (eval transforms); indices are positions in the task's data."""
    for task in range(first, last):
        data = job.data.train(task, eval_transform=True)
        if len(data) == 0:
            continue
        feats = torch.cat([f for f, _ in iter_features(job.model, data, job.cfg, job.device)])
        labels = torch.from_numpy(np.array(data.targets, dtype=np.int64))
        memory.add_classes(feats, labels, torch.arange(len(data)), normalize=normalize)


def exemplar_datasets(job: ClientJob, memory: ExemplarMemory, *, eval_transform: bool) -> dict[int, LabelledDataset]:
    """Per old task, the stored exemplars as a view of this client's own data of that task."""
    by_task: dict[int, list[int]] = {}
    for cls in memory.classes:
        by_task.setdefault(memory_task_of(job, cls), []).extend(memory.class_indices(cls).tolist())
    return {
        t: job.data.train(t, eval_transform=eval_transform).subset(np.asarray(idx, dtype=np.int64))
        for t, idx in sorted(by_task.items())
        if idx
    }


# ------------------------------------------------------------------------------ the handler
def handle_lga(job: ClientJob) -> TrainRes:
    cfg, state, task = job.cfg, job.context.state, job.task
    memory = load_memory(state, MEMORY_STATE, cfg.memory_size)
    meta = load_meta(state, META_STATE)
    detector = TaskTransitionDetector.from_state(meta) if "threshold" in meta else TaskTransitionDetector()
    last_task = int(meta.get("task", -1))
    new_task = task > last_task

    old_model = getattr(job.ins, "old_model", None)
    if old_model is not None:  # the proxy's choice for this task
        state.array_records[TEACHER_STATE] = old_model
        meta["teacher-task"] = task
    current = job.local_data(eval_transform=False)
    current_eval = job.local_data(eval_transform=True)

    # Eq. 8 on the received global model
    detected = 0
    if len(current_eval):
        logits = torch.cat(
            [
                job.model.head(f.to(job.device, torch.float32))[:, : job.num_seen].cpu()
                for f, _ in iter_features(job.model, current_eval, cfg, job.device)
            ]
        )
        detected = int(detector.update(mean_prediction_entropy(logits)))
    if new_task:  # exemplars of the tasks just finished, herded with the end-of-task model
        herd_finished_tasks(job, memory, int(meta.get("memory-through", 0)), task, normalize=True)
        meta["memory-through"] = task

    teacher = None
    num_old = job.task_classes.start
    if task > 0:
        if TEACHER_STATE not in state.array_records or int(meta.get("teacher-task", -1)) != task:
            raise MissingOldModel(f"LGA task {task}: no old model from the server for this task")
        teacher = frozen_teacher(job.model, record_tensors(state.array_records[TEACHER_STATE]), job.device)

    exemplars = exemplar_datasets(job, memory, eval_transform=False)
    datasets = ([current] if len(current) else []) + list(exemplars.values())
    num_examples = sum(len(d) for d in datasets)
    own_new = len(set(np.asarray(current.targets).tolist()))
    exponent = sharpening_exponent(memory.num_classes, own_new) if memory.num_classes + own_new else 0.0
    task_ends = [r.stop for r in job.data.tasks[: task + 1]]
    model, device = job.model.to(job.device), job.device
    losses = {"total": 0.0, "cb": 0.0, "sd": 0.0}
    count = 0
    if num_examples:
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=job.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        with seeded_global_rng(job.round_seed(), device):  # augmentations: same in any process
            for epoch in range(cfg.local_epochs):
                for images, labels in train_loader(datasets, job, job.round_seed() * 1000 + epoch):
                    images, labels = images.to(device), labels.to(device)
                    logits = model(images)[:, : job.num_seen]
                    old_logits = None
                    if teacher is not None:
                        with torch.no_grad():
                            old_logits = teacher(images)[:, :num_old]
                    parts = lga_local_loss(logits, labels, task_ends, old_logits=old_logits, exponent=exponent)
                    opt.zero_grad(set_to_none=True)
                    parts.total.backward()
                    opt.step()
                    n = len(labels)
                    losses["total"] += float(parts.total.detach()) * n
                    losses["cb"] += float(parts.cb.detach()) * n
                    losses["sd"] += float(parts.sd.detach()) * n
                    count += n
        model.eval()

    grads: dict[int, list[torch.Tensor]] = {}
    if new_task and len(current_eval) and cfg.proxy_iterations > 0:
        grads = prototype_gradients(job, current_eval)

    meta.update(detector.to_state())
    meta["task"] = task
    save_meta(state, META_STATE, meta)
    save_memory(state, MEMORY_STATE, memory)
    report = LGAReport(
        cb=losses["cb"] / max(count, 1),
        sd=losses["sd"] / max(count, 1),
        detected=bool(detected),
        new_task=new_task,
        memory=len(memory),
        proto_classes=len(grads),
        prototypes=prototype_record(grads) if grads else None,
    )
    return job.train_reply(num_examples, losses["total"] / max(count, 1), lga=report)


def prototype_gradients(job: ClientJob, data: LabelledDataset) -> dict[int, list[torch.Tensor]]:
    """Per class of the current task: Γ's gradient on its perturbed prototype (A2.7a-c)."""
    model, device = job.model.to(job.device).eval(), job.device
    feats = torch.cat([f for f, _ in iter_features(model, data, job.cfg, device)])
    labels = torch.from_numpy(np.array(data.targets, dtype=np.int64))
    protos = prototype_indices(feats, labels)
    variances = class_feature_variance(feats, labels)
    encoder = gradient_encoder(job.data.shape.image_shape, job.data.shape.num_classes, job.cfg.seed).to(device)
    gen = torch.Generator().manual_seed(job.round_seed())
    out: dict[int, list[torch.Tensor]] = {}
    for cls, row in sorted(protos.items()):
        image = data[row][0].to(device)
        with torch.enable_grad():
            grads = perturbed_prototype_gradient(
                model,
                encoder,
                image,
                cls,
                feature_var=variances[cls],
                eps=PERTURB_EPS,
                steps=PERTURB_STEPS,
                lr=PERTURB_LR,
                num_seen=job.num_seen,
                generator=gen,
            )
        out[cls] = [g.cpu().float() for g in grads]
    return out
