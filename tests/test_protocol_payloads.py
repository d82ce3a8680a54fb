"""Arrays in records and the typed payloads: every check of an untrusted upload, one bad input at a
time, each expecting its one-line UploadError; what a read returns, in which dtype (issue 19)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from fcl_flower.protocol.arrays import cast_for_wire as cast_numpy
from fcl_flower.protocol.arrays import (
    from_record,
    message_bytes,
    npy_array,
    npy_layout,
    npy_view,
    payload_bytes,
    read_ring,
    to_record,
    view_record,
)
from fcl_flower.protocol.errors import UploadError
from fcl_flower.protocol.payloads import (
    FedranStats,
    MaskedStsaStats,
    StsaEStats,
    StsaStats,
    prototype_record,
    read_counts,
    read_fisher,
    read_prototypes,
    read_state,
)
from fcl_flower.tensors import cast_for_wire, read_tensor, record_tensors, tensor_record

F64, F32 = torch.float64, torch.float32


def _raises(call, message: str, error: type[Exception] = UploadError) -> None:
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message


def _record(**arrays) -> ArrayRecord:
    """Keys with '_' become '-' (record keys of the protocol)."""
    return ArrayRecord({k.replace("_", "-"): Array(np.asarray(v)) for k, v in arrays.items()})


NOT_ACCEPTED = "; uploads are float32/float64 or signed integers"
GARBAGE = Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=b"not an npy buffer")


# =============================================================================== arrays
READ_TENSOR_BAD = [
    ("missing", lambda: read_tensor(_record(y=np.zeros(2)), "x"), "missing array 'x'"),
    ("undecodable", lambda: read_tensor(ArrayRecord({"x": GARBAGE}), "x"), "array 'x' cannot be decoded (ValueError)"),
    *[
        (name, lambda array=array: read_tensor(_record(x=array), "x"), f"array 'x' has dtype {dtype}{NOT_ACCEPTED}")
        for name, array, dtype in (
            ("strings", np.array(["a", "b"]), "<U1"),
            ("bools", np.array([True, False]), "bool"),
            ("float16", np.zeros(2, dtype=np.float16), "float16"),  # a sum overflows at 65504
            ("complex", np.zeros(2, dtype=np.complex64), "complex64"),
            ("uint8", np.zeros(2, dtype=np.uint8), "uint8"),
            ("uint64", np.zeros(2, dtype=np.uint64), "uint64"),  # ring elements only through read_ring
        )
    ],
    ("shape", lambda: read_tensor(_record(x=np.zeros(2)), "x", shape=(3,)), "array 'x' has shape (2,), expected (3,)"),
    ("ndim", lambda: read_tensor(_record(x=np.zeros(2)), "x", ndim=2), "array 'x' has 1 dims, expected 2"),
    (
        "not floating",
        lambda: read_tensor(_record(x=np.zeros(2, dtype=np.int64)), "x", floating=True),
        "array 'x' must be floating point, got int64",
    ),
    (
        "not integer",
        lambda: read_tensor(_record(x=np.zeros(2, dtype=np.float32)), "x", floating=False),
        "array 'x' must be integer, got float32",
    ),
    ("nan", lambda: read_tensor(_record(x=np.array([1.0, np.nan])), "x"), "array 'x' contains NaN or inf"),
    ("inf", lambda: read_tensor(_record(x=np.array([np.inf])), "x"), "array 'x' contains NaN or inf"),
    (
        "just beyond 1e150",
        lambda: read_tensor(_record(x=np.array([0.0, np.nextafter(1e150, np.inf)])), "x"),
        "array 'x' has an entry beyond 1e+150 in magnitude",
    ),
    (
        "-2e150",
        lambda: read_tensor(_record(x=np.array([1.0, -2e150])), "x"),
        "array 'x' has an entry beyond 1e+150 in magnitude",
    ),
    (
        "negative",
        lambda: read_tensor(_record(x=np.array([1.0, -0.5])), "x", nonnegative=True),
        "array 'x' has negative entries",
    ),
    (
        "negative ints",
        lambda: read_tensor(_record(x=np.array([-1])), "x", nonnegative=True),
        "array 'x' has negative entries",
    ),
    ("ring missing", lambda: read_ring(_record(y=np.zeros(2)), "x", shape=(2,)), "missing array 'x'"),
    (
        "ring dtype",
        lambda: read_ring(_record(x=np.zeros(2, dtype=np.int64)), "x", shape=(2,)),
        "masked array 'x' has dtype int64, expected uint64",
    ),
    (
        "ring shape",
        lambda: read_ring(_record(x=np.zeros(2, dtype=np.uint64)), "x", shape=(2, 1)),
        "array 'x' has shape (2,), expected (2, 1)",
    ),
]


@pytest.mark.parametrize("call, message", [c[1:] for c in READ_TENSOR_BAD], ids=[c[0] for c in READ_TENSOR_BAD])
def test_read_tensor_and_read_ring_reject_bad_arrays(call, message) -> None:
    _raises(call, message)


def test_read_tensor_accepts_what_its_checks_allow() -> None:
    ints = read_tensor(_record(x=np.array([[1, -2]])), "x", shape=(1, 2), ndim=2)
    assert ints.dtype == torch.int64 and ints.tolist() == [[1, -2]]  # negatives allowed by default
    assert read_tensor(_record(x=np.array([1, 2])), "x", floating=False).tolist() == [1, 2]
    assert read_tensor(_record(x=np.array([1.5])), "x", floating=None).tolist() == [1.5]
    assert read_tensor(_record(x=np.array([3])), "x", floating=None).tolist() == [3]
    kept = read_tensor(_record(x=np.array([np.nan, 1.0])), "x", finite=False)
    assert bool(kept.isnan()[0]) and kept[1] == 1.0
    assert read_tensor(_record(x=np.array([0.0, 2.0])), "x", nonnegative=True).tolist() == [0.0, 2.0]
    assert read_tensor(_record(x=np.zeros(2, dtype=np.float32)), "x").dtype == F32  # the dtype is kept
    for dtype in (np.int8, np.int16, np.int32, np.int64, np.float32, np.float64):  # every accepted dtype
        accepted = read_tensor(_record(x=np.array([-3, 2], dtype=dtype)), "x")
        assert accepted.tolist() == [-3, 2] and accepted.numpy().dtype == np.dtype(dtype)
    edge = read_tensor(_record(x=np.array([1e150, -1e150])), "x")  # exactly the limit is allowed
    assert edge.tolist() == [1e150, -1e150]
    assert read_tensor(_record(x=np.array([5e200])), "x", finite=False).tolist() == [5e200]  # unchecked
    assert read_tensor(_record(x=np.array([5e200])), "x", finite=False, nonnegative=True).tolist() == [5e200]
    for values in ([1.0, np.inf], [-np.inf, 1.0]):  # one infinite end: still "NaN or inf"
        _raises(lambda values=values: read_tensor(_record(x=np.array(values)), "x"), "array 'x' contains NaN or inf")
    assert read_tensor(_record(x=np.zeros((0, 3))), "x", shape=(0, 3)).shape == (0, 3)  # empty: no peak
    ring = read_ring(_record(x=np.array([[1, 2**64 - 1]], dtype=np.uint64)), "x", shape=(1, 2))
    assert ring.dtype == np.uint64 and ring.tolist() == [[1, 2**64 - 1]]


def test_cast_for_wire() -> None:
    x64, ints = torch.tensor([0.1], dtype=F64), torch.tensor([3])
    assert cast_for_wire(x64, "float32").dtype == F32
    assert cast_for_wire(x64.float(), "float64").dtype == F64
    assert cast_for_wire(ints, "float32").dtype == torch.int64  # counts and ids are not floats
    _raises(
        lambda: cast_for_wire(x64, "float16"), "unknown wire dtype 'float16'; use one of float32, float64", ValueError
    )


def test_numpy_protocol_writes_the_bytes_flower_writes_for_tensors() -> None:
    """The protocol is NumPy only (issue 32): its records hold, byte for byte, what Flower writes
    for the same values as tensors (transposed, 0-d, bool, int), and reading back gives writable
    arrays; a tensor handed to the NumPy API is refused, not silently converted."""
    tensors = {
        "t": torch.arange(6.0, dtype=F32).reshape(2, 3).T,  # not contiguous
        "s": torch.tensor(7),
        "b": torch.tensor([True, False]),
        "w": torch.randn(3, 2, dtype=F64, requires_grad=True),
    }
    flower = ArrayRecord({k: v.detach().cpu().contiguous() for k, v in tensors.items()})  # what to_record did
    ours = tensor_record(tensors)
    assert list(ours) == list(flower)
    for key in tensors:
        assert (ours[key].data, ours[key].dtype, ours[key].shape) == (
            flower[key].data,
            flower[key].dtype,
            flower[key].shape,
        )
    plain = to_record({k: v.detach().numpy() for k, v in tensors.items()})
    assert all(plain[k].data == flower[k].data for k in tensors)
    back = from_record(plain)
    assert all(isinstance(v, np.ndarray) and v.flags.writeable for v in back.values()) and back["s"].shape == ()
    _raises(
        lambda: to_record({"x": torch.zeros(2)}),
        "expected a NumPy array, got Tensor (tensors: fcl_flower.tensors)",
        TypeError,
    )
    x64 = np.array([0.1])
    assert cast_numpy(x64, "float32").dtype == np.float32 and cast_numpy(x64, "float32")[0] == np.float32(0.1)
    assert cast_numpy(np.array([3]), "float32").dtype == np.int64
    _raises(lambda: cast_numpy(x64, "float16"), "unknown wire dtype 'float16'; use one of float32, float64", ValueError)


def test_records_round_trip_and_byte_counts_by_hand() -> None:
    tensors = {"a": torch.tensor([1.0, 2.0, 3.0], dtype=F32), "b": torch.arange(4).reshape(2, 2)}
    back = record_tensors(tensor_record(tensors))
    assert set(back) == {"a", "b"}
    assert torch.equal(back["a"], tensors["a"]) and torch.equal(back["b"], tensors["b"])
    content = RecordDict({"one": tensor_record(tensors), "two": tensor_record({"c": torch.zeros(5, dtype=F64)})})
    assert payload_bytes(content) == 3 * 4 + 4 * 8 + 5 * 8
    assert payload_bytes(RecordDict({})) == 0
    assert payload_bytes(RecordDict({"one": tensor_record({"a": torch.zeros(2)})})) == 8
    small = RecordDict({"x": tensor_record({"v": torch.zeros(10, dtype=F64)})})
    large = RecordDict({"x": tensor_record({"v": torch.zeros(110, dtype=F64)})})
    assert message_bytes(small) > payload_bytes(small)  # framing and .npy headers on top of the data
    assert message_bytes(large) - message_bytes(small) >= 100 * 8


@pytest.mark.parametrize(
    "values",
    [np.ones((), np.float32), np.arange(6, dtype=np.int64).reshape(2, 3), np.zeros((0, 4)), np.arange(7.0)],
    ids=["0-d", "int64 2x3", "empty", "float64 vector"],
)
def test_npy_array_writes_the_bytes_flower_writes_with_one_copy(values) -> None:
    """The fast serialisation (one copy of the values, issue 30) is byte for byte Flower's own."""
    ours, flowers = npy_array(values), Array.from_numpy_ndarray(values)
    assert ours.data == flowers.data
    assert (ours.dtype, tuple(ours.shape), ours.stype) == (flowers.dtype, tuple(flowers.shape), flowers.stype)
    assert np.array_equal(ours.numpy(), values) and ours.numpy().shape == values.shape


