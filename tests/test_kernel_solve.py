"""The ridge solve through stacked factor uploads (fcl_flower/analytic/kernel.py): the N × N kernel
form equals the M × M Gram solve, the stack equals the stacked rows, and a whole factor run solves
through it while every upload so far is a factor, and from G after anything else."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fcl_flower.analytic.errors import AnalyticInputError
from fcl_flower.analytic.factor import rotated_factor
from fcl_flower.analytic.kernel import FactorStack, kernel_ridge
from fcl_flower.analytic.ridge import RidgeState, solve_ridge
from tests.conftest import build, run_in_process, small_config

F64 = torch.float64


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(("rows", "dim", "ridge"), [(20, 60, 1.0), (60, 20, 0.5), (30, 30, 1e-3), (5, 80, 1e4)])
def test_kernel_ridge_equals_the_gram_solve(rows: int, dim: int, ridge: float) -> None:
    gen = torch.Generator().manual_seed(rows * dim)
    phi = torch.randn(rows, dim, generator=gen, dtype=F64)
    labels = torch.randn(rows, 4, generator=gen, dtype=F64)
    weights = kernel_ridge(phi, labels, ridge)
    assert weights is not None
    assert relative(weights, solve_ridge(phi.T @ phi, phi.T @ labels, ridge)) <= 1e-10


@pytest.mark.parametrize(
    ("phi", "labels", "ridge", "reason"),
    [
        (torch.zeros(3, 4, dtype=F64), torch.zeros(3, 2, dtype=F64), 0.0, "positive ridge"),
        (torch.zeros(3, 4, dtype=F64), torch.zeros(3, 2, dtype=F64), float("nan"), "positive ridge"),
        (torch.zeros(3, 4, dtype=F64), torch.zeros(2, 2, dtype=F64), 1.0, "N x c"),
        (torch.zeros(3, dtype=F64), torch.zeros(3, 2, dtype=F64), 1.0, "N x M"),
    ],
)
def test_kernel_ridge_refuses_bad_input(phi, labels, ridge, reason: str) -> None:
    with pytest.raises(AnalyticInputError, match=reason):
        kernel_ridge(phi, labels, ridge)


def test_kernel_ridge_uses_the_kernel_it_is_given() -> None:
    """With K given, W = Φᵀ(K + γI)⁻¹Y for that K (the stack passes its cached one); float32
    labels are solved in Φ's float64."""
    gen = torch.Generator().manual_seed(5)
    phi = torch.randn(6, 9, generator=gen, dtype=F64)
    labels = torch.randn(6, 2, generator=gen, dtype=F64)
    other = 2.0 * (phi @ phi.T)  # not Φ Φᵀ: the result must follow it
    weights = kernel_ridge(phi, labels.float(), 0.5, other)
    assert weights is not None and weights.dtype == F64
    direct = phi.T @ torch.linalg.solve(other + 0.5 * torch.eye(6, dtype=F64), labels.float().to(F64))
    assert relative(weights, direct) <= 1e-12
    with pytest.raises(AnalyticInputError, match="kernel must be 6 x 6"):
        kernel_ridge(phi, labels, 0.5, torch.zeros(6, 5, dtype=F64))
    indefinite = -torch.eye(6, dtype=F64)  # K + γI = −0.5 I has no Cholesky factor
    assert kernel_ridge(phi, labels, 0.5, indefinite) is None


def test_stack_solves_with_its_cached_kernel() -> None:
    stack = FactorStack.empty(9, 2, max_rows=9)
    gen = torch.Generator().manual_seed(6)
    stack.add(torch.randn(5, 11, generator=gen, dtype=F64), range(2))
    stack.kernel = stack.kernel * 3.0  # the solve reads the cached kernel, not Φ Φᵀ again
    weights = stack.solve(1, 1.0)
    assert weights is not None and weights.shape == (9, 1)
    assert relative(weights, kernel_ridge(stack.phi, stack.labels[:, :1], 1.0, stack.kernel)) <= 1e-14
    assert relative(weights, kernel_ridge(stack.phi, stack.labels[:, :1], 1.0)) > 1e-3


