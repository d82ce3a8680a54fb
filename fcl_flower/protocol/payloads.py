"""The arrays inside replies, typed: what each method uploads, built by clients, checked by the server.

The one part of the protocol that holds tensors: the payloads are the methods' torch math on both
sides, and only messages that carry a model (which import torch anyway) use them; they read and
write through :mod:`fcl_flower.tensors` (zero-copy over the protocol's NumPy readers).

A client builds a payload and calls ``to_record(wire_dtype)``; the server calls ``read(record, ...)``
with the shapes *its own state* implies (M, the task's classes, the rank it asked for), so a
reply can never choose the shapes the server allocates. Every read checks presence, no extra
arrays, numeric dtype, shape and finiteness, and raises :class:`UploadError` with one line.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fcl_flower.analytic.factor import factor_max_rows
from fcl_flower.protocol.arrays import check_values, is_packed_state, npy_view, read_ring, unpack_state
from fcl_flower.protocol.errors import UploadError
from fcl_flower.tensors import cast_for_wire, read_tensor, tensor_layout, tensor_of
from fcl_flower.tensors import tensor_record as to_record

Tensor = torch.Tensor


T = TypeVar("T")


def _exact_keys(record: ArrayRecord, keys: tuple[str, ...]) -> None:
    extra = sorted(set(record.keys()) - set(keys))
    if extra:
        raise UploadError(f"unexpected array(s) {', '.join(extra)}")


def read_state(record: ArrayRecord, expected: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A model state with exactly the keys, shapes and dtypes of ``expected``: packed for its layout
    (fcl_flower/tensors.py, ``state_record``: one array per dtype), or one array per key (then the
    shapes and the integer or floating kind must match). Floating-point values must be finite and
    within the magnitude limit either way; the tensors are copies."""
    if is_packed_state(record):
        layout = tensor_layout(expected)
        unpacked = unpack_state(record, layout)
        for key in record:  # the packed arrays, each read once
            check_values(key, npy_view(record[key]))
        return {key: tensor_of(np.array(values, copy=True)) for key, values in unpacked.items()}
    if set(record.keys()) != set(expected):
        raise UploadError("model state keys differ from the global model's")
    return {
        key: read_tensor(record, key, shape=tuple(value.shape), floating=value.is_floating_point())
        for key, value in expected.items()
    }


