"""The server's checkpoint: written atomically after every stage, read back by ``resume``.

``resume`` continues from the next stage and ends with the same classifier as an uninterrupted
run, provided the configuration is the same (operational keys such as the timeout may change).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from fcl_flower.config import ConfigError, RunConfig

FILE_NAME = "checkpoint.pt"
#: Keys that may differ between the run that wrote a checkpoint and the one that resumes it.
OPERATIONAL_KEYS = frozenset({"resume", "round-timeout", "require-all-clients", "round-retries", "device"})


def resumable_config(cfg: RunConfig) -> dict[str, Any]:
    """The config keys that must match for a checkpoint to be resumed."""
    return {k: v for k, v in cfg.to_mapping().items() if k not in OPERATIONAL_KEYS}


class CheckpointStore:
    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / FILE_NAME

    def save(self, payload: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".checkpoint.", suffix=".tmp")
        os.close(fd)
        try:
            torch.save(payload, tmp)
            os.replace(tmp, self.path)  # atomic: a crash leaves the previous checkpoint intact
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def load(self, cfg: RunConfig) -> dict[str, Any]:
        """The checkpoint of ``cfg``'s run; ConfigError (one line) if there is none or it is another run's."""
        if not self.path.exists():
            raise ConfigError(f"resume: no checkpoint at {self.path}; run once without --resume first")
        payload = torch.load(self.path, map_location="cpu", weights_only=False)
        if payload.get("strategy") != cfg.strategy:
            raise ConfigError(f"resume: checkpoint at {self.path} is for strategy '{payload.get('strategy')}'")
        saved, current = payload["config"], resumable_config(cfg)
        changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        if changed:
            raise ConfigError(f"resume: config differs from the checkpoint in: {', '.join(changed)}")
        return payload
