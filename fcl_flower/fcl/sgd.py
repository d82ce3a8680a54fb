"""SGD with momentum and weight decay: the update of ``torch.optim.SGD``, without ``torch.optim``.

Why not ``torch.optim.SGD``: constructing any ``torch.optim`` optimiser (and its ``zero_grad``
and ``step``) imports ``torch._dynamo`` on first use, which pulls in sympy and the compiler
stack: ~3.5 s of CPU, more than the whole ClientApp otherwise costs for a FedAvg round on a
real SuperNode, where Flower starts a fresh process for every message. Local SGD needs none of
that.

The update is the one ``torch.optim.SGD(params, lr, momentum, weight_decay)`` applies with
``dampening=0``, ``nesterov=False``, ``maximize=False`` (its per-tensor path, which it takes for
CPU tensors), in the same operations and order, so the trained weights are bit-for-bit those of
``torch.optim.SGD`` (tests/test_client_startup.py checks it):

    g = grad + weight_decay * p            (if weight_decay != 0)
    b = g (first step), else b = momentum * b + g
    p = p - lr * b                          (b replaced by g when momentum == 0)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class MomentumSGD:
    """``torch.optim.SGD`` (momentum, weight decay, no dampening, no Nesterov) for a parameter list."""

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.params = list(params)
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD needs lr, momentum, weight_decay >= 0 (got {lr}, {momentum}, {weight_decay})")
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        """Drop the gradients (``set_to_none=True``, as ``torch.optim`` does by default)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            grad = p.grad
            if self.weight_decay != 0:
                grad = grad.add(p, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = self.buffers[i]
                if buf is None:
                    buf = grad.detach().clone()
                    self.buffers[i] = buf
                else:
                    buf.mul_(self.momentum).add_(grad, alpha=1.0)
                grad = buf
            p.add_(grad, alpha=-self.lr)
