"""STSA / STSA-E math: bad inputs, hand-computed cases and edges (issue 19).

Every bad input expects its specific error type and one-line message; every number is computed
here by hand or by a direct float64 computation, never read back from the function under test.
Edges: zero samples, M = 1, M ≠ number of classes, K = 2 in global mode, float32 inputs
(the math must run in float64), and a process whose default device is not the CPU (results must
live where the inputs are).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from fcl_flower.analytic import (
    AnalyticInputError,
    ClassStatistics,
    NotPositiveDefiniteError,
    StatisticsAccumulator,
    aggregate,
    bytes_for,
    default_ridge_grid,
    estimate_gram,
    fedran_upload_numbers,
    logits,
    pack_upper,
    packed_length,
    paper_table5,
    predict,
    random_features,
    random_projection,
    ridge_residual,
    select_ridge_gcv,
    solve_ridge,
    split_into_dummy_clients,
    stsa_e_upload_numbers,
    stsa_upload_numbers,
    unpack_upper,
)
from fcl_flower.analytic.estimator import GramEstimator
from fcl_flower.analytic.packing import (
    add_packed_,
    diagonal_of_packed,
    gram_packed_,
    pack_symmetrised,
    packed_blocks,
    row_offset,
)
from fcl_flower.analytic.random_features import clip_rows
from fcl_flower.analytic.ridge import RidgeState, gcv_from_spectrum
from tests.conftest import seeded_generator

F64 = torch.float64
F32 = torch.float32


def _raises(call, error: type[Exception], message: str) -> None:
    """``call()`` raises ``error`` whose message is exactly ``message`` (one line)."""
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message
    assert "\n" not in message


def _t(*rows, dtype=F64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# =============================================================================== bad inputs
SQ = torch.eye(3, dtype=F64)
C32 = torch.ones(3, 2, dtype=F64)

BAD_INPUTS = [
    # packing
    ("packed_length(-1)", lambda: packed_length(-1), AnalyticInputError, "dim must be >= 0, got -1"),
    (
        "pack_upper non-square",
        lambda: pack_upper(torch.zeros(3, 4)),
        AnalyticInputError,
        "pack_upper needs a square matrix, got shape (3, 4)",
    ),
    (
        "pack_upper 1-D",
        lambda: pack_upper(torch.zeros(4)),
        AnalyticInputError,
        "pack_upper needs a square matrix, got shape (4,)",
    ),
    (
        "unpack_upper 2-D",
        lambda: unpack_upper(torch.zeros(2, 3), 2),
        AnalyticInputError,
        "packed Gram must be 1-D, got shape (2, 3)",
    ),
    (
        "unpack_upper length",
        lambda: unpack_upper(torch.zeros(5), 3),
        AnalyticInputError,
        "packed Gram has 5 entries, expected 6 for dim 3",
    ),
    # random features
    ("in_dim 0", lambda: random_projection(0, 5, 1), AnalyticInputError, "in_dim must be a positive int, got 0"),
    (
        "in_dim float",
        lambda: random_projection(2.0, 5, 1),
        AnalyticInputError,
        "in_dim must be a positive int, got 2.0",
    ),
    ("rf_dim -1", lambda: random_projection(3, -1, 1), AnalyticInputError, "rf_dim must be a non-negative int, got -1"),
    (
        "rf_dim float",
        lambda: random_projection(3, 2.5, 1),
        AnalyticInputError,
        "rf_dim must be a non-negative int, got 2.5",
    ),
    (
        "features 1-D",
        lambda: random_features(torch.zeros(5), None),
        AnalyticInputError,
        "features must be 2-D (n, d), got shape (5,)",
    ),
    (
        "projection rows",
        lambda: random_features(torch.zeros(2, 6), torch.zeros(5, 20)),
        AnalyticInputError,
        "projection shape (5, 20) does not match feature dim 6",
    ),
    (
        "projection 1-D",
        lambda: random_features(torch.zeros(2, 6), torch.zeros(6)),
        AnalyticInputError,
        "projection shape (6,) does not match feature dim 6",
    ),
    *[
        (f"clip bound {bound}", lambda bound=bound: clip_rows(torch.ones(2, 2), bound), AnalyticInputError, message)
        for bound, message in (
            (-1.0, "clip bound must be a finite number >= 0, got -1.0"),
            (-1e-300, "clip bound must be a finite number >= 0, got -1e-300"),
            (math.inf, "clip bound must be a finite number >= 0, got inf"),
            (math.nan, "clip bound must be a finite number >= 0, got nan"),
        )
    ],
    # heads
    (
        "logits mismatch",
        lambda: logits(torch.zeros(2, 3), torch.zeros(4, 2)),
        AnalyticInputError,
        "phi (n, M) and weights (M, c) do not match: (2, 3) vs (4, 2)",
    ),
    (
        "logits weights 1-D",
        lambda: logits(torch.zeros(2, 3), torch.zeros(3)),
        AnalyticInputError,
        "phi (n, M) and weights (M, c) do not match: (2, 3) vs (3,)",
    ),
    (
        "logits phi 1-D",
        lambda: logits(torch.zeros(3), torch.zeros(3, 2)),
        AnalyticInputError,
        "phi (n, M) and weights (M, c) do not match: (3,) vs (3, 2)",
    ),
    (
        "unknown head",
        lambda: logits(torch.zeros(2, 3), torch.zeros(3, 2), "softmax"),  # type: ignore[arg-type]  # the bad value is the test
        AnalyticInputError,
        "head must be one of ('cosine', 'dot'), got 'softmax'",
    ),
    # communication
    ("stsa rf_dim 0", lambda: stsa_upload_numbers(0, 5), AnalyticInputError, "rf_dim must be a positive int, got 0"),
    (
        "stsa rf_dim float",
        lambda: stsa_upload_numbers(5.0, 2),
        AnalyticInputError,
        "rf_dim must be a positive int, got 5.0",
    ),
    (
        "stsa classes 0",
        lambda: stsa_upload_numbers(5, 0),
        AnalyticInputError,
        "classes_in_task must be a positive int, got 0",
    ),
    (
        "stsa-e rf_dim 0",
        lambda: stsa_e_upload_numbers(0, 2, 3),
        AnalyticInputError,
        "rf_dim must be a positive int, got 0",
    ),
    (
        "stsa-e classes -1",
        lambda: stsa_e_upload_numbers(4, -1, 3),
        AnalyticInputError,
        "classes_in_task must be a positive int, got -1",
    ),
    (
        "stsa-e dummies 0",
        lambda: stsa_e_upload_numbers(4, 2, 0),
        AnalyticInputError,
        "dummy_clients must be a positive int, got 0",
    ),
    (
        "fedran rf_dim 0",
        lambda: fedran_upload_numbers(0, 1, 1),
        AnalyticInputError,
        "rf_dim must be a positive int, got 0",
    ),
    (
        "fedran rank -1",
        lambda: fedran_upload_numbers(4, -1, 1),
        AnalyticInputError,
        "rank must be a non-negative int, got -1",
    ),
    (
        "fedran classes -1",
        lambda: fedran_upload_numbers(4, 1, -1),
        AnalyticInputError,
        "num_classes must be a non-negative int, got -1",
    ),
    (
        "bytes numbers -1",
        lambda: bytes_for(-1, "float32"),
        AnalyticInputError,
        "numbers must be a non-negative int, got -1",
    ),
    (
        "bytes dtype",
        lambda: bytes_for(10, "float16"),
        AnalyticInputError,
        "wire_dtype must be one of ('float32', 'float64'), got 'float16'",
    ),
    # statistics
    (
        "class_sums 1-D",
        lambda: ClassStatistics(None, torch.zeros(3), torch.zeros(3, dtype=torch.int64), 0),
        AnalyticInputError,
        "class_sums must be 2-D (M, num_classes), got shape (3,)",
    ),
    (
        "gram shape",
        lambda: ClassStatistics(torch.zeros(2, 2), torch.zeros(3, 2), torch.zeros(2, dtype=torch.int64), 0),
        AnalyticInputError,
        "gram shape (2, 2) does not match rf_dim 3",
    ),
    (
        "counts shape",
        lambda: ClassStatistics(None, torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), 0),
        AnalyticInputError,
        "counts shape (3,) does not match num_classes 2",
    ),
    (
        "num_samples -1",
        lambda: ClassStatistics(None, torch.zeros(3, 2), torch.zeros(2, dtype=torch.int64), -1),
        AnalyticInputError,
        "num_samples must be >= 0, got -1",
    ),
    (
        "add shapes",
        lambda: (
            ClassStatistics(None, torch.zeros(3, 2), torch.zeros(2), 0)
            + ClassStatistics(None, torch.zeros(3, 4), torch.zeros(4), 0)
        ),
        AnalyticInputError,
        "cannot add statistics of shapes (3, 2) and (3, 4)",
    ),
    (
        "add without gram + with",
        lambda: (
            ClassStatistics(None, torch.zeros(3, 2), torch.zeros(2), 0)
            + ClassStatistics(torch.zeros(3, 3), torch.zeros(3, 2), torch.zeros(2), 0)
        ),
        AnalyticInputError,
        "cannot add statistics with and without a Gram matrix",
    ),
    (
        "add with gram + without",
        lambda: (
            ClassStatistics(torch.zeros(3, 3), torch.zeros(3, 2), torch.zeros(2), 0)
            + ClassStatistics(None, torch.zeros(3, 2), torch.zeros(2), 0)
        ),
        AnalyticInputError,
        "cannot add statistics with and without a Gram matrix",
    ),
    ("aggregate nothing", lambda: aggregate([]), AnalyticInputError, "aggregate needs at least one ClassStatistics"),
    (
        "accumulator rf_dim 0",
        lambda: StatisticsAccumulator(0, 2),
        AnalyticInputError,
        "rf_dim must be a positive int, got 0",
    ),
    (
        "accumulator rf_dim float",
        lambda: StatisticsAccumulator(2.0, 2),
        AnalyticInputError,
        "rf_dim must be a positive int, got 2.0",
    ),
    (
        "accumulator classes 0",
        lambda: StatisticsAccumulator(3, 0),
        AnalyticInputError,
        "num_classes must be a positive int, got 0",
    ),
    (
        "accumulator classes float",
        lambda: StatisticsAccumulator(3, 1.5),
        AnalyticInputError,
        "num_classes must be a positive int, got 1.5",
    ),
    (
        "update phi dim",
        lambda: StatisticsAccumulator(3, 2).update(torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64)),
        AnalyticInputError,
        "phi_batch must have shape (b, 3), got (2, 4)",
    ),
    (
        "update phi 1-D",
        lambda: StatisticsAccumulator(3, 2).update(torch.zeros(3), torch.zeros(1, dtype=torch.int64)),
        AnalyticInputError,
        "phi_batch must have shape (b, 3), got (3,)",
    ),
    (
        "update labels length",
        lambda: StatisticsAccumulator(3, 2).update(torch.zeros(2, 3), torch.zeros(3, dtype=torch.int64)),
        AnalyticInputError,
        "labels must have shape (2,), got (3,)",
    ),
    (
        "update labels 2-D",
        lambda: StatisticsAccumulator(3, 2).update(torch.zeros(2, 3), torch.zeros(2, 1, dtype=torch.int64)),
        AnalyticInputError,
        "labels must have shape (2,), got (2, 1)",
    ),
    (
        "update float labels",
        lambda: StatisticsAccumulator(3, 2).update(torch.zeros(2, 3), torch.zeros(2)),
        AnalyticInputError,
        "labels must be an integer tensor, got torch.float32",
    ),
    (
        "update bool labels",
        lambda: StatisticsAccumulator(3, 2).update(torch.zeros(2, 3), torch.zeros(2, dtype=torch.bool)),
        AnalyticInputError,
        "labels must be an integer tensor, got torch.bool",
    ),
    (
        "update label too large",
        lambda: StatisticsAccumulator(3, 3).update(torch.zeros(2, 3), torch.tensor([0, 3])),
        AnalyticInputError,
        "labels must lie in [0, 2], got range [0, 3]",
    ),
    (
        "update negative label",
        lambda: StatisticsAccumulator(3, 3).update(torch.zeros(2, 3), torch.tensor([-1, 1])),
        AnalyticInputError,
        "labels must lie in [0, 2], got range [-1, 1]",
    ),
    # ridge
    (
        "gram 1-D",
        lambda: solve_ridge(torch.zeros(3), C32, 1.0),
        AnalyticInputError,
        "gram must be square, got shape (3,)",
    ),
    (
        "gram non-square",
        lambda: solve_ridge(torch.zeros(3, 4), C32, 1.0),
        AnalyticInputError,
        "gram must be square, got shape (3, 4)",
    ),
    (
        "gram 3-D",
        lambda: solve_ridge(torch.zeros(3, 3, 3), C32, 1.0),
        AnalyticInputError,
        "gram must be square, got shape (3, 3, 3)",
    ),
    (
        "class_sums rows",
        lambda: solve_ridge(SQ, torch.zeros(4, 2), 1.0),
        AnalyticInputError,
        "class_sums shape (4, 2) does not match gram dim 3",
    ),
    (
        "class_sums 1-D",
        lambda: solve_ridge(SQ, torch.zeros(3), 1.0),
        AnalyticInputError,
        "class_sums shape (3,) does not match gram dim 3",
    ),
    (
        "ridge -1",
        lambda: solve_ridge(SQ, C32, -1.0),
        AnalyticInputError,
        "ridge must be a finite number >= 0, got -1.0",
    ),
    (
        "ridge slightly negative on a PD Gram",
        lambda: solve_ridge(10 * SQ, C32, -1e-3),
        AnalyticInputError,
        "ridge must be a finite number >= 0, got -0.001",
    ),
    (
        "ridge nan",
        lambda: solve_ridge(SQ, C32, math.nan),
        AnalyticInputError,
        "ridge must be a finite number >= 0, got nan",
    ),
    (
        "ridge inf",
        lambda: solve_ridge(SQ, C32, math.inf),
        AnalyticInputError,
        "ridge must be a finite number >= 0, got inf",
    ),
    (
        "not positive definite",
        lambda: solve_ridge(-SQ, C32, 0.5),
        NotPositiveDefiniteError,
        "G + 0.5·I is not positive definite (Cholesky failed at column 1); increase the ridge",
    ),
    (
        "not positive definite at column 2",
        lambda: solve_ridge(torch.diag(_t(1.0, -2.0, 1.0)), C32, 0.5),
        NotPositiveDefiniteError,
        "G + 0.5·I is not positive definite (Cholesky failed at column 2); increase the ridge",
    ),
    (
        "residual weights",
        lambda: ridge_residual(SQ, C32, torch.zeros(3, 1), 1.0),
        AnalyticInputError,
        "weights shape (3, 1) does not match class_sums (3, 2)",
    ),
    ("gcv n 0", lambda: select_ridge_gcv(SQ, C32, 0, 1.0), AnalyticInputError, "num_samples must be positive, got 0"),
    (
        "gcv empty grid",
        lambda: select_ridge_gcv(SQ, C32, 5, 1.0, grid=[]),
        AnalyticInputError,
        "grid must be a non-empty 1-D sequence of positive values",
    ),
    (
        "gcv 2-D grid",
        lambda: select_ridge_gcv(SQ, C32, 5, 1.0, grid=[[1.0, 2.0]]),
        AnalyticInputError,
        "grid must be a non-empty 1-D sequence of positive values",
    ),
    (
        "gcv zero in grid",
        lambda: select_ridge_gcv(SQ, C32, 5, 1.0, grid=[0.0, 1.0]),
        AnalyticInputError,
        "grid must be a non-empty 1-D sequence of positive values",
    ),
    (
        "gcv negative grid",
        lambda: select_ridge_gcv(SQ, C32, 5, 1.0, grid=[-1.0]),
        AnalyticInputError,
        "grid must be a non-empty 1-D sequence of positive values",
    ),
    (
        "spectrum n 0",
        lambda: gcv_from_spectrum(_t(1.0), _t(1.0), 0, 1.0),
        AnalyticInputError,
        "num_samples must be positive, got 0",
    ),
    (
        "spectrum lengths",
        lambda: gcv_from_spectrum(_t(1.0, 2.0, 3.0), _t(1.0, 2.0), 5, 1.0),
        AnalyticInputError,
        "eigvals and q must be 1-D tensors of the same length",
    ),
    (
        "spectrum 2-D",
        lambda: gcv_from_spectrum(torch.ones(2, 2, dtype=F64), torch.ones(2, 2, dtype=F64), 5, 1.0),
        AnalyticInputError,
        "eigvals and q must be 1-D tensors of the same length",
    ),
    (
        "spectrum zero grid",
        lambda: gcv_from_spectrum(_t(1.0), _t(1.0), 5, 1.0, grid=[0.0]),
        AnalyticInputError,
        "grid must be a non-empty 1-D sequence of positive values",
    ),
    (
        "spectrum 2-D grid",
        lambda: gcv_from_spectrum(_t(1.0), _t(1.0), 5, 1.0, grid=[[1.0, 2.0]]),
        AnalyticInputError,
        "grid must be a non-empty 1-D sequence of positive values",
    ),
    (
        "spectrum empty grid",
        lambda: gcv_from_spectrum(_t(1.0), _t(1.0), 5, 1.0, grid=[]),
        AnalyticInputError,
        "grid must be a non-empty 1-D sequence of positive values",
    ),
    (
        "spectrum negative grid",
        lambda: gcv_from_spectrum(_t(1.0), _t(1.0), 5, 1.0, grid=[-2.0]),
        AnalyticInputError,
        "grid must be a non-empty 1-D sequence of positive values",
    ),
    (
        "ridge state add",
        lambda: RidgeState.empty(3, 4).add(range(1, 3), torch.zeros(3, 3), torch.zeros(3, 3), 1),
        AnalyticInputError,
        "class_sums shape (3, 3) does not fit 3 features and 2 classes",
    ),
    (
        "ridge state from_state",
        lambda: RidgeState.from_state({"gram": [[1.0]], "class_sums": torch.zeros(1, 1), "num_samples": 1}),
        AnalyticInputError,
        "ridge state needs the gram and class_sums tensors (field 'ridge/gram' is list [[1.0]])",
    ),
    (
        "ridge state from_state sums",
        lambda: RidgeState.from_state({"gram": torch.zeros(1, 1), "class_sums": 0, "num_samples": 1}),
        AnalyticInputError,
        "ridge state needs the gram and class_sums tensors (field 'ridge/class_sums' is int 0)",
    ),
    # STSA-E estimator
    (
        "estimate 2-D sums",
        lambda: estimate_gram(torch.zeros(3, 2), torch.zeros(3, 2)),
        AnalyticInputError,
        "class_sums must be 3-D (K, M, c), got shape (3, 2)",
    ),
    (
        "estimate counts shape",
        lambda: estimate_gram(torch.zeros(2, 4, 2), torch.zeros(2, 3)),
        AnalyticInputError,
        "counts shape (2, 3) does not match (K, c) = (2, 2)",
    ),
    (
        "estimate bool counts",
        lambda: estimate_gram(torch.zeros(2, 4, 2), torch.ones(2, 2, dtype=torch.bool)),
        AnalyticInputError,
        "counts must be real numbers, got torch.bool",
    ),
    (
        "estimate complex counts",
        lambda: estimate_gram(torch.zeros(2, 4, 2), torch.ones(2, 2, dtype=torch.complex64)),
        AnalyticInputError,
        "counts must be real numbers, got torch.complex64",
    ),
    (
        "estimate negative counts",
        lambda: estimate_gram(torch.zeros(2, 4, 2), _t([1.0, -1.0], [1.0, 1.0])),
        AnalyticInputError,
        "counts must be non-negative",
    ),
    (
        "estimate k_mode",
        lambda: estimate_gram(torch.zeros(2, 4, 2), torch.ones(2, 2), k_mode="local"),  # type: ignore[arg-type]  # the bad value is the test
        AnalyticInputError,
        "k_mode must be one of ('global', 'per-class'), got 'local'",
    ),
    (
        "estimate global K 1",
        lambda: estimate_gram(torch.zeros(1, 4, 2), torch.ones(1, 2)),
        AnalyticInputError,
        "global-K Eq. 9 needs at least 2 (dummy) clients, got 1",
    ),
    ("estimator rf_dim 0", lambda: GramEstimator(0, 2), AnalyticInputError, "rf_dim must be a positive int, got 0"),
    (
        "estimator rf_dim float",
        lambda: GramEstimator(2.0, 2),
        AnalyticInputError,
        "rf_dim must be a positive int, got 2.0",
    ),
    (
        "estimator classes 0",
        lambda: GramEstimator(2, 0),
        AnalyticInputError,
        "num_classes must be a positive int, got 0",
    ),
    (
        "estimator classes float",
        lambda: GramEstimator(2, 1.5),
        AnalyticInputError,
        "num_classes must be a positive int, got 1.5",
    ),
    (
        "estimator k_mode",
        lambda: GramEstimator(2, 2, k_mode="nope"),  # type: ignore[arg-type]  # the bad value is the test
        AnalyticInputError,
        "k_mode must be one of ('global', 'per-class'), got 'nope'",
    ),
    (
        "estimator add sums shape",
        lambda: GramEstimator(4, 2).add(torch.zeros(3, 2), torch.ones(2)),
        AnalyticInputError,
        "class_sums must have shape (D, 4, 2), got (1, 3, 2)",
    ),
    (
        "estimator add counts shape",
        lambda: GramEstimator(4, 2).add(torch.zeros(2, 4, 2), torch.ones(3, 2)),
        AnalyticInputError,
        "counts shape (3, 2) does not match (D, c) = (2, 2)",
    ),
    (
        "estimator add bool counts",
        lambda: GramEstimator(4, 2).add(torch.zeros(4, 2), torch.ones(2, dtype=torch.bool)),
        AnalyticInputError,
        "counts must be real numbers, got torch.bool",
    ),
    (
        "estimator add negative",
        lambda: GramEstimator(4, 2).add(torch.zeros(4, 2), _t(1.0, -1.0)),
        AnalyticInputError,
        "counts must be non-negative",
    ),
    (
        "estimator result empty",
        lambda: GramEstimator(4, 2).result(),
        AnalyticInputError,
        "GramEstimator.result needs at least one upload",
    ),
    (
        "dummy n -1",
        lambda: split_into_dummy_clients(-1, 2, seed=0),
        AnalyticInputError,
        "num_samples must be a non-negative int, got -1",
    ),
    (
        "dummy n float",
        lambda: split_into_dummy_clients(4.0, 2, seed=0),
        AnalyticInputError,
        "num_samples must be a non-negative int, got 4.0",
    ),
    (
        "dummy K 0",
        lambda: split_into_dummy_clients(4, 0, seed=0),
        AnalyticInputError,
        "num_dummy must be a positive int, got 0",
    ),
    (
        "dummy K float",
        lambda: split_into_dummy_clients(4, 2.0, seed=0),
        AnalyticInputError,
        "num_dummy must be a positive int, got 2.0",
    ),
    (
        "dummy neither seed nor generator",
        lambda: split_into_dummy_clients(4, 2),
        AnalyticInputError,
        "pass exactly one of seed or generator",
    ),
    (
        "dummy both",
        lambda: split_into_dummy_clients(4, 2, seed=0, generator=seeded_generator(0)),
        AnalyticInputError,
        "pass exactly one of seed or generator",
    ),
]


@pytest.mark.parametrize("call, error, message", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_raise_their_specific_one_line_error(call, error, message) -> None:
    _raises(call, error, message)


def test_adding_statistics_to_other_things_is_a_type_error() -> None:
    stats = ClassStatistics(None, torch.ones(2, 1), torch.ones(1, dtype=torch.int64), 1)
    assert sum([stats, stats]).num_samples == 2  # sum() starts from the integer 0
    for other in (1, 0.0, "x"):
        with pytest.raises(TypeError):
            _ = other + stats
        with pytest.raises(TypeError):
            _ = stats + other


# =============================================================================== packing
def test_pack_upper_is_the_row_major_upper_triangle() -> None:
    for dim in (0, 1, 2, 5):
        g = torch.arange(dim * dim, dtype=F64).reshape(dim, dim)
        g = g + g.T
        rows, cols = torch.triu_indices(dim, dim)  # row-major upper triangle
        assert packed_length(dim) == dim * (dim + 1) // 2
        assert torch.equal(pack_upper(g), g[rows, cols])
        assert torch.equal(unpack_upper(g[rows, cols], dim), g)
    assert pack_upper(torch.tensor([[7.0]])).tolist() == [7.0]  # M = 1


def test_packing_keeps_the_device_and_dtype_of_its_input() -> None:
    meta = torch.empty(4, 4, device="meta", dtype=F32)
    assert pack_upper(meta).device.type == "meta" and pack_upper(meta).dtype == F32
    packed = torch.empty(10, device="meta", dtype=F32)
    assert unpack_upper(packed, 4).device.type == "meta" and unpack_upper(packed, 4).shape == (4, 4)
    with torch.device("meta"):  # a process whose default device is not the CPU
        assert pack_upper(torch.eye(3, device="cpu")).device.type == "cpu"
        assert unpack_upper(torch.ones(6, device="cpu"), 3).device.type == "cpu"


def _upper_reference(g: torch.Tensor) -> torch.Tensor:
    """The row-major upper triangle by fancy indexing (the direct definition)."""
    rows, cols = torch.triu_indices(g.shape[0], g.shape[0])
    return g[rows, cols]


def _symmetric_from_packed(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The full symmetric matrix of a packed upper triangle, by fancy indexing."""
    rows, cols = torch.triu_indices(dim, dim)
    out = torch.zeros(dim, dim, dtype=packed.dtype)
    out[rows, cols] = packed
    out[cols, rows] = packed
    return out


