"""Local SGD on one dataset: the inner loop of every gradient-trained method (clients, and the
server's pooled joint-gradient bound)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fcl_flower.config import RunConfig
from fcl_flower.data import LabelledDataset
from fcl_flower.fcl.sgd import MomentumSGD
from fcl_flower.models import IncrementalClassifier
from fcl_flower.runtime import make_loader

# extra_loss(model, images, labels, logits over the seen classes) -> scalar added to the CE loss
ExtraLoss = Callable[[IncrementalClassifier, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@contextmanager
def seeded_global_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block with torch's global generator seeded from ``seed``, inside a fork (the
    caller's generator state is restored afterwards).

    Random augmentations (crops, flips) and dropout draw from the global generator. Seeding it per
    round makes a round train the same whatever the process did before: a SuperNode starts a fresh
    ClientApp process per message, while the simulation reuses one."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


@dataclass(frozen=True)
class TrainStats:
    num_examples: int
    mean_loss: float


def local_sgd(
    model: IncrementalClassifier,
    dataset: LabelledDataset,
    cfg: RunConfig,
    *,
    lr: float,
    num_seen: int,
    device: torch.device,
    seed: int,
    extra_loss: ExtraLoss | None = None,
    ce_from: int = 0,
) -> TrainStats:
    """``local-epochs`` epochs of SGD (fresh optimiser each round, as the STSA code does) with
    cross-entropy over the classes seen so far (single head, no task id).

    ``ce_from > 0`` limits the cross-entropy to classes ``ce_from..num_seen-1`` (the new task's,
    as the TARGET/LANDER LwF/EWC baselines train); ``extra_loss`` still gets all seen logits.

    An empty dataset (a client not yet joined, or an LGA Z_o client without memory) trains
    nothing and reports 0 examples, so FedAvg gives its unchanged model weight 0."""
    if len(dataset) == 0:
        return TrainStats(num_examples=0, mean_loss=0.0)
    with seeded_global_rng(seed, device):
        model.to(device).train()
        params = [p for p in model.parameters() if p.requires_grad]
        # torch.optim.SGD's update, bit for bit, without importing torch._dynamo (fcl_flower/fcl/sgd.py)
        optimiser = MomentumSGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        total, count = 0.0, 0
        for epoch in range(cfg.local_epochs):
            for images, labels in make_loader(dataset, cfg, shuffle=True, seed=seed * 1000 + epoch):
                images, labels = images.to(device), labels.to(device)
                logits = model(images)[:, :num_seen]
                if ce_from and bool((labels < ce_from).any()):
                    raise ValueError(f"ce_from={ce_from} but the batch has labels below it")
                loss = F.cross_entropy(logits[:, ce_from:], labels - ce_from)
                if extra_loss is not None:
                    loss = loss + extra_loss(model, images, labels, logits)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                total += float(loss.detach()) * len(labels)
                count += len(labels)
        model.eval()
        return TrainStats(num_examples=len(dataset), mean_loss=total / max(count, 1))
