"""Factor uploads of STSA statistics: the client's [Φ Y] turned by a secret random rotation.

A client with n samples, features Φ (n × M) and one-hot labels Y (n × c) owes the server
J = [Φ Y]ᵀ[Φ Y] = [[G, C], [Cᵀ, diag(n_c)]]. When n is small against M (few samples per client
and task, large random-feature dimensions), J has rank at most n, and the n × (M + c) matrix

    F = O [Φ Y],   O Haar-distributed on the orthogonal group O(n), drawn by the client

carries J exactly (FᵀF = J) in n (M + c) numbers instead of M(M + 1)/2 + M c: 40x fewer at
n = 60, M = 5000. It reveals J and nothing else: every B with BᵀB = J is O'[Φ Y] for some
orthogonal O' (both have the same singular values and right singular vectors), and O[Φ Y] for a
Haar O is uniformly distributed over that set whatever [Φ Y] it started from (Haar measure is
invariant). So the server could draw the upload itself from J: it learns no more than from G, C
and the counts, provided it cannot know O (the client draws O with NumPy's PCG64 seeded with 128
bits of operating-system entropy, a statistical generator, not a cryptographic one; with
``noise-seeded`` from (seed, client, task), which a server knowing the seed can undo;
docs/privacy.md).

The server gains a check for free. FᵀF is positive semidefinite by construction, so the (M + c)³/3
Cholesky factorisation that certifies a Gram upload is replaced by one product of cost n M²: what
is left to check is that the label block F_Yᵀ F_Y is diag(n_c) (one-hot labels), the signs of
random ReLU features and the feature norm bound (fcl_flower/analytic/checks.py).

Pure math: no Flower, no I/O. Sampling a Haar rotation follows Mezzadri (2007), "How to generate
random matrices from the classical compact groups": the Q factor of a Gaussian matrix, with the
signs of R's diagonal folded into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .errors import AnalyticInputError
from .packing import copy_rows, packed_length

__all__ = [
    "FactorGram",
    "factor_gram",
    "factor_is_smaller",
    "factor_length",
    "factor_max_rows",
    "haar_rotation",
    "rotated_factor",
]


def factor_length(rows: int, dim: int, classes: int) -> int:
    """Numbers in a factor upload: F (rows × (M + c)) plus the c counts."""
    if rows < 0 or dim < 0 or classes < 0:
        raise AnalyticInputError(f"rows, dim and classes must be >= 0, got {rows}, {dim}, {classes}")
    return rows * (dim + classes) + classes


def factor_is_smaller(rows: int, dim: int, classes: int) -> bool:
    """Whether a factor upload of ``rows`` samples has fewer numbers than the Gram upload
    (packed G, C and the counts): then it is also the cheaper one for the server to check."""
    return factor_length(rows, dim, classes) < packed_length(dim) + dim * classes + classes


def factor_max_rows(dim: int, classes: int) -> int:
    """The most rows a factor upload may have: the largest r with ``factor_is_smaller(r, dim,
    classes)`` (-1 when not even an empty factor is smaller). A taller factor is refused: the
    client sends the Gram then, and the server's product (r M² multiply-adds) never costs more
    than the Gram check it replaces."""
    if dim < 0 or classes < 0:
        raise AnalyticInputError(f"dim and classes must be >= 0, got {dim}, {classes}")
    limit, width = packed_length(dim) + dim * classes, dim + classes
    return (limit - 1) // width if width and limit > 0 else -1


def haar_rotation(size: int, rng: np.random.Generator) -> Tensor:
    """An orthogonal ``size`` × ``size`` matrix (float64) distributed by Haar measure on O(size)."""
    if size < 0:
        raise AnalyticInputError(f"size must be >= 0, got {size}")
    gaussian = torch.from_numpy(rng.standard_normal((size, size)))
    q, r = torch.linalg.qr(gaussian)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0  # a zero pivot has probability 0; keep Q orthogonal regardless
    return q * signs[None, :]


def rotated_factor(features: Tensor, labels: Tensor, classes: int, rng: np.random.Generator) -> Tensor:
    """F = O [Φ Y] (n × (M + c), float64) for features Φ (n × M), labels in 0..classes-1 and a
    Haar rotation O drawn from ``rng``."""
    if features.dim() != 2 or labels.dim() != 1 or labels.shape[0] != features.shape[0]:
        raise AnalyticInputError(
            f"features must be n x M and labels n, got {tuple(features.shape)} and {tuple(labels.shape)}"
        )
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise AnalyticInputError(f"labels must lie in 0..{classes - 1}")
    rows = int(features.shape[0])
    joint = torch.zeros(rows, int(features.shape[1]) + classes, dtype=torch.float64)
    joint[:, : features.shape[1]] = features
    joint[torch.arange(rows), int(features.shape[1]) + labels.to(torch.long)] = 1.0
    return haar_rotation(rows, rng) @ joint


@dataclass(frozen=True)
class FactorGram:
    """What a factor F = [F_Φ F_Y] stands for: G = F_Φᵀ F_Φ as its packed upper triangle,
    C = F_Φᵀ F_Y, the label block F_Yᵀ F_Y (diag(n_c) for one-hot labels), all float64, and the
    most negative entry of G and of C relative to its Cauchy-Schwarz bound: min G_ij / √(G_ii G_jj)
    and min C_ic / √(G_ii (F_YᵀF_Y)_cc) (0 where a diagonal is 0). ``negative_gram_energy``: the
    squared Frobenius norm of the negative part of the scaled G, Σ_{i≠j} min(G_ij, 0)² / (G_ii G_jj)
    over both triangles (what clamping G's negative entries to 0 moves the scaled matrix by)."""

    gram_packed: Tensor
    class_sums: Tensor
    label_gram: Tensor
    lowest_gram: float
    lowest_sums: float
    negative_gram_energy: float = 0.0


def factor_gram(factor: Tensor, dim: int) -> FactorGram:
    """The statistics of ``factor`` (rows × (M + c)), M = ``dim``, in float64.

    G is built straight into its packed upper triangle, one block of ``_ROWS`` rows at a time (a
    product of the factor's columns a..b-1 with columns a..M-1 into one reused buffer, whose rows
    go to their packed slices; ``packing.gram_packed_``'s layout), so no M × M matrix is formed:
    n M² flops for n rows, against (M + c)³/3 for a Cholesky factorisation of J. The signs are
    read from the same block while it is in cache (issue 30: the whole M × M product, its boolean
    mask and its scaled copies as fresh 32 MiB buffers cost ~55 ms an upload at M = 2000, n = 14;
    ~10 ms now).
    """
    if factor.dim() != 2 or not 0 <= dim <= int(factor.shape[1]):
        raise AnalyticInputError(f"factor must be rows x (M + c) with M = {dim}, got shape {tuple(factor.shape)}")
    f = factor.to(torch.float64)
    phi, y = f[:, :dim], f[:, dim:]
    inv = _inverse_or_zero(torch.linalg.vector_norm(phi, dim=0)).numpy()
    packed = torch.empty(packed_length(dim), dtype=torch.float64)
    out, lowest, energy = packed.numpy(), 0.0, 0.0
    rows = min(_ROWS, max(dim, 1))
    buffer = torch.empty(rows * dim, dtype=torch.float64)
    scratch = np.empty(rows * dim, dtype=np.float64)
    transposed = phi.T
    for a in range(0, dim, _ROWS):
        b = min(dim, a + _ROWS)
        block = buffer[: (b - a) * (dim - a)].view(b - a, dim - a)
        torch.mm(transposed[a:b], phi[:, a:], out=block)
        values = block.numpy()
        copy_rows(values, a, dim, out)
        if float(values.min()) < 0:  # scaled only where some entry is negative
            scaled = np.minimum(values, 0.0, out=scratch[: values.size].reshape(values.shape))
            scaled *= inv[a:b, None]
            scaled *= inv[None, a:]
            lowest = min(lowest, float(scaled.min()))
            scaled *= scaled
            # the block's leading (b - a) square is G[a:b, a:b], both triangles (its diagonal is a
            # sum of squares, never negative); the columns beyond it are upper entries, doubled
            energy += float(scaled[:, : b - a].sum()) + 2.0 * float(scaled[:, b - a :].sum())
    sums = phi.T @ y
    label_gram = y.T @ y
    label_inv = _inverse_or_zero(torch.sqrt(torch.diagonal(label_gram)))  # a diagonal of squares: >= 0
    scaled_sums = sums * torch.from_numpy(inv)[:, None] * label_inv[None, :]
    lowest_sums = min(0.0, float(scaled_sums.min())) if scaled_sums.numel() else 0.0
    return FactorGram(packed, sums, label_gram, lowest, lowest_sums, energy)


_ROWS = 64  # rows of G per product block: 64 × M float64 (1 MiB at M = 2000), one reused buffer


def _inverse_or_zero(norms: Tensor) -> Tensor:
    """1 / x where x > 0, else 0 (a zero column scales to zero)."""
    return torch.where(norms > 0, norms.reciprocal(), 0.0)