def test_row_offset_and_packed_blocks_cover_the_triangle_once() -> None:
    for dim in (1, 2, 7, 30):
        for row in range(dim + 1):  # row r starts after the r longer rows above it
            assert row_offset(row, dim) == sum(dim - i for i in range(row))
        for block in (1, dim, 3 * dim + 1, 10**6):
            end = 0
            for a, b, mask in packed_blocks(dim, block):
                assert a == end and b > a  # consecutive row ranges, none empty
                assert mask.dtype == np.bool_ and np.array_equal(mask, np.triu(np.ones((b - a, dim - a), dtype=bool)))
                assert int(mask.sum()) == row_offset(b, dim) - row_offset(a, dim)
                end = b
            assert end == dim
    # rows per block: block_elements // dim, at least one
    assert [(a, b) for a, b, _ in packed_blocks(7, 20)] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert [(a, b) for a, b, _ in packed_blocks(7, 3)] == [(i, i + 1) for i in range(7)]
    assert [(a, b) for a, b, _ in packed_blocks(7, 21)] == [(0, 3), (3, 6), (6, 7)]
    assert [(a, b) for a, b, _ in packed_blocks(1, 5)] == [(0, 1)]
    assert list(packed_blocks(0)) == []
    assert [(a, b) for a, b, _ in packed_blocks(5)] == [(0, 5)]  # default: ~4 M entries per block


