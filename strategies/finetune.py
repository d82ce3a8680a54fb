"""``finetune``, the lower bound: later tasks are learned by plain FedAvg fine-tuning of the whole
model on the new classes only, so forgetting shows."""

from __future__ import annotations

from strategies.gradient import GradientStrategy


class FinetuneStrategy(GradientStrategy):
    """Local SGD + sample-weighted FedAvg of the trainable state, task after task."""
