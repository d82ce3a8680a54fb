"""Shared plumbing between the server and the clients: the split, the model, loaders, features.

Server and clients build the model from the same seed, so only the *trainable* state has to
travel (for a pretrained ViT that is the adapters and head, not 86M frozen weights).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from fcl_flower.config import RunConfig
from fcl_flower.data import FederatedSplit, LabelledDataset, get_federated_split
from fcl_flower.data.federated import PROTOCOL_ARGS
from fcl_flower.models import IncrementalClassifier, build_classifier, pick_device


def federated_split(cfg: RunConfig) -> FederatedSplit:
    """The task split and per-task client partitions; cached per process."""
    return get_federated_split(
        dataset=cfg.dataset,
        root=cfg.data_dir,
        download=cfg.download,
        seed=cfg.seed,
        num_tasks=cfg.num_tasks,
        first_task_classes=cfg.first_task_classes,
        num_clients=cfg.num_clients,
        beta=cfg.beta,
        image_size=cfg.image_size or None,
        **{arg: getattr(cfg, arg) for arg in PROTOCOL_ARGS},
    )


def resolve_device(cfg: RunConfig) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but no CUDA GPU is visible")
    return pick_device(prefer_gpu=True)


def build_model(cfg: RunConfig, split: FederatedSplit) -> IncrementalClassifier:
    """The seeded global model: identical in every process for the same config."""
    return build_model_for_shape(cfg, split.bundle.num_classes, split.bundle.image_shape)


def build_model_for_shape(cfg: RunConfig, num_classes: int, image_shape: tuple[int, int, int]) -> IncrementalClassifier:
    """:func:`build_model` from the dataset's shape alone (a client with only its own data folder)."""
    channels, height, _ = image_shape
    return build_classifier(
        cfg.backbone,
        num_classes,
        in_channels=channels,
        image_size=height,
        pretrained=cfg.pretrained,
        head=cfg.train_head,
        seed=cfg.seed,
        anchor_dim=cfg.method.anchor_dim,
    )


def make_loader(dataset: LabelledDataset, cfg: RunConfig, *, shuffle: bool, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset, batch_size=cfg.batch_size, shuffle=shuffle, generator=generator, num_workers=0, drop_last=False
    )


@torch.no_grad()
def iter_features(
    model: IncrementalClassifier, dataset: LabelledDataset, cfg: RunConfig, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Backbone features (eval mode, no augmentation) batch by batch, never all at once."""
    model.eval().to(device)
    for images, labels in make_loader(dataset, cfg, shuffle=False):
        yield model.features(images.to(device)).double().cpu(), labels.long()


@torch.no_grad()
def predict_logits(
    model: IncrementalClassifier, dataset: LabelledDataset, cfg: RunConfig, device: torch.device, num_seen: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(predicted labels restricted to the seen classes, true labels)."""
    model.eval().to(device)
    preds, labels = [], []
    for images, y in make_loader(dataset, cfg, shuffle=False):
        logits = model(images.to(device))[:, :num_seen]
        preds.append(logits.argmax(dim=1).cpu())
        labels.append(y.long())
    return torch.cat(preds), torch.cat(labels)
