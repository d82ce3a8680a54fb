"""Noise on the statistics uploads: the STSA paper's q·N(0, s²), and the Gaussian mechanism of DP.

An upload is made of up to three **blocks** (the registry's ``MethodSpec.upload_noise`` names a
method's):

* ``gram``: the packed upper triangle of G = ΦᵀΦ (STSA), or the Gram FedRAN's client sketches
  by a truncated eigendecomposition (the noise goes on G *before* the sketch, so U stays
  orthonormal and σ descending);
* ``sums``: the class sums C = ΦᵀY (STSA; every dummy client's for STSA-E; FedRAN's B = HᵀY);
* ``counts``: the class counts (STSA, every dummy client's for STSA-E; FedRAN: its sample count ñ).

Every entry of a noised block gets its own i.i.d. Gaussian draw. G is noised on its upper
triangle *including* the diagonal and mirrored, so it stays symmetric and every released number
(off-diagonal or diagonal) carries the same variance.

Two ways to choose the standard deviations (:class:`NoiseScale`), docs/privacy.md §6 derives them:

* the paper's (arXiv 2506.01327, Eqs. 63–64; docs/methods/stsa.md §4.6): q·N(0, s²), i.e. std q·s,
  on the blocks ``noise-on`` names (``features`` = gram and sums);
* differential privacy: with every sample's feature clipped to ‖φ‖ ≤ B, adding or removing one
  sample moves the blocks by at most Δ_gram = ‖φφᵀ‖_F = ‖φ‖² ≤ B² (on the upper triangle: at
  most that), Δ_sums = ‖φ e_yᵀ‖_F ≤ B and Δ_counts = 1. Block j gets std z·Δ_j·√J (J blocks),
  so the whole upload, each block divided by its std, moves by at most
  √(Σ_j Δ_j² / (z Δ_j √J)²) = 1/z: one Gaussian mechanism with noise multiplier z
  (:mod:`fcl_flower.privacy.accountant` calibrates z and composes the releases).

Randomness: :func:`noise_generator` seeds NumPy's PCG64 with 128 fresh bits from the operating
system per upload (the server does not know the seed, so it cannot recompute and subtract the
noise; PCG64 is a statistical generator, not a cryptographic one), unless ``noise-seeded`` asks for the
reproducible generator of (seed, client, task, block) -- for experiments and tests only, since
the server knows the seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from fcl_flower.config import RunConfig

BLOCKS: tuple[str, ...] = ("gram", "sums", "counts")
TARGETS: dict[str, tuple[str, ...]] = {"features": ("gram", "sums"), "counts": ("counts",), "both": BLOCKS}
_DOMAIN = 0x5EED_0015  # separates the noise's seed sequence from every other seeded draw of a run


class NoiseError(ValueError):
    """A noise setting that cannot work (one line)."""


@dataclass(frozen=True)
class NoiseScale:
    """Standard deviation of the noise on every entry of each block of one upload (0: no noise)."""

    gram: float = 0.0
    sums: float = 0.0
    counts: float = 0.0

    def __post_init__(self) -> None:
        for block in BLOCKS:
            value = getattr(self, block)
            if not (value >= 0 and math.isfinite(value)):
                raise NoiseError(f"noise std of {block} must be a finite number >= 0, got {value!r}")

    def of(self, block: str) -> float:
        return float(getattr(self, block))

    def scaled(self, factor: float) -> NoiseScale:
        """Every std times ``factor`` (e.g. √(share of the variance) under secure aggregation)."""
        return NoiseScale(self.gram * factor, self.sums * factor, self.counts * factor)

    @property
    def on(self) -> bool:
        return any(self.of(block) > 0 for block in BLOCKS)

    def as_dict(self) -> dict[str, float]:
        return {block: self.of(block) for block in BLOCKS}


def paper_scale(q: float, s: float, on: str, blocks: Sequence[str]) -> NoiseScale:
    """Eqs. 63–64: q·N(0, s²) (std q·s) on the ``blocks`` of an upload that ``on`` covers."""
    if on not in TARGETS:
        raise NoiseError(f"noise-on must be one of {', '.join(TARGETS)}, got {on!r}")
    if q < 0 or s < 0:
        raise NoiseError(f"q and s must be >= 0, got {q}, {s}")
    std = float(q) * float(s)
    return NoiseScale(**{block: std for block in blocks if block in TARGETS[on]})


def sensitivities(bound: float) -> dict[str, float]:
    """L2 change of each block when one sample with ‖φ‖ ≤ ``bound`` is added or removed."""
    if not (bound > 0 and math.isfinite(bound)):
        raise NoiseError(f"the per-sample bound must be a finite number > 0, got {bound!r}")
    return {"gram": bound * bound, "sums": bound, "counts": 1.0}


def dp_scale(multiplier: float, bound: float, blocks: Sequence[str]) -> NoiseScale:
    """The Gaussian mechanism with noise multiplier z on all ``blocks``: std z·Δ_j·√J each."""
    if not (multiplier > 0 and math.isfinite(multiplier)):
        raise NoiseError(f"the noise multiplier must be a finite number > 0, got {multiplier!r}")
    blocks = tuple(blocks)
    if not blocks or set(blocks) - set(BLOCKS):
        raise NoiseError(f"blocks must be a non-empty subset of {BLOCKS}, got {blocks}")
    delta = sensitivities(bound)
    spread = math.sqrt(len(blocks))
    return NoiseScale(**{block: multiplier * delta[block] * spread for block in blocks})


def effective_multiplier(scale: NoiseScale, bound: float, blocks: Sequence[str]) -> float:
    """z of the mechanism that adds ``scale`` to ``blocks``: 1/√(Σ_j Δ_j²/σ_j²) (inf: no block is
    released, 0: a block is released without noise)."""
    delta = sensitivities(bound)
    total = 0.0
    for block in blocks:
        std = scale.of(block)
        if std == 0:
            return 0.0
        total += (delta[block] / std) ** 2
    return math.inf if total == 0 else 1.0 / math.sqrt(total)


def noise_generator(seeded: bool, key: Sequence[int] = ()) -> np.random.Generator:
    """A Generator for one upload's noise.

    ``seeded``: the reproducible generator of ``key`` (e.g. seed, client, task): the same upload
    gets the same noise on every machine. Otherwise NumPy's PCG64 seeded with 128 bits of fresh
    entropy from the operating system (``SeedSequence()``), which nobody else can reproduce (PCG64
    is a statistical generator, not a cryptographically secure one).
    """
    if not seeded:
        return np.random.default_rng()
    if any(int(k) < 0 for k in key):
        raise NoiseError(f"noise seed keys must be >= 0, got {tuple(key)}")
    return np.random.default_rng([_DOMAIN, *(int(k) for k in key)])


def gaussian(rng: np.random.Generator, shape: Sequence[int] | torch.Size, std: float) -> Tensor:
    """i.i.d. N(0, std²) entries, float64 (zeros when std is 0: nothing is drawn)."""
    shape = tuple(int(d) for d in shape)
    if std == 0:
        return torch.zeros(shape, dtype=torch.float64)
    return torch.from_numpy(rng.normal(0.0, float(std), size=shape))


def add_gaussian(values: Tensor, rng: np.random.Generator, std: float) -> Tensor:
    """``values`` + i.i.d. N(0, std²) per entry, in float64 (``values`` itself when std is 0)."""
    if std == 0:
        return values
    return values.to(torch.float64) + gaussian(rng, values.shape, std)


def symmetric_gaussian(rng: np.random.Generator, dim: int, std: float) -> Tensor:
    """A symmetric dim × dim matrix with i.i.d. N(0, std²) entries on and above the diagonal."""
    upper = torch.triu(gaussian(rng, (dim, dim), std))
    return upper + torch.triu(upper, diagonal=1).T


# ------------------------------------------------------------------------------ a run's noise
def releases_per_target(cfg: RunConfig) -> int:
    """How many releases of a sample's data the (ε, δ) target covers: 1 (``dp-scope = stage``) or
    one per stage (``run``)."""
    return cfg.num_tasks if cfg.dp_scope == "run" else 1


def noise_multiplier(cfg: RunConfig) -> float:
    """z of one full-strength release under ``cfg``'s DP target (dp-accounting's calibration)."""
    from fcl_flower.privacy.accountant import calibrate_multiplier

    return calibrate_multiplier(cfg.dp_epsilon, cfg.dp_delta, releases_per_target(cfg), cfg.dp_accountant)


def upload_scale(cfg: RunConfig) -> NoiseScale | None:
    """The std of the noise one client adds to one plain upload (None: noise is off)."""
    if not cfg.upload_noise:
        return None
    blocks = cfg.method.upload_noise
    if cfg.dp:
        return dp_scale(noise_multiplier(cfg), cfg.feature_clip, blocks)
    return paper_scale(cfg.noise_q, cfg.noise_s, cfg.noise_on, blocks)


def secure_share(cfg: RunConfig, threshold: int) -> float:
    """The factor on a client's noise std in a masked upload opened over ≥ ``threshold`` clients.

    Differential privacy distributes the noise: each client adds variance σ²/t, so a sum over
    |U3| ≥ t survivors carries |U3|/t · σ² ≥ σ², the target, whoever dropped out. The paper's
    noise is per client (Eq. 63): every client adds all of it.
    """
    if threshold < 1:
        raise NoiseError(f"threshold must be >= 1, got {threshold}")
    return 1.0 / math.sqrt(threshold) if cfg.dp else 1.0
