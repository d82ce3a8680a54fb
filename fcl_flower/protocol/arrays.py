"""Arrays in Flower records: NumPy arrays in, NumPy arrays out, checked, and how many bytes that took.

The protocol needs no torch (issue 32): a message that carries no model (``query.info``,
``query.keys``, ``query.shares``, ``query.unmask``) is parsed, handled and answered in a process
that never imports it. Where a handler needs tensors it converts at its own side, zero-copy
(:mod:`fcl_flower.tensors`: ``torch.from_numpy`` of what :func:`read_array` / :func:`from_record`
return, and a tensor's ``.numpy()`` into :func:`to_record`).

Clients are untrusted: everything the server reads from a reply goes through
:func:`read_array`, which checks presence, dtype, shape, finiteness and magnitude (at most
``MAGNITUDE_LIMIT`` = 1e150, so float64 sums of squares cannot overflow) and raises
:class:`UploadError` (one line naming the problem) instead of letting a bad upload reach the
aggregate.

Nothing is copied or serialised more often than needed. An Array holds its values as the bytes
of an ``.npy`` file; :func:`npy_view` reads the header and looks at the values in place (Flower's
``Array.numpy()`` copies them), the checks are single-pass reductions without temporaries, and
:func:`message_bytes` computes the size the reply has as a protobuf from the record structure and
the arrays' lengths instead of serialising it again.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import config_record_to_proto, metric_record_to_proto

from fcl_flower.limits import MAGNITUDE_LIMIT
from fcl_flower.protocol.errors import UploadError

#: the dtypes floating-point uploads travel in (run config ``wire-dtype``)
WIRE_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}
#: What an upload's arrays may be: real floats and signed integers (no complex, no unsigned, no bool,
#: no float16 whose range a sum overflows at 65504).
ACCEPTED_DTYPES = frozenset(np.dtype(t) for t in ("float32", "float64", "int8", "int16", "int32", "int64"))
_NPY_MAGIC = b"\x93NUMPY"
_MAX_NPY_HEADER = 10_000  # an .npy header of our arrays is ~128 bytes; numpy's own default limit


def to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Arrays -> ArrayRecord, each serialised C-contiguous by :func:`npy_array` (the bytes Flower
    writes for the same values given as a contiguous CPU tensor)."""
    return ArrayRecord({k: npy_array(v) for k, v in arrays.items()})


def npy_array(values: np.ndarray) -> Array:
    """A Flower Array holding ``values`` as an ``.npy`` buffer: the bytes ``np.save`` writes for
    their C-ordered copy (same header, same values), built with one copy of the values (Flower's
    ``Array.from_numpy_ndarray`` makes three: ``tobytes``, a growing BytesIO and ``getvalue``;
    ~13 ms per 8 MB upload here, issue 30)."""
    values = _c_order(values)
    if values.dtype.hasobject:
        raise ValueError("object arrays are not accepted")
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(values))
    data = b"".join((head.getvalue(), memoryview(values.reshape(-1)).cast("B")))  # type: ignore[arg-type]  # ndarray is a buffer
    return Array(dtype=str(values.dtype), shape=tuple(values.shape), stype="numpy.ndarray", data=data)


def _c_order(values: np.ndarray) -> np.ndarray:
    if not isinstance(values, np.ndarray):
        raise TypeError(f"expected a NumPy array, got {type(values).__name__} (tensors: fcl_flower.tensors)")
    return values if values.flags.c_contiguous else values.copy(order="C")  # keeps 0-d arrays 0-d


def from_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    """ArrayRecord -> writable NumPy arrays (Flower's ``Array.numpy()``: one copy each)."""
    return {k: v.numpy() for k, v in record.items()}


