"""FedRAN as a Flower strategy + client handler, checked against direct computations.

The strategies run their real Flower hooks (configure_train → ClientApp → aggregate_train) over
fcl_flower.local_grid.LocalGrid, which hands each message to the real ClientApp, so no Ray:
digits, a seeded small CNN with no stage-1 training, random features M = 96 (< d = 128).
References are computed here from the raw backbone features: the centralised ridge
(G* + γI)⁻¹ B* by torch.linalg.solve, explicit prototype loops, the docs/methods/fedran.md §3.1 byte formula.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from clients.app import app as client_app
from clients.fedran import fedran_client_update, labelled_mask, random_feature_statistics
from fcl_flower import methods
from fcl_flower.analytic import random_projection, select_ridge_gcv
from fcl_flower.analytic.subspace import select_subspace_ridge_gcv
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.local_grid import LocalGrid
from fcl_flower.models import trainable_state
from fcl_flower.protocol import FedranReport, Header, StatsRes, UploadError
from fcl_flower.results import ResultsRecorder
from fcl_flower.runtime import federated_split, iter_features
from fcl_flower.tensors import tensor_record
from strategies import strategy_class
from strategies.analytic import AnalyticStrategy
from strategies.fedran import FedRANStrategy

F64 = torch.float64
RF_DIM = 96  # M: below the CNN's d = 128, so the random projection is used
GAMMA = 1.0
NUM_TASKS, NUM_CLIENTS = 5, 3


# ----------------------------------------------------------------------------- harness


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Two OpenMP threads on a busy 2-core machine are 10x slower than one for these tiny nets."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def recording(cls):
    """The strategy class, keeping a copy of W after every stage's solve."""

    class Recording(cls):
        def end_stage(self, task):
            extra = super().end_stage(task)
            self.__dict__.setdefault("history", []).append(self.weights.clone())
            return extra

    return Recording


def base_config(tmp: Path, **changes) -> RunConfig:
    cfg = RunConfig(
        num_tasks=NUM_TASKS,
        num_clients=NUM_CLIENTS,
        stage1_rounds=0,
        rf_dim=RF_DIM,
        rank=RF_DIM,
        ridge=str(GAMMA),
        wire_dtype="float64",
        batch_size=256,
        device="cpu",
        out=str(tmp),
    )
    return cfg.replace(**changes)


def run_inprocess(cfg: RunConfig):
    cls = recording(strategy_class(cfg.strategy))
    split = federated_split(cfg)
    recorder = ResultsRecorder(cfg.output_dir, cfg.strategy, cfg.to_mapping())
    strategy = cls(cfg, split, recorder)
    strategy.start(LocalGrid(client_app, cfg.num_clients))
    return strategy, recorder


