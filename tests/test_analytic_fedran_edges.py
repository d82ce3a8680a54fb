"""FedRAN math: bad inputs, hand-computed cases, edges and invariances (issue 19).

Low-rank summaries and merges, the subspace solve and its Theorem 2 bound, prototype
pseudo-labelling. Every bad input expects its specific error and one-line message; every number
is computed here by hand or by a direct dense computation. Edges: a merge with exactly one
non-empty summary, zero samples, M = 1, a class without samples among the prototypes, zero
pseudo-labels accepted, singular vectors with flipped signs (canonicalisation must undo them), a
process whose default device is not the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from fcl_flower.analytic.errors import AnalyticInputError
from fcl_flower.analytic.lowrank import (
    LowRankError,
    LowRankSummary,
    TailEnergy,
    client_summary,
    client_summary_from_gram,
    discarded_energy,
    merge_pair,
    merge_summaries,
    merge_two_level,
    rank_for_budget,
)
from fcl_flower.analytic.pseudolabel import (
    PseudoLabelError,
    class_prototypes,
    pseudo_label,
    pseudo_label_client,
    pseudo_label_report,
    select_labelled,
)
from fcl_flower.analytic.ridge import select_ridge_gcv
from fcl_flower.analytic.subspace import (
    outside_subspace_norm,
    pad_label_corr,
    select_subspace_ridge_gcv,
    solve_subspace_ridge,
    subspace_coefficients,
    weight_error_bound,
)
from tests.conftest import seeded_generator

F64 = torch.float64
F32 = torch.float32


def _raises(call, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message
    assert "\n" not in message


def _summary(n: int, dim: int, rank: int, seed: int) -> LowRankSummary:
    return client_summary(torch.randn(n, dim, generator=seeded_generator(seed), dtype=F64), rank)


GOOD = _summary(10, 6, 3, 0)
OTHER_DIM = _summary(10, 7, 3, 0)
B6 = torch.ones(6, 2, dtype=F64)
Z = torch.zeros(3, 2, dtype=F64)
Y = torch.tensor([0, 1, 1])


def _basis(m: int, r: int) -> torch.Tensor:
    return torch.eye(m, r, dtype=F64)


BAD_INPUTS = [
    # LowRankSummary
    (
        "basis 1-D",
        lambda: LowRankSummary(torch.zeros(3, dtype=F64), torch.zeros(3, dtype=F64), 1),
        "basis must be a 2-D tensor (M, r)",
    ),
    ("basis list", lambda: LowRankSummary([[1.0]], torch.ones(1, dtype=F64), 1), "basis must be a 2-D tensor (M, r)"),
    (
        "sigma 2-D",
        lambda: LowRankSummary(_basis(3, 1), torch.ones(1, 1, dtype=F64), 1),
        "singular_values must be a 1-D tensor (r,)",
    ),
    ("sigma list", lambda: LowRankSummary(_basis(3, 1), [1.0], 1), "singular_values must be a 1-D tensor (r,)"),
    (
        "basis float32",
        lambda: LowRankSummary(_basis(3, 1).float(), torch.ones(1, dtype=F64), 1),
        "basis and singular_values must be float64",
    ),
    (
        "sigma float32",
        lambda: LowRankSummary(_basis(3, 1), torch.ones(1), 1),
        "basis and singular_values must be float64",
    ),
    (
        "columns",
        lambda: LowRankSummary(_basis(4, 2), torch.ones(3, dtype=F64), 1),
        "basis has 2 columns but there are 3 singular values",
    ),
    (
        "rank > M",
        lambda: LowRankSummary(torch.zeros(2, 3, dtype=F64), torch.ones(3, dtype=F64), 1),
        "rank 3 exceeds the feature dimension 2",
    ),
    (
        "devices",
        lambda: LowRankSummary(_basis(3, 1), torch.ones(1, dtype=F64, device="meta"), 1),
        "basis and singular_values must be on the same device",
    ),
    (
        "sigma negative",
        lambda: LowRankSummary(_basis(3, 1), torch.tensor([-1.0], dtype=F64), 1),
        "singular_values must be finite and non-negative",
    ),
    (
        "sigma nan",
        lambda: LowRankSummary(_basis(3, 1), torch.tensor([math.nan], dtype=F64), 1),
        "singular_values must be finite and non-negative",
    ),
    (
        "sigma inf",
        lambda: LowRankSummary(_basis(3, 1), torch.tensor([math.inf], dtype=F64), 1),
        "singular_values must be finite and non-negative",
    ),
    (
        "basis inf",
        lambda: LowRankSummary(torch.full((3, 1), math.inf, dtype=F64), torch.ones(1, dtype=F64), 1),
        "basis must be finite",
    ),
    (
        "n -1",
        lambda: LowRankSummary(_basis(3, 1), torch.ones(1, dtype=F64), -1),
        "num_samples must be a non-negative int, got -1",
    ),
    (
        "n bool",
        lambda: LowRankSummary(_basis(3, 1), torch.ones(1, dtype=F64), True),
        "num_samples must be a non-negative int, got True",
    ),
    (
        "n float",
        lambda: LowRankSummary(_basis(3, 1), torch.ones(1, dtype=F64), 1.5),
        "num_samples must be a non-negative int, got 1.5",
    ),
    ("empty dim 0", lambda: LowRankSummary.empty(0), "dim must be a positive int, got 0"),
    ("empty dim float", lambda: LowRankSummary.empty(2.0), "dim must be a positive int, got 2.0"),
    # discarded_energy
    ("energy 2-D", lambda: discarded_energy(torch.ones(2, 2), 1), "singular_values must be a 1-D tensor"),
    ("energy list", lambda: discarded_energy([1.0], 0), "singular_values must be a 1-D tensor"),
    ("energy rank -1", lambda: discarded_energy(torch.ones(2), -1), "rank must be an int >= 0, got -1"),
    ("energy rank float", lambda: discarded_energy(torch.ones(2), 1.5), "rank must be an int >= 0, got 1.5"),
    # client_summary
    ("features 1-D", lambda: client_summary(torch.zeros(4), 1), "features must be a 2-D tensor (n, M)"),
    ("features list", lambda: client_summary([[1.0]], 1), "features must be a 2-D tensor (n, M)"),
    (
        "features int",
        lambda: client_summary(torch.zeros(2, 2, dtype=torch.int64), 1),
        "features must be floating point, got torch.int64",
    ),
    ("rank 0", lambda: client_summary(torch.zeros(2, 2), 0), "rank must be an int >= 1, got 0"),
    ("rank bool", lambda: client_summary(torch.zeros(2, 2), True), "rank must be an int >= 1, got True"),
    ("rank float", lambda: client_summary(torch.ones(3, 2), 2.5), "rank must be an int >= 1, got 2.5"),
    (
        "method",
        lambda: client_summary(torch.zeros(2, 2), 1, method="qr"),
        "method must be 'auto', 'svd' or 'gram', got 'qr'",
    ),  # type: ignore[arg-type]  # the bad value is the test
    ("zero columns", lambda: client_summary(torch.zeros(3, 0), 1), "features have zero columns"),
    ("features nan", lambda: client_summary(torch.tensor([[math.nan, 1.0]]), 1), "features contain NaN or Inf"),
    # client_summary_from_gram
    ("gram 1-D", lambda: client_summary_from_gram(torch.zeros(4), 1, 1), "gram must be a square 2-D tensor (M, M)"),
    ("gram list", lambda: client_summary_from_gram([[1.0]], 1, 1), "gram must be a square 2-D tensor (M, M)"),
    (
        "gram non-square",
        lambda: client_summary_from_gram(torch.zeros(2, 3), 1, 1),
        "gram must be a square 2-D tensor (M, M)",
    ),
    ("gram empty", lambda: client_summary_from_gram(torch.zeros(0, 0), 1, 1), "gram is empty"),
    (
        "gram n -1",
        lambda: client_summary_from_gram(torch.eye(2), -1, 1),
        "num_samples must be a non-negative int, got -1",
    ),
    (
        "gram n bool",
        lambda: client_summary_from_gram(torch.eye(2), True, 1),
        "num_samples must be a non-negative int, got True",
    ),
    (
        "gram n float",
        lambda: client_summary_from_gram(torch.eye(2), 2.0, 1),
        "num_samples must be a non-negative int, got 2.0",
    ),
    ("gram rank 0", lambda: client_summary_from_gram(torch.eye(2), 2, 0), "rank must be an int >= 1, got 0"),
    ("gram nan", lambda: client_summary_from_gram(torch.tensor([[math.nan]]), 1, 1), "gram contains NaN or Inf"),
    (
        "gram asymmetric",
        lambda: client_summary_from_gram(torch.tensor([[1.0, 2.0], [0.0, 1.0]]), 2, 1),
        "gram is not symmetric",
    ),
    (
        "small-scale asymmetric",
        lambda: client_summary_from_gram(torch.tensor([[1e-6, 1e-13], [0.0, 1e-6]], dtype=F64), 2, 1),
        "gram is not symmetric",
    ),
    # merges
    ("merge dims", lambda: merge_pair(GOOD, OTHER_DIM, 3), "summaries have different feature dimensions [6, 7]"),
    ("merge type", lambda: merge_pair(GOOD, 1, 3), "expected LowRankSummary, got int"),
    (
        "merge devices",
        lambda: merge_pair(GOOD, LowRankSummary.empty(6, device="meta"), 3),
        "summaries live on different devices ['cpu', 'meta']",
    ),
    ("merge rank 0", lambda: merge_pair(GOOD, GOOD, 0), "rank must be an int >= 1, got 0"),
    ("merge nothing", lambda: merge_summaries([], 3), "merge_summaries needs at least one summary"),
    (
        "two-level nothing",
        lambda: merge_two_level([], None, 3),
        "merge_two_level needs client summaries or a previous summary",
    ),
    ("two-level rank", lambda: merge_two_level([GOOD], None, 0), "rank must be an int >= 1, got 0"),
    # rank_for_budget
    ("budget float", lambda: rank_for_budget(1.5, 4, 1, 8), "budget_bytes must be an int, got 1.5"),
    ("budget rf_dim bool", lambda: rank_for_budget(100, True, 1, 8), "rf_dim must be an int, got True"),
    ("budget classes float", lambda: rank_for_budget(100, 4, 1.0, 8), "num_classes must be an int, got 1.0"),
    ("budget width None", lambda: rank_for_budget(100, 4, 1, None), "bytes_per_number must be an int, got None"),
    *[
        (
            f"budget {name}",
            call,
            "rf_dim and bytes_per_number must be positive, budget and classes non-negative",
        )
        for name, call in (
            ("rf_dim 0", lambda: rank_for_budget(1000, 0, 1, 8)),
            ("width 0", lambda: rank_for_budget(1000, 4, 1, 0)),
            ("classes -1", lambda: rank_for_budget(1000, 4, -1, 8)),
            ("budget -1", lambda: rank_for_budget(-1, 4, 1, 8)),
        )
    ],
    (
        "budget holds B exactly",
        lambda: rank_for_budget(8 * 4 * 2, 4, 2, 8),
        "budget of 64 bytes holds B but not one rank-1 factor (40 bytes more)",
    ),
    (
        "budget 0",
        lambda: rank_for_budget(0, 4, 0, 8),
        "budget of 0 bytes holds B but not one rank-1 factor (40 bytes more)",
    ),
    (
        "budget below B",
        lambda: rank_for_budget(63, 4, 2, 8),
        "budget of 63 bytes cannot hold B (4x2 numbers = 64 bytes)",
    ),
    # subspace
    ("pad classes bool", lambda: pad_label_corr(Z, True), "num_classes must be an int, got True"),
    ("pad classes float", lambda: pad_label_corr(Z, 2.5), "num_classes must be an int, got 2.5"),
    ("pad down", lambda: pad_label_corr(torch.zeros(3, 3, dtype=F64), 2), "cannot pad B of width 3 down to 2 classes"),
    (
        "pad B 1-D",
        lambda: pad_label_corr(torch.zeros(3, dtype=F64), 2),
        "label correlation B must be a 2-D tensor (M, C)",
    ),
    ("pad B list", lambda: pad_label_corr([[0.0]], 2), "label correlation B must be a 2-D tensor (M, C)"),
    (
        "pad B int",
        lambda: pad_label_corr(torch.zeros(3, 2, dtype=torch.int64), 2),
        "label correlation B must be floating point, got torch.int64",
    ),
    ("coefficients type", lambda: subspace_coefficients(B6, B6, 1.0), "expected LowRankSummary, got Tensor"),
    (
        "coefficients rows",
        lambda: subspace_coefficients(GOOD, torch.ones(5, 2, dtype=F64), 1.0),
        "B has 5 rows but the summary has dimension 6",
    ),
    ("coefficients ridge -1", lambda: subspace_coefficients(GOOD, B6, -1.0), "ridge must be finite and >= 0, got -1.0"),
    (
        "coefficients ridge inf",
        lambda: subspace_coefficients(GOOD, B6, math.inf),
        "ridge must be finite and >= 0, got inf",
    ),
    (
        "coefficients ridge nan",
        lambda: subspace_coefficients(GOOD, B6, math.nan),
        "ridge must be finite and >= 0, got nan",
    ),
    (
        "coefficients zero direction",
        lambda: subspace_coefficients(
            LowRankSummary(_basis(3, 2), torch.tensor([1.0, 0.0], dtype=F64), 2), torch.ones(3, 1, dtype=F64), 0.0
        ),
        "sigma_i^2 + ridge is zero for some direction; use a positive ridge",
    ),
    ("gcv type", lambda: select_subspace_ridge_gcv(B6, B6, 5, 5.0), "expected LowRankSummary, got Tensor"),
    (
        "gcv rows",
        lambda: select_subspace_ridge_gcv(GOOD, torch.ones(5, 2, dtype=F64), 5, 5.0),
        "B has 5 rows but the summary has dimension 6",
    ),
    (
        "gcv B 1-D",
        lambda: select_subspace_ridge_gcv(GOOD, torch.ones(6, dtype=F64), 5, 5.0),
        "label correlation B must be a 2-D tensor (M, C)",
    ),
    (
        "outside rows",
        lambda: outside_subspace_norm(GOOD, torch.ones(5, 2, dtype=F64)),
        "B has 5 rows but the summary has dimension 6",
    ),
    (
        "outside B int",
        lambda: outside_subspace_norm(GOOD, torch.ones(6, 2, dtype=torch.int64)),
        "label correlation B must be floating point, got torch.int64",
    ),
    ("bound ridge 0", lambda: weight_error_bound(GOOD, B6, 0.0), "ridge must be finite and > 0 for the bound, got 0.0"),
    (
        "bound ridge -1",
        lambda: weight_error_bound(GOOD, B6, -1.0),
        "ridge must be finite and > 0 for the bound, got -1.0",
    ),
    (
        "bound ridge inf",
        lambda: weight_error_bound(GOOD, B6, math.inf),
        "ridge must be finite and > 0 for the bound, got inf",
    ),
    (
        "bound ridge nan",
        lambda: weight_error_bound(GOOD, B6, math.nan),
        "ridge must be finite and > 0 for the bound, got nan",
    ),
]

PSEUDO_BAD_INPUTS = [
    ("features 1-D", lambda: class_prototypes(torch.zeros(3), Y, 2), "features must be a 2-D tensor (n, d)"),
    (
        "features int",
        lambda: class_prototypes(torch.zeros(3, 2, dtype=torch.int64), Y, 2),
        "features must be floating point, got torch.int64",
    ),
    ("features nan", lambda: class_prototypes(torch.full((3, 2), math.nan), Y, 2), "features contain NaN or Inf"),
    ("classes 0", lambda: class_prototypes(torch.zeros(3, 2), Y, 0), "num_classes must be a positive int, got 0"),
    (
        "classes bool",
        lambda: class_prototypes(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), True),
        "num_classes must be a positive int, got True",
    ),
    (
        "classes float",
        lambda: class_prototypes(torch.zeros(3, 2), Y, 2.5),
        "num_classes must be a positive int, got 2.5",
    ),
    (
        "labels length",
        lambda: class_prototypes(torch.zeros(3, 2), torch.tensor([0, 1]), 2),
        "labels must be a 1-D tensor with one entry per feature row",
    ),
    (
        "labels 2-D",
        lambda: class_prototypes(torch.zeros(3, 2), torch.zeros(3, 1, dtype=torch.int64), 2),
        "labels must be a 1-D tensor with one entry per feature row",
    ),
    (
        "labels list",
        lambda: class_prototypes(torch.zeros(3, 2), [0, 1, 1], 2),
        "labels must be a 1-D tensor with one entry per feature row",
    ),
    (
        "labels float",
        lambda: class_prototypes(torch.zeros(3, 2), torch.zeros(3), 2),
        "labels must be an integer tensor, got torch.float32",
    ),
    ("label = C", lambda: class_prototypes(torch.zeros(3, 2), torch.tensor([0, 1, 2]), 2), "labels must lie in [0, 2)"),
    (
        "label < 0",
        lambda: class_prototypes(torch.zeros(3, 2), torch.tensor([0, -1, 1]), 2),
        "labels must lie in [0, 2)",
    ),
    (
        "unlabelled 1-D",
        lambda: pseudo_label(torch.zeros(2), torch.zeros(2, 2), torch.ones(2, dtype=torch.bool)),
        "features_unlabelled must be a 2-D tensor (n, d)",
    ),
    (
        "prototypes 1-D",
        lambda: pseudo_label(torch.zeros(2, 2), torch.zeros(2), torch.ones(2, dtype=torch.bool)),
        "prototypes must be a 2-D tensor (C, d)",
    ),
    (
        "prototypes list",
        lambda: pseudo_label(torch.zeros(2, 2), [[0.0, 0.0]], torch.ones(1, dtype=torch.bool)),
        "prototypes must be a 2-D tensor (C, d)",
    ),
    (
        "prototype dim",
        lambda: pseudo_label(torch.zeros(2, 2), torch.zeros(4, 3), torch.ones(4, dtype=torch.bool)),
        "prototypes have dimension 3, features 2",
    ),
    (
        "mask int",
        lambda: pseudo_label(torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, dtype=torch.int64)),
        "present_mask must be a bool tensor with one entry per prototype",
    ),
    (
        "mask length",
        lambda: pseudo_label(torch.ones(2, 2), torch.ones(2, 2), torch.ones(3, dtype=torch.bool)),
        "present_mask must be a bool tensor with one entry per prototype",
    ),
    (
        "mask list",
        lambda: pseudo_label(torch.ones(2, 2), torch.ones(2, 2), [True, True]),
        "present_mask must be a bool tensor with one entry per prototype",
    ),
    (
        "threshold nan",
        lambda: pseudo_label(torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, dtype=torch.bool), math.nan),
        "threshold must be finite, got nan",
    ),
    (
        "threshold inf",
        lambda: pseudo_label(torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, dtype=torch.bool), -math.inf),
        "threshold must be finite, got -inf",
    ),
    (
        "select n -1",
        lambda: select_labelled(-1, 0.5, seeded_generator(0)),
        "num_samples must be a non-negative int, got -1",
    ),
    (
        "select n bool",
        lambda: select_labelled(True, 0.5, seeded_generator(0)),
        "num_samples must be a non-negative int, got True",
    ),
    (
        "select n float",
        lambda: select_labelled(2.0, 0.5, seeded_generator(0)),
        "num_samples must be a non-negative int, got 2.0",
    ),
    (
        "select ratio > 1",
        lambda: select_labelled(4, 1.5, seeded_generator(0)),
        "label ratio must lie in [0, 1], got 1.5",
    ),
    (
        "select ratio < 0",
        lambda: select_labelled(4, -0.1, seeded_generator(0)),
        "label ratio must lie in [0, 1], got -0.1",
    ),
    (
        "select ratio nan",
        lambda: select_labelled(4, math.nan, seeded_generator(0)),
        "label ratio must lie in [0, 1], got nan",
    ),
    ("select generator", lambda: select_labelled(4, 0.5, 7), "generator must be a torch.Generator"),
    (
        "report accepted 2-D",
        lambda: pseudo_label_report(torch.ones(2, 1, dtype=torch.bool), Y[:2], Y[:2]),
        "accepted must be a 1-D tensor",
    ),
    ("report accepted list", lambda: pseudo_label_report([True], Y[:1], Y[:1]), "accepted must be a 1-D tensor"),
    (
        "report predicted",
        lambda: pseudo_label_report(torch.ones(2, dtype=torch.bool), torch.zeros(2, 2), Y[:2]),
        "predicted must be a 1-D tensor",
    ),
    (
        "report truth",
        lambda: pseudo_label_report(torch.ones(2, dtype=torch.bool), Y[:2], 1),
        "true_labels must be a 1-D tensor",
    ),
    (
        "report lengths",
        lambda: pseudo_label_report(torch.ones(2, dtype=torch.bool), Y, Y),
        "accepted, predicted and true_labels must have the same length",
    ),
    (
        "report accepted int",
        lambda: pseudo_label_report(torch.ones(3, dtype=torch.int64), Y, Y),
        "accepted must be a bool tensor",
    ),
]


@pytest.mark.parametrize("call, message", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_fedran_inputs_raise_their_specific_one_line_error(call, message) -> None:
    _raises(call, LowRankError, message)


@pytest.mark.parametrize("call, message", [c[1:] for c in PSEUDO_BAD_INPUTS], ids=[c[0] for c in PSEUDO_BAD_INPUTS])
def test_bad_pseudo_label_inputs_raise_their_specific_one_line_error(call, message) -> None:
    _raises(call, PseudoLabelError, message)


# =============================================================================== summaries
def test_summary_edges_m1_zero_sigma_and_rank_one() -> None:
    one = client_summary(torch.tensor([[3.0], [-4.0]], dtype=F64), 5)  # M = 1
    assert one.rank == 1 and one.basis.tolist() == [[1.0]] and one.singular_values.tolist() == [5.0]
    from_gram = client_summary_from_gram(torch.tensor([[25.0]], dtype=F64), 2, 5)
    assert from_gram.basis.tolist() == [[1.0]] and from_gram.singular_values.tolist() == [5.0]
    for sign in (1.0, -1.0):  # M = 1 merges: the 1 × 1 basis is canonical (+1) too
        a = LowRankSummary(torch.tensor([[sign]], dtype=F64), torch.tensor([3.0], dtype=F64), 1)
        b = LowRankSummary(torch.tensor([[sign]], dtype=F64), torch.tensor([4.0], dtype=F64), 1)
        merged = merge_pair(a, b, 1)
        assert merged.basis.tolist() == [[1.0]] and merged.singular_values.tolist() == pytest.approx([5.0], rel=1e-15)
    zero_sigma = LowRankSummary(_basis(3, 2), torch.tensor([2.0, 0.0], dtype=F64), 4)  # a zero σ is allowed
    assert zero_sigma.rank == 2 and LowRankSummary.empty(1).dim == 1
    assert discarded_energy(torch.tensor([3.0, 0.1], dtype=F32), 1).spectral == float(
        torch.tensor(0.1, dtype=F32).double() ** 2
    )


def test_zero_samples_give_the_empty_summary_on_the_inputs_device() -> None:
    no_rows, zero_gram = torch.zeros(0, 4), torch.zeros(4, 4)
    with torch.device("meta"):  # a process whose default device is not the CPU
        empty = client_summary(no_rows, 2)
        from_gram = client_summary_from_gram(zero_gram, 0, 2)
        explicit = LowRankSummary.empty(4, device="cpu")
    for s in (empty, from_gram, explicit):
        assert (s.rank, s.dim, s.num_samples, s.discarded) == (0, 4, 0, TailEnergy())
        assert s.basis.device.type == "cpu" and s.singular_values.device.type == "cpu"
        assert s.basis.dtype == F64 and s.singular_values.dtype == F64


def test_summary_from_gram_caps_the_rank_by_samples_and_handles_one_sample() -> None:
    h = torch.randn(2, 5, generator=seeded_generator(1), dtype=F64)
    two = client_summary_from_gram(h.T @ h, 2, 4)
    assert two.rank == 2  # at most n non-zero eigenvalues
    torch.testing.assert_close(two.singular_values, torch.linalg.svdvals(h), rtol=1e-10, atol=0)
    one = client_summary_from_gram(torch.outer(h[0], h[0]), 1, 3)
    assert one.rank == 1 and one.singular_values.item() == pytest.approx(float(h[0].norm()), rel=1e-12)
    # float32 Gram: decomposed in float64
    g32 = (h.T @ h).float()
    assert torch.equal(
        client_summary_from_gram(g32, 2, 2).singular_values,
        client_summary_from_gram(g32.double(), 2, 2).singular_values,
    )


def test_symmetry_tolerance_is_relative_to_the_scale() -> None:
    big = torch.tensor([[1e6, 1e-4], [0.0, 1e6]], dtype=F64)  # asymmetry 1e-10 of the scale: rounding
    assert client_summary_from_gram(big, 3, 2).rank == 2
    edge = torch.tensor([[1.0, 1e-8], [0.0, 1.0]], dtype=F64)  # exactly 1e-8 of the scale: accepted
    assert client_summary_from_gram(edge, 3, 2).rank == 2


def test_routes_auto_svd_and_gram_by_definition() -> None:
    """auto = SVD of H when n < M, eigendecomposition of HᵀH when n ≥ M (bit for bit); the two
    routes differ on an ill-conditioned H, so the routing is observable."""
    gen = seeded_generator(3)
    for n, dim in ((3, 5), (5, 5), (8, 5)):
        q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=F64))
        p, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
        k = min(n, dim)
        h = p[:, :k] @ torch.diag(torch.logspace(0, -9, k, dtype=F64)) @ q[:, :k].T
        by_svd, by_gram = client_summary(h, 4, method="svd"), client_summary(h, 4, method="gram")
        assert not torch.equal(by_svd.singular_values, by_gram.singular_values)
        auto = client_summary(h, 4)
        want = by_svd if n < dim else by_gram
        assert torch.equal(auto.basis, want.basis) and torch.equal(auto.singular_values, want.singular_values)
        assert torch.equal(by_gram.singular_values, client_summary_from_gram(h.T @ h, n, 4).singular_values)
        assert by_svd.rank == min(4, n, dim)


# =============================================================================== merges
def test_a_merge_with_exactly_one_non_empty_summary_passes_it_through() -> None:
    only = _summary(12, 6, 4, 5)
    carried = TailEnergy(0.25, 0.5)
    empty = LowRankSummary(torch.zeros(6, 0, dtype=F64), torch.zeros(0, dtype=F64), 3, carried)
    for merged in (
        merge_summaries([empty, only], 4, stacked=True),
        merge_summaries([only, empty], 4, stacked=True),
        merge_summaries([empty, only], 4),
        merge_pair(empty, only, 4),
        merge_pair(only, empty, 4),
    ):
        assert torch.equal(merged.basis, only.basis) and torch.equal(merged.singular_values, only.singular_values)
        assert merged.num_samples == 15
        assert merged.discarded == only.discarded + carried
    # cut to a smaller rank: the cut is recorded on top of what was carried
    cut = merge_summaries([empty, only], 2, stacked=True)
    s = only.singular_values
    assert torch.equal(cut.basis, only.basis[:, :2]) and torch.equal(cut.singular_values, s[:2])
    want = only.discarded + carried + TailEnergy(float(s[2] ** 2), float((s[2:] ** 2).sum()))
    assert cut.discarded.spectral == pytest.approx(want.spectral, rel=1e-15)
    assert cut.discarded.trace == pytest.approx(want.trace, rel=1e-15)
    assert merge_pair(only, empty, 2).discarded.trace == pytest.approx(want.trace, rel=1e-15)


def test_merges_of_only_empty_summaries() -> None:
    a = LowRankSummary(torch.zeros(5, 0, dtype=F64), torch.zeros(0, dtype=F64), 2, TailEnergy(1.0, 2.0))
    b = LowRankSummary(torch.zeros(5, 0, dtype=F64), torch.zeros(0, dtype=F64), 3, TailEnergy(0.5, 0.5))
    for merged in (merge_summaries([a, b], 3, stacked=True), merge_summaries([a, b], 3)):
        assert (merged.rank, merged.dim, merged.num_samples) == (0, 5, 5)
        assert merged.discarded == TailEnergy(1.5, 2.5)
    single = merge_summaries([a], 3, stacked=True)
    assert (single.rank, single.num_samples, single.discarded) == (0, 2, TailEnergy(1.0, 2.0))
    lone = _summary(4, 5, 2, 1)
    with torch.device("meta"):  # the result stays on the summaries' device
        merged = merge_summaries([a, b], 3, stacked=True)
        sequential = merge_summaries([lone], 3)
        running = merge_two_level([], lone, 3)
    assert merged.basis.device.type == "cpu" and sequential.basis.device.type == "cpu"
    assert running.basis.device.type == "cpu" and running.rank == 2


def test_two_level_merge_honours_stacked() -> None:
    clients = [_summary(9, 8, 4, seed) for seed in (10, 11, 12)]
    for stacked in (True, False):
        got = merge_two_level(clients, None, 3, stacked=stacked)
        want = merge_summaries(clients, 3, stacked=stacked)
        assert torch.equal(got.basis, want.basis) and got.discarded == want.discarded
    assert not torch.equal(
        merge_two_level(clients, None, 3, stacked=True).singular_values,
        merge_two_level(clients, None, 3).singular_values,
    )


def test_flipped_singular_vector_signs_are_undone() -> None:
    """A summary and the same summary with some basis columns negated describe the same Gram;
    every result is in the canonical form (largest-magnitude entry of each column positive), so
    merging either gives the same numbers."""
    a, b = _summary(20, 7, 5, 20), _summary(15, 7, 4, 21)
    flip = torch.tensor([-1.0, 1.0, -1.0, -1.0, 1.0], dtype=F64)
    a_flipped = LowRankSummary(a.basis * flip, a.singular_values, a.num_samples, a.discarded)
    for rank in (3, 7):
        want = merge_pair(a, b, rank)
        got = merge_pair(a_flipped, b, rank)
        torch.testing.assert_close(got.basis, want.basis, rtol=0, atol=1e-10)
        torch.testing.assert_close(got.singular_values, want.singular_values, rtol=1e-12, atol=0)
    h = torch.randn(9, 7, generator=seeded_generator(22), dtype=F64)
    for summary in (
        client_summary(h, 7, method="svd"),
        client_summary(h, 7, method="gram"),
        merge_pair(a, b, 7),
        merge_summaries([a, b], 6, stacked=True),
    ):
        pivots = summary.basis.abs().argmax(dim=0)
        assert bool((summary.basis.gather(0, pivots.unsqueeze(0)) > 0).all())
        # and the signs are the canonical form of -U too
        negated = client_summary_from_gram(summary.gram(), summary.num_samples, summary.rank)
        torch.testing.assert_close(negated.basis, summary.basis, rtol=0, atol=1e-8)


# =============================================================================== budget
def test_rank_for_budget_by_hand() -> None:
    # M = 4, C = 2, 8 bytes: B takes 64 bytes, each rank 40 more
    assert rank_for_budget(64 + 40, 4, 2, 8) == 1
    assert rank_for_budget(64 + 3 * 40 + 39, 4, 2, 8) == 3
    assert rank_for_budget(10**6, 4, 2, 8) == 4  # capped at M
    assert rank_for_budget(2 * 2, 1, 0, 1) == 1  # M = 1, 1 byte per number, no classes yet


# =============================================================================== subspace solve
def test_subspace_solve_with_zero_ridge_and_small_singular_values() -> None:
    summary = LowRankSummary(_basis(3, 2), torch.tensor([2.0, 0.5], dtype=F64), 4)
    b = torch.tensor([[4.0], [1.0], [7.0]], dtype=F64)
    # W̃_i = (UᵀB)_i / σ_i²: [4/4, 1/0.25]
    assert subspace_coefficients(summary, b, 0.0).tolist() == [[1.0], [4.0]]
    assert solve_subspace_ridge(summary, b, 0.0).tolist() == [[1.0], [4.0], [0.0]]
    assert subspace_coefficients(summary, b.float(), 1.0).tolist() == [[4 / 5], [1 / 1.25]]  # float32 B


def test_pad_label_corr_same_width_and_dtype() -> None:
    b32 = torch.tensor([[1.5, 2.0]], dtype=F32)
    same = pad_label_corr(b32, 2)
    assert same.dtype == F64 and same.tolist() == [[1.5, 2.0]]
    assert pad_label_corr(b32, 3).tolist() == [[1.5, 2.0, 0.0]]


def test_weight_error_bound_by_hand() -> None:
    """U = e₁ (M = 2), ε_G = 0.5, B = [1, 2]ᵀ: ‖B‖_F = √5, (I − UUᵀ)B = [0, 2]ᵀ, γ = 3:
    bound = 0.5/9·√5 + 2/3."""
    summary = LowRankSummary(_basis(2, 1), torch.tensor([3.0], dtype=F64), 4, TailEnergy(0.5, 0.7))
    b = torch.tensor([[1.0], [2.0]], dtype=F64)
    assert outside_subspace_norm(summary, b) == 2.0
    assert weight_error_bound(summary, b, 3.0) == pytest.approx(0.5 / 9 * math.sqrt(5) + 2 / 3, rel=1e-15)
    b32 = torch.tensor([[0.1], [0.2]], dtype=F32)
    b64 = b32.double()
    assert outside_subspace_norm(summary, b32) == float(b64[1, 0])
    want = 0.5 / 9 * float(b64.norm()) + float(b64[1, 0]) / 3
    assert weight_error_bound(summary, b32, 3.0) == pytest.approx(want, rel=1e-15)


def test_subspace_gcv_needs_samples() -> None:
    _raises(
        lambda: select_subspace_ridge_gcv(GOOD, B6, 0, 5.0), AnalyticInputError, "num_samples must be positive, got 0"
    )


def test_subspace_gcv_equals_dense_gcv_without_truncation() -> None:
    gen = seeded_generator(30)
    h = torch.randn(25, 6, generator=gen, dtype=F64)
    y = torch.nn.functional.one_hot(torch.randint(0, 3, (25,), generator=gen), 3).double()
    summary = client_summary(h, 6)  # full rank: span(U) is everything
    b = h.T @ y
    grid = [0.01, 0.3, 2.0, 40.0]
    got_gamma, got = select_subspace_ridge_gcv(summary, b, 25, 25.0, grid=grid)
    want_gamma, want = select_ridge_gcv(h.T @ h, b, 25, 25.0, grid=grid)
    assert got_gamma == want_gamma and [r.gamma for r in got] == grid
    for g_row, w_row in zip(got, want):
        assert g_row.rss == pytest.approx(w_row.rss, rel=1e-9)
        assert g_row.df == pytest.approx(w_row.df, rel=1e-12)
        assert g_row.gcv == pytest.approx(w_row.gcv, rel=1e-9)
    assert len(select_subspace_ridge_gcv(summary, b.float(), 25, 25.0)[1]) == 41  # default grid, float32 B
    assert select_subspace_ridge_gcv(summary, b.float(), 25, 25.0, grid=grid)[1][1].rss == pytest.approx(
        got[1].rss, rel=1e-6
    )


# =============================================================================== pseudo-labelling
def test_prototypes_by_hand_with_an_absent_class_and_a_zero_mean() -> None:
    z = torch.tensor([[0.3, 0.4], [0.3, 0.4], [1.0, 0.0], [-1.0, 0.0]], dtype=F32)
    labels = torch.tensor([0, 0, 2, 2], dtype=torch.uint8)
    prototypes, present = class_prototypes(z, labels, 4)
    assert prototypes.dtype == F64 and present.tolist() == [True, False, True, False]
    torch.testing.assert_close(prototypes[0], torch.tensor([0.6, 0.8], dtype=F64))  # small norm: still unit
    assert prototypes[1].tolist() == [0.0, 0.0]  # a class with no samples
    assert prototypes[2].tolist() == [0.0, 0.0]  # a zero mean stays zero, never NaN
    assert prototypes[3].tolist() == [0.0, 0.0]
    one_class, present = class_prototypes(z[:2], labels[:2], 1)  # C = 1
    assert present.tolist() == [True] and one_class.shape == (1, 2)


def test_prototypes_are_float64_means_of_float32_features() -> None:
    gen = seeded_generator(40)
    z = torch.randn(50, 3, generator=gen) * 7 + 0.1  # float32: summing them in float32 would round
    labels = torch.randint(0, 3, (50,), generator=gen)
    prototypes, _ = class_prototypes(z, labels, 3)
    for c in range(3):
        mean = z[labels == c].double().mean(dim=0)
        torch.testing.assert_close(prototypes[c], mean / mean.norm(), rtol=1e-14, atol=1e-15)


def test_pseudo_label_defaults_devices_and_zero_accepted() -> None:
    prototypes = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F32)
    present = torch.tensor([True, True])
    u = torch.tensor([[4.0, 3.0], [1.0, 1.0], [3.0, 4.0]], dtype=F32)  # cosines .8/.6, .707, .6/.8
    labels, accepted = pseudo_label(u, prototypes, present)  # default τ = 0.5
    assert labels.tolist() == [0, 0, 1] and accepted.tolist() == [True, True, True]
    assert labels.dtype == torch.int64 and accepted.dtype == torch.bool
    labels, accepted = pseudo_label(u, prototypes, present, 0.75)
    assert labels.tolist() == [0, -1, 1]
    labels, accepted = pseudo_label(u, prototypes, present, 0.9)  # zero pseudo-labels accepted
    assert labels.tolist() == [-1, -1, -1] and not bool(accepted.any())
    masks, no_rows = (present, torch.tensor([False, False])), u[:0]
    with torch.device("meta"):  # outputs stay with the inputs
        for mask in masks:
            labels, accepted = pseudo_label(u, prototypes, mask)
            assert labels.device.type == "cpu" and accepted.device.type == "cpu"
        labels, accepted = pseudo_label(no_rows, prototypes, present)
        assert labels.device.type == "cpu" and labels.shape == (0,)


def test_pseudo_label_client_threshold_dtypes_and_no_unlabelled() -> None:
    z_lab = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F32)
    y_lab = torch.tensor([0, 1], dtype=torch.int32)
    u = torch.tensor([[4.0, 3.0], [1.0, 1.0]], dtype=F64)
    out = pseudo_label_client(z_lab, y_lab, u, 2)  # default τ = 0.5: both accepted
    assert out.num_accepted == 2 and out.labels.tolist() == [0, 1, 0, 0]
    assert out.features.dtype == F32 and out.labels.dtype == torch.int64
    strict = pseudo_label_client(z_lab, y_lab, u, 2, threshold=0.75)
    assert strict.num_accepted == 1 and strict.predicted.tolist() == [0, -1]
    torch.testing.assert_close(strict.features, torch.tensor([[1.0, 0.0], [0.0, 1.0], [4.0, 3.0]]))
    alone = pseudo_label_client(z_lab, y_lab, None, 2, threshold=-1.0)  # nothing unlabelled, any τ
    assert alone.num_accepted == 0 and alone.accepted.shape == (0,) and alone.predicted.shape == (0,)
    assert torch.equal(alone.features, z_lab) and alone.labels.tolist() == [0, 1]


def test_select_labelled_rounds_half_up_and_stays_on_the_generator_device() -> None:
    assert int(select_labelled(3, 0.5, seeded_generator(0)).sum()) == 2  # 1.5 → 2
    assert int(select_labelled(5, 0.5, seeded_generator(0)).sum()) == 3  # 2.5 → 3
    assert int(select_labelled(4, 0.1, seeded_generator(0)).sum()) == 0  # 0.4 → 0
    with torch.device("meta"):
        for ratio in (0.5, 1.0):
            mask = select_labelled(6, ratio, seeded_generator(1))
            assert mask.device.type == "cpu" and int(mask.sum()) == round(6 * ratio)


def test_pseudo_label_report_by_hand() -> None:
    accepted = torch.tensor([True, True, False, True])
    predicted = torch.tensor([1, 2, -1, 0])
    truth = torch.tensor([1, 0, 2, 0])
    report = pseudo_label_report(accepted, predicted, truth)
    assert report == {"total": 4, "accepted": 3, "correct": 2, "acceptance_rate": 0.75, "precision": 2 / 3}
    none = pseudo_label_report(
        torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    )
    assert none == {"total": 0, "accepted": 0, "correct": 0, "acceptance_rate": 0.0, "precision": 0.0}
    rejected = pseudo_label_report(torch.zeros(2, dtype=torch.bool), torch.tensor([-1, -1]), torch.tensor([0, 1]))
    assert rejected["acceptance_rate"] == 0.0 and rejected["precision"] == 0.0
