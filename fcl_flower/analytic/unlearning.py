"""Exact unlearning from the analytic model: take a contribution out of its statistics again.

The analytic methods keep the model as a function of statistics that are sums over samples
(fcl_flower/analytic/statistics.py): G = ΦᵀΦ, C = ΦᵀY and the counts. A client's upload of one
stage (one task) is such a sum over its samples of that stage, so forgetting it is a subtraction,
and forgetting a subset S of its samples is replacing its upload A by the statistics K of its
kept samples (A − K are the statistics of S). The ridge is then re-solved, with γ re-selected by
GCV under ``ridge auto``: the result is the W of a run that never had the removed samples, up to
float64 rounding (docs/unlearning.md; tests/test_unlearning.py checks ≤ 1e-10 relative).

What is exact, per method:

* **STSA** (:func:`remove_upload`, :func:`replace_upload`): G, C and n are plain sums; the
  subtraction is exact up to the rounding of one float64 addition per entry.
* **STSA-E** (:func:`remove_from_estimator`): Eq. 9 is *not* a sum over uploads (its coefficients
  A_i, B_i depend on the totals n_i, K_i and K), but every input of it is additive: per class the
  sum S_i of class sums, the count n_i, the number of holders K_i, the number of uploads K and the
  outer-product sum P_i = Σ_k C_k^(i) C_k^(i)ᵀ / n_k^(i) (:class:`~.estimator.GramEstimator`).
  Removing a client's K_D uploads subtracts them from each of those and recomputes A_i, B_i from
  the new totals, so Ĝ of the stage becomes exactly the estimate of a run whose stage never had
  them (its K is smaller by K_D, which changes A_i and B_i of *every* class, so a server must keep
  the stage's estimator state, not only Ĝ). The stage's Ĝ in the ridge state is then swapped for
  the new one (:func:`swap_gram`).
* **FedRAN** (:func:`remerge_without`): a truncated QR-SVD merge cannot be undone (what a cut
  discarded of the removed client's summary mixed with everybody else's is gone). Without any
  truncation (every rank at full rank, ``discarded.trace == 0``) the merge equals Σ U_k Σ_k² U_kᵀ and
  the subspace solve equals the dense ridge, whose statistics can be subtracted; in general the
  server keeps the clients' summaries per stage and merges the kept ones again in the same order
  (ascending client id, stage by stage), which performs the very operations of a run that never
  had the removed client, so the result equals that run's. B = Σ_k H_kᵀY_k is a sum and is
  subtracted.

What this cannot forget: the stage-1 backbone trained by FedAvg (the random features Φ are
computed through it). A site that may ask to be forgotten is left out of stage 1 from the start
(``stage1-exclude``, docs/unlearning.md).

A removal is checked (:func:`check_removal`): the removed part A − K must itself be the statistics
of some dataset (non-negative integer counts, [[G, C], [Cᵀ, diag(n)]] ⪰ 0 within the checks'
tolerance), so nobody can "forget" more than it added; the server also compares A with the digest
it kept of the accepted upload (:func:`upload_digest`). After a subtraction nothing is certified
of G's spectrum any more (``negative_bound`` = ∞): the next solve re-certifies λ_min(G) ≥ −γ/2
by a factorisation (:meth:`~.ridge.RidgeState.certified`).

Pure math: no Flower, no I/O.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .checks import StatisticsRejected, check_counts, check_packed_statistics
from .errors import AnalyticInputError
from .estimator import GramEstimator
from .lowrank import LowRankSummary, merge_two_level
from .packing import add_packed_, diagonal_of_packed, packed_length
from .ridge import RidgeState

__all__ = [
    "DIGEST_VERSION",
    "Upload",
    "arrays_digest",
    "check_removal",
    "remerge_without",
    "remove_from_estimator",
    "remove_upload",
    "replace_upload",
    "swap_gram",
    "upload_digest",
]

#: the domain tag hashed in front of every upload digest (a new layout of the bytes gets a new tag)
DIGEST_VERSION = b"fcl-flower/upload-digest/v1"


@dataclass(frozen=True)
class Upload:
    """What one client added to one task's statistics: packed G (None for STSA-E, which sends no
    G), the class sums (M × c_t) and counts (c_t) of the task's classes, and its number of samples."""

    gram_packed: Tensor | None
    class_sums: Tensor
    counts: Tensor
    num_samples: int

    def __post_init__(self) -> None:
        if self.class_sums.dim() != 2:
            raise AnalyticInputError(f"class_sums must be 2-D (M, c), got shape {tuple(self.class_sums.shape)}")
        dim, classes = self.class_sums.shape
        if self.gram_packed is not None and tuple(self.gram_packed.shape) != (packed_length(dim),):
            raise AnalyticInputError(
                f"gram_packed has shape {tuple(self.gram_packed.shape)}, not ({packed_length(dim)},) for M = {dim}"
            )
        if tuple(self.counts.shape) != (classes,):
            raise AnalyticInputError(f"counts has shape {tuple(self.counts.shape)}, not ({classes},)")
        if isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int) or self.num_samples < 0:
            raise AnalyticInputError(f"num_samples must be an int >= 0, got {self.num_samples!r}")

    @classmethod
    def empty(cls, dim: int, classes: int, with_gram: bool = True) -> Upload:
        """The upload of no samples (what a client that forgets all of a stage keeps)."""
        gram = torch.zeros(packed_length(dim), dtype=torch.float64) if with_gram else None
        sums = torch.zeros(dim, classes, dtype=torch.float64)
        return cls(gram, sums, torch.zeros(classes, dtype=torch.float64), 0)

    def minus(self, other: Upload) -> Upload:
        """The statistics of what ``other`` lacks of this one (A − K), in float64."""
        if (self.gram_packed is None) != (other.gram_packed is None) or self.class_sums.shape != other.class_sums.shape:
            raise AnalyticInputError("the two uploads have different shapes or forms")
        gram = None
        if self.gram_packed is not None and other.gram_packed is not None:
            gram = self.gram_packed.to(torch.float64) - other.gram_packed.to(torch.float64)
        return Upload(
            gram,
            self.class_sums.to(torch.float64) - other.class_sums.to(torch.float64),
            self.counts.to(torch.float64) - other.counts.to(torch.float64),
            self.num_samples - other.num_samples,
        )


