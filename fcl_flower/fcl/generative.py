"""Data-free generative replay: the math of TARGET (ICCV 2023) and LANDER (CVPR 2024).

Both methods distil the global model of the previous task into the next one through synthetic
images: after a task the *server* trains a generator against the frozen global model (no real
data: the teacher's BatchNorm statistics, its class decisions and a student's disagreement are
the only signals), keeps a pool of synthetic images, and the *clients* of the next task add a
knowledge-distillation term on those images to their cross-entropy. LANDER additionally maps
every backbone feature onto a label-text-embedding (LTE) "anchor" of its class and bounds the
distance to it, both on the clients and when generating.

This module holds the pieces as small pure-torch functions and modules (no Flower, no I/O); the
loops that use them are :mod:`strategies.generator` (server) and :mod:`clients.generative`.
Sources (docs/method_notes_target_lander.md §1): [CODE-T] the TARGET code (the authors'
repository and its copy in the STSA repository), [CODE-L] the LANDER code (same).

* :class:`ImageGenerator` -- TARGET's generator: noise z -> Linear -> 2 x (upsample, conv, BN,
  LeakyReLU) -> conv -> sigmoid, an image in [0, 1].
* :class:`AnchorGenerator` -- LANDER's: the class's LTE -> BatchNorm1d -> a "noisy" linear layer
  (one per chunk of samples, re-drawn every synthesis round) -> the same decoder.
* :class:`BatchNormStatistics` -- DeepInversion's feature-statistics loss on every BatchNorm2d
  of the teacher, with the codes' momentum over synthesis rounds.
* :func:`adversarial_divergence` -- the "boundary support" / diversity term: minus the
  teacher-student KL on samples where both agree, so the generator seeks their disagreement.
* :func:`distillation_kl` (server student, T = 20, x T²) and :func:`fcl_flower.fcl.distill.kd_loss`
  (clients, T = 2) -- the two KD losses.
* :func:`bounding_loss`, :func:`lander_loss_weights`, :func:`name_anchors` -- LANDER's bounding
  loss around the anchors, its task-adaptive loss weights and the offline stand-in for the LTE.
* :func:`random_crop_flip`, :func:`normalise`, :func:`to_pool` / :func:`from_pool` -- the
  differentiable augmentation of the synthesis and the 8-bit pool (the codes save PNG files).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .distill import softmax_kl_per_sample
from .errors import FCLInputError

M = TypeVar("M", bound=nn.Module)

__all__ = [
    "AnchorGenerator",
    "BatchNormStatistics",
    "ImageGenerator",
    "ReplayAugment",
    "adversarial_divergence",
    "augment",
    "balanced_targets",
    "bounding_loss",
    "cycle_batches",
    "distillation_kl",
    "first_order_meta_grads",
    "from_pool",
    "lander_loss_weights",
    "name_anchors",
    "normalise",
    "random_crop_flip",
    "reinitialise",
    "replay_augment",
    "to_pool",
]


# ------------------------------------------------------------------------------------ networks
def _decoder(ngf: int, image_shape: tuple[int, int, int]) -> tuple[nn.Sequential, int, int]:
    """The shared decoder of both generators: ``(decoder, init_size, upsamplings)``.

    [CODE-T]/[CODE-L] for 32 and 64 px: a 2·ngf x (H/4)² map, BN, then two (upsample x2, 3x3
    conv, BN, LeakyReLU 0.2) blocks (ngf·2 then ngf channels), a 3x3 conv to the image channels
    and a sigmoid. Larger images (LANDER's ImageNet generator) start from H/16 with four
    upsampling blocks, which keeps the first linear layer small.
    """
    channels, height, width = image_shape
    if height != width:
        raise FCLInputError(f"the generators make square images, got {height}x{width}")
    ups = 2 if height <= 64 else 4
    if height % (2**ups) != 0:
        raise FCLInputError(f"image size {height} must be divisible by {2**ups} for the generator")
    init = height // 2**ups
    layers: list[nn.Module] = [nn.BatchNorm2d(ngf * 2)]
    widths = [ngf * 2] + [ngf * 2 if i < ups - 1 else ngf for i in range(ups)]
    for i in range(ups):
        layers += [
            nn.Upsample(scale_factor=2),
            nn.Conv2d(widths[i], widths[i + 1], 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(widths[i + 1]),
            nn.LeakyReLU(0.2, inplace=True),
        ]
    layers += [nn.Conv2d(ngf, channels, 3, stride=1, padding=1), nn.Sigmoid()]
    return nn.Sequential(*layers), init, ups


class ImageGenerator(nn.Module):
    """TARGET's generator G(z): noise ``(B, nz)`` -> images ``(B, C, H, W)`` in [0, 1]."""

    def __init__(self, nz: int, ngf: int, image_shape: tuple[int, int, int]) -> None:
        super().__init__()
        if nz < 1 or ngf < 1:
            raise FCLInputError(f"nz and ngf must be >= 1, got {nz}, {ngf}")
        self.nz, self.ngf = int(nz), int(ngf)
        self.image_shape = tuple(int(s) for s in image_shape)
        self.decoder, self.init_size, _ = _decoder(ngf, image_shape)
        self.project = nn.Linear(nz, ngf * 2 * self.init_size**2)

    def forward(self, z: Tensor) -> Tensor:
        out = self.project(z).view(z.shape[0], self.ngf * 2, self.init_size, self.init_size)
        return self.decoder(out)


class AnchorGenerator(nn.Module):
    """LANDER's generator: images of given classes from their label-text embeddings.

    ``anchors`` (num_classes, D) are fixed (not trained). A batch of targets is embedded as
    ``BN1d(anchors[targets])``; consecutive chunks of ``chunk`` samples each go through their own
    linear layer D -> nz (the "noisy layer": :meth:`reset_noise` redraws them from N(0, 1) every
    synthesis round, which is where the samples' randomness comes from -- there is no z), then
    a linear layer to the decoder's first map and the decoder shared with TARGET's generator.
    """

    def __init__(
        self, anchors: Tensor, nz: int, ngf: int, image_shape: tuple[int, int, int], *, batch: int, chunk: int = 10
    ) -> None:
        super().__init__()
        if anchors.ndim != 2 or anchors.shape[0] < 1:
            raise FCLInputError(f"anchors must be (num_classes, D), got {tuple(anchors.shape)}")
        if batch < 1 or chunk < 1:
            raise FCLInputError(f"batch and chunk must be >= 1, got {batch}, {chunk}")
        dim = int(anchors.shape[1])
        self.register_buffer("anchors", anchors.detach().float().clone())
        self.ngf, self.chunk, self.batch = int(ngf), int(chunk), int(batch)
        self.embed_norm = nn.BatchNorm1d(dim)
        self.noise = nn.ModuleList(nn.Linear(dim, nz) for _ in range(math.ceil(batch / chunk)))
        self.decoder, self.init_size, _ = _decoder(ngf, image_shape)
        self.project = nn.Linear(nz, ngf * 2 * self.init_size**2)

    def reset_noise(self, generator: torch.Generator) -> None:
        """Redraw the noisy layers: weights N(0, 1), biases 0 ([CODE-L] ``re_init_le``)."""
        with torch.no_grad():
            for layer in self.noise:
                assert isinstance(layer, nn.Linear)
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator))  # drawn on the CPU
                layer.bias.zero_()

    def forward(self, targets: Tensor) -> Tensor:
        if targets.ndim != 1 or len(targets) > self.batch:
            raise FCLInputError(f"targets must be 1-D with at most {self.batch} entries, got {tuple(targets.shape)}")
        anchors: Tensor = self.anchors  # type: ignore[assignment]  # a registered buffer is a Tensor
        embedded = self.embed_norm(anchors[targets])
        chunks = [
            layer(embedded[i * self.chunk : (i + 1) * self.chunk])
            for i, layer in enumerate(self.noise)
            if i * self.chunk < len(targets)
        ]
        out = self.project(torch.cat(chunks)).view(len(targets), self.ngf * 2, self.init_size, self.init_size)
        return self.decoder(out)


