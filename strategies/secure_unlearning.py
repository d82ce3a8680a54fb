"""The server's side of a forget round under secure aggregation (docs/unlearning.md, docs/privacy.md §8).

The forget round after stage S is its own secure round (:class:`~strategies.secure.SecureRounds`:
fresh keys, shares, masked upload, unmasking) over every active site, at least the threshold t.
Every masked upload has one layout: packed G, the class sums and counts of every class seen so
far, and a zero slot last. A leaving site masks the negation of what it removes, every other site
zeros (clients/secure_forget.py), and says in clear only whether it is leaving (``leaving`` in its
masked report: who asked is part of the record anyway). The server opens only the sum, −R.

R must be the statistics of some dataset: counts non-negative integers, none above what the
secure stages added to its class so far (:attr:`STSAStrategy.secure_class_counts`), and
[[G, C], [Cᵀ, diag(n)]] ⪰ 0 within the upload checks' tolerance plus the fixed-point rounding of
the encodings it is a difference of (fcl_flower/analytic/checks.py). Then R is subtracted from the
ridge state (:func:`~fcl_flower.analytic.unlearning.remove_upload`), the next solve re-selects γ and
re-certifies G, and the round is recorded (results.json ``unlearning``: who, what, counts, the
opened set's size, ``secure: true``). A round that cannot open, or an opened sum that fails the
check, changes nothing and is recorded with its reason; so is a named site that refuses (it
gave no ``forget-consent``).

What the server cannot check: that R is what the leaving site added (it never saw that); it can
only check that R is some dataset's statistics within what was added per class. And it learns R,
which anybody holding the aggregate before and after an exact removal computes by difference.
"""

from __future__ import annotations

import time
from logging import WARNING
from typing import TYPE_CHECKING, Any

import torch
from flwr.common.logger import log

from fcl_flower.analytic import packed_length
from fcl_flower.analytic.checks import StatisticsRejected, check_counts, check_packed_statistics, wire_epsilon
from fcl_flower.analytic.unlearning import Upload, remove_upload
from fcl_flower.privacy.secagg import add_ring
from fcl_flower.protocol import StatsRes, UploadError
from fcl_flower.protocol.payloads import MaskedStsaStats
from strategies.accounting import client_name, client_order
from strategies.base import Accepted, RoundPlan

if TYPE_CHECKING:
    from strategies.stsa import STSAStrategy

NAMES = ("gram-packed", "class-sums", "counts")


def read_masked_removal(strategy: STSAStrategy, plan: RoundPlan, reply: StatsRes) -> dict[str, Any]:
    """A secure forget round's masked reply: the forget layout's ring elements and whether the
    site says it is leaving (UploadError otherwise)."""
    if reply.secagg is None:
        raise UploadError("a secure forget round's reply without its masked report")
    if reply.backfill or reply.num_examples:
        raise UploadError("a masked removal carries nothing in clear")
    masked = MaskedStsaStats.read(
        reply.arrays, packed=packed_length(strategy.rf_dim), dim=strategy.rf_dim, classes=strategy.num_seen(plan.task)
    )
    return {"masked": masked, "leaving": reply.secagg.leaving}


class SecureForgetFold:
    """A secure forget round's masked replies, summed in the ring as they arrive; the sum is opened
    once the unmask step has rebuilt the secrets (:func:`apply_opened_removal`)."""

    def __init__(self, strategy: STSAStrategy, plan: RoundPlan) -> None:
        self.strategy, self.plan = strategy, plan
        self.sums: dict[str, Any] = {}
        self.survivors: set[str] = set()
        self.leaving: set[str] = set()
        # the replies rejected before this round (its own key, share and masked steps come after)
        self.rejected_before = dict(strategy.accounting.rejected)

    def add(self, item: Accepted[Any]) -> None:
        masked = item.payload["masked"]
        for name in NAMES:
            add_ring(self.sums, name, getattr(masked, name.replace("-", "_")))
        self.survivors.add(item.client)
        if item.payload["leaving"]:
            self.leaving.add(item.client)

    def finish(self) -> None:
        rejected = {
            client: why
            for client, why in self.strategy.accounting.rejected.items()
            if self.rejected_before.get(client) != why and client not in self.survivors
        }
        try:
            apply_opened_removal(self.strategy, self.plan, self.sums, self.survivors, self.leaving, rejected)
        finally:  # what was revealed for a forget round says nothing about who owes statistics
            if self.strategy.secure is not None:
                self.strategy.secure.revealed = set()


