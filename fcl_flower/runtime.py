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
from fcl_flower.data.plan import CUSTOM, FederationLayout, TaskPlan, custom_plan, public_plan
from fcl_flower.feature_cache import CacheUse, cached_batches, feature_key
from fcl_flower.models import IncrementalClassifier, build_classifier, pick_device


def task_plan(cfg: RunConfig) -> TaskPlan:
    """The classes, tasks and input shape of the run, without opening any dataset."""
    if cfg.dataset == CUSTOM:
        return custom_plan(
            class_names=cfg.class_names,
            plan_file=cfg.task_plan,
            plan_text=cfg.task_plan_content,
            num_tasks=cfg.num_tasks,
            first_task_classes=cfg.first_task_classes,
            image_size=cfg.image_size,
        )
    return public_plan(
        cfg.dataset,
        seed=cfg.seed,
        num_tasks=cfg.num_tasks,
        first_task_classes=cfg.first_task_classes,
        image_size=cfg.image_size,
        task_pool=cfg.partition == "task-pool",
    )


def federation_layout(cfg: RunConfig) -> FederationLayout:
    """Which client holds which task's data, from the plan and the seed alone (no dataset)."""
    return FederationLayout(
        task_plan(cfg),
        cfg.num_clients,
        cfg.seed,
        cfg.partition,
        initial_clients=cfg.initial_clients,
        joining_per_task=cfg.joining_per_task,
        old_only_fraction=cfg.old_only_fraction,
        classes_per_task=cfg.classes_per_task,
    )


def server_split(cfg: RunConfig) -> FederationLayout:
    """What the ServerApp holds: the whole split where it scores the model itself (evaluation
    central or both) or pools the data (joint bounds); under federated evaluation only the layout,
    so it never opens a dataset."""
    if cfg.evaluation == "federated":
        return federation_layout(cfg)
    return federated_split(cfg)


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


def build_model(cfg: RunConfig, split: FederationLayout) -> IncrementalClassifier:
    """The seeded global model: identical in every process for the same config."""
    return build_model_for_shape(cfg, split.num_classes, split.image_shape)


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


def iter_features(
    model: IncrementalClassifier,
    dataset: LabelledDataset,
    cfg: RunConfig,
    device: torch.device,
    cache: CacheUse | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Backbone features (eval mode, no augmentation) batch by batch, never all at once.

    With ``cache`` they come from it when it holds this backbone's features of this data (the
    same batches, bit for bit), else they are computed and cached (fcl_flower/feature_cache.py)."""
    model.eval().to(device)
    key = None if cache is None else feature_key(model.backbone, dataset, device, cfg.batch_size)
    if cache is None or key is None:
        yield from _computed_features(model, dataset, cfg, device)
    else:
        yield from cached_batches(cache, key, cfg.batch_size, _computed_features(model, dataset, cfg, device))


@torch.no_grad()
def _computed_features(
    model: IncrementalClassifier, dataset: LabelledDataset, cfg: RunConfig, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
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


@torch.no_grad()
def predict_ridge(
    model: IncrementalClassifier,
    dataset: LabelledDataset,
    cfg: RunConfig,
    device: torch.device,
    weights: torch.Tensor | None,
    projection: torch.Tensor | None,
    cache: CacheUse | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(predictions, true labels) of an analytic method's classifier: random features
    ``R(f) = ReLU(f · W_rand)`` of the frozen backbone's features, scored by the ridge weights W
    (head ``cosine`` or ``dot``). Without a classifier yet (a failed first stage) every
    prediction is class 0. The server (central evaluation) and the clients (federated) both
    score through here, so the two agree sample by sample."""
    from fcl_flower.analytic import predict, random_features

    phis, labels = [], []
    for features, y in iter_features(model, dataset, cfg, device, cache):
        phis.append(random_features(features, projection, cfg.feature_clip))
        labels.append(y)
    if not phis:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    phi = torch.cat(phis)
    w = weights if weights is not None else torch.zeros(phi.shape[1], 1, dtype=torch.float64)
    return predict(phi, w, cfg.head), torch.cat(labels)  # type: ignore[arg-type]  # head is validated against Head's choices
