"""Secure rounds as a component: keys, shares, masked upload, unmasking -- one attempt.

With ``secure-aggregation`` the statistics round of a stage, and every stage-1 FedAvg round, is
four steps (fcl_flower/privacy/secagg.py has the math, fcl_flower/protocol/secure.py the
messages; in a FedAvg round step 3 is the ``train`` message and the masked upload is the
fixed-point vector of (n_k · w_k, n_k), fcl_flower/privacy/secure_fedavg.py), two exchanges
after the run's first secure round (step 1 rides with the previous round's step 3, step 2 with
its step 4: *shares ahead*; :attr:`SecureRounds.shares_ahead` off, step 1 alone rides with step 4:
*keys ahead*, three exchanges):

1. ``query.keys``: every node makes two fresh key pairs and answers with the public halves
   (signed with its SuperNode key in signed-keys mode). U1: the nodes that answered. Where the
   round goes to every node, nodes not heard from get this step too and their replies are their
   first contact (strategies/nodes.py: every claim settled at once before any reply is
   identified), so a secure run sends no ``query.info``. Ahead: the
   previous secure round's masked upload (shares ahead) or ``query.unmask`` instruction (keys
   ahead) named this round's key step (its header: run, task, stage, round, attempt 0; the host
   names the next secure round, :meth:`SecureHost.next_secure_round`) and each node sent these
   keys, made exactly so, inside that reply (:class:`Prepared`). Keys ahead stand in for the
   exchange only for the very key step they were made for and only where every target node was
   asked; a restarted attempt, a node not asked (dropped before that unmask step, joined,
   sampled), fewer than ``secagg-min-clients`` keys ahead, and a resumed run (nothing ahead is
   ever in the checkpoint) exchange the step, and the fresh keys replace those made ahead before
   anything is dealt over them.
2. ``query.shares``: U1's keys to every node of U1; each answers with Shamir shares of its
   self-mask seed and mask key, one encrypted bundle per participant. U2: the nodes that did.
   Shares ahead: the previous round's unmask instruction carried this step (U1: the survivors
   whose masked uploads carried usable keys, at least ``secagg-min-clients`` of them, else it
   asks keys ahead instead) and each survivor dealt in its unmask reply (:class:`DealtAhead`,
   checked as a shares reply is). They serve only for the very round they were dealt for, where
   every target was asked, U1 is among the targets with no barred node, at least ``threshold``
   dealt and, under ``require-all-clients``, every target did (:meth:`SecureRounds._take_dealt`);
   otherwise the round exchanges a full key step (never a shares step over keys already dealt
   over: a node refuses to deal over one set of keys twice).
3. ``query.stats`` to U2, each node with the bundles addressed to it: every client uploads its
   statistics masked. Every reply is screened (parsed, identified, shapes checked) as it
   arrives and handed on to be summed in the ring and dropped (:meth:`SecureRounds.run` is a
   stream, strategies/stream.py); U3: the ones that passed. A reply that fails is treated like
   a dropout. Shares ahead: the instruction also names the next secure round's key step and
   each reply carries the node's fresh keys for it.
4. ``query.unmask`` to U3: survivors reveal their shares of U3's self-mask seeds and of the
   mask keys of U2 \\ U3. With ≥ t shares the server rebuilds them and opens Σ_{U3} x_k (the
   method does, from :attr:`SecureRounds.opening`). Where a secure round follows, the
   instruction also carries its shares step (shares ahead) or names its key step (keys ahead),
   and each reply carries the survivor's bundles or keys for it.

Dropouts and rejected uploads are recovered inside the attempt: there is never a second attempt
over the same inputs, and nothing is opened unless at least ``threshold`` (a majority, and at
least ``secagg-min-clients``) survive. A round that cannot be opened fails the stage cleanly
(:class:`~strategies.base.StageFailed`): the previous classifier is kept.

Against misbehaving clients (blame instead of stall): every dealer commits to the shares it deals
and to its secrets; a recipient whose bundle does not open accuses the dealer in its masked upload;
a dealer accused by two or more participants so that fewer than ``threshold`` survivors hold its
shares is barred before the unmask step and the round runs again without it; every revealed share
is checked against its commitment and every rebuilt secret against the dealer's. Whoever broke the
protocol is named (stage extra ``secagg_blame``) and is not admitted to later secure rounds of the
run (:attr:`SecureRounds.barred`); with ``threshold`` honest nodes left the round opens, and a
round that cannot names who stopped it.

The component knows nothing of the method: the strategy (:class:`SecureHost`) builds the
instructions, identifies nodes and screens replies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, Protocol

from flwr.app import Message
from flwr.common.logger import log
from flwr.serverapp import Grid

from fcl_flower.config import RunConfig
from fcl_flower.methods import Kind
from fcl_flower.privacy.secagg import (
    KEY_BYTES,
    MASK_KEY,
    SEED,
    SecretNotRebuilt,
    SecureAggregationError,
    agree,
    generate_keypair,
    rebuild_secret,
    round_context,
    threshold_for,
    verify_keys,
    verify_view,
    view_context,
)
from fcl_flower.protocol import (
    DealtShares,
    Header,
    Instruction,
    KeysIns,
    KeysRes,
    MaskedReport,
    ProtocolError,
    PublicKeys,
    Reply,
    SecAggRound,
    SharesAhead,
    SharesIns,
    SharesRes,
    StatsIns,
    TrainIns,
    UnmaskIns,
    UnmaskRes,
    UploadError,
    message_bytes,
    parse_reply,
)
from fcl_flower.protocol.base import SECAGG
from strategies.accounting import StageAccounting
from strategies.base import RoundPlan, StagedStrategy, StageFailed
from strategies.nodes import NodeDirectory
from strategies.stream import ReplyStream, exchange

KEYS_PHASE, SHARES_PHASE, UNMASK_PHASE = "secagg-keys", "secagg-shares", "secagg-unmask"


class SecureHost(Protocol):
    """What the secure rounds need from the strategy that runs them."""

    cfg: RunConfig
    server_round: int
    accounting: StageAccounting
    nodes: NodeDirectory

    def header(self, plan: Any, attempt: int) -> Header: ...

    def instruction(self, plan: Any, header: Header) -> Instruction: ...

    def messages(
        self,
        grid: Grid,
        plan: Any,
        attempt: int,
        exclude: set[int],
        build: Callable[[int], Instruction] | None = None,
        only: set[int] | None = None,
        side: bool = False,
        first_contact: bool = False,
    ) -> list[Message]: ...

    def settle_claims(self, received: list[Message], sent: Callable[[int], Header | None], kind: Kind) -> None: ...

    def accept(self, plan: Any, message: Message, taken: set[str]) -> Any: ...

    def reject(self, message: Message, err: Any, server_round: int) -> None: ...

    def identify(self, node: int, reply: Reply) -> str: ...

    def in_client_order(self, nodes: list[int]) -> list[int]: ...

    def next_secure_round(self, plan: Any) -> Header | None:
        """The header of the secure round after ``plan``'s, where known (keys ahead); else None."""
        ...