def reinitialise(model: M, generator: torch.Generator) -> M:
    """Re-draw a student's weights as [CODE-T]/[CODE-L] ``weight_init`` does, from ``generator``:
    conv and linear weights Xavier-normal (biases N(0, 1)), BatchNorm weights N(1, 0.02) and
    biases 0; other parameters (e.g. a cosine head) are left as they are. ``model`` must be on the
    device of ``generator`` (the CPU)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_normal_(m.weight, generator=generator)
                if m.bias is not None:
                    nn.init.normal_(m.bias, generator=generator)
            elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                nn.init.normal_(m.weight, 1.0, 0.02, generator=generator)
                nn.init.zeros_(m.bias)
    return model


# ------------------------------------------------------------------------------------ DeepInversion
class BatchNormStatistics:
    """DeepInversion's feature-distribution loss over every ``BatchNorm2d`` of a model.

    While attached (``with stats.attached(model): ...``), each BN layer's *input* batch mean μ and
    (biased) variance σ² per channel are compared with the layer's running statistics:
    ``R_l = ||running_var - σ²||₂ + ||running_mean - μ||₂`` and :meth:`loss` is ``Σ_l R_l``.
    With ``momentum`` m > 0 ([CODE-T]/[CODE-L]: 0.9) the batch statistics are blended with an
    exponential average over earlier synthesis rounds, ``(1 - m)·μ + m·μ_prev``, once
    :meth:`end_round` has stored a first round.
    """

    def __init__(self, momentum: float = 0.0) -> None:
        if not 0.0 <= momentum < 1.0:
            raise FCLInputError(f"BN momentum must be in [0, 1), got {momentum}")
        self.momentum = float(momentum)
        self._terms: dict[int, Tensor] = {}
        self._batch: dict[int, tuple[Tensor, Tensor]] = {}
        self._average: dict[int, tuple[Tensor, Tensor]] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self, model: nn.Module) -> BatchNormStatistics:
        self.detach()
        for i, m in enumerate(mod for mod in model.modules() if isinstance(mod, nn.BatchNorm2d)):
            self._handles.append(m.register_forward_hook(self._hook(i)))
        if not self._handles:
            raise FCLInputError("the model has no BatchNorm2d layer: DeepInversion has no statistics to match")
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> BatchNormStatistics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _hook(self, index: int) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], None]:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            assert isinstance(module, nn.BatchNorm2d)
            x = inputs[0]
            mean = x.mean(dim=(0, 2, 3))
            var = x.transpose(0, 1).reshape(x.shape[1], -1).var(dim=1, unbiased=False)
            self._batch[index] = (mean, var)
            running_mean, running_var = module.running_mean, module.running_var
            assert running_mean is not None and running_var is not None
            if index in self._average:
                prev_mean, prev_var = self._average[index]
                mean = (1 - self.momentum) * mean + self.momentum * prev_mean
                var = (1 - self.momentum) * var + self.momentum * prev_var
            self._terms[index] = torch.linalg.vector_norm(running_var - var) + torch.linalg.vector_norm(
                running_mean - mean
            )

        return hook

    def loss(self) -> Tensor:
        """Σ_l R_l of the last forward pass."""
        if not self._terms:
            raise FCLInputError("no forward pass through the attached model yet")
        return torch.stack([self._terms[i] for i in sorted(self._terms)]).sum()

    def end_round(self) -> None:
        """Fold the last forward pass's batch statistics into the running average (momentum > 0)."""
        if self.momentum == 0.0:
            return
        for i, (mean, var) in self._batch.items():
            mean, var = mean.detach(), var.detach()
            if i in self._average:
                prev_mean, prev_var = self._average[i]
                mean = self.momentum * prev_mean + (1 - self.momentum) * mean
                var = self.momentum * prev_var + (1 - self.momentum) * var
            self._average[i] = (mean, var)


