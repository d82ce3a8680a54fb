"""Client handlers, one per phase a strategy can ask for.

The strategy names the phase in each message's config; :data:`HANDLERS` routes it. Adding a
method's client side means adding one handler here.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Message

from clients.analytic import handle_stsa_e_stats, handle_stsa_stats
from clients.fedavg import handle_fedavg
from clients.fedran import handle_fedran_stats
from clients.job import ClientJob
from clients.lga import handle_lga
from clients.stamp import handle_stamp
from clients.regularised import handle_ewc, handle_ewc_stats, handle_lwf
from clients.secure import KEYS_PHASE, handle_keys

Handler = Callable[[Message, ClientJob], Message]

HANDLERS: dict[str, Handler] = {
    "fedavg": handle_fedavg,
    "lga": handle_lga, "stamp": handle_stamp,
    "lwf": handle_lwf, "ewc": handle_ewc, "ewc-stats": handle_ewc_stats,
    "stsa-stats": handle_stsa_stats,
    "stsa-e-stats": handle_stsa_e_stats,
    "fedran-stats": handle_fedran_stats,
    KEYS_PHASE: handle_keys,
}


def register(phase: str, handler: Handler) -> None:
    HANDLERS[phase] = handler