@dataclass(frozen=True)
class DealtAhead:
    """Shares ahead: the next secure round's shares step, answered with this round's unmask replies."""

    keys: Mapping[int, PublicKeys]  # U1: the keys the shares were dealt over (checked when they were relayed)
    clients: Mapping[int, int]  # node -> client, as relayed with them
    threshold: int
    bundles: Mapping[int, Mapping[int, bytes]]  # U2: dealer -> recipient -> encrypted bundle
    commitments: Mapping[int, Mapping[int, bytes]]  # dealer -> recipient -> commitment
    secrets: Mapping[int, bytes]  # dealer -> its secret commitment


@dataclass(frozen=True)
class Prepared:
    """Keys ahead: the next secure round's public keys, sent with this round's unmask replies; or
    shares ahead: sent with its masked uploads, and the shares dealt over them with its unmask replies."""

    header: Header  # the key step they are for (phase KEYS_PHASE, attempt 0): what their signatures bind
    asked: frozenset[int]  # the nodes asked to prepare them
    keys: Mapping[int, PublicKeys]  # node -> its public keys (unchecked: checked as a key reply is, at use)
    dealt: DealtAhead | None = None  # shares ahead: the next round's shares step, answered


@dataclass(frozen=True)
class Opening:
    """What opening the masked sum of one round needs (fcl_flower.privacy.secagg.unmask_sum)."""

    seeds: Mapping[int, bytes]  # survivor node -> its rebuilt self-mask seed
    dropped_keys: Mapping[int, bytes]  # dropped or rejected node -> its rebuilt mask key
    s_publics: Mapping[int, bytes]  # every U2 node's mask public key
    context: bytes


UNSIGNED_WARNING = (
    "secure aggregation without signed keys protects against an honest-but-curious server only: a server "
    "that deviates from the protocol can open one client's statistics; set secagg-signed-keys=true "
    "(docs/privacy.md)"
)
COMMITMENT_BYTES = 64
MAX_ATTEMPTS = 3  # a secure round restarted at most twice in a stage (each restart bars at least one client)


class RestartSecureRound(Exception):
    """The attempt cannot open (a barred dealer holds back its shares); nothing was revealed."""

    def __init__(self, attempt: int, barred: list[str]) -> None:
        super().__init__(f"secure round restarted without {', '.join(barred)}")
        self.attempt = attempt  # SHA-256 of the seed share (or seed) ‖ of the key share (or key)


