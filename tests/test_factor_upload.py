"""STSA's factor uploads (``stats-form factor``): F = O[Φ Y] with a secret Haar rotation O.

The math (fcl_flower/analytic/factor.py) against direct dense computations, the server's checks
(fcl_flower/analytic/checks.py: every attack written as a test, each rejected with its reason; an
accepted factor always passes the Gram upload's own PSD test), and whole runs through the Flower
glue: the classifier equals the Gram form's, the uploads are the factor's size, a Gram-form run
refuses a factor, and a seeded rotation makes runs reproducible.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message

from clients.stsa import ROTATION_STREAM
from fcl_flower.analytic import bytes_for, checks, pack_upper, packed_length, stsa_upload_numbers
from fcl_flower.analytic.checks import (
    MAGNITUDE_LIMIT,
    StatisticsRejected,
    check_factor_statistics,
    check_packed_statistics,
    wire_epsilon,
)
from fcl_flower.analytic.errors import AnalyticInputError
from fcl_flower.analytic.factor import (
    factor_gram,
    factor_is_smaller,
    factor_length,
    factor_max_rows,
    haar_rotation,
    rotated_factor,
)
from fcl_flower.analytic.kernel import FactorStack
from fcl_flower.analytic.packing import diagonal_of_packed
from fcl_flower.analytic.ridge import product_rounding_bound
from fcl_flower.config import ConfigError
from fcl_flower.privacy.noise import noise_generator
from fcl_flower.protocol import UploadError
from fcl_flower.protocol.payloads import StsaFactorStats, StsaStats
from strategies import stsa as stsa_strategy
from strategies.stsa import NO_GRAM, TaskSum
from tests.conftest import reply_partition, run_in_process, small_config
from tests.test_sum_certificate import _indefinite_within_cauchy_schwarz

F64 = torch.float64


def joint(phi: torch.Tensor, labels: torch.Tensor, classes: int) -> torch.Tensor:
    """[Φ Y] with one-hot Y, built directly."""
    y = torch.nn.functional.one_hot(labels, classes).to(F64)
    return torch.cat([phi, y], dim=1)


def honest(rows: int = 20, dim: int = 50, classes: int = 3, seed: int = 0, relu: bool = True):
    gen = torch.Generator().manual_seed(seed)
    phi = torch.randn(rows, dim, generator=gen, dtype=F64)
    phi = torch.relu(phi) if relu else phi
    labels = torch.arange(rows) % classes
    factor = rotated_factor(phi, labels, classes, np.random.default_rng(seed))
    counts = torch.bincount(labels, minlength=classes).to(F64)
    return phi, labels, factor, counts


def check(factor: torch.Tensor, counts: torch.Tensor, dim: int, rows: int | None = None, **kw):
    kw.setdefault("relative_tolerance", wire_epsilon(factor.dtype))
    return check_factor_statistics(factor, counts, factor.shape[0] if rows is None else rows, dim=dim, **kw)


# --------------------------------------------------------------------------- the math
def test_haar_rotation_is_orthogonal_seeded_and_unbiased() -> None:
    """O is orthogonal; the same generator state gives the same O; and E[O] = 0, which the bare Q
    factor of a Gaussian matrix (LAPACK's signs, no sign correction) does not have."""
    o = haar_rotation(7, np.random.default_rng(3))
    assert torch.allclose(o.T @ o, torch.eye(7, dtype=F64), atol=1e-13)
    assert torch.equal(o, haar_rotation(7, np.random.default_rng(3)))
    rng = np.random.default_rng(0)
    mean = torch.stack([haar_rotation(3, rng) for _ in range(4000)]).mean(dim=0)
    assert float(mean.abs().max()) < 0.05  # each entry has std 1/sqrt(3): the mean's std is 0.009
    raw = torch.stack([torch.linalg.qr(torch.from_numpy(rng.standard_normal((3, 3))))[0] for _ in range(4000)])
    assert float(raw.mean(dim=0).diagonal().abs().min()) > 0.2  # without the correction: biased
    assert haar_rotation(0, rng).shape == (0, 0)
    with pytest.raises(AnalyticInputError, match="size"):
        haar_rotation(-1, rng)


def test_rotated_factor_carries_exactly_the_joint_gram() -> None:
    phi, labels, factor, _ = honest()
    a = joint(phi, labels, 3)
    assert factor.shape == a.shape and factor.dtype == F64
    assert torch.allclose(factor.T @ factor, a.T @ a, rtol=0, atol=1e-12 * float((a.T @ a).abs().max()))
    assert not torch.allclose(factor, a)  # the rows themselves are not sent
    with pytest.raises(AnalyticInputError, match="labels must lie"):
        rotated_factor(phi, labels + 1, 3, np.random.default_rng(0))
    with pytest.raises(AnalyticInputError, match="labels must lie"):
        rotated_factor(phi, labels - 1, 3, np.random.default_rng(0))
    with pytest.raises(AnalyticInputError, match="n x M"):
        rotated_factor(phi, labels[:-1], 3, np.random.default_rng(0))


def test_factor_gram_equals_the_direct_products() -> None:
    phi, _labels, factor, counts = honest(rows=40, dim=1100, relu=False)  # > one block of rows at M = 1100
    dim = phi.shape[1]
    stats = factor_gram(factor, dim)
    gram = factor[:, :dim].T @ factor[:, :dim]
    scale = float(gram.abs().max())
    assert torch.allclose(stats.gram_packed, pack_upper(gram), rtol=0, atol=1e-13 * scale)
    assert torch.allclose(stats.class_sums, factor[:, :dim].T @ factor[:, dim:], rtol=0, atol=1e-12 * scale)
    assert torch.allclose(stats.label_gram, torch.diag(counts), rtol=0, atol=1e-12 * float(counts.max()))
    d = gram.diagonal().sqrt()
    assert stats.lowest_gram == pytest.approx(float((gram / torch.outer(d, d)).min()), abs=1e-12)
    sums = stats.class_sums / torch.outer(d, counts.sqrt())
    assert stats.lowest_sums == pytest.approx(float(sums.min()), abs=1e-12)
    negative = (gram / torch.outer(d, d)).clamp_max(0.0)
    assert stats.negative_gram_energy == pytest.approx(float((negative * negative).sum()), rel=1e-10)
    assert stats.lowest_gram < -0.1 and stats.lowest_sums < -0.1  # Gaussian features: far from >= 0


def test_factor_gram_of_nonnegative_features_reports_no_negative_entry() -> None:
    phi, labels, _, _ = honest(rows=12, dim=20)
    stats = factor_gram(joint(phi, labels, 3), 20)  # unrotated: the products are exact sums of >= 0 terms
    assert stats.lowest_gram == 0.0 and stats.lowest_sums == 0.0 and stats.negative_gram_energy == 0.0
    with pytest.raises(AnalyticInputError, match="M = 30"):
        factor_gram(joint(phi, labels, 3), 30)


def scaled_reference(factor: torch.Tensor, dim: int) -> tuple[float, float, float]:
    """lowest_gram, lowest_sums and negative_gram_energy computed directly from the full matrices."""
    f = factor.to(F64)
    phi, y = f[:, :dim], f[:, dim:]
    gram, sums, labels = phi.T @ phi, phi.T @ y, y.T @ y

    def inverse(d: torch.Tensor) -> torch.Tensor:
        root = d.sqrt()
        return torch.where(root > 0, 1.0 / root, torch.zeros_like(root))

    g_inv, y_inv = inverse(torch.diagonal(gram)), inverse(torch.diagonal(labels))
    scaled = gram * g_inv[:, None] * g_inv[None, :]
    scaled_sums = sums * g_inv[:, None] * y_inv[None, :]
    off = scaled.clone()
    off.fill_diagonal_(0.0)
    energy = float((off.clamp_max(0.0) ** 2).sum())
    lowest = min(0.0, float(scaled.min())) if scaled.numel() else 0.0
    lowest_sums = min(0.0, float(scaled_sums.min())) if scaled_sums.numel() else 0.0
    return lowest, lowest_sums, energy


@pytest.mark.parametrize(("dim", "scale"), [(20, 0.05), (20, 3.0), (2100, 0.05)])
def test_factor_gram_scaled_minima_and_energy_equal_the_direct_ones(dim: int, scale: float) -> None:
    """Features of any sign and size (norms below and above 1), a zero feature, a class with one
    sample (label norm exactly 1), an empty class; at M = 2100 G spans two packed blocks."""
    gen = torch.Generator().manual_seed(dim)
    rows = 3 if dim > 1000 else 9
    phi = scale * torch.randn(rows, dim, generator=gen, dtype=F64)
    phi[:, 1] = 0.0
    labels = torch.tensor([0] * (rows - 1) + [1])
    factor = joint(phi, labels, 3)  # class 2 is empty
    stats = factor_gram(factor, dim)
    lowest, lowest_sums, energy = scaled_reference(factor, dim)
    assert stats.lowest_gram < 0 and stats.lowest_sums < 0 and stats.negative_gram_energy > 0
    assert stats.lowest_gram == pytest.approx(lowest, rel=1e-12)
    assert stats.lowest_sums == pytest.approx(lowest_sums, rel=1e-12)
    assert stats.negative_gram_energy == pytest.approx(energy, rel=1e-10)
    assert torch.equal(stats.label_gram, factor[:, dim:].T @ factor[:, dim:])


def test_factor_gram_edge_shapes_and_dtypes() -> None:
    phi = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float32)
    as32 = factor_gram(phi, 2)  # M = all columns: no label block
    assert as32.gram_packed.dtype == F64 and as32.class_sums.shape == (2, 0) and as32.lowest_sums == 0.0
    assert torch.equal(as32.gram_packed, pack_upper(phi.to(F64).T @ phi.to(F64)))
    none = factor_gram(phi, 0)  # M = 0: every column is a label
    assert none.gram_packed.numel() == 0 and none.lowest_gram == 0.0 and none.class_sums.shape == (0, 2)
    for bad in (-1, 3):
        with pytest.raises(AnalyticInputError, match=f"with M = {bad}, got shape"):
            factor_gram(phi, bad)
    with pytest.raises(AnalyticInputError, match="with M = 1"):
        factor_gram(phi[0], 1)


