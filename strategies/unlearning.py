"""The server's side of exact unlearning (issue 33, docs/unlearning.md): commitments to what was
added, and the check of a removal against them.

:class:`Commitments` keeps, per client and task, the SHA-256 digest of every accepted plain-mode
upload (fcl_flower/analytic/unlearning.py ``upload_digest``: the upload's bytes as received, bound
to the run, the client and the task), its number of samples and its counts: 32 bytes and a few
numbers per upload, never the statistics themselves. A removal names the upload it takes out; the
server recomputes the digest of what the client re-sends and refuses it unless it is the very
upload that was added, and refuses a "kept" part that is not a subset of it
(:func:`~fcl_flower.analytic.unlearning.check_removal`), so nobody can forget more than it put in
or forget for another client. After the swap the commitment names the kept part, so a second
removal of the same samples is refused too.

Under secure aggregation the server never sees one client's upload, so there is nothing here to
commit to: a removal there runs as its own secure round (strategies/secure_unlearning.py,
docs/unlearning.md "Secure aggregation").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fcl_flower import restore as fields
from fcl_flower.analytic.checks import StatisticsRejected
from fcl_flower.analytic.unlearning import Upload, arrays_digest, check_removal, upload_digest
from fcl_flower.protocol.payloads import StsaStats
from fcl_flower.restore import RestoreError


class ForgetRefused(ValueError):
    """A removal the server does not apply (one line: why)."""


def as_upload(stats: StsaStats, num_samples: int) -> Upload:
    """The statistics of an upload as :mod:`fcl_flower.analytic.unlearning` takes them."""
    return Upload(stats.gram_packed, stats.class_sums, stats.counts, int(num_samples))


@dataclass(frozen=True)
class Commitment:
    """What the server accepted of one client for one task: the digest, the run it was accepted in,
    its number of samples and its counts per class of the task."""

    digest: str
    run: str
    num_samples: int
    counts: tuple[float, ...]


def context_of(run: str, client: str, task: int) -> dict[str, str | int]:
    """What a digest is bound to (the same on the client, which recomputes it from its store)."""
    return {"run": run, "client": client, "task": int(task)}


class Commitments:
    """Digests of the accepted plain uploads, per (client, task)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, int], Commitment] = {}

    def record(self, run: str, client: str, task: int, upload: Upload) -> Commitment:
        """Commit to ``upload`` of ``client`` for ``task`` (one per client and task: on time, or
        later as a backfill)."""
        digest = upload_digest(context_of(run, client, task), upload)
        return self._keep(client, task, digest, run, upload.num_samples, upload.counts)

    def record_arrays(
        self, run: str, client: str, task: int, arrays: Mapping[str, torch.Tensor], num_samples: int, counts: Any = ()
    ) -> Commitment:
        """Commit to an upload of another form than STSA's (STSA-E, FedRAN): its arrays as the server
        read them, by name (:func:`~fcl_flower.analytic.unlearning.arrays_digest`), with its number
        of samples and the counts per class of the task where the upload has them."""
        digest = arrays_digest(context_of(run, client, task), sorted(arrays.items()), num_samples)
        return self._keep(client, task, digest, run, num_samples, torch.as_tensor(counts, dtype=torch.float64))

    def _keep(
        self, client: str, task: int, digest: str, run: str, num_samples: int, counts: torch.Tensor
    ) -> Commitment:
        entry = Commitment(digest, run, int(num_samples), tuple(float(c) for c in counts.to(torch.float64).tolist()))
        self.entries[(client, task)] = entry
        return entry

    def drop(self, client: str, task: int) -> None:
        """The upload was left out after all (its sum failed its certificate): nothing to commit to."""
        self.entries.pop((client, task), None)

    def verify(self, client: str, task: int, upload: Upload) -> Commitment:
        """The commitment ``upload`` matches; ForgetRefused (why) when there is none or it differs."""
        return self._match(client, task, lambda entry: upload_digest(context_of(entry.run, client, task), upload))

    def verify_arrays(self, client: str, task: int, arrays: Mapping[str, torch.Tensor]) -> Commitment:
        """:meth:`verify` for an upload committed with :meth:`record_arrays` (its number of samples
        is the commitment's: the site re-sends only the arrays)."""

        def digest(entry: Commitment) -> str:
            return arrays_digest(context_of(entry.run, client, task), sorted(arrays.items()), entry.num_samples)

        return self._match(client, task, digest)

    def _match(self, client: str, task: int, digest: Callable[[Commitment], str]) -> Commitment:
        entry = self.entries.get((client, task))
        if entry is None:
            raise ForgetRefused(f"{client} has no accepted upload of stage {task + 1} to remove")
        if digest(entry) != entry.digest:
            raise ForgetRefused(
                f"the upload {client} names for stage {task + 1} is not the one the server accepted "
                f"(its SHA-256 differs from the commitment {entry.digest[:16]}…)"
            )
        return entry

    def tasks_of(self, client: str) -> list[int]:
        return sorted(task for (name, task) in self.entries if name == client)

    def state_dict(self) -> dict[str, Any]:
        return {
            f"{client}/{task}": {
                "digest": e.digest,
                "run": e.run,
                "num_samples": e.num_samples,
                "counts": list(e.counts),
            }
            for (client, task), e in sorted(self.entries.items())
        }

    def load_state_dict(self, state: Any) -> None:
        tree = fields.mapping(state, "state/commitments")
        entries: dict[tuple[str, int], Commitment] = {}
        for key, value in tree.items():
            where = f"state/commitments/{key}"
            client, _, task = str(key).rpartition("/")
            if not client or not task.isdigit():
                raise RestoreError(where, "must be named client/task")
            item = fields.mapping(value, where)
            digest = item.get("digest")
            if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise RestoreError(f"{where}/digest", "must be a SHA-256 in hex")
            run = item.get("run")
            if not isinstance(run, str):
                raise RestoreError(f"{where}/run", "must be the run id")
            samples = fields.integer(fields.entry(item, "num_samples", where), f"{where}/num_samples", 0)
            counts = item.get("counts")
            if not isinstance(counts, list) or not all(isinstance(c, (int, float)) for c in counts):
                raise RestoreError(f"{where}/counts", "must be a list of numbers")
            entries[(client, int(task))] = Commitment(digest, run, samples, tuple(float(c) for c in counts))
        self.entries = entries


def verified_removal(
    commitments: Commitments,
    client: str,
    task: int,
    added: Upload,
    kept: Upload | None,
    *,
    relative_tolerance: float,
    norm_bound: float = 0.0,
    nonnegative: bool = False,
) -> tuple[Upload, Upload]:
    """(the kept part, the removed part) of a removal that passes: ``added`` is the upload the
    server committed to for ``client`` and ``task``, and ``added − kept`` the statistics of some
    dataset (``kept`` None: the whole upload goes). ForgetRefused with the reason otherwise."""
    commitments.verify(client, task, added)
    if kept is None:
        kept = Upload.empty(
            int(added.class_sums.shape[0]), int(added.class_sums.shape[1]), added.gram_packed is not None
        )
    try:
        removed = check_removal(
            added, kept, relative_tolerance=relative_tolerance, norm_bound=norm_bound, nonnegative=nonnegative
        )
    except StatisticsRejected as err:
        raise ForgetRefused(
            f"{client}, stage {task + 1}: the part to remove is no dataset's statistics: {err}"
        ) from None
    return kept, removed