@pytest.mark.parametrize("dim", [1, 5, 300, 600, 2100])  # > 256: several tiles; > 2048: several row blocks
def test_packing_round_trips_equal_the_direct_definition(dim: int) -> None:
    gen = seeded_generator(dim)
    g = torch.randn(dim, dim, dtype=F64, generator=gen)  # not symmetric
    sym = 0.5 * (g + g.T)
    assert torch.equal(pack_upper(g), _upper_reference(g))
    assert torch.equal(pack_upper(g, F32), _upper_reference(g).to(F32))
    assert torch.equal(pack_symmetrised(g), _upper_reference(sym))
    assert torch.equal(pack_symmetrised(g, F32), _upper_reference(sym).to(F32))
    packed = torch.randn(packed_length(dim), dtype=F64, generator=gen)
    assert torch.equal(unpack_upper(packed, dim), _symmetric_from_packed(packed, dim))
    assert torch.equal(diagonal_of_packed(packed, dim), torch.diagonal(_symmetric_from_packed(packed, dim)))
    before = sym.clone()
    out = add_packed_(sym, packed)
    assert out is sym  # in place
    assert torch.equal(sym, before + _symmetric_from_packed(packed, dim))


@pytest.mark.parametrize("dim", [1, 63, 64, 65, 300])  # around the 64-row product blocks
def test_gram_packed_is_the_upper_triangle_of_phi_t_phi(dim: int) -> None:
    """Integer-valued features: every product and sum is exact, so the blocked upper-triangle product
    equals the direct ΦᵀΦ entry for entry; real-valued ones to float64 rounding."""
    gen = seeded_generator(dim)
    phi = torch.randint(0, 5, (23, dim), generator=gen).to(F64)
    out = np.empty(packed_length(dim))
    assert torch.equal(torch.from_numpy(gram_packed_(out, phi, accumulate=False)), _upper_reference(phi.T @ phi))
    gram_packed_(out, phi[:7], accumulate=True)  # adds
    assert torch.equal(torch.from_numpy(out), _upper_reference(phi.T @ phi + phi[:7].T @ phi[:7]))
    real = torch.rand(9, dim, dtype=F64, generator=gen)
    got = torch.from_numpy(gram_packed_(np.empty(packed_length(dim), np.float32), real, accumulate=False))
    assert got.dtype == F32 and torch.allclose(got.to(F64), _upper_reference(real.T @ real), rtol=1e-6, atol=0)
    _raises(
        lambda: gram_packed_(np.empty(3), real.to(F32), accumulate=False),
        AnalyticInputError,
        f"gram_packed_ needs 2-D float64 CPU features, got (9, {dim}) torch.float32",
    )