def test_npy_array_of_a_strided_array_round_trips_in_c_order() -> None:
    values = np.arange(6.0).reshape(2, 3).T
    array = npy_array(values)
    assert np.array_equal(npy_view(array), values) and np.array_equal(array.numpy(), values)


def test_cached_npy_header_parse_still_refuses_a_wrong_length_or_truncated_header() -> None:
    data = npy_array(np.arange(4.0)).data
    assert npy_layout(data)[:2] == (np.dtype(np.float64), (4,))
    with pytest.raises(ValueError, match="buffer length does not match its header"):
        npy_layout(data + b"\0" * 8)
    with pytest.raises(ValueError):
        npy_layout(data[:20])


def test_view_record_views_the_record_bytes_and_equals_from_record() -> None:
    record = to_record({"w": np.arange(6.0).reshape(2, 3), "n": np.array(3)})
    views, copies = view_record(record), from_record(record)
    assert all(np.array_equal(views[k], copies[k]) and views[k].shape == copies[k].shape for k in copies)
    assert not views["w"].flags.writeable and views["w"].ctypes.data == npy_view(record["w"]).ctypes.data  # no copy


# =============================================================================== payloads
def test_unexpected_arrays_are_named() -> None:
    record = tensor_record(
        {"gram-packed": torch.zeros(3), "class-sums": torch.zeros(2, 1), "b": torch.zeros(1), "a": torch.zeros(1)}
    )
    _raises(lambda: StsaStats.read(record, packed=3, dim=2, classes=1), "unexpected array(s) a, b")


