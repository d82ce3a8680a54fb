"""FedAvg client: train the global model on this client's data of the current task."""

from __future__ import annotations

from clients.job import ClientJob
from fcl_flower.fcl.training import ExtraLoss, local_sgd
from fcl_flower.protocol import TrainRes


def train_locally(job: ClientJob, extra_loss: ExtraLoss | None = None, ce_from: int = 0) -> TrainRes:
    """``local-epochs`` of SGD on this client's data of the task, and the trained state back.

    Every gradient client shares it (the same optimiser, schedule and batches): LwF and EWC add
    their regulariser and limit the cross-entropy to the new task's classes (``ce_from``)."""
    stats = local_sgd(
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
    return job.train_reply(stats.num_examples, stats.mean_loss)


def handle_fedavg(job: ClientJob) -> TrainRes:
    """Plain local SGD: stage 1 of every method and the ``finetune`` lower bound afterwards."""
    return train_locally(job)
