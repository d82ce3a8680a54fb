"""A site's side of a forget round under secure aggregation (phase ``stsa-forget``, docs/unlearning.md).

The forget round is its own secure round (keys, shares, masked upload, unmasking: clients/secure.py)
over every active site. Each site masks one vector of the same layout: packed G, the class sums of
every class seen so far, their counts, and one zero slot last (where a statistics upload carries
the withheld count):

* a **leaving** site masks the *negation* of what it removes, computed in the ring of the
  fixed-point encoding: −(enc(what it masked then) − enc(what it keeps)), enc the deterministic
  round(x · 2^f) of fcl_flower/privacy/secagg.py. It re-encodes the float64 arrays it kept of each
  secure upload (clients/upload_store.py ``SecureUpload``), so the removal is exactly the ring
  elements it added: after the server subtracts the opened sum, its state equals, bit for bit in
  the ring, that of a secure run that never had the removed statistics;
* every other site masks zeros, which reveals nothing.

Consent. With the other sites masking zeros, the opened sum *is* the leaving site's removal: a
server that names a site that never asked would read its statistics. So a site removes its whole
contribution only when the server operator names it (run config ``forget = "S:C"``) *and* its own
node config says ``forget-consent = true`` (:data:`CONSENT_KEY`); without it the site refuses with
one line and the round records the refusal. A site's own sample request (node config
``forget-samples``, clients/forget.py) is its consent for those samples. Each removal is written to
the node's ledger under its own key (clients/ledger.py ``forget_ledger_key``: ``forget-site`` once
per run; ``forget-samples-<digest>`` per request) before anything is revealed, so it is opened over
one set of survivors only, like any input; a whole-site removal is masked with one content per run
(``forget-site.json``), and applied sample requests are remembered (``forgotten.json``) and not
applied twice.

What the site removes for a whole-site request: every kept secure upload of the stages so far whose
sum this node revealed its shares for (its ledger lists it among that stage's survivors); an upload
that never made it into an opened sum took nothing in. A sample request removes, per stage, the
difference between the stage's upload and the statistics of the samples it keeps; it needs a
stage whose upload carried that stage's statistics alone (no owed stage rode in it), and the site
keeps the kept statistics from then on (before the server's answer, as in plain mode).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from logging import INFO
from pathlib import Path

import numpy as np
import torch
from flwr.common.logger import log

from clients.forget import ForgetError, _applied, _note_applied, kept_accumulator, sample_requests
from clients.job import ClientJob
from clients.ledger import forget_ledger_key, input_digest
from clients.secure import masked_upload, node_ledger, signed_mode
from clients.statistics import effective_rf_dim
from clients.upload_store import (
    SecureUpload,
    StoreError,
    load_secure_upload,
    save_secure_upload,
    secure_tasks,
    store_folder,
    write_private,
)
from fcl_flower.analytic import packed_length
from fcl_flower.privacy.secagg import decode_fixed_point, encode_fixed_point
from fcl_flower.protocol import StatsIns, StatsRes
from fcl_flower.protocol.payloads import MaskedStsaStats

CONSENT_KEY = "forget-consent"  # node-config key: this site agrees to a server operator's whole-site removal
NAMES = ("gram-packed", "class-sums", "counts")


class Ring:
    """A forget round's vector in the ring Z/2⁶⁴ (uint64, wrapping): packed G, the class sums of the
    ``seen`` classes (M × seen, row-major) and their counts, plus the zero slot."""

    def __init__(self, dim: int, seen: int, bits: int) -> None:
        self.dim, self.seen, self.bits = dim, seen, bits
        self.gram = np.zeros(packed_length(dim), dtype=np.uint64)
        self.sums = np.zeros((dim, seen), dtype=np.uint64)
        self.counts = np.zeros(seen + 1, dtype=np.uint64)

    def add(self, upload: SecureUpload, columns: list[range], sign: int = 1) -> None:
        """± enc(``upload``): its column blocks go to the global classes ``columns`` (one per task of
        its layout); its last count (the withheld samples, which the server never holds) is left out."""
        enc = {name: encode_fixed_point(array.numpy(), self.bits, 1) for name, array in upload.arrays().items()}
        sums = enc["class-sums"].reshape(self.dim, -1)
        counts = enc["counts"]
        width = sum(len(block) for block in columns)
        if enc["gram-packed"].shape != self.gram.shape or sums.shape[1] != width or counts.size != width + 1:
            raise ForgetError("a kept secure upload does not fit the stages it names")
        if block_end(columns) > self.seen:
            raise ForgetError("a kept secure upload names a stage that has not run")
        if sign < 0:
            enc["gram-packed"] = np.zeros_like(enc["gram-packed"]) - enc["gram-packed"]
            sums = np.zeros_like(sums) - sums
            counts = np.zeros_like(counts) - counts
        self.gram += enc["gram-packed"]
        start = 0
        for block in columns:
            self.sums[:, block.start : block.stop] += sums[:, start : start + len(block)]
            self.counts[block.start : block.stop] += counts[start : start + len(block)]
            start += len(block)

    def negated_floats(self) -> dict[str, torch.Tensor]:
        """−(this vector) as float64 arrays whose fixed-point encoding gives back exactly its ring
        elements (masked_upload encodes them again); ForgetError where float64 cannot hold them."""
        out = {}
        for name, ring in zip(NAMES, (self.gram, self.sums.reshape(-1), self.counts), strict=True):
            negated = np.zeros_like(ring) - ring
            values = decode_fixed_point(negated, self.bits)
            if not np.array_equal(np.rint(values * float(2**self.bits)).astype(np.int64).view(np.uint64), negated):
                raise ForgetError(
                    f"the removal's '{name}' is too large to travel exactly at secagg-fraction-bits={self.bits}"
                )
            out[name] = torch.from_numpy(values.reshape(self.sums.shape) if name == "class-sums" else values)
        return out


def block_end(columns: list[range]) -> int:
    return max((block.stop for block in columns), default=0)


def _columns(job: ClientJob, layout: tuple[int, ...]) -> list[range]:
    return [job.split.tasks[task] for task in layout]


def _opened_for_this_node(job: ClientJob, upload: SecureUpload, task: int) -> bool:
    """Whether this node revealed its shares for the sum that held ``upload`` (its ledger lists it
    among the survivors): only then did the upload go into the server's statistics."""
    ledger = node_ledger(job.context, signed_mode(job.context, job.cfg))
    survivors = ledger.contributed(upload.run, task)
    return survivors is not None and int(job.context.node_id) in survivors