# ------------------------------------------------------------------------------------ losses
def _check_pair(a: Tensor, b: Tensor) -> None:
    if a.ndim != 2 or a.shape != b.shape:
        raise FCLInputError(f"logits must both be (B, C), got {tuple(a.shape)} and {tuple(b.shape)}")


def adversarial_divergence(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """``-mean_i( m_i · KL(softmax(t_i) || softmax(s_i)) )``, m_i = 1 where student and teacher
    pick the same class ([CODE-T]/[CODE-L]; TARGET's "boundary support" term).

    Minimising it drives the generator towards samples on which the student still disagrees with
    the teacher; once they disagree (m_i = 0) the sample stops pushing. Gradients flow into both
    logit tensors (the generator reaches both through the images); neither model is updated here.
    """
    _check_pair(student_logits, teacher_logits)
    mask = (student_logits.argmax(dim=1) == teacher_logits.argmax(dim=1)).to(student_logits.dtype)
    log_s = F.log_softmax(student_logits, dim=1)
    log_t = F.log_softmax(teacher_logits, dim=1)
    kl = (log_t.exp() * (log_t - log_s)).sum(dim=1)
    return -(kl * mask).mean()


def distillation_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """``T² · mean_i KL(softmax(t_i/T) || softmax(s_i/T))``: the server student's loss
    ([CODE-T]/[CODE-L] ``KLDiv``, T = 20); the teacher side is detached."""
    _check_pair(student_logits, teacher_logits)
    return softmax_kl_per_sample(teacher_logits, student_logits, temperature).mean() * temperature**2


def bounding_loss(embeddings: Tensor, anchors: Tensor, radius: float) -> Tensor:
    """LANDER's bounding loss ``max(0, MSE(embeddings, anchors) - r)``.

    As in [CODE-L], the squared error is averaged over the batch *and* the embedding dimensions
    before the hinge: the batch may sit anywhere inside the radius-``r`` ball around its anchors
    (the "flexible" constraint the paper motivates); ``r = 0`` is plain MSE pulling onto them.
    """
    if embeddings.shape != anchors.shape or embeddings.ndim != 2:
        raise FCLInputError(
            f"embeddings and anchors must both be (B, D), got {tuple(embeddings.shape)}, {tuple(anchors.shape)}"
        )
    if radius < 0:
        raise FCLInputError(f"radius must be >= 0, got {radius}")
    return F.relu(F.mse_loss(embeddings, anchors.detach()) - radius)


def lander_loss_weights(num_old: int, num_seen: int, cur: float, pre: float) -> tuple[float, float]:
    """LANDER's task-adaptive weights of the current-task and the distillation terms ([CODE-L]):
    with a = log2(C_seen/2 + 1) and b = sqrt(C_old / C_seen),
    ``w_cur = cur · (1 + 1/a) / b`` and ``w_pre = pre · a · b``: the more old classes, the more the
    distillation weighs."""
    if not 0 < num_old < num_seen:
        raise FCLInputError(f"need 0 < old classes < seen classes, got {num_old}, {num_seen}")
    a = math.log2(num_seen / 2 + 1)
    b = math.sqrt(num_old / num_seen)
    return cur * (1 + 1 / a) / b, pre * a * b


def balanced_targets(batch: int, num_classes: int, generator: torch.Generator) -> Tensor:
    """LANDER's synthesis labels: every class ``batch // num_classes`` times (in class order), the
    remainder drawn uniformly at random, remainder last."""
    if batch < 1 or num_classes < 1:
        raise FCLInputError(f"batch and num_classes must be >= 1, got {batch}, {num_classes}")
    repeats, rest = divmod(batch, num_classes)
    extra = torch.randint(num_classes, (rest,), generator=generator)
    return torch.cat([torch.arange(num_classes).repeat(repeats), extra])


def cycle_batches(n: int, batch: int, generator: torch.Generator) -> Iterator[Tensor]:
    """Endless batches of indices into ``n`` items, reshuffled every pass, the last batch of a pass
    possibly short (a cycled, shuffled DataLoader: [CODE-T]/[CODE-L] ``DataIter``)."""
    if n < 1 or batch < 1:
        raise FCLInputError(f"need n >= 1 and batch >= 1, got {n}, {batch}")
    while True:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch):
            yield order[start : start + batch]