def test_rotated_factor_refuses_bad_input_and_takes_any_integer_labels() -> None:
    rng = np.random.default_rng(0)
    phi = torch.ones(4, 2, dtype=F64)
    with pytest.raises(AnalyticInputError, match="features must be n x M"):
        rotated_factor(torch.ones(4, 2, 2, dtype=F64), torch.zeros(4, dtype=torch.long), 2, rng)
    with pytest.raises(AnalyticInputError, match="features must be n x M"):
        rotated_factor(phi, torch.zeros(4, 1, dtype=torch.long), 2, rng)
    with pytest.raises(AnalyticInputError, match="features must be n x M"):
        rotated_factor(phi, torch.zeros(3, dtype=torch.long), 2, rng)
    for bad in ([0, 1, 3, 0], [0, -1, 1, 0]):
        with pytest.raises(AnalyticInputError, match=r"^labels must lie in 0\.\.2$"):
            rotated_factor(phi, torch.tensor(bad), 3, rng)
    small = torch.tensor([0, 1, 1, 2], dtype=torch.uint8)  # a uint8 index would be a mask
    factor = rotated_factor(phi, small, 3, np.random.default_rng(1))
    assert torch.allclose(
        factor[:, 2:].T @ factor[:, 2:], torch.diag(torch.tensor([1.0, 2.0, 1.0], dtype=F64)), atol=1e-12
    )


