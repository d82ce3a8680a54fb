"""Shared fixtures: a small digits RunConfig, and in-process runs of a strategy's real ``start``
loop through the real ClientApp (``fcl_flower.local_grid.LocalGrid``), without Ray.

The grid builds each client's reply exactly as Flower would (the real handler's reply, or an
error reply when the handler raises), so the strategies see the same objects they see in a
simulation; a ``tamper`` hook lets a test corrupt replies in flight.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Message
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from clients.app import app as client_app
from fcl_flower.config import RunConfig
from fcl_flower.local_grid import LocalGrid
from fcl_flower.methods import Kind
from fcl_flower.protocol import ProtocolError, UnmaskRes, parse_reply
from fcl_flower.protocol.messages import HEADER, Header
from fcl_flower.results import ResultsRecorder
from fcl_flower.runtime import server_split
from fcl_flower.state_key import ENV as KEY_ENV
from strategies import build_strategy
from strategies.base import StagedStrategy

NODE_BASE = 2**64 - 1000  # node ids differ from partition ids and, as on a real SuperLink, use all 64 bits


@pytest.fixture(autouse=True)
def secagg_ledger(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test's nodes keep their secure-aggregation ledger (clients/ledger.py) in a folder of
    their own: two tests never see each other's openings, and none writes under the user's home."""
    folder = tmp_path_factory.mktemp("secagg-ledger")
    monkeypatch.setenv("FCL_SECAGG_LEDGER", str(folder))
    return folder