def read_fisher(record: ArrayRecord, expected: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A diagonal Fisher: one non-negative float array per trainable parameter, in float64."""
    unexpected = sorted(set(record.keys()) - set(expected))
    if unexpected:
        raise UploadError(f"Fisher has unknown parameter(s): {', '.join(unexpected[:3])}")
    return {
        key: read_tensor(record, key, shape=tuple(p.shape), floating=True, nonnegative=True).to(torch.float64)
        for key, p in expected.items()
    }


@dataclass(frozen=True)
class StsaStats:
    """STSA: the packed upper triangle of G = ΦᵀΦ (M(M+1)/2), the class sums C = ΦᵀY (M × c) and the
    class counts n_c (c); the counts let the server check that (G, C, n_c) fit one dataset."""

    gram_packed: Tensor
    class_sums: Tensor
    counts: Tensor
    KEYS = ("gram-packed", "class-sums", "counts")

    def arrays(self) -> dict[str, Tensor]:
        return {"gram-packed": self.gram_packed, "class-sums": self.class_sums, "counts": self.counts}

    def to_record(self, wire_dtype: str) -> ArrayRecord:
        return to_record({key: cast_for_wire(value, wire_dtype) for key, value in self.arrays().items()})

    @classmethod
    def read(
        cls,
        record: ArrayRecord,
        *,
        packed: int,
        dim: int,
        classes: int,
        noisy_counts: bool = False,
        screened: bool = False,
    ) -> StsaStats:
        """G stays packed at wire precision until summed, read in place (a read-only view of the
        reply's bytes: it is only checked and added, never written to); C and the counts become
        float64 copies. ``noisy_counts``: the counts carry noise (any finite floats;
        fcl_flower/analytic/checks.py). ``screened``: the caller screens G before any use
        (``screen_packed_statistics``, whose pass over it tests the same finiteness and magnitude),
        so they are not tested here too: one read of the largest array instead of two."""
        _exact_keys(record, cls.KEYS)
        counts = read_tensor(record, "counts", shape=(classes,), nonnegative=not noisy_counts).to(torch.float64)
        return cls(
            read_tensor(record, "gram-packed", shape=(packed,), floating=True, finite=not screened, copy=False),
            read_tensor(record, "class-sums", shape=(dim, classes), floating=True).to(torch.float64),
            counts,
        )


@dataclass(frozen=True)
class StsaFactorStats:
    """STSA in factor form (``stats-form factor``, fcl_flower/analytic/factor.py): F = O[Φ Y], one
    row per sample (n × (M + c)), turned by the client's secret Haar rotation O, and the class
    counts n_c; FᵀF is the Gram upload's [[G, C], [Cᵀ, diag n_c]]."""

    factor: Tensor
    counts: Tensor
    KEYS = ("gram-factor", "counts")

    def to_record(self, wire_dtype: str) -> ArrayRecord:
        return to_record(
            {"gram-factor": cast_for_wire(self.factor, wire_dtype), "counts": cast_for_wire(self.counts, wire_dtype)}
        )

    @classmethod
    def read(cls, record: ArrayRecord, *, dim: int, classes: int) -> StsaFactorStats:
        """F is read in place at wire precision (it is only multiplied, never written to), with
        M + c columns and only as many rows as keep it smaller than the Gram upload
        (:func:`~fcl_flower.analytic.factor.factor_max_rows`: an honest client sends the Gram
        otherwise, and a taller factor would make the server's check dearer than the Gram's); the
        counts become a float64 copy."""
        _exact_keys(record, cls.KEYS)
        counts = read_tensor(record, "counts", shape=(classes,), nonnegative=True).to(torch.float64)
        factor = read_tensor(record, "gram-factor", ndim=2, floating=True, copy=False)
        most = factor_max_rows(dim, classes)
        if int(factor.shape[1]) != dim + classes or int(factor.shape[0]) > most:
            raise UploadError(
                f"array 'gram-factor' has shape {tuple(factor.shape)}, expected (rows <= {most}, {dim + classes}): "
                "a taller factor is no smaller than the Gram upload"
            )
        return cls(factor, counts)

    @staticmethod
    def matches(record: ArrayRecord) -> bool:
        """Whether ``record`` is in factor form (it carries the factor, not the packed Gram)."""
        return "gram-factor" in record


@dataclass(frozen=True)
class MaskedStsaStats:
    """STSA under secure aggregation: the same arrays as uint64 ring elements, masked. The counts
    carry one more entry, the samples withheld under min-class-count, so nothing travels in clear."""

    gram_packed: np.ndarray
    class_sums: np.ndarray
    counts: np.ndarray

    def to_record(self) -> ArrayRecord:
        return ArrayRecord(
            {"gram-packed": Array(self.gram_packed), "class-sums": Array(self.class_sums), "counts": Array(self.counts)}
        )

    @classmethod
    def read(cls, record: ArrayRecord, *, packed: int, dim: int, classes: int) -> MaskedStsaStats:
        _exact_keys(record, StsaStats.KEYS)
        return cls(  # read in place: the server only adds them into its ring sums
            read_ring(record, "gram-packed", shape=(packed,), copy=False),
            read_ring(record, "class-sums", shape=(dim, classes), copy=False),
            read_ring(record, "counts", shape=(classes + 1,), copy=False),
        )


@dataclass(frozen=True)
class MaskedFedAvgState:
    """A stage-1 FedAvg upload under secure aggregation (fcl_flower/privacy/secure_fedavg.py): the
    masked ring elements of n_k · w_k over the flattened trainable state (``weights``) and of n_k
    (``count``). Nothing of the client's model or sample count travels in clear."""

    weights: np.ndarray
    count: np.ndarray
    KEYS = ("weights", "count")

    def to_record(self) -> ArrayRecord:
        return ArrayRecord({"weights": Array(self.weights), "count": Array(self.count)})

    @classmethod
    def read(cls, record: ArrayRecord, *, length: int) -> MaskedFedAvgState:
        if set(record.keys()) != set(cls.KEYS):
            raise UploadError(
                "not a masked upload (arrays 'weights' and 'count' of uint64 ring elements): a plain model "
                "state is refused under secure aggregation"
            )
        return cls(  # read in place: the server only adds them into its ring sums
            read_ring(record, "weights", shape=(length,), copy=False),
            read_ring(record, "count", shape=(1,), copy=False),
        )


@dataclass(frozen=True)
class StsaEStats:
    """STSA-E: class sums (K_D × M × c_t) and counts (K_D × c_t) of the client's dummy clients."""

    class_sums: Tensor
    counts: Tensor
    KEYS = ("class-sums", "counts")

    def arrays(self) -> dict[str, Tensor]:
        return {"class-sums": self.class_sums, "counts": self.counts}

    def to_record(self, wire_dtype: str) -> ArrayRecord:
        return to_record({key: cast_for_wire(value, wire_dtype) for key, value in self.arrays().items()})

    @classmethod
    def read(
        cls, record: ArrayRecord, *, dummies: int, dim: int, classes: int, noisy_counts: bool = False
    ) -> StsaEStats:
        """``noisy_counts``: the counts carry noise (any finite floats; fcl_flower/analytic/checks.py)."""
        _exact_keys(record, cls.KEYS)
        counts = read_tensor(record, "counts", shape=(dummies, classes), nonnegative=not noisy_counts)
        counts = counts.to(torch.float64)
        if not noisy_counts and not torch.equal(counts, counts.round()):
            raise UploadError("array 'counts' has non-integer entries")
        sums = read_tensor(record, "class-sums", shape=(dummies, dim, classes), floating=True).to(torch.float64)
        return cls(sums, counts)


@dataclass(frozen=True)
class FedranStats:
    """FedRAN: rank-r_k basis U (M × r_k), singular values σ (r_k), B = HᵀY (M × C_t)."""

    basis: Tensor
    singular_values: Tensor
    label_corr: Tensor
    KEYS = ("basis", "singular-values", "label-corr")

    def arrays(self) -> dict[str, Tensor]:
        return {"basis": self.basis, "singular-values": self.singular_values, "label-corr": self.label_corr}

    def to_record(self, wire_dtype: str) -> ArrayRecord:
        return to_record({key: cast_for_wire(value, wire_dtype) for key, value in self.arrays().items()})

    @classmethod
    def read(cls, record: ArrayRecord, *, dim: int, classes: int, max_rank: int) -> FedranStats:
        """Shapes, finiteness, descending σ ≥ 0 and orthonormal U, all in float64."""
        _exact_keys(record, cls.KEYS)
        basis = read_tensor(record, "basis", ndim=2, floating=True)
        if basis.shape[0] != dim or basis.shape[1] > max_rank:
            raise UploadError(f"basis has shape {tuple(basis.shape)}, expected ({dim}, r_k <= {max_rank})")
        r_k = int(basis.shape[1])
        sigma = read_tensor(record, "singular-values", shape=(r_k,), floating=True, nonnegative=True)
        if r_k > 1 and bool((sigma[1:] > sigma[:-1]).any()):
            raise UploadError("singular values are not in descending order")
        label_corr = read_tensor(record, "label-corr", shape=(dim, classes), floating=True)
        u = basis.to(torch.float64)
        tolerance = 1e3 * torch.finfo(basis.dtype).eps * dim**0.5
        drift = float((u.T @ u - torch.eye(r_k, dtype=torch.float64)).abs().max()) if r_k else 0.0
        if drift > tolerance:
            raise UploadError(f"basis columns are not orthonormal (max |UᵀU − I| = {drift:.2e})")
        return cls(u, sigma.to(torch.float64), label_corr.to(torch.float64))

    @property
    def rank(self) -> int:
        return int(self.basis.shape[1])


def prototype_record(gradients: Mapping[int, list[Tensor]]) -> ArrayRecord:
    """LGA: per class, the encoder gradients on its perturbed prototype, keys ``<class>/<index>``."""
    return to_record({f"{c}/{i}": g for c, gs in gradients.items() for i, g in enumerate(gs)})


def read_prototypes(record: ArrayRecord, classes: range, shapes: list[tuple[int, ...]]) -> dict[int, list[Tensor]]:
    """Inverse of :func:`prototype_record`, checked against the task's classes and the encoder's shapes."""
    by_class: dict[int, set[int]] = {}
    for key in record:
        try:
            cls, idx = (int(part) for part in key.split("/"))
        except ValueError:
            raise UploadError(f"prototype gradient key '{key}' is not '<class>/<index>'") from None
        if cls not in classes:
            raise UploadError(f"prototype gradient for class {cls}, not a class of this task")
        by_class.setdefault(cls, set()).add(idx)
    out: dict[int, list[Tensor]] = {}
    for cls, idxs in by_class.items():
        if idxs != set(range(len(shapes))):
            raise UploadError(f"prototype gradient of class {cls} lacks some encoder parameters")
        out[cls] = [read_tensor(record, f"{cls}/{i}", shape=s, floating=True).float() for i, s in enumerate(shapes)]
    return out


#: the most held-out samples of one class one client may report (no site holds two billion test
#: images of a class); so per-class sums over clients stay far inside int64
MAX_CLASS_SAMPLES = 2**31 - 1


def read_counts(record: ArrayRecord, num_seen: int, num_examples: int) -> tuple[Tensor, Tensor]:
    """An evaluate reply's per-class ``correct`` and ``total`` (int64, ``num_seen`` each): integers,
    non-negative, at most :data:`MAX_CLASS_SAMPLES` each, correct <= total, adding up (in exact
    integers: no int64 wrap) to the reply's number of examples."""
    _exact_keys(record, ("correct", "total"))
    correct = read_tensor(record, "correct", shape=(num_seen,), floating=False, nonnegative=True).to(torch.int64)
    total = read_tensor(record, "total", shape=(num_seen,), floating=False, nonnegative=True).to(torch.int64)
    totals = [int(v) for v in total.tolist()]
    largest = max(totals, default=0)
    if largest > MAX_CLASS_SAMPLES:
        raise UploadError(f"a class count of {largest} exceeds {MAX_CLASS_SAMPLES} held-out samples")
    if bool((correct > total).any()):
        raise UploadError("a class has more correct predictions than test samples")
    if sum(totals) != num_examples:
        raise UploadError(f"the counts add up to {sum(totals)} samples, the reply says {num_examples}")
    return correct, total


def check_declared(total: Sequence[int], declared: Sequence[int], *, zero_is_final: bool = True) -> list[int]:
    """A client's held-out samples per class against those it declared at its first evaluation
    of each class (``declared``: the classes evaluated before, in class order); returns the
    declaration extended by the classes evaluated now for the first time. UploadError naming the
    first class that differs. ``zero_is_final=False`` (the task pool, where a client takes on
    classes seen before) fixes a class at its first non-zero count instead."""
    fixed = [int(v) for v in declared]
    for label, (now, before) in enumerate(zip(total, declared, strict=False)):
        if before == 0 and not zero_is_final:
            fixed[label] = int(now)
        elif int(now) != int(before):
            raise UploadError(
                f"class {label}: {int(now)} held-out samples, {int(before)} at its first evaluation "
                "(a client's held-out set is fixed)"
            )
    return [*fixed, *(int(v) for v in total[len(declared) :])]


@dataclass(frozen=True)
class ForgetStats:
    """A forget round's reply (phase ``stsa-forget``, docs/unlearning.md): per stage the site takes
    something out of, the upload it kept (``added``: the bytes the server accepted, which it checks
    against its digest) and, where the site keeps some samples of that stage, the statistics of
    those (``kept``). Empty for a site with nothing to remove. Each upload's number of samples is
    the sum of its counts (exact counts: a forget round takes no noised uploads)."""

    added: Mapping[int, StsaStats]
    kept: Mapping[int, StsaStats]

    def to_record(self, wire_dtype: str) -> ArrayRecord:
        arrays: dict[str, Tensor] = {}
        for part, uploads in (("added", self.added), ("kept", self.kept)):
            for task, stats in sorted(uploads.items()):
                for key, value in stats.arrays().items():
                    arrays[f"{part}-{task}-{key}"] = cast_for_wire(value, wire_dtype)
        return to_record(arrays)

    @classmethod
    def read(cls, record: ArrayRecord, *, packed: int, dim: int, classes_of: Mapping[int, int]) -> ForgetStats:
        """Every key ``added-<task>-<name>`` or ``kept-<task>-<name>`` for a task of ``classes_of``
        (the stages done so far, and their numbers of classes), each upload complete, a kept part
        only beside its added one; shapes as a statistics upload's (:meth:`StsaStats.read`)."""
        uploads: dict[str, dict[int, StsaStats]] = {"added": {}, "kept": {}}
        for (part, task), sub in forget_groups(record, ("added", "kept"), StsaStats.KEYS, classes_of).items():
            uploads[part][task] = StsaStats.read(sub, packed=packed, dim=dim, classes=classes_of[task])
        stray = sorted(set(uploads["kept"]) - set(uploads["added"]))
        if stray:
            raise UploadError(f"a kept part of stage {stray[0] + 1} without the upload it replaces")
        return cls(uploads["added"], uploads["kept"])


def forget_groups(
    record: ArrayRecord, parts: tuple[str, ...], keys: tuple[str, ...], tasks: Collection[int]
) -> dict[tuple[str, int], ArrayRecord]:
    """A forget reply's arrays ``<part>-<task>-<key>`` grouped by (part, task), in order, each group
    complete (every one of ``keys``) and of a stage in ``tasks`` (those that have run); UploadError
    naming the first array or upload that is not."""
    found: dict[tuple[str, int], set[str]] = {}
    for key in record:
        part, _, rest = key.partition("-")
        task_text, _, name = rest.partition("-")
        if part not in parts or not task_text.isdigit() or name not in keys:
            raise UploadError(f"unexpected array '{key}' in a forget reply")
        if int(task_text) not in tasks:
            raise UploadError(f"array '{key}' names a stage that has not run")
        found.setdefault((part, int(task_text)), set()).add(name)
    groups: dict[tuple[str, int], ArrayRecord] = {}
    for (part, task), names in sorted(found.items()):
        if names != set(keys):
            raise UploadError(f"the {part} upload of stage {task + 1} lacks {sorted(set(keys) - names)}")
        groups[(part, task)] = ArrayRecord({name: record[f"{part}-{task}-{name}"] for name in keys})
    return groups


@dataclass(frozen=True)
class SiteUploads:
    """A whole-site forget round's reply for a method whose uploads are not STSA's (STSA-E: the
    class sums and counts of the site's dummy clients; FedRAN: U, σ, B; docs/unlearning.md): per
    stage, the arrays of the upload the site kept, as the server read them (``added-<task>-<key>``),
    which the server checks against its digest. Empty for a site with nothing to remove."""

    added: Mapping[int, Mapping[str, Tensor]]

    def to_record(self, wire_dtype: str) -> ArrayRecord:
        return to_record(
            {
                f"added-{task}-{name}": cast_for_wire(value, wire_dtype)
                for task, arrays in sorted(self.added.items())
                for name, value in arrays.items()
            }
        )

    @staticmethod
    def read(
        record: ArrayRecord, *, keys: tuple[str, ...], tasks: Collection[int], read_one: Callable[[ArrayRecord, int], T]
    ) -> dict[int, T]:
        """Per stage the upload ``read_one(its arrays, task)`` reads (the method's own parse of a
        statistics upload of that stage, every check of it included)."""
        return {task: read_one(sub, task) for (_, task), sub in forget_groups(record, ("added",), keys, tasks).items()}