class SecureRounds:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        if not cfg.secagg_signed_keys:
            log(WARNING, UNSIGNED_WARNING)
        self.current: SecAggRound | None = None  # the round whose masked replies are being read
        self.opening: Opening | None = None
        self.barred: dict[int, str] = {}  # client -> why it is not admitted to secure rounds any more
        self._commitments: dict[int, Mapping[int, bytes]] = {}  # dealer -> recipient -> commitment
        self._secrets: dict[int, bytes] = {}  # dealer -> its secret commitment
        self._accusers: dict[int, set[int]] = {}  # accused dealer -> the nodes that accused it
        self.revealed: set[str] = set()  # clients asked to reveal their shares in this round: opened once
        self.blame: dict[str, list[str]] = {}  # this round's evidence: client -> what it was named for
        self.prepared: Prepared | None = None  # keys ahead for the next round (never in a checkpoint)
        self.shares_ahead = True  # ask the next round's keys with the masked upload and its shares with unmasking

    def bar(self, host: SecureHost, node: int, why: str) -> None:
        """Name ``node``'s client with the evidence and keep it out of later secure rounds."""
        client = host.nodes.client_of.get(node)
        name = self._name(host, node)
        log(WARNING, "round %d: %s is barred from secure rounds of this run: %s", host.server_round, name, why)
        self.blame.setdefault(name, []).append(f"barred: {why}")
        host.accounting.reject(name, f"barred from secure aggregation: {why}")
        if client is not None:
            self.barred.setdefault(client, why)

    def _barred_nodes(self, host: SecureHost) -> set[int]:
        return {node for node, client in host.nodes.client_of.items() if client in self.barred}

    def run(self, host: SecureHost, grid: Grid, plan: Any, timeout: float, attempt: int = 0) -> Iterator[Message]:
        """The screened masked replies of the survivors, as they arrive; once the last one is
        handed on, the unmask step runs and :attr:`opening` opens their sum.

        Raises :class:`RestartSecureRound` before anything is revealed when a dealer accused with
        checked evidence left fewer than ``threshold`` survivors holding its shares: the attempt
        could not open; the dealer is barred and the strategy runs the round again without it
        (fresh keys, ``attempt`` + 1; nothing of this attempt is ever unmasked)."""
        self.current, self.opening = None, None
        self._commitments, self._secrets, self.revealed = {}, {}, set()
        self._accusers = {}
        if attempt == 0:
            self.blame = {}
        header = host.header(plan, attempt)
        prepared, self.prepared = self.prepared, None  # used in this round's first attempt, or never
        keys_header = dataclasses.replace(header, phase=KEYS_PHASE)
        instruction = KeysIns(keys_header, self.cfg)
        # the key step's messages, one per target node (not barred): sent unless keys ahead serve
        # (nodes not heard from get it too, where it goes to every node: their key replies say
        # which client they serve, settled all at once before any is identified; no query.info)
        sent = host.messages(
            grid, plan, 0, self._barred_nodes(host), build=lambda node: instruction, side=True, first_contact=True
        )
        dealt = self._take_dealt(host, keys_header, prepared, {m.metadata.dst_node_id for m in sent})
        if dealt is not None:  # shares ahead: the round starts at its masked upload
            keys, clients, threshold = dict(dealt.keys), dict(dealt.clients), dealt.threshold
            bundles = dict(dealt.bundles)
            self._commitments, self._secrets = dict(dealt.commitments), dict(dealt.secrets)
            for client, why in sorted(self.barred.items()):
                host.accounting.reject(f"client-{client}", f"barred from secure aggregation: {why}")
        else:
            if prepared is not None and prepared.dealt is not None:
                prepared = None  # shares were dealt over those keys: only fresh keys replace them
            keys = self._collect_keys(host, grid, keys_header, sent, timeout, prepared)
            if len(keys) < self.cfg.secagg_min_clients:
                raise StageFailed(
                    f"secure aggregation needs at least {self.cfg.secagg_min_clients} participants, "
                    f"{len(keys)} sent keys"
                )
            threshold = threshold_for(len(keys), self.cfg.secagg_min_clients, self.cfg.secagg_signed_keys)
            clients = {node: host.nodes.client_of[node] for node in keys}  # identified in the key round
            bundles = self._collect_shares(host, grid, plan, header, keys, clients, threshold, timeout)
            if len(bundles) < threshold:
                raise StageFailed(f"{len(bundles)} node(s) shared their secrets, the threshold is {threshold}")
        context = round_context(header.run_id, header.task, header.stage, header.server_round, header.attempt, keys)
        participants = {node: keys[node] for node in bundles}
        self.current = SecAggRound(tuple(sorted(keys)), participants, {n: clients[n] for n in bundles}, threshold)
        upload_ins = host.instruction(plan, header)  # a statistics round, or a stage-1 FedAvg round
        assert isinstance(upload_ins, (StatsIns, TrainIns))
        backfill = upload_ins.backfill if isinstance(upload_ins, StatsIns) else {}
        # what every mask and every view signature binds: the participants, clients and backfill request
        view = view_context(context, participants, self.current.binding(backfill))
        # shares ahead: the next secure round's key step rides with this masked upload
        ahead = host.next_secure_round(plan) if self.shares_ahead else None
        prepare = None if ahead is None else dataclasses.replace(ahead, phase=KEYS_PHASE, attempt=0)

        def build(node: int) -> Instruction:
            assert self.current is not None
            shares = {src: bundles[src][node] for src in bundles}
            commitments = {src: self._commitments[src][node] for src in bundles}
            secagg = dataclasses.replace(self.current, shares=shares, commitments=commitments, prepare=prepare)
            return dataclasses.replace(upload_ins, secagg=secagg)

        def messages(attempt: int, nodes: list[int]) -> list[Message]:
            return host.messages(grid, plan, 0, set(), build=build, only=set(nodes))

        good: dict[int, str] = {}
        signatures: dict[int, bytes] = {}
        upload_keys: dict[int, PublicKeys] = {}  # shares ahead: the next round's keys, as the uploads carried them
        for message in ReplyStream(grid, messages, host.in_client_order(list(bundles)), timeout=timeout):
            try:
                item = host.accept(plan, message, set(good.values()))
                node = message.metadata.src_node_id
                report = self._screen(host, message, item.client, participants, bundles, (context, view), prepare)
                signatures[node] = report.view_signature
                if report.next_keys is not None:
                    upload_keys[node] = report.next_keys
            except ProtocolError as err:
                host.reject(message, err, host.server_round)
                continue
            good[node] = item.client
            yield message  # summed in the ring by the strategy, then dropped
        if len(good) < threshold:
            raise StageFailed(f"{len(good)} valid masked upload(s), the threshold is {threshold}: nothing is opened")
        dropped = sorted(set(bundles) - set(good))
        if self.cfg.require_all_clients:
            expected = {f"client-{c}" for c in range(self.cfg.num_clients)}
            missing = expected - {f"client-{clients[n]}" for n in good}
            if missing:  # never re-run over the same inputs: stop before anything is opened
                raise StageFailed(f"no valid masked upload from {', '.join(sorted(missing))}")
        if dropped:
            log(
                WARNING,
                "round %d: node(s) %s dropped or were rejected; their masks are removed in this "
                "attempt, their statistics stay hidden",
                host.server_round,
                ", ".join(map(str, dropped)),
            )
        doomed = self._unopenable(set(good), threshold)
        if doomed:  # before anything is revealed: this attempt's uploads are never unmasked
            for dealer in doomed:
                self.bar(
                    host,
                    dealer,
                    f"{len(self._accusers[dealer])} participants could not open its share bundles: fewer "
                    f"than the threshold {threshold} hold its shares",
                )
            raise RestartSecureRound(attempt + 1, [self._name(host, d) for d in doomed])
        survivors = sorted(good)
        self.revealed = set(good.values())
        seeds, dropped_keys = self._unmask(
            host,
            grid,
            plan,
            header,
            survivors,
            dropped,
            {n: signatures[n] for n in survivors},
            threshold,
            context,
            timeout,
            (prepare, upload_keys),
        )
        self.opening = Opening(seeds, dropped_keys, {n: k.s for n, k in participants.items()}, view)

    def _screen(
        self,
        host: SecureHost,
        message: Message,
        client: str,
        participants: Mapping[int, PublicKeys],
        bundles: Mapping[int, Mapping[int, bytes]],
        contexts: tuple[bytes, bytes],
        prepare: Header | None,
    ) -> MaskedReport:
        """What rides beside a masked upload: its view signature (checked in signed-keys mode: the
        node masked over this round's view) and its accusations, each checked against the bundle
        the server relayed. A false accusation is a ProtocolError of its accuser, who is barred; a
        founded one names the dealer. Returns the report; raises UploadError naming ``client``."""
        node = message.metadata.src_node_id
        record = message.content.config_records.get(SECAGG)
        context, view = contexts
        try:
            if record is None:
                raise ProtocolError(f"masked upload without its '{SECAGG}' record")
            report = MaskedReport.from_entries(record)
            if report.next_keys is not None and prepare is None:
                raise ProtocolError("masked upload: keys that were not asked for")
            if self.cfg.secagg_signed_keys:
                try:
                    verify_view(participants[node].signer, report.view_signature, view)
                except SecureAggregationError as err:
                    raise ProtocolError(f"masked upload: {err}") from None
            self._check_accusations(host, node, report, bundles, context)
        except ProtocolError as err:
            rejected = UploadError(str(err))
            rejected.client = client
            raise rejected from None
        return report

    def _unopenable(self, survivors: set[int], threshold: int) -> list[int]:
        """Dealers accused by two or more participants whose shares too few survivors hold to open
        the sum (a single accuser, who may lie, never removes anyone)."""
        return sorted(
            dealer
            for dealer, accusers in self._accusers.items()
            if len(accusers) >= 2 and len(survivors - accusers) < threshold
        )

    def _check_accusations(
        self,
        host: SecureHost,
        node: int,
        report: MaskedReport,
        bundles: Mapping[int, Mapping[int, bytes]],
        context: bytes,
    ) -> None:
        """Record the dealers ``node`` accuses. An accusation cannot be proven (no key may travel as
        evidence), so it counts only where at least two participants accuse the same dealer
        (:meth:`_unopenable`); alone it is recorded and changes nothing."""
        for dealer, reason in sorted(report.accused.items()):
            if dealer not in bundles or dealer == node:
                raise ProtocolError(f"masked upload accuses node {dealer}, which dealt it no shares")
            log(
                WARNING,
                "round %d: %s accuses %s: %s",
                host.server_round,
                self._name(host, node),
                self._name(host, dealer),
                reason,
            )
            self._accusers.setdefault(dealer, set()).add(node)
            self.blame.setdefault(self._name(host, dealer), []).append(f"accused by {self._name(host, node)}: {reason}")

    # ---------------------------------------------------------------- the steps
    def _exchange(
        self, host: SecureHost, grid: Grid, sent: list[Message], timeout: float, kind: Kind, header: Header
    ) -> dict[int, Reply]:
        """Send one step's messages (:meth:`_step`), parse and identify every reply; bad ones are
        logged and left out."""
        answers: dict[int, Reply] = {}
        replies = exchange(grid, sent, timeout)
        asked = {m.metadata.dst_node_id for m in sent}
        received = list(replies)
        if kind is Kind.KEYS:  # first contact: map the nodes not heard from by their claims, all at once
            host.settle_claims(received, lambda node: header if node in asked else None, kind)
        for message in received:
            node = message.metadata.src_node_id
            try:
                if node not in asked:  # it claims nothing, whatever it says (the step went to others)
                    raise ProtocolError("a reply from a node this step was not sent to")
                reply = parse_reply(message, header, kind)
                client = host.identify(node, reply)
            except ProtocolError as err:
                log(WARNING, "Rejected %s from node %d in round %d: %s", header.phase, node, host.server_round, err)
                host.accounting.reject(self._name(host, node), f"{header.phase}: {err}")
                continue
            if host.nodes.client_of.get(node) in self.barred:
                host.accounting.reject(
                    client, f"barred from secure aggregation: {self.barred[host.nodes.client_of[node]]}"
                )
                continue
            host.accounting.accept(client, 0, message_bytes(message.content))
            answers[node] = reply
        for node, why in getattr(replies, "dropped", ()):  # a node that answered this step twice
            host.accounting.duplicate(f"node-{node}", f"{self._name(host, node)} (node {node}) {header.phase}: {why}")
        return answers

    @staticmethod
    def _step(host: SecureHost, grid: Grid, plan: Any, instruction: Instruction, only: set[int]) -> list[Message]:
        """One step's messages: ``instruction`` to each node of ``only`` that the round targets."""
        return host.messages(grid, plan, 0, set(), build=lambda node: instruction, only=only, side=True)

    @staticmethod
    def _name(host: SecureHost, node: int) -> str:
        client = host.nodes.client_of.get(node)
        return f"node-{node}" if client is None else f"client-{client}"

    def _collect_keys(
        self,
        host: SecureHost,
        grid: Grid,
        keys_header: Header,
        sent: list[Message],
        timeout: float,
        prepared: Prepared | None,
    ) -> dict[int, PublicKeys]:
        """U1: the key step's answers (``sent``: its messages), checked. Keys ahead
        (:meth:`_take_prepared`) stand in for the key exchange where they were made for this very
        step; else the step is an exchange."""
        offered = self._take_prepared(host, keys_header, prepared, {m.metadata.dst_node_id for m in sent})
        if offered is None:
            answers = self._exchange(host, grid, sent, timeout, Kind.KEYS, keys_header)
            offered = {node: reply.keys for node, reply in answers.items() if isinstance(reply, KeysRes)}
        for client, why in sorted(self.barred.items()):
            host.accounting.reject(f"client-{client}", f"barred from secure aggregation: {why}")
        keys: dict[int, PublicKeys] = {}
        for node, public in offered.items():
            unusable = self._unusable(host, node, public)
            if unusable is not None:
                if unusable:  # a low-order point (a wrong length is rejected, not barred)
                    self.bar(host, node, f"its public keys are unusable: {unusable}")
                continue
            keys[node] = public
        return keys

    def _unusable(self, host: SecureHost, node: int, public: PublicKeys) -> str | None:
        """Why ``public`` cannot serve in a round (None: it can): not 32-byte X25519 keys (logged and
        rejected here), or a low-order point that would make every peer's key agreement fail."""
        if len(public.c) != KEY_BYTES or len(public.s) != KEY_BYTES:
            log(WARNING, "node %d sent keys that are not %d-byte X25519 keys; it is left out", node, KEY_BYTES)
            host.accounting.reject(self._name(host, node), f"secure key round: no {KEY_BYTES}-byte public keys")
            return ""
        try:
            probe = generate_keypair()[0]
            agree(probe, public.c), agree(probe, public.s)
        except SecureAggregationError as err:
            return str(err)
        return None

    @staticmethod
    def _self_signed(host: SecureHost, header: Header, keys: Mapping[int, PublicKeys]) -> dict[int, PublicKeys]:
        """Signed-keys mode, shares ahead: the keys whose signature verifies under the signer they
        name, over the round they are for, each signer named once. Every node checks them against
        the operator's list before it deals (and refuses the whole unmask step otherwise), so keys
        that fail even this are left out of U1 here: one client's bad keys never stop the round
        being unmasked. (The server holds no list; a key signed by an unlisted signer still makes
        the nodes refuse, as it makes them refuse a shares step.)"""
        context = round_context(header.run_id, header.task, header.stage, header.server_round, header.attempt, ())
        signers = [k.signer for k in keys.values()]
        out: dict[int, PublicKeys] = {}
        for node, k in keys.items():
            try:
                if signers.count(k.signer) > 1:
                    raise SecureAggregationError("another node's keys name the same signer")
                verify_keys([k.signer], k.signer, k.signature, k.c, k.s, context)
            except Exception as err:  # untrusted keys: any failure (a malformed signer too) leaves them out
                why = (str(err).splitlines() or [type(err).__name__])[0]
                log(WARNING, "round %d: node %d's keys ahead are left out: %s", host.server_round, node, why)
                continue
            out[node] = k
        return out

    def _take_dealt(
        self, host: SecureHost, keys_header: Header, prepared: Prepared | None, targets: set[int]
    ) -> DealtAhead | None:
        """The shares dealt ahead that serve as this round's key and shares steps, or None (then
        the round exchanges its key step: nothing dealt over those keys is used again).

        They serve only where they were dealt for this very round (its key step's header: a
        restarted attempt, a resume or a wrong guess exchange fresh keys), every target node was
        asked to deal them, U1 is among the targets with no barred node and the clients the
        directory knows, at least ``secagg-min-clients`` keys and ``threshold`` dealers (U2), and
        under ``require-all-clients`` every target a dealer."""
        if prepared is None or prepared.dealt is None or prepared.header != keys_header or not targets:
            return None
        dealt, barred = prepared.dealt, self._barred_nodes(host)
        round_nodes, dealers = set(dealt.keys), set(dealt.bundles)
        due = threshold_for(len(round_nodes), self.cfg.secagg_min_clients, self.cfg.secagg_signed_keys)
        if (
            not targets <= prepared.asked
            or not round_nodes <= targets
            or round_nodes & barred
            or any(host.nodes.client_of.get(n) != c for n, c in dealt.clients.items())
            or len(round_nodes) < self.cfg.secagg_min_clients
            or dealt.threshold != due
            or len(dealers) < due
            or (self.cfg.require_all_clients and targets - dealers)
        ):
            log(INFO, "round %d: the shares dealt ahead do not serve; the key step is an exchange", host.server_round)
            return None
        for node in sorted(targets - dealers):
            host.accounting.reject(self._name(host, node), "dealt no shares for this round with its last unmask reply")
        return dealt

    def _take_prepared(
        self, host: SecureHost, keys_header: Header, prepared: Prepared | None, targets: set[int]
    ) -> dict[int, PublicKeys] | None:
        """The keys ahead that serve as this key step's answers, or None: the step is an exchange.

        They serve only where they were made for this very step (run, task, stage, round, attempt
        0: a restarted attempt always exchanges fresh keys) and every target node was asked for
        them (a node that joined, was sampled, or dropped out of the last round before its unmask
        step gets the key step itself); then a node asked that sent none (a dropout) is simply
        not in U1. Fewer than ``secagg-min-clients`` of them, or one missing under
        ``require-all-clients``: the key step is exchanged instead (nothing was dealt over them,
        so fresh keys replace them on the nodes)."""
        if prepared is None or prepared.header != keys_header or not targets:
            return None
        if not targets <= prepared.asked:
            log(INFO, "round %d: node(s) not asked for keys ahead; the key step is an exchange", host.server_round)
            return None
        barred = self._barred_nodes(host)
        offered = {n: k for n, k in prepared.keys.items() if n in targets and n not in barred}
        missing = targets - set(prepared.keys) - barred
        if len(offered) < self.cfg.secagg_min_clients or (missing and self.cfg.require_all_clients):
            return None  # a round that would fail for want of keys: its nodes are asked again
        for node in sorted(missing):
            host.accounting.reject(self._name(host, node), "sent no keys for this round with its last unmask reply")
        return offered

    def _bad_dealing(self, host: SecureHost, node: int, dealt: SharesRes | DealtShares, round_nodes: set[int]) -> bool:
        """Whether a dealer's answer to a shares step fails its checks (then rejected, logged):
        one bundle and one commitment per participant, every commitment of its size."""
        if set(dealt.shares) != round_nodes or set(dealt.commitments) != round_nodes:
            host.accounting.reject(
                self._name(host, node), "secure shares round: not one share and one commitment per participant"
            )
            return True
        lengths = {len(c) for c in dealt.commitments.values()} | {len(dealt.secrets)}
        if lengths != {COMMITMENT_BYTES}:
            host.accounting.reject(
                self._name(host, node), f"secure shares round: commitments are not {COMMITMENT_BYTES} bytes"
            )
            return True
        return False

    def _collect_shares(
        self,
        host: SecureHost,
        grid: Grid,
        plan: Any,
        header: Header,
        keys: dict[int, PublicKeys],
        clients: dict[int, int],
        threshold: int,
        timeout: float,
    ) -> dict[int, Mapping[int, bytes]]:
        shares_header = dataclasses.replace(header, phase=SHARES_PHASE)
        instruction = SharesIns(shares_header, self.cfg, keys=keys, clients=clients, threshold=threshold)
        sent = self._step(host, grid, plan, instruction, set(keys))
        answers = self._exchange(host, grid, sent, timeout, Kind.SHARES, shares_header)
        bundles = {}
        for node, reply in answers.items():
            assert isinstance(reply, SharesRes)
            if self._bad_dealing(host, node, reply, set(keys)):
                continue
            bundles[node] = reply.shares
            self._commitments[node] = reply.commitments
            self._secrets[node] = reply.secrets
        return bundles

    def _unmask(
        self,
        host: SecureHost,
        grid: Grid,
        plan: Any,
        header: Header,
        survivors: list[int],
        dropped: list[int],
        signatures: Mapping[int, bytes],
        threshold: int,
        context: bytes,
        timeout: float,
        uploaded: tuple[Header | None, Mapping[int, PublicKeys]],
    ) -> tuple[dict[int, bytes], dict[int, bytes]]:
        """``uploaded``: the next round's key step the masked upload named and the keys it carried
        (shares ahead): the shares step over them rides here where enough survivors sent usable
        ones; else (or with none named) the next round's key step does (keys ahead)."""
        unmask_header = dataclasses.replace(header, phase=UNMASK_PHASE)
        prepare, upload_keys = uploaded
        ahead = None
        if prepare is not None:  # shares ahead: U1 = the survivors whose masked uploads carried usable keys
            round_keys = {
                n: k for n, k in sorted(upload_keys.items()) if n in survivors and self._unusable(host, n, k) is None
            }
            if self.cfg.secagg_signed_keys:
                round_keys = self._self_signed(host, prepare, round_keys)
            if len(round_keys) >= self.cfg.secagg_min_clients:
                due = threshold_for(len(round_keys), self.cfg.secagg_min_clients, self.cfg.secagg_signed_keys)
                ahead = SharesAhead(round_keys, {n: host.nodes.client_of[n] for n in round_keys}, due)
        if ahead is None:
            following = host.next_secure_round(plan)  # keys ahead: the next secure round's key step rides here
            prepare = None if following is None else dataclasses.replace(following, phase=KEYS_PHASE, attempt=0)
        instruction = UnmaskIns(
            unmask_header,
            self.cfg,
            survivors=tuple(survivors),
            dropped=tuple(dropped),
            signatures=signatures,
            prepare=prepare,
            ahead=ahead,
        )
        sent = self._step(host, grid, plan, instruction, set(survivors))
        answers = self._exchange(host, grid, sent, timeout, Kind.UNMASK, unmask_header)
        seed_shares: dict[int, dict[int, bytes]] = {node: {} for node in survivors}
        key_shares: dict[int, dict[int, bytes]] = {node: {} for node in dropped}
        next_keys: dict[int, PublicKeys] = {}
        dealt: dict[int, DealtShares] = {}
        for node, reply in answers.items():
            assert isinstance(reply, UnmaskRes)
            if not set(reply.seed_shares) <= set(survivors) or not set(reply.key_shares) <= set(dropped):
                host.accounting.reject(self._name(host, node), "secure unmask round: shares that were not asked for")
                continue
            if (reply.next_keys is not None and (prepare is None or ahead is not None)) or (
                reply.next_shares is not None and (ahead is None or node not in ahead.keys)
            ):
                host.accounting.reject(self._name(host, node), "secure unmask round: keys that were not asked for")
                continue
            if reply.next_keys is not None:  # checked as a key reply is, when the next round takes them
                next_keys[node] = reply.next_keys
            if reply.next_shares is not None and ahead is not None:  # checked as a shares reply is
                if self._bad_dealing(host, node, reply.next_shares, set(ahead.keys)):
                    continue
                dealt[node] = reply.next_shares
            for target, share in reply.seed_shares.items():
                seed_shares[target][node] = share
            for target, share in reply.key_shares.items():
                key_shares[target][node] = share
        rebuilt: dict[str, dict[int, bytes]] = {SEED: {}, MASK_KEY: {}}
        for what, revealed in ((SEED, seed_shares), (MASK_KEY, key_shares)):
            for dealer, shares in revealed.items():
                try:
                    result = rebuild_secret(
                        dealer, what, shares, self._commitments[dealer], self._secrets[dealer], threshold, context
                    )
                except SecretNotRebuilt as err:
                    self._blame_opening(host, dealer, err)
                    raise StageFailed(f"the secure sum cannot be opened: {err}") from None
                for liar in result.liars:
                    self.bar(host, liar, f"revealed a share of node {dealer}'s secret that is not the one dealt")
                rebuilt[what][dealer] = result.secret
        asked = frozenset(m.metadata.dst_node_id for m in sent)
        if ahead is not None and prepare is not None:  # kept once every secret is rebuilt (checked at use)
            answered = DealtAhead(
                ahead.keys,
                ahead.clients,
                ahead.threshold,
                {n: d.shares for n, d in dealt.items()},
                {n: d.commitments for n, d in dealt.items()},
                {n: d.secrets for n, d in dealt.items()},
            )
            self.prepared = Prepared(prepare, asked, ahead.keys, answered)
        elif prepare is not None:  # kept once every secret is rebuilt (a barred node's are dropped at use)
            self.prepared = Prepared(prepare, asked, next_keys)
        return rebuilt[SEED], rebuilt[MASK_KEY]

    def _blame_opening(self, host: SecureHost, dealer: int, err: SecretNotRebuilt) -> None:
        """A secret that cannot be rebuilt: bar whoever provably caused it: a revealer of a wrong
        share; the dealer, where its checked shares do not rebuild its committed secret, or where
        bundles of it were accused (too few nodes hold its shares) -- that case restarts the round
        before the unmask step (:meth:`_unopenable`)."""
        for liar in err.liars:
            self.bar(host, liar, f"revealed a share of node {dealer}'s secret that is not the one dealt")
        if err.dealer_at_fault:
            self.bar(host, dealer, str(err))