def _hash_array(digest: Any, name: str, tensor: Tensor | None) -> None:
    """Feed name, dtype, shape and the little-endian C-order bytes of one array to ``digest``
    (canonical: the same numbers always give the same bytes; another dtype or shape gives other
    bytes). The array's memory is hashed in place, without a copy."""
    if tensor is None:
        digest.update(struct.pack("<I", len(name)) + name.encode() + b"\x00none")
        return
    array = np.ascontiguousarray(tensor.detach().to("cpu").numpy())
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    head = f"{name}|{array.dtype.str}|{','.join(str(s) for s in array.shape)}".encode()
    digest.update(struct.pack("<I", len(head)) + head + struct.pack("<Q", array.nbytes))
    digest.update(array.data.cast("B"))


def upload_digest(context: Mapping[str, str | int], upload: Upload) -> str:
    """SHA-256 (hex) of an upload as the server accepted it, bound to ``context`` (run, client,
    task, ...): the server keeps it, the client can recompute it from what it kept, and a removal
    naming other numbers (or another client's, task's or run's) has another digest. About 10 times
    the cost of adding the upload to the sums (0.5 s per 100 MB on a 2-core VM)."""
    named = (("gram_packed", upload.gram_packed), ("class_sums", upload.class_sums), ("counts", upload.counts))
    return arrays_digest(context, named, upload.num_samples)


def arrays_digest(
    context: Mapping[str, str | int], arrays: Sequence[tuple[str, Tensor | None]], num_samples: int
) -> str:
    """SHA-256 (hex) of named arrays (in the given order) and a number of samples, bound to
    ``context``: :func:`upload_digest` for any method's upload (STSA-E's class sums and counts of
    its dummy clients, FedRAN's U, σ and B), the same bytes for STSA's."""
    digest = hashlib.sha256(DIGEST_VERSION)
    for key in sorted(context):
        item = f"{key}={context[key]}".encode()
        digest.update(struct.pack("<I", len(item)) + item)
    for name, tensor in arrays:
        _hash_array(digest, name, tensor)
    digest.update(struct.pack("<q", int(num_samples)))
    return digest.hexdigest()


