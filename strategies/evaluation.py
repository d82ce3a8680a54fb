"""Federated evaluation as a component: after each stage, every client scores the global model on
its own held-out data and answers with counts per seen class; the server sums them.

Flower's ``evaluate`` messages carry it (``@app.evaluate()`` on the client, clients/evaluate.py).
The summed counts give the same metrics as central evaluation (A_t, A_{t,tau}, then A_avg, A_T,
F_T): accuracy over all held-out samples of the seen classes, sample-weighted across clients. In
simulation the clients' held-out shares partition the public test set, so ``evaluation = both``
gives identical numbers both ways (tests/test_federated_evaluation.py).

Replies are untrusted like any other: counts must be integers, non-negative, at most
``MAX_CLASS_SAMPLES`` per class, correct <= total, adding up (exact integers, no int64 wrap) to
the reply's sample count, from the node mapped to the client; and a client's held-out samples
per class are fixed at its first evaluation of the class (``held_out_sizes``, kept in the
server's state and checkpoint, so they hold across a resume too): a later reply with
other totals is left out of the metrics with its reason. Nothing can check that a client's
counts are true: a client that lies consistently from its first evaluation skews the *reported*
accuracy by at most its declared share of the samples, never the model. Evaluation traffic is not counted in the upload bytes (those
are the methods' costs the papers compare).

Riding along (:class:`Riding`). Each exchange costs a round on a real SuperLink (Flower's floor,
~4 s), so where nothing changes the model between a stage's solve and the next stage's statistics
round (an analytic method with ``evaluation = federated``, no forget round after the stage, no
withdrawn site: :meth:`~strategies.base.StagedStrategy.evaluation_rides`), the evaluation of stage t
rides with the statistics instruction of stage t+1 (:class:`~fcl_flower.protocol.EvaluationRequest`:
the same model, stage t's W) and each statistics reply carries its counts, checked exactly as a
separate evaluation reply (under secure aggregation in clear beside the masked statistics, as an
``evaluate`` reply carries them); the last stage's evaluation is an exchange of its own. Stage t's record
(accuracy, per-task accuracy, the log line, results.json) is completed when stage t+1's round is
read; until then the checkpoint holds it as ``pending_stage``, and a resume sends the evaluation
with the next statistics round (or, where no round is sent again -- a secure sum opened before
the interruption -- in an ``evaluate`` exchange of its own with stage t's W). Same numbers as
separate exchanges (tests/test_evaluation_rides.py). A client whose statistics reply does not
come, or cannot be read, is left out of that evaluation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from logging import WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.common.logger import log
from flwr.serverapp import Grid

from fcl_flower.methods import Kind
from fcl_flower.metrics import accuracy_from_counts, task_pool_rows_from_counts
from fcl_flower.protocol import (
    EvaluateIns,
    EvaluateRes,
    EvaluationRequest,
    Header,
    ProtocolError,
    UploadError,
    parse_reply,
)
from fcl_flower.protocol.payloads import check_declared, read_counts
from fcl_flower.results import StageRecord
from strategies.accounting import client_name, client_order
from strategies.stream import exchange

if TYPE_CHECKING:
    from strategies.base import StagedStrategy

PHASE = "evaluate"


@dataclass
class Scores:
    """What the clients reported after one stage."""

    counts: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # client -> (correct, total)
    left_out: dict[str, str] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return int(sum(total.sum() for _, total in self.counts.values()))

    def summary(self) -> dict[str, Any]:
        return {
            "clients": sorted(self.counts, key=client_order),
            "samples": self.samples,
            "left_out": dict(sorted(self.left_out.items(), key=lambda kv: client_order(kv[0]))),
        }


def collect(host: StagedStrategy, grid: Grid, task: int, request: EvaluationRequest | None = None) -> Scores:
    """Send the evaluate round to every node mapped to a client and read the counts (of the
    current model, or of ``request``'s W: a riding evaluation that no round carried)."""
    host.server_round += 1
    num_seen = host.num_seen(task)
    header = Header(host.run_id, PHASE, task, task + 1, host.server_round, 0)
    extra = host.evaluate_arrays() if request is None else {"ridge": request.ridge}
    ins = EvaluateIns(header, host.cfg, num_seen=num_seen, model=host.wire_state(), **extra)
    mapped = host.nodes.client_of
    targets = [n for n in host.nodes.connected(grid) if n in mapped]
    scores = Scores()
    # pulled as they arrive (Flower's send_and_receive would poll a real SuperLink every 3 s)
    replies = exchange(grid, [ins.to_message(n) for n in targets], host.cfg.round_timeout)
    for message in replies:
        node = message.metadata.src_node_id
        name = client_name(mapped[node]) if node in mapped else f"node-{node}"
        try:
            if node not in targets:
                raise ProtocolError("an answer from a node that was not asked")
            reply = parse_reply(message, header, Kind.EVALUATE)
            assert isinstance(reply, EvaluateRes)
            name = host.identify(node, reply)
        except (ProtocolError, UploadError) as err:
            scores.left_out[name] = f"evaluation: {err}"
            continue
        except Exception as err:  # an untrusted reply never stops the run
            scores.left_out[name] = f"evaluation: cannot read the counts ({type(err).__name__}: {err})"
            continue
        take(host, scores, name, reply, num_seen)
    for node, why in replies.dropped:
        scores.left_out[f"node-{node}"] = f"evaluation: {host.nodes_name(node)} (node {node}) {why}"
    for node in targets:
        name = client_name(mapped[node])
        if name not in scores.counts and name not in scores.left_out:
            scores.left_out[name] = "evaluation: no reply within round-timeout"
    warn_left_out(scores, task)
    return scores


def score(host: StagedStrategy, scores: Scores, task: int) -> tuple[float, list[float], dict[str, Any]]:
    """(A_t, per-task accuracies, extras) from the clients' counts, as :meth:`score_stage` gives them."""
    nan = float("nan")
    if not scores.counts:
        return nan, [nan] * (task + 1), {}
    if host.split.is_task_pool:
        assert host.split.client_classes is not None
        clients = sorted(scores.counts, key=client_order)
        ids = [int(c.rsplit("-", 1)[1]) for c in clients]
        correct = np.stack([scores.counts[c][0] for c in clients])
        total = np.stack([scores.counts[c][1] for c in clients])
        rows = task_pool_rows_from_counts(correct, total, host.split.client_classes[ids], task)
        per_client = {c: row.tolist() for c, row in zip(clients, rows, strict=True)}
        return float(rows.mean(axis=1).mean()), rows.mean(axis=0).tolist(), {"per_client": per_client}
    correct_sum = np.sum([c for c, _ in scores.counts.values()], axis=0)
    total_sum = np.sum([t for _, t in scores.counts.values()], axis=0)
    if int(total_sum.sum()) == 0:
        return nan, [nan] * (task + 1), {}
    accuracy, per_task = accuracy_from_counts(correct_sum, total_sum, host.task_of_label, task + 1)
    return accuracy, per_task, {}


def warn_left_out(scores: Scores, task: int) -> None:
    if scores.left_out:
        log(
            WARNING,
            "[stage %d] evaluation without %s",
            task + 1,
            "; ".join(f"{c}: {w}" for c, w in scores.left_out.items()),
        )


def take(host: StagedStrategy, scores: Scores, name: str, reply: EvaluateRes | None, num_seen: int) -> None:
    """Check one client's counts (``reply``: an ``evaluate`` reply, or the counts riding with its
    statistics; None: the reply carried none) and add them to ``scores``, or leave the client out
    with the reason. Never raises: an untrusted reply never stops the run."""
    try:
        if reply is None:
            raise UploadError("the reply carries no counts")
        if name in scores.counts:
            raise UploadError(f"duplicate evaluation from {name}")
        correct, total = read_counts(reply.counts, num_seen, reply.num_examples)
        sizes = check_declared(
            total.tolist(), host.held_out_sizes.get(name, []), zero_is_final=not host.split.is_task_pool
        )
    except (ProtocolError, UploadError) as err:
        scores.left_out[name] = f"evaluation: {err}"
        return
    except Exception as err:  # an untrusted reply never stops the run
        scores.left_out[name] = f"evaluation: cannot read the counts ({type(err).__name__}: {err})"
        return
    scores.counts[name] = (correct.numpy(), total.numpy())
    host.held_out_sizes[name] = sizes


#: the key of a riding stage's extras that its evaluation's extras replace when the counts are in
PENDING = "evaluation"


@dataclass
class Riding:
    """A stage whose evaluation rides with the next stage's statistics round (see the module doc):
    its record without the scores, what the clients are asked to score, the counts so far."""

    record: StageRecord
    request: EvaluationRequest
    scores: Scores = field(default_factory=Scores)
    asked: set[int] = field(default_factory=set)  # nodes whose instruction carried the request
    read: set[str] = field(default_factory=set)  # clients whose counts were read (once: a secure
    # round reads each upload twice, screening then summing, and a restarted attempt re-sends them)

    @classmethod
    def of(cls, host: StagedStrategy, record: StageRecord) -> Riding:
        """``record`` (just solved, scores pending) and the request for the current model and W."""
        task = record.stage - 1
        nan = float("nan")
        extra = {**record.extra, PENDING: {"mode": "federated", "pending": True}}
        record = dataclasses.replace(record, accuracy=nan, per_task_accuracy=[nan] * (task + 1), extra=extra)
        return cls(record, host.evaluation_request(task))

    def take(self, host: StagedStrategy, name: str, reply: EvaluateRes | None) -> None:
        if name not in self.read:
            self.read.add(name)
            take(host, self.scores, name, reply, self.request.num_seen)

    def complete(self, host: StagedStrategy, grid: Grid | None = None) -> StageRecord:
        """The stage's record with the scores of the counts that came (a client asked and not
        heard from is left out of the evaluation, by name)."""
        task = self.request.task
        if not self.asked and grid is not None:  # no round carried it (a secure sum opened before a resume)
            self.scores = collect(host, grid, task, self.request)
        else:
            rejected = host.accounting.rejected  # why the statistics reply that carried the counts failed
            for name in sorted({host.nodes_name(node) for node in self.asked}, key=client_order):
                if name not in self.scores.counts and name not in self.scores.left_out:
                    why = rejected.get(name, "no readable statistics reply within round-timeout")
                    self.scores.left_out[name] = f"evaluation: {why}"
            warn_left_out(self.scores, task)
        scores = self.scores
        accuracy, per_task, scored = score(host, scores, task)
        scored = {**scored, PENDING: {"mode": "federated", **scores.summary()}}
        extra: dict[str, Any] = {}
        for key, value in self.record.extra.items():
            if key == PENDING:
                extra.update(scored)
            else:
                extra[key] = value
        return dataclasses.replace(self.record, accuracy=accuracy, per_task_accuracy=per_task, extra=extra)
