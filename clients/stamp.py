"""STAMP client (Nguyen et al.): local CE + ProtoNet training, then temporal gradient matching.

Phase ``stamp``, every round of every task. Per round:

1. Restore the prototypical coreset from ``context.state`` (ArrayRecord ``stamp-coreset``:
   dataset indices of this client's own past-task samples, at most ``memory-size`` in all) and
   the bookkeeping (ConfigRecord ``stamp-state``).
2. When the task id is new to this client: select the coreset of the tasks just finished
   (Eq. 6) on the received model's backbone embeddings g(x; φ), by herding towards p^l.
   Classes never recur across tasks in class-incremental learning, so p^l (the running
   count-weighted class mean) is the class mean of that task's samples.
3. ``local-epochs`` of SGD on ``CE + λ_proto · L_proto`` (Eq. 8 on the backbone embeddings of
   each batch) over the current task's data.
4. TAM (Eq. 3): the current-task pseudo-gradient ``θ_received − θ_local`` and one gradient per
   old task (mean CE over that task's coreset through the whole network, at θ_local) are
   matched by the CAGrad operator (radius ``gm-c``); the client uploads ``θ_received − d``.
   With no old task in the coreset this is plain local training.

A client's "old tasks" are its *own* earlier tasks: each coreset class belongs to the first of
this client's tasks whose data holds it. On the shared stream that is the task whose label
range holds the class; in STAMP's limitless task pool (``partition = task-pool``) every client
has its own class sequence, and a tiled sequence can bring a class back, in which case the
coreset keeps the exemplars picked at its first task.

Math: :mod:`fcl_flower.fcl.stamp`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from clients.job import ClientJob
from clients.memory import load_memory, load_meta, save_memory, save_meta, train_loader
from fcl_flower.data import LabelledDataset
from fcl_flower.fcl.exemplars import ExemplarMemory
from fcl_flower.fcl.stamp import assign_flat_params, flatten_params, protonet_loss, task_gradient, temporal_match
from fcl_flower.fcl.training import seeded_global_rng
from fcl_flower.protocol import StampReport, TrainRes
from fcl_flower.runtime import iter_features

CORESET_STATE = "stamp-coreset"
META_STATE = "stamp-state"
PROTO_WEIGHT = 1.0  # λ_proto (docs/methods/lga_stamp.md B5.2)


def own_task_of_classes(job: ClientJob, through: int) -> dict[int, int]:
    """class -> the first of this client's tasks ``0..through-1`` whose own data holds it."""
    owner: dict[int, int] = {}
    for task in range(through):
        for cls in np.unique(job.data.train(task, eval_transform=True).targets).tolist():
            owner.setdefault(int(cls), task)
    return owner


def herd_new_classes(job: ClientJob, coreset: ExemplarMemory, first: int, last: int) -> None:
    """Eq. 6 for this client's tasks ``first..last-1``: herd towards each class mean on the
    received model's embeddings; a class already in the coreset (a tiled task pool brings classes
    back) keeps its exemplars. Indices are positions in that task's own data."""
    for task in range(first, last):
        data = job.data.train(task, eval_transform=True)
        if len(data) == 0:
            continue
        labels = torch.from_numpy(np.array(data.targets, dtype=np.int64))
        fresh = ~torch.isin(labels, torch.tensor(coreset.classes, dtype=torch.int64))
        if not bool(fresh.any()):
            continue
        feats = torch.cat([f for f, _ in iter_features(job.model, data, job.cfg, job.device)])
        coreset.add_classes(feats[fresh], labels[fresh], torch.arange(len(data))[fresh], normalize=False)


def coreset_by_task(job: ClientJob, coreset: ExemplarMemory) -> dict[int, LabelledDataset]:
    """Per old task of this client, its coreset samples (eval transforms)."""
    owner = own_task_of_classes(job, job.task)
    by_task: dict[int, list[int]] = {}
    for cls in coreset.classes:
        by_task.setdefault(owner[cls], []).extend(coreset.class_indices(cls).tolist())
    return {
        t: job.data.train(t, eval_transform=True).subset(np.asarray(idx, dtype=np.int64))
        for t, idx in sorted(by_task.items())
        if idx
    }


def handle_stamp(job: ClientJob) -> TrainRes:
    cfg, state, task = job.cfg, job.context.state, job.task
    coreset = load_memory(state, CORESET_STATE, cfg.memory_size)
    meta = load_meta(state, META_STATE)
    if task > int(meta.get("task", -1)):  # Eq. 6 on the end-of-task global model
        herd_new_classes(job, coreset, int(meta.get("memory-through", 0)), task)
        meta["memory-through"] = task

    model, device = job.model.to(job.device), job.device
    received = flatten_params(model).clone()
    current = job.local_data(eval_transform=False)
    total, proto_total, count = 0.0, 0.0, 0
    if len(current):
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=job.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        with seeded_global_rng(job.round_seed(), device):  # augmentations: same in any process
            for epoch in range(cfg.local_epochs):
                for images, labels in train_loader([current], job, job.round_seed() * 1000 + epoch):
                    images, labels = images.to(device), labels.to(device)
                    emb = model.features(images)
                    logits = model.head(emb)[:, : job.num_seen]
                    proto = protonet_loss(emb, labels)
                    loss = F.cross_entropy(logits, labels) + PROTO_WEIGHT * proto
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    total += float(loss.detach()) * len(labels)
                    proto_total += float(proto.detach()) * len(labels)
                    count += len(labels)
        model.eval()

    old_tasks = coreset_by_task(job, coreset)
    matched = 0
    if len(current) and old_tasks:
        local = flatten_params(model)
        old_grads = []
        for data in old_tasks.values():
            x, y = data.tensors()
            old_grads.append(task_gradient(model, x.to(device), y.to(device), num_seen=job.num_seen))
        d = temporal_match(received - local, torch.stack(old_grads), cfg.gm_c)
        assign_flat_params(model, received - d)
        matched = len(old_grads)

    meta["task"] = task
    save_meta(state, META_STATE, meta)
    save_memory(state, CORESET_STATE, coreset)
    report = StampReport(proto=proto_total / max(count, 1), old_tasks=matched, coreset=len(coreset))
    return job.train_reply(len(current), total / max(count, 1), stamp=report)


__all__ = ["CORESET_STATE", "META_STATE", "handle_stamp"]
