"""A site's side of a forget round (phase ``stsa-forget``; ``stsa-e-forget`` and ``fedran-forget``
through :func:`handle_forget_site`, docs/unlearning.md).

The server asks every site between two stages (run config ``forget``). A site the server names
(a whole-site removal, the server operator's request) re-sends every upload it kept
(clients/upload_store.py) of the stages so far. Otherwise a site with node config
``forget-samples`` (a text file of ``stage,row`` lines: the 1-based stage, and the 0-based row of
the sample in the site's own data of that stage, in the order its data folder lists them; or
``class,C`` lines: every sample of global class C, in whichever stage holds it) re-sends
the kept upload of each stage it forgets samples of, together with the statistics of the samples
it keeps (computed with the same frozen backbone and random features), and keeps those from then
on. Lines already applied are remembered in ``<store>/partition-<p>/forgotten.json`` and not
applied twice. A site with nothing to forget answers with an empty reply. Under secure
aggregation the forget round is a secure round: clients/secure_forget.py answers it.

Forgetting samples needs the stage's data (the kept samples' statistics are computed from it);
forgetting the whole site needs only the kept uploads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from clients.job import ClientJob
from clients.statistics import local_task_features
from clients.upload_store import as_received, load_arrays, load_upload, save_upload, store_folder, store_sizes
from fcl_flower.analytic import StatisticsAccumulator
from fcl_flower.protocol import StatsIns, StatsRes
from fcl_flower.protocol.payloads import FedranStats, ForgetStats, SiteUploads, StsaEStats, StsaStats
from fcl_flower.tensors import WIRE_DTYPES

SAMPLES_KEY = "forget-samples"  # node-config key: the site's own request
# the arrays of a kept upload, per method whose forget round re-sends whole uploads (handle_forget_site)
UPLOAD_KEYS = {"stsa-e": StsaEStats.KEYS, "fedran": FedranStats.KEYS}


class ForgetError(RuntimeError):
    """The site cannot do what it is asked (one line: why); the reply is an error."""


def sample_requests(node_config: Mapping[str, Any]) -> tuple[dict[int, set[int]], set[int]]:
    """({task (0-based): rows}, {classes}) from the file node config ``forget-samples`` names
    (empty without one): lines ``stage,row``, or ``class,C`` for every sample of global class C."""
    path = node_config.get(SAMPLES_KEY)
    if not isinstance(path, str) or not path:
        return {}, set()
    requests: dict[int, set[int]] = {}
    classes: set[int] = set()
    for number, line in enumerate(Path(path).expanduser().read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        first, _, second = (part.strip() for part in text.partition(","))
        if first == "class" and second.isdigit():
            classes.add(int(second))
            continue
        if not first.isdigit() or not second.isdigit() or int(first) < 1:
            raise ForgetError(f"{path}:{number}: '{text}' is neither 'stage,row' nor 'class,C'")
        requests.setdefault(int(first) - 1, set()).add(int(second))
    return requests, classes


def _applied_path(folder: Path, partition: int) -> Path:
    return folder / f"partition-{int(partition)}" / "forgotten.json"


def _applied(folder: Path, partition: int) -> tuple[dict[int, set[int]], set[int]]:
    """The requests already applied: rows by task, and whole classes."""
    path = _applied_path(folder, partition)
    if not path.is_file():
        return {}, set()
    saved = json.loads(path.read_text())
    return {int(task): set(rows) for task, rows in saved["rows"].items()}, set(saved["classes"])


def _note_applied(folder: Path, partition: int, rows: dict[int, set[int]], classes: set[int]) -> None:
    path = _applied_path(folder, partition)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        rows_json = {str(t): sorted(r) for t, r in sorted(rows.items())}
        json.dump({"rows": rows_json, "classes": sorted(classes)}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def kept_accumulator(job: ClientJob, task: int, rows: set[int], drop: set[int]) -> tuple[StatisticsAccumulator, int]:
    """The statistics of ``task`` the site would have computed without the samples in ``rows`` nor
    those of the global classes in ``drop``: the same features, the same min-class-count rule on
    the kept counts, accumulated in float64 batch by batch as a run that never had them would
    (clients/stsa.py ``stsa_statistics``); and the samples withheld by that rule."""
    phi, labels = local_task_features(job, task)
    if rows and max(rows) >= int(labels.shape[0]):
        raise ForgetError(f"stage {task + 1}: row {max(rows)} is beyond the site's {int(labels.shape[0])} samples")
    keep = torch.ones(int(labels.shape[0]), dtype=torch.bool)
    keep[sorted(rows)] = False
    start = job.split.tasks[task].start
    for cls in drop:
        keep &= labels != cls - start
    classes = len(job.split.tasks[task])
    counts = torch.bincount(labels[keep], minlength=classes)
    disclosed = counts >= job.cfg.min_class_count
    withheld = int(counts[~disclosed].sum())
    keep &= disclosed[labels]
    accumulator = StatisticsAccumulator(int(phi.shape[1]), classes)
    kept_phi, kept_labels, size = phi[keep], labels[keep], job.cfg.batch_size
    for first in range(0, int(kept_labels.shape[0]), size):  # in the batches a run without them adds
        accumulator.update(kept_phi[first : first + size], kept_labels[first : first + size])
    return accumulator, withheld


def kept_statistics(job: ClientJob, task: int, rows: set[int], drop: set[int]) -> tuple[StsaStats, int]:
    """The upload of ``task`` the site would have sent without the samples in ``rows`` nor those of
    the global classes in ``drop`` (:func:`kept_accumulator`), as the server reads it."""
    accumulator, _ = kept_accumulator(job, task, rows, drop)
    stats = accumulator.result(with_gram=False)
    upload = StsaStats(
        accumulator.packed_gram(WIRE_DTYPES[job.cfg.wire_dtype]), stats.class_sums, stats.counts.to(torch.float64)
    )
    return as_received(upload, job.cfg.wire_dtype), stats.num_samples


def handle_forget(job: ClientJob) -> StatsRes:
    assert isinstance(job.ins, StatsIns)
    if job.ins.secagg is not None:  # the forget round is a secure round: its own handler
        from clients.secure_forget import handle_secure_forget

        return handle_secure_forget(job)
    config = job.context.node_config
    named = job.partition in job.ins.forget
    rows, classes = ({}, set()) if named else sample_requests(config)
    folder = store_folder(config)
    requests: dict[int, tuple[set[int], set[int]]] = {}  # task -> (rows, classes) still to apply
    if folder is not None and (rows or classes):
        done_rows, done_classes = _applied(folder, job.partition)
        for task in range(job.task + 1):
            task_classes = set(job.split.tasks[task]) & (classes - done_classes)
            task_rows = rows.get(task, set()) - done_rows.get(task, set())
            if task_rows or task_classes:
                requests[task] = (task_rows, task_classes)
    if not named and not requests:
        return job.stats_reply(0, arrays=ForgetStats({}, {}).to_record(job.cfg.wire_dtype))
    if folder is None:
        raise ForgetError("asked to forget, but this node keeps no uploads (node config upload-store)")
    added: dict[int, StsaStats] = {}
    kept: dict[int, StsaStats] = {}
    removed = 0
    if named:
        for task in (t for t in store_sizes(folder, job.partition) if t <= job.task):
            added[task], samples, _ = load_upload(folder, job.partition, task)
            removed += samples
    else:
        done_rows, done_classes = _applied(folder, job.partition)
        for task, (task_rows, task_classes) in sorted(requests.items()):
            added[task], samples, meta = load_upload(folder, job.partition, task)
            kept[task], kept_samples = kept_statistics(job, task, task_rows, task_classes)
            removed += samples - kept_samples
            save_upload(folder, job.partition, task, kept[task], kept_samples, run=meta["run"], client=meta["client"])
            if task_rows:
                done_rows.setdefault(task, set()).update(task_rows)
            done_classes |= task_classes
        _note_applied(folder, job.partition, done_rows, done_classes)
    return job.stats_reply(removed, arrays=ForgetStats(added, kept).to_record(job.cfg.wire_dtype))


def handle_forget_site(job: ClientJob) -> StatsRes:
    """The forget round of a method that forgets whole sites only (STSA-E, FedRAN; phases
    ``stsa-e-forget``, ``fedran-forget``): a site the server names re-sends every upload it kept of
    the stages so far, as the server read them; any other site answers with an empty reply. A
    site's own sample requests (``forget-samples``) are refused with the reason."""
    assert isinstance(job.ins, StatsIns)
    config = job.context.node_config
    wire = job.cfg.wire_dtype
    if job.partition not in job.ins.forget:
        if sample_requests(config) != ({}, set()):
            raise ForgetError(
                f"{SAMPLES_KEY}: strategy {job.cfg.strategy} forgets whole sites only (run config forget 'S:C'); "
                "a site's samples or classes are forgotten with strategy stsa"
            )
        return job.stats_reply(0, arrays=SiteUploads({}).to_record(wire))
    folder = store_folder(config)
    if folder is None:
        raise ForgetError("asked to forget, but this node keeps no uploads (node config upload-store)")
    added: dict[int, dict[str, torch.Tensor]] = {}
    removed = 0
    for task in (t for t in store_sizes(folder, job.partition) if t <= job.task):
        added[task], samples, _ = load_arrays(folder, job.partition, task, UPLOAD_KEYS[job.cfg.strategy])
        removed += samples
    return job.stats_reply(removed, arrays=SiteUploads(added).to_record(wire))