def whole_site_removal(job: ClientJob, folder: Path, ring: Ring) -> int:
    """Add every kept secure upload of the stages so far that went into an opened sum; returns
    their number of samples."""
    samples = 0
    for task in (t for t in secure_tasks(folder, job.partition) if t <= job.task):
        upload = load_secure_upload(folder, job.partition, task)
        if not _opened_for_this_node(job, upload, task):
            log(
                INFO,
                "client-%d: its secure upload of stage %d was never opened; nothing to remove",
                job.partition,
                task + 1,
            )
            continue
        ring.add(upload, _columns(job, upload.layout))
        samples += upload.num_samples
    return samples


def kept_upload(job: ClientJob, upload: SecureUpload, task: int, rows: set[int], drop: set[int]) -> SecureUpload:
    """``upload`` (stage ``task``'s own, carrying no owed stage) as the site would have masked it
    without the samples in ``rows`` nor those of the global classes in ``drop``
    (clients/forget.py ``kept_accumulator``)."""
    accumulator, withheld = kept_accumulator(job, task, rows, drop)
    gram = accumulator.packed_gram(torch.float64)
    stats = accumulator.result(with_gram=False)
    counts64 = torch.cat([stats.counts.to(torch.float64), torch.tensor([float(withheld)], dtype=torch.float64)])
    return SecureUpload(
        gram, stats.class_sums.to(torch.float64), counts64, upload.layout, upload.run, stats.num_samples
    )


def sample_removal(
    job: ClientJob, folder: Path, requests: dict[int, tuple[set[int], set[int]]], ring: Ring
) -> tuple[int, dict[int, SecureUpload]]:
    """Add enc(stage upload) − enc(kept statistics) per requested stage; returns the samples removed
    and the kept uploads (to be kept in place of the old ones)."""
    removed, kept = 0, {}
    for task, (rows, classes) in sorted(requests.items()):
        try:
            upload = load_secure_upload(folder, job.partition, task)
        except StoreError as err:
            raise ForgetError(str(err)) from None
        if upload.layout != (task,):
            raise ForgetError(
                f"stage {task + 1}'s secure upload also carried owed stages {list(upload.layout[1:])}: a sample "
                "removal would not be exact; ask for a whole-site removal"
            )
        if not _opened_for_this_node(job, upload, task):
            raise ForgetError(f"stage {task + 1}'s secure upload was never opened: there is nothing to remove")
        kept[task] = kept_upload(job, upload, task, rows, classes)
        columns = _columns(job, upload.layout)
        ring.add(upload, columns)
        ring.add(kept[task], columns, sign=-1)
        removed += upload.num_samples - kept[task].num_samples
    return removed, kept


