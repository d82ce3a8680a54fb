"""Privacy accounting with Google's dp-accounting library: calibrate the noise, compose the releases.

Every statistics upload (plain mode) or opened secure sum (secure mode) is one Gaussian
mechanism on the samples it covers, with the noise multiplier z of
:func:`fcl_flower.privacy.noise.effective_multiplier` (L2 sensitivity 1 after scaling each
block by its noise std, docs/privacy.md §6). This module

* calibrates z from a target (ε, δ) for ``releases`` such mechanisms composed
  (:func:`calibrate_multiplier`: ``dp-scope = stage`` is one release, ``run`` one per stage);
* composes any list of releases (:func:`epsilon_spent`) and keeps, per client, the releases of
  its data the server has seen (:class:`PrivacyLedger`), so each stage can report the ε spent.

Neighbouring datasets differ by adding or removing one sample (dp-accounting's
``ADD_OR_REMOVE_ONE``). Accountants: ``pld`` (privacy loss distributions; for Gaussian
mechanisms it is tight, equal to the analytic Gaussian mechanism of Balle & Wang 2018) or
``rdp`` (Rényi DP; an upper bound, slightly looser). dp-accounting is imported on first use,
so the rest of the package works without it (``pip install 'fcl-flower[dp]'``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
PLD_DISCRETIZATION = 1e-4  # dp-accounting's default value discretisation of the privacy loss


class AccountingError(ValueError):
    """An accounting request that cannot be answered (one line)."""


def _library() -> Any:
    try:
        import dp_accounting
    except ImportError:  # pragma: no cover - the config refuses dp-epsilon without it
        raise AccountingError("differential privacy needs dp-accounting: pip install 'fcl-flower[dp]'") from None
    return dp_accounting


def make_accountant(name: str) -> Any:
    """A fresh dp-accounting accountant (``pld`` or ``rdp``) for add-or-remove-one neighbours."""
    dpa = _library()
    if name == "pld":
        from dp_accounting.pld import pld_privacy_accountant

        return pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    if name == "rdp":
        from dp_accounting.rdp import rdp_privacy_accountant

        return rdp_privacy_accountant.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    raise AccountingError(f"unknown accountant '{name}'; choose one of: {', '.join(ACCOUNTANTS)}")


def composed_event(multipliers: Sequence[float]) -> Any:
    """The DpEvent of Gaussian mechanisms with these noise multipliers, composed."""
    dpa = _library()
    events = []
    for z in multipliers:
        if z == math.inf:
            continue  # nothing released
        if not z > 0:
            return dpa.NonPrivateDpEvent()
        events.append(dpa.GaussianDpEvent(float(z)))
    if not events:
        return dpa.NoOpDpEvent()
    return events[0] if len(events) == 1 else dpa.ComposedDpEvent(events)


def epsilon_spent(multipliers: Sequence[float], delta: float, accountant: str = "pld") -> float:
    """ε at ``delta`` of the composition of Gaussian mechanisms with these noise multipliers."""
    return _epsilon(tuple(sorted(float(z) for z in multipliers)), float(delta), accountant)


@lru_cache(maxsize=1024)
def _epsilon(multipliers: tuple[float, ...], delta: float, accountant: str) -> float:
    if not 0.0 < delta < 1.0:
        raise AccountingError(f"delta must be in (0, 1), got {delta}")
    if not multipliers or all(z == math.inf for z in multipliers):
        return 0.0
    if any(not z > 0 for z in multipliers):
        return math.inf
    tool = make_accountant(accountant)
    tool.compose(composed_event(multipliers))
    return float(tool.get_epsilon(delta))


@lru_cache(maxsize=256)
def calibrate_multiplier(epsilon: float, delta: float, releases: int = 1, accountant: str = "pld") -> float:
    """The smallest noise multiplier z (within 1e-6) such that ``releases`` Gaussian mechanisms of
    multiplier z, composed, are (``epsilon``, ``delta``)-DP under ``accountant``.

    dp-accounting's ``calibrate_dp_mechanism`` searches z; the bracket starts from the exact
    value for Gaussian mechanisms, z* = σ(ε, δ)·√releases (their composition is one Gaussian
    mechanism of multiplier z/√releases; dp-accounting's ``get_sigma_gaussian`` gives σ(ε, δ)).
    """
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise AccountingError(f"epsilon must be a finite number > 0, got {epsilon}")
    if not 0.0 < delta < 1.0:
        raise AccountingError(f"delta must be in (0, 1), got {delta}")
    if releases < 1:
        raise AccountingError(f"releases must be >= 1, got {releases}")
    dpa = _library()
    exact = float(dpa.get_sigma_gaussian(epsilon, delta)) * math.sqrt(releases)
    z = dpa.calibrate_dp_mechanism(
        lambda: make_accountant(accountant),
        lambda value: dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(value), releases),
        epsilon,
        delta,
        dpa.ExplicitBracketInterval(0.5 * exact, 4.0 * exact),
    )
    z = float(z)
    while _epsilon((z,) * releases, float(delta), accountant) > epsilon:  # never report under the target
        z *= 1.0 + 1e-6
    return z


class PrivacyLedger:
    """Every release of a client's data the server has seen: (stage, noise multiplier).

    A client's ε is the composition of all its releases, as if one person's samples could be in
    every stage's data of that client (a person with a record in several tasks; repeated
    uploads of the same data after a retry, a failed secure stage or a backfill). The worst
    client bounds every sample of the federation.
    """

    def __init__(self, delta: float, accountant: str = "pld") -> None:
        if accountant not in ACCOUNTANTS:
            raise AccountingError(f"unknown accountant '{accountant}'; choose one of: {', '.join(ACCOUNTANTS)}")
        self.delta, self.accountant = float(delta), accountant
        self.releases: dict[str, list[tuple[int, float]]] = {}

    def record(self, clients: Iterable[str], stage: int, multiplier: float) -> None:
        for client in clients:
            self.releases.setdefault(client, []).append((int(stage), float(multiplier)))

    def multipliers(self, client: str, stage: int | None = None) -> list[float]:
        return [z for s, z in self.releases.get(client, []) if stage is None or s == stage]

    def epsilon(self, client: str, stage: int | None = None) -> float:
        """ε of ``client``'s releases (of one ``stage`` only, if given), composed."""
        return epsilon_spent(self.multipliers(client, stage), self.delta, self.accountant)

    def worst(self, stage: int | None = None) -> tuple[str | None, float]:
        """(client, ε) of the client with the largest ε (over ``stage``'s releases, if given)."""
        best: tuple[str | None, float] = (None, 0.0)
        for client in sorted(self.releases):
            eps = self.epsilon(client, stage)
            if eps > best[1]:
                best = (client, eps)
        return best

    def counts(self, stage: int | None = None) -> dict[str, int]:
        """Releases per client (in ``stage``, if given)."""
        out = {c: len(self.multipliers(c, stage)) for c in sorted(self.releases)}
        return {c: n for c, n in out.items() if n}

    def state_dict(self) -> dict[str, Any]:
        return {c: [[s, z] for s, z in items] for c, items in self.releases.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.releases = {c: [(int(s), float(z)) for s, z in items] for c, items in state.items()}