def backbone_features(strategy, dataset) -> tuple[torch.Tensor, torch.Tensor]:
    zs, ys = zip(*iter_features(strategy.model, dataset, strategy.cfg, torch.device("cpu")))
    return torch.cat(zs), torch.cat(ys)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Untruncated FedRAN (r = M ≥ min(n, M) everywhere) and STSA on the same split, γ fixed."""
    tmp = tmp_path_factory.mktemp("fedran")
    fedran = run_inprocess(base_config(tmp, strategy="fedran"))
    stsa = run_inprocess(base_config(tmp, strategy="stsa"))
    return {"fedran": fedran, "stsa": stsa, "tmp": tmp}


def expected_pseudo_labels(z_lab, y_lab, z_unl, tau):
    """Prototype pseudo-labels by explicit loops (docs/methods/fedran.md §2.5): (accepted mask, labels)."""
    classes = sorted(set(y_lab.tolist()))
    protos = {c: z_lab[y_lab == c].mean(dim=0) for c in classes}
    protos = {c: p / p.norm() for c, p in protos.items()}
    accepted, labels = [], []
    for u in z_unl:
        scores = {c: float(u @ p / u.norm()) for c, p in protos.items()}
        best = max(classes, key=lambda c: (scores[c], -c)) if classes else None
        assert best is None or abs(scores[best] - tau) > 1e-9, "a cosine sits on tau: pick another tau"
        ok = best is not None and scores[best] >= tau
        accepted.append(ok)
        labels.append(best if ok else -1)
    return torch.tensor(accepted, dtype=torch.bool), torch.tensor(labels, dtype=torch.int64)


# ----------------------------------------------------------------------------- exactness


def test_untruncated_fedran_equals_stsa_and_centralised_ridge(runs):
    fedran, rec_f = runs["fedran"]
    stsa, rec_s = runs["stsa"]
    split = fedran.split
    projection = random_projection(fedran.model.backbone.feature_dim, RF_DIM, seed=fedran.cfg.seed)
    pooled_z, pooled_y = [], []
    for task in range(NUM_TASKS):
        z, y = backbone_features(fedran, split.task_train(task, eval_transform=True))
        pooled_z.append(z)
        pooled_y.append(y)
        h = torch.relu(torch.cat(pooled_z).to(F64) @ projection)
        classes = int(split.tasks[task].stop)
        one_hot = torch.nn.functional.one_hot(torch.cat(pooled_y), classes).to(F64)
        central = torch.linalg.solve(h.T @ h + GAMMA * torch.eye(RF_DIM, dtype=F64), h.T @ one_hot)
        assert fedran.history[task].shape == (RF_DIM, classes)
        assert rel(fedran.history[task], central) <= 1e-8
        assert rel(stsa.history[task], central) <= 1e-8
        assert rel(fedran.history[task], stsa.history[task]) <= 1e-8
        stage = rec_f.stages[task]
        assert stage.extra["merge_discarded_energy"] == {"spectral": 0.0, "trace": 0.0}
        assert stage.extra["num_samples"] == sum(len(y) for y in pooled_y)
    assert [s.accuracy for s in rec_f.stages] == [s.accuracy for s in rec_s.stages]
    assert [s.per_task_accuracy for s in rec_f.stages] == [s.per_task_accuracy for s in rec_s.stages]


def test_subspace_gcv_picks_the_dense_gcv_ridge_without_truncation(runs):
    fedran, _ = runs["fedran"]
    summary, corr, n = fedran.summary_state, fedran.label_corr, fedran.num_samples
    dense_gram = summary.gram()  # == G* here (previous test); only the solve differs
    gamma_dense, table_dense = select_ridge_gcv(dense_gram, corr, n, float(n))
    gamma_sub, table_sub = select_subspace_ridge_gcv(summary, corr, n, float(n))
    assert gamma_sub == gamma_dense
    for a, b in zip(table_sub, table_dense):
        assert a.rss == pytest.approx(b.rss, rel=1e-6, abs=1e-6 * n)
        assert a.df == pytest.approx(b.df, rel=1e-9)


def test_measured_upload_bytes_equal_the_spec_formula(runs):
    fedran, recorder = runs["fedran"]
    split = fedran.split
    for task, stage in enumerate(recorder.stages):
        classes = int(split.tasks[task].stop)
        expected = {}
        for k in range(NUM_CLIENTS):
            r_k = min(RF_DIM, len(split.client_indices(task, k)), RF_DIM)
            expected[f"client-{k}"] = 8 * (RF_DIM * r_k + r_k + RF_DIM * classes)
        assert stage.upload_bytes_per_client == expected
        assert stage.extra["upload_formula_bytes_per_client"] == expected
    saved = json.loads(recorder.path.read_text())
    assert saved["stages"][-1]["extra"]["pseudo_labels"]["accepted"] == 0


def test_byte_budget_sets_the_rank_per_stage_in_float32(tmp_path):
    budget = 4 * (RF_DIM * 40 + 40 + RF_DIM * 10)  # float32 upload with r = 40 at C_t = 10
    cfg = base_config(tmp_path, strategy="fedran", wire_dtype="float32", rank_budget_bytes=budget)
    strategy, recorder = run_inprocess(cfg)
    ranks = []
    for task, stage in enumerate(recorder.stages):
        classes = int(strategy.split.tasks[task].stop)
        r_t = (budget // 4 - RF_DIM * classes) // (RF_DIM + 1)  # Eq. 12
        ranks.append(r_t)
        assert stage.extra["rank"]["upload"] == r_t
        for k in range(NUM_CLIENTS):
            r_k = min(r_t, len(strategy.split.client_indices(task, k)))
            sent = stage.upload_bytes_per_client[f"client-{k}"]
            assert sent == 4 * (RF_DIM * r_k + r_k + RF_DIM * classes) <= budget
    assert ranks[-1] == 40 and ranks == sorted(ranks, reverse=True) and ranks[0] > ranks[-1]
    assert recorder.stages[-1].extra["rank"]["server"] == ranks[0]  # the server keeps the largest
    assert recorder.stages[-1].extra["merge_discarded_energy"]["spectral"] > 0.0  # truncation did happen


def test_budget_too_small_for_b_is_a_config_error(tmp_path):
    cfg = base_config(tmp_path, strategy="fedran", rank_budget_bytes=8 * RF_DIM * 10)  # B alone at C_T
    with pytest.raises(ConfigError, match="rank-budget-bytes"):
        FedRANStrategy(cfg, federated_split(cfg), ResultsRecorder(tmp_path, "fedran", {}))


class CrashingGrid(LocalGrid):
    """The server process dies when it sends round ``crash_at`` (1-based)."""

    def __init__(self, num_clients: int, crash_at: int) -> None:
        super().__init__(client_app, num_clients)
        self.rounds, self.crash_at = 0, crash_at

    def push_messages(self, messages):  # each round pushes its messages once
        self.rounds += 1
        if self.rounds == self.crash_at:
            raise KeyboardInterrupt("server killed")
        return super().push_messages(messages)


def test_resume_after_a_crash_ends_with_the_uninterrupted_classifier(runs):
    fedran, _ = runs["fedran"]
    cfg = base_config(runs["tmp"], strategy="fedran", run_name="resume")
    split = federated_split(cfg)
    with pytest.raises(KeyboardInterrupt):
        FedRANStrategy(cfg, split, ResultsRecorder(cfg.output_dir, "fedran", {})).start(
            CrashingGrid(NUM_CLIENTS, 3)
        )  # send 3 is stage 3's round (the nodes' first contact rides with stage 1's)
    resumed = recording(FedRANStrategy)(cfg.replace(resume=True), split, ResultsRecorder(cfg.output_dir, "fedran", {}))
    resumed.start(LocalGrid(client_app, NUM_CLIENTS))
    assert len(resumed.history) == NUM_TASKS - 2 and len(resumed.recorder.stages) == NUM_TASKS
    assert torch.equal(resumed.history[-1], fedran.history[-1])
    assert resumed.summary_state.num_samples == fedran.summary_state.num_samples


# ----------------------------------------------------------------------------- pseudo-labels


def test_full_label_ratio_is_plain_fedran_whatever_the_threshold(runs):
    fedran, recorder = runs["fedran"]
    for stage in recorder.stages:
        pseudo = stage.extra["pseudo_labels"]
        assert pseudo["unlabelled"] == pseudo["accepted"] == pseudo["correct"] == 0
        assert pseudo["labelled"] == sum(
            len(fedran.split.client_indices(stage.stage - 1, k)) for k in range(NUM_CLIENTS)
        )
    other, _ = run_inprocess(
        base_config(runs["tmp"], strategy="fedran", label_ratio=1.0, pseudo_threshold=-1.0, run_name="rho1-tau-1")
    )
    for a, b in zip(other.history, fedran.history):
        assert torch.equal(a, b)
    # Client level: an all-labelled mask reproduces the statistics of the raw data exactly.
    gen = torch.Generator().manual_seed(3)
    z, y = torch.rand(40, 8, generator=gen, dtype=F64), torch.randint(0, 3, (40,), generator=gen)
    projection = random_projection(8, 12, seed=1)
    stats = fedran_client_update(
        z, y, torch.ones(40, dtype=torch.bool), projection, num_classes=3, rank=12, threshold=-1.0
    )
    summary, corr = random_feature_statistics(z, y, projection, 3, 12)
    assert torch.equal(stats.label_corr, corr) and torch.equal(stats.summary.basis, summary.basis)
    assert stats.pseudo["total"] == 0 and stats.num_samples == 40


def _client_case(strategy, ratio):
    """A (task, client) whose unlabelled data holds a class with no labelled sample."""
    split = strategy.split
    for task in range(NUM_TASKS):
        for k in range(NUM_CLIENTS):
            z, y = backbone_features(strategy, split.client_train(task, k, eval_transform=True))
            mask = labelled_mask(strategy.cfg.seed, task, k, len(y), ratio)
            if set(y[~mask].tolist()) - set(y[mask].tolist()) and mask.any():
                return task, z, y, mask
    raise AssertionError("no client with an unlabelled-only class; change the ratio")


def test_pseudo_labels_are_exactly_the_samples_above_tau_of_labelled_classes(runs):
    fedran, _ = runs["fedran"]
    ratio = 0.2
    task, z, y, mask = _client_case(fedran, ratio)
    assert int(mask.sum()) == math.floor(ratio * len(y) + 0.5)
    classes = int(fedran.split.tasks[task].stop)
    z_lab, y_lab, z_unl, y_unl = z[mask], y[mask], z[~mask], y[~mask]
    # τ between the two middle best-cosines, so samples fall on both sides of it.
    protos = torch.stack([z_lab[y_lab == c].mean(0) for c in sorted(set(y_lab.tolist()))])
    best = (torch.nn.functional.normalize(z_unl, dim=1) @ torch.nn.functional.normalize(protos, dim=1).T).max(1).values
    ordered = best.sort().values
    middle = len(ordered) // 2
    tau = float(0.5 * (ordered[middle - 1] + ordered[middle]))  # strictly between two samples
    accepted, labels = expected_pseudo_labels(z_lab, y_lab, z_unl, tau)
    assert 0 < int(accepted.sum()) < len(accepted)

    projection = random_projection(z.shape[1], RF_DIM, seed=fedran.cfg.seed)
    stats = fedran_client_update(z, y, mask, projection, num_classes=classes, rank=RF_DIM, threshold=tau)
    kept_z = torch.cat([z_lab, z_unl[accepted]])
    kept_y = torch.cat([y_lab, labels[accepted]])
    h = torch.relu(kept_z @ projection)
    assert stats.num_samples == len(kept_y)
    assert stats.pseudo["accepted"] == int(accepted.sum())
    assert stats.pseudo["correct"] == int((labels[accepted] == y_unl[accepted]).sum())
    torch.testing.assert_close(
        stats.label_corr, h.T @ torch.nn.functional.one_hot(kept_y, classes).to(F64), rtol=1e-12, atol=1e-9
    )
    assert rel(stats.summary.gram(), h.T @ h) <= 1e-10
    unlabelled_only = sorted(set(y_unl.tolist()) - set(y_lab.tolist()))
    assert stats.label_corr[:, unlabelled_only].abs().max() == 0  # no class without labels appears


def test_ssl_run_after_stage1_fedavg_reports_pseudo_label_counts_per_stage(tmp_path):
    """ρ = 0.2 on a backbone trained by one stage-1 FedAvg round, float32 uploads."""
    ratio, tau = 0.2, 0.99  # ReLU CNN features: every best cosine here is above 0.96
    strategy, recorder = run_inprocess(
        base_config(
            tmp_path, strategy="fedran", label_ratio=ratio, pseudo_threshold=tau, wire_dtype="float32", stage1_rounds=1
        )
    )
    model_bytes = sum(v.numel() * v.element_size() for v in trainable_state(strategy.model).values())
    assert recorder.stages[0].rounds == 2 and recorder.stages[1].rounds == 1
    total_kept = 0
    for task, stage in enumerate(recorder.stages):
        want = {"labelled": 0, "unlabelled": 0, "accepted": 0, "correct": 0}
        classes = int(strategy.split.tasks[task].stop)
        for k in range(NUM_CLIENTS):
            z, y = backbone_features(strategy, strategy.split.client_train(task, k, eval_transform=True))
            mask = labelled_mask(strategy.cfg.seed, task, k, len(y), ratio)
            accepted, labels = expected_pseudo_labels(z[mask], y[mask], z[~mask], tau)
            n_kept = int(mask.sum() + accepted.sum())
            want["labelled"] += int(mask.sum())
            want["unlabelled"] += int((~mask).sum())
            want["accepted"] += int(accepted.sum())
            want["correct"] += int((labels[accepted] == y[~mask][accepted]).sum())
            r_k = min(RF_DIM, n_kept)
            stats_bytes = 4 * (RF_DIM * r_k + r_k + RF_DIM * classes)
            assert stage.extra["upload_formula_bytes_per_client"][f"client-{k}"] == stats_bytes
            fedavg_bytes = model_bytes if task == 0 else 0  # the stage-1 round uploads the model
            assert stage.upload_bytes_per_client[f"client-{k}"] == stats_bytes + fedavg_bytes
            total_kept += n_kept
        assert stage.extra["pseudo_labels"] == want
        assert stage.extra["num_samples"] == total_kept
    assert any(s.extra["pseudo_labels"]["accepted"] for s in recorder.stages)
    assert any(s.extra["pseudo_labels"]["accepted"] < s.extra["pseudo_labels"]["unlabelled"] for s in recorder.stages)


# ----------------------------------------------------------------------------- untrusted uploads


def _reply(basis, sigma, corr, *, n, labelled=None, extra_arrays=None, accepted=0, unlabelled=0, correct=0):
    arrays = {"basis": basis, "singular-values": sigma, "label-corr": corr, **(extra_arrays or {})}
    report = FedranReport(n - accepted if labelled is None else labelled, unlabelled, accepted, correct)
    return StatsRes(Header("run", "fedran-stats", 0, 1, 1), 0, n, arrays=tensor_record(arrays), fedran=report)


@pytest.mark.parametrize(
    "case",
    [
        "ok",
        "float32-ok",
        "not-orthonormal",
        "rank-above-r",
        "rank-above-n",
        "wrong-b",
        "ascending",
        "negative-sigma",
        "nan",
        "extra-array",
        "counts",
    ],
)
def test_server_rejects_malformed_uploads(tmp_path, case):
    cfg = base_config(tmp_path, strategy="fedran", rank=4)
    strategy = FedRANStrategy(cfg, federated_split(cfg), ResultsRecorder(tmp_path, "fedran", {}))
    plan = strategy.round_plan(0, "fedran-stats")
    classes = int(strategy.split.tasks[0].stop)
    columns = 5 if case == "rank-above-r" else 4
    basis, _ = torch.linalg.qr(torch.randn(RF_DIM, columns, generator=torch.Generator().manual_seed(0), dtype=F64))
    sigma = torch.arange(columns, 0, -1, dtype=F64)
    corr = torch.ones(RF_DIM, classes, dtype=F64)
    kwargs = {"n": 20}
    if case == "float32-ok":
        basis, sigma, corr = basis.float(), sigma.float(), corr.float()
    elif case == "not-orthonormal":
        basis = basis * 1.01
    elif case == "rank-above-n":
        kwargs["n"] = 3
    elif case == "wrong-b":
        corr = torch.ones(RF_DIM, classes + 1, dtype=F64)
    elif case == "ascending":
        sigma = sigma.flip(0)
    elif case == "negative-sigma":
        sigma[-1] = -1.0
    elif case == "nan":
        corr[0, 0] = float("nan")
    elif case == "extra-array":
        kwargs["extra_arrays"] = {"gram": torch.zeros(3)}
    elif case == "counts":
        kwargs.update(labelled=10, accepted=3, unlabelled=2)  # 10 + 3 != 20 and accepted > unlabelled
    content = _reply(basis, sigma, corr, **kwargs)

    def parse_and_validate():
        return strategy.read_reply(plan, content)

    if case.endswith("ok"):
        assert parse_and_validate()["summary"].rank == 4
    else:
        with pytest.raises(UploadError):
            parse_and_validate()


def test_fedran_is_registered_and_reuses_the_analytic_strategy():
    assert strategy_class("fedran") is FedRANStrategy and issubclass(FedRANStrategy, AnalyticStrategy)
    phase = methods.get("fedran").phase("fedran-stats")
    assert FedRANStrategy.stats_phase == "fedran-stats"
    from clients.fedran import handle_stats

    assert methods.load(phase.handler) is handle_stats


def test_subspace_gcv_residual_and_df_match_the_truncated_sketch():
    """With truncation: RSS(γ) of the table = ‖Y − HW‖² computed on the sketch G̃, df = tr of its hat."""
    from fcl_flower.analytic import ridge_residual
    from fcl_flower.analytic.lowrank import client_summary
    from fcl_flower.analytic.subspace import solve_subspace_ridge

    gen = torch.Generator().manual_seed(5)
    y = torch.randint(0, 4, (60,), generator=gen)
    h = torch.relu(torch.randn(60, 30, generator=gen, dtype=F64) + y.unsqueeze(1).to(F64))
    summary = client_summary(h, 7)
    corr = h.T @ torch.nn.functional.one_hot(y, 4).to(F64)
    grid = [0.1, 3.0, 100.0]
    _, table = select_subspace_ridge_gcv(summary, corr, 60, 60.0, grid=grid)
    sketch = summary.gram()
    for row, gamma in zip(table, grid):
        weights = solve_subspace_ridge(summary, corr, gamma)
        assert row.rss == pytest.approx(max(ridge_residual(sketch, corr, weights, 60.0), 0.0), rel=1e-9)
        sigma2 = summary.singular_values.square()
        assert row.df == pytest.approx(float((sigma2 / (sigma2 + gamma)).sum()), rel=1e-12)
