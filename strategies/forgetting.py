"""The forget round between stages, one code path for every analytic method that can forget
(issue 33, docs/unlearning.md; the registry's ``forget`` capability).

:class:`ForgetRounds` is what STSA, STSA-E and FedRAN share: the server's commitments to the
uploads it accepted (strategies/unlearning.py), the forget round run config ``forget`` asks for
after a stage (:meth:`ForgetRounds.between_stages`: phase ``<method>-forget``), the withdrawal of a
site forgotten wholly, the re-solve after removals (γ re-selected under ``ridge auto``) with its
record in results.json, and their checkpoint. A method says how a removal changes its state.

:class:`WholeSiteForgetting` adds the round of a method that forgets whole sites only (STSA-E,
FedRAN): the named site re-sends every upload it kept (:class:`~fcl_flower.protocol.payloads.SiteUploads`,
read with the method's own parse of a statistics upload), every one is checked against its
commitment before anything changes, then :meth:`WholeSiteForgetting.remove_site` takes them out
(all or nothing). STSA's round also takes a site's own sample requests (strategies/stsa.py).
"""

from __future__ import annotations

import dataclasses
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar, TypeVar

from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fcl_flower import restore as fields
from fcl_flower.config import RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.methods import Kind
from fcl_flower.protocol import Instruction, Reply, StatsIns, StatsRes, UploadError
from fcl_flower.protocol.payloads import SiteUploads
from fcl_flower.restore import RestoreError
from fcl_flower.results import ResultsRecorder
from strategies.accounting import client_name
from strategies.analytic import AnalyticStrategy
from strategies.base import Accepted, RoundFold, RoundPlan, StageFailed
from strategies.loop import run_one_round
from strategies.unlearning import Commitment, Commitments, ForgetRefused

U = TypeVar("U")


def site_of(client: str) -> int:
    """The client id of ``client-<id>``."""
    return int(client.rsplit("-", 1)[1])