def view_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The arrays of a record as read-only views of its bytes (no copy; :func:`npy_view`): for a
    reader that copies them on (e.g. ``load_trainable_state``), never for one that writes."""
    return {key: npy_view(array) for key, array in record.items()}


def wire_dtype_of(wire_dtype: str) -> np.dtype:
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype '{wire_dtype}'; use one of {', '.join(WIRE_DTYPES)}")
    return WIRE_DTYPES[wire_dtype]


def cast_for_wire(values: np.ndarray, wire_dtype: str) -> np.ndarray:
    """Floating-point values in the wire dtype (integers, counts and ids, as they are)."""
    dtype = wire_dtype_of(wire_dtype)
    return values.astype(dtype) if values.dtype.kind == "f" else values


# ------------------------------------------------------------------------------------ .npy bytes
def npy_layout(data: bytes) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """(dtype, shape, Fortran order, offset of the values) of an ``.npy`` buffer; ValueError if it
    is not one, or if its length is not exactly header + values."""
    if len(data) < 10 or data[:6] != _NPY_MAGIC:
        raise ValueError("not an .npy buffer")
    # the header's length field (2 bytes in version 1.0, 4 in 2.0/3.0) bounds what is parsed; the
    # parse (numpy's, an ast.literal_eval) is cached by the header's bytes: a message repeats the
    # same few headers (~0.15 ms each)
    size = 10 + int.from_bytes(data[8:10], "little") if data[6] == 1 else 12 + int.from_bytes(data[8:12], "little")
    dtype, shape, fortran, offset = _parse_npy_header(bytes(data[: min(len(data), size, 12 + _MAX_NPY_HEADER)]))
    if len(data) != offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise ValueError("buffer length does not match its header")
    return dtype, shape, fortran, offset


@functools.lru_cache(maxsize=256)
def _parse_npy_header(header: bytes) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    head = io.BytesIO(header)
    version = np.lib.format.read_magic(head)
    dtype: np.dtype
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(head, max_header_size=_MAX_NPY_HEADER)
    elif version in ((2, 0), (3, 0)):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(head, max_header_size=_MAX_NPY_HEADER)
    else:  # pragma: no cover - read_magic already refuses unknown versions
        raise ValueError(f"unsupported .npy version {version}")
    if dtype.hasobject:
        raise ValueError("object arrays are not accepted")
    return dtype, tuple(int(s) for s in shape), bool(fortran), head.tell()


def npy_view(array: Array) -> np.ndarray:
    """The values of a serialised Array, read in place: a read-only view of its bytes, no copy."""
    data = array.data
    dtype, shape, fortran, offset = npy_layout(data)
    flat = np.frombuffer(data, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)), offset=offset)
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


# ------------------------------------------------------------------------------------ model states
#: A model's state travels as one Array per dtype (issue 32). Flower moves every Array of a message
#: as objects of its own, one request each on every hop (ServerApp -> SuperLink -> SuperNode ->
#: ClientApp process, and back): a state of 20 tensors was ~40 requests a hop, ~20-40 ms each on a
#: loaded node. The receiver splits the values by its own copy of the model's layout (names, dtypes,
#: shapes in order), so nothing of the layout is parsed from the message: the key names the dtype
#: and a digest of the layout, and a state packed for another layout does not match.
PACKED_STATE = "state:"

#: (name, dtype, shape) of every array of a state, in order
Layout = tuple[tuple[str, np.dtype, tuple[int, ...]], ...]


def layout_of(arrays: Mapping[str, np.ndarray]) -> Layout:
    return tuple((name, np.dtype(values.dtype), tuple(int(s) for s in values.shape)) for name, values in arrays.items())


@functools.lru_cache(maxsize=64)
def packed_keys(layout: Layout) -> Mapping[str, tuple[int, ...]]:
    """The record keys of ``layout``'s packed state (``state:<dtype>@<layout digest>``) and the
    positions in ``layout`` of the arrays each one holds, in order."""
    text = json.dumps([[name, dtype.str, list(shape)] for name, dtype, shape in layout])
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    keys: dict[str, list[int]] = {}
    for position, (_, dtype, _) in enumerate(layout):
        keys.setdefault(f"{PACKED_STATE}{dtype.name}@{digest}", []).append(position)
    return MappingProxyType({key: tuple(positions) for key, positions in keys.items()})  # cached: read-only


def is_packed_state(record: ArrayRecord) -> bool:
    return any(key.startswith(PACKED_STATE) for key in record)


def pack_state(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """A state's arrays as one Array per dtype, each the concatenation of its arrays' C-ordered
    values in the state's order (one copy of the values)."""
    items = [_c_order(values) for values in arrays.values()]
    keys = packed_keys(layout_of(dict(zip(arrays, items, strict=True))))
    return ArrayRecord(
        {key: npy_array(np.concatenate([items[p].reshape(-1) for p in positions])) for key, positions in keys.items()}
    )


