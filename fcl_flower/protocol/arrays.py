"""Arrays in Flower records: tensors in, tensors out, checked, and how many bytes that took.

Clients are untrusted: everything the server reads from a reply goes through
:func:`read_tensor`, which checks presence, dtype, shape, finiteness and magnitude (at most
``MAGNITUDE_LIMIT`` = 1e150, so float64 sums of squares cannot overflow) and raises
:class:`UploadError` (one line naming the problem) instead of letting a bad upload reach the
aggregate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

from fcl_flower.analytic.checks import MAGNITUDE_LIMIT
from fcl_flower.protocol.errors import UploadError

WIRE_DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: What an upload's arrays may be: real floats and signed integers (no complex, no unsigned, no bool,
#: no float16 whose range a sum overflows at 65504).
ACCEPTED_DTYPES = frozenset(np.dtype(t) for t in ("float32", "float64", "int8", "int16", "int32", "int64"))


def to_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Tensors -> ArrayRecord (detached, contiguous, on the CPU)."""
    return ArrayRecord({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return dict(record.to_torch_state_dict())


def cast_for_wire(tensor: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype '{wire_dtype}'; use one of {', '.join(WIRE_DTYPES)}")
    return tensor.to(WIRE_DTYPES[wire_dtype]) if tensor.is_floating_point() else tensor


def payload_bytes(content: RecordDict) -> int:
    """Numeric payload of all arrays in a message, measured from the serialised arrays.

    Each serialised Array is an .npy buffer: header + raw data. We count the raw data (what the
    papers' formulas count), read back from the buffer itself, not from our own bookkeeping.
    """
    total = 0
    for record in content.array_records.values():
        for array in record.values():
            data = array.numpy()
            assert len(array.data) >= data.nbytes  # header + data
            total += data.nbytes
    return total


def message_bytes(content: RecordDict) -> int:
    """Size of the whole serialised reply (protobuf), arrays, metrics and framing included."""
    return recorddict_to_proto(content).ByteSize()


def read_tensor(
    record: ArrayRecord,
    key: str,
    *,
    shape: Sequence[int] | None = None,
    ndim: int | None = None,
    floating: bool | None = None,
    finite: bool = True,
    nonnegative: bool = False,
) -> torch.Tensor:
    """Fetch one array from an untrusted reply and check it; raise UploadError if it is bad."""
    data = _fetch(record, key)
    if data.dtype not in ACCEPTED_DTYPES:
        raise UploadError(f"array '{key}' has dtype {data.dtype}; uploads are float32/float64 or signed integers")
    tensor = torch.from_numpy(np.array(data, copy=True))
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise UploadError(f"array '{key}' has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if ndim is not None and tensor.ndim != ndim:
        raise UploadError(f"array '{key}' has {tensor.ndim} dims, expected {ndim}")
    if floating is True and not tensor.is_floating_point():
        raise UploadError(f"array '{key}' must be floating point, got {tensor.dtype}")
    if floating is False and tensor.is_floating_point():
        raise UploadError(f"array '{key}' must be integer, got {tensor.dtype}")
    if finite and tensor.is_floating_point():
        if not torch.isfinite(tensor).all():
            raise UploadError(f"array '{key}' contains NaN or inf")
        if tensor.numel() and float(tensor.abs().max()) > MAGNITUDE_LIMIT:
            raise UploadError(f"array '{key}' has an entry beyond {MAGNITUDE_LIMIT:g} in magnitude")
    if nonnegative and (tensor < 0).any():
        raise UploadError(f"array '{key}' has negative entries")
    return tensor


def read_ring(record: ArrayRecord, key: str, *, shape: Sequence[int]) -> np.ndarray:
    """Fetch one masked secure-aggregation array (uint64 ring elements) and check its shape."""
    data = _fetch(record, key)
    if data.dtype != np.uint64:
        raise UploadError(f"masked array '{key}' has dtype {data.dtype}, expected uint64")
    if tuple(data.shape) != tuple(shape):
        raise UploadError(f"array '{key}' has shape {tuple(data.shape)}, expected {tuple(shape)}")
    return np.array(data, copy=True)


def _fetch(record: ArrayRecord, key: str) -> np.ndarray:
    if key not in record:
        raise UploadError(f"missing array '{key}'")
    try:
        return record[key].numpy()
    except Exception as exc:  # malformed buffer
        raise UploadError(f"array '{key}' cannot be decoded ({type(exc).__name__})") from None