def test_read_state_and_fisher() -> None:
    expected = {"w": torch.zeros(2, 3), "n": torch.zeros((), dtype=torch.int64)}
    state = read_state(tensor_record({"w": torch.ones(2, 3), "n": torch.tensor(7)}), expected)
    assert set(state) == {"w", "n"} and state["w"].tolist() == [[1.0] * 3] * 2 and int(state["n"]) == 7
    assert state["w"].dtype == F32 and state["n"].dtype == torch.int64
    _raises(  # a float parameter sent as integers
        lambda: read_state(tensor_record({"w": torch.ones(2, 3, dtype=torch.int64), "n": torch.tensor(7)}), expected),
        "array 'w' must be floating point, got int64",
    )
    _raises(  # an integer buffer (e.g. BatchNorm's num_batches_tracked) sent as a float
        lambda: read_state(tensor_record({"w": torch.ones(2, 3), "n": torch.tensor(7.5)}), expected),
        "array 'n' must be integer, got float32",
    )
    _raises(
        lambda: read_state(tensor_record({"w": torch.ones(2, 3), "n": torch.tensor(7), "z": torch.ones(1)}), expected),
        "model state keys differ from the global model's",
    )
    _raises(
        lambda: read_state(tensor_record({"w": torch.ones(2, 3)}), expected),
        "model state keys differ from the global model's",
    )
    _raises(
        lambda: read_state(tensor_record({"w": torch.ones(3, 2), "n": torch.tensor(7)}), expected),
        "array 'w' has shape (3, 2), expected (2, 3)",
    )
    params = {"w": torch.zeros(2), "b": torch.zeros(1)}
    fisher = read_fisher(tensor_record({"w": torch.tensor([0.5, 0.0], dtype=F32), "b": torch.tensor([2.0])}), params)
    assert fisher["w"].dtype == F64 and fisher["w"].tolist() == [0.5, 0.0] and fisher["b"].tolist() == [2.0]
    unknown = tensor_record({k: torch.zeros(1) for k in ("w", "b", "z", "y", "x", "v")})
    _raises(lambda: read_fisher(unknown, params), "Fisher has unknown parameter(s): v, x, y")
    _raises(lambda: read_fisher(tensor_record({"w": torch.zeros(2)}), params), "missing array 'b'")
    bad = [
        ({"w": torch.tensor([0.5, -1.0]), "b": torch.zeros(1)}, "array 'w' has negative entries"),
        ({"w": torch.tensor([1, 0]), "b": torch.zeros(1)}, "array 'w' must be floating point, got int64"),
        ({"w": torch.zeros(3), "b": torch.zeros(1)}, "array 'w' has shape (3,), expected (2,)"),
    ]
    for arrays, message in bad:
        _raises(lambda arrays=arrays: read_fisher(tensor_record(arrays), params), message)