def test_accumulator_folds_batches_into_the_same_g_and_packs_it_once_rounded() -> None:
    """Batches beyond the buffer (fold) and below it give the G of all rows; the upload is
    ``pack_upper(result().gram)`` rounded once to the wire dtype; the caller's batch may change after."""
    dim, classes = 40, 3
    gen = seeded_generator(1)
    phi = torch.randint(0, 4, (700, dim), generator=gen).to(F64)  # > 256 rows: folds
    labels = torch.randint(0, classes, (700,), generator=gen)
    acc = StatisticsAccumulator(dim, classes)
    batch = torch.empty(100, dim, dtype=F64)
    for start in range(0, 700, 100):
        batch.copy_(phi[start : start + 100])
        acc.update(batch, labels[start : start + 100])
    batch.zero_()
    stats = acc.result()
    assert torch.equal(stats.gram, phi.T @ phi) and stats.num_samples == 700
    real = torch.rand(30, dim, dtype=F64, generator=gen)
    small = StatisticsAccumulator(dim, classes)
    small.update(real, torch.zeros(30, dtype=torch.int64))
    assert torch.equal(small.packed_gram(F32), pack_upper(small.result().gram).to(F32))
    assert torch.equal(small.packed_gram(F64), pack_upper(small.result().gram))
    assert torch.equal(StatisticsAccumulator(dim, classes).packed_gram(F32), torch.zeros(packed_length(dim), dtype=F32))


