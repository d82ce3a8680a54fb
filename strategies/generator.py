"""Data-free knowledge transfer on the server: the component TARGET and LANDER share.

After task t the strategy hands the global model to :meth:`DataFreeReplay.synthesize`. A frozen
copy of it is the *teacher*; a re-initialised copy is the *student*. A generator is trained for
``generator-rounds`` synthesis rounds of ``generator-steps`` Adam iterations each, on

    bn · Σ_l DeepInversion(l) + oh · CE(teacher(x̂), ŷ) + adv · adversarial(student, teacher) [+ LANDER's anchor term]

(math in :mod:`fcl_flower.fcl.generative`); each round's lowest-loss batch joins the pool, and
after the warm-up the student is distilled from the teacher on the pool (its disagreement with
the teacher is what the adversarial term seeks). The pool -- 8-bit images, unlabelled -- is what
the clients of task t+1 receive (``TrainIns.synthetic``); the intended labels stay here and are
only used to report how often the teacher recognises its own synthetic classes.

The two flavours, as their codes run them (docs/method_notes_target_lander.md §2-§3):

* ``target``: a noise-driven generator meta-learned by first-order MAML -- every round optimises
  a fresh copy of the generator and the noise z towards random labels, the meta generator takes
  the sum of the copy's gradients; fixed dataset normalisation; one student optimiser (SGD with
  a cosine schedule) for the whole task, ``student-steps`` KL steps per round.
* ``lander``: the label-text-anchor generator (:class:`~fcl_flower.fcl.generative.AnchorGenerator`)
  trained directly, its noisy layers redrawn each round, class-balanced labels, learnable data
  statistics (mean/std) in place of the fixed normalisation, the bounding loss of the teacher's
  anchor embeddings around the labels' anchors, and ``generator-warmup`` extra rounds whose
  images are not kept; the student (fresh SGD each round) also matches the teacher's anchor
  embeddings.

Every random draw comes from a generator seeded by (run seed, task, flavour): the same seed gives
the same pool.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord

from fcl_flower.config import RunConfig
from fcl_flower.fcl.generative import (
    AnchorGenerator,
    BatchNormStatistics,
    ImageGenerator,
    adversarial_divergence,
    augment,
    balanced_targets,
    bounding_loss,
    cycle_batches,
    distillation_kl,
    first_order_meta_grads,
    from_pool,
    normalise,
    random_crop_flip,
    reinitialise,
    replay_augment,
    to_pool,
)
from fcl_flower.models import IncrementalClassifier
from fcl_flower.tensors import tensor_record

Flavour = Literal["target", "lander"]


@dataclass(frozen=True)
class FlavourConstants:
    """The synthesis constants each code hard-codes (CIFAR-100 settings; §2.2, §3.2 of the notes)."""

    nz: int = 256  # noise / noisy-layer width
    ngf: int = 64  # generator width
    lr_g: float = 2e-3  # Adam learning rate of the generator
    lr_extra: float = 0.01  # TARGET: of the noise z; LANDER: of the learnable mean/std
    oh: float = 0.5  # weight of the teacher's cross-entropy
    adv: float = 1.0  # weight of the adversarial term
    bn_momentum: float = 0.9
    temperature: float = 20.0  # of the student's KL
    student_lr: float = 0.2
    student_wd: float = 1e-4


TARGET_CONSTANTS = FlavourConstants()
LANDER_CONSTANTS = FlavourConstants(student_lr=0.1, student_wd=2e-4)
TARGET_STUDENT_T_MAX, TARGET_STUDENT_ETA_MIN = 200, 2e-4  # [CODE-T] CosineAnnealingLR of the student
LANDER_CHUNK = 10  # samples per noisy layer ([CODE-L] nl)
LANDER_STATS_INIT = (0.5, 0.2)  # learnable data mean / std, per channel ((0, 1) without normalisation)


@dataclass
class SynthesisResult:
    """A task's synthetic pool and what happened while making it."""

    pool: torch.Tensor  # uint8 (N, H, W, C): what clients receive
    labels: torch.Tensor  # int64 (N,): the class each image was generated for (server only)
    log: dict[str, Any]


