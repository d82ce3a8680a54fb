"""A model state in a message: one Flower Array per dtype, split by the receiver's own layout (issue 32).

Flower moves every Array of a message as an object of its own, one request per hop; a state of 20
tensors cost ~40 requests on each of the four hops of a round. The packed form must carry exactly
the same values, bit for bit, and a reply packed for anything but the global model's layout, or
holding anything but finite values of the right dtype and length, is refused with one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fcl_flower.models import load_trainable_state, trainable_state, trainable_tensors
from fcl_flower.protocol import UploadError
from fcl_flower.protocol.arrays import layout_of, npy_array, pack_state, packed_keys, unpack_state
from fcl_flower.protocol.payloads import read_state
from fcl_flower.tensors import state_record, state_views, tensor_layout, tensor_record


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "conv.weight": torch.randn(4, 3, 3, 3, generator=g),
        "bn.running_mean": torch.randn(4, generator=g),
        "bn.num_batches_tracked": torch.tensor(17),  # 0-d int64 between float arrays
        "empty": torch.zeros(0, 5),
        "fc.weight": torch.randn(10, 36, generator=g),
        "fc.bias": torch.randn(10, generator=g),
    }


def _small_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.LazyLinear(3)
    )


def test_a_packed_state_holds_one_array_per_dtype_and_the_same_bits() -> None:
    state = _state()
    record = state_record(state)
    assert len(record) == 2  # float32 and int64, whatever the number of tensors
    # what Flower moves, one request each per hop: the record, and each array with its chunk
    assert len(get_all_nested_objects(record)) == 5 < len(get_all_nested_objects(tensor_record(state)))
    views = state_views(record, tensor_layout(state))
    assert list(views) == list(state)  # the state's order
    for name, value in state.items():
        assert views[name].dtype == value.dtype and views[name].shape == value.shape
        assert views[name].numpy().tobytes() == value.numpy().tobytes()
    read = read_state(record, state)
    assert all(torch.equal(read[k], state[k]) for k in state)
    assert all(read[k].numpy().flags.writeable for k in state)  # copies, not views of the message


def test_the_old_form_one_array_per_key_still_reads() -> None:
    state = _state()
    read = read_state(tensor_record(state), state)
    assert all(torch.equal(read[k], state[k]) for k in state)
    views = state_views(tensor_record(state), tensor_layout(state))
    assert all(torch.equal(views[k], state[k]) for k in state)


def test_a_model_loads_a_packed_state_bit_for_bit() -> None:
    torch.manual_seed(0)
    source, target = _small_cnn(), _small_cnn()
    x = torch.randn(2, 1, 6, 6)
    source(x), target(x)  # materialise the lazy layers
    record = state_record(trainable_state(source))
    load_trainable_state(target, state_views(record, tensor_layout(trainable_tensors(target))))
    for (k, a), b in zip(trainable_state(source).items(), trainable_state(target).values(), strict=True):
        assert a.numpy().tobytes() == b.numpy().tobytes(), k


def _tamper(record: ArrayRecord, key: str, values: np.ndarray) -> ArrayRecord:
    out = ArrayRecord(dict(record.items()))
    out[key] = npy_array(values)
    return out


def _float_key(state: dict[str, torch.Tensor]) -> str:
    return next(k for k in packed_keys(tensor_layout(state)) if "float32" in k)


@pytest.mark.parametrize(
    ("attack", "reason"),
    [
        ("another layout", "not packed for this model's layout"),
        ("one value short", "expected float32"),
        ("one value more", "expected float32"),
        ("float64 values", "expected float32"),
        ("2-d", "expected float32"),
        ("extra key", "not packed for this model's layout"),
        ("a key missing", "not packed for this model's layout"),
        ("NaN", "contains NaN or inf"),
        ("inf", "contains NaN or inf"),
    ],
)
def test_a_reply_packed_otherwise_is_refused_with_its_reason(attack: str, reason: str) -> None:
    state = _state()
    record = state_record(state)
    key = _float_key(state)
    flat = np.array(record[key].numpy())
    if attack == "another layout":  # the same values, one tensor shaped otherwise
        other = {**state, "fc.weight": state["fc.weight"].reshape(36, 10)}
        record = state_record(other)
    elif attack == "one value short":
        record = _tamper(record, key, flat[:-1])
    elif attack == "one value more":
        record = _tamper(record, key, np.concatenate([flat, flat[:1]]))
    elif attack == "float64 values":
        record = _tamper(record, key, flat.astype(np.float64))
    elif attack == "2-d":
        record = _tamper(record, key, flat.reshape(1, -1))
    elif attack == "extra key":
        record = _tamper(record, "extra", flat[:3])
    elif attack == "a key missing":
        record = ArrayRecord({k: v for k, v in record.items() if k != key})
    else:
        flat[len(flat) // 2] = {"NaN": np.nan, "inf": np.inf}[attack]
        record = _tamper(record, key, flat)
    with pytest.raises(UploadError, match=reason):
        read_state(record, state)


def test_a_client_refuses_a_state_packed_for_another_model() -> None:
    state = _state()
    other = {**state, "fc.bias": torch.zeros(11)}
    with pytest.raises(UploadError, match="not packed for this model's layout"):
        state_views(state_record(other), tensor_layout(state))


def test_views_are_read_only_and_unpack_keeps_the_layout_order() -> None:
    arrays: dict[str, np.ndarray] = {
        "b": np.arange(3, dtype=np.float32),
        "a": np.arange(4, dtype=np.int64),
        "c": np.ones((2, 2), np.float32),
    }
    record = pack_state(arrays)
    layout = layout_of(arrays)
    views = unpack_state(record, layout)
    assert list(views) == ["b", "a", "c"]
    assert all(not v.flags.writeable for v in views.values())
    assert all(np.array_equal(views[k], arrays[k]) for k in arrays)


def test_playing_the_server_a_model_packed_otherwise_fails_the_client_round_with_its_reason(tmp_path) -> None:
    """A server's instruction is untrusted too: a train instruction whose model is packed for
    another layout, cut short, or holds float64 under the float32 key gets Flower's error reply
    naming the reason, from a real ClientApp; the client never trains on it."""
    from flwr.app import Message, RecordDict

    from fcl_flower.local_grid import LocalGrid
    from strategies.app import run_experiment
    from tests.conftest import NODE_BASE, client_app, server_identity, small_config

    cfg = small_config(tmp_path, num_tasks=2, num_clients=2, stage1_rounds=1, rf_dim=20)
    grid = LocalGrid(client_app, 2, first_node_id=NODE_BASE)
    server_identity()
    run_experiment(grid, cfg)
    honest = next(m for m in grid.sent if m.metadata.message_type == "train")
    model = honest.content.array_records["arrays"]
    key = next(k for k in model if "float32" in k)
    flat = np.array(model[key].numpy())
    others = {k: v for k, v in model.items() if k != key}
    bad = {  # the model record the client gets instead of the honest one
        "another layout": {**others, f"{key}0": npy_array(flat)},
        "cut short": {**others, key: npy_array(flat[:-1])},
        "float64": {**others, key: npy_array(flat.astype(np.float64))},
    }
    for name, arrays in bad.items():
        content = RecordDict(dict(honest.content.items()))
        content.array_records["arrays"] = ArrayRecord(arrays)
        sent = Message(content, dst_node_id=honest.metadata.dst_node_id, message_type="train")
        (reply,) = grid.send_and_receive([sent])
        assert reply.has_error(), name
        reason = reply.error.reason
        expected = "not packed for this model's layout" if name == "another layout" else "expected float32"
        assert "UploadError" in reason and expected in reason, (name, reason)
