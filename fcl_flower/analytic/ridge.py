"""Closed-form ridge classifier on aggregated statistics (docs/methods/stsa.md §2.7, Eqs. 6–8, 10).

W = (G + γI)⁻¹ C is the exact joint ridge solution when G = ΦᵀΦ and C = ΦᵀY are the pooled
statistics, so the federated solve loses nothing. It is solved by Cholesky (G + γI is
symmetric positive definite for γ > 0), never by an explicit inverse.

``select_ridge_gcv`` is an extra, not in the paper (which fixes γ = 1e4 / 1e6, docs/methods/stsa.md §6 item 3):
generalised cross-validation computed from the statistics alone, so the server can pick γ
without any validation data. Its grid starts at :func:`factorable_floor` of G's spectrum: uploads
rounded to float32 (and an adversary within the upload check's tolerance) leave G with negative
eigenvalues, and G + γI must keep its Cholesky factor.

Noisy statistics (the paper's noise or differential privacy, fcl_flower/privacy/noise.py): G plus
symmetric Gaussian noise is symmetric but may be indefinite, so G + γI may have no Cholesky
factor for a small γ. :func:`solve_ridge_psd` projects G onto the PSD cone first (the nearest PSD
matrix in Frobenius norm: the eigendecomposition with negative eigenvalues set to 0, which a
true Gram never has) and solves in that eigenbasis; GCV runs on the same projected spectrum and
the noisy C and n (post-processing: no privacy is spent). GCV alone does not know the noise: on
a noisy G it keeps choosing the smallest γ, which inverts noise-dominated directions. Its grid
therefore starts at |λ_min| of the noisy G: for G ⪰ 0 plus symmetric noise E, λ_min(G + E) ≥
−‖E‖₂, and the bottom of the spectrum of a low-rank-ish G plus noise is the noise's, so |λ_min|
estimates the noise level from the statistics themselves (the λ_min correction of AdaSSP, Wang
2018, "Revisiting differentially private linear regression", which sets the ridge at the noise's
spectral bound).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from fcl_flower import restore as fields
from fcl_flower.restore import RestoreError

from .errors import AnalyticInputError, NotPositiveDefiniteError
from .packing import add_packed_, pack_upper, packed_length, unpack_upper
from .ridge_krylov import factor_solve, krylov_gcv, ridge_rss, rss_agreement, shifted_cholesky

__all__ = [
    "GCVRow",
    "PSDProjection",
    "RidgeState",
    "default_ridge_grid",
    "factorable_floor",
    "gcv_from_spectrum",
    "product_rounding_bound",
    "ridge_residual",
    "select_ridge_gcv",
    "solve_ridge",
    "solve_ridge_psd",
    "sum_rounding_bound",
    "symmetric_eigh",
    "symmetric_part",
    "uses_krylov",
]

#: ``ridge-selection auto`` searches with the Krylov estimate from this M on, when there are at least
#: KRYLOV_SAMPLES_PER_DIM samples per feature; below that the exact eigendecomposition costs about as
#: much, or GCV's denominator n − df is too small for the trace estimate (experiments/bench_ridge_selection.py).
KRYLOV_FROM_DIM = 2048
KRYLOV_SAMPLES_PER_DIM = 2
#: the precision of the Krylov search's factors (fcl_flower/analytic/ridge_krylov.py, "Precision");
#: the solve itself is always float64
KRYLOV_DTYPE = torch.float32
#: float32 Cholesky's usual normwise backward error, relative, with the rounding of G to float32:
#: 2⁻²² = 4 units of roundoff (the upload checks' "Float32 first" rests on the same behaviour,
#: fcl_flower/analytic/checks.py)
FLOAT32_BACKWARD = 2.0**-22


def uses_krylov(selection: str, dim: int, num_samples: int) -> bool:
    """Whether ``selection`` (auto, exact or krylov) searches with :func:`krylov_gcv` at this M and n."""
    if selection not in ("auto", "exact", "krylov"):
        raise AnalyticInputError(f"ridge selection must be auto, exact or krylov, got {selection!r}")
    if selection == "auto":
        return dim >= KRYLOV_FROM_DIM and num_samples >= KRYLOV_SAMPLES_PER_DIM * dim
    return selection == "krylov"


def _check_system(gram: Tensor, class_sums: Tensor) -> None:
    if gram.dim() != 2 or gram.shape[0] != gram.shape[1]:
        raise AnalyticInputError(f"gram must be square, got shape {tuple(gram.shape)}")
    if class_sums.dim() != 2 or class_sums.shape[0] != gram.shape[0]:
        raise AnalyticInputError(f"class_sums shape {tuple(class_sums.shape)} does not match gram dim {gram.shape[0]}")


def symmetric_part(gram: Tensor, tile: int = 512) -> Tensor:
    """½(G + Gᵀ); ``gram`` itself when it is exactly symmetric (the server's G always is: packed
    uploads are added to both triangles), which are the very same numbers (x + x and ½·2x are exact)
    without two M × M temporaries. Symmetry is compared tile by tile, with no full-size copy."""
    dim = int(gram.shape[0])
    for a in range(0, dim, tile):
        b = min(dim, a + tile)
        if not torch.equal(gram[a:b, a:], gram[a:, a:b].T):
            return 0.5 * (gram + gram.T)
    return gram


def symmetric_eigh(gram: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues (ascending) and orthonormal eigenvectors of ½(G + Gᵀ), float64.

    On the CPU with one M × M working copy and O(M) workspace: LAPACK's MRRR driver (dsyevr,
    through SciPy) overwrites the copy and writes the eigenvectors into one more matrix, where
    torch.linalg.eigh's divide and conquer (dsyevd) also needs 2 M² numbers of workspace
    (1 GiB at M = 8192), the server's peak memory with ``ridge auto``. A decomposition that does not
    converge raises ``AnalyticInputError`` (a stage failure with its reason, not a crash).
    """
    g = symmetric_part(gram.to(torch.float64))
    try:
        if g.device.type != "cpu" or g.shape[0] == 0:
            return torch.linalg.eigh(g)
        import scipy.linalg  # lazily: the server's ridge selection only; clients never load SciPy

        work = g.numpy().copy()  # C order; its transpose, the same symmetric matrix, is Fortran order
        eigvals, eigvecs = scipy.linalg.eigh(work.T, overwrite_a=True, check_finite=False, driver="evr")
    except (torch.linalg.LinAlgError, np.linalg.LinAlgError) as err:
        raise AnalyticInputError(f"the eigendecomposition of G failed: {err}") from None
    return torch.from_numpy(eigvals), torch.from_numpy(eigvecs)


