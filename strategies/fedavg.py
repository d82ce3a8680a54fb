"""FedAvg as a component: reading clients' model states and merging them into the global model.

Stage 1 of every analytic method and every round of the gradient methods use it (spec: the
STSA method notes, docs/methods/stsa.md §2.2): sample-weighted averaging (``weighted-fedavg``)
of the trainable parameters and BatchNorm statistics; a round whose clients report no examples
at all falls back to the plain mean.

``stage1-aggregation`` swaps the mean for one of Flower's Byzantine-robust rules (median,
trimmed-mean, krum, multikrum, bulyan). The arithmetic is Flower's own, never rewritten here:
the mean is ``aggregate_arrayrecords`` (``flwr.serverapp.strategy.strategy_utils``); median,
trimmed-mean and bulyan the ``aggregate_train`` of Flower's FedMedian, FedTrimmedAvg and Bulyan;
krum and multikrum ``select_multikrum`` then ``aggregate_arrayrecords``, the body of Krum's and
MultiKrum's ``aggregate_train`` (docs/privacy.md, "Stage 1").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import cast

import torch
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy.multikrum import select_multikrum
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from torch import nn

from fcl_flower.config import RunConfig, stage1_shortfall
from fcl_flower.models import load_trainable_state, trainable_state
from fcl_flower.protocol import Reply, TrainRes, UploadError
from fcl_flower.protocol.payloads import read_state
from strategies.base import RoundFailed

ARRAYS, METRICS, WEIGHT = "arrays", "metrics", "num-examples"  # the keys Flower's strategies read


def fedavg_weights(num_examples: Sequence[int], weighted: bool) -> list[float]:
    weights = [float(n) if weighted else 1.0 for n in num_examples]
    return weights if sum(weights) > 0 else [1.0] * len(weights)


@dataclass(frozen=True)
class Aggregation:
    """How a FedAvg round merges the clients' models (the ``stage1-*`` knobs)."""

    rule: str = "fedavg"
    byzantine: int = 1  # f: malicious clients per round the robust rule must withstand
    trim_fraction: float = 0.2  # trimmed-mean: Flower's beta
    select: int = 0  # multikrum: models averaged (0: clients - f)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Aggregation:
        return cls(cfg.stage1_aggregation, cfg.stage1_byzantine, cfg.stage1_trim_fraction, cfg.stage1_multikrum_select)

    def selected(self, clients: int) -> int:
        """Multi-Krum's number of models averaged among ``clients`` (Krum: 1)."""
        if self.rule == "krum":
            return 1
        return max(1, min(self.select or clients - self.byzantine, clients))

    def flower_strategy(self) -> FlowerFedAvg:
        """Flower's strategy whose ``aggregate_train`` applies this rule (median, trimmed-mean, bulyan)."""
        if self.rule == "median":
            return FedMedian(train_metrics_aggr_fn=_no_metrics)
        if self.rule == "trimmed-mean":
            return FedTrimmedAvg(beta=self.trim_fraction, train_metrics_aggr_fn=_no_metrics)
        if self.rule == "bulyan":
            return Bulyan(num_malicious_nodes=self.byzantine, train_metrics_aggr_fn=_no_metrics)
        raise ValueError(f"stage1-aggregation '{self.rule}' has no Flower strategy here")


def _check(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> list[str]:
    """The states' common keys, after checking there is something to merge."""
    if not states:
        raise ValueError("nothing to average")
    if len(states) != len(weights):
        raise ValueError("one weight per state is needed")
    if float(sum(weights)) <= 0 or any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative with a positive sum")
    keys = list(states[0].keys())
    for state in states[1:]:
        if list(state.keys()) != keys:
            raise ValueError("states have different keys")
    return keys


def _records(
    states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], keys: Sequence[str]
) -> list[RecordDict]:
    """One reply's content per client, as Flower's strategies read it: its floating tensors in
    float64 under ``arrays``, its weight under ``metrics``/``num-examples``.

    float64 because :func:`aggregate_arrayrecords` accumulates ``value * weight`` in the arrays'
    own dtype (NumPy keeps float32 for a float32 array times a Python float): fed the clients'
    float32 states as they arrive it sums in float32, and the merged model differs from the
    float64 mean (measured on the default small CNN, five clients: 37 % of the entries differ,
    by up to 1.4e-4 relative): no longer the float64 accumulation the project keeps. Fed float64, it performs
    exactly the float64 sum of ``value * (w / total)`` in client order that this project's
    average always did: the merged model, and the default result, are the same bit for bit.
    """
    return [
        RecordDict(
            {
                ARRAYS: ArrayRecord({k: Array(state[k].detach().to(torch.float64).numpy()) for k in keys}),
                METRICS: MetricRecord({WEIGHT: float(weight)}),
            }
        )
        for state, weight in zip(states, weights, strict=True)
    ]


