"""The Flower strategy every FCIL method builds on: rounds in, typed replies out.

A run is a sequence of stages, one per task; each stage is a list of federated rounds
(:class:`RoundPlan`). Every round goes through Flower's ``configure_train`` / ``aggregate_train``
hooks -- the Message-API successors of the legacy ``fit`` / ``aggregate_fit`` -- so the same
strategy runs under the Ray simulation engine and on real SuperNodes.

A method (one subclass per registry entry) says *what* happens:

* :meth:`StagedStrategy.plan_stage` -- the rounds of a stage;
* :meth:`StagedStrategy.customise` -- what its instructions carry beyond the global model;
* :meth:`StagedStrategy.read_reply` -- reading and checking one typed reply's arrays;
* :meth:`StagedStrategy.aggregate_round`, :meth:`StagedStrategy.end_stage`,
  :meth:`StagedStrategy.predict_seen` -- folding replies in, solving, predicting.

This class owns the protocol (headers, parsing, rejection of bad replies) and delegates the
rest to components with one job each: the stage loop (:mod:`strategies.loop`), node waiting,
identity and sampling (:mod:`strategies.nodes`), streaming replies and retries (:mod:`strategies.stream`),
accounting (:mod:`strategies.accounting`) and checkpoints (:mod:`strategies.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fcl_flower import methods
from fcl_flower import restore as fields
from fcl_flower.averaging import cosine_lr
from fcl_flower.config import RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.methods import Kind
from fcl_flower.metrics import accuracy_by_task, task_pool_accuracy
from fcl_flower.models import trainable_state
from fcl_flower.protocol import (
    EvaluationRequest,
    Header,
    InfoIns,
    Instruction,
    ProtocolError,
    Reply,
    StatsIns,
    StatsRes,
    TrainIns,
    TrainRes,
    UploadError,
    message_bytes,
    parse_reply,
    payload_bytes,
)
from fcl_flower.protocol.payloads import MAX_CLASS_SAMPLES
from fcl_flower.restore import RestoreError
from fcl_flower.results import ResultsRecorder
from fcl_flower.runtime import build_model, resolve_device
from fcl_flower.tensors import state_record, tensor_record
from strategies.accounting import StageAccounting, client_name, client_order
from strategies.checkpoint import CheckpointStore
from strategies.nodes import NodeDirectory
from strategies.stream import WINDOW, ReplyStream, exchange

if TYPE_CHECKING:
    from strategies.evaluation import Riding

P = TypeVar("P")


@dataclass(frozen=True)
class RoundPlan:
    """One federated round of a stage."""

    task: int  # 0-based task index
    phase: str  # the method's phase (fcl_flower/methods.py), i.e. the client handler to run
    kind: Kind = Kind.TRAIN  # the Flower message type of the phase
    index: int = 0  # round within the stage, 0-based
    total: int = 1  # rounds in the stage
    lr: float = 0.0  # learning rate for this round (train rounds)


def train_time(seconds: Sequence[float]) -> dict[str, float]:
    """A round's metrics from its clients' ``train-seconds``: the max (the round waits for the
    slowest client), the mean and how many reported; empty when none did."""
    if not seconds:
        return {}
    return {
        "train-seconds-max": max(seconds),
        "train-seconds-mean": sum(seconds) / len(seconds),
        "train-seconds-reported": float(len(seconds)),
    }


class StageFailed(RuntimeError):
    """The stage cannot produce a classifier (no valid statistics, a sum that fails its checks, a
    secure sum that cannot be opened, a solve that fails): the previous classifier is kept."""


class RoundFailed(RuntimeError):
    """No reply of a round could be accepted."""


@dataclass(frozen=True)
class Accepted(Generic[P]):
    """A reply that passed every check: which client, how many examples, the method's payload."""

    client: str
    num_examples: int
    payload: P
    reply: Reply | None = None


class RoundFold(Protocol):
    """Folds a round's accepted replies into the server state one at a time, in client order,
    so that none has to be kept (:meth:`StagedStrategy.round_fold`)."""

    def add(self, item: Accepted[Any]) -> None: ...

    def finish(self) -> None: ...


@dataclass
class Settled:
    """A round's replies, all in, in client order (:meth:`StagedStrategy.settle_first_contact`)."""

    replies: list[Message]
    dropped: list[tuple[int, str]]

    def __iter__(self) -> Iterator[Message]:
        return iter(self.replies)