class DataFreeReplay:
    """Builds the synthetic pool after each task (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        image_shape: tuple[int, int, int],
        flavour: Flavour,
        device: torch.device,
        anchors: torch.Tensor | None = None,
    ) -> None:
        if flavour == "lander" and anchors is None:
            raise ValueError("LANDER's synthesis needs the label-text anchors")
        self.cfg = cfg
        self.image_shape = image_shape
        self.flavour: Flavour = flavour
        self.device = device
        self.anchors = None if anchors is None else anchors.float().to(device)
        self.constants = TARGET_CONSTANTS if flavour == "target" else LANDER_CONSTANTS
        self.aug = replay_augment(cfg.dataset, image_shape[1] if cfg.image_size else 0)
        self.pool = torch.zeros(0, image_shape[1], image_shape[2], image_shape[0], dtype=torch.uint8)
        self.labels = torch.zeros(0, dtype=torch.int64)

    # ------------------------------------------------------------------ public
    def synthesize(self, model: IncrementalClassifier, num_seen: int, task: int) -> SynthesisResult:
        """Train a generator against ``model`` (frozen) over its ``num_seen`` classes; the pool
        replaces the previous task's (the new teacher knows every class seen so far)."""
        began = time.perf_counter()
        salt = 1 if self.flavour == "target" else 2
        rng = torch.Generator().manual_seed(
            int(np.random.SeedSequence([self.cfg.seed, task, salt]).generate_state(1)[0])
        )
        teacher = copy.deepcopy(model).to(self.device).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        student = reinitialise(copy.deepcopy(model).cpu(), rng).to(self.device)
        for p in student.parameters():
            p.requires_grad_(True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(2**31 - 1, (1,), generator=rng)))
            if self.flavour == "target":
                result = self._target(teacher, student, num_seen, rng)
            else:
                result = self._lander(teacher, student, num_seen, rng)
        self.pool, self.labels = result.pool, result.labels
        result.log["intended_accuracy"] = self.intended_accuracy(teacher, num_seen)
        result.log["pool"] = len(self.labels)
        result.log["seconds"] = time.perf_counter() - began  # wall time of the synthesis (part of the stage's)
        return result

    def record(self) -> ArrayRecord:
        """The pool as the clients receive it: one uint8 array ``images`` (N, H, W, C)."""
        return tensor_record({"images": self.pool})

    @torch.no_grad()
    def intended_accuracy(self, model: IncrementalClassifier, num_seen: int) -> float:
        """Percent of the pool ``model`` classifies as the class it was generated for."""
        if not len(self.labels):
            return float("nan")
        model.eval().to(self.device)
        correct = 0
        for start in range(0, len(self.labels), 512):
            x = normalise(from_pool(self.pool[start : start + 512]).to(self.device), self.aug.mean, self.aug.std)
            pred = model(x)[:, :num_seen].argmax(dim=1).cpu()
            correct += int((pred == self.labels[start : start + 512]).sum())
        return 100.0 * correct / len(self.labels)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"pool": self.pool, "labels": self.labels}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.pool, self.labels = state["pool"], state["labels"]

    # ------------------------------------------------------------------ TARGET
    def _target(
        self, teacher: IncrementalClassifier, student: IncrementalClassifier, num_seen: int, rng: torch.Generator
    ) -> SynthesisResult:
        cfg, k = self.cfg, self.constants
        generator = ImageGenerator(k.nz, k.ngf, self.image_shape).to(self.device).train()
        meta = torch.optim.Adam(generator.parameters(), k.lr_g * cfg.generator_steps, betas=(0.5, 0.999))
        opt_s = torch.optim.SGD(student.parameters(), lr=k.student_lr, momentum=0.9, weight_decay=k.student_wd)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt_s, TARGET_STUDENT_T_MAX, eta_min=TARGET_STUDENT_ETA_MIN)
        bn = BatchNormStatistics(k.bn_momentum)
        pools, labels, log = [], [], _new_log()
        for r in range(cfg.generator_rounds):
            adversarial = k.adv > 0 and r >= cfg.generator_warmup
            z = torch.randn(cfg.synthesis_batch, k.nz, generator=rng).to(self.device).requires_grad_(True)
            targets = torch.randint(num_seen, (cfg.synthesis_batch,), generator=rng).sort().values.to(self.device)
            fast = copy.deepcopy(generator)
            groups: list[dict[str, Any]] = [{"params": fast.parameters()}, {"params": [z], "lr": k.lr_extra}]
            opt = torch.optim.Adam(groups, lr=k.lr_g, betas=(0.5, 0.999))
            best, best_cost = None, math.inf
            student.eval()
            bn.attach(teacher)
            for it in range(cfg.generator_steps):
                images = fast(z)
                x = augment(images, self.aug, rng)
                t_logits = teacher(x)[:, :num_seen]
                terms = {"bn": bn.loss(), "ce": F.cross_entropy(t_logits, targets)}
                if adversarial:
                    terms["adv"] = adversarial_divergence(student(x)[:, :num_seen], t_logits)
                loss = cfg.generator_bn * terms["bn"] + k.oh * terms["ce"] + k.adv * terms.get("adv", torch.zeros(()))
                cost = float(loss.detach())
                if cost < best_cost or best is None:
                    best_cost, best = cost, images.detach()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if it == 0:
                    meta.zero_grad(set_to_none=True)
                first_order_meta_grads(generator, fast)
                if it == cfg.generator_steps - 1:
                    meta.step()
                opt.step()
                _log_step(log, it, cfg.generator_steps, loss, terms)
            bn.detach()
            bn.end_round()
            assert best is not None
            pools.append(to_pool(best))
            labels.append(targets.cpu())
            if r >= cfg.generator_warmup:
                pool = torch.cat(pools)
                log["student_kd"].append(
                    self._train_student(teacher, student, opt_s, pool, num_seen, rng, anchors=None)
                )
                sched.step()
        return SynthesisResult(torch.cat(pools), torch.cat(labels), log)

    # ------------------------------------------------------------------ LANDER
    def _lander(
        self, teacher: IncrementalClassifier, student: IncrementalClassifier, num_seen: int, rng: torch.Generator
    ) -> SynthesisResult:
        cfg, k = self.cfg, self.constants
        assert self.anchors is not None
        anchors = self.anchors
        generator = AnchorGenerator(
            anchors, k.nz, k.ngf, self.image_shape, batch=cfg.synthesis_batch, chunk=LANDER_CHUNK
        ).to(self.device)
        generator.train()
        channels = self.image_shape[0]
        init = LANDER_STATS_INIT if self.aug.mean is not None else (0.0, 1.0)  # start at the pipeline's scale
        mean = torch.full((channels,), init[0], device=self.device, requires_grad=True)
        std = torch.full((channels,), init[1], device=self.device, requires_grad=True)
        bn = BatchNormStatistics(k.bn_momentum)
        pools, labels, log = [], [], _new_log()
        warmup = cfg.generator_warmup
        for ep in range(1, cfg.generator_rounds + warmup + 1):  # [CODE-L]: syn_round + warmup rounds, 1-based
            adversarial = k.adv > 0 and ep > warmup + 2
            generator.reset_noise(rng)
            targets = balanced_targets(cfg.synthesis_batch, num_seen, rng).to(self.device)
            groups: list[dict[str, Any]] = [
                {"params": generator.parameters()},
                {"params": [mean, std], "lr": k.lr_extra},
            ]
            opt = torch.optim.Adam(groups, lr=k.lr_g, betas=(0.5, 0.999))
            best, best_cost = None, math.inf
            student.eval()
            bn.attach(teacher)
            for it in range(cfg.generator_steps):
                images = generator(targets)
                x = normalise(random_crop_flip(images, self.aug.padding, self.aug.flip, rng), mean, std)
                t_logits, t_anchor = teacher.forward_with_anchor(x)
                t_logits = t_logits[:, :num_seen]
                terms = {
                    "bn": bn.loss(),
                    "ce": F.cross_entropy(t_logits, targets),
                    "anchor": bounding_loss(t_anchor, anchors[targets], cfg.lander_radius),
                }
                if adversarial:
                    terms["adv"] = adversarial_divergence(student(x)[:, :num_seen], t_logits)
                loss = (
                    cfg.generator_bn * terms["bn"]
                    + k.oh * terms["ce"]
                    + k.adv * terms.get("adv", torch.zeros(()))
                    + cfg.lander_ltc * terms["anchor"]
                )
                cost = float(loss.detach())
                if cost < best_cost or best is None:
                    best_cost, best = cost, images.detach()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                _log_step(log, it, cfg.generator_steps, loss, terms)
            bn.detach()
            bn.end_round()
            if ep >= warmup:  # [CODE-L]: kept (and the student trained) from the warm-up's last round on
                assert best is not None
                pools.append(to_pool(best))
                labels.append(targets.cpu())
                opt_s = torch.optim.SGD(student.parameters(), lr=k.student_lr, momentum=0.9, weight_decay=k.student_wd)
                pool = torch.cat(pools)
                log["student_kd"].append(
                    self._train_student(teacher, student, opt_s, pool, num_seen, rng, anchors=True)
                )
        log["data_mean"], log["data_std"] = mean.detach().cpu().tolist(), std.detach().cpu().tolist()
        return SynthesisResult(torch.cat(pools), torch.cat(labels), log)

    # ------------------------------------------------------------------ the student
    def _train_student(
        self,
        teacher: IncrementalClassifier,
        student: IncrementalClassifier,
        optimiser: torch.optim.Optimizer,
        pool: torch.Tensor,
        num_seen: int,
        rng: torch.Generator,
        *,
        anchors: bool | None,
    ) -> float:
        """``student-steps`` KL steps on batches of the pool (train augmentation, as the codes
        reload their PNGs with it); LANDER adds the anchor-embedding MSE. Mean loss (float64)."""
        cfg, k = self.cfg, self.constants
        batch = cfg.synthesis_batch if self.flavour == "target" else cfg.batch_size
        student.train()
        total, steps = 0.0, 0
        for _, idx in zip(range(cfg.student_steps), cycle_batches(len(pool), batch, rng)):
            x = augment(from_pool(pool[idx]).to(self.device), self.aug, rng)
            if anchors:
                with torch.no_grad():
                    t_logits, t_anchor = teacher.forward_with_anchor(x)
                s_logits, s_anchor = student.forward_with_anchor(x)
                loss = distillation_kl(
                    s_logits[:, :num_seen], t_logits[:, :num_seen], k.temperature
                ) + cfg.lander_ltc * F.mse_loss(s_anchor, t_anchor)
            else:
                with torch.no_grad():
                    t_logits = teacher(x)
                loss = distillation_kl(student(x)[:, :num_seen], t_logits[:, :num_seen], k.temperature)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            total += float(loss.detach().double())
            steps += 1
        return total / max(steps, 1)


def _new_log() -> dict[str, Any]:
    return {"generator_loss_first": [], "generator_loss_last": [], "last_terms": {}, "student_kd": []}


def _log_step(log: dict[str, Any], it: int, steps: int, loss: torch.Tensor, terms: dict[str, torch.Tensor]) -> None:
    """Per round: the objective at its first and last iteration, and the last iteration's terms."""
    value = float(loss.detach().double())
    if it == 0:
        log["generator_loss_first"].append(value)
    if it == steps - 1:
        log["generator_loss_last"].append(value)
        log["last_terms"] = {name: float(t.detach().double()) for name, t in terms.items()}
