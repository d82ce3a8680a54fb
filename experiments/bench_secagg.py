"""Secure aggregation against plain, for one STSA statistics round: keys, shares, masking, unmasking.

    python -m experiments.bench_secagg            # 5/20/50 clients, M = 1000 and 4000 (~15 min on 2 cores)
    python -m experiments.bench_secagg --quick    # 5/20 clients, M = 1000 (~1 min)

Every client of the round is played with the functions the client handlers call
(fcl_flower/privacy/secagg.py), on STSA statistics of its own random ReLU features: the packed
G (M(M+1)/2), C (M × c_t) and the counts (c_t + 1, the last one withheld samples).

* ``keys``: one client's two fresh X25519 key pairs (the query.keys round).
* ``shares``: one client's Shamir sharing of its self-mask seed and mask key, the encryption of
  one bundle per participant and the commitments to every share, plus the decryption and the
  commitment check of the bundles it receives.
* ``mask``: one client's fixed-point encoding plus its self mask and n − 1 pairwise masks (over
  its view), its signature over the view (signed-keys mode, the node's ECDSA P-384 key) and the
  SHA-256 digest of its statistics for its ledger.
* ``unmask``: one client's check of the unmask request (the n survivors' view signatures) and its
  ledger write (an atomic file write with fsync), then the shares it reveals.
* client columns are the median over every client of the round (each does the same work).
* ``server``: check each upload's view signature, rebuild the seeds (and, with a dropout, the
  dropped client's mask key) from shares each checked against its dealer's commitment, check
  each rebuilt secret against the dealer's commitment, sum the n (or n − 1) masked uploads, strip
  the masks, decode, and check the opened sum (fcl_flower/analytic/checks.py) once. Plain: read
  each float32 upload, check it, add it in float64.

Every secure round is verified: the opened sum equals the plain float64 sum of the survivors up to
the fixed-point step. Bytes are those of the arrays and secrets that travel (no Flower framing).
Writes experiments/results/bench_secagg.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from clients.ledger import Ledger, input_digest
from experiments.benchlib import format_table, write_json
from fcl_flower.analytic import pack_upper, unpack_upper
from fcl_flower.analytic.checks import check_gram_statistics, wire_epsilon
from fcl_flower.privacy.secagg import (
    KEY_BYTES,
    MASK_KEY,
    SEED,
    check_unmask_request,
    generate_keypair,
    make_shares,
    mask_arrays,
    new_seed,
    open_shares,
    rebuild_secret,
    round_context,
    sign_view,
    threshold_for,
    unmask_sum,
    verify_view,
    view_context,
)

T = TypeVar("T")
CLASSES = 10  # c_t: a 10-class task (CIFAR-100 in 10 tasks)
SAMPLES = 50  # samples per client (the round's cost does not depend on it)
FRACTION_BITS = 24
MIN_CLIENTS = 2


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def client_statistics(dim: int, gen: torch.Generator) -> dict[str, np.ndarray]:
    """One client's STSA upload: packed G, C and counts (+ withheld) of random ReLU features."""
    phi = torch.randn(SAMPLES, dim, generator=gen, dtype=torch.float64).relu()  # ReLU features are >= 0
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=gen)
    y = torch.nn.functional.one_hot(labels, CLASSES).to(torch.float64)
    counts = torch.cat([y.sum(0), torch.zeros(1, dtype=torch.float64)])
    return {
        "gram-packed": pack_upper(phi.T @ phi).numpy(),
        "class-sums": (phi.T @ y).numpy(),
        "counts": counts.numpy(),
    }


def check(gram_packed: np.ndarray, sums: np.ndarray, counts: np.ndarray, dim: int, **tolerances: float) -> None:
    check_gram_statistics(
        unpack_upper(torch.from_numpy(gram_packed), dim),
        torch.from_numpy(sums).reshape(dim, CLASSES),
        torch.from_numpy(counts[:CLASSES]),
        nonnegative=True,
        **tolerances,
    )


def plain_round(uploads: list[dict[str, np.ndarray]], dim: int) -> dict[str, Any]:
    """The plain server: every float32 upload read, checked and added in float64."""
    wire = [{k: v.astype(np.float32) for k, v in u.items()} for u in uploads]

    def serve() -> dict[str, np.ndarray]:
        total = {k: np.zeros(v.shape) for k, v in uploads[0].items()}
        for upload in wire:
            values = {k: v.astype(np.float64) for k, v in upload.items()}
            check(
                values["gram-packed"],
                values["class-sums"],
                values["counts"],
                dim,
                relative_tolerance=wire_epsilon(torch.float32),
            )
            for k in total:
                total[k] += values[k]
        return total

    seconds, _ = timed(serve)
    upload_bytes = sum(v.nbytes for k, v in wire[0].items() if k != "counts") + wire[0]["counts"][:CLASSES].nbytes
    return {"server_s": seconds, "client_upload_bytes": upload_bytes}