def unpack_state(record: ArrayRecord, layout: Layout) -> dict[str, np.ndarray]:
    """The arrays of a state packed for ``layout`` (:func:`pack_state`), as read-only views of the
    message's bytes, in ``layout``'s order; UploadError (one line) if ``record`` is not exactly
    that: other keys, or a packed array of another dtype, shape or length."""
    keys = packed_keys(layout)
    if set(record.keys()) != set(keys):
        raise UploadError("the model state is not packed for this model's layout (another model or version)")
    out: dict[str, np.ndarray] = {}
    for key, positions in keys.items():
        flat = _fetch(record, key)
        dtype = layout[positions[0]][1]
        sizes = [int(np.prod(layout[p][2], dtype=np.int64)) for p in positions]
        if flat.dtype != dtype or flat.ndim != 1 or flat.size != sum(sizes):
            raise UploadError(
                f"packed state '{key}' holds {flat.dtype} of shape {tuple(flat.shape)}, expected {dtype} ({sum(sizes)},)"
            )
        offset = 0
        for position, size in zip(positions, sizes, strict=True):
            name, _, shape = layout[position]
            out[name] = flat[offset : offset + size].reshape(shape)
            offset += size
    return {name: out[name] for name, _, _ in layout}


def check_values(key: str, values: np.ndarray) -> None:
    """:func:`read_array`'s finiteness and magnitude test of floating-point ``values``."""
    if values.size and values.dtype.kind == "f":
        _check_range(key, float(values.min()), float(values.max()))  # no temporaries; NaN propagates


def _check_range(key: str, low: float, high: float) -> None:
    if not (np.isfinite(low) and np.isfinite(high)):
        raise UploadError(f"array '{key}' contains NaN or inf")
    if max(-low, high) > MAGNITUDE_LIMIT:
        raise UploadError(f"array '{key}' has an entry beyond {MAGNITUDE_LIMIT:g} in magnitude")


# ------------------------------------------------------------------------------------ byte counts
def payload_bytes(content: RecordDict) -> int:
    """Numeric payload of all arrays in a message, measured from the serialised arrays.

    Each serialised Array is an .npy buffer: header + raw data. We count the raw data (what the
    papers' formulas count): the buffer's length less its header, read from the buffer itself, not
    from our own bookkeeping. UploadError (one line) for an array that is not an ``.npy`` buffer.
    """
    total = 0
    for name, record in content.array_records.items():
        for key, array in record.items():
            try:  # every array of the reply: also those of a record its method never reads
                _, _, _, offset = npy_layout(array.data)
            except ValueError as exc:
                raise UploadError(f"array '{key}' of record '{name}' cannot be decoded ({exc})") from None
            total += len(array.data) - offset
    return total


def _varint_size(value: int) -> int:
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def _field(tag_size: int, length: int) -> int:
    """Bytes of a length-delimited field (bytes, string, sub-message) whose content is ``length`` long."""
    return tag_size + _varint_size(length) + length


def _array_proto_size(array: Array) -> int:
    """Bytes of flwr.proto.Array {dtype=1, shape=2 (packed int32), stype=3, data=4}."""
    size = 0
    for text in (array.dtype, array.stype):
        if text:
            size += _field(1, len(text.encode("utf-8")))
    if array.shape:
        packed = sum(_varint_size(s) if s >= 0 else 10 for s in array.shape)
        size += _field(1, packed)
    if array.data:
        size += _field(1, len(array.data))
    return size