def test_stsa_stats_read() -> None:
    packed, sums = torch.tensor([1.0, 2.0, 3.0], dtype=F64), torch.tensor([[0.1], [0.2]], dtype=F64)
    counts = torch.tensor([4])
    got = StsaStats.read(StsaStats(packed, sums, counts).to_record("float32"), packed=3, dim=2, classes=1)
    assert got.gram_packed.dtype == F32 and got.gram_packed.tolist() == [1.0, 2.0, 3.0]  # wire precision
    assert got.class_sums.dtype == F64 and got.class_sums.tolist() == sums.float().double().tolist()
    assert got.counts.dtype == F64 and got.counts.tolist() == [4.0]  # integers on the wire, float64 read
    assert set(StsaStats(packed, sums, counts).to_record("float64").keys()) == {"gram-packed", "class-sums", "counts"}
    float_counts = StsaStats.read(
        StsaStats(packed, sums, counts.double()).to_record("float32"), packed=3, dim=2, classes=1
    )
    assert float_counts.counts.dtype == F64 and float_counts.counts.tolist() == [4.0]
    bad = [
        (StsaStats(packed.long(), sums, counts), "array 'gram-packed' must be floating point, got int64"),
        (StsaStats(packed, sums.long(), counts), "array 'class-sums' must be floating point, got int64"),
        (StsaStats(packed, sums.T, counts), "array 'class-sums' has shape (1, 2), expected (2, 1)"),
        (StsaStats(packed[:2], sums, counts), "array 'gram-packed' has shape (2,), expected (3,)"),
        (StsaStats(packed, sums * float("nan"), counts), "array 'class-sums' contains NaN or inf"),
        (StsaStats(packed, sums, torch.tensor([-1])), "array 'counts' has negative entries"),
        (StsaStats(packed, sums, torch.tensor([1, 2])), "array 'counts' has shape (2,), expected (1,)"),
        (StsaStats(packed, sums, torch.tensor([float("inf")])), "array 'counts' contains NaN or inf"),
        (
            StsaStats(packed, sums, torch.tensor([2e150], dtype=F64)),
            "array 'counts' has an entry beyond 1e+150 in magnitude",
        ),
        (StsaStats(packed * 1e300, sums, counts), "array 'gram-packed' has an entry beyond 1e+150 in magnitude"),
    ]
    for payload, message in bad:
        _raises(
            lambda payload=payload: StsaStats.read(payload.to_record("float64"), packed=3, dim=2, classes=1), message
        )
    no_counts = tensor_record({"gram-packed": packed, "class-sums": sums})
    _raises(lambda: StsaStats.read(no_counts, packed=3, dim=2, classes=1), "missing array 'counts'")


