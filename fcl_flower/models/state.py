"""What travels between server and clients, freezing, and device choice."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from .base import ModelError

__all__ = ["freeze", "full_state", "load_trainable_state", "pick_device", "trainable_state", "trainable_tensors"]

M = TypeVar("M", bound=nn.Module)


#: model -> (its parameters' identities and requires_grad flags, the keys computed for them)
_KEYS: WeakKeyDictionary[nn.Module, tuple[tuple[tuple[int, bool], ...], list[str]]] = WeakKeyDictionary()


def _trainable_keys(model: nn.Module) -> list[str]:
    """state_dict keys of trainable parameters and of running-statistics buffers, in
    state_dict (module registration) order, which is deterministic for a given architecture.
    Computed again only when a parameter is replaced (a module added, swapped or grown) or its
    ``requires_grad`` changed: a client loads the global model into the same cached model every
    message (clients/job.py), and walking every module for them was ~1 ms of each."""
    flags = tuple((id(p), p.requires_grad) for p in model.parameters())
    cached = _KEYS.get(model)
    if cached is None or cached[0] != flags:
        cached = _KEYS[model] = (flags, _compute_trainable_keys(model))
    return list(cached[1])


def _compute_trainable_keys(model: nn.Module) -> list[str]:
    wanted = {name for name, p in model.named_parameters() if p.requires_grad}
    for mod_name, module in model.named_modules():
        if isinstance(module, _NormBase):  # BatchNorm*/InstanceNorm*/SyncBatchNorm
            prefix = f"{mod_name}." if mod_name else ""
            wanted.update(prefix + b for b, v in module.named_buffers(recurse=False) if v is not None)
    return [k for k in model.state_dict(keep_vars=True) if k in wanted]


def trainable_state(model: nn.Module) -> dict[str, Tensor]:
    """The part of ``model`` that FedAvg averages and broadcasts.

    Trainable parameters (``requires_grad``) plus normalisation running statistics
    (BatchNorm ``running_mean`` / ``running_var`` / ``num_batches_tracked``), which STSA [CODE]
    averages along with the weights. Values are detached CPU copies (ready for numpy / the wire,
    and unaffected by later training); key order is deterministic.
    """
    sd = model.state_dict(keep_vars=True)
    return {k: sd[k].detach().to(device="cpu", copy=True) for k in _trainable_keys(model)}


def trainable_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The tensors :func:`trainable_state` copies, themselves (no copy): their names, shapes and
    dtypes say how a packed state splits (fcl_flower/tensors.py, ``state_views``). Read only."""
    sd = model.state_dict(keep_vars=True)
    return {k: sd[k] for k in _trainable_keys(model)}


def load_trainable_state(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy ``state`` (as produced by :func:`trainable_state`) into ``model`` in place.

    Strict: the keys must be exactly the model's trainable keys and shapes must match; values are
    cast to each target's device and dtype.
    """
    keys = _trainable_keys(model)
    missing = [k for k in keys if k not in state]
    unexpected = [k for k in state if k not in set(keys)]
    if missing or unexpected:
        raise ModelError(
            f"trainable state mismatch: {len(missing)} missing {missing[:3]}, "
            f"{len(unexpected)} unexpected {unexpected[:3]}"
        )
    targets = model.state_dict(keep_vars=True)
    for k in keys:
        value = state[k]
        if not isinstance(value, Tensor):
            value = torch.as_tensor(value)
        if tuple(value.shape) != tuple(targets[k].shape):
            raise ModelError(
                f"trainable state shape mismatch for {k!r}: got {tuple(value.shape)}, "
                f"expected {tuple(targets[k].shape)}"
            )
    with torch.no_grad():
        for k in keys:
            value = state[k]
            if not isinstance(value, Tensor):
                value = torch.as_tensor(value)
            targets[k].copy_(value)


def full_state(model: nn.Module) -> dict[str, Tensor]:
    """Everything needed to rebuild the (frozen) model: the full state_dict as detached CPU copies."""
    return {k: v.detach().to(device="cpu", copy=True) for k, v in model.state_dict().items()}


def freeze(model: M) -> M:
    """Put ``model`` in eval mode (BN uses running stats, no dropout) and stop all gradients.

    Used once stage 1 is over: the feature extractor F is fixed for every later stage.
    """
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def pick_device(prefer_gpu: bool = True) -> torch.device:
    """CUDA when available and wanted, else CPU."""
    if prefer_gpu and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")
