"""A client's exemplar memory between rounds (LGA's herding memory, STAMP's coreset).

Flower keeps a node's ``context.state`` across the messages of a run; the memory is stored there
as an ArrayRecord of dataset indices into this client's *own* data of past tasks (never images).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from flwr.app import ConfigRecord, RecordDict
from flwr.app.typing import ConfigRecordValues
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from clients.job import ClientJob
from fcl_flower.fcl.exemplars import ExemplarMemory
from fcl_flower.protocol import to_record


def load_memory(state: RecordDict, key: str, memory_size: int) -> ExemplarMemory:
    if key not in state.array_records:
        return ExemplarMemory(memory_size)
    arrays = {k: v.numpy() for k, v in state.array_records[key].items()}
    memory = ExemplarMemory.from_state(arrays)
    if memory.memory_size != memory_size:
        raise ValueError(f"stored memory has size {memory.memory_size}, the run says memory-size={memory_size}")
    return memory


def save_memory(state: RecordDict, key: str, memory: ExemplarMemory) -> None:
    state.array_records[key] = to_record(memory.to_state())


def load_meta(state: RecordDict, key: str) -> dict[str, float]:
    """A handler's numeric bookkeeping between rounds (task ids, detector state)."""
    record = state.config_records.get(key)
    if record is None:
        return {}
    return {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def save_meta(state: RecordDict, key: str, meta: dict[str, float]) -> None:
    state.config_records[key] = ConfigRecord(dict[str, ConfigRecordValues](meta))


def train_loader(datasets: Sequence[Dataset], job: ClientJob, seed: int) -> DataLoader:
    data = datasets[0] if len(datasets) == 1 else ConcatDataset(datasets)
    return DataLoader(
        data, batch_size=job.cfg.batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed), num_workers=0
    )
