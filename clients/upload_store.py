"""A site's own copy of what it uploaded, per stage, so that it can be forgotten exactly later
(issue 33, docs/unlearning.md).

With node config ``upload-store`` (a folder; or $FCL_UPLOAD_STORE) an STSA, STSA-E or FedRAN
client in plain mode writes every upload it sends, as the server will read it (STSA: G at the
wire dtype, C and the counts as float64 of their wire values; STSA-E: its dummy clients' class
sums and counts, FedRAN: U, σ and B, each as float64 of its wire values), to ``<folder>/partition-<p>/task-<t>.safetensors`` with the run
id, the client name and the number of samples in its metadata. To forget the stage later the site
re-sends exactly these bytes (the server checks them against its digest, strategies/unlearning.py)
together with the statistics of the samples it keeps, even after its raw data of that stage is
gone. Writes are atomic (a temporary file in the same folder, fsync, os.replace) and the files
are created mode 0600 in a folder of mode 0700: they are the site's statistics, as sensitive as
the upload itself. :func:`store_sizes` reports the bytes on disk per stage.

In a secure statistics round (``secure-aggregation``) the site keeps instead what it masked, before
the fixed-point encoding (:class:`SecureUpload`, ``<folder>/partition-<p>/secure-task-<t>.safetensors``,
same atomic 0600 writes): the encoding is deterministic, so a secure forget round
(clients/secure_forget.py) re-encodes it to remove exactly the ring elements the site added.

Without ``upload-store`` nothing is written (the default).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.common.logger import log
from safetensors.torch import load, save

from clients.job import ClientJob
from clients.statistics import Statistics
from fcl_flower.protocol.payloads import StsaStats
from fcl_flower.tensors import cast_for_wire

STORE_KEY = "upload-store"  # node-config key
ENV = "FCL_UPLOAD_STORE"
FORMAT = "fcl-flower-upload-store/1"


class StoreError(RuntimeError):
    """The store has no such upload, or a file that is not one (one line: which and why)."""


def store_folder(node_config: Mapping[str, Any]) -> Path | None:
    """Node config ``upload-store``, else $FCL_UPLOAD_STORE, else None (nothing is kept)."""
    configured = node_config.get(STORE_KEY)
    if isinstance(configured, str) and configured:
        return Path(configured).expanduser()
    env = os.environ.get(ENV)
    return Path(env).expanduser() if env else None


def as_received(stats: StsaStats, wire_dtype: str) -> StsaStats:
    """The upload as the server reads it (fcl_flower/protocol/payloads.py ``StsaStats.read``)."""
    return StsaStats(
        cast_for_wire(stats.gram_packed, wire_dtype).contiguous(),
        cast_for_wire(stats.class_sums, wire_dtype).to(torch.float64).contiguous(),
        cast_for_wire(stats.counts, wire_dtype).to(torch.float64).contiguous(),
    )


def upload_path(folder: Path, partition: int, task: int) -> Path:
    return folder / f"partition-{int(partition)}" / f"task-{int(task)}.safetensors"


def as_read(arrays: Mapping[str, torch.Tensor], wire_dtype: str) -> dict[str, torch.Tensor]:
    """An upload the server reads in float64 (STSA-E's, FedRAN's) as it reads it: each array cast to
    the wire dtype and back to float64."""
    return {name: cast_for_wire(value, wire_dtype).to(torch.float64).contiguous() for name, value in arrays.items()}


def save_upload(
    folder: Path, partition: int, task: int, stats: StsaStats, num_samples: int, *, run: str, client: str
) -> int:
    """Keep one STSA upload (atomically, mode 0600); returns its size on disk in bytes."""
    return save_arrays(folder, partition, task, stats.arrays(), num_samples, run=run, client=client)


def save_arrays(
    folder: Path,
    partition: int,
    task: int,
    arrays: Mapping[str, torch.Tensor],
    num_samples: int,
    *,
    run: str,
    client: str,
) -> int:
    """Keep one upload's arrays, any method's (atomically, mode 0600); returns its size in bytes."""
    meta = {"format": FORMAT, "run": run, "client": client, "task": str(int(task)), "num_samples": str(num_samples)}
    return write_private(upload_path(folder, partition, task), save(dict(arrays), metadata=meta))


def keep_upload(job: ClientJob, folder: Path, task: int, arrays: Mapping[str, torch.Tensor], num_samples: int) -> None:
    """Keep ``job``'s upload of ``task`` (as the server reads it) and log its size on disk."""
    size = save_arrays(
        folder, job.partition, task, arrays, num_samples, run=job.ins.header.run_id, client=f"client-{job.partition}"
    )
    log(INFO, "client-%d keeps its upload of stage %d: %d bytes on disk", job.partition, task + 1, size)


