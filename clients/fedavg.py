"""FedAvg client: train the global model on this client's data of the current task."""

from __future__ import annotations

from clients.job import ClientJob
from fcl_flower.fcl.training import local_sgd
from fcl_flower.protocol import TrainRes


def handle_fedavg(job: ClientJob) -> TrainRes:
    """Plain local SGD: stage 1 of every method and the ``finetune`` lower bound afterwards."""
    stats = local_sgd(
        job.model,
        job.local_data(eval_transform=False),
        job.cfg,
        lr=job.lr,
        num_seen=job.num_seen,
        device=job.device,
        seed=job.round_seed(),
    )
    return job.train_reply(stats.num_examples, stats.mean_loss)
