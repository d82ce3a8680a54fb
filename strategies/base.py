"""The stage loop every FCIL strategy shares, built on Flower's strategy hooks.

A run is a sequence of stages, one per task. Each stage is a list of federated rounds
(:class:`RoundPlan`): ``train`` rounds (local SGD + FedAvg) and ``stats`` rounds (one-shot
statistics upload). Every round goes through Flower's ``configure_train`` /
``aggregate_train`` hooks -- the Message-API successors of the legacy ``fit`` /
``aggregate_fit`` -- so the same strategy runs under the Ray simulation engine and on real
SuperNodes. After the last round of a stage the strategy evaluates the global model on the
test data of every class seen so far and records the stage.

Subclasses say *what* happens (``plan_stage``, ``parse_reply``, ``aggregate_round``,
``predict_seen``); this class owns *how*: node selection, message construction, reply
validation, byte accounting, timing, results and checkpoints.
"""

from __future__ import annotations

import os
import tempfile
import time
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import FederatedSplit
from fcl_flower.data.paper_partitions import sample_clients
from fcl_flower.metrics import accuracy_by_task, task_pool_accuracy
from fcl_flower.models import trainable_state
from fcl_flower.results import ResultsRecorder, StageRecord, format_stage_table
from fcl_flower.runtime import build_model, resolve_device
from fcl_flower.wire import UploadError, message_bytes, payload_bytes, to_record

TRAIN_MESSAGE = "train"  # local SGD rounds -> @app.train()
STATS_MESSAGE = "query.stats"  # one-shot statistics -> @app.query("stats")
RECONNECT_GRACE_S = 30.0  # after the first round: how long to wait for a node that went away
INFO_MESSAGE = "query.info"  # which client a node serves -> @app.query("info")


@dataclass(frozen=True)
class RoundPlan:
    """One federated round of a stage."""

    task: int  # 0-based task index
    phase: str  # client handler to run (see clients.HANDLERS)
    index: int = 0  # round within the stage, 0-based
    total: int = 1  # rounds in the stage
    lr: float = 0.0  # learning rate for this round (train rounds)

    @property
    def message_type(self) -> str:
        return STATS_MESSAGE if self.phase.endswith("stats") else TRAIN_MESSAGE


@dataclass
class Reply:
    """A validated reply: which client, how many examples, and the method's parsed payload."""

    client: str
    num_examples: int
    payload: Any