def _tolerance(strategy: STSAStrategy, task: int, leaving: int) -> float:
    """The fixed-point rounding R may carry: each leaving site's removal is a difference of at most
    two encodings per stage so far, each within 2^-(f+1) of its float64 statistics."""
    return 2 * (task + 1) * max(leaving, 1) * 2.0 ** -(strategy.cfg.secagg_fraction_bits + 1)


def check_opened_removal(
    strategy: STSAStrategy, task: int, gram: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor, leaving: int
) -> None:
    """R (the negated opened sum) is the statistics of some dataset within what was added per class;
    StatisticsRejected (one line) otherwise."""
    seen = strategy.num_seen(task)
    if not leaving:
        if bool(gram.any()) or bool(sums.any()) or bool(counts.any()):
            raise StatisticsRejected("the opened sum is not zero, though no site said it removes anything")
        return
    check_counts(counts, int(counts.sum()) if bool(torch.isfinite(counts).all()) else 0)
    totals = strategy.secure_class_counts[:seen]
    over = (counts > totals).nonzero().flatten().tolist()
    if over:
        c = int(over[0])
        raise StatisticsRejected(f"it removes {int(counts[c])} samples of class {c}, but {int(totals[c])} were added")
    check_packed_statistics(
        gram,
        sums,
        counts,
        relative_tolerance=wire_epsilon(torch.float64),
        absolute_tolerance=_tolerance(strategy, task, leaving),
        **strategy.feature_bounds,
    )


def apply_opened_removal(
    strategy: STSAStrategy,
    plan: RoundPlan,
    ring: dict[str, Any],
    survivors: set[str],
    leaving: set[str],
    rejected: dict[str, str] | None = None,
) -> None:
    """Open −R over the survivors, check R and subtract it; record the removal or why it was refused
    (``rejected``: the sites whose replies this round rejected, with why: a named site's refusal, a
    site whose own request failed)."""
    rejected = rejected or {}
    task, seen, dim = plan.task, strategy.num_seen(plan.task), strategy.rf_dim
    opened = {name: torch.from_numpy(values) for name, values in strategy.open_ring_sums(ring).items()}
    gram, sums = -opened["gram-packed"], -opened["class-sums"].reshape(dim, seen)
    counts, slot = -opened["counts"][:-1], float(opened["counts"][-1])
    named = {client_name(site) for site in strategy._forget_sites}
    who = sorted(leaving, key=client_order)
    base = {"secure": True, "opened_over": len(survivors), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        if slot != 0.0:
            raise StatisticsRejected("the slot after the counts is not zero")
        check_opened_removal(strategy, task, gram, sums, counts, len(leaving))
    except StatisticsRejected as err:
        reason = f"the opened removal fails its checks: {err}; nothing was removed"
        log(WARNING, "secure forget round after stage %d: %s", task + 1, reason)
        strategy.forgotten.append({**base, "who": ", ".join(who) or "(nobody)", "refused": reason})
        who = []
    if who:
        removed = int(counts.sum())
        remove_upload(strategy.ridge, range(seen), Upload(gram, sums, counts, removed))
        strategy.secure_class_counts[:seen] -= counts
        strategy.stack = None
        strategy.forgotten.append(
            {
                **base,
                "who": ", ".join(who),
                "requested_by": ", ".join("server operator" if c in named else "site" for c in who),
                "what": ", ".join("client" if c in named else "samples" for c in who),
                "stages": list(range(1, task + 2)),
                "removed_samples": removed,
                "removed_counts": {str(c): int(n) for c, n in enumerate(counts.tolist()) if n},
            }
        )
        for client in who:
            if client in named:
                strategy.withdraw(client)
    for client in sorted((named - set(who)) | set(rejected), key=client_order):
        if client in leaving:
            continue  # its removal was refused above, with the reason
        why = rejected.get(client, "no masked removal from it in the forget round")
        log(WARNING, "secure forget round after stage %d: %s took no part as a leaving site: %s", task + 1, client, why)
        strategy.forgotten.append({**base, "who": client, "refused": why})
