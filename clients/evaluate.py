"""Federated evaluation on the client: score the global model on this node's own held-out data.

The server sends the global model (and, for an analytic method, its ridge classifier W); the
client predicts every held-out sample of the classes seen so far, exactly as the server would
centrally (fcl_flower.runtime: ``predict_ridge`` / ``predict_logits``), and answers with two
counts per seen class -- correct predictions and samples. No prediction, feature or sample
leaves the node.

The evaluation of a stage may ride with the next stage's statistics instruction
(:class:`~fcl_flower.protocol.EvaluationRequest`): :func:`riding_evaluation` scores it first,
exactly as its own ``evaluate`` message would, and the statistics reply carries the counts.
"""

from __future__ import annotations

import torch
from flwr.app import Context

from clients.features import cache_for
from clients.job import ClientJob
from fcl_flower import methods
from fcl_flower.analytic import random_projection
from fcl_flower.metrics import class_counts
from fcl_flower.protocol import EvaluateIns, EvaluateRes, ProtocolError, StatsIns, to_record
from fcl_flower.runtime import predict_logits, predict_ridge
from fcl_flower.tensors import record_tensors


def handle_evaluate(job: ClientJob) -> EvaluateRes:
    ins = job.ins
    assert isinstance(ins, EvaluateIns)
    cfg, num_seen = job.cfg, ins.num_seen
    test = job.data.test(ins.header.task)
    if methods.get(cfg.strategy).family is methods.Family.ANALYTIC:
        projection = random_projection(job.model.backbone.feature_dim, cfg.rf_dim, seed=cfg.seed)
        weights = _ridge_weights(ins, projection, job.model.backbone.feature_dim)
        cache = cache_for(job, f"the held-out data of tasks 0..{ins.header.task}")
        preds, labels = predict_ridge(job.model, test, cfg, job.device, weights, projection, cache)
    else:
        preds, labels = predict_logits(job.model, test, cfg, job.device, num_seen)
    correct, total = class_counts(preds.numpy(), labels.numpy(), num_seen)
    counts = to_record({"correct": correct, "total": total})
    return EvaluateRes(ins.header, job.partition, int(total.sum()), counts=counts)


def riding_evaluation(ins: StatsIns, context: Context) -> EvaluateRes | None:
    """The counts of the evaluation riding with a statistics instruction (None: none rides)."""
    if ins.evaluate is None:
        return None
    from clients.job import make_job

    return handle_evaluate(make_job(ins.evaluate.instruction(ins), context))


def _ridge_weights(ins: EvaluateIns, projection: torch.Tensor | None, feature_dim: int) -> torch.Tensor | None:
    """W from the server, shape-checked: (M, num_seen) with M the random-feature dimension."""
    if ins.ridge is None:
        return None  # no classifier yet (a failed first stage): every prediction is class 0
    arrays = record_tensors(ins.ridge)
    if set(arrays) != {"weights"}:
        raise ProtocolError("the ridge record must hold exactly 'weights'")
    weights = arrays["weights"].to(torch.float64)
    dim = feature_dim if projection is None else int(projection.shape[1])
    if tuple(weights.shape) != (dim, ins.num_seen):
        raise ProtocolError(f"ridge weights of shape {tuple(weights.shape)}, expected ({dim}, {ins.num_seen})")
    return weights
