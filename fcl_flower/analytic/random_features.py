"""Random ReLU feature map R(f) = ReLU(f · W_rand) of STSA (docs/methods/stsa.md §2.3, Eq. 1).

The projection is regenerated from a shared integer seed by every client and by the server, so
it never travels over the wire. It is drawn from a CPU ``torch.Generator`` in float64: the same
seed gives bit-identical matrices whatever device the features later live on.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import AnalyticInputError

__all__ = ["clip_rows", "random_features", "random_projection"]


def random_projection(in_dim: int, rf_dim: int, seed: int) -> Tensor | None:
    """W_rand with i.i.d. N(0, 1) entries, shape (in_dim, rf_dim), float64, on CPU.

    No scaling and no bias, as in the reference code: γ is tuned for this raw scale.
    Returns ``None`` when ``rf_dim == 0`` or ``rf_dim == in_dim``: then there is no random
    mapping and Φ = F (the "M = d" point of the paper's M ablation, which also skips the ReLU).
    """
    if not isinstance(in_dim, int) or in_dim <= 0:
        raise AnalyticInputError(f"in_dim must be a positive int, got {in_dim!r}")
    if not isinstance(rf_dim, int) or rf_dim < 0:
        raise AnalyticInputError(f"rf_dim must be a non-negative int, got {rf_dim!r}")
    if rf_dim == 0 or rf_dim == in_dim:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed))
    return torch.randn(in_dim, rf_dim, generator=generator, dtype=torch.float64, device="cpu")


def clip_rows(rows: Tensor, bound: float) -> Tensor:
    """Each row scaled down to L2 norm at most ``bound`` (0: unchanged): φ ← φ · min(1, B / ‖φ‖).

    This is what gives every sample's contribution a known size: tr(ΦᵀΦ) ≤ n B² (the server's
    upload check) and a per-sample sensitivity of B² and B (the noise of differential privacy).
    """
    if bound < 0 or not torch.isfinite(torch.tensor(bound)):
        raise AnalyticInputError(f"clip bound must be a finite number >= 0, got {bound!r}")
    if bound == 0 or rows.numel() == 0:
        return rows
    norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
    return rows * torch.clamp(bound / norms.clamp_min(torch.finfo(rows.dtype).tiny), max=1.0)


def random_features(features: Tensor, projection: Tensor | None, clip: float = 0.0) -> Tensor:
    """Φ = ReLU(F @ W_rand) in float64; Φ = F (float64, no ReLU) when ``projection`` is None;
    with ``clip`` B > 0 every row is then scaled to norm at most B (:func:`clip_rows`).

    ``features`` is (n, d), typically float32 backbone output; the product is taken in float64
    because the Gram matrix built from Φ is summed over many samples and clients.
    """
    if features.dim() != 2:
        raise AnalyticInputError(f"features must be 2-D (n, d), got shape {tuple(features.shape)}")
    feats = features.to(torch.float64)
    if projection is None:
        return clip_rows(feats, clip)
    if projection.dim() != 2 or projection.shape[0] != feats.shape[1]:
        raise AnalyticInputError(
            f"projection shape {tuple(projection.shape)} does not match feature dim {feats.shape[1]}"
        )
    proj = projection.to(device=feats.device, dtype=torch.float64)
    return clip_rows(torch.relu(feats @ proj), clip)
