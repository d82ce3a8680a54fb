"""Symmetric packing of the Gram matrix for upload.

G = ΦᵀΦ is symmetric, so only its upper triangle (diagonal included) needs to travel:
M(M+1)/2 numbers instead of M² (the paper counts M²; docs/methods/stsa.md §3.1). Order is row-major:
G[0,0..M-1], G[1,1..M-1], …, G[M-1,M-1]. Rows are copied one slice at a time so no
M(M+1)/2 index tensor is ever built (that would be 200 MB of int64 at M = 5000).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import AnalyticInputError

__all__ = ["pack_upper", "packed_length", "unpack_upper"]


def packed_length(dim: int) -> int:
    """Number of entries of the upper triangle, diagonal included: dim(dim+1)/2."""
    if dim < 0:
        raise AnalyticInputError(f"dim must be >= 0, got {dim}")
    return dim * (dim + 1) // 2


def pack_upper(gram: Tensor) -> Tensor:
    """Row-major upper triangle (incl. diagonal) of a square matrix as a 1-D tensor."""
    if gram.dim() != 2 or gram.shape[0] != gram.shape[1]:
        raise AnalyticInputError(f"pack_upper needs a square matrix, got shape {tuple(gram.shape)}")
    dim = int(gram.shape[0])
    out = torch.empty(packed_length(dim), dtype=gram.dtype, device=gram.device)
    offset = 0
    for row in range(dim):
        width = dim - row
        out[offset : offset + width] = gram[row, row:]
        offset += width
    return out


def unpack_upper(packed: Tensor, dim: int) -> Tensor:
    """Inverse of ``pack_upper``: the full symmetric dim × dim matrix.

    Raises ``AnalyticInputError`` (a ValueError) when the length is not dim(dim+1)/2, which is
    how the server rejects a truncated or mis-sized upload.
    """
    if packed.dim() != 1:
        raise AnalyticInputError(f"packed Gram must be 1-D, got shape {tuple(packed.shape)}")
    expected = packed_length(dim)
    if packed.numel() != expected:
        raise AnalyticInputError(f"packed Gram has {packed.numel()} entries, expected {expected} for dim {dim}")
    out = torch.zeros(dim, dim, dtype=packed.dtype, device=packed.device)
    offset = 0
    for row in range(dim):
        width = dim - row
        out[row, row:] = packed[offset : offset + width]
        offset += width
    # Mirror the strict upper triangle into the lower one.
    return out + torch.triu(out, diagonal=1).T