def following_secure_round(host: StagedStrategy, plan: RoundPlan, phases: Collection[str]) -> Header | None:
    """Keys ahead: the header of the secure round that directly follows ``plan``'s, as its key step
    will carry it, where it is known during ``plan``'s unmask step; None where it is not.

    The next round of the stage, else the first of the next stage, when its phase is one of
    ``phases`` (the host's secure rounds), one server round later, or two where the stage is
    scored in an ``evaluate`` exchange of its own; None after the last stage and where a forget
    round comes between the stages. A guess that turns out wrong costs nothing but the key
    exchange the next round then makes (its header differs from the keys', which are dropped)."""
    plans = host.plan_stage(plan.task)
    position = next((i for i, p in enumerate(plans) if p == plan), None)
    if position is None:
        return None
    if position + 1 < len(plans):
        following, rounds = plans[position + 1], 1
    else:
        task, cfg = plan.task + 1, host.cfg
        if task >= host.num_tasks or task in cfg.forget_requests():
            return None
        following = host.plan_stage(task)[0]
        scored_alone = cfg.evaluation != "central" and not host.evaluation_rides(plan.task)
        rounds = 2 if scored_alone else 1
    if following.phase not in phases:
        return None
    header = host.header(following, 0)
    return dataclasses.replace(header, server_round=host.server_round + rounds)