def test_factor_sizes() -> None:
    """n(M + c) + c numbers; smaller than the Gram upload M(M+1)/2 + Mc + c exactly below the crossing."""
    assert factor_length(60, 5000, 10) == 60 * 5010 + 10
    gram = stsa_upload_numbers(100, 2, packed=True, counts=True)
    assert gram == packed_length(100) + 100 * 2 + 2
    crossing = [rows for rows in range(200) if factor_is_smaller(rows, 100, 2)]
    assert crossing == list(range(max(crossing) + 1))
    for dim, classes in ((100, 2), (50, 3), (1, 1), (7, 0), (0, 4), (0, 0)):
        smaller = [rows for rows in range(300) if factor_is_smaller(rows, dim, classes)]
        assert factor_max_rows(dim, classes) == (max(smaller) if smaller else -1)
    assert factor_length(max(crossing), 100, 2) < gram <= factor_length(max(crossing) + 1, 100, 2)
    for bad in ((-1, 5, 2), (1, -5, 2), (1, 5, -2)):
        with pytest.raises(AnalyticInputError, match=r"^rows, dim and classes must be >= 0, got "):
            factor_length(*bad)
    for dim in range(30):
        for classes in range(5):
            smaller = [rows for rows in range(dim * dim + 2) if factor_is_smaller(rows, dim, classes)]
            assert factor_max_rows(dim, classes) == (max(smaller) if smaller else -1), (dim, classes)
    for bad in ((-1, 2), (3, -1)):
        with pytest.raises(AnalyticInputError, match=rf"^dim and classes must be >= 0, got {bad[0]}, {bad[1]}$"):
            factor_max_rows(*bad)


# --------------------------------------------------------------------------- the checks
@pytest.mark.parametrize("wire", [torch.float32, torch.float64])
def test_honest_factor_passes_and_stands_for_the_gram_upload(wire: torch.dtype) -> None:
    """An honest factor (any wire dtype, ReLU signs, a norm bound) passes, and the G and C it stands
    for are the true ones within the wire's rounding; they also pass the Gram upload's checks."""
    rows = 40
    phi, labels, factor, counts = honest(rows=rows, dim=80)
    bound = float(phi.norm(dim=1).max())
    gram, sums = check(factor.to(wire), counts, 80, nonnegative=True, norm_bound=bound)
    eps = wire_epsilon(wire)
    # the wire's rounding, plus the float64 arithmetic's, 4 (rows + 1) u as in the check's τ: the
    # rotation O[Φ Y] and the products are sums of `rows` terms, and for a float64 wire their
    # rounding (in the BLAS kernel's order) decides: 8.4 u x max under MKL's SSE4.2 and AVX code
    # paths, 4.2 to 6.3 u x max under AVX2 and AVX-512 (a bare 8 eps failed on the former)
    slack = 8 * eps + 4 * (rows + 1) * wire_epsilon(F64)
    true_gram = phi.T @ phi
    assert float((gram - pack_upper(true_gram)).abs().max()) <= slack * float(true_gram.abs().max())
    onehot = torch.nn.functional.one_hot(labels, 3).to(F64)
    assert float((sums - phi.T @ onehot).abs().max()) <= slack * float((phi.T @ onehot).abs().max())
    check_packed_statistics(gram, sums, counts, relative_tolerance=eps, nonnegative=True, norm_bound=bound)


def test_empty_class_needs_a_zero_column() -> None:
    _phi, _labels, factor, counts = honest(classes=3)
    wide = torch.cat([factor, torch.zeros(factor.shape[0], 1, dtype=F64)], dim=1)  # a 4th class, no sample
    check(wide, torch.cat([counts, torch.zeros(1, dtype=F64)]), 50)
    wide[0, -1] = 1e-9
    with pytest.raises(StatisticsRejected, match="label block"):
        check(wide, torch.cat([counts, torch.zeros(1, dtype=F64)]), 50)


def _attack(name: str):
    phi, labels, factor, counts = honest()
    f, n, rows = factor.clone(), counts.clone(), None
    if name == "rows-not-samples":
        rows = f.shape[0] + 1
    elif name == "too-many-rows":
        f = torch.cat([f, torch.zeros(60, f.shape[1], dtype=F64)])  # 80 rows > M + c = 53
        rows = f.shape[0]
    elif name == "not-smaller":  # rows <= M + c, but more numbers than the Gram: dearer to check
        f = torch.cat([f, torch.zeros(factor_max_rows(50, 3) + 1 - f.shape[0], f.shape[1], dtype=F64)])
        rows = f.shape[0]
    elif name == "wrong-width":
        f = f[:, 1:]
    elif name == "counts-lie":  # counts that do not match the label block (total unchanged)
        n[0], n[1] = n[0] + 1, n[1] - 1
    elif name == "soft-labels":  # label columns that are not one-hot: off-diagonal label Gram
        f[:, 50:] = rotated_factor(phi, labels, 3, np.random.default_rng(1))[:, 50:] @ torch.tensor(
            [[0.9, 0.1, 0.0], [0.1, 0.9, 0.0], [0.0, 0.0, 1.0]], dtype=F64
        )
    elif name == "negative-features":
        f[:, :50] = rotated_factor(-phi, labels, 3, np.random.default_rng(0))[:, :50]
    elif name == "too-long":
        f[:, :50] *= 10.0
    elif name == "huge":
        f[0, 0] = 1e75
    elif name == "nan":
        f[0, 0] = float("nan")
    return f, n, rows, float(phi.norm(dim=1).max())