def test_masked_stsa_stats_round_trip_and_checks() -> None:
    gram, sums = np.array([1, 2, 2**63], dtype=np.uint64), np.array([[5], [6]], dtype=np.uint64)
    counts = np.array([7, 2**64 - 1], dtype=np.uint64)  # one class and the withheld count
    masked = MaskedStsaStats(gram, sums, counts)
    got = MaskedStsaStats.read(masked.to_record(), packed=3, dim=2, classes=1)
    assert got.gram_packed.tolist() == [1, 2, 2**63] and got.class_sums.tolist() == [[5], [6]]
    assert got.counts.tolist() == [7, 2**64 - 1] and got.counts.dtype == np.uint64
    assert set(masked.to_record().keys()) == {"gram-packed", "class-sums", "counts"}
    record = masked.to_record()
    _raises(
        lambda: MaskedStsaStats.read(record, packed=4, dim=2, classes=1),
        "array 'gram-packed' has shape (3,), expected (4,)",
    )
    _raises(
        lambda: MaskedStsaStats.read(record, packed=3, dim=1, classes=2),
        "array 'class-sums' has shape (2, 1), expected (1, 2)",
    )
    _raises(  # the counts carry classes + 1 entries: c counts and the withheld samples
        lambda: MaskedStsaStats.read(MaskedStsaStats(gram, sums, counts[:1]).to_record(), packed=3, dim=2, classes=1),
        "array 'counts' has shape (1,), expected (2,)",
    )
    for changed, name in (
        (MaskedStsaStats(gram.astype(np.int64), sums, counts), "gram-packed"),
        (MaskedStsaStats(gram, sums.astype(np.int64), counts), "class-sums"),
        (MaskedStsaStats(gram, sums, counts.astype(np.int64)), "counts"),
    ):
        _raises(
            lambda changed=changed: MaskedStsaStats.read(changed.to_record(), packed=3, dim=2, classes=1),
            f"masked array '{name}' has dtype int64, expected uint64",
        )
    extra = ArrayRecord(
        {"gram-packed": Array(gram), "class-sums": Array(sums), "counts": Array(counts), "x": Array(gram)}
    )
    _raises(lambda: MaskedStsaStats.read(extra, packed=3, dim=2, classes=1), "unexpected array(s) x")
    no_counts = ArrayRecord({"gram-packed": Array(gram), "class-sums": Array(sums)})
    _raises(lambda: MaskedStsaStats.read(no_counts, packed=3, dim=2, classes=1), "missing array 'counts'")


