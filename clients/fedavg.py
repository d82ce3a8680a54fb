"""FedAvg client: train the global model on this client's data of the current task."""

from __future__ import annotations

from flwr.app import Message

from clients.job import ClientJob, make_reply
from clients.training import local_sgd
from fcl_flower.models import trainable_state


def handle_fedavg(message: Message, job: ClientJob) -> Message:
    """Plain local SGD: stage 1 of every method and the ``finetune`` lower bound afterwards."""
    stats = local_sgd(job.model, job.local_data(eval_transform=False), job.cfg, lr=job.lr,
                      num_seen=job.num_seen, device=job.device, seed=_round_seed(job))
    return make_reply(message, job, trainable_state(job.model), stats.num_examples,
                      {"train-loss": stats.mean_loss})


def _round_seed(job: ClientJob) -> int:
    """Shuffling differs per client and round but is reproducible for a given run seed."""
    return (job.cfg.seed * 100_003 + int(job.round_config.get("server-round", 0))) * 1_009 + job.partition