def message_bytes(content: RecordDict) -> int:
    """Size of the whole serialised reply as a protobuf (flwr.proto.RecordDict: arrays, metrics,
    configs and framing), computed from the record structure without serialising it again: equal
    to ``recorddict_to_proto(content).ByteSize()`` (tests/test_wire_bytes.py), without a copy of
    the arrays."""
    total = 0
    for key, record in content.items():
        key_size = _field(1, len(key.encode("utf-8"))) if key else 0
        if isinstance(record, ArrayRecord):
            body = 0
            for name, array in record.items():
                item = (_field(1, len(name.encode("utf-8"))) if name else 0) + _field(1, _array_proto_size(array))
                body += _field(1, item)
        elif isinstance(record, MetricRecord):
            body = metric_record_to_proto(record).ByteSize()
        elif isinstance(record, ConfigRecord):
            body = config_record_to_proto(record).ByteSize()
        else:
            raise ValueError(f"unsupported record type: {type(record).__name__}")
        total += _field(1, key_size + _field(1, body))
    return total


# ------------------------------------------------------------------------------------ reading
def read_array(
    record: ArrayRecord,
    key: str,
    *,
    shape: Sequence[int] | None = None,
    ndim: int | None = None,
    floating: bool | None = None,
    finite: bool = True,
    nonnegative: bool = False,
    copy: bool = True,
) -> np.ndarray:
    """Fetch one array from an untrusted reply and check it; raise UploadError if it is bad.

    ``copy=False`` returns a read-only view of the message's bytes (no copy): for large arrays that
    are only read (summed, checked), never written to. The dtype is the upload's.
    """
    values = _fetch(record, key)
    if values.dtype not in ACCEPTED_DTYPES:
        raise UploadError(f"array '{key}' has dtype {values.dtype}; uploads are float32/float64 or signed integers")
    if shape is not None and tuple(values.shape) != tuple(shape):
        raise UploadError(f"array '{key}' has shape {tuple(values.shape)}, expected {tuple(shape)}")
    if ndim is not None and values.ndim != ndim:
        raise UploadError(f"array '{key}' has {values.ndim} dims, expected {ndim}")
    is_float = values.dtype.kind == "f"
    if floating is True and not is_float:
        raise UploadError(f"array '{key}' must be floating point, got {values.dtype}")
    if floating is False and is_float:
        raise UploadError(f"array '{key}' must be integer, got {values.dtype}")
    if values.size and ((finite and is_float) or nonnegative):
        low, high = float(values.min()), float(values.max())  # no temporaries; NaN propagates to both
        if finite and is_float:
            _check_range(key, low, high)
        if nonnegative and low < 0:
            raise UploadError(f"array '{key}' has negative entries")
    return np.array(values, copy=True) if copy else values


def read_ring(record: ArrayRecord, key: str, *, shape: Sequence[int], copy: bool = True) -> np.ndarray:
    """Fetch one masked secure-aggregation array (uint64 ring elements) and check its shape."""
    values = _fetch(record, key)
    if values.dtype != np.uint64:
        raise UploadError(f"masked array '{key}' has dtype {values.dtype}, expected uint64")
    if tuple(values.shape) != tuple(shape):
        raise UploadError(f"array '{key}' has shape {tuple(values.shape)}, expected {tuple(shape)}")
    return np.array(values, copy=True) if copy else values


def _fetch(record: ArrayRecord, key: str) -> np.ndarray:
    if key not in record:
        raise UploadError(f"missing array '{key}'")
    array = record[key]
    try:
        if array.stype != "numpy.ndarray":
            raise ValueError(f"serialisation type '{array.stype}'")
        return npy_view(array)
    except Exception as exc:  # malformed buffer
        raise UploadError(f"array '{key}' cannot be decoded ({type(exc).__name__})") from None