def test_large_uploads_are_read_in_place_the_rest_copied() -> None:
    """G (packed) and the masked arrays are views of the reply's bytes (only summed, never written);
    C and the counts, and read_ring/read_tensor by default, are private writable copies."""
    packed, sums = torch.tensor([1.0, 2.0, 3.0], dtype=F64), torch.tensor([[0.1], [0.2]], dtype=F64)
    record = StsaStats(packed, sums, torch.tensor([4.0], dtype=F64)).to_record("float64")
    got = StsaStats.read(record, packed=3, dim=2, classes=1)
    assert np.shares_memory(got.gram_packed.numpy(), npy_view(record["gram-packed"]))
    assert not np.shares_memory(got.class_sums.numpy(), npy_view(record["class-sums"]))
    assert not np.shares_memory(got.counts.numpy(), npy_view(record["counts"]))
    ring = np.array([1, 2, 3], dtype=np.uint64)
    masked_record = MaskedStsaStats(ring, ring.reshape(3, 1), ring[:2]).to_record()
    masked = MaskedStsaStats.read(masked_record, packed=3, dim=3, classes=1)
    for name, values in (
        ("gram-packed", masked.gram_packed),
        ("class-sums", masked.class_sums),
        ("counts", masked.counts),
    ):
        assert not values.flags.writeable and np.shares_memory(values, npy_view(masked_record[name]))
    owned = read_ring(masked_record, "gram-packed", shape=(3,))
    assert owned.flags.writeable and not np.shares_memory(owned, npy_view(masked_record["gram-packed"]))


def test_stsa_e_stats_read() -> None:
    sums, counts = torch.full((2, 3, 1), 0.5, dtype=F64), torch.tensor([[2], [0]])
    got = StsaEStats.read(StsaEStats(sums, counts).to_record("float32"), dummies=2, dim=3, classes=1)
    assert got.class_sums.dtype == F64 and got.class_sums.tolist() == sums.tolist()
    assert got.counts.dtype == F64 and got.counts.tolist() == [[2.0], [0.0]]
    bad = [
        (StsaEStats(sums, torch.tensor([[2], [-1]])), "array 'counts' has negative entries"),
        (StsaEStats(sums, torch.tensor([[1.5], [0.0]])), "array 'counts' has non-integer entries"),
        (StsaEStats(sums, torch.tensor([[2, 1]])), "array 'counts' has shape (1, 2), expected (2, 1)"),
        (StsaEStats(sums[:1], counts), "array 'class-sums' has shape (1, 3, 1), expected (2, 3, 1)"),
        (StsaEStats(sums.long(), counts), "array 'class-sums' must be floating point, got int64"),
        (StsaEStats(sums * float("inf"), counts), "array 'class-sums' contains NaN or inf"),
    ]
    for payload, message in bad:
        _raises(
            lambda payload=payload: StsaEStats.read(payload.to_record("float64"), dummies=2, dim=3, classes=1), message
        )


def _fedran(basis, sigma, corr) -> ArrayRecord:
    return tensor_record({"basis": basis, "singular-values": sigma, "label-corr": corr})


