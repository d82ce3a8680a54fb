"""Flower's transport floor of an STSA statistics stage (issue 30): a minimal Flower app that moves
uploads of the real size and does nothing else.

The ServerApp runs one round per stage; each round it sends one ``query`` message to every node
and folds every reply as it comes; the ClientApp (this module imports only flwr and numpy, so
that a Ray worker unpickling it imports nothing else) answers at once with an ArrayRecord holding
ONE float32 array of exactly an STSA upload's length at that stage, :func:`upload_length`: the
packed Gram, M(M+1)/2 entries, then the M x c class sums and the c counts. Its values are ones,
built once per process and length and then reused (the floor times transport, not compute or
serialisation). The server reads each reply's array as the project's server does (a read-only
view of the message's bytes, ``fcl_flower.protocol.arrays.view_record``), adds the Gram part into
a float64 running sum with ``np.add(..., out=...)`` (as ``TaskSum.add``, strategies/stsa.py) and
the rest into a second one, and pulls replies as the project's server does
(``strategies.stream.ReplyStream``: push, then pull with a 2 ms wait doubling to 0.1 s while
nothing arrives) with a window of every node. A round's seconds run from building its first
message to folding its last reply, on the server's clock, like ``StageRecord.seconds``.

Its engines are the project's own: :func:`run_local` (the in-process LocalGrid, as
``experiments.sim.run_local``) and :func:`run_ray` (Flower's Ray simulation with
``experiments.sim.run_on_ray``'s settings, as ``experiments.sim.simulate``). Used by
experiments/bench_framework_overhead.py (the ``flower floor (...)`` engines).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

#: (M, c) of each round: the random-feature dimension and the number of classes of that stage
Sizes = Sequence[tuple[int, int]]

client_app = ClientApp()
_PAYLOADS: dict[int, Array] = {}  # length -> the upload (one per process, built on first use)


def upload_length(dim: int, classes: int) -> int:
    """Entries of an STSA upload: packed Gram (``packed_length(M)``), class sums and counts."""
    return dim * (dim + 1) // 2 + dim * classes + classes


@client_app.query()
def upload(message: Message, context: Context) -> Message:
    ask = message.content.config_records["ask"]
    dim, classes = ask["rf-dim"], ask["classes"]
    if not (isinstance(dim, int) and isinstance(classes, int)):
        raise TypeError("rf-dim and classes must be integers")
    length = upload_length(dim, classes)
    if length not in _PAYLOADS:
        _PAYLOADS[length] = Array(np.ones(length, dtype=np.float32))
    content = RecordDict(
        {"upload": ArrayRecord({"stats": _PAYLOADS[length]}), "answer": ConfigRecord({"round": ask["round"]})}
    )
    return Message(content, reply_to=message)


def floor_rounds(grid: Grid, sizes: Sizes, num_nodes: int, timeout: float = 600.0) -> list[float]:
    """Run one round per entry of ``sizes`` on ``grid`` (``num_nodes`` nodes); each round's seconds."""
    from fcl_flower.protocol.arrays import view_record
    from strategies.stream import ReplyStream

    nodes = _online(grid, num_nodes)
    seconds = []
    for server_round, (dim, classes) in enumerate(sizes, start=1):
        began = time.perf_counter()
        packed = dim * (dim + 1) // 2
        gram = np.zeros(packed, dtype=np.float64)  # a new running sum per stage, as TaskSum
        rest = np.zeros(dim * classes + classes, dtype=np.float64)
        ask = ConfigRecord({"round": server_round, "rf-dim": dim, "classes": classes})

        def build(
            attempt: int, targets: list[int], ask: ConfigRecord = ask, group: str = str(server_round)
        ) -> list[Message]:
            return [
                Message(RecordDict({"ask": ask}), dst_node_id=node, message_type="query", group_id=group)
                for node in targets
            ]

        folded = 0
        for reply in ReplyStream(grid, build, nodes, timeout=timeout, window=len(nodes)):
            if reply.has_error():
                raise RuntimeError(f"round {server_round}: node {reply.metadata.src_node_id}: {reply.error.reason}")
            values = view_record(reply.content.array_records["upload"])["stats"]
            if values.shape != (upload_length(dim, classes),):
                raise RuntimeError(f"round {server_round}: an upload of shape {values.shape}")
            np.add(gram, values[:packed], out=gram)
            np.add(rest, values[packed:], out=rest)
            folded += 1
        seconds.append(time.perf_counter() - began)
        if folded != len(nodes):
            raise RuntimeError(f"round {server_round}: {folded} of {len(nodes)} replies")
    return seconds


def _online(grid: Grid, count: int, timeout: float = 120.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(nodes := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(nodes)} of {count} nodes online after {timeout:.0f} s")
        time.sleep(0.1)
    return nodes


def server_app(sizes: Sizes, num_nodes: int, seconds: list[float]) -> ServerApp:
    """The ServerApp of :func:`floor_rounds`; it appends the rounds' seconds to ``seconds`` (Flower's
    simulation runs the ServerApp in a thread of this process)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        seconds.extend(floor_rounds(grid, sizes, num_nodes))

    return app


def run_local(sizes: Sizes, num_nodes: int) -> list[float]:
    """The floor app through the project's in-process LocalGrid; each round's seconds."""
    from fcl_flower.local_grid import LocalGrid

    return floor_rounds(LocalGrid(client_app, num_nodes, record=False), sizes, num_nodes)


def run_ray(sizes: Sizes, num_nodes: int, *, num_cpus: float = 1.0) -> list[float]:
    """The floor app in Flower's Ray simulation, on ``experiments.sim.simulate``'s settings; each
    round's seconds (RuntimeError if the ServerApp did not complete)."""
    from experiments.sim import run_on_ray

    seconds: list[float] = []
    run_on_ray(server_app(sizes, num_nodes, seconds), client_app, num_nodes, num_cpus=num_cpus)
    if len(seconds) != len(sizes):
        raise RuntimeError(f"the floor app ended after {len(seconds)} of {len(sizes)} rounds; see the log above")
    return seconds