@pytest.mark.parametrize(
    ("dim", "classes", "cap", "ok"),
    [(1, 1, 0, True), (0, 1, 1, False), (1, 0, 1, False), (1, 1, -1, False), (-1, 1, 1, False)],
)
def test_empty_stack_shapes_and_bad_sizes(dim: int, classes: int, cap: int, ok: bool) -> None:
    if not ok:
        with pytest.raises(AnalyticInputError, match=f"must be > 0 and max_rows >= 0, got {dim}, {classes}, {cap}"):
            FactorStack.empty(dim, classes, cap)
        return
    stack = FactorStack.empty(dim, classes, cap)
    assert stack.rows == 0 and not stack.fits(1) and stack.fits(0)
    assert tuple(stack.phi.shape) == (0, dim) and tuple(stack.labels.shape) == (0, classes)
    assert tuple(stack.kernel.shape) == (0, 0)
    assert {stack.phi.dtype, stack.labels.dtype, stack.kernel.dtype} == {F64}


def uploads(dim: int = 70, classes_per_task: int = 3, tasks: int = 3, clients: int = 2):
    """Honest factor uploads (ReLU features, one-hot labels) of ``clients`` per task."""
    gen = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(1)
    out = []
    for task in range(tasks):
        classes = range(task * classes_per_task, (task + 1) * classes_per_task)
        for k in range(clients):
            n = 6 + 3 * k + task
            phi = torch.relu(torch.randn(n, dim, generator=gen, dtype=F64))
            labels = torch.randint(0, classes_per_task, (n,), generator=gen)
            out.append((classes, phi, labels, rotated_factor(phi, labels, classes_per_task, rng)))
    return out


def test_stack_holds_the_stacked_rows_and_solves_like_the_summed_statistics() -> None:
    dim, per, tasks = 70, 3, 3
    stack = FactorStack.empty(dim, per * tasks, max_rows=dim)
    state = RidgeState.empty(dim, per * tasks)
    for classes, phi, labels, factor in uploads(dim, per, tasks):
        stack.add(factor, classes)
        y = torch.nn.functional.one_hot(labels, per).to(F64)
        state.add(classes, phi.T @ phi, phi.T @ y, len(labels))
        seen = classes.stop
        # the kernel is the stacked rows' inner products, the labels sit at the global columns
        assert torch.allclose(
            stack.kernel, stack.phi @ stack.phi.T, rtol=0, atol=1e-12 * float(stack.kernel.abs().max())
        )
        assert torch.allclose(stack.phi.T @ stack.phi, state.gram, rtol=0, atol=1e-11 * float(state.gram.abs().max()))
        assert torch.allclose(stack.phi.T @ stack.labels, state.class_sums, rtol=0, atol=1e-11)
        assert not bool(stack.labels[:, seen:].any())
        weights = stack.solve(seen, 2.0)
        assert weights is not None and weights.shape == (dim, seen)
        assert relative(weights, state.solve(seen, 2.0)[0]) <= 1e-10


def test_stack_keeps_its_row_cap_and_refuses_bad_uploads() -> None:
    stack = FactorStack.empty(10, 4, max_rows=8)
    good = torch.zeros(5, 12, dtype=F64)
    stack.add(good, range(2))
    assert stack.rows == 5 and stack.fits(3) and not stack.fits(4)
    with pytest.raises(AnalyticInputError, match=r"^5 more rows pass the stack's cap of 8$"):
        stack.add(good, range(2, 4))
    with pytest.raises(AnalyticInputError, match="rows x 12"):
        stack.add(torch.zeros(2, 13, dtype=F64), range(2))
    with pytest.raises(AnalyticInputError, match=r"^classes range\(3, 5\) do not lie in 0\.\.3$"):
        stack.add(torch.zeros(2, 12, dtype=F64), range(3, 5))
    with pytest.raises(AnalyticInputError, match="do not lie"):
        stack.add(torch.zeros(2, 12, dtype=F64), range(0, 4, 2))  # not a contiguous block of columns
    for seen in (0, 5):
        with pytest.raises(AnalyticInputError, match=f"num_seen must lie in 1..4, got {seen}"):
            stack.solve(seen, 1.0)
    one = stack.solve(1, 1.0)
    assert one is not None and one.shape == (10, 1)
    assert stack.rows == 5  # a refused upload leaves the stack as it was