def test_fedran_stats_read() -> None:
    basis, sigma, corr = torch.eye(4, 2, dtype=F64), torch.tensor([3.0, 3.0], dtype=F64), torch.ones(4, 3)
    got = FedranStats.read(FedranStats(basis, sigma, corr).to_record("float32"), dim=4, classes=3, max_rank=2)
    assert got.rank == 2 and got.basis.dtype == got.singular_values.dtype == got.label_corr.dtype == F64
    assert got.basis.tolist() == basis.tolist() and got.singular_values.tolist() == [3.0, 3.0]
    assert got.label_corr.tolist() == corr.tolist()
    one = FedranStats.read(_fedran(basis[:, :1], sigma[:1], corr), dim=4, classes=3, max_rank=2)
    assert one.rank == 1
    empty = FedranStats.read(_fedran(torch.zeros(4, 0), torch.zeros(0), corr), dim=4, classes=3, max_rank=2)
    assert empty.rank == 0  # a client with no samples
    bad = [
        (_fedran(torch.ones(4), sigma, corr), "array 'basis' has 1 dims, expected 2"),
        (
            _fedran(torch.eye(4, 2, dtype=torch.int64), sigma, corr),
            "array 'basis' must be floating point, got int64",
        ),
        (_fedran(torch.eye(5, 2), sigma, corr), "basis has shape (5, 2), expected (4, r_k <= 2)"),
        (_fedran(torch.eye(4, 3), torch.ones(3), corr), "basis has shape (4, 3), expected (4, r_k <= 2)"),
        (_fedran(basis, torch.ones(3), corr), "array 'singular-values' has shape (3,), expected (2,)"),
        (_fedran(basis, torch.tensor([2, 1]), corr), "array 'singular-values' must be floating point, got int64"),
        (_fedran(basis, torch.tensor([1.0, -1.0]), corr), "array 'singular-values' has negative entries"),
        (_fedran(basis, torch.tensor([1.0, 2.0]), corr), "singular values are not in descending order"),
        (_fedran(basis, sigma, torch.ones(3, 4)), "array 'label-corr' has shape (3, 4), expected (4, 3)"),
        (
            _fedran(basis, sigma, torch.ones(4, 3, dtype=torch.int64)),
            "array 'label-corr' must be floating point, got int64",
        ),
        (_fedran(basis * 2, sigma, corr), "basis columns are not orthonormal (max |UᵀU − I| = 3.00e+00)"),
    ]
    for record, message in bad:
        _raises(lambda record=record: FedranStats.read(record, dim=4, classes=3, max_rank=2), message)
    three = _fedran(torch.eye(4, 3), torch.tensor([3.0, 1.0, 2.0]), corr)  # not descending after the first
    _raises(
        lambda: FedranStats.read(three, dim=4, classes=3, max_rank=3), "singular values are not in descending order"
    )


def test_fedran_orthonormality_tolerance_by_hand() -> None:
    """float64 basis, M = 16: tolerance 1e3·ε·√M = 1e3 · 2.220446049250313e-16 · 4; the drift
    of U = [e₀, e₁ + t·e₀] is exactly t."""
    tolerance = 1e3 * 2.220446049250313e-16 * 4.0

    def drifted(t: float) -> ArrayRecord:
        basis = torch.eye(16, 2, dtype=F64)
        basis[0, 1] = t
        return _fedran(basis, torch.tensor([2.0, 1.0], dtype=F64), torch.zeros(16, 1, dtype=F64))

    for t in (0.9995 * tolerance, tolerance):
        assert FedranStats.read(drifted(t), dim=16, classes=1, max_rank=2).rank == 2
    with pytest.raises(UploadError, match="not orthonormal"):
        FedranStats.read(drifted(1.0005 * tolerance), dim=16, classes=1, max_rank=2)


