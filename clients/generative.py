"""What the TARGET and LANDER clients share: local SGD with a synthetic batch beside every real one.

Same optimiser, learning rate, schedule and shuffled batches as every gradient client
(:func:`fcl_flower.fcl.training.local_sgd`); each real batch of this client's own data of the task
is paired with the next batch of the server's synthetic pool (cycled and reshuffled, as the codes'
``DataIter``), augmented like the codes reload their synthetic PNGs
(:func:`fcl_flower.fcl.generative.replay_augment`). The method's ``batch_loss`` returns its named
terms; their per-epoch means (float64) come back in :class:`ReplayStats`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from clients.job import ClientJob
from fcl_flower.fcl.generative import augment, cycle_batches, from_pool, replay_augment
from fcl_flower.models import IncrementalClassifier
from fcl_flower.protocol import ProtocolError, TrainIns
from fcl_flower.runtime import make_loader
from fcl_flower.tensors import record_tensors

# batch_loss(model, images, labels, synthetic images or None) -> {"loss": total, <term>: value, ...}
BatchLoss = Callable[[IncrementalClassifier, Tensor, Tensor, Tensor | None], dict[str, Tensor]]


@dataclass
class ReplayStats:
    num_examples: int
    mean_loss: float
    terms: dict[str, list[float]] = field(default_factory=dict)  # term -> mean per local epoch


def synthetic_pool(job: ClientJob) -> Tensor:
    """The server's synthetic images (``TrainIns.synthetic``): uint8 (N, H, W, C) of this dataset's shape."""
    record = job.ins.synthetic if isinstance(job.ins, TrainIns) else None
    if record is None:
        raise ProtocolError(f"phase '{job.ins.header.phase}' needs the server's synthetic images")
    pool = record_tensors(record).get("images")
    channels, height, width = job.data.shape.image_shape
    if pool is None or pool.dtype != torch.uint8 or tuple(pool.shape[1:]) != (height, width, channels) or not len(pool):
        raise ProtocolError(f"synthetic images must be uint8 (N>0, {height}, {width}, {channels})")
    return pool


def replay_sgd(job: ClientJob, batch_loss: BatchLoss, synthetic: Tensor | None) -> ReplayStats:
    """``local-epochs`` of SGD on this client's data of the task, ``batch_loss`` per batch."""
    cfg = job.cfg
    dataset = job.local_data(eval_transform=False)
    if len(dataset) == 0:
        return ReplayStats(0, 0.0)
    model = job.model.to(job.device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.SGD(params, lr=job.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    seed = job.round_seed()
    rng = torch.Generator().manual_seed(seed)
    aug = replay_augment(cfg.dataset, cfg.image_size)
    batches = cycle_batches(len(synthetic), cfg.batch_size, rng) if synthetic is not None else None
    terms: dict[str, list[float]] = {}
    total, count = [], 0
    # The dataset's random crops/flips draw from torch's global generator: seed it from the round
    # seed inside a fork, as local_sgd does, so a round trains the same in any process.
    with torch.random.fork_rng(devices=[job.device] if job.device.type == "cuda" else []):
        torch.manual_seed(seed)
        for epoch in range(cfg.local_epochs):
            sums: dict[str, list[float]] = {}
            seen = 0
            for images, labels in make_loader(dataset, cfg, shuffle=True, seed=seed * 1000 + epoch):
                images, labels = images.to(job.device), labels.to(job.device)
                syn = None
                if synthetic is not None and batches is not None:
                    syn = augment(from_pool(synthetic[next(batches)]).to(job.device), aug, rng)
                out = batch_loss(model, images, labels, syn)
                optimiser.zero_grad(set_to_none=True)
                out["loss"].backward()
                optimiser.step()
                for name, value in out.items():
                    sums.setdefault(name, []).append(float(value.detach().double()) * len(labels))
                seen += len(labels)
            for name, values in sums.items():
                terms.setdefault(name, []).append(math.fsum(values) / max(seen, 1))
            total.extend(sums["loss"])
            count += seen
    model.eval()
    return ReplayStats(len(dataset), math.fsum(total) / max(count, 1), terms)