def solve_ridge(gram: Tensor, class_sums: Tensor, ridge: float) -> Tensor:
    """W = (G + γI)⁻¹ C (M × c, float64) via Cholesky factor and two triangular solves.

    Raises ``NotPositiveDefiniteError`` if G + γI has no Cholesky factor (γ too small for a
    rank-deficient or indefinite G, e.g. a noised or estimated Gram matrix).
    """
    _check_system(gram, class_sums)
    if not math.isfinite(float(ridge)) or float(ridge) < 0:
        raise AnalyticInputError(f"ridge must be a finite number >= 0, got {ridge!r}")
    live = live_features(gram)
    if live is not None:  # features no sample activates: solved apart, the rest on a smaller factor
        return _solve_live(gram, class_sums, float(ridge), live)
    # G + γI in one M × M buffer, factorised in place (the same numbers as g + γ·eye, without the
    # identity and factor temporaries: at M = 8192 each is 512 MiB)
    factor, info = shifted_cholesky(gram, float(ridge))
    if info != 0:
        raise NotPositiveDefiniteError(
            f"G + {ridge:g}·I is not positive definite (Cholesky failed at column {info}); increase the ridge"
        )
    return factor_solve(factor, class_sums.to(device=factor.device))


#: a share of dead features below which the full factorisation is kept (the gather would cost more)
DEAD_SHARE = 0.05