def test_prototype_gradients_round_trip_and_checks() -> None:
    shapes = [(2,), (1, 2)]
    grads = {3: [torch.ones(2, dtype=F64), torch.zeros(1, 2)], 4: [torch.full((2,), 2.0), torch.ones(1, 2)]}
    record = prototype_record(grads)
    assert set(record.keys()) == {"3/0", "3/1", "4/0", "4/1"}
    back = read_prototypes(record, range(3, 5), shapes)
    assert set(back) == {3, 4}
    assert back[3][0].dtype == F32 and back[3][0].tolist() == [1.0, 1.0] and back[4][0].tolist() == [2.0, 2.0]
    assert back[4][1].tolist() == [[1.0, 1.0]]
    assert read_prototypes(ArrayRecord(), range(3, 5), shapes) == {}
    bad = [
        ({"x": torch.zeros(2)}, "prototype gradient key 'x' is not '<class>/<index>'"),
        ({"3-0": torch.zeros(2)}, "prototype gradient key '3-0' is not '<class>/<index>'"),
        ({"3/0/1": torch.zeros(2)}, "prototype gradient key '3/0/1' is not '<class>/<index>'"),
        ({"7/0": torch.zeros(2), "7/1": torch.zeros(1, 2)}, "prototype gradient for class 7, not a class of this task"),
        ({"3/0": torch.zeros(2)}, "prototype gradient of class 3 lacks some encoder parameters"),
        (
            {"3/0": torch.zeros(2), "3/1": torch.zeros(1, 2), "3/2": torch.zeros(1)},
            "prototype gradient of class 3 lacks some encoder parameters",
        ),
        ({"3/0": torch.zeros(3), "3/1": torch.zeros(1, 2)}, "array '3/0' has shape (3,), expected (2,)"),
        (
            {"3/0": torch.zeros(2, dtype=torch.int64), "3/1": torch.zeros(1, 2)},
            "array '3/0' must be floating point, got int64",
        ),
    ]
    for arrays, message in bad:
        _raises(lambda arrays=arrays: read_prototypes(tensor_record(arrays), range(3, 5), shapes), message)


# =============================================================================== evaluate counts
def _counts(correct, total, **extra) -> ArrayRecord:
    return _record(correct=np.asarray(correct, dtype=np.int64), total=np.asarray(total, dtype=np.int64), **extra)


READ_COUNTS_BAD = [
    (_counts([1, 2], [3, 4], x=np.zeros(1)), 7, "unexpected array(s) x"),
    (_record(total=np.array([3, 4])), 7, "missing array 'correct'"),
    (_record(correct=np.array([1, 2])), 7, "missing array 'total'"),
    (_counts([1, 2, 0], [3, 4, 0]), 7, "array 'correct' has shape (3,), expected (2,)"),
    (_counts([1, 2], [[3, 4]]), 7, "array 'total' has shape (1, 2), expected (2,)"),
    (
        _record(correct=np.array([1.0, 2.0]), total=np.array([3, 4])),
        7,
        "array 'correct' must be integer, got float64",
    ),
    (
        _record(correct=np.array([1, 2]), total=np.array([3.0, 4.0])),
        7,
        "array 'total' must be integer, got float64",
    ),
    (_counts([-1, 2], [3, 4]), 7, "array 'correct' has negative entries"),
    (_counts([0, 0], [3, -1]), 2, "array 'total' has negative entries"),
    (_counts([1, 5], [3, 4]), 7, "a class has more correct predictions than test samples"),
    (_counts([4, 0], [3, 4]), 7, "a class has more correct predictions than test samples"),
    (_counts([1, 2], [3, 4]), 8, "the counts add up to 7 samples, the reply says 8"),
    (_counts([1, 2], [3, 4]), 6, "the counts add up to 7 samples, the reply says 6"),
]


@pytest.mark.parametrize(
    "record, num_examples, message", READ_COUNTS_BAD, ids=[m + str(n) for _, n, m in READ_COUNTS_BAD]
)
def test_read_counts_refuses(record, num_examples, message) -> None:
    _raises(lambda: read_counts(record, 2, num_examples), message)


def test_read_counts_accepts_honest_counts_as_int64() -> None:
    correct, total = read_counts(_counts([1, 4], [3, 4]), 2, 7)  # a class all right: correct == total
    assert correct.tolist() == [1, 4] and total.tolist() == [3, 4]
    assert correct.dtype == total.dtype == torch.int64
    narrow = _record(correct=np.array([0, 2], dtype=np.int8), total=np.array([1, 2], dtype=np.int32))
    correct, total = read_counts(narrow, 2, 3)  # narrower integers widen to int64
    assert correct.dtype == total.dtype == torch.int64 and correct.tolist() == [0, 2] and total.tolist() == [1, 2]
    zero = read_counts(_counts([0, 0, 0], [0, 0, 0]), 3, 0)  # a client without held-out samples of these classes
    assert [t.tolist() for t in zero] == [[0, 0, 0], [0, 0, 0]]