def first_order_meta_grads(meta: nn.Module, fast: nn.Module) -> None:
    """First-order MAML ([CODE-T] ``fomaml_grad``): add the fast copy's gradients to the meta
    generator's, parameter by parameter (the meta optimiser steps once per synthesis round)."""
    for p, q in zip(meta.parameters(), fast.parameters(), strict=True):
        if q.grad is None:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.add_(q.grad)


def name_anchors(names: Sequence[str], dim: int, norm: float = 10.0) -> Tensor:
    """Deterministic stand-ins for label-text embeddings when no text encoder is available.

    Each class name is hashed (SHA-256 of its UTF-8 text) to the seed of a standard normal
    vector of length ``dim``, scaled to Euclidean norm ``norm`` (the LTE [CODE-L] ships have
    norm ≈ 10 in 512 dims, i.e. entries of scale ≈ 0.44, which the default radius 0.015 is tuned
    to). Same names -> same anchors on every machine; different names -> nearly orthogonal
    anchors (no semantics: "cat" is no closer to "dog" than to "truck").
    """
    if dim < 1 or norm <= 0:
        raise FCLInputError(f"dim must be >= 1 and norm > 0, got {dim}, {norm}")
    if len(set(names)) != len(names):
        raise FCLInputError("class names must be distinct")
    rows = []
    for name in names:
        seed = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")
        v = torch.randn(dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        rows.append(v * (norm / torch.linalg.vector_norm(v)))
    return torch.stack(rows).float()


# ------------------------------------------------------------------------------------ images
@dataclass(frozen=True)
class ReplayAugment:
    """The augmentation applied to synthetic images (generation, student and client KD).

    ``padding``: zero-padded random crop back to the image size (0: none); ``flip``: random
    horizontal flip; ``mean``/``std``: per-channel normalisation (None: images stay in [0, 1]).
    """

    padding: int
    flip: bool
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None


def replay_augment(dataset: str, image_size: int) -> ReplayAugment:
    """[CODE-T]/[CODE-L]: crop with padding 4 + flip, then the dataset's normalisation, for the
    natural-image datasets. Digits and the synthetic set have no train augmentation and no
    normalisation: a 1-pixel crop (4 px scaled to 8 px images) and no flip (a mirrored digit is
    not a digit)."""
    from fcl_flower.data.transforms import (
        CIFAR100_MEAN,
        CIFAR100_STD,
        IMAGENET_MEAN,
        IMAGENET_STD,
        TINY_IMAGENET_MEAN,
        TINY_IMAGENET_STD,
    )

    if dataset in ("digits", "synthetic"):
        return ReplayAugment(padding=max(1, image_size // 8) if image_size else 1, flip=False)
    if dataset == "cifar100":  # CIFAR-224 (the ViT pipeline) has no normalisation
        return ReplayAugment(4, True, *((None, None) if image_size else (CIFAR100_MEAN, CIFAR100_STD)))
    if dataset == "tiny-imagenet":
        return ReplayAugment(4, True, TINY_IMAGENET_MEAN, TINY_IMAGENET_STD)
    return ReplayAugment(4, True, IMAGENET_MEAN, IMAGENET_STD)


def random_crop_flip(images: Tensor, padding: int, flip: bool, generator: torch.Generator) -> Tensor:
    """Per-sample zero-padded random crop (offsets uniform in [0, 2·padding]) and random
    horizontal flip (p = 1/2), differentiable in the images (kornia's ``RandomCrop(padding)`` +
    ``RandomHorizontalFlip`` in [CODE-T]/[CODE-L])."""
    if images.ndim != 4:
        raise FCLInputError(f"images must be (B, C, H, W), got {tuple(images.shape)}")
    b, _, h, w = images.shape
    out = images
    if padding > 0:
        padded = F.pad(images, (padding, padding, padding, padding))
        dy = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
        dx = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
        rows = (dy[:, None] + torch.arange(h)[None, :]).to(images.device)  # (B, H)
        cols = (dx[:, None] + torch.arange(w)[None, :]).to(images.device)  # (B, W)
        batch = torch.arange(b, device=images.device)[:, None, None]
        out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
    if flip:
        flips = (torch.rand(b, generator=generator) < 0.5).to(images.device)
        out = torch.where(flips[:, None, None, None], out.flip(-1), out)
    return out


def normalise(images: Tensor, mean: Tensor | Sequence[float] | None, std: Tensor | Sequence[float] | None) -> Tensor:
    """``(x - mean) / std`` per channel; identity when either is None. Tensors stay differentiable
    (LANDER learns its "data stats" this way)."""
    if mean is None or std is None:
        return images
    m = torch.as_tensor(mean, dtype=images.dtype, device=images.device)
    s = torch.as_tensor(std, dtype=images.dtype, device=images.device)
    return (images - m[None, :, None, None]) / s[None, :, None, None]


def augment(images: Tensor, aug: ReplayAugment, generator: torch.Generator) -> Tensor:
    """:func:`random_crop_flip` then :func:`normalise` with ``aug``'s settings."""
    return normalise(random_crop_flip(images, aug.padding, aug.flip, generator), aug.mean, aug.std)


def to_pool(images: Tensor) -> Tensor:
    """Generator output in [0, 1] (B, C, H, W) -> uint8 (B, H, W, C), truncating as the codes'
    PNG export does (``(x·255).astype(uint8)``)."""
    return (images.detach().clamp(0, 1) * 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu()


def from_pool(pool: Tensor) -> Tensor:
    """uint8 (N, H, W, C) -> float32 (N, C, H, W) in [0, 1]."""
    if pool.dtype != torch.uint8 or pool.ndim != 4:
        raise FCLInputError(f"a synthetic pool is uint8 (N, H, W, C), got {pool.dtype} {tuple(pool.shape)}")
    return pool.permute(0, 3, 1, 2).float() / 255.0
