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
from .packing import gram_packed_, packed_length

__all__ = [
    "FactorGram",
    "factor_gram",
    "factor_is_smaller",
    "factor_length",
    "factor_max_rows",
    "factor_packed_gram",
    "factor_signs",
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
    """What a factor F = [F_Φ F_Y] stands for: G = F_Φᵀ F_Φ as its packed upper triangle (empty
    where not asked for), its diagonal, C = F_Φᵀ F_Y, the label block F_Yᵀ F_Y (diag(n_c) for
    one-hot labels), all float64, and the most negative entry of G and of C relative to its
    Cauchy-Schwarz bound: min G_ij / √(G_ii G_jj) and min C_ic / √(G_ii (F_YᵀF_Y)_cc) (0 where a
    diagonal is 0). ``negative_gram_energy``: the squared Frobenius norm of the negative part of the
    scaled G, Σ_{i≠j} min(G_ij, 0)² / (G_ii G_jj) over both triangles (what clamping G's negative
    entries to 0 moves the scaled matrix by)."""

    gram_packed: Tensor
    class_sums: Tensor
    label_gram: Tensor
    lowest_gram: float
    lowest_sums: float
    negative_gram_energy: float
    diagonal: Tensor


def factor_gram(factor: Tensor, dim: int, *, packed: bool = True) -> FactorGram:
    """The statistics of ``factor`` (rows × (M + c)), M = ``dim``, in float64; G packed only with
    ``packed`` (the server's check needs G's signs, not G: a sum of factors is made by one product
    of their stacked rows, strategies/stsa.py).

    G's diagonal is each feature column's sum of squares. Its signs come from the product of the
    non-zero columns scaled to unit norm (:func:`factor_signs`; a zero column, a feature no sample
    activates, has exactly zero products: a third of the features at M = 2000 on digits), G itself
    from ``packing.gram_packed_``: one block of rows at a time into a reused buffer, no M × M
    matrix, n M² flops for n rows against (M + c)³/3 for a Cholesky factorisation of J (issue 30: the whole M × M product, its boolean
    mask and its scaled copies as fresh 32 MiB buffers cost ~55 ms an upload at M = 2000, n = 14).
    """
    if factor.dim() != 2 or not 0 <= dim <= int(factor.shape[1]):
        raise AnalyticInputError(f"factor must be rows x (M + c) with M = {dim}, got shape {tuple(factor.shape)}")
    f = factor.to(torch.float64)
    phi, y = f[:, :dim].contiguous(), f[:, dim:]
    diagonal = (phi * phi).sum(dim=0)
    inv = _inverse_or_zero(diagonal.sqrt())
    live = diagonal > 0  # a zero column's products are exactly 0: no sign to read there
    lowest, energy = factor_signs(phi[:, live] * inv[live][None, :])
    gram = _packed(phi) if packed else torch.empty(0, dtype=torch.float64)
    sums = phi.T @ y
    label_gram = y.T @ y
    label_inv = _inverse_or_zero(torch.sqrt(torch.diagonal(label_gram)))  # a diagonal of squares: >= 0
    scaled_sums = sums * inv[:, None] * label_inv[None, :]
    lowest_sums = min(0.0, float(scaled_sums.min())) if scaled_sums.numel() else 0.0
    return FactorGram(gram, sums, label_gram, lowest, lowest_sums, energy, diagonal)


def factor_packed_gram(factor: Tensor, dim: int, *, clamp: bool = False) -> Tensor:
    """G = F_Φᵀ F_Φ of ``factor`` (rows × (M + c)), M = ``dim``, packed, float64; with ``clamp`` its
    negative entries set to 0 (for random ReLU features, whose G is non-negative: what is left is
    rounding of true zeros, once the signs passed their check)."""
    if factor.dim() != 2 or not 0 <= dim <= int(factor.shape[1]):
        raise AnalyticInputError(f"factor must be rows x (M + c) with M = {dim}, got shape {tuple(factor.shape)}")
    return _packed(factor[:, :dim].to(torch.float64).contiguous(), clamp)


def _packed(phi: Tensor, clamp: bool = False) -> Tensor:
    gram = torch.empty(packed_length(int(phi.shape[1])), dtype=torch.float64)
    gram_packed_(gram.numpy(), phi, accumulate=False, clamp=clamp)
    return gram


def factor_signs(scaled: Tensor) -> tuple[float, float]:
    """(the smallest off-diagonal-or-not entry of S = XᵀX, if negative, else 0; Σ_{i≠j} min(S_ij,
    0)² over both triangles) for ``scaled`` X (n × M float64, its columns scaled to unit norm or
    zero, so S is G scaled by its diagonal). S is formed one block of ``_ROWS`` rows at a time
    (rows a..b-1 × columns a..M-1) into one reused buffer and read while the block is in cache:
    the product, a minimum, a clamp and a dot product. A block holds its leading square S[a:b, a:b]
    whole (both triangles; the diagonal, a sum of squares, is never negative) and the columns beyond
    once, so its share is 2 Σ min(S, 0)² less the square's."""
    if scaled.dim() != 2 or scaled.dtype != torch.float64:
        raise AnalyticInputError(f"factor_signs needs n x M float64, got {tuple(scaled.shape)} {scaled.dtype}")
    x = scaled.contiguous()
    dim = int(x.shape[1])
    buffer = torch.empty(min(_ROWS, max(dim, 1)) * dim, dtype=torch.float64)
    lowest, energy, transposed = 0.0, 0.0, x.T
    for a in range(0, dim, _ROWS):
        b = min(dim, a + _ROWS)
        flat = buffer[: (b - a) * (dim - a)]
        block = flat.view(b - a, dim - a)
        torch.mm(transposed[a:b], x[:, a:], out=block)
        low = float(block.min())
        if low >= 0:
            continue
        lowest = min(lowest, low)
        block.clamp_max_(0.0)
        square = block[:, : b - a]
        energy += 2.0 * float(torch.dot(flat, flat)) - float((square * square).sum())
    return lowest, energy


_ROWS = 64  # rows of S per product block: 64 × M float64 (1 MiB at M = 2000), one reused buffer


def _inverse_or_zero(norms: Tensor) -> Tensor:
    """1 / x where x > 0, else 0 (a zero column scales to zero)."""
    return torch.where(norms > 0, norms.reciprocal(), 0.0)