@dataclass
class DealtRound:
    """One signed-keys round up to the masked upload, every client played here: key pairs, SuperNode
    signing keys, seeds, the dealt shares and what each client opened of its peers' (with the
    seconds each client spent on keys and on shares)."""

    key_s: tuple[float, ...]
    c_pair: dict[int, Any]
    s_pair: dict[int, Any]
    s_public: dict[int, Any]
    signing: dict[int, Any]
    signer: dict[int, bytes]
    seeds: dict[int, bytes]
    share_s: dict[int, float]
    dealt: dict[int, Any]
    held: dict[int, dict[int, tuple[bytes, bytes]]]


def dealt_round(nodes: list[int], threshold: int, context: bytes) -> DealtRound:
    """Keys, shares and their opening for ``nodes`` (the same calls the client handlers make)."""
    key_s, keys = zip(*(timed(lambda: (generate_keypair(), generate_keypair())) for _ in nodes), strict=True)
    c_pair = {node: pair[0] for node, pair in zip(nodes, keys, strict=True)}
    s_pair = {node: pair[1] for node, pair in zip(nodes, keys, strict=True)}
    c_public = {node: c_pair[node][1] for node in nodes}
    s_public = {node: s_pair[node][1] for node in nodes}
    signing = {node: ec.generate_private_key(ec.SECP384R1()) for node in nodes}  # the SuperNode keys
    signer = {
        node: key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        for node, key in signing.items()
    }
    seeds = {node: new_seed() for node in nodes}
    share_s: dict[int, float] = {}
    dealt = {}
    for node in nodes:
        share_s[node], dealt[node] = timed(
            partial(make_shares, node, seeds[node], s_pair[node][0], c_pair[node][0], c_public, threshold, context)
        )
    held: dict[int, dict[int, tuple[bytes, bytes]]] = {}
    for node in nodes:
        received = {src: dealt[src].bundles[node] for src in nodes}
        commitments = {src: dealt[src].commitments[node] for src in nodes}
        seconds, (held[node], accused) = timed(
            partial(open_shares, node, c_pair[node][0], c_public, received, commitments, context)
        )
        assert not accused
        share_s[node] += seconds
    return DealtRound(key_s, c_pair, s_pair, s_public, signing, signer, seeds, share_s, dealt, held)


