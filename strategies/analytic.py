"""The small base of the analytic methods: FedAvg on task 1, a frozen backbone, random features,
a closed-form classifier solved after every stage.

Stage 1 runs ``stage1-rounds`` rounds of FedAvg (the :class:`~strategies.fedavg.FedAvg`
component); every stage then has one statistics round of ``stats_phase`` (none for ``joint``).
After the last round of a stage the backbone stays frozen and the method's :meth:`solve` gives
the ridge weights W, which classify the random features ``R(f) = ReLU(f · W_rand)`` of the
test images (head ``cosine`` or ``dot``). W_rand is regenerated from the run seed by the
server and every client: it never travels. Siblings: stsa, stsa-e, fedran, joint.

Noise on the uploads (``noise-q``/``noise-s``, or ``dp-epsilon``; fcl_flower/privacy/noise.py): the
server knows the std of every client's noise from the run config (:attr:`noise`), widens the
upload checks by its high-probability bounds (fcl_flower/analytic/checks.py), solves the ridge on
the PSD projection of the noisy G, and, under differential privacy, keeps a
:class:`~fcl_flower.privacy.accountant.PrivacyLedger` of every release of a client's data it
has seen: each plain upload (and each backfilled task in it) it parsed, accepted or not, and
each opened secure sum. Every stage records ``extra.privacy`` (ε of the stage and ε spent so
far, for the worst client) or ``extra.noise`` (the paper's q, s).
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from logging import WARNING
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.common.logger import log

from fcl_flower import restore as fields
from fcl_flower.analytic import (
    AnalyticInputError,
    NotPositiveDefiniteError,
    random_projection,
)
from fcl_flower.analytic.checks import NoiseLevels, StatisticsRejected, check_packed_statistics, gram_check_epsilon
from fcl_flower.analytic.packing import pack_upper
from fcl_flower.analytic.ridge import GCVRow, RidgeState
from fcl_flower.config import RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.privacy.accountant import PrivacyLedger
from fcl_flower.privacy.noise import effective_multiplier, noise_multiplier, upload_scale
from fcl_flower.protocol import Reply, StatsRes, UploadError
from fcl_flower.restore import RestoreError
from fcl_flower.results import ResultsRecorder
from fcl_flower.runtime import predict_ridge
from fcl_flower.tensors import WIRE_DTYPES, tensor_record
from strategies.base import Accepted, RoundFold, RoundPlan, StagedStrategy, StageFailed
from strategies.fedavg import Aggregation, FedAvg

FEDAVG_PHASE = "fedavg"


class AnalyticStrategy(StagedStrategy):
    stats_phase: ClassVar[str | None] = None  # the statistics round of every stage (None: no round)

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        self.fedavg = FedAvg(self.model, cfg.weighted_fedavg, Aggregation.from_config(cfg))
        feature_dim = self.model.backbone.feature_dim
        self.projection = random_projection(feature_dim, cfg.rf_dim, seed=cfg.seed)
        self.rf_dim = feature_dim if self.projection is None else int(self.projection.shape[1])
        self.weights: torch.Tensor | None = None
        self._withheld: dict[str, int] = {}  # samples each client kept back under min-class-count
        self.noise = upload_scale(cfg)  # std of one client's noise per block (None: no noise)
        self.ledger = PrivacyLedger(cfg.dp_delta, cfg.dp_accountant) if cfg.dp else None
        # noise variance per entry of each class column of the summed class sums (GCV debiases by it)
        self.sums_noise = torch.zeros(split.num_classes, dtype=torch.float64)

    # ---------------------------------------------------------------- noise on the uploads
    def noise_levels(self, factor: float = 1.0) -> NoiseLevels | None:
        """The noise std the upload checks allow for: one client's, times ``factor`` (a sum)."""
        if self.noise is None:
            return None
        scale = self.noise.scaled(factor)
        return NoiseLevels(scale.gram, scale.sums, scale.counts)

    @property
    def counts_noised(self) -> bool:
        """Uploads carry noisy counts (and report 0 samples): the server counts from them."""
        return self.noise is not None and self.noise.counts > 0

    def record_release(self, clients: Iterable[str], task: int, factor: float = 1.0) -> None:
        """Record a release of these clients' data of ``task`` in the privacy ledger.

        ``factor``: the release's noise std relative to one client's full noise, divided by how
        many records of one person it may hold (e.g. √|U3|·share / k for an opened secure sum
        that carries k tasks of a survivor's data)."""
        if self.ledger is None or self.noise is None:
            return
        z = effective_multiplier(self.noise.scaled(factor), self.cfg.feature_clip, self.method.upload_noise)
        self.ledger.record(clients, task, z)

    def privacy_extras(self, task: int) -> dict[str, Any]:
        """``extra.privacy`` (differential privacy) or ``extra.noise`` (the paper's noise) of a stage."""
        cfg = self.cfg
        if self.noise is None:
            return {}
        if self.ledger is None:
            return {"noise": {"q": cfg.noise_q, "s": cfg.noise_s, "on": cfg.noise_on, "std": self.noise.as_dict()}}
        worst, spent = self.ledger.worst()
        stage = self.ledger.worst(task)[1]
        releases = self.ledger.counts(task)
        target = cfg.dp_epsilon * (cfg.num_tasks if cfg.dp_scope == "stage" else 1)
        if spent > target * (1 + 1e-6):
            log(
                WARNING,
                "[stage %d] %s's data was released more often than the (epsilon, delta) target plans for "
                "(retries, backfill, a failed secure stage): epsilon spent %.3f",
                task + 1,
                worst,
                spent,
            )
        record: dict[str, Any] = {
            "epsilon_stage": stage,
            "epsilon_spent": spent,
            "worst_client": worst,
            "epsilon_target": cfg.dp_epsilon,
            "delta": cfg.dp_delta,
            "scope": cfg.dp_scope,
            "accountant": cfg.dp_accountant,
            "noise_multiplier": noise_multiplier(cfg),
            "feature_clip": cfg.feature_clip,
            "std": self.noise.as_dict(),
            "releases": releases,
        }
        if cfg.stage1_rounds > 0:
            record["not_covered"] = (
                "stage-1 FedAvg model updates (stage1-rounds > 0) carry no noise (under secure aggregation "
                "only their average over each round's survivors is opened)"
                if cfg.secure_aggregation
                else "stage-1 FedAvg model updates (stage1-rounds > 0) travel without noise"
            )
        return {"privacy": record}

    def note_sums_noise(self, classes: range, uploads: float) -> None:
        """``uploads`` client noises (in units of one client's full noise variance) went into these
        class columns of the summed class sums."""
        if self.noise is not None:
            self.sums_noise[classes.start : classes.stop] += uploads * self.noise.sums**2

    def solve_noisy(self, ridge: RidgeState, task: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """The ridge on noisy statistics: G projected onto the PSD cone, γ fixed or by GCV from the
        noisy statistics, debiased for the known noise in C (fcl_flower/analytic/ridge.py)."""
        seen = self.num_seen(task)
        noise = float(self.sums_noise[:seen].sum())
        weights, gamma, table, projection = ridge.solve_projected(seen, self.cfg.ridge_value(), noise)
        extra = ridge_extras(ridge.num_samples, gamma, table)
        extra["psd_projection"] = projection.as_dict()
        return weights, extra

    def masked(self) -> bool:
        """Whether the replies being read are masked (only STSA's secure rounds are)."""
        return False

    @property
    def feature_bounds(self) -> dict[str, Any]:
        """What the checks of :mod:`fcl_flower.analytic.checks` may assume of every feature vector:
        its norm bound (``feature-clip``, 0 = none) and its sign (random ReLU features are >= 0)."""
        return {"norm_bound": self.cfg.feature_clip, "nonnegative": self.projection is not None}

    # ---------------------------------------------------------------- what a sibling says
    @abstractmethod
    def read_stats(self, plan: RoundPlan, client: str, reply: StatsRes) -> Any:
        """Read and check one statistics reply against the server state."""

    @abstractmethod
    def aggregate_stats(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        """Fold one statistics round into the server state."""

    @abstractmethod
    def solve(self, task: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """(W over the seen classes, result extras) from the statistics so far."""

    # ---------------------------------------------------------------- schedule and replies
    def plan_stage(self, task: int) -> list[RoundPlan]:
        stage1 = self.train_plans(task, FEDAVG_PHASE, self.cfg.stage1_rounds) if task == 0 else []
        stats = [self.round_plan(task, self.stats_phase)] if self.stats_phase else []
        return stage1 + stats

    def read_reply(self, plan: RoundPlan, reply: Reply) -> Any:
        if plan.phase == FEDAVG_PHASE:
            return self.read_train(reply)
        if not isinstance(reply, StatsRes):
            raise UploadError("expected a statistics reply")
        if not self.masked():  # the server has seen this client's noisy statistics, whatever comes next
            for task in (plan.task, *reply.backfill):
                self.record_release([f"client-{reply.client}"], task)
        return self.read_stats(plan, f"client-{reply.client}", reply)

    def read_train(self, reply: Reply) -> Any:
        """One stage-1 FedAvg reply (a method under secure aggregation reads it masked)."""
        return self.fedavg.read(reply)

    def train_fold(self, plan: RoundPlan) -> RoundFold | None:
        """A fold for a stage-1 FedAvg round (None: the clear states are averaged together)."""
        return None

    def stats_fold(self, plan: RoundPlan) -> RoundFold | None:
        """A method whose statistics round can be folded reply by reply returns its fold here (then
        :meth:`aggregate_stats` is never called); None: the replies are aggregated together."""
        return None

    def round_fold(self, plan: RoundPlan) -> RoundFold | None:
        if plan.phase == FEDAVG_PHASE:
            return self.train_fold(plan)
        fold = self.stats_fold(plan)
        return None if fold is None else _CountWithheld(self, fold)

    def aggregate_round(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        fold = self.round_fold(plan)
        if plan.phase == FEDAVG_PHASE and fold is None:
            self.fedavg.aggregate([r.payload for r in replies], [r.num_examples for r in replies])
            return
        if fold is not None:  # the same fold as when the replies stream in
            for r in replies:
                fold.add(r)
            fold.finish()
            return
        for r in replies:
            self.note_withheld(r)
        self.aggregate_stats(plan, replies)

    def note_withheld(self, reply: Accepted[Any]) -> None:
        withheld = reply.reply.withheld if isinstance(reply.reply, StatsRes) else 0
        if withheld:
            self._withheld[reply.client] = self._withheld.get(reply.client, 0) + withheld

    # ---------------------------------------------------------------- solve + evaluate
    def end_stage(self, task: int) -> dict[str, Any]:
        self.model.eval()  # frozen from here on: no later round trains it (keys stay the same
        # on both sides, so the broadcast state still matches the clients' models)
        began = time.perf_counter()
        try:
            self.weights, extra = self.solve(task)
        except (AnalyticInputError, NotPositiveDefiniteError) as err:
            raise StageFailed(f"the ridge solve failed: {err}") from None
        # the ridge solve (and its selection), next to extra.server_reply_seconds (reading the replies)
        solve = {"solve_seconds": time.perf_counter() - began}
        return {**extra, **solve, **self.pop_withheld(), **self.privacy_extras(task)}

    def pop_withheld(self) -> dict[str, Any]:
        """Samples withheld under min-class-count in this stage (never silent)."""
        withheld, self._withheld = self._withheld, {}
        return {"withheld_samples": dict(sorted(withheld.items()))} if withheld else {}

    def stage_failed(self, task: int, reason: str) -> dict[str, Any]:
        return {**super().stage_failed(task, reason), **self.pop_withheld(), **self.privacy_extras(task)}

    def predict_seen(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        """Predictions of the current classifier on the test data of every seen class (central
        evaluation; fcl_flower.runtime.predict_ridge, as the clients under federated evaluation)."""
        preds, labels = predict_ridge(
            self.model, self.split.seen_test(task), self.cfg, self.device, self.weights, self.projection
        )
        return preds.numpy(), labels.numpy()

    def evaluation_rides(self, task: int) -> bool:
        """Stage ``task``'s federated evaluation rides with the next stage's statistics round
        (strategies/evaluation.py) where nothing changes the model in between: the backbone is
        frozen after stage 1, and W changes only at the next solve, unless a forget round runs
        between the stages; and where the statistics round goes to every node an ``evaluate``
        message would (no withdrawn site: it still scores). Under secure aggregation the counts
        ride in clear beside the masked statistics (as an ``evaluate`` reply carries them)."""
        cfg = self.cfg
        return (
            cfg.evaluation == "federated"
            and self.stats_phase is not None
            and task + 1 < self.num_tasks
            and task + 1 not in cfg.forget_requests()
            and not self.nodes.excluded(task + 1, self.stats_phase)
        )

    def rides_on(self, plan: RoundPlan) -> bool:
        return plan.phase == self.stats_phase

    def evaluate_arrays(self) -> dict[str, Any]:
        """What a client needs besides the backbone to score the model: the ridge weights W."""
        return {} if self.weights is None else {"ridge": tensor_record({"weights": self.weights})}

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "weights": self.weights}
        if self.ledger is not None:
            state["privacy_ledger"] = self.ledger.state_dict()
        if self.noise is not None:
            state["sums_noise"] = self.sums_noise
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        weights = fields.entry(state, "weights", "state")
        if weights is not None:
            weights = fields.tensor(weights, "state/weights", (self.rf_dim, None), dtype=None)
        self.weights = weights
        if self.ledger is not None:
            ledger = fields.mapping(state.get("privacy_ledger", {}), "state/privacy_ledger")
            for client, items in ledger.items():
                where = f"state/privacy_ledger/{client}"
                if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 2 for i in items):
                    raise RestoreError(where, "must be a list of [stage, noise multiplier] pairs")
                for k, (stage, z) in enumerate(items):
                    fields.integer(stage, f"{where}/{k}/0", 0, self.num_tasks - 1)
                    if isinstance(z, bool) or not isinstance(z, (int, float)) or not z >= 0:  # inf: no noise
                        raise RestoreError(f"{where}/{k}/1", f"must be a noise multiplier >= 0, not {fields.kind(z)}")
            self.ledger.load_state_dict(dict(ledger))
        if self.noise is not None and "sums_noise" in state:
            noise = fields.tensor(state["sums_noise"], "state/sums_noise", (self.split.num_classes,))
            if bool((noise < 0).any()):
                raise RestoreError("state/sums_noise", "holds a negative variance")
            self.sums_noise = noise
        self.model.eval()

    def check_restored(self, completed: int) -> None:
        super().check_restored(completed)
        if self.weights is not None:
            widths = {self.num_seen(t) for t in range(completed)}
            if int(self.weights.shape[1]) not in widths:
                raise RestoreError(
                    "state/weights",
                    f"has {int(self.weights.shape[1])} class columns; after {completed} stages: one of {sorted(widths)}",
                )

    def restore_ridge(self, state: dict[str, Any]) -> RidgeState:
        """The ridge state of a checkpoint, every field checked (RidgeState.from_state) and of this
        configuration's shape (M × M, M × all classes)."""
        try:
            ridge = RidgeState.from_state(fields.entry(state, "ridge", "state"), "state/ridge")
        except AnalyticInputError as err:
            raise RestoreError.worded(str(err)) from None
        want = (self.rf_dim, self.split.num_classes)
        if tuple(ridge.class_sums.shape) != want:
            raise RestoreError(
                "state/ridge/class_sums", f"has shape {tuple(ridge.class_sums.shape)}, the configuration gives {want}"
            )
        return ridge

    def check_restored_ridge(
        self, ridge: RidgeState, completed: int, *, sum_of_checked_uploads: bool, subtracted: bool = False
    ) -> None:
        """A restored ridge state checked as strictly as a fresh upload: nothing in the columns of
        classes not yet seen, no statistics without samples, and, where G is a sum of checked
        uploads (STSA without noise), [[G, C·1], [(C·1)ᵀ, n]] positive semidefinite within the
        checks' tolerance (fcl_flower/analytic/checks.py; the tolerance of any upload's, and of an
        opened secure sum's fixed point over every stage, so an honest state always passes) and
        the certified bound on λ_min(G) verified by a factorisation (:meth:`RidgeState.verify_bound`),
        never taken from the file. Under noise the solve projects G onto the PSD cone and uses no bound.
        ``subtracted``: uploads were taken out again (docs/unlearning.md), so an entry that is a
        rounding of zero may be either sign: the checks allow an absolute rounding of the tolerance
        times G's largest diagonal entry (as :func:`~fcl_flower.analytic.unlearning.check_removal`)."""
        seen = self.num_seen(completed - 1)
        if bool(ridge.class_sums[:, seen:].any()):
            raise RestoreError(
                "state/ridge/class_sums", f"has statistics of classes not yet seen (beyond the first {seen})"
            )
        if ridge.num_samples == 0 and (bool(ridge.gram.any()) or bool(ridge.class_sums.any())):
            raise RestoreError("state/ridge/num_samples", "is 0, yet G or the class sums are not")
        if self.noise is not None:
            ridge.negative_bound = math.inf
            return
        if sum_of_checked_uploads:
            if not torch.equal(ridge.gram, ridge.gram.T):  # sums of packed uploads are exactly symmetric
                raise RestoreError("state/ridge/gram", "is not symmetric")
            cfg, dim = self.cfg, self.rf_dim
            widen = 2.0 * (dim + self.split.num_classes) / (dim + 1)
            wire = gram_check_epsilon(WIRE_DTYPES[cfg.wire_dtype], cfg.check_tolerance)
            absolute = cfg.num_clients * cfg.num_tasks * 2.0 ** -(cfg.secagg_fraction_bits + 1)
            absolute = absolute if cfg.secure_aggregation else 0.0
            if subtracted and ridge.gram.numel():
                absolute += max(wire, 2.0**-40) * float(torch.diagonal(ridge.gram).abs().max())
            try:
                check_packed_statistics(
                    pack_upper(ridge.gram),
                    ridge.class_sums.sum(dim=1, keepdim=True),
                    torch.tensor([float(ridge.num_samples)], dtype=torch.float64),
                    relative_tolerance=widen * max(wire, 2.0**-40),
                    absolute_tolerance=widen * absolute,
                    **self.feature_bounds,
                )
            except StatisticsRejected as err:
                raise RestoreError("state/ridge", f"fails the upload checks: {err}") from None
        if not ridge.verify_bound():
            beta = ridge.negative_bound
            raise RestoreError(
                "state/ridge/negative_bound",
                f"is {beta:g}, but G + {beta:g}·I has no Cholesky factor: λ_min(G) >= -{beta:g} does not hold",
            )


class _CountWithheld:
    """A method's statistics fold, plus the samples each reply says it withheld."""

    def __init__(self, strategy: AnalyticStrategy, fold: RoundFold) -> None:
        self.strategy, self.fold = strategy, fold

    def add(self, item: Accepted[Any]) -> None:
        self.strategy.note_withheld(item)
        self.fold.add(item)

    def finish(self) -> None:
        self.fold.finish()


@contextmanager
def upload_checks() -> Iterator[None]:
    """Statistics that no dataset can produce reject the upload, with the check's one-line reason."""
    try:
        yield
    except StatisticsRejected as err:
        raise UploadError(str(err)) from None


def solve_dense(ridge: RidgeState, num_seen: int, cfg: RunConfig) -> tuple[torch.Tensor, dict[str, Any]]:
    """W from the summed statistics, γ fixed or by GCV (``ridge = auto``), and the result extras."""
    weights, gamma, table = ridge.solve(num_seen, cfg.ridge_value(), cfg.ridge_selection)
    extra = ridge_extras(ridge.num_samples, gamma, table)
    selection = dict(ridge.selection)
    if "certificate_seconds" in selection:  # a wall time, beside solve_seconds (part of it)
        extra["certificate_seconds"] = selection.pop("certificate_seconds")
    projection = selection.pop("psd_projection", None)
    if isinstance(projection, dict):  # a fixed γ without its certificate: solved on the PSD projection of G
        extra["psd_projection"] = projection
        log(
            WARNING,
            "the ridge solve: %s (%s negative eigenvalues)",
            projection["reason"],
            projection["negative_eigenvalues"],
        )
    if selection:  # how γ was chosen (GCV) or certified (a fixed γ)
        extra.setdefault("gcv" if "gcv" in extra else "ridge_solve", {}).update(selection)
    return weights, extra


def noisy_total(counts: Iterable[torch.Tensor]) -> int:
    """Samples in uploads whose counts are noisy: round(max(Σ counts, 0)) (post-processing)."""
    return rounded_count(sum((float(c.to(torch.float64).sum()) for c in counts), 0.0))


def rounded_count(total: float) -> int:
    """:func:`noisy_total` of a running sum of noisy counts (a streamed round adds them as they come)."""
    return max(round(total), 0) if math.isfinite(total) else 0


def ridge_extras(num_samples: int, gamma: float, table: list[GCVRow]) -> dict[str, Any]:
    """The solve's result extras: samples, the ridge γ, and the GCV grid when γ was selected."""
    extra: dict[str, Any] = {"num_samples": num_samples}
    if table:
        extra["gcv"] = {"grid_min": table[0].gamma, "grid_max": table[-1].gamma}
    extra["ridge"] = gamma
    return extra