def live_features(gram: Tensor) -> np.ndarray | None:
    """The indices of G's live features where enough are dead, else None. A feature is dead when
    its whole row and column of G are exactly 0 (no sample ever activates it: with random ReLU
    features a fifth to a third of them on the digits backbone). (G + γI) is then block diagonal, γI
    on the dead ones, so the ridge solution splits exactly: W_dead = C_dead / γ, and
    W_live = (G_live + γI)⁻¹ C_live, a factorisation of (M − dead)³/3 instead of M³/3 (half the
    time with a fifth dead). Rows are tested before columns (contiguous first); only a CPU G
    whose dead share is at least :data:`DEAD_SHARE` is split."""
    if gram.device.type != "cpu" or gram.dtype != torch.float64 or gram.shape[0] < 2:
        return None
    g = gram.numpy()
    dead = np.flatnonzero(np.diagonal(g) == 0)
    if dead.size < DEAD_SHARE * g.shape[0] or g[dead].any() or g[:, dead].any():
        return None
    return np.flatnonzero(np.diagonal(g) != 0)


def _solve_live(gram: Tensor, class_sums: Tensor, ridge: float, live: np.ndarray) -> Tensor:
    """:func:`solve_ridge` of a G with dead features (:func:`live_features`): one factor of the live
    block (gathered straight into its buffer); the dead rows of W are (C / √γ) / √γ, the two
    triangular solves of their block √γ·I."""
    block, info = shifted_cholesky(gram, ridge, torch.float64, live)
    if info != 0:
        column = int(live[info - 1]) + 1
        raise NotPositiveDefiniteError(
            f"G + {ridge:g}·I is not positive definite (Cholesky failed at column {column}); increase the ridge"
        )
    sums = class_sums.to(torch.float64)
    root = math.sqrt(ridge)
    weights = sums / root / root  # the dead rows: (C / √γ) / √γ
    index = torch.from_numpy(live)
    weights[index] = factor_solve(block, sums[index])
    return weights


@dataclass(frozen=True)
class PSDProjection:
    """What the projection of a noisy G removed: how many eigenvalues were negative, their total
    |λ|, and the trace of G (for scale)."""

    negative: int
    clipped: float
    trace: float

    def as_dict(self) -> dict[str, float | int]:
        return {"negative_eigenvalues": self.negative, "clipped": self.clipped, "trace": self.trace}


def solve_ridge_psd(
    gram: Tensor, class_sums: Tensor, num_samples: int, ridge: float | None, sums_noise: float = 0.0
) -> tuple[Tensor, float, list[GCVRow], PSDProjection]:
    """W = (P(G) + γI)⁻¹ C with P(G) = Q diag(max(λ, 0)) Qᵀ, γ fixed or by GCV (``ridge`` None) on
    the projected spectrum over the grid points ≥ |λ_min(G)| (module doc; the floor itself when
    none is); one eigendecomposition for both. Any γ > 0 works: P(G) + γI ≻ 0.

    ``sums_noise``: Σ_c of the noise variance per entry of column c of C. Rotated into any
    orthonormal basis the noise keeps that energy per row, so GCV's q_j = ‖(QᵀC)_j‖² is debiased
    to max(q_j − sums_noise, 0): otherwise GCV takes the noise in C for signal."""
    _check_system(gram, class_sums)
    g = gram.to(torch.float64)
    eigvals, eigvecs = symmetric_eigh(g)
    negative = eigvals < 0
    projection = PSDProjection(int(negative.sum()), float(-eigvals[negative].sum()), float(torch.diagonal(g).sum()))
    projected = eigvecs.T @ class_sums.to(device=g.device, dtype=torch.float64)
    table: list[GCVRow] = []
    if ridge is None:
        n = max(int(num_samples), 1)
        floor = max(-float(eigvals.min()), 0.0) if eigvals.numel() else 0.0
        grid = [gamma for gamma in default_ridge_grid().tolist() if gamma >= floor] or [floor]
        q = ((projected * projected).sum(dim=1) - float(sums_noise)).clamp_min(0.0)
        ridge, table = gcv_from_spectrum(eigvals.clamp_min(0.0), q, n, float(n), grid)
    if not (math.isfinite(float(ridge)) and float(ridge) > 0):
        raise AnalyticInputError(f"ridge must be a finite number > 0, got {ridge!r}")
    weights = eigvecs @ (projected / (eigvals.clamp_min(0.0) + float(ridge)).unsqueeze(1))
    return weights, float(ridge), table, projection