ATTACKS = {
    "rows-not-samples": "21 samples",
    "too-many-rows": "send the Gram",
    "not-smaller": "send the Gram",
    "wrong-width": "do not fit",
    "counts-lie": "label block",
    "soft-labels": "label block",
    "negative-features": "negative entries",
    "too-long": "n·B²",
    "huge": "magnitude",
    "nan": "NaN",
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_bad_factor_is_rejected_with_its_reason(name: str) -> None:
    factor, counts, rows, bound = _attack(name)
    with pytest.raises(StatisticsRejected, match=ATTACKS[name]):
        check(factor, counts, 50, rows=rows, nonnegative=True, norm_bound=bound)


def test_magnitude_limit_keeps_every_product_under_the_gram_limit() -> None:
    """|F_ij| <= sqrt(limit / rows): FᵀF's entries then stay under the Gram upload's limit."""
    rows = 4
    edge = float(np.sqrt(MAGNITUDE_LIMIT / rows))
    factor = torch.zeros(rows, 11, dtype=F64)
    factor[:, 0] = edge * 0.999
    gram, _ = check(factor, torch.zeros(2, dtype=F64), 9)
    assert float(gram[0]) <= MAGNITUDE_LIMIT
    factor[0, 0] = edge * 1.001
    with pytest.raises(StatisticsRejected, match="magnitude"):
        check(factor, torch.zeros(2, dtype=F64), 9)


def test_forged_label_block_is_refused_before_the_feature_gram(monkeypatch: pytest.MonkeyPatch) -> None:
    """The label block (r c² work) is checked before the r M² product of the feature block, so a
    forged label block costs the server next to nothing."""
    calls: list[int] = []
    real = checks.factor_gram

    def counted(factor: torch.Tensor, dim: int, **options: bool):
        calls.append(dim)
        return real(factor, dim, **options)

    monkeypatch.setattr(checks, "factor_gram", counted)
    _, _, factor, counts = honest()
    check(factor, counts, 50)
    assert calls == [50]  # an honest factor: one product
    forged = factor.clone()
    forged[:, 50:] *= 1.5
    with pytest.raises(StatisticsRejected, match="label block"):
        check(forged, counts, 50)
    assert calls == [50]  # refused without it


def sparse_relu(rows: int, dim: int, density: float, rng: np.random.Generator) -> torch.Tensor:
    """ReLU features of which most pairs are never active together: G_ij = 0 exactly, which a
    rotation turns into ± rounding."""
    return torch.from_numpy(np.abs(rng.standard_normal((rows, dim))) * (rng.random((rows, dim)) < density))


@pytest.mark.parametrize("wire", [torch.float32, torch.float64])
def test_sparse_relu_factor_stands_for_nonnegative_statistics(wire: torch.dtype) -> None:
    """An honest factor of sparse ReLU features passes, and the G and C it stands for have no
    negative entry (rounding of true zeros is clamped to 0), so they pass the Gram upload's sign
    test (floor exactly 0) and PSD test; an entry beyond the rounding is still refused."""
    rng = np.random.default_rng(11)
    rows, dim, classes = 60, 300, 4
    phi = sparse_relu(rows, dim, 0.05, rng)
    labels = torch.from_numpy(rng.integers(0, classes, rows))
    counts = torch.bincount(labels, minlength=classes).to(F64)
    factor = rotated_factor(phi, labels, classes, rng).to(wire)
    raw = factor_gram(factor, dim)
    assert float(raw.gram_packed.min()) < 0  # the rounding the clamp is for
    eps = wire_epsilon(wire)
    gram, sums = check(factor, counts, dim, nonnegative=True)
    assert float(gram.min()) >= 0 and float(sums.min()) >= 0
    true_gram = pack_upper(phi.T @ phi)
    assert float((gram - true_gram).abs().max()) <= 8 * eps * float(true_gram.abs().max())
    check_packed_statistics(gram, sums, counts, relative_tolerance=eps, nonnegative=True)
    forged = factor.clone()
    forged[:, 0] -= 1e-3 * forged[:, 1]  # G_01 pushed to -1e-3 G_11: far beyond rounding
    with pytest.raises(StatisticsRejected, match="negative entries"):
        check(forged, counts, dim, nonnegative=True)


def test_label_block_forged_within_each_entrys_tolerance_is_refused() -> None:
    """Float64: every entry of the label block within its rounding tolerance τ√(n_i n_j), yet
    together (c(c - 1) entries on a direction where J is singular) enough to push J below the Gram
    check's slack. The Gram check refuses the statistics; so must the factor check.

    The forgery is exact, so its set-up holds on every CPU and BLAS code path: the label block is
    one-hot plus, in each row, one entry s = 0.9 τ n (a multiple of u = 2⁻⁵³) in another class's
    column, each pair of classes getting one row; O is a signed permutation. Every product in
    F_YᵀF_Y is then exact, an entry off the diagonal has a single non-zero term (s), and the s²
    terms of a diagonal entry are below half an ulp of n_c, so F_YᵀF_Y = diag(n) + s(11ᵀ - I)
    whatever the summation order. (Built at 0.9 τ through eigh and a Haar rotation instead, the
    forgery's own rounding was about 0.1 τ: some entry landed over τ under MKL's AVX2 and AVX-512
    paths.)"""
    u = wire_epsilon(F64)
    rows, dim, classes = 21, 36, 7  # n = 3 rows a class, and one row for each of the 21 pairs of classes
    assert factor_is_smaller(rows, dim, classes)
    rng = np.random.default_rng(2)
    labels = torch.arange(rows) % classes
    counts = torch.bincount(labels, minlength=classes).to(F64)
    phi = torch.from_numpy(rng.standard_normal((rows, dim)))
    phi[:, 0] = 1.0  # φ_0 = Σ_c y_c: [e_0; -1] is a null direction of J
    tau = 2 * u + 4 * (rows + 1) * u  # the per-entry tolerance of the label block: 90 u
    step = 243 * u  # 0.9 τ √(n_i n_j) = 0.9 · 90 u · 3
    honest = joint(phi, labels, classes)
    forged = honest.clone()
    row = torch.arange(rows)
    forged[row, dim + (labels + 1 + row // classes) % classes] = step  # class l's rows: classes l + 1, 2, 3 (mod 7)
    flip = torch.from_numpy(rng.choice([-1.0, 1.0], size=rows))[:, None]
    order = torch.from_numpy(rng.permutation(rows))
    factor, forged = (flip * honest)[order], (flip * forged)[order]  # O = a signed permutation: exact
    stats = factor_gram(forged, dim)
    deviation = stats.label_gram - torch.diag(counts)
    assert torch.equal(deviation, step * (1 - torch.eye(classes, dtype=F64)))  # exact, on any CPU
    root = counts.sqrt()
    assert bool((deviation.abs() <= tau * torch.outer(root, root)).all())  # each entry within τ
    with pytest.raises(StatisticsRejected, match="not positive semidefinite"):  # the attack is real
        check_packed_statistics(stats.gram_packed, stats.class_sums, counts, relative_tolerance=u)
    with pytest.raises(StatisticsRejected, match="label block"):
        check(forged, counts, dim)
    check(factor, counts, dim)  # the honest one passes


def test_underflow_forgeries_are_refused() -> None:
    """Entries whose squares underflow to 0: a label column of a class without samples, or a
    feature column, has a zero diagonal in FᵀF but non-zero products with the rest. The Gram check
    refuses such statistics (a zero diagonal needs a zero row); so must the factor check."""
    phi, labels, _, counts = honest(rows=20, classes=3)
    wide = joint(phi, labels, 4)  # a 4th class without samples; O = I is a rotation too
    four = torch.cat([counts, torch.zeros(1, dtype=F64)])
    first, second = (int(i) for i in torch.nonzero(labels == 0)[:2])
    wide[first, -1], wide[second, -1] = 1e-170, -1e-170  # orthogonal to every label column, square 0
    stats = factor_gram(wide, 50)
    assert float(stats.label_gram[-1].abs().max()) == 0 and float(stats.class_sums[:, -1].abs().max()) > 0
    with pytest.raises(StatisticsRejected, match="zero energy"):
        check_packed_statistics(stats.gram_packed, stats.class_sums, four, relative_tolerance=wire_epsilon(F64))
    with pytest.raises(StatisticsRejected, match="without samples"):
        check(wide, four, 50)

    _, _, factor, counts = honest(rows=20, classes=3)
    feature = factor.clone()
    feature[:, 0] = 0.0
    feature[:2, 0] = 1e-170  # G_00 underflows to 0, G_0j and C_0c do not
    stats = factor_gram(feature, 50)
    assert float(stats.gram_packed[0]) == 0 and float(stats.class_sums[0].abs().max()) > 0
    with pytest.raises(StatisticsRejected, match="zero energy"):
        check_packed_statistics(stats.gram_packed, stats.class_sums, counts, relative_tolerance=wire_epsilon(F64))
    # refused before G is made: zero energy then holds by construction
    with pytest.raises(StatisticsRejected, match="underflow"):
        check(feature, counts, 50)
    quiet = factor.clone()
    quiet[:, 0] = 0.0  # a feature never active: a zero column is honest
    check(quiet, counts, 50, nonnegative=True)


def test_subnormal_entries_are_refused() -> None:
    """Float64: a feature column of entries ~1e-162, whose squares are subnormal (G_ii computed 7 %
    low), beside a column along it: the derived G breaks Cauchy-Schwarz by the lost precision and
    the Gram check refuses it; the factor check refuses any non-zero entry whose square would
    underflow. Exact zeros (a feature never active) pass."""
    _, _, factor, counts = honest(rows=20, classes=3)
    forged = factor.clone()
    forged[:, :2] = 0.0
    forged[:2, 0] = 2.3e-162
    forged[:2, 1] = 0.23  # column 1 = 1e161 x column 0
    stats = factor_gram(forged, 50)
    with pytest.raises(StatisticsRejected, match="Cauchy-Schwarz"):  # the attack is real
        check_packed_statistics(stats.gram_packed, stats.class_sums, counts, relative_tolerance=wire_epsilon(F64))
    with pytest.raises(StatisticsRejected, match="underflow"):
        check(forged, counts, 50)
    forged[:2, 0] = 2.0**-500  # the smallest magnitude allowed: squares stay normal
    gram, sums = check(forged, counts, 50)
    check_packed_statistics(gram, sums, counts, relative_tolerance=wire_epsilon(F64))


@pytest.mark.parametrize("wire", [torch.float32, torch.float64])
def test_norm_bound_is_the_gram_checks(wire: torch.dtype) -> None:
    """tr G ≤ n B² with exactly the Gram check's slack: a bound that the Gram check refuses on the
    derived statistics is refused on the factor, a bound just above them passes both."""
    phi, _labels, factor, counts = honest(rows=20, dim=50)
    factor = factor.to(wire)
    eps, rows = wire_epsilon(wire), int(factor.shape[0])
    stats = factor_gram(factor, 50)
    trace = float(diagonal_of_packed(stats.gram_packed, 50).sum())
    gram_slack = 4 * (50 + 3) * eps
    tau = 2 * eps + 4 * (rows + 1) * wire_epsilon(F64)
    loose = np.sqrt(trace / (rows * (1 + gram_slack + tau / 2)))  # within the old slack, beyond the Gram's
    with pytest.raises(StatisticsRejected, match="n·B²"):
        check_packed_statistics(stats.gram_packed, stats.class_sums, counts, relative_tolerance=eps, norm_bound=loose)
    with pytest.raises(StatisticsRejected, match="n·B²"):
        check(factor, counts, 50, norm_bound=loose)
    fits = np.sqrt(trace / (rows * (1 + gram_slack / 2)))
    gram, sums = check(factor, counts, 50, norm_bound=fits)
    check_packed_statistics(gram, sums, counts, relative_tolerance=eps, norm_bound=fits)
    assert fits < float(phi.norm(dim=1).max())  # tighter than any honest bound: the edge is tested


def _perturbed(factor: torch.Tensor, dim: int, rng: np.random.Generator, scale: float) -> torch.Tensor:
    """A factor pushed off honesty by about ``scale`` (relative) in one random way."""
    f = factor.clone()
    kind = int(rng.integers(0, 3))
    if kind == 0:  # the label block: a random symmetric stretch
        sym = rng.standard_normal((f.shape[1] - dim,) * 2)
        f[:, dim:] = f[:, dim:] @ (torch.eye(f.shape[1] - dim, dtype=F64) + scale * torch.from_numpy(sym + sym.T))
    elif kind == 1:  # the feature block: every column mixed with another (negative entries in G and C)
        f[:, :dim] -= scale * f[:, :dim][:, torch.from_numpy(rng.permutation(dim))]
    else:  # the label columns leaking into the features
        f[:, :dim] -= scale * f[:, dim:][:, torch.from_numpy(rng.integers(0, f.shape[1] - dim, dim))]
    return f


def test_an_accepted_factor_always_passes_the_gram_check() -> None:
    """Whatever the feature block (signed or ReLU, dense or sparse, any scale), with or without a
    norm bound and ReLU signs, honest or pushed off honesty by about the rounding tolerance: a
    factor the check accepts stands for statistics that pass the Gram upload's own check with the
    same options (signs, norm bound, PSD): the factor form accepts nothing the Gram form would
    reject. Honest factors are always accepted."""
    rng = np.random.default_rng(5)
    accepted = refused = 0
    for trial in range(40):
        dim, classes = int(rng.integers(2, 60)), int(rng.integers(1, 6))
        rows = int(rng.integers(1, factor_max_rows(dim, classes) + 1))
        labels = torch.from_numpy(rng.integers(0, classes, rows))
        relu = trial % 2 == 0
        if relu:
            phi = sparse_relu(rows, dim, float(rng.uniform(0.02, 1.0)), rng)
        else:
            phi = torch.from_numpy(rng.standard_normal((rows, dim)))
        phi = phi * 10.0 ** rng.uniform(-3, 3)
        factor = rotated_factor(phi, labels, classes, rng)
        counts = torch.bincount(labels, minlength=classes).to(F64)
        bound = float(phi.norm(dim=1).max()) if trial % 3 else 0.0
        options = {"nonnegative": relu, "norm_bound": bound}
        for wire in (torch.float32, torch.float64):
            eps = wire_epsilon(wire)
            gram, sums = check(factor.to(wire), counts, dim, **options)  # honest: accepted
            check_packed_statistics(gram, sums, counts, relative_tolerance=eps, **options)
            for scale in 10.0 ** rng.uniform(-2, 1.5, size=3) * (4 * (rows + dim + classes) * eps):
                forged = _perturbed(factor, dim, rng, float(scale)).to(wire)
                try:
                    gram, sums = check(forged, counts, dim, **options)
                except StatisticsRejected:
                    refused += 1
                    continue
                accepted += 1
                check_packed_statistics(gram, sums, counts, relative_tolerance=eps, **options)
    assert accepted > 20 and refused > 20  # both sides of the line were exercised


# --------------------------------------------------------------------------- the server's sum
def stacked_sum(uploads: list[tuple[torch.Tensor, torch.Tensor]], dim: int, gram_upload=None) -> TaskSum:
    """A TaskSum of factor uploads (checked as the server checks them), after an optional Gram upload."""
    total = TaskSum(dim, int(uploads[0][1].numel()), clamp=True)
    if gram_upload is not None:
        total.add("gram", gram_upload, int(gram_upload.counts.sum()), None, 0.0)
    for k, (factor, counts) in enumerate(uploads):
        _, sums = check(factor, counts, dim, nonnegative=True)
        total.add(f"client-{k}", StsaStats(NO_GRAM, sums, counts), factor.shape[0], factor, 0.0)
    return total


def test_the_sum_of_factor_uploads_is_one_product_of_their_rows_within_its_bound() -> None:
    """The server never makes one factor upload's G (issue 30): it stacks their rows and adds one
    product of them, clamped, whenever G is read or M/2 rows wait. That equals the sum of the
    uploads' own clamped G to the products' rounding, which the sum's certified bound covers; the
    same uploads in the same order give the same numbers bit for bit (a rebuilt sum after a
    culprit); a Gram upload in the same round simply adds."""
    dim = 50
    uploads = [honest(rows=12, dim=dim, seed=s)[2:] for s in range(5)]  # 60 rows: flushed at 25 and 50
    total = stacked_sum(uploads, dim)
    direct = sum(check(f, c, dim, nonnegative=True)[0] for f, c in uploads)
    gram = total.gram
    trace = float(diagonal_of_packed(gram, dim).sum())
    assert float((gram - direct).abs().max()) <= 2 * product_rounding_bound(60, trace)
    assert float(gram.min()) >= 0.0  # ReLU features: the clamp leaves no negative rounding
    assert 0 < total.stacked_bound <= total.negative_bound
    assert total.stacked_bound >= 2 * product_rounding_bound(12, trace)
    assert torch.equal(stacked_sum(uploads, dim).gram, gram)

    phi, labels, _, counts = honest(rows=30, dim=dim, seed=9)
    packed = pack_upper(phi.T @ phi)
    sums = phi.T @ torch.nn.functional.one_hot(labels, 3).to(F64)
    mixed = stacked_sum(uploads, dim, StsaStats(packed, sums, counts)).gram
    assert torch.allclose(mixed, gram + packed, rtol=1e-12, atol=0.0)


def test_the_kernel_stack_takes_a_rounds_factors_at_once() -> None:
    """A round's factors go into the kernel stack as one block (its arrays copied once a round):
    the same rows and labels as one upload at a time, the kernel to rounding."""
    dim, classes = 50, 3
    factors = [honest(rows=10, dim=dim, seed=s)[2] for s in range(4)]
    one_by_one, at_once = FactorStack.empty(dim, 5, 100), FactorStack.empty(dim, 5, 100)
    for factor in factors:
        one_by_one.add(factor, range(2, 2 + classes))
    at_once.add(torch.cat(factors), range(2, 2 + classes))
    assert torch.equal(at_once.phi, one_by_one.phi) and torch.equal(at_once.labels, one_by_one.labels)
    assert torch.allclose(at_once.kernel, one_by_one.kernel, rtol=1e-13, atol=1e-13)


def _as_breaking_gram_upload(reply: Message) -> None:
    """Turn a factor reply into a Gram upload of the same samples with three features rewired to an
    indefinite block inside Cauchy–Schwarz, scaled up so that it breaks any sum (it passes the
    O(M²) screen; only the stage's certificate sees it)."""
    arrays = reply.content.array_records["arrays"]
    factor = torch.from_numpy(arrays["gram-factor"].numpy().copy()).to(F64)
    counts = arrays["counts"].numpy().copy()
    dim = int(factor.shape[1]) - counts.shape[0]
    phi, labels = factor[:, :dim], factor[:, dim:]
    gram = np.maximum((phi.T @ phi).numpy(), 0.0)  # ReLU statistics, without the rotation's rounding
    active = tuple(int(i) for i in np.argsort(-np.diag(gram))[:3])
    bad = _indefinite_within_cauchy_schwarz(gram, active, 1e8)  # type: ignore[arg-type]
    sums = np.maximum((phi.T @ labels).numpy(), 0.0)
    sums[list(active)] = 0.0
    for key in list(arrays.keys()):
        del arrays[key]
    arrays["gram-packed"] = Array(np.ascontiguousarray(pack_upper(torch.from_numpy(bad)).numpy()))
    arrays["class-sums"] = Array(np.ascontiguousarray(sums))
    arrays["counts"] = Array(counts)


def test_a_gram_upload_that_breaks_a_round_of_factors_is_named_without_redoing_their_products(
    out_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A factor run where client 1 sends, in stage 2, a Gram upload that passes the screen but
    breaks the sum: the certificate fails, and halving runs over the screened (Gram) uploads only
    (a factor upload is PSD by construction and carries its bound), so no product of factor rows
    is made while a subset is tested (they are made for the sum, and for the sum rebuilt without
    the culprit); the culprit is named and the stage's W is exactly that of a run where its reply
    never came."""
    products: list[int] = []
    real = stsa_strategy.gram_packed_

    def counted(out: np.ndarray, phi: torch.Tensor, **options: bool) -> np.ndarray:
        products.append(int(phi.shape[0]))
        return real(out, phi, **options)

    halving: list[int] = []  # products made while a subset is tested
    subset = stsa_strategy.STSAStrategy.certify_subset

    def certify_subset(self: stsa_strategy.STSAStrategy, total: TaskSum, uploads: list) -> bool:
        before = len(products)
        try:
            return subset(self, total, uploads)
        finally:
            halving.append(len(products) - before)

    monkeypatch.setattr(stsa_strategy, "gram_packed_", counted)
    monkeypatch.setattr(stsa_strategy.STSAStrategy, "certify_subset", certify_subset)
    cfg = small_config(
        out_dir, rf_dim=FACTOR_DIM, stats_form="factor", noise_seeded=True
    )  # every other upload a factor

    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        for reply in replies:
            if task == 1 and phase == "stsa-stats" and not reply.has_error() and reply_partition(reply) == 1:
                _as_breaking_gram_upload(reply)
        return replies

    bad = run_in_process(cfg.replace(run_name="breaks"), tamper)
    stage = bad.recorder.stages[1]
    assert stage.extra["sum_certificate"]["culprits"] == ["client-1"]
    assert "PSD certificate" in stage.left_out["client-1"]
    assert halving and halving == [0] * len(halving)  # the one screened upload, tested alone
    assert products  # the factors' sums were made

    def dropped(task: int, phase: str, replies: list[Message]) -> list[Message]:
        keep = task != 1 or phase != "stsa-stats"
        return [r for r in replies if keep or r.has_error() or reply_partition(r) != 1]

    reference = run_in_process(cfg.replace(run_name="dropped"), dropped)
    assert torch.equal(bad.stage_weights[1], reference.stage_weights[1])


# --------------------------------------------------------------------------- the payload
def test_payload_reads_what_it_writes_and_refuses_bad_shapes() -> None:
    _, _, factor, counts = honest()
    record = StsaFactorStats(factor, counts).to_record("float32")
    assert StsaFactorStats.matches(record)
    back = StsaFactorStats.read(record, dim=50, classes=3)
    assert back.factor.dtype == torch.float32 and torch.equal(back.factor, factor.to(torch.float32))
    assert torch.equal(back.counts, counts)
    with pytest.raises(UploadError, match="expected"):
        StsaFactorStats.read(record, dim=49, classes=3)
    most = factor_max_rows(50, 3)
    for rows in (most + 1, 53, 60):  # no smaller than the Gram (53 = M + c was accepted before)
        tall = ArrayRecord({"gram-factor": Array(np.zeros((rows, 53))), "counts": Array(counts.numpy())})
        with pytest.raises(UploadError, match=f"rows <= {most}, 53"):
            StsaFactorStats.read(tall, dim=50, classes=3)
    edge = ArrayRecord({"gram-factor": Array(np.zeros((most, 53))), "counts": Array(counts.numpy())})
    assert StsaFactorStats.read(edge, dim=50, classes=3).factor.shape == (most, 53)
    extra = ArrayRecord({"gram-factor": Array(factor.numpy()), "counts": Array(counts.numpy()), "x": Array(np.ones(1))})
    with pytest.raises(UploadError, match="unexpected"):
        StsaFactorStats.read(extra, dim=50, classes=3)
    assert not StsaFactorStats.matches(
        ArrayRecord({"gram-packed": Array(np.zeros(3)), "counts": Array(counts.numpy())})
    )
    good = {"gram-factor": Array(factor.numpy()), "counts": Array(counts.numpy())}
    for changes, reason in (
        ({"counts": Array(-counts.numpy())}, "'counts'"),
        ({"counts": Array(counts.numpy()[:2])}, "'counts'"),
        ({"gram-factor": Array(factor.numpy()[0])}, "'gram-factor'"),
        ({"gram-factor": Array(factor.numpy().astype(np.int64))}, "'gram-factor'"),
    ):
        with pytest.raises(UploadError, match=reason):
            StsaFactorStats.read(ArrayRecord({**good, **changes}), dim=50, classes=3)
    with pytest.raises(UploadError, match="counts"):
        StsaFactorStats.read(ArrayRecord({"gram-factor": good["gram-factor"]}), dim=50, classes=3)


# --------------------------------------------------------------------------- whole runs
FACTOR_DIM = 400  # digits, 3 clients: every client has fewer than ~M/2 samples of a task


def test_factor_run_equals_the_gram_run(out_dir: Path) -> None:
    """Same classifier (float64 wire: to rounding), same accuracies; each upload is the factor's
    n(M + c) + c numbers, below the Gram's."""
    gram_cfg = small_config(out_dir, rf_dim=FACTOR_DIM, run_name="gram")
    gram = run_in_process(gram_cfg)
    factor = run_in_process(gram_cfg.replace(stats_form="factor", run_name="factor"))
    for w_gram, w_factor in zip(gram.stage_weights, factor.stage_weights):
        assert float((w_gram - w_factor).norm() / w_gram.norm()) <= 1e-10
    assert [s.accuracy for s in factor.recorder.stages] == [s.accuracy for s in gram.recorder.stages]
    assert factor.ridge.num_samples == gram.ridge.num_samples
    split = factor.split
    for task, record in enumerate(factor.recorder.stages):
        classes = len(record.classes)
        full = bytes_for(stsa_upload_numbers(FACTOR_DIM, classes, packed=True, counts=True), "float64")
        for k in range(3):
            rows = len(split.client_train(task, k))
            assert factor_is_smaller(rows, FACTOR_DIM, classes)
            expected = bytes_for(factor_length(rows, FACTOR_DIM, classes), "float64")
            assert record.upload_bytes_per_client[f"client-{k}"] == expected < full
        assert gram.recorder.stages[task].upload_bytes_per_client == {f"client-{k}": full for k in range(3)}


def test_client_falls_back_to_the_gram_where_it_is_smaller(out_dir: Path) -> None:
    """At M = 40 every client has more samples than a factor is worth: Gram uploads, same numbers."""
    cfg = small_config(out_dir, rf_dim=40, num_tasks=2, stats_form="factor", run_name="small")
    strategy = run_in_process(cfg)
    reference = run_in_process(cfg.replace(stats_form="gram", run_name="small-gram"))
    for record in strategy.recorder.stages:
        full = bytes_for(stsa_upload_numbers(40, len(record.classes), packed=True, counts=True), "float64")
        assert set(record.upload_bytes_per_client.values()) == {full}
    assert torch.equal(strategy.weights, reference.weights)


def test_seeded_rotation_makes_factor_runs_reproducible(out_dir: Path) -> None:
    cfg = small_config(out_dir, rf_dim=FACTOR_DIM, num_tasks=2, stats_form="factor", noise_seeded=True)
    first = run_in_process(cfg.replace(run_name="a"))
    second = run_in_process(cfg.replace(run_name="b"))
    assert torch.equal(first.weights, second.weights)
    assert torch.equal(first.ridge.gram, second.ridge.gram)


def test_seeded_rotation_can_be_undone_by_a_server_that_knows_the_seed(out_dir: Path) -> None:
    """Why ``noise-seeded`` is for tests only with factor uploads (its help says so): it also seeds
    the rotation, so a server that knows (seed, client, task) redraws O and reads every sample's raw
    one-hot label and ReLU features off Oᵀ F; the rotation of another key leaves them hidden."""
    seen: dict[int, np.ndarray] = {}

    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        for reply in replies:
            if task == 0 and phase == "stsa-stats" and not reply.has_error():
                arrays = reply.content.array_records["arrays"]
                if StsaFactorStats.matches(arrays):
                    seen[reply_partition(reply)] = arrays["gram-factor"].numpy().copy()
        return replies

    cfg = small_config(out_dir, rf_dim=FACTOR_DIM, stats_form="factor", noise_seeded=True, run_name="undo")
    run_in_process(cfg, tamper)
    assert seen
    for partition, upload in seen.items():
        factor = torch.from_numpy(upload).to(F64)
        rows = factor.shape[0]
        for task, undone in ((0, True), (1, False)):
            rotation = haar_rotation(rows, noise_generator(True, (cfg.seed, partition, task, ROTATION_STREAM)))
            raw = rotation.T @ factor
            labels, features = raw[:, FACTOR_DIM:], raw[:, :FACTOR_DIM]
            one_hot = torch.allclose(labels, labels.round(), atol=1e-9) and bool((labels.round().sum(dim=1) == 1).all())
            assert one_hot == undone
            assert (float(features.min()) > -1e-9) == undone  # ReLU features: >= 0


def _to_factor_form(reply: Message) -> None:
    arrays = reply.content.array_records["arrays"]
    counts = arrays["counts"].numpy()
    width = FACTOR_DIM + counts.shape[0]
    reply.content.array_records["arrays"] = ArrayRecord(
        {"gram-factor": Array(np.zeros((int(counts.sum()), width))), "counts": Array(counts.copy())}
    )


def test_gram_run_refuses_a_factor_upload(out_dir: Path) -> None:
    """A factor in a run that takes Gram uploads is rejected with its reason; the others aggregate."""

    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        for reply in replies:
            if task == 0 and phase == "stsa-stats" and not reply.has_error() and reply_partition(reply) == 1:
                _to_factor_form(reply)
        return replies

    cfg = small_config(out_dir, rf_dim=FACTOR_DIM, num_tasks=2, run_name="refuse")
    strategy = run_in_process(cfg, tamper)
    stage = strategy.recorder.stages[0]
    assert "stats-form gram" in stage.left_out["client-1"]
    assert stage.clients == ["client-0", "client-2"]


def test_factor_run_rejects_a_forged_label_block(out_dir: Path) -> None:
    """A factor whose label block does not match its counts is rejected by name and reason."""

    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        for reply in replies:
            if task == 0 and phase == "stsa-stats" and not reply.has_error() and reply_partition(reply) == 1:
                _to_factor_form(reply)  # all-zero rows: the label block is 0, the counts are not
        return replies

    cfg = small_config(out_dir, rf_dim=FACTOR_DIM, stats_form="factor", run_name="forged")  # every upload a factor
    strategy = run_in_process(cfg, tamper)
    stage = strategy.recorder.stages[0]
    assert "label block" in stage.left_out["client-1"]
    assert stage.clients == ["client-0", "client-2"]


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"strategy": "stsa-e"}, "works with stsa"),
        ({"secure_aggregation": True}, "cannot be masked"),
        ({"noise_q": 1.0, "noise_s": 0.1}, "carries no noise"),
    ],
)
def test_factor_form_config_errors(out_dir: Path, changes: dict, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        small_config(out_dir, stats_form="factor", **changes).validated()
