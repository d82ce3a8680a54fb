"""The ridge solve and GCV without M × M temporaries give the very same numbers as the plain formulas,
and the memory benchmark's client process changes nothing in a run (issue 16, item 2)."""

from __future__ import annotations

import pytest
import torch

from fcl_flower.analytic import NotPositiveDefiniteError
from fcl_flower.analytic.packing import add_packed_, pack_upper
from fcl_flower.analytic.ridge import (
    default_ridge_grid,
    gcv_from_spectrum,
    select_ridge_gcv,
    solve_ridge,
    solve_ridge_psd,
    symmetric_eigh,
    symmetric_part,
)


def _server_gram(dim: int, samples: int, seed: int = 0) -> torch.Tensor:
    """G as the server holds it: packed uploads added into a zero matrix (both triangles)."""
    gen = torch.Generator().manual_seed(seed)
    gram = torch.zeros(dim, dim, dtype=torch.float64)
    for _ in range(3):
        phi = torch.relu(torch.randn(samples, dim, generator=gen, dtype=torch.float64))
        full = phi.T @ phi
        add_packed_(gram, pack_upper(0.5 * (full + full.T)))
    return gram


def test_symmetric_part_is_the_matrix_itself_when_exactly_symmetric() -> None:
    gram = _server_gram(70, 30)
    assert torch.equal(gram, gram.T)
    same = symmetric_part(gram, tile=16)
    assert same is gram
    assert torch.equal(same, 0.5 * (gram + gram.T))


def test_symmetric_part_averages_an_asymmetric_matrix() -> None:
    gram = _server_gram(70, 30)
    gram[3, 65] += 1e-9  # one entry off, in the last tile column
    got = symmetric_part(gram, tile=16)
    assert got is not gram
    assert torch.equal(got, 0.5 * (gram + gram.T))
    nan = _server_gram(20, 5)
    nan[0, 0] = float("nan")
    assert torch.isnan(symmetric_part(nan)[0, 0])


@pytest.mark.parametrize("ridge", [1e-3, 1.0, 250.0])
def test_solve_ridge_equals_the_plain_formula_bit_for_bit(ridge: float) -> None:
    gram = _server_gram(90, 40, seed=1)
    sums = torch.randn(90, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    # the upper factor U (LAPACK's column-major potrf), stored as L = Uᵀ row by row, as solve_ridge's buffer
    factor = torch.linalg.cholesky(gram + ridge * torch.eye(90, dtype=torch.float64), upper=True).T.contiguous()
    plain = torch.linalg.solve_triangular(
        factor.T, torch.linalg.solve_triangular(factor, sums, upper=False), upper=True
    )
    got = solve_ridge(gram, sums, ridge)
    assert torch.equal(got, plain)  # the in-place (row-major) factor, two triangular solves: the plain formula's bits
    reference = torch.cholesky_solve(sums, factor)  # LAPACK's potrs: the same solves, another rounding order
    assert float((got - reference).abs().max()) <= 1e-12 * float(reference.abs().max())
    assert torch.equal(gram, _server_gram(90, 40, seed=1))  # the input is left alone
    assert torch.allclose((gram + ridge * torch.eye(90, dtype=torch.float64)) @ got, sums, atol=1e-8)


def test_solve_ridge_float32_input_and_failure_reason() -> None:
    gram = _server_gram(40, 60, seed=3)
    sums = torch.ones(40, 2, dtype=torch.float64)
    assert torch.equal(solve_ridge(gram.float(), sums, 1.0), solve_ridge(gram.float().double(), sums, 1.0))
    indefinite = -torch.eye(5, dtype=torch.float64)
    with pytest.raises(NotPositiveDefiniteError, match=r"G \+ 0\.5·I is not positive definite \(Cholesky failed"):
        solve_ridge(indefinite, torch.ones(5, 1, dtype=torch.float64), 0.5)


@pytest.mark.parametrize("symmetric", [True, False])
def test_symmetric_eigh_is_the_eigendecomposition_of_the_symmetric_part(symmetric: bool) -> None:
    """LAPACK's MRRR driver (one working copy, O(M) workspace): G's input untouched, eigenvalues
    ascending and equal to torch.linalg.eigh's, Q orthonormal, ½(G + Gᵀ) = Q diag(λ) Qᵀ."""
    gram = _server_gram(70, 30, seed=7)
    if not symmetric:
        gram[3, 5] += 1e-3
    before = gram.clone()
    eigvals, eigvecs = symmetric_eigh(gram)
    sym = 0.5 * (gram + gram.T)
    scale = float(sym.abs().max())
    assert torch.equal(gram, before)
    assert eigvals.dtype == eigvecs.dtype == torch.float64 and bool((eigvals[1:] >= eigvals[:-1]).all())
    assert torch.allclose(eigvals, torch.linalg.eigvalsh(sym), rtol=0, atol=1e-12 * scale)
    assert torch.allclose(eigvecs.T @ eigvecs, torch.eye(70, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(eigvecs @ torch.diag(eigvals) @ eigvecs.T, sym, rtol=0, atol=1e-11 * scale)
    empty = symmetric_eigh(torch.zeros(0, 0, dtype=torch.float64))
    assert empty[0].shape == (0,) and empty[1].shape == (0, 0)


def test_gcv_and_psd_solve_equal_the_symmetrised_formulas() -> None:
    gram = _server_gram(60, 20, seed=4)
    sums = torch.rand(60, 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    eigvals, eigvecs = symmetric_eigh(0.5 * (gram + gram.T))
    projected = eigvecs.T @ sums
    gamma, table = select_ridge_gcv(gram, sums, 60, 60.0)
    want_gamma, want_table = gcv_from_spectrum(
        eigvals.clamp_min(0.0), (projected * projected).sum(dim=1), 60, 60.0, default_ridge_grid()
    )
    assert gamma == want_gamma and table == want_table
    weights, ridge, _, projection = solve_ridge_psd(gram, sums, 60, 2.0)
    want = eigvecs @ (projected / (eigvals.clamp_min(0.0) + 2.0).unsqueeze(1))
    assert ridge == 2.0 and torch.equal(weights, want)
    assert projection.negative == int((eigvals < 0).sum())


def test_memory_benchmark_clients_in_a_child_process_change_nothing(tmp_path) -> None:
    """bench_paper_size's WorkerGrid: every message and reply crosses as protobuf bytes to a child
    process; the run's accuracies, ridge and byte counts equal those of the in-process grid."""
    from experiments.bench_paper_size import memory_config, worker_grid
    from experiments.sim import run_local
    from fcl_flower.data.synthetic import SyntheticSpec
    from strategies.app import run_experiment

    grid = worker_grid(3, SyntheticSpec().train_per_class)  # the dataset this test process uses
    remote = run_experiment(grid, memory_config(48, 3, str(tmp_path / "worker")))
    assert grid.client_peak_mib() > 0
    local = run_local(memory_config(48, 3, str(tmp_path / "local")))
    assert [len(s.clients) for s in remote.stages] == [3, 3]
    for a, b in zip(remote.stages, local.stages, strict=True):
        assert a.accuracy == b.accuracy and a.per_task_accuracy == b.per_task_accuracy
        assert a.extra["ridge"] == b.extra["ridge"]
        assert a.upload_bytes_per_client == b.upload_bytes_per_client
        assert a.upload_message_bytes_per_client == b.upload_message_bytes_per_client