def check_removal(
    added: Upload, kept: Upload, *, relative_tolerance: float, norm_bound: float = 0.0, nonnegative: bool = False
) -> Upload:
    """The removed part ``added − kept`` when it is the statistics of some dataset of
    ``added.num_samples − kept.num_samples`` samples (counts non-negative integers adding up to that,
    [[G, C], [Cᵀ, diag(n)]] ⪰ 0 within ``relative_tolerance``, fcl_flower/analytic/checks.py);
    otherwise StatisticsRejected with the check's one-line reason. So a client can take out at most
    what it put in: a "removal" of more samples, of a class it never had, or of a direction of G
    it never contributed fails.

    A − K is a difference of two rounded sums, so an entry the removed samples do not touch may come
    out as a rounding of either sign: the check allows an absolute rounding of ``relative_tolerance``
    times the largest entry of A (|G_ij| ≤ max_i G_ii, |C_ic| ≤ max(G_ii, n_c)), the same relative
    room the upload checks give, so what can be taken out beyond the truth is within it."""
    if kept.num_samples > added.num_samples:
        raise StatisticsRejected(
            f"the removal takes out {kept.num_samples - added.num_samples} samples more than were added"
        )
    removed = added.minus(kept)
    check_counts(removed.counts, removed.num_samples)
    if removed.gram_packed is not None and added.gram_packed is not None:
        dim = int(added.class_sums.shape[0])
        largest = max(
            float(diagonal_of_packed(added.gram_packed.to(torch.float64), dim).abs().max()) if dim else 0.0,
            float(added.class_sums.abs().max()) if added.class_sums.numel() else 0.0,
            float(added.counts.abs().max()) if added.counts.numel() else 0.0,
        )
        check_packed_statistics(
            removed.gram_packed,
            removed.class_sums,
            removed.counts,
            relative_tolerance=relative_tolerance,
            absolute_tolerance=relative_tolerance * largest,
            norm_bound=norm_bound,
            nonnegative=nonnegative,
        )
    return removed


def remove_upload(state: RidgeState, classes: range, upload: Upload) -> None:
    """Take ``upload`` (added to the columns of ``classes``) out of the ridge state: G, C and n
    shrink by it. Nothing is certified of G's spectrum afterwards (the next solve re-certifies)."""
    replace_upload(
        state, classes, upload, Upload.empty(state.gram.shape[0], len(classes), upload.gram_packed is not None)
    )


def replace_upload(state: RidgeState, classes: range, added: Upload, kept: Upload) -> None:
    """Swap ``added`` for ``kept`` in the ridge state (a client forgetting some of its samples of
    one task: ``kept`` are the statistics of the rest). The difference is subtracted in one pass."""
    removed = added.minus(kept)
    if tuple(removed.class_sums.shape) != (state.gram.shape[0], len(classes)):
        raise AnalyticInputError(
            f"class_sums shape {tuple(removed.class_sums.shape)} does not fit "
            f"{state.gram.shape[0]} features and {len(classes)} classes"
        )
    if removed.gram_packed is not None:
        add_packed_(state.gram, -removed.gram_packed)
    state.class_sums[:, classes.start : classes.stop] -= removed.class_sums
    state.num_samples -= removed.num_samples
    if state.num_samples < 0:
        raise AnalyticInputError(f"the ridge state would hold {state.num_samples} samples")
    state.negative_bound = math.inf  # a difference of certified matrices: re-certified by the next solve
    state.previous = None


def swap_gram(state: RidgeState, old: Tensor, new: Tensor) -> None:
    """G ← G − old + new (STSA-E: a stage's Ĝ replaced by its estimate without the removed
    uploads); nothing is certified afterwards (an estimated G never is)."""
    state.gram += new.to(torch.float64) - old.to(torch.float64)
    state.negative_bound = math.inf
    state.previous = None


def remove_from_estimator(estimator: GramEstimator, class_sums: Tensor, counts: Tensor) -> None:
    """Take uploads added with ``estimator.add(class_sums, counts)`` out again (module doc, STSA-E;
    :meth:`~.estimator.GramEstimator.remove`)."""
    estimator.remove(class_sums, counts)


def remerge_without(
    stages: Sequence[Sequence[tuple[int, LowRankSummary]]],
    removed: set[int],
    ranks: Sequence[int],
    *,
    stacked: bool = False,
    start: LowRankSummary | None = None,
) -> LowRankSummary | None:
    """FedRAN's running summary merged again from the kept per-client summaries: ``stages[t]`` the
    (client id, summary) pairs of stage t, ``ranks[t]`` the server rank used at stage t. Clients in
    ``removed`` are left out; the rest merge in ascending client id, stage after stage, as
    :meth:`strategies.fedran.FedRANStrategy.aggregate_stats` did, so the result is that of a run
    that never had them (None where no stage keeps anything). ``start``: the summary the run's first
    merge began from (the strategy's empty summary), so the merges are the run's own, bit for bit."""
    if len(ranks) != len(stages):
        raise AnalyticInputError(f"{len(stages)} stages but {len(ranks)} ranks")
    state: LowRankSummary | None = start
    for stage, rank in zip(stages, ranks):
        kept = [summary for client, summary in sorted(stage, key=lambda item: item[0]) if client not in removed]
        if not kept and state is None:
            continue
        state = merge_two_level(kept, state, rank)
    return state