def load_upload(folder: Path, partition: int, task: int) -> tuple[StsaStats, int, dict[str, str]]:
    """(the STSA upload, its number of samples, its metadata: run, client, task)."""
    arrays, samples, meta = load_arrays(folder, partition, task, StsaStats.KEYS)
    return StsaStats(arrays["gram-packed"], arrays["class-sums"], arrays["counts"]), samples, meta


def load_arrays(
    folder: Path, partition: int, task: int, keys: tuple[str, ...]
) -> tuple[dict[str, torch.Tensor], int, dict[str, str]]:
    """(the upload's arrays, named ``keys``, its number of samples, its metadata: run, client, task)."""
    path = upload_path(folder, partition, task)
    if not path.is_file():
        raise StoreError(f"{path}: no kept upload of stage {task + 1}")
    blob = path.read_bytes()
    try:
        arrays = load(blob)
        header_size = int.from_bytes(blob[:8], "little")
        meta = json.loads(blob[8 : 8 + header_size]).get("__metadata__", {})
    except Exception as err:
        raise StoreError(f"{path}: not a kept upload ({err})") from None
    if meta.get("format") != FORMAT or set(arrays) != set(keys):
        raise StoreError(f"{path}: not a kept upload of this format ({FORMAT}, arrays {', '.join(keys)})")
    return arrays, int(meta["num_samples"]), dict(meta)


def keeping(
    folder: Path | None,
    compute: Callable[[ClientJob, int], Statistics],
    arrays_of: Callable[[Any, str], Mapping[str, torch.Tensor] | None],
) -> Callable[[ClientJob, int], Statistics]:
    """``compute`` (a task's statistics), also keeping each upload in ``folder`` (none: as it is):
    ``arrays_of(payload, wire dtype)`` the arrays as the server reads them (None: not kept)."""
    if folder is None:
        return compute

    def kept(job: ClientJob, task: int) -> Statistics:
        stats = compute(job, task)
        arrays = arrays_of(stats.payload, job.cfg.wire_dtype)
        if arrays is not None:
            keep_upload(job, folder, task, arrays, stats.num_samples)
        return stats

    return kept


# ---------------------------------------------------------------- secure uploads
SECURE_FORMAT = "fcl-flower-secure-upload-store/1"
SECURE_KEYS = ("gram-packed", "class-sums", "counts")


@dataclass(frozen=True)
class SecureUpload:
    """What a site masked in one secure statistics round, before the fixed-point encoding: the
    float64 arrays it passed to the masking (packed G; the class sums and counts of ``layout``'s
    tasks, column block after block; the withheld count last). The encoding is deterministic
    (round(x · 2^f), fcl_flower/privacy/secagg.py), so re-encoding them gives the very ring
    elements the site added. ``layout``: the round's own task first, then the owed tasks whose
    columns rode in it; ``run``: the run id of the round (its ledger entry)."""

    gram_packed: torch.Tensor
    class_sums: torch.Tensor
    counts: torch.Tensor
    layout: tuple[int, ...]
    run: str
    num_samples: int

    def arrays(self) -> dict[str, torch.Tensor]:
        return {"gram-packed": self.gram_packed, "class-sums": self.class_sums, "counts": self.counts}


def secure_upload_path(folder: Path, partition: int, task: int) -> Path:
    return folder / f"partition-{int(partition)}" / f"secure-task-{int(task)}.safetensors"