class StagedStrategy(Strategy):
    """Base class: the protocol, the Flower hooks and the components; methods subclass it."""

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        self.cfg = cfg
        self.method = methods.get(cfg.strategy)
        self.split = split
        self.recorder = recorder
        self.device = resolve_device(cfg)
        self.model = build_model(cfg, split)
        self.num_tasks = len(split.tasks)
        self.task_of_label = np.concatenate([np.full(len(r), t, dtype=np.int64) for t, r in enumerate(split.tasks)])
        # a fresh id per server process: replies to another run (or an earlier process) never parse
        self.run_id = f"{cfg.strategy}-{secrets.token_hex(6)}"
        self.nodes = NodeDirectory(cfg, split)
        self.accounting = StageAccounting()
        self.checkpoints = CheckpointStore(cfg.output_dir)
        self.server_round = 0
        self._plan: RoundPlan | None = None
        self._sent: dict[int, Header] = {}  # node -> header of the message it got in this round
        self._round_began = float("-inf")  # begin_round's clock (perf_counter); -inf: no bound yet
        self._round_expected: set[str] = set()
        # client -> held-out samples per class, fixed at its first evaluation (strategies/evaluation.py)
        self.held_out_sizes: dict[str, list[int]] = {}
        # a stage whose evaluation rides with the next statistics round (strategies/evaluation.py)
        self.riding: Riding | None = None

    # ------------------------------------------------------------------ what a method says
    @abstractmethod
    def plan_stage(self, task: int) -> list[RoundPlan]:
        """The rounds of stage ``task``."""

    def customise(self, plan: RoundPlan, ins: Instruction) -> Instruction:
        """Add the method's own fields to a round's instruction (default: none)."""
        return ins

    @abstractmethod
    def read_reply(self, plan: RoundPlan, reply: Reply) -> Any:
        """Read and check one client's arrays against the server's state; raise UploadError to reject."""

    @abstractmethod
    def aggregate_round(self, plan: RoundPlan, replies: list[Accepted[Any]]) -> None:
        """Fold the accepted replies of one round (in client order) into the server state."""

    def round_fold(self, plan: RoundPlan) -> RoundFold | None:
        """A fold that adds each accepted reply of ``plan``'s round as it arrives (in client order)
        and drops it; None (the default): the round's replies are kept and handed to
        :meth:`aggregate_round` together. Both must give the same numbers."""
        return None

    def end_stage(self, task: int) -> dict[str, Any]:
        """Work after the last round of a stage (e.g. a ridge solve); returns result extras."""
        return {}

    def between_stages(self, grid: Grid, task: int, timeout: float) -> None:
        """After stage ``task`` is recorded, before its checkpoint: what a method does between stages
        (STSA: the forget round of run config ``forget``, docs/unlearning.md). Nothing by default."""

    @abstractmethod
    def predict_seen(self, task: int) -> tuple[np.ndarray, np.ndarray]:
        """(predictions, labels) of the global model on the test data of all seen classes."""

    def global_arrays(self) -> ArrayRecord:
        """The trainable state of the global model, one array per key (Flower's round result)."""
        return tensor_record(trainable_state(self.model))

    def wire_state(self) -> ArrayRecord:
        """What the clients receive: the trainable state of the global model, one array per dtype
        (fcl_flower/tensors.py ``state_record``: a few of Flower's objects instead of one per tensor)."""
        return state_record(trainable_state(self.model))

    def stage_failed(self, task: int, reason: str) -> dict[str, Any]:
        """The stage failed (:class:`StageFailed`): keep the previous classifier; result extras."""
        self.model.eval()
        return {"failed": reason}

    def state_dict(self) -> dict[str, Any]:
        """Everything the server needs to continue after a crash (extended by subclasses)."""
        return {
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "nodes": self.nodes.state_dict(),
            "held_out_sizes": {name: list(sizes) for name, sizes in sorted(self.held_out_sizes.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state; RestoreError (one line naming the field) where a field
        does not hold what this configuration writes there (fcl_flower/restore.py)."""
        saved = fields.mapping(fields.entry(state, "model", "state"), "state/model")
        own = self.model.state_dict()
        extra = sorted(set(saved) - set(own))
        if extra:
            raise RestoreError(f"state/model/{extra[0]}", "is not a tensor of this configuration's model")
        for name, tensor in own.items():
            fields.tensor(fields.entry(saved, name, "state/model"), f"state/model/{name}", tensor.shape, tensor.dtype)
        self.model.load_state_dict(dict(saved))
        self.nodes.load_state_dict(state.get("nodes", {}))
        self.held_out_sizes = self.restored_held_out_sizes(state.get("held_out_sizes", {}))

    def restored_held_out_sizes(self, saved: Any) -> dict[str, list[int]]:
        """The clients' held-out sizes per class as fixed before the interruption (evaluation
        counts must keep matching them after a resume); RestoreError naming the field."""
        field = "state/held_out_sizes"
        names = {client_name(i) for i in range(self.cfg.num_clients)}
        sizes: dict[str, list[int]] = {}
        for name, values in fields.mapping(saved, field).items():
            if name not in names:
                raise RestoreError(f"{field}/{name}", "is not a client of this run")
            sizes[name] = fields.integers(values, f"{field}/{name}", 0, MAX_CLASS_SAMPLES)
            if len(sizes[name]) > self.split.num_classes:
                raise RestoreError(f"{field}/{name}", f"has more than the run's {self.split.num_classes} classes")
        return sizes

    def check_restored(self, completed: int) -> None:
        """After :meth:`load_state_dict`: the restored state is consistent with ``completed`` stages
        done (shapes that grow with the stages, sums against counts); RestoreError if not."""

    # ------------------------------------------------------------------ helpers for methods
    def num_seen(self, task: int) -> int:
        return int(self.split.tasks[task].stop)

    def round_plan(self, task: int, phase: str, index: int = 0, total: int = 1, lr: float = 0.0) -> RoundPlan:
        """A round of one of this method's phases (its kind comes from the registry)."""
        return RoundPlan(task, phase, self.method.phase(phase).kind, index, total, lr)

    def train_plans(self, task: int, phase: str, rounds: int) -> list[RoundPlan]:
        """``rounds`` local-SGD rounds with the per-round cosine learning rate."""
        return [self.round_plan(task, phase, i, rounds, cosine_lr(self.cfg.lr, i, rounds)) for i in range(rounds)]

    def score_stage(self, task: int, grid: Grid | None = None) -> tuple[float, list[float], dict[str, Any]]:
        """(stage accuracy, per-task accuracies, result extras) of the global model after ``task``.

        ``evaluation`` central: the server scores its test set (:meth:`score_central`); federated:
        the clients score their own held-out data and send counts (strategies/evaluation.py);
        both: the central numbers, and the federated ones in ``extra["federated_evaluation"]``.
        """
        mode = self.cfg.evaluation
        if mode == "central" or grid is None:
            return self.score_central(task)
        from strategies import evaluation

        scores = evaluation.collect(self, grid, task)
        accuracy, per_task, extra = evaluation.score(self, scores, task)
        if mode == "federated":
            return accuracy, per_task, {**extra, "evaluation": {"mode": "federated", **scores.summary()}}
        central = self.score_central(task)
        federated = {"accuracy": accuracy, "per_task_accuracy": per_task, **extra, **scores.summary()}
        return central[0], central[1], {**central[2], "federated_evaluation": federated}

    def evaluation_rides(self, task: int) -> bool:
        """Whether stage ``task``'s federated evaluation rides with stage ``task`` + 1's statistics
        round instead of an exchange of its own (strategies/evaluation.py); never by default."""
        return False

    def rides_on(self, plan: RoundPlan) -> bool:
        """Whether ``plan``'s round carries a riding evaluation (the method's statistics round)."""
        return False

    def evaluation_request(self, task: int) -> EvaluationRequest:
        """What the clients need to score the current model after stage ``task`` (riding along)."""
        return EvaluationRequest(task, self.num_seen(task), self.evaluate_arrays().get("ridge"))

    def evaluate_arrays(self) -> dict[str, Any]:
        """Extra records of the evaluate message besides the global model (analytic: W)."""
        return {}

    def score_central(self, task: int) -> tuple[float, list[float], dict[str, Any]]:
        """The server scores the global model on the test data of all seen classes.

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
        assert self.split.client_classes is not None
        rows = task_pool_accuracy(preds, labels, self.split.client_classes, task)
        per_client = {client_name(u): row.tolist() for u, row in enumerate(rows)}
        return float(rows.mean(axis=1).mean()), rows.mean(axis=0).tolist(), {"per_client": per_client}

    # ------------------------------------------------------------------ messages out
    def header(self, plan: RoundPlan, attempt: int) -> Header:
        return Header(self.run_id, plan.phase, plan.task, plan.task + 1, self.server_round, attempt)

    def instruction(self, plan: RoundPlan, header: Header) -> Instruction:
        ins: Instruction
        if plan.kind is Kind.TRAIN:
            ins = TrainIns(header, self.cfg, lr=plan.lr, num_seen=self.num_seen(plan.task), model=self.wire_state())
        else:
            ins = StatsIns(header, self.cfg, num_seen=self.num_seen(plan.task), model=self.wire_state())
        ins = self.customise(plan, ins)
        if isinstance(ins, StatsIns) and self.riding is not None and self.rides_on(plan):
            ins = dataclasses.replace(ins, evaluate=self.riding.request)
        return ins

    def messages(
        self,
        grid: Grid,
        plan: RoundPlan,
        attempt: int,
        exclude: set[int],
        build: Callable[[int], Instruction] | None = None,
        only: set[int] | None = None,
        side: bool = False,
        first_contact: bool = False,
    ) -> list[Message]:
        """The round's messages for ``attempt``: one per target node not in ``exclude`` (and in
        ``only``, if given); ``build(node)`` makes each node's instruction (default: the plan's).
        ``side``: an exchange whose replies its caller parses (a secure round's key, share and
        unmask steps), not the round's own replies that :meth:`aggregate_train` parses.
        ``first_contact``: a side exchange whose caller settles the claims of nodes not heard from
        in its replies (:meth:`settle_claims`; a secure round's key step, whose small replies are
        all read at once anyway): they get it directly where it goes to every node
        (:meth:`reaches_every_node`), instead of a ``query.info`` exchange before it."""
        unknown: list[int] = []  # nodes not heard from that get the round itself (first contact rides)
        connected = self.nodes.connected(grid)

        def discover(nodes: list[int]) -> None:
            nodes = [n for n in nodes if only is None or n in only]  # a step for named nodes asks nobody else
            if not nodes:
                return
            if first_contact:  # a key step's small replies are all read at once anyway
                rides = self.reaches_every_node(plan)
            else:  # a round's replies are then all held at once: no more than a stream's window
                rides = not side and len(connected) <= WINDOW and self.first_contact_rides(plan)
            if rides:
                unknown.extend(nodes)
            else:
                self.discover(grid, nodes)

        targets = self.nodes.targets(connected, plan.task, plan.phase, plan.index, plan.kind, discover)
        self._round_expected = targets.expected
        self.accounting.expect(targets.expected)
        for client, nodes in self.nodes.contested.items():
            self.accounting.reject(client_name(client), f"contested by nodes {', '.join(map(str, nodes))}")
        if targets.sampled is not None:
            self.accounting.sampled(self.server_round, targets.sampled)
        if build is None:
            shared = self.instruction(plan, self.header(plan, attempt))
            build = lambda node: shared  # noqa: E731 (one instruction for every node)
        out = []
        for node in [*targets.nodes, *sorted(unknown)]:
            if node in exclude or (only is not None and node not in only):
                continue
            ins = build(node)
            if not side:
                self._sent[node] = ins.header
            if isinstance(ins, StatsIns) and ins.evaluate is not None and self.riding is not None:
                self.riding.asked.add(node)
            out.append(ins.to_message(node))
        return out

    def first_contact_rides(self, plan: RoundPlan) -> bool:
        """Whether nodes not heard from get ``plan``'s round itself, their replies saying which
        client they serve (:meth:`settle_first_contact`), instead of a ``query.info`` exchange
        before it (:meth:`discover`): where the round goes to every node anyway (no sampling, no
        excluded site), with plain uploads (a secure round names its participants beforehand) and
        without ``require-all-clients`` (which re-sends by client). Only while at most
        :data:`~strategies.stream.WINDOW` nodes are connected (a few real SuperNodes, where an
        exchange costs a Flower round; :meth:`messages`): the round's replies are then all held
        at once, no more than a streamed round holds. A secure round's key step settles first
        contact instead (``messages(first_contact=True)``)."""
        return not self.cfg.secure_aggregation and self.reaches_every_node(plan)

    def reaches_every_node(self, plan: RoundPlan) -> bool:
        """Whether ``plan``'s round goes to every connected node, whichever client each serves: no
        sampling, no excluded site, and no ``require-all-clients`` (which re-sends by client)."""
        cfg = self.cfg
        return (
            not cfg.require_all_clients
            and (cfg.clients_per_round == 0 or plan.kind is not Kind.TRAIN)
            and not self.nodes.excluded(plan.task, plan.phase)
        )

    def settle_first_contact(self, replies: Iterable[Message], plan: RoundPlan) -> Iterable[Message]:
        """A round sent to nodes not heard from (:meth:`first_contact_rides`): all its replies are
        read first, the new nodes mapped by the clients their replies claim, exactly as a
        ``query.info`` discovery would (two claiming one client: neither is mapped, the client is
        contested and left out), then the replies are handed on in client order. So the sums are
        those of a round sent after a discovery; this round holds all its (at most
        :data:`~strategies.stream.WINDOW`) replies at once."""
        received = list(replies)
        self.settle_claims(received, self._sent.get, plan.kind)
        order = {node: i for i, node in enumerate(self.in_client_order(list(self._sent)))}
        received.sort(key=lambda m: order.get(m.metadata.src_node_id, len(order)))
        return Settled(received, getattr(replies, "dropped", []))

    def settle_claims(self, received: list[Message], sent: Callable[[int], Header | None], kind: Kind) -> None:
        """Map the nodes not heard from by the clients their replies in ``received`` claim, all at
        once, as a ``query.info`` discovery would (two claiming one client: neither is mapped, the
        client is contested and left out). ``sent(node)``: the header the node was sent (None: it
        was not asked, and its reply claims nothing)."""
        claims: dict[int, int] = {}
        for message in received:
            node = message.metadata.src_node_id
            header = sent(node)
            if node in self.nodes.client_of or header is None:
                continue
            try:
                claims[node] = self.client_id(parse_reply(message, header, kind))
            except ProtocolError as err:
                log(WARNING, "node %d did not say which client it serves (%s)", node, err)
        self.nodes.first_contact(claims)
        for client, nodes in self.nodes.contested.items():
            self.accounting.reject(client_name(client), f"contested by nodes {', '.join(map(str, nodes))}")

    def discover(self, grid: Grid, node_ids: list[int]) -> None:
        """Ask nodes we have not heard from which client they serve (one tiny message each, no data)."""
        plan = self._require_plan()
        header = Header(self.run_id, "info", plan.task, plan.task + 1, self.server_round, 0)
        ins = InfoIns(header, self.cfg)
        claims: dict[int, int] = {}
        for message in exchange(grid, [ins.to_message(n) for n in node_ids], self.cfg.round_timeout):
            node = message.metadata.src_node_id
            try:
                if node not in node_ids:
                    raise ProtocolError("an answer from a node that was not asked")
                claims[node] = self.client_id(parse_reply(message, header, Kind.INFO))
            except ProtocolError as err:
                log(WARNING, "node %d did not say which client it serves (%s); it gets no round", node, err)
        self.nodes.first_contact(claims)

    # ------------------------------------------------------------------ Flower hooks
    def summary(self) -> None:
        cfg = self.cfg
        log(
            INFO,
            "\t├──> %s on %s: %d tasks, %d clients, beta=%s, seed=%d",
            cfg.strategy,
            cfg.dataset,
            self.num_tasks,
            cfg.num_clients,
            cfg.beta,
            cfg.seed,
        )
        log(INFO, "\t└──> output: %s", self.recorder.path)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The current round's instruction to every target node (``arrays``/``config`` are unused:
        the instruction carries the global model and the whole run config)."""
        return self.messages(grid, self._require_plan(), 0, set())

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Parse and check every reply, account its bytes, reject bad ones by name, aggregate the rest.

        ``replies`` may be a :class:`~strategies.stream.ReplyStream`: replies handed on in client
        order as they arrive. Then a method with a :meth:`round_fold` adds each accepted reply at
        once and drops it, so the server never holds more than the stream's window of replies.
        """
        plan = self._require_plan()
        fold = self.round_fold(plan) if getattr(replies, "ordered", False) else None
        kept: list[Accepted[Any]] = []
        clients: list[str] = []
        examples = 0
        train_seconds: list[float] = []  # the clients' own local-training times (a metric only)
        timed = self.accounting.timed
        for message in replies:
            self.accounting.replies += 1
            try:
                with timed("accept"):
                    item = self.accept(plan, message, set(clients))
                with timed("bytes"):  # reads every array's header, of records the method ignores too
                    try:
                        sizes = payload_bytes(message.content), message_bytes(message.content)
                    except UploadError as err:
                        err.client = item.client
                        raise
            except UploadError as err:
                self.reject(message, err, server_round)
                continue
            self.note_train_seconds(item, server_round, train_seconds)
            self.accounting.accept(item.client, *sizes)
            clients.append(item.client)
            examples += item.num_examples
            if fold is not None:
                with timed("add"):
                    fold.add(item)
            else:
                kept.append(item)
            del item, message  # a folded reply is dropped here
        for node, why in getattr(replies, "dropped", ()):
            self.accounting.duplicate(f"node-{node}", f"{self.nodes_name(node)} (node {node}) {why}")
        if not clients:
            raise RoundFailed(f"round {server_round}: no valid reply")
        # Replies arrive in whatever order the nodes finish; aggregating in client order makes
        # every float sum (and any seeded shuffle of the replies) independent of that order.
        self.accounting.contributed(server_round, sorted(clients, key=client_order))
        with timed("finish" if fold is not None else "add"):
            if fold is not None:
                fold.finish()
            else:
                kept.sort(key=lambda a: client_order(a.client))
                self.aggregate_round(plan, kept)
        metrics = MetricRecord({"num-clients": len(clients), "num-examples": examples, **train_time(train_seconds)})
        return self.global_arrays(), metrics

    def note_train_seconds(self, item: Accepted[Any], server_round: int, into: list[float]) -> None:
        """An accepted train reply's ``train-seconds`` into ``into``; one that the parser ignored
        (negative, not finite, not a number) or longer than the round so far (the client trained
        after the round began and before its reply came) is named in the log and left out; the
        reply itself counts as ever."""
        reply = item.reply
        if not isinstance(reply, TrainRes):
            return
        why = reply.train_seconds_ignored
        if reply.train_seconds is not None:
            so_far = time.perf_counter() - self._round_began
            if reply.train_seconds <= so_far:  # it trained after the round began and before this reply
                into.append(reply.train_seconds)
                return
            why = f"metric 'train-seconds' is {reply.train_seconds:.6g}, longer than the round so far ({so_far:.3g} s)"
        if why:
            log(WARNING, "%s in round %d: %s, ignored", item.client, server_round, why)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []  # the stage loop runs evaluation itself, after each stage (score_stage)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Any = None,
    ) -> Result:
        """Run every stage (:func:`strategies.loop.run_stages`); Flower's own ``start`` runs a
        flat list of rounds instead."""
        from strategies.loop import run_stages

        return run_stages(self, grid, timeout=timeout or self.cfg.round_timeout)

    # ------------------------------------------------------------------ replies in
    def client_id(self, reply: Reply) -> int:
        if not 0 <= reply.client < self.cfg.num_clients:
            raise UploadError(f"partition-id {reply.client} outside 0..{self.cfg.num_clients - 1}")
        return reply.client

    def identify(self, node: int, reply: Reply) -> str:
        """The client a reply speaks for: the one its node is mapped to (see strategies/nodes.py)."""
        client = self.client_id(reply)
        self.nodes.claim(node, client)
        return client_name(client)

    def accept(self, plan: RoundPlan, message: Message, taken: set[str]) -> Accepted[Any]:
        """Identify, parse and check one reply; ``taken``: clients already accepted this round.

        Raises UploadError with ``.client`` set to the name the rejection is logged under.
        """
        node = message.metadata.src_node_id
        client = f"node-{node}"
        try:
            sent = self._sent.get(node)
            if sent is None:
                raise UploadError("reply from a node this round was not sent to")
            reply = parse_reply(message, sent, plan.kind)
            client = self.identify(node, reply)
            if client in taken:
                claimed, client = client, f"node-{node}"  # name the sender: `claimed` is already in
                raise UploadError(f"duplicate upload: {claimed} already uploaded in this round")
            self.take_evaluation(plan, client, reply)
            try:
                payload = self.read_reply(plan, reply)
            except ProtocolError:
                raise
            except Exception as exc:  # any failure on an untrusted reply rejects that reply, never the run
                raise UploadError(f"cannot read the upload ({type(exc).__name__}: {exc})") from None
            return Accepted(client, reply.num_examples, payload, reply)
        except ProtocolError as err:
            mapped = self.nodes.client_of.get(node)
            if client.startswith("node-") and mapped is not None:
                client = client_name(mapped)  # the node's own client, whatever the reply claimed
            error = err if isinstance(err, UploadError) else UploadError(str(err))
            error.client = client
            raise error from None

    def take_evaluation(self, plan: RoundPlan, client: str, reply: Reply) -> None:
        """The counts riding with an identified reply go to the riding evaluation, checked there
        (a client with bad counts is left out of the evaluation, its statistics are read as ever);
        counts nobody asked for reject the reply."""
        counts = reply.evaluation if isinstance(reply, StatsRes) else None
        if self.riding is None or not self.rides_on(plan):
            if counts is not None:
                raise UploadError("evaluation counts that this round did not ask for")
            return
        self.riding.take(self, client, counts)

    def reject(self, message: Message, err: UploadError, server_round: int) -> None:
        """Log a rejected reply by name and record it for the stage's ``left_out``."""
        client = err.client or f"node-{message.metadata.src_node_id}"
        log(
            WARNING,
            "Rejected upload from %s (node %d) in round %d: %s",
            client,
            message.metadata.src_node_id,
            server_round,
            err,
        )
        self.accounting.reject(client, str(err))

    # ------------------------------------------------------------------ one round
    def begin_round(self, plan: RoundPlan) -> None:
        self.server_round += 1
        self._plan = plan
        self._sent = {}
        self._round_began = time.perf_counter()  # a client's train-seconds cannot exceed the round so far

    def run_round(self, grid: Grid, plan: RoundPlan, timeout: float) -> Iterable[Message]:
        """The round's replies as a stream (strategies/stream.py): pulled as they arrive, in client
        order; with ``require-all-clients`` a node that does not answer gets the round again."""
        first = self.messages(grid, plan, 0, set())
        for attempt in range(self.cfg.round_retries + 1):  # expected clients no node serves yet
            unreached = self._round_expected - {self.nodes_name(m.metadata.dst_node_id) for m in first}
            if not (self.cfg.require_all_clients and unreached):
                break
            if attempt == self.cfg.round_retries:
                raise RuntimeError(
                    f"round {self.server_round}: no reply from {', '.join(sorted(unreached))} "
                    f"after {attempt + 1} attempts (require-all-clients is set)"
                )
            log(
                WARNING,
                "round %d: retry %d/%d for %d node(s)",
                self.server_round,
                attempt + 1,
                self.cfg.round_retries,
                len(unreached),
            )
            first = self.messages(grid, plan, attempt + 1, set())
        nodes = self.in_client_order([m.metadata.dst_node_id for m in first])

        def build(attempt: int, targets: list[int]) -> list[Message]:
            if attempt == 0:
                wanted = set(targets)
                return [m for m in first if m.metadata.dst_node_id in wanted]
            return self.messages(grid, plan, attempt, set(), only=set(targets))

        stream = ReplyStream(
            grid,
            build,
            nodes,
            timeout=timeout,
            require_all=self.cfg.require_all_clients,
            retries=self.cfg.round_retries,
            answered=self.well_formed,
            server_round=self.server_round,
            missing_names=self.names_of,
        )
        if any(node not in self.nodes.client_of for node in nodes):  # first contact rides with this round
            return self.settle_first_contact(stream, plan)
        return stream

    def in_client_order(self, nodes: list[int]) -> list[int]:
        """``nodes`` sorted by the client each serves (nodes not mapped yet last, by id)."""

        def key(node: int) -> tuple[int, str]:
            client = self.nodes.client_of.get(node)
            return client_order(client_name(client)) if client is not None else (1 << 31, f"{node:020d}")

        return sorted(nodes, key=key)

    def names_of(self, nodes: list[int]) -> list[str]:
        return [self.nodes_name(node) for node in nodes]

    def nodes_name(self, node: int) -> str:
        client = self.nodes.client_of.get(node)
        return f"node-{node}" if client is None else client_name(client)

    def well_formed(self, message: Message) -> bool:
        """Whether a reply answers this round (the rule ``require-all-clients`` re-sends by)."""
        plan = self._require_plan()
        sent = self._sent.get(message.metadata.src_node_id)
        if sent is None or message.has_error():
            return False
        try:
            parse_reply(message, sent, plan.kind)
        except ProtocolError:
            return False
        return True

    def _require_plan(self) -> RoundPlan:
        if self._plan is None:
            raise RuntimeError("no round planned: call start()")
        return self._plan
