"""STSA, STSA-E and the joint upper bound: FedAvg on task 1, then one statistics round per stage.

Server state is G_{1:t} (M × M) and C_{1:t} (M × all classes) in float64 plus a sample count:
nothing per client, nothing that grows with the number of clients. After each stage the ridge
classifier W_t = (G_{1:t} + γI)⁻¹ C_{1:t} is re-solved for every seen class (spec §2.5–2.7).

Missing clients and backfill: a client whose statistics of task s did not arrive (node down,
timed out, upload rejected) is recorded in ``missing`` and asked for them in every later
statistics round (round-config key ``backfill``, see clients/analytic.py). Late statistics are
checked against task s's shapes and added to G and to task s's columns of C, so once every
late upload is in, W equals the fault-free run's. Stage extras record who still owes which
stage (``statistics_missing``) and whose late statistics arrived (``backfilled``); ``missing``
is part of the checkpoint. FedRAN (strategies/fedran.py) does not backfill: its rank-truncated
QR-SVD merge depends on the order in which summaries arrive, so a late summary could not
reproduce the fault-free sketch; it only records the missing clients (results ``left_out``).
"""

from __future__ import annotations

from logging import INFO
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import RecordDict
from flwr.common.logger import log

from clients.analytic import BACKFILL_KEY, BACKFILL_PREFIX, WITHHELD_METRIC, backfill_task_of, encode_backfill
from fcl_flower.analytic import (
    StatisticsAccumulator,
    estimate_gram,
    packed_length,
    predict,
    random_features,
    random_projection,
    select_ridge_gcv,
    solve_ridge,
    unpack_upper,
)
from fcl_flower.analytic.estimator import GramEstimator
from fcl_flower.privacy.secagg import unmask_sum
from fcl_flower.runtime import iter_features
from fcl_flower.wire import UploadError, read_ring, read_tensor
from strategies.base import Reply, RoundPlan
from strategies.gradient import FedAvgStrategy
from strategies.secure import SecureRounds


def withheld_samples(content: RecordDict) -> int:
    """Samples a client kept out of its upload under ``min-class-count`` (metric, default 0)."""
    count = content.metric_records["metrics"].get(WITHHELD_METRIC, 0)
    if not isinstance(count, int) or count < 0:
        raise UploadError(f"metric '{WITHHELD_METRIC}' is {count!r}, expected a non-negative int")
    return count