@pytest.fixture(autouse=True, scope="session")
def checkpoint_key(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The test session signs its checkpoints with a key of its own (fcl_flower/state_key.py),
    made on first use in a temporary folder: no test writes a key under the user's home. Set for
    the session, not through a test's monkeypatch, which some tests undo half-way."""
    path = tmp_path_factory.mktemp("checkpoint-key") / "checkpoint.key"
    before = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = str(path)
    yield path
    if before is None:
        os.environ.pop(KEY_ENV, None)
    else:
        os.environ[KEY_ENV] = before


def small_config(tmp: Path, **changes) -> RunConfig:
    """A fast run: digits, frozen seeded backbone, small random-feature dimension, CPU."""
    base = RunConfig(
        strategy="stsa",
        dataset="digits",
        num_tasks=5,
        num_clients=3,
        beta=0.5,
        seed=0,
        stage1_rounds=0,
        rf_dim=200,
        ridge="100.0",
        wire_dtype="float64",
        batch_size=256,
        device="cpu",
        out=str(tmp),
        round_timeout=5.0,
    )
    return base.replace(**changes)


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    path = tmp_path / "results"
    path.mkdir()
    return path


@pytest.fixture
def cfg(out_dir: Path) -> RunConfig:
    return small_config(out_dir)


# A tamper hook sees (task, phase, replies) of one round and returns the replies to deliver.
Tamper = Callable[[int, str, list[Message]], list[Message]]


def sent_header(message: Message) -> Header:
    """The header of a message the server sent (its task, phase, round, attempt)."""
    return Header.from_record(message.content.config_records[HEADER])


def round_messages(messages: list[Message]) -> list[Message]:
    """The messages of the rounds themselves, without the nodes' first-contact ``query.info``."""
    return [m for m in messages if m.metadata.message_type != "query.info"]


def in_process_grid(num_clients: int, tamper: Tamper | None = None) -> LocalGrid:
    """A LocalGrid with node ids NODE_BASE.. whose replies pass through ``tamper(task, phase, replies)``."""

    def hook(sent: Sequence[Message], replies: list[Message]) -> list[Message]:
        header = sent_header(sent[0])
        return tamper(header.task, header.phase, replies) if tamper is not None else replies

    return LocalGrid(client_app, num_clients, first_node_id=NODE_BASE, tamper=hook)


def server_identity() -> None:
    """What a ServerApp process has set before a strategy builds messages (flwr >= 1.41)."""
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = SUPERLINK_NODE_ID


def build(cfg: RunConfig) -> StagedStrategy:
    """The strategy of ``cfg.strategy`` with its split and a recorder in ``cfg.output_dir``."""
    recorder = ResultsRecorder(cfg.output_dir, cfg.strategy, cfg.to_mapping())
    return build_strategy(cfg, server_split(cfg), recorder)


def record_stage_weights(strategy: StagedStrategy) -> list[torch.Tensor]:
    """Spy on ``strategy.end_stage``: the returned list gets a copy of W after each stage's solve."""
    weights: list[torch.Tensor] = []
    end_stage = strategy.end_stage

    def recording(task: int):
        extra = end_stage(task)
        weights.append(strategy.weights.clone())  # type: ignore[attr-defined]
        return extra

    strategy.end_stage = recording  # type: ignore[method-assign]
    return weights


def run_in_process(cfg: RunConfig, tamper: Tamper | None = None) -> StagedStrategy:
    """Run every stage of ``cfg`` through the strategy's own loop; returns the strategy.

    ``strategy.stage_weights`` holds a copy of the ridge solution after each stage when the
    strategy has one (analytic methods).
    """
    server_identity()
    strategy = build(cfg)
    strategy.stage_weights = []
    end_stage = strategy.end_stage

    def recording_end_stage(task: int):
        extra = end_stage(task)
        weights = getattr(strategy, "weights", None)
        strategy.stage_weights.append(None if weights is None else weights.clone())
        return extra

    strategy.end_stage = recording_end_stage  # type: ignore[method-assign]  # spies on each solve
    strategy.start(in_process_grid(cfg.num_clients, tamper))
    return strategy


def reply_partition(message: Message) -> int:
    return int(message.content.metric_records["metrics"]["partition-id"])


def garbage_entries(entries: list[bytes]) -> list[bytes]:
    """As many entries, each ``b"garbage"``."""
    return [b"garbage" for _ in entries]


def zeroed_entries(entries: list[bytes]) -> list[bytes]:
    """The entries with every byte zeroed (same lengths)."""
    return [bytes(len(s)) for s in entries]


def tamper_secagg_entries(
    phase: str, partition: int, name: str, corrupt: Callable[[Any], Any], task: int | None = 0
) -> Tamper:
    """A tamper hook: in ``phase`` of ``task`` (of every task when ``task`` is None), the reply of
    client ``partition`` carries ``corrupt(entries)`` in place of its secure-aggregation entry ``name``."""

    def tamper(at_task: int, at_phase: str, replies: list[Message]) -> list[Message]:
        if at_phase == phase and (task is None or at_task == task):
            for m in replies:
                if not m.has_error() and reply_partition(m) == partition:
                    record = m.content.config_records["secagg"]
                    record[name] = corrupt(record[name])
        return replies

    return tamper


def unmask_reply_without(reply: UnmaskRes, header: Header, delivered: Message, name: str, error: str) -> Message:
    """``reply`` to the ``delivered`` unmask instruction parses back to itself, and without its
    secure-aggregation entry ``name`` is refused with ``error`` (a pattern); returns that message."""
    message = reply.reply_to(delivered)
    assert parse_reply(message, header, Kind.UNMASK) == reply
    del message.content.config_records["secagg"][name]
    with pytest.raises(ProtocolError, match=error):
        parse_reply(message, header, Kind.UNMASK)
    return message


def run_locally(configs: dict[str, RunConfig]) -> dict[str, tuple[RunConfig, object, dict]]:
    """Run each config through the ServerApp's own ``run_experiment`` on an in-process LocalGrid
    (one torch thread, so the numbers match a Ray actor's); name -> (cfg, grid, results.json)."""
    import json

    from strategies.app import run_experiment

    torch.set_num_threads(1)
    results = {}
    for name, cfg in configs.items():
        grid = LocalGrid(client_app, cfg.num_clients)
        recorder = run_experiment(grid, cfg)
        results[name] = (cfg, grid, json.loads(recorder.path.read_text()))
    return results


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU torch.Generator seeded with ``seed`` (test data that repeats exactly)."""
    return torch.Generator().manual_seed(seed)
