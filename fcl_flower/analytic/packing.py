"""Symmetric packing of the Gram matrix for upload.

G = ΦᵀΦ is symmetric, so only its upper triangle (diagonal included) needs to travel:
M(M+1)/2 numbers instead of M² (the paper counts M²; docs/methods/stsa.md §3.1). Order is row-major:
G[0,0..M-1], G[1,1..M-1], …, G[M-1,M-1].

Every function works on blocks of rows, vectorised: rows a..b-1 of the upper triangle are the
packed entries ``offset(a) .. offset(b)``, and within the rectangle ``G[a:b, a:]`` they are the
positions of a triangular mask, in row-major order. So no M(M+1)/2 index tensor is ever built
(that would be 400 MB of int64 at M = 10000), no Python loop runs per row, and no full M × M
temporary is made: the client packs the symmetrised G straight from its accumulator, the server
adds packed sums straight into its running G.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from .errors import AnalyticInputError

__all__ = [
    "add_packed_",
    "diagonal_of_packed",
    "gram_packed_",
    "pack_symmetrised",
    "pack_upper",
    "packed_blocks",
    "packed_length",
    "row_offset",
    "symmetrised",
    "unpack_rows",
    "unpack_upper",
]

_BLOCK_ELEMENTS = 1 << 22  # ~4 M entries per block: 32 MiB of float64, a 4 MiB mask
_TILE = 256  # square tiles of transposed copies: 512 KiB of float64 each
_GRAM_ROWS = 64  # rows of G per product block of gram_packed_: 64 × M float64 (1 MiB at M = 2000)


def packed_length(dim: int) -> int:
    """Number of entries of the upper triangle, diagonal included: dim(dim+1)/2."""
    if dim < 0:
        raise AnalyticInputError(f"dim must be >= 0, got {dim}")
    return dim * (dim + 1) // 2


def row_offset(row: int, dim: int) -> int:
    """Where row ``row`` of the upper triangle starts in the packed vector."""
    return row * dim - row * (row - 1) // 2


def packed_blocks(dim: int, block_elements: int = _BLOCK_ELEMENTS) -> Iterator[tuple[int, int, np.ndarray]]:
    """(first row a, end row b, mask) per block: ``mask`` marks the upper-triangle positions of the
    rectangle rows a..b-1 × columns a..dim-1, which hold packed entries row_offset(a)..row_offset(b)."""
    rows = max(1, block_elements // max(dim, 1))
    for a in range(0, dim, rows):
        b = min(dim, a + rows)
        # np.triu(np.ones(...)) in one broadcast comparison (column j >= row i) instead of three passes
        yield a, b, np.arange(dim - a)[None, :] >= np.arange(b - a)[:, None]


def _check_square(gram: Tensor, what: str) -> int:
    if gram.dim() != 2 or gram.shape[0] != gram.shape[1]:
        raise AnalyticInputError(f"{what} needs a square matrix, got shape {tuple(gram.shape)}")
    return int(gram.shape[0])


def _check_packed(packed: Tensor, dim: int) -> None:
    if packed.dim() != 1:
        raise AnalyticInputError(f"packed Gram must be 1-D, got shape {tuple(packed.shape)}")
    expected = packed_length(dim)
    if packed.numel() != expected:
        raise AnalyticInputError(f"packed Gram has {packed.numel()} entries, expected {expected} for dim {dim}")


def _np(tensor: Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (boolean-mask indexing is several times faster in NumPy)."""
    return tensor.detach().cpu().numpy()