def ridge_residual(gram: Tensor, class_sums: Tensor, weights: Tensor, yty: float) -> float:
    """‖Y − ΦW‖_F² from statistics only: tr(YᵀY) − 2 tr(WᵀC) + tr(WᵀGW).

    For one-hot labels tr(YᵀY) = n, the number of samples.
    """
    _check_system(gram, class_sums)
    if tuple(weights.shape) != tuple(class_sums.shape):
        raise AnalyticInputError(
            f"weights shape {tuple(weights.shape)} does not match class_sums {tuple(class_sums.shape)}"
        )
    g = gram.to(torch.float64)
    c = class_sums.to(torch.float64)
    w = weights.to(torch.float64)
    return float(yty) - 2.0 * float((w * c).sum()) + float((w * (g @ w)).sum())


def default_ridge_grid() -> Tensor:
    """γ candidates for GCV: 41 log-spaced values 1e-2 … 1e8 (4 per decade).

    Wide because γ is not scale-invariant: it must dominate the small eigenvalues of ΦᵀΦ,
    whose scale grows with n and with the (unnormalised) random-feature magnitude; the paper's
    fixed values 1e4 and 1e6 lie inside it.
    """
    return torch.logspace(-2, 8, 41, dtype=torch.float64)


@dataclass(frozen=True)
class GCVRow:
    """One grid point: γ, residual sum of squares, effective degrees of freedom, GCV score."""

    gamma: float
    rss: float
    df: float
    gcv: float


def select_ridge_gcv(
    gram: Tensor,
    class_sums: Tensor,
    num_samples: int,
    yty: float,
    grid: Sequence[float] | Tensor | None = None,
) -> tuple[float, list[GCVRow]]:
    """γ minimising GCV(γ) = n · RSS(γ) / (n − df(γ))², from ONE eigendecomposition of G.

    With G = Q diag(λ) Qᵀ and Ĉ = QᵀC, q_j = Σ_c Ĉ_jc²:
        RSS(γ) = tr(YᵀY) − Σ_j q_j (λ_j + 2γ)/(λ_j + γ)²,   df(γ) = Σ_j λ_j/(λ_j + γ).
    RSS is summed over the output columns; the hat matrix (and so df) is shared by all columns,
    so this is the per-column GCV summed. Grid points with df ≥ n get GCV = +inf.
    Exact for STSA statistics; for STSA-E (estimated Ĝ) it is only a plug-in approximation.
    """
    _check_system(gram, class_sums)
    n = int(num_samples)
    if n <= 0:
        raise AnalyticInputError(f"num_samples must be positive, got {num_samples}")
    gammas = default_ridge_grid() if grid is None else torch.as_tensor(grid, dtype=torch.float64)
    if gammas.dim() != 1 or gammas.numel() == 0 or bool((gammas <= 0).any()):
        raise AnalyticInputError("grid must be a non-empty 1-D sequence of positive values")
    eigvals, eigvecs = symmetric_eigh(gram)
    floor = factorable_floor(eigvals)
    kept = gammas[gammas >= floor]
    gammas = kept if kept.numel() else torch.tensor([floor], dtype=torch.float64)
    eigvals = eigvals.clamp_min(0.0)  # G = ΦᵀΦ is PSD; negatives are rounding noise
    projected = eigvecs.T @ class_sums.to(device=eigvecs.device, dtype=torch.float64)
    return gcv_from_spectrum(eigvals, (projected * projected).sum(dim=1), n, yty, gammas)


def factorable_floor(eigvals: Tensor) -> float:
    """The least γ GCV may choose on G's spectrum so that G + γI keeps a Cholesky factor:
    2·(max(−λ_min, 0) + M·u·λ_max), u the float64 unit roundoff.

    A Gram of fewer samples than features is singular; rounded to float32 for the wire its zero
    eigenvalues move to both sides of zero, and the upload check accepts that (within its stated
    tolerance, and so whatever an adversary hides inside it). GCV runs on the clamped spectrum and
    may prefer a γ below |λ_min| (a random-init ViT-B/16 on digits: γ = 0.03 at λ_min = −0.16),
    where the solve's Cholesky fails and the stage with it. Above 2|λ_min|, λ_min(G + γI) ≥ |λ_min|;
    the second term keeps it above the rounding of the factorisation (and of the eigenvalues), a
    few units of M·u·‖G‖₂. Directions below that level carry nothing the rounding could not have
    put there (as :func:`solve_ridge_psd` floors its grid at |λ_min| for noise)."""
    if not eigvals.numel():
        return 0.0
    lowest, highest = float(eigvals.min()), float(eigvals.max())
    unit = float(torch.finfo(torch.float64).eps) / 2.0
    return 2.0 * (max(-lowest, 0.0) + eigvals.numel() * unit * max(highest, 0.0))