def pending_requests(job: ClientJob, folder: Path | None) -> dict[int, tuple[set[int], set[int]]]:
    """This site's own requests (node config forget-samples) not applied yet, per stage so far."""
    rows, classes = sample_requests(job.context.node_config)
    if not (rows or classes):
        return {}
    if folder is None:
        raise ForgetError("asked to forget, but this node keeps no uploads (node config upload-store)")
    done_rows, done_classes = _applied(folder, job.partition)
    requests: dict[int, tuple[set[int], set[int]]] = {}
    for task in range(job.task + 1):
        task_classes = set(job.split.tasks[task]) & (classes - done_classes)
        task_rows = rows.get(task, set()) - done_rows.get(task, set())
        if task_rows or task_classes:
            requests[task] = (task_rows, task_classes)
    return requests


def _once_per_run(job: ClientJob, folder: Path, digest: str) -> None:
    """A site masks its whole-site removal once per run: the content of the first one is noted
    (``partition-<p>/forget-site.json``, atomic, 0600) before anything is masked, and any other
    content in the same run is refused. Otherwise a server could ask for the removal after stage 1,
    then after stage 2 over the same set (which the ledger allows, as a retry), and read the site's
    stage-2 statistics by difference."""
    path = folder / f"partition-{int(job.partition)}" / "forget-site.json"
    run = job.ins.header.run_id
    try:
        noted = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        noted = None
    if not isinstance(noted, dict):
        raise ForgetError(f"{path} is damaged: refusing to mask a removal")
    if run in noted and noted[run] != digest:
        raise ForgetError("this site already masked another whole-site removal in this run: refused")
    noted[run] = digest
    write_private(path, json.dumps(noted, sort_keys=True).encode())


def _request_key(requests: dict[int, tuple[set[int], set[int]]]) -> str:
    text = ";".join(f"{t}:{sorted(r)}:{sorted(c)}" for t, (r, c) in sorted(requests.items()))
    return "samples-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def handle_secure_forget(job: ClientJob) -> StatsRes:
    """The masked reply of this site in a secure forget round (module doc)."""
    ins = job.ins
    assert isinstance(ins, StatsIns) and ins.secagg is not None
    config = job.context.node_config
    folder = store_folder(config)
    dim = effective_rf_dim(job.model.backbone.feature_dim, job.cfg.rf_dim)
    ring = Ring(dim, int(job.split.tasks[job.task].stop), job.cfg.secagg_fraction_bits)
    key: str | None = None
    kept: dict[int, SecureUpload] = {}
    removed = 0
    requests: dict[int, tuple[set[int], set[int]]] = {}
    if job.partition in ins.forget:
        if config.get(CONSENT_KEY) is not True:
            raise ForgetError(
                f"the server names this site for a whole-site removal, but its node config does not say "
                f"{CONSENT_KEY}=true: refused (the opened sum would be this site's statistics)"
            )
        if folder is None:
            raise ForgetError("asked to forget, but this node keeps no uploads (node config upload-store)")
        removed = whole_site_removal(job, folder, ring)
        key = forget_ledger_key("site")
    else:
        requests = pending_requests(job, folder)
        if requests:
            assert folder is not None
            removed, kept = sample_removal(job, folder, requests, ring)
            key = forget_ledger_key(_request_key(requests))
    arrays = ring.negated_floats()  # zeros for a site that removes nothing
    contributed: dict[str, str] = {}
    if key is not None:  # the removal is opened over one set of survivors only (clients/ledger.py)
        digest = input_digest(*(arrays[name].numpy().tobytes() for name in NAMES))
        if key == forget_ledger_key("site"):
            assert folder is not None
            _once_per_run(job, folder, digest)
        contributed[key] = digest if job.cfg.secagg_signed_keys else ""
    masked, report = masked_upload(job, arrays, (), contributed)
    if folder is not None and kept:  # the site keeps the kept statistics from now on (module doc)
        done_rows, done_classes = _applied(folder, job.partition)
        for task, upload in kept.items():
            save_secure_upload(folder, job.partition, task, upload, client=f"client-{job.partition}")
            rows, classes = requests[task]
            done_rows.setdefault(task, set()).update(rows)
            done_classes |= classes
        _note_applied(folder, job.partition, done_rows, done_classes)
    if key is not None:
        log(INFO, "client-%d masks its removal of %d sample(s) (%s)", job.partition, removed, key)
    payload = MaskedStsaStats(masked["gram-packed"], masked["class-sums"], masked["counts"])
    return job.stats_reply(0, arrays=payload.to_record(), secagg=dataclasses.replace(report, leaving=key is not None))