def secure_round(
    uploads: list[dict[str, np.ndarray]], nodes: list[int], dim: int, dropouts: list[int]
) -> dict[str, Any]:
    n = len(nodes)
    context = round_context("bench", 1, 2, 3, 0, nodes)
    view = view_context(context, nodes)
    threshold = threshold_for(n, MIN_CLIENTS, signed=True)  # the round plays signed-keys mode
    keys = dealt_round(nodes, threshold, context)
    key_s, s_pair, s_public, signing, signer = keys.key_s, keys.s_pair, keys.s_public, keys.signing, keys.signer
    seeds, share_s, dealt, held = keys.seeds, keys.share_s, keys.dealt, keys.held
    mask_s: list[float] = []
    masked: list[dict[str, np.ndarray]] = []
    signatures: dict[int, bytes] = {}
    for upload, node in zip(uploads, nodes, strict=True):
        began = time.perf_counter()
        masked.append(
            mask_arrays(upload, node, s_pair[node][0], seeds[node], s_public, view, FRACTION_BITS, MIN_CLIENTS)
        )
        signatures[node] = sign_view(signing[node], view)
        input_digest(*(np.ascontiguousarray(v).tobytes() for v in upload.values()))
        mask_s.append(time.perf_counter() - began)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for dropped_count in dropouts:
            survivors = nodes[dropped_count:]
            dropped = nodes[:dropped_count]
            responders = survivors[:threshold]
            unmask_s = []
            for node in responders:  # what each responder does before it reveals
                began = time.perf_counter()
                check_unmask_request(survivors, dropped, nodes, threshold)
                for k in survivors:
                    verify_view(signer[k], signatures[k], view)
                Ledger(Path(folder), f"bench-{dropped_count}", node).record("bench", [1], nodes, {1: "digest"})
                unmask_s.append(time.perf_counter() - began)

            def serve(
                survivors: list[int] = survivors, dropped: list[int] = dropped, responders: list[int] = responders
            ) -> dict[str, np.ndarray]:
                for k in survivors:
                    verify_view(signer[k], signatures[k], view)

                def rebuilt(what: str, targets: list[int], half: int) -> dict[int, bytes]:
                    return {
                        k: rebuild_secret(
                            k,
                            what,
                            {d: held[d][k][half] for d in responders},
                            dealt[k].commitments,
                            dealt[k].secrets,
                            threshold,
                            context,
                        ).secret
                        for k in targets
                    }

                rebuilt_seeds, rebuilt_keys = rebuilt(SEED, survivors, 0), rebuilt(MASK_KEY, dropped, 1)
                opened = {
                    name: unmask_sum(
                        (masked[nodes.index(k)][name] for k in survivors),
                        name,
                        rebuilt_seeds,
                        rebuilt_keys,
                        s_public,
                        view,
                        FRACTION_BITS,
                    )
                    for name in uploads[0]
                }
                check(
                    opened["gram-packed"],
                    opened["class-sums"],
                    opened["counts"],
                    dim,
                    relative_tolerance=wire_epsilon(torch.float64),
                    absolute_tolerance=len(survivors) * 2.0 ** -(FRACTION_BITS + 1),
                )
                return opened

            seconds, opened = timed(serve)
            step = len(survivors) * 2.0 ** -(FRACTION_BITS + 1)
            for name, value in opened.items():  # the round is right, not just fast
                truth = np.sum([uploads[nodes.index(k)][name] for k in survivors], axis=0).reshape(-1)
                error = float(np.abs(value - truth).max())
                assert error <= step, f"{name}: opened sum off by {error:g} > {step:g}"
            rows.append(
                {
                    "dropouts": dropped_count,
                    "server_s": seconds,
                    "client_keys_s": statistics.median(key_s),
                    "client_shares_s": statistics.median(share_s.values()),
                    "client_mask_s": statistics.median(mask_s),
                    "client_unmask_s": statistics.median(unmask_s),
                    "client_bytes": {
                        "keys": 2 * KEY_BYTES,
                        "shares_sent": sum(len(b) for b in dealt[nodes[-1]].bundles.values())
                        + sum(len(c) for c in dealt[nodes[-1]].commitments.values())
                        + len(dealt[nodes[-1]].secrets),
                        "masked_upload": sum(v.nbytes for v in masked[-1].values()) + len(signatures[nodes[-1]]),
                        "unmask_reply": sum(len(held[nodes[-1]][k][0]) for k in survivors)
                        + sum(len(held[nodes[-1]][j][1]) for j in dropped),
                    },
                }
            )
    return {"threshold": threshold, "rounds": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 and 20 clients at M = 1000 only")
    parser.add_argument("--clients", type=int, nargs="+", default=None)
    parser.add_argument("--dims", type=int, nargs="+", default=None)
    parser.add_argument("--out", default=None, help="JSON path (default experiments/results/bench_secagg.json)")
    parser.add_argument("--skip-plain", action="store_true", help="time only the secure round")
    args = parser.parse_args(argv)
    clients = args.clients or ([5, 20] if args.quick else [5, 20, 50])
    dims = args.dims or ([1000] if args.quick else [1000, 4000])
    table, records = [], []
    for dim in dims:
        for n in clients:
            print(f"M = {dim}, {n} clients ...", flush=True)
            gen = torch.Generator().manual_seed(dim * 1000 + n)
            nodes = [2**64 - 1 - 7919 * k for k in range(n)]  # real SuperNode ids use all 64 bits
            uploads = [client_statistics(dim, gen) for _ in nodes]
            plain = (
                {"server_s": float("nan"), "client_upload_bytes": 0} if args.skip_plain else plain_round(uploads, dim)
            )
            secure = secure_round(uploads, nodes, dim, [0, 1])
            del uploads
            for row in secure["rounds"]:
                sent = row["client_bytes"]
                table.append(
                    {
                        "M": dim,
                        "clients": n,
                        "dropouts": row["dropouts"],
                        "plain server s": plain["server_s"],
                        "secure server s": row["server_s"],
                        "client keys s": row["client_keys_s"],
                        "client shares s": row["client_shares_s"],
                        "client mask s": row["client_mask_s"],
                        "client unmask s": row["client_unmask_s"],
                        "plain MiB/client": plain["client_upload_bytes"] / 2**20,
                        "secure MiB/client": sum(sent.values()) / 2**20,
                    }
                )
            records.append({"M": dim, "clients": n, "classes": CLASSES, "plain": plain, "secure": secure})
    columns = list(table[0])
    print(format_table(table, columns))
    path = write_json(
        "bench_secagg",
        {
            "settings": {
                "classes": CLASSES,
                "fraction_bits": FRACTION_BITS,
                "min_clients": MIN_CLIENTS,
                "wire_dtype_plain": "float32",
            },
            "table": table,
            "runs": records,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
