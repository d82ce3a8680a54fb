"""The ridge solve through the stacked factor uploads of a run (``stats-form factor``).

Every factor upload F_k = O_k [Φ_k Y_k] satisfies F_kᵀ F_k = [[G_k, C_k], [C_kᵀ, ·]], so the rows of
all of them, stacked (S = [S_Φ S_Y], N × (M + classes), label columns at the global class
indices), carry the run's sums: G = S_Φᵀ S_Φ and C = S_Φᵀ S_Y. The push-through identity

    W = (S_Φᵀ S_Φ + γI)⁻¹ S_Φᵀ S_Y = S_Φᵀ (S_Φ S_Φᵀ + γI)⁻¹ S_Y

turns the M × M solve (M³/3 flops for the Cholesky factor, at every stage) into an N × N one. The
kernel K = S_Φ S_Φᵀ grows by blocks as uploads arrive (2·N·n·M flops for n new rows), so a stage
costs N³/3 + 2·N·M·c more; while N ≪ M that is far below M³/3. W equals the Gram form's solve up
to float64 rounding; γ must be positive (the kernel form needs no regularity of G).

The stack holds per-upload rows in memory only (they stand for each client's G_k, which the server
already sees in a plain round); nothing of it is checkpointed, and it has a row cap (at most
``max_rows``, e.g. M/2, so it never takes more memory than G): past it, or after any upload
without a factor, the caller drops it and solves from G.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import AnalyticInputError
from .ridge_krylov import factor_solve

__all__ = ["FactorStack", "kernel_ridge"]


def kernel_ridge(phi: Tensor, labels: Tensor, ridge: float, kernel: Tensor | None = None) -> Tensor | None:
    """W = Φᵀ (Φ Φᵀ + γI)⁻¹ Y (M × c, float64) for rows Φ (N × M) and Y (N × c); ``kernel`` is
    Φ Φᵀ when the caller has it. None when K + γI has no Cholesky factor in floating point."""
    if phi.dim() != 2 or labels.dim() != 2 or labels.shape[0] != phi.shape[0]:
        raise AnalyticInputError(
            f"phi must be N x M and labels N x c, got {tuple(phi.shape)} and {tuple(labels.shape)}"
        )
    if not ridge > 0:
        raise AnalyticInputError(f"the kernel form needs a positive ridge, got {ridge}")
    rows = int(phi.shape[0])
    if kernel is not None and tuple(kernel.shape) != (rows, rows):
        raise AnalyticInputError(f"kernel must be {rows} x {rows}, got {tuple(kernel.shape)}")
    gram = phi @ phi.T if kernel is None else kernel
    shifted = gram + ridge * torch.eye(rows, dtype=gram.dtype, device=gram.device)
    factor, info = torch.linalg.cholesky_ex(shifted)
    if int(info) != 0:
        return None
    return phi.T @ factor_solve(factor, labels)


@dataclass
class FactorStack:
    """The stacked rows of every factor upload so far: Φ rows (N × M), label rows (N × classes,
    global class columns) and the kernel Φ Φᵀ (N × N), all float64."""

    phi: Tensor
    labels: Tensor
    kernel: Tensor
    max_rows: int

    @classmethod
    def empty(cls, dim: int, num_classes: int, max_rows: int) -> FactorStack:
        if dim <= 0 or num_classes <= 0 or max_rows < 0:
            raise AnalyticInputError(
                f"dim and num_classes must be > 0 and max_rows >= 0, got {dim}, {num_classes}, {max_rows}"
            )
        zeros = torch.zeros
        return cls(
            zeros(0, dim, dtype=torch.float64),
            zeros(0, num_classes, dtype=torch.float64),
            zeros(0, 0, dtype=torch.float64),
            max_rows,
        )

    @property
    def rows(self) -> int:
        return int(self.phi.shape[0])

    def fits(self, more: int) -> bool:
        """Whether ``more`` rows still fit under the row cap."""
        return self.rows + more <= self.max_rows

    def add(self, factor: Tensor, classes: range) -> None:
        """Append the rows of one upload F = [F_Φ F_Y] (rows × (M + len(classes))), whose label
        columns are the global classes ``classes``; the kernel grows by the new blocks."""
        dim, total = int(self.phi.shape[1]), int(self.labels.shape[1])
        if factor.dim() != 2 or int(factor.shape[1]) != dim + len(classes):
            raise AnalyticInputError(f"factor must be rows x {dim + len(classes)}, got shape {tuple(factor.shape)}")
        if classes.step != 1 or classes.start < 0 or classes.stop > total:
            raise AnalyticInputError(f"classes {classes} do not lie in 0..{total - 1}")
        if not self.fits(int(factor.shape[0])):
            raise AnalyticInputError(f"{factor.shape[0]} more rows pass the stack's cap of {self.max_rows}")
        new = factor.to(torch.float64)  # torch.cat below copies: the stack never shares the reply's buffer
        new_phi = new[:, :dim]
        new_labels = torch.zeros(new.shape[0], total, dtype=torch.float64)
        new_labels[:, classes.start : classes.stop] = new[:, dim:]
        cross = self.phi @ new_phi.T
        self.kernel = torch.cat(
            [torch.cat([self.kernel, cross], dim=1), torch.cat([cross.T, new_phi @ new_phi.T], dim=1)]
        )
        self.phi = torch.cat([self.phi, new_phi])
        self.labels = torch.cat([self.labels, new_labels])

    def solve(self, num_seen: int, ridge: float) -> Tensor | None:
        """W over the first ``num_seen`` classes (M × num_seen), or None where the N × N factor
        fails (the caller then solves from G)."""
        if not 0 < num_seen <= int(self.labels.shape[1]):
            raise AnalyticInputError(f"num_seen must lie in 1..{self.labels.shape[1]}, got {num_seen}")
        return kernel_ridge(self.phi, self.labels[:, :num_seen], ridge, self.kernel)