def test_packing_helpers_reject_bad_shapes_and_keep_the_device() -> None:
    _raises(
        lambda: pack_symmetrised(torch.zeros(2, 3)),
        AnalyticInputError,
        "pack_symmetrised needs a square matrix, got shape (2, 3)",
    )
    _raises(
        lambda: add_packed_(torch.zeros(3), torch.zeros(6)),
        AnalyticInputError,
        "add_packed_ needs a square matrix, got shape (3,)",
    )
    _raises(
        lambda: add_packed_(torch.zeros(3, 3), torch.zeros(5)),
        AnalyticInputError,
        "packed Gram has 5 entries, expected 6 for dim 3",
    )
    _raises(
        lambda: diagonal_of_packed(torch.zeros(2, 3), 3),
        AnalyticInputError,
        "packed Gram must be 1-D, got shape (2, 3)",
    )
    _raises(
        lambda: diagonal_of_packed(torch.zeros(7), 3),
        AnalyticInputError,
        "packed Gram has 7 entries, expected 6 for dim 3",
    )
    assert diagonal_of_packed(torch.zeros(0), 0).shape == (0,)
    meta = torch.empty(4, 4, device="meta", dtype=F64)
    sym = pack_symmetrised(meta, F32)
    assert sym.device.type == "meta" and sym.dtype == F32 and sym.shape == (10,)
    assert pack_symmetrised(meta).dtype == F64
    assert pack_upper(meta, F32).dtype == F32
    added = add_packed_(meta, torch.zeros(10, dtype=F64))  # a CPU upload into a Gram on another device
    assert added is meta
    diag = diagonal_of_packed(torch.empty(10, device="meta"), 4)
    assert diag.device.type == "meta" and diag.shape == (4,)


def test_packing_on_the_cpu_whatever_the_default_device() -> None:
    g = torch.arange(9, dtype=F64).reshape(3, 3)
    packed = _upper_reference(g)
    with torch.device("meta"):  # index and output tensors must follow the input, not the default
        diag = diagonal_of_packed(packed, 3)
        sym = pack_symmetrised(g)
    assert diag.device.type == "cpu" and diag.tolist() == [0.0, 4.0, 8.0]
    assert sym.device.type == "cpu" and torch.equal(sym, _upper_reference(0.5 * (g + g.T)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packing_on_cuda_equals_the_cpu_result() -> None:
    """The row-by-row path for tensors on another device gives the CPU path's numbers."""
    gen = seeded_generator(5)
    g = torch.randn(7, 7, dtype=F64, generator=gen)
    packed = torch.randn(28, dtype=F64, generator=gen)
    sym = 0.5 * (g + g.T)
    cuda = torch.device("cuda")
    assert torch.equal(pack_upper(g.to(cuda)).cpu(), pack_upper(g))
    assert torch.equal(pack_symmetrised(g.to(cuda)).cpu(), pack_symmetrised(g))
    assert torch.equal(unpack_upper(packed.to(cuda), 7).cpu(), unpack_upper(packed, 7))
    assert torch.equal(diagonal_of_packed(packed.to(cuda), 7).cpu(), diagonal_of_packed(packed, 7))
    on_gpu = add_packed_(sym.to(cuda), packed)  # a CPU upload into a Gram on the GPU
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), add_packed_(sym.clone(), packed))


# =============================================================================== random features
def test_random_projection_shapes_edges_and_device() -> None:
    assert random_projection(1, 5, seed=0).shape == (1, 5)  # one input feature
    assert random_projection(3, 1, seed=0).shape == (3, 1)  # M = 1
    with torch.device("meta"):  # drawn on the CPU whatever the default device
        w = random_projection(4, 6, seed=3)
    assert w.device.type == "cpu" and torch.equal(w, random_projection(4, 6, seed=3))


def test_random_features_float32_projection_and_device() -> None:
    feats = torch.randn(5, 3, generator=seeded_generator(0))
    proj32 = torch.randn(3, 4, generator=seeded_generator(1))
    phi = random_features(feats, proj32)
    assert phi.dtype == F64
    assert torch.equal(phi, torch.relu(feats.double() @ proj32.double()))
    meta = random_features(torch.empty(5, 3, device="meta"), proj32)  # the projection follows the features
    assert meta.device.type == "meta" and meta.shape == (5, 4) and meta.dtype == F64


