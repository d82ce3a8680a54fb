"""The small base of the analytic methods: FedAvg on task 1, a frozen backbone, random features,
a closed-form classifier solved after every stage.

Stage 1 runs ``stage1-rounds`` rounds of FedAvg (the :class:`~strategies.fedavg.FedAvg`
component); every stage then has one statistics round of ``stats_phase`` (none for ``joint``).
After the last round of a stage the backbone stays frozen and the method's :meth:`solve` gives
the ridge weights W, which classify the random features ``R(f) = ReLU(f · W_rand)`` of the
test images (head ``cosine`` or ``dot``). W_rand is regenerated from the run seed by the
server and every client: it never travels. Siblings: stsa, stsa-e, fedran, joint.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import torch

from fcl_flower.analytic import (
    AnalyticInputError,
    NotPositiveDefiniteError,
    random_projection,
)
from fcl_flower.analytic.checks import StatisticsRejected
from fcl_flower.analytic.ridge import GCVRow, RidgeState
from fcl_flower.config import RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.protocol import Reply, StatsRes, UploadError, to_record
from fcl_flower.results import ResultsRecorder
from fcl_flower.runtime import predict_ridge
from strategies.base import Accepted, RoundPlan, StagedStrategy, StageFailed
from strategies.fedavg import FedAvg

FEDAVG_PHASE = "fedavg"


class AnalyticStrategy(StagedStrategy):
    stats_phase: ClassVar[str | None] = None  # the statistics round of every stage (None: no round)

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        self.fedavg = FedAvg(self.model, cfg.weighted_fedavg)
        feature_dim = self.model.backbone.feature_dim
        self.projection = random_projection(feature_dim, cfg.rf_dim, seed=cfg.seed)
        self.rf_dim = feature_dim if self.projection is None else int(self.projection.shape[1])
        self.weights: torch.Tensor | None = None
        self._withheld: dict[str, int] = {}  # samples each client kept back under min-class-count

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
            return self.fedavg.read(reply)
        if not isinstance(reply, StatsRes):
            raise UploadError("expected a statistics reply")
        return self.read_stats(plan, f"client-{reply.client}", reply)

    def aggregate_round(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        if plan.phase == FEDAVG_PHASE:
            self.fedavg.aggregate([r.payload for r in replies], [r.num_examples for r in replies])
            return
        for r in replies:
            withheld = r.reply.withheld if isinstance(r.reply, StatsRes) else 0
            if withheld:
                self._withheld[r.client] = self._withheld.get(r.client, 0) + withheld
        self.aggregate_stats(plan, replies)

    # ---------------------------------------------------------------- solve + evaluate
    def end_stage(self, task: int) -> dict[str, Any]:
        self.model.eval()  # frozen from here on: no later round trains it (keys stay the same
        # on both sides, so the broadcast state still matches the clients' models)
        try:
            self.weights, extra = self.solve(task)
        except (AnalyticInputError, NotPositiveDefiniteError) as err:
            raise StageFailed(f"the ridge solve failed: {err}") from None
        return {**extra, **self.pop_withheld()}

    def pop_withheld(self) -> dict[str, Any]:
        """Samples withheld under min-class-count in this stage (never silent)."""
        withheld, self._withheld = self._withheld, {}
        return {"withheld_samples": dict(sorted(withheld.items()))} if withheld else {}

    def stage_failed(self, task: int, reason: str) -> dict[str, Any]:
        return {**super().stage_failed(task, reason), **self.pop_withheld()}

    def predict_seen(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        """Predictions of the current classifier on the test data of every seen class (central
        evaluation; fcl_flower.runtime.predict_ridge, as the clients under federated evaluation)."""
        preds, labels = predict_ridge(
            self.model, self.split.seen_test(task), self.cfg, self.device, self.weights, self.projection
        )
        return preds.numpy(), labels.numpy()

    def evaluate_arrays(self) -> dict[str, Any]:
        """What a client needs besides the backbone to score the model: the ridge weights W."""
        return {} if self.weights is None else {"ridge": to_record({"weights": self.weights})}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.weights = state["weights"]
        self.model.eval()


@contextmanager
def upload_checks() -> Iterator[None]:
    """Statistics that no dataset can produce reject the upload, with the check's one-line reason."""
    try:
        yield
    except StatisticsRejected as err:
        raise UploadError(str(err)) from None


def solve_dense(ridge: RidgeState, num_seen: int, cfg: RunConfig) -> tuple[torch.Tensor, dict[str, Any]]:
    """W from the summed statistics, γ fixed or by GCV (``ridge = auto``), and the result extras."""
    weights, gamma, table = ridge.solve(num_seen, cfg.ridge_value())
    return weights, ridge_extras(ridge.num_samples, gamma, table)


def ridge_extras(num_samples: int, gamma: float, table: list[GCVRow]) -> dict[str, Any]:
    """The solve's result extras: samples, the ridge γ, and the GCV grid when γ was selected."""
    extra: dict[str, Any] = {"num_samples": num_samples}
    if table:
        extra["gcv"] = {"grid_min": table[0].gamma, "grid_max": table[-1].gamma}
    extra["ridge"] = gamma
    return extra