class AnalyticStrategy(SecureRounds, FedAvgStrategy):
    """STSA: sum exact client statistics, solve the joint ridge in closed form.

    With ``secure-aggregation`` the uploads are pairwise-masked ring elements (strategies/
    secure.py): the server reads only their sum over the round's participants, which is all
    Eq. 2 needs; with ``min-class-count`` the clients leave out classes they hold too few
    samples of (fcl_flower/privacy/disclosure.py) and say how many samples they withheld.
    """

    name: ClassVar[str] = "stsa"
    stats_phase: ClassVar[str] = "stsa-stats"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        feature_dim = self.model.backbone.feature_dim
        self.projection = random_projection(feature_dim, self.cfg.rf_dim, seed=self.cfg.seed)
        self.rf_dim = feature_dim if self.projection is None else self.projection.shape[1]
        self.gram, self.class_sums = self.init_statistics()
        self.num_samples = 0
        self.weights: torch.Tensor | None = None
        self.missing: dict[str, list[int]] = {}  # client -> tasks whose statistics are not in G, C
        self._backfilled: dict[str, list[int]] = {}  # late statistics that arrived in this stage
        self._withheld: dict[str, int] = {}  # samples each client kept back under min-class-count

    def init_statistics(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Empty G_{1:0} (M × M) and C_{1:0} (M × all classes); methods without a dense Gram
        (FedRAN) return None and never allocate the M × M matrix."""
        total_classes = self.split.bundle.num_classes
        return (torch.zeros(self.rf_dim, self.rf_dim, dtype=torch.float64),
                torch.zeros(self.rf_dim, total_classes, dtype=torch.float64))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "gram": self.gram, "class_sums": self.class_sums,
                "num_samples": self.num_samples, "weights": self.weights,
                "missing": {c: list(tasks) for c, tasks in self.missing.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.gram, self.class_sums = state["gram"], state["class_sums"]
        self.num_samples, self.weights = state["num_samples"], state["weights"]
        self.missing = {c: list(tasks) for c, tasks in state.get("missing", {}).items()}
        self.model.eval()

    # ---------------------------------------------------------------- schedule
    def plan_stage(self, task: int) -> list[RoundPlan]:
        stage1 = self.train_plans(task, "fedavg", self.cfg.stage1_rounds) if task == 0 else []
        return stage1 + [RoundPlan(task, self.stats_phase)]

    def round_config(self, plan: RoundPlan) -> dict[str, Any]:
        """Stats rounds also ask the clients that owe earlier statistics for them."""
        config = super().round_config(plan)
        if plan.phase == self.stats_phase and self.missing:
            config[BACKFILL_KEY] = encode_backfill(
                {int(c.rsplit("-", 1)[1]): tasks for c, tasks in self.missing.items()})
        return config

    # ---------------------------------------------------------------- replies
    def parse_reply(self, plan: RoundPlan, content: RecordDict) -> Any:
        if plan.phase == "fedavg":
            return super().parse_reply(plan, content)
        if "arrays" not in content.array_records:
            raise UploadError("reply has no 'arrays' record")
        payload = self.parse_stats(plan, content.array_records["arrays"])
        payload["backfill"] = self.parse_backfill(content)
        payload["withheld"] = withheld_samples(content)
        return payload

    def parse_backfill(self, content: RecordDict) -> dict[int, tuple[dict[str, torch.Tensor], int]]:
        """Late statistics {task: (payload, n)}, checked like on-time ones against that task's shapes.

        Only tasks this client owes are accepted: anything else would count its data twice, so
        the whole reply is rejected (its on-time statistics included).
        """
        metrics = content.metric_records["metrics"]  # present: base._identify checked it
        client = f"client-{metrics['partition-id']}"
        owed = self.missing.get(client, [])
        # Masked sums cancel only if every participant sends every record: under secure
        # aggregation each one answers for every owed stage, with zeros for stages it does not owe.
        asked = sorted({t for ts in self.missing.values() for t in ts}) if self.secure_payloads() else owed
        late = {}
        for name, record in content.array_records.items():
            if not name.startswith(BACKFILL_PREFIX):
                continue
            task = backfill_task_of(name)
            if task is None or task not in asked:
                raise UploadError(f"record '{name}' was not asked for ({client} owes stages {[t + 1 for t in owed]})")
            count = metrics.get(f"{name}-num-examples")
            if not isinstance(count, int) or count < 0:
                raise UploadError(f"metric '{name}-num-examples' is {count!r}, expected a non-negative int")
            if task not in owed and count:
                raise UploadError(f"record '{name}' carries {count} samples of a stage {client} does not owe")
            try:
                late[task] = (self.parse_stats(RoundPlan(task, self.stats_phase), record), count)
            except UploadError as err:
                raise UploadError(f"record '{name}': {err}") from None
        if self.secure_payloads() and sorted(late) != asked:
            raise UploadError(f"secure round: backfill records for stages {[t + 1 for t in sorted(late)]}, "
                              f"expected {[t + 1 for t in asked]}")
        return late

    def secure_payloads(self) -> bool:
        """Whether the replies being read are masked (the round in progress is a secure one)."""
        return self._secagg_step is not None and self._secagg_step[0] == "stats"

    def parse_stats(self, plan: RoundPlan, record: Any) -> dict[str, torch.Tensor]:
        classes = len(self.split.tasks[plan.task])
        if self.secure_payloads():  # ring elements: only their sum over the participants is readable
            return {"gram-packed": read_ring(record, "gram-packed", shape=(packed_length(self.rf_dim),)),
                    "class-sums": read_ring(record, "class-sums", shape=(self.rf_dim, classes))}
        return {  # G stays packed at wire precision until summed: 1/4 (float32) of a dense float64 G per reply
            "gram-packed": read_tensor(record, "gram-packed", shape=(packed_length(self.rf_dim),), floating=True),
            "class-sums": read_tensor(record, "class-sums", shape=(self.rf_dim, classes), floating=True)
            .to(torch.float64),
        }

    def aggregate_round(self, plan: RoundPlan, replies: list[Reply]) -> None:
        if plan.phase == "fedavg":
            super().aggregate_round(plan, replies)
            return
        if self.secure_payloads():
            self.require_participants(replies)
        self.note_withheld(replies)
        self.add_stage_statistics(plan.task, *self.stage_statistics(plan, replies))
        self.add_backfill(replies)
        self.note_missing(plan.task, replies)

    def note_withheld(self, replies: list[Reply]) -> None:
        for reply in replies:
            if reply.payload.get("withheld", 0):
                self._withheld[reply.client] = self._withheld.get(reply.client, 0) + reply.payload["withheld"]

    def pop_withheld(self) -> dict[str, Any]:
        """Stage extra: samples each client withheld under min-class-count (never silent)."""
        withheld, self._withheld = self._withheld, {}
        return {"withheld_samples": dict(sorted(withheld.items()))} if withheld else {}

    def require_participants(self, replies: list[Reply]) -> None:
        """A masked sum opens only with every participant's upload: anything else is garbage."""
        _, peers, _ = self._secagg_step
        if len(replies) != len(peers):
            raise RuntimeError(f"secure round: {len(replies)} accepted uploads for {len(peers)} participants")

    def sum_over_clients(self, replies: list[Reply], key: str) -> torch.Tensor:
        """Σ_k of one statistic in float64: plain, or by opening the masked sum."""
        if self.secure_payloads():
            return torch.from_numpy(unmask_sum((r.payload[key] for r in replies), self.cfg.secagg_fraction_bits))
        total = torch.zeros_like(replies[0].payload[key], dtype=torch.float64)
        for r in replies:
            total += r.payload[key]  # summed in float64
        return total

    def note_missing(self, task: int, replies: list[Reply]) -> None:
        """Every client without an accepted upload in this stats round owes task ``task``."""
        answered = {r.client for r in replies}
        absent = [f"client-{i}" for i in range(self.cfg.num_clients) if f"client-{i}" not in answered]
        for client in absent:
            self.missing.setdefault(client, []).append(task)
        if absent:
            self.hold_stage(task, replies)

    def add_backfill(self, replies: list[Reply]) -> None:
        """Fold the late statistics carried by this round's replies in, and strike them off."""
        late: dict[int, list[Reply]] = {}
        for reply in replies:
            for task, (payload, count) in reply.payload["backfill"].items():
                late.setdefault(task, []).append(Reply(reply.client, count, payload))
        for task, task_replies in sorted(late.items()):
            self.add_late_statistics(task, task_replies)
            for reply in task_replies:
                if task not in self.missing.get(reply.client, []):
                    continue  # a secure round's zero record from a client that did not owe it
                self.missing[reply.client].remove(task)
                if not self.missing[reply.client]:
                    del self.missing[reply.client]
                self._backfilled.setdefault(reply.client, []).append(task)
                log(INFO, "%s backfilled its statistics of stage %d", reply.client, task + 1)
            if not any(task in owed for owed in self.missing.values()):
                self.release_stage(task)

    def add_late_statistics(self, task: int, replies: list[Reply]) -> None:
        """STSA statistics are sums over clients (Eq. 2), so late ones simply add."""
        self.add_stage_statistics(task, *self.stage_statistics(RoundPlan(task, self.stats_phase), replies))

    def hold_stage(self, task: int, replies: list[Reply]) -> None:
        """Keep what a later backfill of ``task`` needs besides G and C (STSA: nothing)."""

    def release_stage(self, task: int) -> None:
        """Every client's statistics of ``task`` are in: drop what :meth:`hold_stage` kept."""

    def stage_statistics(self, plan: RoundPlan, replies: list[Reply]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Spatial aggregation (Eq. 2): sums over the clients of this stage."""
        gram = unpack_upper(self.sum_over_clients(replies, "gram-packed"), self.rf_dim)
        return gram, self.sum_over_clients(replies, "class-sums"), sum(r.num_examples for r in replies)

    def add_stage_statistics(self, task: int, gram: torch.Tensor, class_sums: torch.Tensor, n: int) -> None:
        """Temporal aggregation (Eq. 4): G grows by G_t, the task's class columns receive C_t."""
        classes = self.split.tasks[task]
        self.gram += gram
        self.class_sums[:, classes.start:classes.stop] += class_sums
        self.num_samples += n

    # ---------------------------------------------------------------- solve + evaluate
    def end_stage(self, task: int) -> dict[str, Any]:
        self.model.eval()  # frozen from here on: no later round trains it (keys stay the same
        # on both sides, so the broadcast state still matches the clients' models)
        seen = self.num_seen(task)
        sums = self.class_sums[:, :seen]
        extra: dict[str, Any] = {"num_samples": self.num_samples}
        gamma = self.cfg.ridge_value()
        if gamma is None:
            gamma, table = select_ridge_gcv(self.gram, sums, self.num_samples, float(self.num_samples))
            extra["gcv"] = {"grid_min": table[0].gamma, "grid_max": table[-1].gamma}
        extra["ridge"] = gamma
        self.weights = solve_ridge(self.gram, sums, gamma)
        if self.cfg.secure_aggregation:
            extra["secure_aggregation"] = True
        extra.update(self.pop_withheld())
        if self._backfilled:
            extra["backfilled"] = {c: [t + 1 for t in sorted(ts)] for c, ts in sorted(self._backfilled.items())}
            self._backfilled = {}
        if self.missing:
            extra["statistics_missing"] = {c: [t + 1 for t in ts] for c, ts in sorted(self.missing.items())}
        return extra

    def test_features(self, task: int) -> tuple[torch.Tensor, torch.Tensor]:
        phis, labels = [], []
        for features, y in iter_features(self.model, self.split.seen_test(task), self.cfg, self.device):
            phis.append(random_features(features, self.projection))
            labels.append(y)
        return torch.cat(phis), torch.cat(labels)

    def predict_seen(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        assert self.weights is not None, "end_stage solves before evaluation"
        phi, labels = self.test_features(task)
        return predict(phi, self.weights, self.cfg.head).numpy(), labels.numpy()


class STSAEStrategy(AnalyticStrategy):
    """STSA-E: clients upload class sums and counts only; the server estimates G (Eq. 9).

    Eq. 9 is not a sum over clients (its coefficients depend on the totals of every upload of
    the stage), so a stage with missing clients keeps its uploads (class sums and counts) until
    the last late client is in, and then swaps the stage's Ĝ for the estimate from all of them.
    """

    name = "stsa-e"
    stats_phase = "stsa-e-stats"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # task -> (sums, counts) so far

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "held": dict(self.held)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.held = dict(state.get("held", {}))

    def hold_stage(self, task: int, replies: list[Reply]) -> None:
        self.held[task] = (torch.cat([r.payload["class-sums"] for r in replies]),
                           torch.cat([r.payload["counts"] for r in replies]))

    def release_stage(self, task: int) -> None:
        self.held.pop(task, None)

    def add_late_statistics(self, task: int, replies: list[Reply]) -> None:
        """Swap the stage's Ĝ for the estimate from all its uploads; sums and counts just add."""
        old_sums, old_counts = self.held[task]
        late_sums = torch.cat([r.payload["class-sums"] for r in replies])
        late_counts = torch.cat([r.payload["counts"] for r in replies])
        sums, counts = torch.cat([old_sums, late_sums]), torch.cat([old_counts, late_counts])
        k_mode = self.cfg.k_mode
        delta = estimate_gram(sums, counts, k_mode=k_mode) - estimate_gram(old_sums, old_counts, k_mode=k_mode)
        self.add_stage_statistics(task, delta, late_sums.sum(dim=0), int(late_counts.sum()))
        self.held[task] = (sums, counts)

    def parse_stats(self, plan: RoundPlan, record: Any) -> dict[str, torch.Tensor]:
        classes = len(self.split.tasks[plan.task])
        dummies = self.cfg.dummy_clients
        counts = read_tensor(record, "counts", shape=(dummies, classes), nonnegative=True).to(torch.float64)
        if not torch.equal(counts, counts.round()):
            raise UploadError("array 'counts' has non-integer entries")
        return {
            "class-sums": read_tensor(record, "class-sums", shape=(dummies, self.rf_dim, classes),
                                      floating=True).to(torch.float64),
            "counts": counts,
        }

    def validate_reply(self, plan: RoundPlan, reply: Reply) -> None:
        if plan.phase == "fedavg":
            return
        if int(reply.payload["counts"].sum()) != reply.num_examples:
            raise UploadError("counts do not add up to num-examples")
        for task, (payload, count) in reply.payload["backfill"].items():
            if int(payload["counts"].sum()) != count:
                raise UploadError(f"backfilled counts of stage {task + 1} do not add up to their num-examples")

    def stage_statistics(self, plan: RoundPlan, replies: list[Reply]) -> tuple[torch.Tensor, torch.Tensor, int]:
        # Streaming Eq. 9: no (K·K_D, M, c_t) stack of all uploads on the server.
        estimator = GramEstimator(self.rf_dim, len(self.split.tasks[plan.task]), k_mode=self.cfg.k_mode)
        for r in replies:
            estimator.add(r.payload["class-sums"], r.payload["counts"])
        return estimator.result(), estimator.class_sums, int(estimator.counts.sum())


class JointStrategy(AnalyticStrategy):
    """Upper bound: the same backbone and features, but ridge on all seen data pooled centrally."""

    name = "joint"

    def plan_stage(self, task: int) -> list[RoundPlan]:
        return self.train_plans(task, "fedavg", self.cfg.stage1_rounds) if task == 0 else []

    def end_stage(self, task: int) -> dict[str, Any]:
        self.model.eval()
        classes = self.split.tasks[task]
        accumulator = StatisticsAccumulator(self.rf_dim, len(classes), with_gram=True)
        pooled = self.split.task_train(task, eval_transform=True)
        for features, y in iter_features(self.model, pooled, self.cfg, self.device):
            accumulator.update(random_features(features, self.projection), y - classes.start)
        stats = accumulator.result()
        self.add_stage_statistics(task, stats.gram, stats.class_sums, stats.num_samples)
        return {**super().end_stage(task), "pooled": True}