def gcv_from_spectrum(
    eigvals: Tensor,
    q: Tensor,
    num_samples: int,
    yty: float,
    grid: Sequence[float] | Tensor | None = None,
) -> tuple[float, list[GCVRow]]:
    """The GCV scan of :func:`select_ridge_gcv`, given the spectrum already.

    ``eigvals`` λ_j ≥ 0 and ``q`` q_j = ‖row j of QᵀC‖² in any common eigenbasis Q. Shared by the
    dense STSA solve and FedRAN's subspace solve, whose sketch is already diagonal (λ = σ²), so
    neither needs another M×M factorisation.
    """
    n = int(num_samples)
    if n <= 0:
        raise AnalyticInputError(f"num_samples must be positive, got {num_samples}")
    if eigvals.dim() != 1 or q.shape != eigvals.shape:
        raise AnalyticInputError("eigvals and q must be 1-D tensors of the same length")
    gammas = default_ridge_grid() if grid is None else torch.as_tensor(grid, dtype=torch.float64)
    if gammas.dim() != 1 or gammas.numel() == 0 or bool((gammas <= 0).any()):
        raise AnalyticInputError("grid must be a non-empty 1-D sequence of positive values")
    eigvals = eigvals.to(torch.float64)
    q = q.to(device=eigvals.device, dtype=torch.float64)
    table: list[GCVRow] = []
    for gamma in gammas.tolist():
        denom = eigvals + gamma
        rss = float(yty) - float((q * (eigvals + 2.0 * gamma) / (denom * denom)).sum())
        rss = max(rss, 0.0)
        df = float((eigvals / denom).sum())
        gcv = n * rss / (n - df) ** 2 if df < n else math.inf
        table.append(GCVRow(gamma=gamma, rss=rss, df=df, gcv=gcv))
    best = min(table, key=lambda row: row.gcv)
    return best.gamma, table


UNIT = 2.0**-53  # float64 unit roundoff


def product_rounding_bound(rows: int, trace: float) -> float:
    """β with λ_min(Ĝ) ≥ −β for Ĝ = ΦᵀΦ of ``rows`` samples computed in float64 (any summation
    order), ``trace`` = tr Ĝ: |Ĝ − ΦᵀΦ| ≤ γ_n |Φ|ᵀ|Φ| entry by entry, γ_n = n u / (1 − n u)
    (Higham, Accuracy and Stability, §3.5), so ‖Ĝ − ΦᵀΦ‖₂ ≤ γ_n ‖Φ‖²_F = γ_n tr(ΦᵀΦ) ≤ γ_n tr Ĝ / (1 − γ_n)."""
    n_u = max(int(rows), 1) * UNIT
    gamma_n = n_u / (1.0 - n_u) if n_u < 0.5 else math.inf
    return gamma_n * max(float(trace), 0.0) / (1.0 - gamma_n) if gamma_n < 1.0 else math.inf


def sum_rounding_bound(trace: float) -> float:
    """What adding one matrix to another in float64 can cost the sum S's smallest eigenvalue: each
    entry is rounded by at most u|S_ij|, so ‖E‖₂ ≤ ‖E‖_F ≤ u‖S‖_F ≤ u tr S for a PSD S; twice that
    for an S only nearly PSD."""
    return 2.0 * UNIT * max(float(trace), 0.0)


def _valid_bound(bound: float) -> None:
    if not bound >= 0:  # NaN too
        raise AnalyticInputError(f"negative_bound must be >= 0 (math.inf: unknown), got {bound!r}")