def write_private(path: Path, blob: bytes) -> int:
    """``blob`` to ``path`` atomically (temporary file, fsync, os.replace), mode 0600 in a 0700 folder."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(blob)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def save_secure_upload(folder: Path, partition: int, task: int, upload: SecureUpload, *, client: str) -> int:
    """Keep what the site masked in the secure round of ``task`` (atomically, mode 0600); returns
    its size on disk in bytes."""
    meta = {
        "format": SECURE_FORMAT,
        "run": upload.run,
        "client": client,
        "task": str(int(task)),
        "layout": ",".join(str(t) for t in upload.layout),
        "num_samples": str(int(upload.num_samples)),
    }
    arrays = {k: v.detach().to(torch.float64).contiguous() for k, v in upload.arrays().items()}
    return write_private(secure_upload_path(folder, partition, task), save(arrays, metadata=meta))


def load_secure_upload(folder: Path, partition: int, task: int) -> SecureUpload:
    """The secure upload kept for ``task`` (StoreError: none, or not one)."""
    path = secure_upload_path(folder, partition, task)
    if not path.is_file():
        raise StoreError(f"{path}: no kept secure upload of stage {task + 1}")
    blob = path.read_bytes()
    try:
        arrays = load(blob)
        header_size = int.from_bytes(blob[:8], "little")
        meta = json.loads(blob[8 : 8 + header_size]).get("__metadata__", {})
        layout = tuple(int(t) for t in meta["layout"].split(","))
        samples = int(meta["num_samples"])
    except Exception as err:
        raise StoreError(f"{path}: not a kept secure upload ({type(err).__name__})") from None
    if meta.get("format") != SECURE_FORMAT or set(arrays) != set(SECURE_KEYS) or not layout or layout[0] != task:
        raise StoreError(f"{path}: not a kept secure upload of this format ({SECURE_FORMAT})")
    if any(arrays[k].dtype != torch.float64 for k in SECURE_KEYS):
        raise StoreError(f"{path}: a kept secure upload holds float64 arrays")
    return SecureUpload(
        arrays["gram-packed"], arrays["class-sums"], arrays["counts"], layout, str(meta["run"]), samples
    )


def secure_tasks(folder: Path, partition: int) -> list[int]:
    """The stages (task indices) whose secure upload is kept for ``partition``."""
    base = folder / f"partition-{int(partition)}"
    found = base.glob("secure-task-*.safetensors") if base.is_dir() else []
    return sorted(int(path.stem.removeprefix("secure-task-")) for path in found)


def store_sizes(folder: Path, partition: int) -> dict[int, int]:
    """Bytes on disk per stage (task index) kept for ``partition``."""
    base = folder / f"partition-{int(partition)}"
    sizes = {}
    for path in sorted(base.glob("task-*.safetensors")) if base.is_dir() else []:
        sizes[int(path.stem.removeprefix("task-"))] = path.stat().st_size
    return dict(sorted(sizes.items()))


def main(argv: list[str] | None = None) -> int:
    """``python -m clients.upload_store <folder>``: what a site keeps, per partition and stage."""
    import argparse

    parser = argparse.ArgumentParser(description="The uploads a site keeps for exact unlearning, per stage.")
    parser.add_argument("folder", help="the node's upload-store folder")
    args = parser.parse_args(argv)
    folder = Path(args.folder).expanduser()
    partitions = sorted(int(p.name.removeprefix("partition-")) for p in folder.glob("partition-*") if p.is_dir())
    if not partitions:
        print(f"{folder}: no kept uploads")
        return 1
    for partition in partitions:
        sizes = store_sizes(folder, partition)
        total = sum(sizes.values())
        print(f"partition {partition}: {len(sizes)} stage(s), {total} bytes")
        for task, size in sizes.items():
            print(f"  stage {task + 1}: {size} bytes")
        for task in secure_tasks(folder, partition):
            print(f"  stage {task + 1} (secure): {secure_upload_path(folder, partition, task).stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
