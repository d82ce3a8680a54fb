"""Tensors at the protocol's edge: the protocol (fcl_flower/protocol) reads and writes NumPy arrays
only, so a message without a model never imports torch (issue 32); handlers that compute with
torch convert here, zero-copy where the values allow.

* :func:`state_record` / :func:`state_views` -- a model state in a message: one Array per dtype,
  split again by the receiver's own layout (:func:`~fcl_flower.protocol.arrays.pack_state`);
* :func:`tensor_record` -- tensors -> ArrayRecord (detached, on the CPU, contiguous: the same bytes
  Flower writes for a tensor, ``tensor.detach().cpu().numpy()``);
* :func:`record_tensors` -- ArrayRecord -> tensors (``torch.from_numpy`` of Flower's
  ``Array.numpy()``: what ``ArrayRecord.to_torch_state_dict()`` gives); :func:`record_views` the
  same as views of the message's bytes (no copy), for a reader that copies them on;
* :func:`read_tensor` -- :func:`~fcl_flower.protocol.arrays.read_array` as a tensor (a view of the
  checked array: of the message's bytes with ``copy=False``, of a private copy otherwise);
* :func:`cast_for_wire` / :data:`WIRE_DTYPES` -- the run's wire dtype as torch casts it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord

from fcl_flower.protocol.arrays import (
    Layout,
    from_record,
    is_packed_state,
    pack_state,
    read_array,
    to_record,
    unpack_state,
    view_record,
    wire_dtype_of,
)

WIRE_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def numpy_of(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values as a C-contiguous NumPy array (a view where the tensor already is one)."""
    return tensor.detach().cpu().contiguous().numpy()


def tensor_of(values: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy``, also of a read-only view (torch warns that it must not be written to:
    nothing writes to a view of a message's bytes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(values)


def tensor_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    return to_record({k: numpy_of(v) for k, v in tensors.items()})


def record_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in from_record(record).items()}


def record_views(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """:func:`record_tensors` without the copies: read-only views of the message's bytes
    (:func:`~fcl_flower.protocol.arrays.view_record`), for a reader that copies them on."""
    return {k: tensor_of(v) for k, v in view_record(record).items()}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty((), dtype=dtype).numpy().dtype


def tensor_layout(tensors: Mapping[str, torch.Tensor]) -> Layout:
    """(name, NumPy dtype, shape) of every tensor, in order: what :func:`state_views` splits by."""
    return tuple((name, numpy_dtype(t.dtype), tuple(int(s) for s in t.shape)) for name, t in tensors.items())


def state_record(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """A model state for a message: one Array per dtype (:func:`~fcl_flower.protocol.arrays.pack_state`)."""
    return pack_state({k: numpy_of(v) for k, v in state.items()})


def state_views(record: ArrayRecord, layout: Layout) -> dict[str, torch.Tensor]:
    """A model state of a message as read-only views of its bytes: packed for ``layout``
    (:func:`state_record`; another layout is refused in one line), or one array per key."""
    if is_packed_state(record):
        return {k: tensor_of(v) for k, v in unpack_state(record, layout).items()}
    return record_views(record)


def cast_for_wire(tensor: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    wire_dtype_of(wire_dtype)  # refuses an unknown name, with the protocol's one line
    return tensor.to(WIRE_DTYPES[wire_dtype]) if tensor.is_floating_point() else tensor


def read_tensor(
    record: ArrayRecord,
    key: str,
    *,
    shape: Sequence[int] | None = None,
    ndim: int | None = None,
    floating: bool | None = None,
    finite: bool = True,
    nonnegative: bool = False,
    copy: bool = True,
) -> torch.Tensor:
    """One checked array of an untrusted reply as a tensor (:func:`read_array`'s checks)."""
    values = read_array(
        record, key, shape=shape, ndim=ndim, floating=floating, finite=finite, nonnegative=nonnegative, copy=copy
    )
    return tensor_of(values)