def test_stack_copies_the_upload() -> None:
    """The stack keeps its own float64 copy: the reply's buffer may be reused after the read."""
    stack = FactorStack.empty(3, 1, max_rows=4)
    factor = torch.ones(2, 4, dtype=F64)
    stack.add(factor, range(1))
    factor.fill_(7.0)
    assert float(stack.phi.max()) == 1.0 and float(stack.kernel.max()) == 3.0
    stack.add(torch.ones(1, 4, dtype=torch.float32), range(1))  # a float32 wire factor: float64 rows
    assert stack.phi.dtype == F64 and stack.rows == 3


# --------------------------------------------------------------------------- whole runs
def test_factor_run_solves_through_the_kernel_and_equals_the_gram_run(out_dir: Path) -> None:
    """M = 3000, 2 tasks: the stacked rows (about 1350) stay under M/2, every stage solves N × N, same W."""
    cfg = small_config(out_dir, rf_dim=3000, num_tasks=2, run_name="gram")
    gram = run_in_process(cfg)
    factor = run_in_process(cfg.replace(stats_form="factor", run_name="factor"))
    rows = [stage.extra.get("kernel_rows") for stage in factor.recorder.stages]
    assert all(isinstance(r, int) for r in rows) and rows == sorted(rows) and rows[-1] == factor.ridge.num_samples
    assert all("kernel_rows" not in stage.extra for stage in gram.recorder.stages)
    for w_gram, w_factor in zip(gram.stage_weights, factor.stage_weights, strict=True):
        assert relative(w_factor, w_gram) <= 1e-10
    assert [s.accuracy for s in factor.recorder.stages] == [s.accuracy for s in gram.recorder.stages]
    # a resumed run has G from its checkpoint, not the factors: it solves from G
    resumed = build(cfg.replace(stats_form="factor", run_name="resumed"))
    assert resumed.stack is not None and resumed.stack.rows == 0
    resumed.load_state_dict(factor.state_dict())
    assert resumed.stack is None and resumed.kernel_solve(1) is None


def test_factor_run_past_the_row_cap_solves_from_g(out_dir: Path) -> None:
    """M = 400: the rows pass M/2 in the first stage, the stack is dropped, G solves (same W)."""
    cfg = small_config(out_dir, rf_dim=400, num_tasks=2, run_name="gram")
    gram = run_in_process(cfg)
    factor = run_in_process(cfg.replace(stats_form="factor", run_name="factor"))
    assert factor.stack is None
    assert all("kernel_rows" not in stage.extra for stage in factor.recorder.stages)
    for w_gram, w_factor in zip(gram.stage_weights, factor.stage_weights, strict=True):
        assert relative(w_factor, w_gram) <= 1e-10


def test_gcv_factor_run_solves_from_g(out_dir: Path) -> None:
    """ridge auto selects γ from G's spectrum: no kernel solve (the stack holds stage 1's rows,
    under M/2), the Gram run's γ and W."""
    cfg = small_config(out_dir, rf_dim=700, num_tasks=5, ridge="auto", run_name="gram")
    gram = run_in_process(cfg)
    factor = run_in_process(cfg.replace(stats_form="factor", run_name="factor"))
    for a, b in zip(gram.recorder.stages, factor.recorder.stages, strict=True):
        assert "kernel_rows" not in b.extra and "gcv" in b.extra and a.extra["ridge"] == b.extra["ridge"]
    for w_gram, w_factor in zip(gram.stage_weights, factor.stage_weights, strict=True):
        assert relative(w_factor, w_gram) <= 1e-9