# =============================================================================== heads
def test_heads_against_a_direct_loop() -> None:
    gen = seeded_generator(2)
    phi = torch.randn(6, 4, generator=gen, dtype=F64)
    w = torch.randn(4, 3, generator=gen, dtype=F64) * torch.tensor([1.0, 5.0, 0.2], dtype=F64)
    cos = torch.empty(6, 3, dtype=F64)
    for i in range(6):
        for c in range(3):
            cos[i, c] = torch.dot(phi[i], w[:, c]) / (phi[i].norm() * w[:, c].norm())
    torch.testing.assert_close(logits(phi, w, "cosine"), cos, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(logits(phi, w, "dot"), phi @ w, rtol=1e-12, atol=1e-14)
    assert torch.equal(predict(phi, w), cos.argmax(dim=1))  # cosine is the default
    assert not torch.equal(predict(phi, w, "dot"), predict(phi, w))  # and differs from dot here


def test_heads_take_float32_and_follow_the_features_device() -> None:
    gen = seeded_generator(3)
    phi32, w32 = torch.randn(5, 4, generator=gen), torch.randn(4, 2, generator=gen)
    for head in ("cosine", "dot"):
        got = logits(phi32, w32, head)
        assert got.dtype == F64
        torch.testing.assert_close(got, logits(phi32.double(), w32.double(), head), rtol=0, atol=0)
        assert torch.equal(logits(phi32, w32.double(), head), got)
        meta = logits(torch.empty(5, 4, device="meta"), w32, head)
        assert meta.device.type == "meta" and meta.shape == (5, 2)


# =============================================================================== clipping
def test_clip_rows_by_hand() -> None:
    """φ ← φ · min(1, B / ‖φ‖): long rows shrink onto the sphere, short and zero rows stay."""
    rows = _t([3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [-6.0, 8.0])
    assert clip_rows(rows, 2.5).tolist() == [[1.5, 2.0], [0.3, 0.4], [0.0, 0.0], [-1.5, 2.0]]
    assert clip_rows(rows, 5.0).tolist() == [[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [-3.0, 4.0]]  # exactly B: kept
    assert clip_rows(rows, 0.0) is rows  # 0: no clipping
    assert clip_rows(_t([3.0]), 2.0).tolist() == [[2.0]]  # a single entry
    empty = torch.zeros(0, 4, dtype=F64)
    assert clip_rows(empty, 1.0).shape == (0, 4)
    tiny = clip_rows(_t([2.0**-170, 0.0]), 2.0**-340)  # below float32's range: float64 rows clip at their own scale
    assert tiny.tolist() == [[2.0**-340, 0.0]]
    short32 = clip_rows(_t([3.0, 4.0], dtype=F32), 2.5)
    assert short32.dtype == F32 and short32.tolist() == [[1.5, 2.0]]


def test_random_features_are_clipped_after_the_relu() -> None:
    feats = _t([1.0, 0.0], [0.0, -2.0])
    proj = _t([3.0, -1.0], [4.0, 1.0])  # rows of F @ W: (3, -1) -> ReLU (3, 0); (-8, -2) -> (0, 0)
    assert random_features(feats, proj, clip=2.0).tolist() == [[2.0, 0.0], [0.0, 0.0]]
    assert random_features(_t([6.0, 8.0]), None, clip=5.0).tolist() == [[3.0, 4.0]]  # no projection: Φ = F clipped


# =============================================================================== communication
def test_upload_counts_by_hand() -> None:
    assert stsa_upload_numbers(4, 2) == 4 * 4 + 4 * 2  # unpacked (the paper's count) by default
    assert stsa_upload_numbers(4, 2, packed=True) == 10 + 8
    assert stsa_upload_numbers(1, 1) == 2  # M = 1, one class
    assert stsa_upload_numbers(4, 2, counts=True) == 16 + 8 + 2  # plus the c_t class counts
    assert stsa_upload_numbers(4, 3, packed=True, counts=True) == 10 + 12 + 3
    assert stsa_e_upload_numbers(1, 1, 1) == 2
    assert fedran_upload_numbers(3, 0, 0) == 0  # rank 0 and no classes yet
    assert fedran_upload_numbers(3, 2, 0) == 3 * 2 + 2
    assert bytes_for(0, "float64") == 0
    assert bytes_for(3, "float32") == 12
    # counts are ints that bytes_for accepts
    assert bytes_for(stsa_upload_numbers(5, 2, packed=True), "float32") == 4 * (15 + 10)


def test_paper_table5_rows_by_hand() -> None:
    rows = paper_table5(stages=1, wire_dtype="float64")
    expected = [
        ("ResNet18, CIFAR-100, 10 tasks, M=5000, K_D=50", "STSA", (5000 + 10) * 5000),
        ("ResNet18, CIFAR-100, 10 tasks, M=5000, K_D=50", "STSA-E", 5001 * 10 * 50),
        ("ViT-B/16, CIFAR-100, 10 tasks, M=1250, K_D=10", "STSA", (1250 + 10) * 1250),
        ("ViT-B/16, CIFAR-100, 10 tasks, M=1250, K_D=10", "STSA-E", 1251 * 10 * 10),
    ]
    assert [(r.setting, r.method, r.numbers_per_stage) for r in rows] == expected
    for row, (_, _, numbers) in zip(rows, expected):
        assert row.mib_total == numbers * 8 / 2**20


# =============================================================================== statistics
@pytest.mark.parametrize("rf_dim, num_classes", [(1, 3), (5, 2), (2, 1)])
def test_accumulator_equals_direct_statistics_for_m_not_classes(rf_dim: int, num_classes: int) -> None:
    gen = seeded_generator(rf_dim * 10 + num_classes)
    phi = torch.randn(13, rf_dim, generator=gen)  # float32 input: statistics are float64
    labels = torch.randint(0, num_classes, (13,), generator=gen).to(torch.uint8)
    acc = StatisticsAccumulator(rf_dim, num_classes)
    assert acc.with_gram is True
    acc.update(phi[:6], labels[:6])
    acc.update(phi[:0], labels[:0])  # an empty batch changes nothing
    acc.update(phi[6:], labels[6:].to(torch.int16))
    stats = acc.result()
    x = phi.double()
    y = torch.nn.functional.one_hot(labels.long(), num_classes).double()
    torch.testing.assert_close(stats.gram, x.T @ x, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(stats.class_sums, x.T @ y, rtol=1e-13, atol=1e-13)
    assert stats.counts.dtype == torch.int64 and stats.counts.tolist() == y.sum(0).long().tolist()
    assert stats.num_samples == 13 and stats.gram.dtype == F64
    assert (stats.rf_dim, stats.num_classes) == (rf_dim, num_classes)


def test_zero_samples_and_gramless_statistics() -> None:
    empty = StatisticsAccumulator(3, 2).result()
    assert empty.num_samples == 0 and torch.equal(empty.gram, torch.zeros(3, 3, dtype=F64))
    assert torch.equal(empty.counts, torch.zeros(2, dtype=torch.int64))
    acc = StatisticsAccumulator(3, 2)
    acc.update(torch.ones(2, 3), torch.tensor([0, 1]))
    one = acc.result()
    total = aggregate([empty, one])  # a client with no samples adds nothing
    assert torch.equal(total.gram, one.gram) and torch.equal(total.class_sums, one.class_sums)
    assert total.num_samples == 2
    # STSA-E statistics carry no Gram; they still add and aggregate
    a = StatisticsAccumulator(3, 2, with_gram=False)
    a.update(torch.ones(2, 3), torch.tensor([0, 1]))
    gramless = a.result()
    assert gramless.gram is None and (gramless + gramless).gram is None
    summed = aggregate([gramless, gramless])
    assert summed.gram is None and torch.equal(summed.class_sums, 2 * gramless.class_sums)


def test_packed_gram_is_the_packed_symmetrised_gram() -> None:
    gen = seeded_generator(4)
    acc = StatisticsAccumulator(6, 3)
    acc.update(torch.randn(11, 6, generator=gen), torch.randint(0, 3, (11,), generator=gen))
    gram = acc.result().gram
    assert gram is not None and torch.equal(gram, gram.T)
    assert acc.packed_gram().dtype == F64 and torch.equal(acc.packed_gram(), _upper_reference(gram))
    assert acc.packed_gram(F32).dtype == F32 and torch.equal(acc.packed_gram(F32), _upper_reference(gram).to(F32))
    without = acc.result(with_gram=False)  # after packed_gram: the rest, without G
    assert without.gram is None and torch.equal(without.class_sums, acc.result().class_sums)
    assert acc.result(with_gram=True).gram is not None
    _raises(
        lambda: StatisticsAccumulator(6, 3, with_gram=False).packed_gram(),
        AnalyticInputError,
        "this accumulator has no Gram matrix (with_gram=False)",
    )


def test_aggregate_never_aliases_its_inputs() -> None:
    acc = StatisticsAccumulator(2, 2)
    acc.update(torch.ones(1, 2), torch.tensor([1]))
    only = acc.result()
    total = aggregate([only])
    total.gram += 1.0
    total.class_sums += 1.0
    total.counts += 1
    assert torch.equal(only.gram, torch.ones(2, 2, dtype=F64))
    assert torch.equal(only.class_sums, _t([0.0, 1.0], [0.0, 1.0]))
    assert only.counts.tolist() == [0, 1]


# =============================================================================== ridge
def _spd(dim: int, seed: int) -> torch.Tensor:
    a = torch.randn(dim, dim, generator=seeded_generator(seed), dtype=F64)
    return a @ a.T / dim + 0.5 * torch.eye(dim, dtype=F64)


def test_solve_ridge_in_float64_from_float32_statistics() -> None:
    g32 = _spd(5, 0).float()
    c32 = torch.randn(5, 3, generator=seeded_generator(1))
    want = torch.linalg.solve(g32.double() + 0.1 * torch.eye(5, dtype=F64), c32.double())
    got = solve_ridge(g32, c32, 0.1)
    assert got.dtype == F64
    assert _rel(got, want) <= 1e-13  # γ = 0.1 is not a float32 number: γI must be float64
    # γ = 0 is allowed for a positive definite G
    assert _rel(solve_ridge(g32, c32, 0), torch.linalg.solve(g32.double(), c32.double())) <= 1e-13


def test_residual_in_float64_from_float32_inputs() -> None:
    gen = seeded_generator(4)
    phi = torch.randn(9, 3, generator=gen)
    y = torch.nn.functional.one_hot(torch.randint(0, 2, (9,), generator=gen), 2).float()
    w = torch.randn(3, 2, generator=gen) * 0.37
    g, c = phi.T @ phi, phi.T @ y
    direct = float(((y.double() - phi.double() @ w.double()) ** 2).sum())
    got = ridge_residual(g, c, w, float((y * y).sum()))
    # float32 statistics are exact in float64; the residual must be computed in float64
    g64, c64, w64 = g.double(), c.double(), w.double()
    exact = 9.0 - 2 * float((w64 * c64).sum()) + float((w64 * (g64 @ w64)).sum())
    assert got == pytest.approx(exact, rel=1e-14, abs=1e-12)
    assert got == pytest.approx(direct, rel=1e-5)  # g, c were summed in float32


def test_default_ridge_grid_by_hand() -> None:
    grid = default_ridge_grid()
    assert grid.dtype == F64 and grid.shape == (41,)
    for k in range(11):  # 4 per decade from 1e-2 to 1e8
        assert float(grid[4 * k]) == pytest.approx(10.0 ** (k - 2), rel=1e-12)
    assert float(grid[1]) == pytest.approx(10 ** (-2 + 0.25), rel=1e-12)


def test_gcv_on_a_hand_computed_one_feature_problem() -> None:
    """Φ = [2, 0]ᵀ, y = [4, 0]: G = 4, C = 8, yᵀy = 16, n = 2. At γ = 1: W = 8/5, residual
    y − ΦW = [0.8, 0], RSS = 0.64, df = 4/5, GCV = 2·0.64/1.2² = 0.8889. At γ = 4: W = 1,
    RSS = 4, df = 0.5, GCV = 2·4/1.5² = 3.5556."""
    best, table = select_ridge_gcv(_t([4.0]), _t([8.0]), 2, 16.0, grid=[1, 4])
    assert best == 1.0 and type(best) is float
    assert [(r.gamma, type(r.gamma)) for r in table] == [(1.0, float), (4.0, float)]
    assert table[0].rss == pytest.approx(0.64, rel=1e-12)
    assert table[0].df == pytest.approx(0.8, rel=1e-12)
    assert table[0].gcv == pytest.approx(2 * 0.64 / 1.2**2, rel=1e-12)
    assert table[1].rss == pytest.approx(4.0, rel=1e-12)
    assert table[1].gcv == pytest.approx(8 / 1.5**2, rel=1e-12)
    # one grid point, one sample
    best, table = select_ridge_gcv(_t([4.0]), _t([8.0]), 1, 16.0, grid=[4.0])
    assert best == 4.0 and len(table) == 1 and table[0].df == pytest.approx(0.5)
    # float32 statistics give the same table
    _, table32 = select_ridge_gcv(_t([4.0], dtype=F32), _t([8.0], dtype=F32), 2, 16.0, grid=[1.0, 4.0])
    assert [r.rss for r in table32] == pytest.approx([0.64, 4.0], rel=1e-12)


def test_gcv_spectrum_edges_by_hand() -> None:
    # df ≥ n: GCV is +inf, never a division by zero (λ = [1, 1], γ = 1: df = 1 = n)
    _, table = gcv_from_spectrum(_t(1.0, 1.0), _t(0.0, 0.0), 1, 1.0, grid=[1.0, 3.0])
    assert table[0].df == 1.0 and table[0].gcv == math.inf
    assert table[1].df == pytest.approx(0.5) and table[1].gcv == pytest.approx(1 * 1.0 / 0.5**2)
    # statistics that do not fit yᵀy (rounding, or a plug-in Ĝ) never give a negative RSS
    _, table = gcv_from_spectrum(_t(4.0), _t(64.0), 2, 0.0, grid=[1.0])
    assert table[0].rss == 0.0 and table[0].gcv == 0.0
    # the spectrum is used in float64 even when given in float32 (4.1 is not a float32 number)
    _, t32 = gcv_from_spectrum(_t(4.0, dtype=F32), _t(64.0, dtype=F32), 2, 16.0, grid=[0.1])
    assert t32[0].rss == pytest.approx(16.0 - 64.0 * 4.2 / 4.1**2, rel=1e-14)
    assert t32[0].df == pytest.approx(4.0 / 4.1, rel=1e-15)
    # the default grid is the 41-point one
    assert [r.gamma for r in gcv_from_spectrum(_t(4.0), _t(64.0), 2, 16.0)[1]] == default_ridge_grid().tolist()
    assert len(select_ridge_gcv(_t([4.0]), _t([8.0]), 2, 16.0)[1]) == 41


def test_ridge_state_over_stages_equals_one_direct_solve() -> None:
    gen = seeded_generator(7)
    phi = torch.randn(30, 4, generator=gen, dtype=F64)
    labels = torch.randint(0, 5, (30,), generator=gen)
    state = RidgeState.empty(4, 5)
    assert state.num_samples == 0 and state.gram.dtype == F64 and state.class_sums.shape == (4, 5)
    for classes in (range(2), range(2, 5)):  # two stages with global class columns
        mask = (labels >= classes.start) & (labels < classes.stop)
        x = phi[mask]
        y = torch.nn.functional.one_hot(labels[mask] - classes.start, len(classes)).double()
        state.add(classes, x.T @ x, x.T @ y, int(mask.sum()))
    y_all = torch.nn.functional.one_hot(labels, 5).double()
    assert state.num_samples == 30
    torch.testing.assert_close(state.class_sums, phi.T @ y_all, rtol=1e-13, atol=1e-13)
    w, gamma, table = state.solve(5, 2.0)
    assert gamma == 2.0 and table == []
    torch.testing.assert_close(w, torch.linalg.solve(phi.T @ phi + 2 * torch.eye(4, dtype=F64), phi.T @ y_all))
    # the first num_seen classes only
    w3, _, _ = state.solve(3, 2.0)
    assert w3.shape == (4, 3) and torch.allclose(w3, w[:, :3], rtol=1e-12, atol=1e-14)
    # ridge None: γ chosen by GCV with yᵀy = n (one-hot labels)
    w_auto, gamma_auto, table = state.solve(5, None)
    want_gamma, want_table = select_ridge_gcv(phi.T @ phi, phi.T @ y_all, 30, 30.0)
    assert gamma_auto == want_gamma and len(table) == len(want_table) == 41
    assert [r.gcv for r in table] == pytest.approx([r.gcv for r in want_table], rel=1e-9)
    assert _rel(w_auto, torch.linalg.solve(phi.T @ phi + gamma_auto * torch.eye(4, dtype=F64), phi.T @ y_all)) < 1e-10
    # late statistics of classes already seen add to their columns
    late = RidgeState.from_state(
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.state_dict().items()}
    )
    late.add(range(2), torch.eye(4, dtype=F64), torch.ones(4, 2, dtype=F64), 3)
    assert torch.equal(late.class_sums[:, :2], state.class_sums[:, :2] + 1) and late.num_samples == 33
    assert torch.equal(late.gram, state.gram + torch.eye(4, dtype=F64))
    # state_dict round trip
    restored = RidgeState.from_state(state.state_dict())
    assert torch.equal(restored.gram, state.gram) and torch.equal(restored.class_sums, state.class_sums)
    assert restored.num_samples == 30
    symmetric = torch.equal(state.gram, state.gram.T)
    # the certified bound too, where finite (an empty state's 0 plus what was added with a bound)
    bounded = {"negative_bound"} if math.isfinite(state.negative_bound) else set()
    assert set(state.state_dict()) == {"gram_packed" if symmetric else "gram", "class_sums", "num_samples"} | bounded
    assert restored.negative_bound == state.negative_bound


@pytest.mark.parametrize("symmetric", [True, False])
def test_ridge_state_checkpoints_a_symmetric_gram_packed(symmetric: bool) -> None:
    """A symmetric G (every sum of packed uploads) is stored as its upper triangle, half the bytes,
    and comes back bit for bit; any other G is stored whole, also bit for bit."""
    gen = seeded_generator(3)
    x = torch.randn(7, 5, generator=gen, dtype=F64)
    state = RidgeState.empty(5, 2)
    state.add_packed(range(2), pack_upper(x.T @ x), torch.randn(5, 2, generator=gen, dtype=F64), 7)
    if not symmetric:
        state.gram[0, 1] += 1.0
    saved = state.state_dict()
    assert ("gram_packed" in saved) is symmetric and ("gram" in saved) is not symmetric
    if symmetric:
        assert saved["gram_packed"].numel() == 15
    restored = RidgeState.from_state(saved)
    assert torch.equal(restored.gram, state.gram) and torch.equal(restored.class_sums, state.class_sums)
    with pytest.raises(AnalyticInputError):
        RidgeState.from_state(
            {**saved, "gram_packed": torch.zeros(14, dtype=F64)} if symmetric else {**saved, "gram": None}
        )


def test_ridge_state_add_packed_equals_add_of_the_unpacked_gram() -> None:
    gen = seeded_generator(8)
    x = torch.randn(9, 4, generator=gen, dtype=F64)
    gram_t, sums_t = x.T @ x, torch.randn(4, 2, generator=gen, dtype=F64)
    plain, packed = RidgeState.empty(4, 5), RidgeState.empty(4, 5)
    for state in (plain, packed):
        state.add(range(5), torch.eye(4, dtype=F64), torch.ones(4, 5, dtype=F64), 2)
    plain.add(range(1, 3), gram_t, sums_t, 9)
    packed.add_packed(range(1, 3), pack_upper(gram_t), sums_t, 9)
    assert torch.equal(packed.gram, plain.gram) and torch.equal(packed.class_sums, plain.class_sums)
    assert packed.num_samples == plain.num_samples == 11
    packed.add_packed(range(3, 5), None, sums_t, 1)  # no Gram (STSA-E): G unchanged
    assert torch.equal(packed.gram, plain.gram) and packed.num_samples == 12
    assert torch.equal(packed.class_sums[:, 3:], plain.class_sums[:, 3:] + sums_t)
    before = packed.gram.clone()
    _raises(  # the shapes are checked before G changes
        lambda: packed.add_packed(range(2), pack_upper(gram_t), torch.zeros(4, 3, dtype=F64), 1),
        AnalyticInputError,
        "class_sums shape (4, 3) does not fit 4 features and 2 classes",
    )
    assert torch.equal(packed.gram, before) and packed.num_samples == 12


# =============================================================================== STSA-E estimator
def _eq9_by_hand(sums: torch.Tensor, counts: torch.Tensor, k: float) -> torch.Tensor:
    """Eq. 9 for one class: A Σ_k C_k C_kᵀ/n_k − B S Sᵀ, clipped coefficients, K given."""
    n = float(counts.sum())
    a = max(0.0, (n - 1) / (k - 1))
    b = max(0.0, (n - k) / ((k - 1) * n))
    s = sums.sum(0)
    out = -b * torch.outer(s, s)
    for c_k, n_k in zip(sums, counts.tolist()):
        if n_k > 0:
            out += a * torch.outer(c_k, c_k) / n_k
    return out


def test_global_mode_with_two_clients_by_hand() -> None:
    """K = 2 (the smallest global K): C_1 = [3, 0] (n_1 = 3), C_2 = [0, 4] (n_2 = 1); n = 4,
    A = 3, B = 2/4: Ĝ = 3·(diag(9/3, 16/1)) − ½·[3, 4][3, 4]ᵀ."""
    sums = torch.tensor([[[3.0], [0.0]], [[0.0], [4.0]]], dtype=F64)
    counts = torch.tensor([[3], [1]])
    want = 3 * torch.diag(_t(3.0, 16.0)) - 0.5 * torch.outer(_t(3.0, 4.0), _t(3.0, 4.0))
    assert torch.allclose(estimate_gram(sums, counts), want, rtol=1e-15, atol=1e-14)
    estimator = GramEstimator(2, 1)
    estimator.add(sums[0], counts[0])
    estimator.add(sums[1], counts[1])
    assert torch.allclose(estimator.result(), want, rtol=1e-14, atol=1e-13)
    assert torch.allclose(_eq9_by_hand(sums[:, :, 0], counts[:, 0].double(), 2.0), want)


def test_per_class_mode_keeps_a_single_sample_class() -> None:
    """One class held by one upload with one sample: Ĝ^(i) = S Sᵀ/n = C Cᵀ (A = 1, B = 0)."""
    sums = torch.tensor([[[2.0, 1.0], [0.0, 3.0]], [[0.0, 0.0], [0.0, 0.0]]], dtype=F64)  # (K=2, M=2, c=2)
    counts = torch.tensor([[1, 2], [0, 0]])
    want = torch.outer(_t(2.0, 0.0), _t(2.0, 0.0)) + torch.outer(_t(1.0, 3.0), _t(1.0, 3.0)) / 2
    assert torch.allclose(estimate_gram(sums, counts, k_mode="per-class"), want, rtol=1e-15, atol=1e-15)
    streaming = GramEstimator(2, 2, k_mode="per-class")
    streaming.add(sums, counts)  # one call with D = 2 rows: one block per class
    assert torch.allclose(streaming.result(), want, rtol=1e-14, atol=1e-14)
    # global mode, same uploads: class 0 has n = 1 → A = 0, B = 0; class 1: n = 2 = K → A = 1, B = 0
    assert torch.allclose(estimate_gram(sums, counts), torch.outer(_t(1.0, 3.0), _t(1.0, 3.0)) / 2)


def test_fractional_counts_clip_the_coefficients() -> None:
    """Noised counts may be fractional: n = 1 over K_i = 2 holders gives A = 0 and B < 0 → 0."""
    sums = torch.tensor([[[1.0], [2.0]], [[3.0], [1.0]]], dtype=F64)
    counts = torch.tensor([[0.5], [0.5]], dtype=F64)
    for k_mode in ("per-class", "global"):
        assert torch.equal(estimate_gram(sums, counts, k_mode=k_mode), torch.zeros(2, 2, dtype=F64))


def test_estimator_runs_in_float64_for_float32_and_integer_inputs() -> None:
    gen = seeded_generator(11)
    counts = torch.randint(1, 7, (4, 3), generator=gen)
    counts[1, 2] = 0
    sums = torch.rand(4, 5, 3, generator=gen) * counts.unsqueeze(1)
    want = estimate_gram(sums.double(), counts.double(), k_mode="per-class")
    for s, c in ((sums, counts), (sums, counts.float() * 1.1), (sums.double(), counts)):
        got = estimate_gram(s, c, k_mode="per-class")
        expected = estimate_gram(s.double(), c.double(), k_mode="per-class")
        assert got.dtype == F64 and _rel(got, expected) <= 1e-14
    for s, c in ((sums, counts), (sums.double(), counts)):  # streaming, integer or float32 inputs
        estimator = GramEstimator(5, 3, k_mode="per-class")
        for k in range(4):
            estimator.add(s[k], c[k])
        assert _rel(estimator.result(), want) <= 1e-14
        assert estimator.holders.dtype == torch.int64 and estimator.holders.tolist() == [4, 4, 3]


def test_streaming_with_one_and_with_two_blocks_per_class() -> None:
    sums, counts = torch.rand(2, 10, 2, generator=seeded_generator(5), dtype=F64), torch.tensor([[2, 3], [1, 4]])
    want = estimate_gram(sums, counts)
    one_call = GramEstimator(10, 2)
    one_call.add(sums, counts)  # one block of two columns per class
    two_calls = GramEstimator(10, 2)
    two_calls.add(sums[0], counts[0])
    two_calls.add(sums[1], counts[1])  # two blocks of one column per class
    for estimator in (one_call, two_calls):
        assert _rel(estimator.result(), want) <= 1e-14
        assert estimator.num_uploads == 2


def test_streaming_sums_a_float32_block_in_float64() -> None:
    """D uploads in one call: their class sums are added in float64 (float32 would round here)."""
    gen = seeded_generator(12)
    sums = (torch.rand(3, 4, 1, generator=gen) * 1000 + torch.rand(3, 4, 1, generator=gen) / 3).float()
    counts = torch.tensor([[3], [5], [7]])
    estimator = GramEstimator(4, 1)
    estimator.add(sums, counts)
    assert torch.equal(estimator.class_sums, sums.double().sum(dim=0))
    assert _rel(estimator.result(), estimate_gram(sums.double(), counts)) <= 1e-14
    one = GramEstimator(1, 2)  # M = 1
    one.add(torch.tensor([[2.0, 0.0]]), torch.tensor([2.0, 0.0]))
    one.add(torch.tensor([[4.0, 3.0]]), torch.tensor([2.0, 1.0]))
    assert torch.allclose(
        one.result(), estimate_gram(torch.tensor([[[2.0, 0.0]], [[4.0, 3.0]]]), torch.tensor([[2.0, 0.0], [2.0, 1.0]]))
    )


def test_estimator_state_size_by_hand() -> None:
    rf_dim = 3
    estimator = GramEstimator(rf_dim, 2)
    assert estimator.state_numbers() == 3 * 2  # S only
    estimator.add(torch.ones(3, 2), torch.tensor([1.0, 0.0]))  # class 0: one column of M numbers
    assert estimator.state_numbers() == 3 + 6
    estimator.add(torch.ones(3, 3, 2), torch.ones(3, 2))  # class 0: 4 columns > M → dense M²; class 1: 3 columns
    assert estimator.state_numbers() == 9 + 3 * 3 + 6


def test_dummy_split_edges() -> None:
    assert [len(c) for c in split_into_dummy_clients(0, 3, seed=0)] == [0, 0, 0]  # zero samples
    (only,) = split_into_dummy_clients(5, 1, seed=0)  # one dummy client holds everything
    assert sorted(only.tolist()) == [0, 1, 2, 3, 4]
    with torch.device("meta"):
        chunks = split_into_dummy_clients(6, 2, seed=1)
    assert all(c.device.type == "cpu" for c in chunks)


def test_no_warning_from_the_analytic_math() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        estimate_gram(torch.zeros(2, 3, 2), torch.tensor([[1, 0], [0, 0]]), k_mode="per-class")
        select_ridge_gcv(torch.eye(2, dtype=F64), torch.ones(2, 1, dtype=F64), 3, 3.0)
