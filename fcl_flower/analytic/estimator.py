"""STSA-E: estimating the Gram matrix from class sums and counts (docs/methods/stsa.md §2.9, Eq. 9).

Each (dummy) client k uploads only C_k (M × c, class-wise feature sums) and n_k (c counts).
For class i, with n = Σ_k n_k, S = Σ_k C_k (columns i), Eq. 9 reads

    Ĝ^(i) = A_i Σ_k C_k C_kᵀ / n_k  −  B_i S Sᵀ,
    A_i = (n − 1)/(K − 1),   B_i = (n − K)/((K − 1) n),

and Ĝ = Σ_i Ĝ^(i). Equivalently (docs/methods/stsa.md §2.9, "interpretable form", when B_i is not clipped)

    Ĝ^(i) = n m mᵀ + (n − 1)/(K − 1) Σ_k n_k (m_k − m)(m_k − m)ᵀ,  m_k = C_k/n_k, m = S/n:

the exact "mean part" plus (n − 1) times a covariance estimate built from the spread of
client-wise class means (Var m_k = Σ/n_k). It is unbiased when every one of the K clients
holds class i.

Vectorised as Ĝ = Z_A Z_Aᵀ − Z_B Z_Bᵀ, where Z_A has columns √(A_i/n_k^(i)) C_k^(i) and Z_B
has columns √B_i S^(i): two matmuls instead of c·K rank-1 updates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, cast

import torch
from torch import Tensor

from .errors import AnalyticInputError

__all__ = ["K_MODES", "GramEstimator", "estimate_gram", "split_into_dummy_clients"]

KMode = Literal["global", "per-class"]
K_MODES: tuple[str, ...] = ("global", "per-class")


def _coefficients(counts: Tensor, k_mode: str) -> tuple[Tensor, Tensor]:
    """Per-class (A_i, B_i), both ≥ 0, float64, shape (c,).

    global: K = number of uploads (all (dummy) clients, empty ones included), negative
        coefficients clipped to 0 as in the reference code (B_i = 0 when n < K; A_i = 0 when
        n ≤ 1). Biased when some client lacks class i: the covariance part is scaled by
        (n−1)/(K−1) instead of (n−1)/(K_i−1), i.e. under-estimated.
    per-class: K_i = #{k : n_k^(i) > 0}; unbiased whenever K_i ≥ 2. With K_i < 2 no spread of
        client means exists, so the class falls back to its exact mean part S Sᵀ/n
        (A_i = 1, B_i = 0; for a single holder Σ_k C_k C_kᵀ/n_k = S Sᵀ/n), which misses the
        class's (n−1)Σ covariance term.
    """
    return _coefficients_from_totals(counts.sum(dim=0), (counts > 0).sum(dim=0), counts.shape[0], k_mode)


def _coefficients_from_totals(n: Tensor, holders: Tensor, num_clients: int, k_mode: str) -> tuple[Tensor, Tensor]:
    """(A_i, B_i) from the totals alone: n_i, K_i = #uploads holding class i, and K = #uploads.

    These totals are all Eq. 9 needs besides the per-upload outer products, which is what
    lets :class:`GramEstimator` fold uploads in one at a time.
    """
    safe_n = torch.where(n > 0, n, torch.ones_like(n))
    if k_mode == "global":
        if num_clients < 2:
            raise AnalyticInputError(f"global-K Eq. 9 needs at least 2 (dummy) clients, got {num_clients}")
        k = torch.full_like(n, float(num_clients))
        a = ((n - 1.0) / (k - 1.0)).clamp_min(0.0)
        b = ((n - k) / ((k - 1.0) * safe_n)).clamp_min(0.0)
    elif k_mode == "per-class":
        k = holders.to(torch.float64)
        ok = k >= 2
        safe_k = torch.where(ok, k, torch.full_like(k, 2.0))
        a = torch.where(ok, (n - 1.0) / (safe_k - 1.0), torch.ones_like(n)).clamp_min(0.0)
        # Integer counts give n ≥ K_i, hence B_i ≥ 0; the clip only guards fractional counts.
        b = torch.where(ok, (n - safe_k) / ((safe_k - 1.0) * safe_n), torch.zeros_like(n))
        b = b.clamp_min(0.0)
    else:
        raise AnalyticInputError(f"k_mode must be one of {K_MODES}, got {k_mode!r}")
    # Absent classes contribute nothing (their sums are zero anyway).
    a = torch.where(n > 0, a, torch.zeros_like(a))
    b = torch.where(n > 0, b, torch.zeros_like(b))
    return a, b


def estimate_gram(class_sums: Tensor, counts: Tensor, *, k_mode: KMode = "global") -> Tensor:
    """Ĝ (M × M, float64) from K uploads of class sums (K, M, c) and counts (K, c), Eq. 9.

    ``k_mode="global"`` reproduces the paper/code (K = total number of (dummy) clients, terms
    with n_k = 0 skipped, negative coefficients clipped); ``"per-class"`` uses K_i, the number of
    uploads holding class i, which keeps Ĝ unbiased when some clients lack a class.
    Counts may be float (e.g. noised), but must be non-negative; n_k ≤ 0 means "absent".
    """
    if class_sums.dim() != 3:
        raise AnalyticInputError(f"class_sums must be 3-D (K, M, c), got shape {tuple(class_sums.shape)}")
    num_clients, rf_dim, num_classes = class_sums.shape
    if tuple(counts.shape) != (num_clients, num_classes):
        raise AnalyticInputError(
            f"counts shape {tuple(counts.shape)} does not match (K, c) = ({num_clients}, {num_classes})"
        )
    if counts.dtype.is_complex or counts.dtype == torch.bool:
        raise AnalyticInputError(f"counts must be real numbers, got {counts.dtype}")
    sums = class_sums.to(torch.float64)
    cnt = counts.to(device=sums.device, dtype=torch.float64)
    if bool((cnt < 0).any()):
        raise AnalyticInputError("counts must be non-negative")
    a, b = _coefficients(cnt, k_mode)

    present = cnt > 0
    safe_cnt = torch.where(present, cnt, torch.ones_like(cnt))
    scale_a = torch.where(present, torch.sqrt(a.unsqueeze(0) / safe_cnt), torch.zeros_like(cnt))
    # Z_A: (M, K·c), column (k, i) = √(A_i / n_k^(i)) C_k^(i).
    z_a = (sums * scale_a.unsqueeze(1)).permute(1, 0, 2).reshape(rf_dim, num_clients * num_classes)
    # Z_B: (M, c), column i = √B_i S^(i).
    z_b = sums.sum(dim=0) * torch.sqrt(b).unsqueeze(0)
    gram = z_a @ z_a.T - z_b @ z_b.T
    return 0.5 * (gram + gram.T)


class GramEstimator:
    """Eq. 9 folded in one upload at a time, for a server that must not hold every upload.

    Eq. 9 is *not* linear in the uploads: A_i and B_i depend on the totals n_i, K_i and K,
    known only once the last upload is in. What is additive is, per class i, the sum S_i of
    class sums, the count n_i, the number of holders K_i, and the outer-product sum
    P_i = Σ_k C_k^(i) C_k^(i)ᵀ / n_k^(i). P_i is kept as its columns C_k^(i)/√n_k^(i) while
    there are at most ``rf_dim`` of them (no more memory than the uploads themselves), then as
    a dense M × M matrix (no more than the full Gram of that class), so the state never
    exceeds min(uploads so far, c·M²) numbers however many clients send:
    Ĝ = Σ_i A_i P_i − B_i S_i S_iᵀ.

    :meth:`result` equals :func:`estimate_gram` on the stacked uploads (up to float64
    rounding: the summation order differs), for any upload order.
    """

    def __init__(self, rf_dim: int, num_classes: int, *, k_mode: KMode = "global") -> None:
        if not isinstance(rf_dim, int) or rf_dim < 1:
            raise AnalyticInputError(f"rf_dim must be a positive int, got {rf_dim!r}")
        if not isinstance(num_classes, int) or num_classes < 1:
            raise AnalyticInputError(f"num_classes must be a positive int, got {num_classes!r}")
        if k_mode not in K_MODES:
            raise AnalyticInputError(f"k_mode must be one of {K_MODES}, got {k_mode!r}")
        self.rf_dim, self.num_classes, self.k_mode = rf_dim, num_classes, k_mode
        self.class_sums = torch.zeros(rf_dim, num_classes, dtype=torch.float64)  # S (M × c)
        self.counts = torch.zeros(num_classes, dtype=torch.float64)  # n_i
        self.holders = torch.zeros(num_classes, dtype=torch.int64)  # K_i
        self.num_uploads = 0  # K (dummy clients included)
        self._columns: list[list[Tensor]] = [[] for _ in range(num_classes)]  # blocks (M × d) of P_i
        self._num_columns = [0] * num_classes
        self._dense: list[Tensor | None] = [None] * num_classes  # P_i once it outgrew its columns

    def _uploads(self, class_sums: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """``class_sums`` (M, c) or (D, M, c) and ``counts`` (c,) or (D, c) as (D, M, c) and (D, c)
        float64 CPU tensors; AnalyticInputError on other shapes."""
        if class_sums.dim() == 2:
            class_sums, counts = class_sums.unsqueeze(0), counts.unsqueeze(0)
        if class_sums.dim() != 3 or tuple(class_sums.shape[1:]) != (self.rf_dim, self.num_classes):
            raise AnalyticInputError(
                f"class_sums must have shape (D, {self.rf_dim}, {self.num_classes}), got {tuple(class_sums.shape)}"
            )
        if tuple(counts.shape) != (class_sums.shape[0], self.num_classes):
            raise AnalyticInputError(
                f"counts shape {tuple(counts.shape)} does not match (D, c) = "
                f"({class_sums.shape[0]}, {self.num_classes})"
            )
        if counts.dtype.is_complex or counts.dtype == torch.bool:
            raise AnalyticInputError(f"counts must be real numbers, got {counts.dtype}")
        return class_sums.to(device="cpu", dtype=torch.float64), counts.to(device="cpu", dtype=torch.float64)

    def add(self, class_sums: Tensor, counts: Tensor) -> None:
        """Fold in uploads: ``class_sums`` (M, c) or (D, M, c), ``counts`` (c,) or (D, c).

        A client with K_D dummy clients sends D = K_D uploads; each counts once in K.
        """
        sums, cnt = self._uploads(class_sums, counts)
        if bool((cnt < 0).any()):
            raise AnalyticInputError("counts must be non-negative")
        present = cnt > 0
        self.class_sums += sums.sum(dim=0)
        self.counts += cnt.sum(dim=0)
        self.holders += present.sum(dim=0)
        self.num_uploads += int(sums.shape[0])
        for i in range(self.num_classes):
            rows = present[:, i]
            if not bool(rows.any()):
                continue
            block = sums[rows, :, i].T / torch.sqrt(cnt[rows, i]).unsqueeze(0)  # (M, d)
            dense = self._dense[i]
            if dense is not None:
                dense.addmm_(block, block.T)
                continue
            self._columns[i].append(block)
            self._num_columns[i] += int(block.shape[1])
            if self._num_columns[i] > self.rf_dim:  # columns now cost more than P_i itself
                z = torch.cat(self._columns[i], dim=1)
                self._dense[i] = z @ z.T
                self._columns[i], self._num_columns[i] = [], 0

    def remove(self, class_sums: Tensor, counts: Tensor) -> None:
        """Take uploads added by :meth:`add` (the same arguments) out again: S_i, n_i, K_i, K and
        P_i each lose exactly what the upload added, so :meth:`result` is the estimate of a stage
        that never had it (fcl_flower/analytic/unlearning.py). A P_i still kept as columns loses the
        very block it received; a dense P_i is subtracted. A block never received is refused
        (AnalyticInputError) before anything changes."""
        sums, cnt = self._uploads(class_sums, counts)
        present = cnt > 0
        if int(sums.shape[0]) > self.num_uploads or bool((present.sum(dim=0) > self.holders).any()):
            raise AnalyticInputError("the estimator holds fewer uploads than the removal takes out")
        blocks: list[Tensor | None] = []
        for i in range(self.num_classes):
            rows = present[:, i]
            if not bool(rows.any()):
                blocks.append(None)
                continue
            block = sums[rows, :, i].T / torch.sqrt(cnt[rows, i]).unsqueeze(0)
            if self._dense[i] is None and not any(torch.equal(block, kept) for kept in self._columns[i]):
                raise AnalyticInputError(f"class {i}: the estimator never received these uploads (no such block)")
            blocks.append(block)
        for i, found in enumerate(blocks):  # all checked first: a refused removal changes nothing
            if found is None:
                continue
            dense = self._dense[i]
            if dense is not None:
                dense.addmm_(found, found.T, alpha=-1.0)
                continue
            position = next(j for j, kept in enumerate(self._columns[i]) if torch.equal(found, kept))
            del self._columns[i][position]
            self._num_columns[i] -= int(found.shape[1])
        self.class_sums -= sums.sum(dim=0)
        self.counts -= cnt.sum(dim=0)
        self.holders -= present.sum(dim=0)
        self.num_uploads -= int(sums.shape[0])

    def result(self) -> Tensor:
        """Ĝ (M × M, float64) from everything added so far."""
        if self.num_uploads == 0:
            raise AnalyticInputError("GramEstimator.result needs at least one upload")
        a, b = _coefficients_from_totals(self.counts, self.holders, self.num_uploads, self.k_mode)
        gram = torch.zeros(self.rf_dim, self.rf_dim, dtype=torch.float64)
        for i in range(self.num_classes):  # class by class: one class's columns as temporary, not all
            dense = self._dense[i]
            if dense is not None:
                gram.add_(dense, alpha=float(a[i]))
            if self._columns[i]:
                z = torch.cat(self._columns[i], dim=1) if len(self._columns[i]) > 1 else self._columns[i][0]
                gram.addmm_(z, z.T, alpha=float(a[i]))
        z_b = self.class_sums * torch.sqrt(b).unsqueeze(0)
        gram.addmm_(z_b, z_b.T, alpha=-1.0)
        return 0.5 * (gram + gram.T)

    def state_dict(self) -> dict[str, object]:
        """Everything the estimate depends on (a checkpoint; :meth:`from_state` reads it back):
        S, n_i, K_i, K and each P_i as its blocks of columns or dense, so that a removal after a
        resume still finds the very blocks it added."""
        return {
            "k_mode": self.k_mode,
            "class_sums": self.class_sums,
            "counts": self.counts,
            "holders": self.holders,
            "num_uploads": self.num_uploads,
            "columns": [list(blocks) for blocks in self._columns],
            "dense": list(self._dense),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], rf_dim: int, num_classes: int) -> GramEstimator:
        """The estimator :meth:`state_dict` describes, every field checked against ``rf_dim`` and
        ``num_classes`` (AnalyticInputError naming the field otherwise)."""

        def tensor(value: Any, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> Tensor:
            if not isinstance(value, Tensor) or tuple(value.shape) != shape or value.dtype != dtype:
                raise AnalyticInputError(f"estimator {name} must be a {dtype} tensor of shape {shape}")
            if dtype.is_floating_point and not bool(torch.isfinite(value).all()):
                raise AnalyticInputError(f"estimator {name} has non-finite entries")
            return value.clone()

        k_mode = state.get("k_mode")
        if k_mode not in K_MODES:
            raise AnalyticInputError(f"estimator k_mode must be one of {K_MODES}, got {k_mode!r}")
        estimator = cls(rf_dim, num_classes, k_mode=cast(KMode, k_mode))
        estimator.class_sums = tensor(state.get("class_sums"), "class_sums", (rf_dim, num_classes))
        estimator.counts = tensor(state.get("counts"), "counts", (num_classes,))
        estimator.holders = tensor(state.get("holders"), "holders", (num_classes,), torch.int64)
        uploads = state.get("num_uploads")
        if isinstance(uploads, bool) or not isinstance(uploads, int) or uploads < 0:
            raise AnalyticInputError(f"estimator num_uploads must be an int >= 0, got {uploads!r}")
        estimator.num_uploads = uploads
        if bool((estimator.counts < 0).any()) or bool((estimator.holders < 0).any()):
            raise AnalyticInputError("estimator counts and holders must be >= 0")
        if bool((estimator.holders > uploads).any()):
            raise AnalyticInputError("estimator holders exceed its number of uploads")
        columns, dense = state.get("columns"), state.get("dense")
        if (
            not isinstance(columns, list)
            or not isinstance(dense, list)
            or not len(columns) == len(dense) == num_classes
        ):
            raise AnalyticInputError(f"estimator columns and dense must be lists of {num_classes} classes")
        for i, (blocks, full) in enumerate(zip(columns, dense)):
            if full is not None:
                estimator._dense[i] = tensor(full, f"dense[{i}]", (rf_dim, rf_dim))
            if not isinstance(blocks, list) or (full is not None and blocks):
                raise AnalyticInputError(f"estimator columns[{i}] must be a list of blocks (none once dense)")
            for j, block in enumerate(blocks):
                width = int(block.shape[1]) if isinstance(block, Tensor) and block.dim() == 2 else -1
                estimator._columns[i].append(tensor(block, f"columns[{i}][{j}]", (rf_dim, max(width, 1))))
            estimator._num_columns[i] = sum(int(b.shape[1]) for b in estimator._columns[i])
            if estimator._num_columns[i] > rf_dim:
                raise AnalyticInputError(f"estimator columns[{i}] holds more than {rf_dim} columns")
        return estimator

    def state_numbers(self) -> int:
        """Numbers held (for memory accounting): columns or dense P_i, plus S."""
        held = sum(n * self.rf_dim for n in self._num_columns)
        held += sum(self.rf_dim**2 for d in self._dense if d is not None)
        return held + self.class_sums.numel()


def split_into_dummy_clients(
    num_samples: int,
    num_dummy: int,
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> list[Tensor]:
    """Index sets of K_D dummy clients: a random permutation cut into equal contiguous chunks.

    As in the reference code (docs/methods/stsa.md §2.9): step = n // K_D, chunk j = perm[j·step:(j+1)·step],
    the last chunk also takes the remainder; not stratified by class. If n < K_D the first
    K_D − 1 chunks are empty (they still count in global K). Pass exactly one of ``seed`` /
    ``generator`` so the split is reproducible.
    """
    if not isinstance(num_samples, int) or num_samples < 0:
        raise AnalyticInputError(f"num_samples must be a non-negative int, got {num_samples!r}")
    if not isinstance(num_dummy, int) or num_dummy < 1:
        raise AnalyticInputError(f"num_dummy must be a positive int, got {num_dummy!r}")
    if (seed is None) == (generator is None):
        raise AnalyticInputError("pass exactly one of seed or generator")
    if generator is None:
        assert seed is not None  # exactly one of the two is given (checked above)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(int(seed))
    perm = torch.randperm(num_samples, generator=generator, device=generator.device)
    step = num_samples // num_dummy
    chunks = [perm[j * step : (j + 1) * step] for j in range(num_dummy - 1)]
    chunks.append(perm[(num_dummy - 1) * step :])
    return chunks