class StagedStrategy(Strategy):
    """Base class: stage schedule + Flower hooks + evaluation + results."""

    name: ClassVar[str] = "base"

    def __init__(self, cfg: RunConfig, split: FederatedSplit, recorder: ResultsRecorder) -> None:
        self.cfg = cfg
        self.split = split
        self.recorder = recorder
        self.device = resolve_device(cfg)
        self.model = build_model(cfg, split)
        self.num_tasks = len(split.tasks)
        self.task_of_label = np.concatenate(
            [np.full(len(r), t, dtype=np.int64) for t, r in enumerate(split.tasks)]
        )
        self._plan: RoundPlan | None = None
        self._nodes_seen = False  # select_nodes has waited for the federation once
        self._node_partition: dict[int, int] = {}  # node id -> partition id, learnt from replies
        self._reset_stage_accounting()

    # ------------------------------------------------------------------ for subclasses
    def plan_stage(self, task: int) -> list[RoundPlan]:
        """The rounds of stage ``task``."""
        raise NotImplementedError

    def parse_reply(self, plan: RoundPlan, content: RecordDict) -> Any:
        """Read and validate one client's payload; raise UploadError to reject it."""
        raise NotImplementedError

    def validate_reply(self, plan: RoundPlan, reply: Reply) -> None:
        """Cross-checks between payload and metrics; raise UploadError to reject."""

    def aggregate_round(self, plan: RoundPlan, replies: list[Reply]) -> None:
        """Fold the accepted replies of one round into the server state."""
        raise NotImplementedError

    def end_stage(self, task: int) -> dict[str, Any]:
        """Work after the last round of a stage (e.g. a ridge solve); returns result extras."""
        return {}

    def predict_seen(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        """(predictions, labels) of the global model on the test data of all seen classes."""
        raise NotImplementedError

    def score_stage(self, task: int) -> tuple[float, list[float], dict[str, Any]]:
        """(stage accuracy, per-task accuracies, result extras) of the global model after ``task``.

        Shared task stream: accuracy over all seen test samples and per global task. STAMP's
        task pool (``partition = task-pool``): every client is scored on its own tasks' test
        classes; the stage accuracy is the mean over clients of their mean task accuracy and
        ``per_task[i]`` the mean over clients of their task-i accuracy; the per-client rows go
        to ``extra["per_client"]`` (results.json's A_avg/A_T/F_T are then means over clients).
        """
        preds, labels = self.predict_seen(task)
        if not self.split.is_task_pool:
            accuracy, per_task = accuracy_by_task(preds, labels, self.task_of_label, task + 1)
            return accuracy, per_task, {}
        rows = task_pool_accuracy(preds, labels, self.split.client_classes, task)
        per_client = {f"client-{u}": row.tolist() for u, row in enumerate(rows)}
        return float(rows.mean(axis=1).mean()), rows.mean(axis=0).tolist(), {"per_client": per_client}

    def round_config(self, plan: RoundPlan) -> dict[str, Any]:
        """Extra per-round settings for the clients (added to the run config)."""
        return {}

    def global_arrays(self) -> ArrayRecord:
        """What the clients receive: the trainable state of the global model."""
        return to_record(trainable_state(self.model))

    def extra_arrays(self, plan: RoundPlan) -> dict[str, ArrayRecord]:
        """More named ArrayRecords sent with this round next to "arrays" (e.g. a teacher model)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Everything the server needs to continue after a crash (extended by subclasses)."""
        return {"model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])

    # ------------------------------------------------------------------ helpers
    def num_seen(self, task: int) -> int:
        return int(self.split.tasks[task].stop)

    def train_plans(self, task: int, phase: str, rounds: int) -> list[RoundPlan]:
        """``rounds`` local-SGD rounds with the per-round cosine learning rate."""
        from fcl_flower.averaging import cosine_lr

        return [RoundPlan(task, phase, i, rounds, cosine_lr(self.cfg.lr, i, rounds)) for i in range(rounds)]

    # ------------------------------------------------------------------ Flower hooks
    def summary(self) -> None:
        cfg = self.cfg
        log(INFO, "\t├──> %s on %s: %d tasks, %d clients, beta=%s, seed=%d",
            self.name, cfg.dataset, self.num_tasks, cfg.num_clients, cfg.beta, cfg.seed)
        log(INFO, "\t└──> output: %s", self.recorder.path)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global arrays and the full run config + this round's settings to every client."""
        plan = self._require_plan()
        node_ids = self._round_nodes(grid, self.select_nodes(grid), plan, server_round)
        settings = {
            **self.cfg.to_mapping(),
            **dict(config),
            "phase": plan.phase,
            "task": plan.task,
            "round-lr": plan.lr,
            "num-seen-classes": self.num_seen(plan.task),
            "server-round": server_round,
            **self.round_config(plan),
        }
        extra = self.extra_arrays(plan)
        if {"arrays", "config"} & set(extra):
            raise ValueError("extra_arrays may not replace the 'arrays' or 'config' record")
        content = RecordDict({"arrays": arrays, "config": ConfigRecord(settings), **extra})
        return [Message(content=content, message_type=plan.message_type, dst_node_id=n) for n in node_ids]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate every reply, account its bytes, reject bad ones by name, aggregate the rest."""
        plan = self._require_plan()
        accepted: list[Reply] = []
        for message in replies:
            try:
                reply = self.check_reply(plan, message, {r.client for r in accepted})
            except UploadError as err:
                self.reject(message, err, server_round)
                continue
            client = reply.client
            self._upload[client] = self._upload.get(client, 0) + payload_bytes(message.content)
            self._message[client] = self._message.get(client, 0) + message_bytes(message.content)
            accepted.append(reply)
        if not accepted:
            raise RuntimeError(f"round {server_round}: no valid reply; see the rejected uploads above")
        self._clients.update(r.client for r in accepted)
        if server_round in self._sampling:
            self._sampling[server_round]["contributed"] = sorted((r.client for r in accepted), key=_client_order)
        # Replies arrive in whatever order the nodes finish; aggregating in client order makes
        # every float sum (and any seeded shuffle of the replies) independent of that order.
        accepted.sort(key=lambda r: int(r.client.removeprefix("client-")))
        self.aggregate_round(plan, accepted)
        metrics = MetricRecord({"num-clients": len(accepted),
                                "num-examples": sum(r.num_examples for r in accepted)})
        return self.global_arrays(), metrics

    def check_reply(self, plan: RoundPlan, message: Message, taken: set[str]) -> Reply:
        """Identify, parse and validate one reply; ``taken``: clients already accepted this round.

        Raises UploadError with ``.client`` set to the name the rejection is logged under.
        """
        node = message.metadata.src_node_id
        client = f"node-{node}"
        try:
            if message.has_error():
                raise UploadError(f"client failed: {message.error.reason}")
            client, num_examples = self._identify(message.content)
            self._node_partition[node] = int(client.removeprefix("client-"))
            if client in taken:
                claimed, client = client, f"node-{node}"  # name the sender: `claimed` is already in
                raise UploadError(f"duplicate upload: {claimed} already uploaded in this round")
            reply = Reply(client, num_examples, self.parse_reply(plan, message.content))
            self.validate_reply(plan, reply)
            return reply
        except UploadError as err:
            err.client = client
            raise

    def reject(self, message: Message, err: UploadError, server_round: int) -> None:
        """Log a rejected reply by name and record it for the stage's ``left_out``."""
        client = getattr(err, "client", f"node-{message.metadata.src_node_id}")
        log(WARNING, "Rejected upload from %s (node %d) in round %d: %s", client,
            message.metadata.src_node_id, server_round, err)
        self._left_out[client] = str(err)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []  # evaluation is central: the server holds the test data of all seen classes

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    # ------------------------------------------------------------------ the loop
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn: Any = None) -> Result:
        """Run every stage; Flower's own ``start`` runs a flat list of rounds instead.

        After each stage the server state is checkpointed atomically, so ``resume`` continues
        from the next stage and ends with the same classifier as an uninterrupted run.
        """
        log(INFO, "Starting %s", self.name)
        self.summary()
        result = Result()
        first_task = self._restore_checkpoint() if self.cfg.resume else 0
        server_round = 0
        for task in range(first_task, self.num_tasks):
            began = time.perf_counter()
            self._reset_stage_accounting()
            plans = self.plan_stage(task)
            for plan in plans:
                server_round += 1
                self._plan = plan
                log(INFO, "[stage %d/%d] round %d/%d (%s)", task + 1, self.num_tasks,
                    plan.index + 1, plan.total, plan.phase)
                replies = self._run_round(grid, server_round, train_config or ConfigRecord(),
                                          timeout or self.cfg.round_timeout)
                arrays, metrics = self.aggregate_train(server_round, replies)
                if metrics is not None:
                    result.train_metrics_clientapp[server_round] = metrics
                if arrays is not None:
                    result.arrays = arrays
            extra = self.end_stage(task)
            record = self._evaluate_stage(task, rounds=len(plans), began=began, extra=extra)
            self.recorder.add(record)
            self._save_checkpoint(task)
            log(INFO, "[stage %d/%d] accuracy on %d seen classes: %.2f%% (%.1f s)",
                task + 1, self.num_tasks, self.num_seen(task), record.accuracy, record.seconds)
            if record.left_out:
                log(WARNING, "[stage %d/%d] data missing from this stage: %s", task + 1, self.num_tasks,
                    "; ".join(f"{c}: {why}" for c, why in record.left_out.items()))
        log(INFO, "\n%s", format_stage_table(self.recorder.stages))
        log(INFO, "results: %s", self.recorder.path)
        return result

    def _run_round(self, grid: Grid, server_round: int, config: ConfigRecord, timeout: float) -> list[Message]:
        """Send one round; with ``require-all-clients``, re-send to the nodes that did not answer
        until every client's reply is in (bounded by ``round-retries``)."""
        messages = list(self.configure_train(server_round, self.global_arrays(), config, grid))
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        attempt = 0
        while self.cfg.require_all_clients and self._missing_clients(replies):
            if attempt >= self.cfg.round_retries:
                raise RuntimeError(
                    f"round {server_round}: no reply from {', '.join(sorted(self._missing_clients(replies)))} "
                    f"after {attempt + 1} attempts (require-all-clients is set)"
                )
            attempt += 1
            answered = {m.metadata.src_node_id for m in replies if not m.has_error()}
            replies = [m for m in replies if not m.has_error()]
            retry = [m for m in self.configure_train(server_round, self.global_arrays(), config, grid)
                     if m.metadata.dst_node_id not in answered]
            log(WARNING, "round %d: retry %d/%d for %d node(s)", server_round, attempt,
                self.cfg.round_retries, len(retry))
            replies += list(grid.send_and_receive(retry, timeout=timeout))
        return replies

    def _missing_clients(self, replies: list[Message]) -> set[str]:
        seen = set()
        for message in replies:
            if not message.has_error():
                metrics = message.content.metric_records.get("metrics")
                if metrics is not None and "partition-id" in metrics:
                    seen.add(f"client-{metrics['partition-id']}")
        return self._round_expected - seen

    def _round_nodes(self, grid: Grid, node_ids: list[int], plan: RoundPlan, server_round: int) -> list[int]:
        """The nodes this round goes to. Train rounds with ``clients-per-round > 0`` go only to the
        nodes of a seeded sample of the clients joined by the task (LGA: 10 per round); every
        other round goes to every node. Only the clients a round goes to can miss it."""
        everyone = {f"client-{i}" for i in range(self.cfg.num_clients)}
        if self.cfg.clients_per_round == 0 or plan.message_type != TRAIN_MESSAGE:
            self._round_expected = everyone
            self._expected |= everyone
            return node_ids
        # seeded by (seed, task, phase, round in stage): a rerun or a resumed run samples the same
        rng = np.random.default_rng([self.cfg.seed, plan.task, zlib.crc32(plan.phase.encode()), plan.index])
        sampled = sample_clients(self.split.active_clients(plan.task), self.cfg.clients_per_round, rng)
        unknown = [n for n in node_ids if n not in self._node_partition]
        if unknown:
            self._discover(grid, unknown)
        names = [f"client-{c}" for c in sampled.tolist()]
        self._round_expected = set(names)
        self._expected |= self._round_expected
        self._sampling.setdefault(server_round, {"round": server_round, "sampled": names, "contributed": []})
        wanted = set(sampled.tolist())
        return [n for n in node_ids if self._node_partition.get(n) in wanted]

    def _discover(self, grid: Grid, node_ids: list[int]) -> None:
        """Ask nodes we have not heard from which client (partition) they serve: the server only
        knows node ids, and sampling is by client. One tiny ``query.info`` message each, no data."""
        content = RecordDict({"config": ConfigRecord(self.cfg.to_mapping())})
        messages = [Message(content=content, message_type=INFO_MESSAGE, dst_node_id=n) for n in node_ids]
        for reply in grid.send_and_receive(messages, timeout=self.cfg.round_timeout):
            node = reply.metadata.src_node_id
            metrics = None if reply.has_error() else reply.content.metric_records.get("metrics")
            partition = None if metrics is None else metrics.get("partition-id")
            if isinstance(partition, int) and 0 <= partition < self.cfg.num_clients:
                self._node_partition[node] = partition
            else:
                why = reply.error.reason if reply.has_error() else f"partition-id {partition!r}"
                log(WARNING, "node %d did not say which client it serves (%s); it is not sampled", node, why)

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_path(self) -> Path:
        return self.cfg.output_dir / "checkpoint.pt"

    def _save_checkpoint(self, task: int) -> None:
        payload = {
            "strategy": self.name,
            "config": _resumable_config(self.cfg),
            "completed_tasks": task + 1,
            "state": self.state_dict(),
            "stages": [asdict(s) for s in self.recorder.stages],
        }
        path = self.checkpoint_path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".checkpoint.", suffix=".tmp")
        os.close(fd)
        try:
            torch.save(payload, tmp)
            os.replace(tmp, path)  # atomic: a crash leaves the previous checkpoint intact
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _restore_checkpoint(self) -> int:
        path = self.checkpoint_path
        if not path.exists():
            raise ConfigError(f"resume: no checkpoint at {path}; run once without --resume first")
        payload = torch.load(path, map_location="cpu", weights_only=False)
        if payload.get("strategy") != self.name:
            raise ConfigError(f"resume: checkpoint at {path} is for strategy '{payload.get('strategy')}'")
        saved, current = payload["config"], _resumable_config(self.cfg)
        changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        if changed:
            raise ConfigError(f"resume: config differs from the checkpoint in: {', '.join(changed)}")
        self.load_state_dict(payload["state"])
        self.recorder.stages = [StageRecord(**s) for s in payload["stages"]]
        done = int(payload["completed_tasks"])
        log(INFO, "Resuming %s from %s after stage %d/%d", self.name, path, done, self.num_tasks)
        return done

    def select_nodes(self, grid: Grid) -> list[int]:
        """All connected nodes, after waiting (bounded) for ``num-clients`` of them.

        The first round waits up to ``round-timeout`` (SuperNodes are still connecting); later
        rounds wait at most :data:`RECONNECT_GRACE_S` for a node that went away, then go on
        without it (its missing statistics are backfilled when it comes back), instead of
        paying the whole timeout again in every round.
        """
        patience = self.cfg.round_timeout if not self._nodes_seen else min(self.cfg.round_timeout, RECONNECT_GRACE_S)
        self._nodes_seen = True
        deadline = time.monotonic() + patience
        while True:
            node_ids = sorted(grid.get_node_ids())
            if len(node_ids) >= self.cfg.num_clients or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if not node_ids:
            raise RuntimeError("no SuperNode connected")
        if len(node_ids) < self.cfg.num_clients:
            log(WARNING, "only %d of %d clients connected", len(node_ids), self.cfg.num_clients)
        return node_ids

    # ------------------------------------------------------------------ internals
    def _require_plan(self) -> RoundPlan:
        if self._plan is None:
            raise RuntimeError("no round planned: call start()")
        return self._plan

    def _identify(self, content: RecordDict) -> tuple[str, int]:
        metrics = content.metric_records.get("metrics")
        if metrics is None or "partition-id" not in metrics or "num-examples" not in metrics:
            raise UploadError("reply lacks the 'metrics' record with partition-id and num-examples")
        partition, num_examples = metrics["partition-id"], metrics["num-examples"]
        if not isinstance(partition, int) or not 0 <= partition < self.cfg.num_clients:
            raise UploadError(f"partition-id {partition!r} outside 0..{self.cfg.num_clients - 1}")
        if not isinstance(num_examples, int) or num_examples < 0:
            raise UploadError(f"num-examples {num_examples!r} is not a non-negative integer")
        return f"client-{partition}", num_examples

    def _reset_stage_accounting(self) -> None:
        self._upload: dict[str, int] = {}
        self._message: dict[str, int] = {}
        self._clients: set[str] = set()
        self._left_out: dict[str, str] = {}
        self._expected: set[str] = set()  # clients some round of this stage was sent to
        self._round_expected: set[str] = set()
        self._sampling: dict[int, dict[str, Any]] = {}  # server round -> sampled / contributed clients

    def _evaluate_stage(self, task: int, *, rounds: int, began: float, extra: dict[str, Any]) -> StageRecord:
        accuracy, per_task, scores = self.score_stage(task)
        extra = {**extra, **scores}
        left_out = {c: why for c, why in self._left_out.items() if c not in self._clients}
        unattributed = any(c.startswith("node-") for c in left_out)  # rejected before we knew who
        if rounds:  # a stage without federated rounds (e.g. joint) misses nobody
            for i in range(self.cfg.num_clients):
                client = f"client-{i}"
                if client in self._expected and client not in self._clients and client not in left_out:
                    left_out[client] = ("no reply within round-timeout" if not unattributed else
                                        "no accepted reply (timed out, or one of the rejected node-* uploads)")
        if self._sampling:
            extra = {**extra, "sampling": [self._sampling[r] for r in sorted(self._sampling)]}
        old_only = getattr(self.split, "old_only", None)
        if old_only is not None and len(old_only[task]):
            extra = {**extra, "old_only_clients": [f"client-{c}" for c in old_only[task].tolist()]}
        return StageRecord(
            stage=task + 1,
            classes=self.split.stage_classes(task),
            accuracy=accuracy,
            per_task_accuracy=per_task,
            seconds=time.perf_counter() - began,
            rounds=rounds,
            upload_bytes_per_client=dict(sorted(self._upload.items())),
            upload_message_bytes_per_client=dict(sorted(self._message.items())),
            clients=sorted(self._clients),
            left_out=left_out,
            extra=extra,
        )


def _resumable_config(cfg: RunConfig) -> dict[str, Any]:
    """The config keys that must match for a checkpoint to be resumed."""
    operational = {"resume", "round-timeout", "require-all-clients", "round-retries", "device"}
    return {k: v for k, v in cfg.to_mapping().items() if k not in operational}


def _client_order(name: str) -> tuple[int, str]:
    """``client-2`` before ``client-10``; other names (``node-*``) after."""
    head, _, tail = name.partition("-")
    return (int(tail), "") if head == "client" and tail.isdigit() else (1 << 30, name)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()
