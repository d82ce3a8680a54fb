"""The lean readers of fcl_flower/protocol/arrays.py agree with Flower's own, to the byte.

``message_bytes`` computes a reply's protobuf size from its structure (no second serialisation),
``payload_bytes`` the arrays' raw data from their .npy headers (no copy), ``read_tensor`` reads
the values in place: each must equal what Flower's serialisation and ``Array.numpy()`` give.
"""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

from fcl_flower.protocol import UploadError, message_bytes, payload_bytes
from fcl_flower.protocol.arrays import npy_layout, npy_view
from fcl_flower.tensors import read_tensor


def contents() -> list[RecordDict]:
    rng = np.random.default_rng(0)
    sizes = [0, 1, 15, 16, 127, 128, 2047, 2048, 16_383, 16_384, 300_000]  # around the varint boundaries
    out = [
        RecordDict(),
        RecordDict({"arrays": ArrayRecord()}),
        RecordDict({"metrics": MetricRecord({"partition-id": 3, "num-examples": 10, "loss": 0.25})}),
        RecordDict({"header": ConfigRecord({"run-id": "x", "round": 2, "flag": True, "blob": b"\x00\x01"})}),
    ]
    for n in sizes:
        arrays = {
            "gram-packed": Array(rng.random(n).astype(np.float32)),
            "class-sums": Array(rng.random((n // 3 + 1, 3))),
            "counts": Array(np.arange(n % 7, dtype=np.int64)),
            "": Array(np.zeros((0, 4))),
        }
        out.append(
            RecordDict(
                {
                    "header": ConfigRecord({"run-id": "stsa-abc", "phase": "stsa-stats", "task": 1}),
                    "arrays": ArrayRecord(arrays),
                    "backfill-0": ArrayRecord({"x": Array(rng.random(n))}),
                    "metrics": MetricRecord({"partition-id": 1, "num-examples": n}),
                }
            )
        )
    out.append(RecordDict({"": ArrayRecord({"x": Array(np.zeros(2))})}))  # an empty record name: no key field
    big = torch.rand(1_100_000, dtype=torch.float64)  # > 2 MiB arrays: a 4-byte length prefix
    out.append(RecordDict({"arrays": ArrayRecord({"w": big, "b": big[:5].float()})}))
    return out


@pytest.mark.parametrize("index", range(len(contents())))
def test_message_bytes_equals_the_protobuf_size(index: int) -> None:
    content = contents()[index]
    assert message_bytes(content) == recorddict_to_proto(content).ByteSize()


@pytest.mark.parametrize("index", range(len(contents())))
def test_payload_bytes_equals_the_arrays_nbytes(index: int) -> None:
    content = contents()[index]
    expected = sum(a.numpy().nbytes for r in content.array_records.values() for a in r.values())
    assert payload_bytes(content) == expected


def test_views_equal_flowers_own_reading_and_copy_nothing() -> None:
    rng = np.random.default_rng(1)
    for values in (rng.random((5, 7)), rng.random(10).astype(np.float32), np.asfortranarray(rng.random((4, 3)))):
        array = Array(values)
        view = npy_view(array)
        assert np.array_equal(view, array.numpy()) and view.dtype == values.dtype
        assert not view.flags.writeable  # a view of the message's bytes, not a copy
    record = ArrayRecord({"g": Array(rng.random(100).astype(np.float32))})
    shared = read_tensor(record, "g", copy=False)
    owned = read_tensor(record, "g")
    assert torch.equal(shared, owned)
    owned += 1  # the default is a private, writable copy
    assert not torch.equal(shared, owned)


def test_a_truncated_or_padded_buffer_is_rejected() -> None:
    array = Array(np.arange(10, dtype=np.float64))
    for data in (array.data[:-8], array.data + b"\x00" * 8, b"\x93NUMPY garbage", b""):
        broken = Array(dtype=array.dtype, shape=array.shape, stype=array.stype, data=data)
        with pytest.raises(UploadError, match="cannot be decoded"):
            read_tensor(ArrayRecord({"x": broken}), "x")


def _npy(values: np.ndarray, version: tuple[int, int] | None = None, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, values, version=version, allow_pickle=allow_pickle)
    return buffer.getvalue()


def test_npy_layout_reads_every_header_version_and_refuses_the_rest() -> None:
    values = np.arange(6, dtype=np.int32).reshape(2, 3)
    for version in ((1, 0), (2, 0), (3, 0)):
        data = _npy(values, version)
        dtype, shape, fortran, offset = npy_layout(data)
        assert (dtype, shape, fortran) == (np.dtype(np.int32), (2, 3), False)
        assert offset == len(data) - values.nbytes and data[offset:] == values.tobytes()
    assert npy_layout(_npy(np.asfortranarray(values)))[2] is True
    assert npy_layout(_npy(np.float64(2.5)))[1] == ()  # a 0-d array: one value
    for data, message in (
        (b"", "not an .npy buffer"),
        (b"\x93NUMPY\x01", "not an .npy buffer"),  # shorter than magic + version + header length
        (b"\x93NUMPX" + _npy(values)[6:], "not an .npy buffer"),
        (_npy(np.array([1, None], dtype=object), allow_pickle=True), "object arrays are not accepted"),
        (_npy(values)[:-1], "buffer length does not match its header"),
        (_npy(values) + b"\x00", "buffer length does not match its header"),
    ):
        with pytest.raises(ValueError) as info:
            npy_layout(data)
        assert str(info.value) == message


def test_message_bytes_refuses_an_unknown_record_type() -> None:
    with pytest.raises(ValueError) as info:
        message_bytes({"x": 5})  # type: ignore[arg-type]
    assert str(info.value) == "unsupported record type: int"


def test_reading_in_place_warns_nothing_in_a_fresh_process() -> None:
    """torch warns once per process about a read-only array; read_tensor silences exactly that."""
    record = ArrayRecord({"g": Array(np.arange(3, dtype=np.float64))})
    assert read_tensor(record, "g", copy=False).tolist() == [0.0, 1.0, 2.0]
    code = (
        "import numpy as np\n"
        "from flwr.app import Array, ArrayRecord\n"
        "from fcl_flower.tensors import read_tensor\n"
        "t = read_tensor(ArrayRecord({'g': Array(np.arange(3.0))}), 'g', copy=False)\n"
        "print(t.tolist())\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[0.0, 1.0, 2.0]"


def test_message_bytes_counts_a_negative_shape_entry_as_protobuf_does() -> None:
    negative = Array(dtype="float64", shape=(-1, 3), stype="numpy.ndarray", data=b"abc")  # int32 -1: a 10-byte varint
    content = RecordDict({"odd": ArrayRecord({"x": negative})})
    assert message_bytes(content) == recorddict_to_proto(content).ByteSize()