class ForgetRounds(AnalyticStrategy):
    """An analytic method with a forget round (module doc)."""

    forget_phase: ClassVar[str] = ""  # the method's forget round (a phase of its registry entry)

    def __init__(self, cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> None:
        super().__init__(cfg, split, recorder)
        # a digest of every accepted plain upload, per client and task: what a removal must match
        self.commitments = Commitments()
        self.removals_scheduled = bool(cfg.forget_requests())
        self.forgotten: list[dict[str, Any]] = []  # the removals applied since the last re-solve
        self.unlearning_log: list[dict[str, Any]] = []  # every re-solve after removals (results.json)
        self._forget_sites: tuple[int, ...] = ()  # the sites the forget round in progress removes wholly

    # ---------------------------------------------------------------- removals
    def record_removal(
        self, client: str, task: int, samples: int, counts: dict[str, int], *, what: str, requested_by: str
    ) -> dict[str, Any]:
        """Note one applied removal for the next re-solve's record (results.json ``unlearning``)."""
        event = {
            "who": client,
            "requested_by": requested_by,
            "what": what,
            "task": task,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "removed_samples": samples,
            "removed_counts": counts,
        }
        self.forgotten.append(event)
        return event

    def site_uploads(
        self, client: str, uploads: Mapping[int, U], verify: Callable[[int, U], Commitment]
    ) -> dict[int, tuple[U, Commitment]]:
        """A whole-site removal's uploads of the stages the server accepted, each verified against
        its commitment (``verify``) before any is applied; ForgetRefused (why) where a stage the
        site contributed to is missing or an upload is not the one committed to. A kept upload the
        server never accepted (rejected, or lost on the way) took nothing in and is passed over."""
        committed = self.commitments.tasks_of(client)
        missing = [t for t in committed if t not in uploads]
        if missing:
            raise ForgetRefused(f"{client}: its uploads of stage(s) {[t + 1 for t in missing]} are not in the request")
        return {task: (uploads[task], verify(task, uploads[task])) for task in committed}

    def withdraw(self, client: str) -> None:
        """``client`` is forgotten wholly: no later round goes to it."""
        self.nodes.withdrawn.add(site_of(client))

    # ---------------------------------------------------------------- the round
    def between_stages(self, grid: Grid, task: int, timeout: float) -> None:
        """The forget round run config ``forget`` asks for after stage ``task`` + 1: every site is
        asked (the named ones re-send their uploads to be removed wholly, the others apply their own
        requests where the method takes them), then W is solved again and the removals recorded."""
        requests = self.cfg.forget_requests()
        if task + 1 not in requests:
            return
        self._forget_sites = tuple(s for s in requests[task + 1] if s not in self.nodes.withdrawn)
        plan = RoundPlan(task, self.forget_phase, Kind.STATS)
        rejected = dict(self.accounting.rejected)
        try:
            run_one_round(self, grid, plan, timeout, Result())
        except StageFailed as err:  # nobody answered: nothing was removed
            self.forgotten.append({"refused": f"the forget round after stage {task + 1} failed: {err}"})
        finally:
            self._forget_sites = ()
        told = {event.get("who") for event in self.forgotten if "refused" in event}  # the fold said why already
        for who, why in sorted(self.accounting.rejected.items()):  # a site's error or a rejected reply
            if rejected.get(who) != why and who not in told:
                self.forgotten.append({"who": who, "refused": f"its forget reply was rejected: {why}"})
        if self.forgotten:
            record = self.resolve(task)
            log(
                INFO,
                "[stage %d] after the forget round: accuracy %.2f%% (was %.2f%%)",
                task + 1,
                record["accuracy_after"],
                record["accuracy_before"],
            )

    def resolve(self, task: int) -> dict[str, Any]:
        """Solve again after removals (γ re-selected under ``ridge auto``) and score: the record of
        the removals, with the accuracy (all seen classes and per task) before and after."""
        before, per_task_before, _ = self.score_central(task)
        self.weights, _extra = self.solve(task)
        after, per_task_after, _ = self.score_central(task)
        record = {
            "after_stage": task + 1,
            "requests": list(self.forgotten),
            "accuracy_before": before,
            "accuracy_after": after,
            "per_task_before": per_task_before,
            "per_task_after": per_task_after,
            "ridge_after": _extra.get("ridge"),
        }
        self.forgotten = []
        self.unlearning_log.append(record)
        self.recorder.info["unlearning"] = self.unlearning_log  # results.json: who, what, when, counts, accuracy
        self.recorder.write()
        return record

    # ---------------------------------------------------------------- checkpoint
    def forgetting_state(self) -> dict[str, Any]:
        return {
            "commitments": self.commitments.state_dict(),
            "withdrawn": sorted(self.nodes.withdrawn),
            "unlearning": list(self.unlearning_log),
        }

    def load_forgetting_state(self, state: dict[str, Any]) -> None:
        self.commitments.load_state_dict(state.get("commitments", {}))
        withdrawn = fields.integers(state.get("withdrawn", []), "state/withdrawn", 0, self.cfg.num_clients - 1)
        for site in withdrawn:
            self.withdraw(client_name(site))
        log_entries = state.get("unlearning", [])
        if not isinstance(log_entries, list) or not all(isinstance(e, dict) for e in log_entries):
            raise RestoreError("state/unlearning", "must be the list of the forget rounds' records")
        self.unlearning_log = list(log_entries)
        if self.unlearning_log:
            self.recorder.info["unlearning"] = self.unlearning_log


class SiteForgetFold:
    """A forget round's replies, one at a time: a named site's removal is applied (and the site
    withdrawn) or refused with its reason; a named site without an acceptable reply is recorded as
    refused. Sites not named have nothing to remove here (STSA's fold also applies their own
    requests: :meth:`apply`)."""

    def __init__(self, strategy: Any, plan: RoundPlan) -> None:
        self.strategy, self.plan = strategy, plan
        self.answered: set[str] = set()

    def add(self, item: Accepted[Any]) -> None:
        self.answered.add(item.client)
        try:
            self.apply(item)
        except ForgetRefused as err:
            log(WARNING, "removal refused for %s: %s", item.client, err)
            self.strategy.forgotten.append({"who": item.client, "refused": str(err)})

    def apply(self, item: Accepted[Any]) -> None:
        strategy = self.strategy
        if site_of(item.client) in strategy._forget_sites:
            strategy.forget_site(item.client, item.payload)
            strategy.withdraw(item.client)

    def finish(self) -> None:
        strategy = self.strategy
        for site in strategy._forget_sites:  # named, but no acceptable answer: nothing was removed
            name = client_name(site)
            if name not in self.answered:
                strategy.forgotten.append({"who": name, "refused": "no acceptable reply in the forget round"})


class WholeSiteForgetting(ForgetRounds):
    """A method whose forget round removes whole sites only (STSA-E, FedRAN; module doc)."""

    upload_keys: ClassVar[tuple[str, ...]] = ()  # the arrays of one statistics upload

    @abstractmethod
    def read_upload(self, task: int, record: Any) -> Any:
        """The method's parse (and checks) of one statistics upload of stage ``task``."""

    @abstractmethod
    def remove_site(self, client: str, uploads: dict[int, tuple[Any, Commitment]]) -> None:
        """Take ``client``'s verified uploads (by task, with their commitments) out of the state,
        all of them or none (ForgetRefused with the reason before anything changes)."""

    def commit_upload(self, client: str, task: int, payload: Any, num_samples: int, counts: Any = ()) -> None:
        """Keep the digest of an accepted upload (its arrays as read) in a run that schedules removals."""
        if self.removals_scheduled:
            self.commitments.record_arrays(self.run_id, client, task, payload.arrays(), num_samples, counts)

    def forget_site(self, client: str, uploads: dict[int, Any]) -> list[dict[str, Any]]:
        """``client`` out of every stage it contributed to (the server operator's request), verified
        first; one removal record per stage."""
        verified = self.site_uploads(
            client, uploads, lambda task, payload: self.commitments.verify_arrays(client, task, payload.arrays())
        )
        self.remove_site(client, verified)
        events = []
        for task, (_, entry) in sorted(verified.items()):
            self.commitments.drop(client, task)
            counts = {str(c): int(n) for c, n in zip(self.split.tasks[task], entry.counts) if n}
            events.append(
                self.record_removal(
                    client, task, entry.num_samples, counts, what="client", requested_by="server operator"
                )
            )
        return events

    def customise(self, plan: RoundPlan, ins: Instruction) -> Instruction:
        if isinstance(ins, StatsIns) and plan.phase == self.forget_phase:
            return dataclasses.replace(ins, forget=self._forget_sites)
        return super().customise(plan, ins)

    def read_reply(self, plan: RoundPlan, reply: Reply) -> Any:
        if plan.phase != self.forget_phase:
            return super().read_reply(plan, reply)
        if not isinstance(reply, StatsRes):
            raise UploadError("expected a statistics reply")
        return SiteUploads.read(
            reply.arrays,
            keys=self.upload_keys,
            tasks=range(plan.task + 1),
            read_one=lambda record, task: self.read_upload(task, record),
        )

    def stats_fold(self, plan: RoundPlan) -> RoundFold | None:
        return SiteForgetFold(self, plan) if plan.phase == self.forget_phase else super().stats_fold(plan)