def pack_upper(gram: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Row-major upper triangle (incl. diagonal) of a square matrix as a 1-D tensor (in ``dtype``)."""
    dim = _check_square(gram, "pack_upper")
    out = torch.empty(packed_length(dim), dtype=dtype or gram.dtype, device=gram.device)
    if gram.device.type != "cpu":  # another device (CUDA, meta): row by row, where the input lives
        offset = 0
        for row in range(dim):
            out[offset : offset + dim - row] = gram[row, row:]
            offset += dim - row
        return out
    g, o = _np(gram), out.numpy()
    for a, b, mask in packed_blocks(dim):
        o[row_offset(a, dim) : row_offset(b, dim)] = g[a:b, a:][mask]
    return out


def pack_symmetrised(gram: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``pack_upper(0.5 * (G + Gᵀ))``, entry for entry the same numbers, without building the full
    symmetrised matrix: only the upper triangle is formed, one block of rows at a time (G from a
    BLAS product is symmetric only up to rounding; the client uploads the symmetrised values)."""
    dim = _check_square(gram, "pack_symmetrised")
    if gram.device.type != "cpu":
        return pack_upper(0.5 * (gram + gram.T), dtype)
    out = torch.empty(packed_length(dim), dtype=dtype or gram.dtype, device=gram.device)
    g, o = _np(gram), out.numpy()
    for a in range(0, dim, _TILE):
        b = min(dim, a + _TILE)
        block = g[a:b, a:].copy()
        for c in range(a, dim, _TILE):  # + Gᵀ, one square tile at a time (cache-friendly transposes)
            block[:, c - a : c - a + _TILE] += g[c : c + _TILE, a:b].T
        block *= 0.5
        _copy_rows(block, a, dim, o)
    return out


def _copy_rows(block: np.ndarray, a: int, dim: int, out: np.ndarray) -> None:
    """Rows a.. of the upper triangle from ``block`` = G[a:a + rows, a:] into the packed ``out``
    (rounded to its dtype): the rows' slices laid end to end by one ``np.concatenate``, whose loop
    runs in C (a Python slice assignment per row cost ~2 µs a row, most of a small client's packing;
    a boolean-mask gather of the block is slower still)."""
    rows = block.shape[0]
    if rows:
        np.concatenate(
            [block[r, r:] for r in range(rows)],
            out=out[row_offset(a, dim) : row_offset(a + rows, dim)],
            casting="same_kind",
        )


def _add_rows(block: np.ndarray, a: int, dim: int, out: np.ndarray) -> None:
    """:func:`_copy_rows`, adding into ``out`` instead of overwriting it (each entry added once)."""
    rows = block.shape[0]
    if rows:
        target = out[row_offset(a, dim) : row_offset(a + rows, dim)]
        target += np.concatenate([block[r, r:] for r in range(rows)])


def unpack_rows(packed: np.ndarray, a: int, b: int, dim: int, out: np.ndarray) -> np.ndarray:
    """Rows a..b-1 of the upper triangle as the rectangle G[a:b, a:] (zeros below the diagonal),
    written into ``out`` (at least (b - a)(dim - a) entries, any float dtype) and returned as a
    (b - a) × (dim - a) view: row r of the rectangle is r zeros, then row a + r's packed slice, so
    the rectangle's entries are those pieces laid end to end, one ``np.concatenate`` (C loop)."""
    width = dim - a
    zeros = np.zeros(b - a, dtype=packed.dtype)
    pieces: list[np.ndarray] = []
    offset = row_offset(a, dim)
    for r in range(b - a):
        pieces.append(zeros[:r])
        pieces.append(packed[offset : offset + width - r])
        offset += width - r
    block = out[: (b - a) * width]
    if pieces:
        np.concatenate(pieces, out=block, casting="same_kind")
    return block.reshape(b - a, width)


def gram_packed_(out: np.ndarray, phi: Tensor, *, accumulate: bool, clamp: bool = False) -> np.ndarray:
    """The packed upper triangle of G = ΦᵀΦ written (or, with ``accumulate``, added) into ``out``
    (1-D, dim(dim+1)/2 entries, any float dtype), straight from the n × dim float64 features.

    Only the upper triangle is computed, one block of rows at a time: G[a:b, a:] = Φ[:, a:b]ᵀ Φ[:, a:]
    (one ``torch.mm`` into a reused buffer), whose rows go to their packed slices. So each G_ij
    (i ≤ j) is computed exactly once and G is symmetric by construction (no 0.5·(G + Gᵀ) pass), in
    half the products of ΦᵀΦ, and no M × M matrix is ever formed (issue 30: a fresh 32 MiB buffer,
    its symmetrisation and packing were most of a small client's cost at M = 2000). With ``clamp``
    the negative entries of the product are set to 0 first, block by block (the products of
    non-negative features' rows turned by a rotation: their negative entries are rounding)."""
    if phi.dim() != 2 or phi.dtype != torch.float64 or phi.device.type != "cpu":
        raise AnalyticInputError(f"gram_packed_ needs 2-D float64 CPU features, got {tuple(phi.shape)} {phi.dtype}")
    dim = int(phi.shape[1])
    if out.ndim != 1 or out.shape[0] != packed_length(dim):
        raise AnalyticInputError(f"packed output has shape {out.shape}, expected ({packed_length(dim)},)")
    if phi.shape[0] == 0:
        if not accumulate:
            out[:] = 0
        return out
    write = _add_rows if accumulate else _copy_rows
    buffer = torch.empty(min(_GRAM_ROWS, dim) * dim, dtype=torch.float64, device="cpu")
    transposed = phi.T
    for a in range(0, dim, _GRAM_ROWS):
        b = min(dim, a + _GRAM_ROWS)
        block = buffer[: (b - a) * (dim - a)].view(b - a, dim - a)
        torch.mm(transposed[a:b], phi[:, a:], out=block)
        if clamp:
            block.clamp_min_(0.0)
        write(block.numpy(), a, dim, out)
    return out


def symmetrised(gram: Tensor) -> Tensor:
    """``0.5 * (G + Gᵀ)``, entry for entry the same numbers, in square tiles: the transposed operand
    is read one cache-sized tile at a time (a whole transposed matrix walks memory with a stride of
    M and is several times slower, most of a small client's cost at large M)."""
    dim = _check_square(gram, "symmetrised")
    if gram.device.type != "cpu" or not gram.is_contiguous():
        return 0.5 * (gram + gram.T)
    out = torch.empty_like(gram)
    g, o = _np(gram), out.numpy()
    for a in range(0, dim, _TILE):
        for c in range(0, dim, _TILE):
            np.add(
                g[a : a + _TILE, c : c + _TILE], g[c : c + _TILE, a : a + _TILE].T, out=o[a : a + _TILE, c : c + _TILE]
            )
    o *= 0.5
    return out


def unpack_upper(packed: Tensor, dim: int) -> Tensor:
    """Inverse of ``pack_upper``: the full symmetric dim × dim matrix.

    Raises ``AnalyticInputError`` (a ValueError) when the length is not dim(dim+1)/2, which is
    how the server rejects a truncated or mis-sized upload.
    """
    _check_packed(packed, dim)
    if packed.device.type != "cpu":  # another device (CUDA, meta): row by row, where the input lives
        out = torch.zeros(dim, dim, dtype=packed.dtype, device=packed.device)
        offset = 0
        for row in range(dim):
            out[row, row:] = packed[offset : offset + dim - row]
            offset += dim - row
        return out + torch.triu(out, diagonal=1).T
    out = torch.empty(dim, dim, dtype=packed.dtype, device="cpu")  # every entry written: upper rows, then their mirror
    unpack_rows(_np(packed), 0, dim, dim, out.numpy().reshape(-1))
    _mirror_upper(out.numpy())
    return out


def add_packed_(gram: Tensor, packed: Tensor) -> Tensor:
    """``gram += unpack_upper(packed)`` in place, for a symmetric ``gram``, without the unpacked
    temporary: the upper triangle receives the packed values, the lower one their mirror (the
    same numbers ``gram + unpack_upper(packed)`` has, since ``gram`` is symmetric)."""
    dim = _check_square(gram, "add_packed_")
    _check_packed(packed, dim)
    if gram.device.type != "cpu" or packed.device.type != "cpu":
        return gram.add_(unpack_upper(packed, dim).to(gram.device))
    g, p = _np(gram), _np(packed)
    rows = max(1, min(dim, _TILE))
    buffer = np.empty(rows * dim, dtype=p.dtype)
    for a in range(0, dim, rows):  # blocks of rows, unpacked in C (zeros below the diagonal: + 0 there)
        b = min(dim, a + rows)
        g[a:b, a:] += unpack_rows(p, a, b, dim, buffer)
    _mirror_upper(g)
    return gram


def diagonal_of_packed(packed: Tensor, dim: int) -> Tensor:
    """G_ii from the packed upper triangle."""
    _check_packed(packed, dim)
    rows = torch.arange(dim, dtype=torch.int64, device=packed.device)
    return packed[rows * dim - rows * (rows - 1) // 2]


def _mirror_upper(out: np.ndarray, tile: int = _TILE) -> None:
    """Copy the strict upper triangle onto the lower one in place, in square tiles (a transposed
    copy of whole row blocks walks memory with a large stride and is several times slower)."""
    dim = int(out.shape[0])
    for a in range(0, dim, tile):
        b = min(dim, a + tile)
        for c in range(0, a, tile):
            out[a:b, c : min(dim, c + tile)] = out[c : min(dim, c + tile), a:b].T
        square = out[a:b, a:b]
        square[...] = np.triu(square) + np.triu(square, 1).T
