"""FedAvg client: train the global model on this client's data of the current task."""

from __future__ import annotations

import dataclasses
import time

from clients.job import ClientJob
from fcl_flower.fcl.training import ExtraLoss, TrainStats, local_sgd
from fcl_flower.protocol import TrainIns, TrainRes


def _local_sgd(job: ClientJob, extra_loss: ExtraLoss | None = None, ce_from: int = 0) -> TrainStats:
    return local_sgd(
        job.model,
        job.local_data(eval_transform=False),
        job.cfg,
        lr=job.lr,
        num_seen=job.num_seen,
        device=job.device,
        seed=job.round_seed(),
        extra_loss=extra_loss,
        ce_from=ce_from,
    )


def train_locally(job: ClientJob, extra_loss: ExtraLoss | None = None, ce_from: int = 0) -> TrainRes:
    """``local-epochs`` of SGD on this client's data of the task, and the trained state back.

    Every gradient client shares it (the same optimiser, schedule and batches): LwF and EWC add
    their regulariser and limit the cross-entropy to the new task's classes (``ce_from``).

    The reply's ``train-seconds`` is the wall time of the local epochs alone (not the data, the
    model or the reply), what a deployment benchmark subtracts from a round (issue 32); a metric
    only, the trained state is the same."""
    began = time.perf_counter()
    stats = _local_sgd(job, extra_loss, ce_from)
    seconds = time.perf_counter() - began
    return dataclasses.replace(job.train_reply(stats.num_examples, stats.mean_loss), train_seconds=seconds)


def handle_fedavg(job: ClientJob) -> TrainRes:
    """Plain local SGD: stage 1 of every method and the ``finetune`` lower bound afterwards.

    In a secure round (stage 1 under ``secure-aggregation``) the trained state and the sample count
    leave only masked (clients/secure.py ``masked_train_reply``), without ``train-seconds``: the time
    of the local epochs grows with the client's sample count, which a secure round keeps hidden."""
    if isinstance(job.ins, TrainIns) and job.ins.secagg is not None:
        from clients.secure import masked_train_reply

        return masked_train_reply(job, _local_sgd(job).num_examples)
    return train_locally(job)