def _counters(states: Sequence[Mapping[str, torch.Tensor]], key: str, robust: bool) -> torch.Tensor:
    """Integer buffers (``num_batches_tracked``) are counters, not estimates: the mean takes their
    max; a robust rule their lower median (an honest client's count when most are honest)."""
    stacked = torch.stack([s[key] for s in states])
    return stacked.median(dim=0).values if robust else stacked.amax(dim=0)


def average_states(
    states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], aggregation: Aggregation | None = None
) -> dict[str, torch.Tensor]:
    """Merge model states key by key: Flower's weighted mean in float64 (``aggregation`` None or
    fedavg) or Flower's robust rule; each tensor keeps the first state's dtype."""
    keys = _check(states, weights)
    rule = aggregation or Aggregation()
    floating = [k for k in keys if states[0][k].is_floating_point()]
    merged: dict[str, torch.Tensor] = {}
    if floating:
        records = _records(states, weights, floating)
        if rule.rule == "fedavg":
            arrays = aggregate_arrayrecords(records, WEIGHT)
        else:
            arrays = _robust(rule, records)
        merged = {k: torch.from_numpy(arrays[k].numpy()).to(states[0][k].dtype) for k in floating}
    for key in keys:
        if key not in merged:
            merged[key] = _counters(states, key, robust=rule.rule != "fedavg")
    return {key: merged[key] for key in keys}


def _robust(rule: Aggregation, records: list[RecordDict]) -> ArrayRecord:
    """Flower's robust rule over the clients' records.

    median, trimmed-mean, bulyan: the strategy's ``aggregate_train`` on replies built here, since
    FedMedian's coordinate-wise median and Bulyan's whole rule (Multi-Krum selection, median,
    closest-to-median mean) exist only inside it, not as functions; it also runs Flower's own
    checks (one ArrayRecord, the same keys, the weight present). Its metrics are not needed and
    not aggregated (:func:`_no_metrics`). Flower's Bulyan returns nothing below 4f + 3 replies:
    the round fails and the model stays as it was.

    krum, multikrum: Flower's ``select_multikrum`` then ``aggregate_arrayrecords`` over the chosen,
    which is all that Krum's and MultiKrum's ``aggregate_train`` do, called here directly so that
    chosen replies whose counts sum to 0 are averaged plainly (as :func:`fedavg_weights` does)
    instead of ending the server in Flower's ZeroDivisionError.
    """
    clients = len(records)
    shortfall = stage1_shortfall(rule.rule, clients, rule.byzantine, rule.trim_fraction)
    if rule.rule == "bulyan" and shortfall:
        raise RoundFailed(f"stage1-aggregation {shortfall}")
    if shortfall:
        log(WARNING, "stage1-aggregation %s this round: its guarantee does not hold", shortfall)
    if rule.rule in ("krum", "multikrum"):
        chosen = select_multikrum(records, rule.byzantine, rule.selected(clients))
        if sum(cast(float, r.metric_records[METRICS][WEIGHT]) for r in chosen) <= 0:  # the floats _records put
            for record in chosen:
                record[METRICS] = MetricRecord({WEIGHT: 1.0})
        return aggregate_arrayrecords(chosen, WEIGHT)
    replies = [Message(content=record, dst_node_id=0, message_type=MessageType.TRAIN) for record in records]
    arrays, _ = rule.flower_strategy().aggregate_train(0, replies)
    if arrays is None:
        raise RoundFailed(f"stage1-aggregation {rule.rule}: Flower's rule gave no model for {clients} replies")
    return arrays


def _no_metrics(records: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """The strategies' metrics aggregation, skipped: the stage loop keeps its own round metrics,
    and Flower's weighted mean of them divides by the chosen replies' counts (0 if they claim 0)."""
    return MetricRecord()


class FedAvg:
    def __init__(self, model: nn.Module, weighted: bool, aggregation: Aggregation | None = None) -> None:
        self.model = model
        self.weighted = weighted
        self.aggregation = aggregation or Aggregation()

    def read(self, reply: Reply) -> dict[str, torch.Tensor]:
        """A client's trainable state, with exactly the global model's keys and shapes."""
        if not isinstance(reply, TrainRes):
            raise UploadError("expected a training reply")
        return read_state(reply.model, trainable_state(self.model))

    def average(
        self, states: Sequence[dict[str, torch.Tensor]], num_examples: Sequence[int]
    ) -> dict[str, torch.Tensor]:
        return average_states(list(states), fedavg_weights(num_examples, self.weighted), self.aggregation)

    def aggregate(self, states: Sequence[dict[str, torch.Tensor]], num_examples: Sequence[int]) -> None:
        load_trainable_state(self.model, self.average(states, num_examples))