@dataclass
class RidgeState:
    """The server's running statistics of every stage so far (temporal aggregation, Eq. 4).

    ``gram`` G_{1:t} (M × M), ``class_sums`` C_{1:t} (M × all classes, global class columns) and
    ``num_samples`` n, all sums over samples: a stage's statistics (or a late client's) just add.

    ``negative_bound`` β: what is certified of G's spectrum, λ_min(G) ≥ −β, summed over what was
    added (each upload's from its check, fcl_flower/analytic/checks.py; ``math.inf`` when a caller
    knows nothing, e.g. STSA-E's estimated G). A γ (fixed, or the Krylov search's) is used on G
    directly only where λ_min(G) ≥ −γ/2 is certified, by β ≤ γ/2 or else by a Cholesky factor of
    G + γ/2·I: then G + γI ⪰ γ/2·I, and no direction is amplified more than a ridge of γ/2 would
    (the exact scan's floor gives the same). Otherwise a fixed γ is kept on G projected onto the
    PSD cone and the Krylov search falls back to the exact scan.
    """

    gram: Tensor
    class_sums: Tensor
    num_samples: int = 0
    negative_bound: float = math.inf  # λ_min(G) >= -negative_bound is certified (math.inf: nothing is)
    previous: float | None = None  # the last γ GCV chose: the Krylov search starts there
    selection: dict[str, object] = field(default_factory=dict)  # how the last γ was selected

    @classmethod
    def empty(cls, dim: int, num_classes: int) -> RidgeState:
        zeros = torch.zeros(dim, dim, dtype=torch.float64)  # PSD: nothing negative to bound
        return cls(zeros, torch.zeros(dim, num_classes, dtype=torch.float64), negative_bound=0.0)

    def add(
        self,
        classes: range,
        gram: Tensor | None,
        class_sums: Tensor,
        num_samples: int,
        negative_bound: float = math.inf,
    ) -> None:
        """G grows by G_t (``None``: G is unchanged); the columns of ``classes`` receive C_t.
        ``negative_bound``: what is certified of G_t, λ_min(G_t) ≥ −negative_bound (default: nothing)."""
        if tuple(class_sums.shape) != (self.gram.shape[0], len(classes)):
            raise AnalyticInputError(
                f"class_sums shape {tuple(class_sums.shape)} does not fit "
                f"{self.gram.shape[0]} features and {len(classes)} classes"
            )
        _valid_bound(negative_bound)
        if gram is not None:
            self.gram += gram
            self._add_bound(negative_bound)
        self.class_sums[:, classes.start : classes.stop] += class_sums
        self.num_samples += int(num_samples)

    def add_packed(
        self,
        classes: range,
        gram_packed: Tensor | None,
        class_sums: Tensor,
        num_samples: int,
        negative_bound: float = math.inf,
    ) -> None:
        """:meth:`add` with G_t as its packed upper triangle: the same numbers, without unpacking it."""
        _valid_bound(negative_bound)
        self.add(classes, None, class_sums, num_samples)  # checks the shapes first
        if gram_packed is not None:
            add_packed_(self.gram, gram_packed)
            self._add_bound(negative_bound)

    def _add_bound(self, bound: float) -> None:
        """G just grew by a matrix certified λ_min ≥ −bound: the sum's bound grows by it and by the
        addition's own rounding."""
        self.negative_bound += float(bound) + sum_rounding_bound(float(torch.diagonal(self.gram).sum()))

    def state_dict(self) -> dict[str, Tensor | int | float]:
        """G as its packed upper triangle where it is exactly symmetric (as sums of packed uploads
        always are): half the bytes to write, hash and sync at every checkpoint. The certified
        bound only where finite (a state without it is read back as certifying nothing)."""
        state: dict[str, Tensor | int | float] = {"class_sums": self.class_sums, "num_samples": self.num_samples}
        if torch.equal(self.gram, self.gram.T):
            state["gram_packed"] = pack_upper(self.gram)
        else:
            state["gram"] = self.gram
        if math.isfinite(self.negative_bound):
            state["negative_bound"] = self.negative_bound
        return state

    @classmethod
    def from_state(cls, state: dict[str, Tensor | int | float], field: str = "ridge") -> RidgeState:
        """The state of :meth:`state_dict`, every field checked (fcl_flower/restore.py): float64
        tensors, finite, of matching shapes, G packed or exactly symmetric; ``num_samples`` an
        integer >= 0; ``negative_bound`` a number >= 0 (absent: nothing certified). Whether the
        bound holds is for :meth:`verify_bound`. AnalyticInputError (one line naming the field,
        ``field`` its prefix) otherwise."""
        try:
            tree = fields.mapping(state, field)
            sums = tree.get("class_sums")
            gram_value = tree["gram_packed"] if "gram_packed" in tree else tree.get("gram")
            for name, value in (
                ("class_sums", sums),
                ("gram_packed" if "gram_packed" in tree else "gram", gram_value),
            ):
                if not isinstance(value, Tensor):
                    raise AnalyticInputError(
                        f"ridge state needs the gram and class_sums tensors (field '{field}/{name}' is {fields.kind(value)})"
                    )
            sums = fields.tensor(sums, f"{field}/class_sums", (None, None))
            dim = int(sums.shape[0])
            if "gram_packed" in tree:
                packed = fields.tensor(tree["gram_packed"], f"{field}/gram_packed", (packed_length(dim),))
                gram = unpack_upper(packed, dim)
            else:
                gram = fields.tensor(tree.get("gram"), f"{field}/gram", (dim, dim))
            samples = fields.integer(fields.entry(tree, "num_samples", field), f"{field}/num_samples", 0)
            bound = tree.get("negative_bound", math.inf)
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound >= 0:  # NaN too
                raise RestoreError(f"{field}/negative_bound", f"must be a number >= 0, not {fields.kind(bound)}")
        except RestoreError as err:
            raise AnalyticInputError(str(err)) from None
        return cls(gram, sums, samples, float(bound))

    def verify_bound(self) -> bool:
        """Whether the certified bound holds of G as it stands: G + β·I has a Cholesky factor, so
        λ_min(G) ≥ −β (up to the factorisation's rounding, as :meth:`certified`). For a restored
        state, whose β must not be taken from the file on trust; ``math.inf`` certifies nothing
        and always holds."""
        if not math.isfinite(self.negative_bound) or not bool(self.gram.any()):
            return True  # nothing certified, or G = 0 (λ_min = 0 <= any bound)
        # the factorisation's own rounding, a few units of M·u·‖G‖₂ (as factorable_floor allows)
        rounding = self.gram.shape[0] * UNIT * max(float(torch.diagonal(self.gram).sum()), 0.0)
        factor, info = shifted_cholesky(self.gram, self.negative_bound + rounding)
        del factor
        return info == 0

    def solve_projected(
        self, num_seen: int, ridge: float | None, sums_noise: float = 0.0
    ) -> tuple[Tensor, float, list[GCVRow], PSDProjection]:
        """:meth:`solve` for noisy statistics: G projected onto the PSD cone (:func:`solve_ridge_psd`)."""
        return solve_ridge_psd(self.gram, self.class_sums[:, :num_seen], self.num_samples, ridge, sums_noise)

    def certified(self, ridge: float) -> bool:
        """Whether λ_min(G) ≥ −γ/2 holds: by the bound (β ≤ γ/2, free) or else by a Cholesky factor
        of G + γ/4·I (:attr:`selection` records which, and the factorisation's time).

        The factorisation runs in float32 first (half the time and memory) where float32's usual
        backward error with the rounding of G, ‖E‖ ≤ 2⁻²²‖A‖₂ ≤ 2⁻²² tr A (:data:`FLOAT32_BACKWARD`),
        stays within γ/4: its success then certifies λ_min(G) ≥ −γ/2. Otherwise, or when it fails,
        float64 decides, and its success certifies λ_min(G) ≥ −γ/4 (the factorisation's own
        rounding aside). Either becomes the new bound, so the next stage pays again only when what
        it adds does not fit under γ/2."""
        if self.negative_bound <= 0.5 * ridge:
            self.selection["certificate"] = "checks"
            return True
        began = time.perf_counter()
        quarter = 0.25 * ridge
        dim = self.gram.shape[0]
        if FLOAT32_BACKWARD * (float(torch.diagonal(self.gram).sum()) + dim * quarter) <= quarter:
            factor, info = shifted_cholesky(self.gram, quarter, torch.float32)
            del factor
            if info == 0:
                self._certify(began, "float32 factorisation", 0.5 * ridge)
                return True
        factor, info = shifted_cholesky(self.gram, quarter)
        del factor
        if info == 0:
            self._certify(began, "float64 factorisation", quarter)
            return True
        self.selection["certificate"] = "none: G + γ/4·I has no Cholesky factor"
        self.selection["certificate_seconds"] = time.perf_counter() - began
        return False

    def _certify(self, began: float, how: str, bound: float) -> None:
        self.selection["certificate"] = how
        self.selection["certificate_seconds"] = time.perf_counter() - began
        self.negative_bound = min(self.negative_bound, bound)

    def solve(self, num_seen: int, ridge: float | None, selection: str = "exact") -> tuple[Tensor, float, list[GCVRow]]:
        """(W over the first ``num_seen`` classes, γ, GCV table): ``ridge`` None selects γ by GCV,
        ``selection`` says how (:func:`uses_krylov`); :attr:`selection` then records how it went.
        The Krylov search starts from the previous stage's γ and falls back to the exact scan
        when it cannot certify its choice (the RSS check, or λ_min(G) ≥ −γ/2: class doc). A fixed
        γ without that certificate is solved on G projected onto the PSD cone (``psd_projection``
        in :attr:`selection`: the reason and what was clipped)."""
        sums = self.class_sums[:, :num_seen]
        table: list[GCVRow] = []
        self.selection = {}
        if ridge is None and uses_krylov(selection, self.gram.shape[0], self.num_samples):
            yty = float(self.num_samples)
            found = krylov_gcv(
                self.gram, sums, self.num_samples, yty, default_ridge_grid(), centre=self.previous, dtype=KRYLOV_DTYPE
            )
            self.selection.update({"method": "krylov", "centres": found.centres, "block_solves": found.block_solves})
            self.selection["margin"] = found.margin
            if found.gamma is not None:
                row = next(row for row in found.rows if row.gamma == found.gamma)
                self.selection["stated_error"] = row.error
                weights = self._direct(sums, found.gamma)
                if weights is None:  # an indefinite G (rounding, or an adversary within the checks)
                    found.reason = (
                        f"λ_min(G) ≥ −γ/2 is not certified at γ = {found.gamma:g}: the exact scan knows λ_min"
                    )
                else:
                    # the search ran on float32 factors: its RSS at γ must match the float64 solution's
                    agrees, deviation = rss_agreement(row.rss, ridge_rss(sums, weights, yty, found.gamma), row.error)
                    self.selection["rss_deviation"] = deviation
                    if agrees:
                        self.previous = found.gamma
                        table = [GCVRow(r.gamma, r.rss, r.df, r.gcv) for r in found.rows]
                        return weights, found.gamma, table
                    found.reason = (
                        f"the search's RSS at γ = {found.gamma:g} is {deviation:.2g} (relative) off the float64 "
                        f"solution's, more than its stated error {row.error:.2g}"
                    )
            self.selection["fallback"] = found.reason
        if ridge is None:
            self.selection.setdefault("method", "exact")
            ridge, table = select_ridge_gcv(self.gram, sums, self.num_samples, float(self.num_samples))
            self.previous = ridge
            return solve_ridge(self.gram, sums, ridge), ridge, table  # γ >= the floor: it has a factor
        self.selection["method"] = "fixed"
        if not float(ridge) > 0:  # γ = 0 (API only; the run config wants γ > 0): G itself must factorise
            return solve_ridge(self.gram, sums, ridge), ridge, table
        weights = self._direct(sums, ridge)
        if weights is not None:
            return weights, ridge, table
        # λ_min(G) < −γ/2 possible (rounding, an estimated G, or an adversary inside the checks'
        # tolerance): keep the user's γ on G projected onto the PSD cone rather than fail the stage
        # or amplify a direction G + γI nearly lacks
        weights, _, _, projection = solve_ridge_psd(self.gram, sums, self.num_samples, ridge)
        reason = f"λ_min(G) ≥ −γ/2 is not certified at the fixed γ = {float(ridge):g}: G projected onto the PSD cone"
        self.selection["psd_projection"] = {"reason": reason, **projection.as_dict()}
        return weights, ridge, table

    def _direct(self, sums: Tensor, ridge: float) -> Tensor | None:
        """(G + γI)⁻¹C where λ_min(G) ≥ −γ/2 is certified and G + γI factorises; else None. The
        certificate's factor is freed before the solve's (one M × M factor at a time)."""
        if not self.certified(ridge):
            return None
        try:
            return solve_ridge(self.gram, sums, ridge)
        except NotPositiveDefiniteError:  # certified by the bound, yet no factor: rounding at the edge
            self.selection["certificate"] = f"{self.selection['certificate']}, but G + γI has no Cholesky factor"
            return None
