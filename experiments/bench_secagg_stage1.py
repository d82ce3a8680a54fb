"""Stage-1 FedAvg under secure aggregation against plain FedAvg: the cost of one round, clients and server.

    python -m experiments.bench_secagg_stage1            # digits CNN and ResNet-18, 3 and 5 clients (~3 min)
    python -m experiments.bench_secagg_stage1 --quick    # the digits CNN only (~10 s)

Models: the default run's digits CNN (``small-cnn``, the trainable state stage 1 averages) and
torchvision's ResNet-18 built with ``weights=None`` (no download; 11.7 M entries of trainable
state: parameters and BatchNorm statistics). Each client's state is the model's own plus a small
seeded perturbation (training does not change the cost), with a random sample count.

Every client of the round is played with the functions the client handlers call
(clients/secure.py ``masked_train_reply``; fcl_flower/privacy/secagg.py), in signed-keys mode:

* ``keys``: two fresh X25519 key pairs (query.keys);
* ``shares``: Shamir sharing of the self-mask seed and mask key, one encrypted bundle and its
  commitment per participant, and opening the bundles it receives;
* ``mask``: the vector (n_k · w_k, n_k) flattened in float64, fixed-point encoding, the self mask
  and the n − 1 pairwise masks, the SHA-256 digest for its ledger and the signature over its view;
* ``unmask``: the check of the unmask request (every survivor's view signature) and the ledger
  write (atomic, fsync);
* client columns are the median over the round's clients (each does the same work); the table
  gives the median over ``--repeats`` rounds (3), plain and secure run alternately.
* ``server`` secure: verify the view signatures, rebuild every survivor's seed (with a dropout,
  also the dropped client's mask key) from shares checked against the commitments, sum the masked
  uploads in the ring, strip the masks, decode, divide and load the average into the model.
  Plain: read each float32 state (the server's checks) and average them in float64 (the project's
  FedAvg).

Every secure round is verified: the opened average equals the clear float64 average of the
survivors within the quantisation bound (fcl_flower/privacy/secure_fedavg.py). Bytes are those of
the arrays and secrets that travel (no Flower framing). The machine's load (os.getloadavg) is
written down before and after: the timings are wall-clock on a shared machine.
Writes experiments/results/bench_secagg_stage1.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from clients.ledger import Ledger, input_digest, train_ledger_key
from experiments.bench_secagg import dealt_round
from experiments.benchlib import format_table, write_json
from fcl_flower.config import RunConfig
from fcl_flower.models import load_trainable_state, trainable_state
from fcl_flower.privacy.secagg import (
    KEY_BYTES,
    MASK_KEY,
    SEED,
    check_unmask_request,
    mask_arrays,
    rebuild_secret,
    round_context,
    sign_view,
    threshold_for,
    unmask_sum,
    verify_view,
    view_context,
)
from fcl_flower.privacy.secure_fedavg import COUNT, WEIGHTS, opened_average, quantisation_bound, upload_vector
from fcl_flower.protocol.payloads import read_state
from fcl_flower.tensors import tensor_record
from strategies.fedavg import average_states

T = TypeVar("T")
FRACTION_BITS = 24  # the default secagg-fraction-bits
MIN_CLIENTS = 2


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def digits_cnn() -> nn.Module:
    from fcl_flower.runtime import build_model_for_shape

    cfg = RunConfig()  # the default run: digits, small-cnn
    return build_model_for_shape(cfg, 10, (1, 8, 8))


def resnet18() -> nn.Module:
    from torchvision.models import resnet18 as torchvision_resnet18

    return torchvision_resnet18(weights=None)


MODELS: dict[str, Callable[[], nn.Module]] = {"digits-cnn": digits_cnn, "resnet18": resnet18}


def client_states(model: nn.Module, n: int, seed: int) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    base = trainable_state(model)
    states = []
    for _ in range(n):
        state = {}
        for key, value in base.items():
            if value.is_floating_point():
                state[key] = value + 0.01 * torch.randn(value.shape, generator=gen, dtype=value.dtype)
            else:
                state[key] = value + int(torch.randint(0, 50, (1,), generator=gen))
        states.append(state)
    counts = [int(c) for c in torch.randint(100, 2000, (n,), generator=gen)]
    return states, counts


def plain_round(model: nn.Module, states: list[dict[str, torch.Tensor]], counts: list[int]) -> dict[str, Any]:
    records = [tensor_record(s) for s in states]  # what travels (float32)
    expected = trainable_state(model)

    def serve() -> dict[str, torch.Tensor]:
        read = [read_state(r, expected) for r in records]
        return average_states(read, [float(c) for c in counts])

    seconds, _ = timed(serve)
    return {"server_s": seconds, "client_upload_bytes": sum(a.numpy().nbytes for a in records[0].values())}


def secure_round(
    model: nn.Module, states: list[dict[str, torch.Tensor]], counts: list[int], dropouts: list[int]
) -> dict[str, Any]:
    n = len(states)
    nodes = [2**64 - 1 - 7919 * k for k in range(n)]  # real SuperNode ids use all 64 bits
    context = round_context("bench", 0, 1, 3, 0, nodes)
    view = view_context(context, nodes)
    threshold = threshold_for(n, MIN_CLIENTS, signed=True)
    dropouts = [d for d in dropouts if n - d >= threshold]  # 3 clients in signed-keys mode: t = 3, no dropout
    keys = dealt_round(nodes, threshold, context)
    key_s, s_pair, s_public, signing, signer = keys.key_s, keys.s_pair, keys.s_public, keys.signing, keys.signer
    seeds, share_s, dealt, held = keys.seeds, keys.share_s, keys.dealt, keys.held
    mask_s: list[float] = []
    masked: list[dict[str, np.ndarray]] = []
    signatures: dict[int, bytes] = {}
    vectors = []
    for state, count, node in zip(states, counts, nodes, strict=True):
        began = time.perf_counter()
        vector = upload_vector(state, count, weighted=True)
        masked.append(
            mask_arrays(vector, node, s_pair[node][0], seeds[node], s_public, view, FRACTION_BITS, MIN_CLIENTS)
        )
        input_digest(vector[WEIGHTS].tobytes(), vector[COUNT].tobytes())
        signatures[node] = sign_view(signing[node], view)
        mask_s.append(time.perf_counter() - began)
        vectors.append(vector)
    rows = []
    like = trainable_state(model)
    with tempfile.TemporaryDirectory() as folder:
        for dropped_count in dropouts:
            survivors, dropped = nodes[dropped_count:], nodes[:dropped_count]
            responders = survivors[:threshold]
            unmask_s = []
            for node in responders:
                began = time.perf_counter()
                check_unmask_request(survivors, dropped, nodes, threshold)
                for k in survivors:
                    verify_view(signer[k], signatures[k], view)
                Ledger(Path(folder), f"bench-{dropped_count}", node).record(
                    "bench", [train_ledger_key(3)], survivors, {train_ledger_key(3): "digest"}
                )
                unmask_s.append(time.perf_counter() - began)

            def serve(
                survivors: list[int] = survivors, dropped: list[int] = dropped, responders: list[int] = responders
            ) -> dict[str, torch.Tensor]:
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
                sums: dict[str, np.ndarray] = {}
                for k in survivors:  # the fold: ring sums as the uploads arrive
                    for name, ring in masked[nodes.index(k)].items():
                        sums[name] = ring.copy() if name not in sums else sums[name] + ring
                opened = {
                    name: unmask_sum([ring], name, rebuilt_seeds, rebuilt_keys, s_public, view, FRACTION_BITS)
                    for name, ring in sums.items()
                }
                state, _ = opened_average(opened, len(survivors), True, like)
                assert state is not None
                load_trainable_state(model, state)
                return state

            seconds, state = timed(serve)
            kept = [nodes.index(k) for k in survivors]
            total = float(sum(counts[i] for i in kept))
            clear = sum(vectors[i][WEIGHTS] for i in kept) / total  # the clear float64 average
            got = np.concatenate([state[key].reshape(-1).to(torch.float64).numpy() for key in like])
            floating = np.concatenate(
                [np.full(v.numel(), v.is_floating_point()) for v in like.values()]
            )  # counters are rounded
            ulp = np.finfo(np.float32).eps * np.abs(clear)
            bound = quantisation_bound(len(survivors), total, FRACTION_BITS)
            error = float(np.max(np.abs(got - clear)[floating] - ulp[floating]))
            assert error <= bound, f"opened average off by {error:g} > {bound:g}"
            rows.append(
                {
                    "dropouts": dropped_count,
                    "server_s": seconds,
                    "client_keys_s": statistics.median(key_s),
                    "client_shares_s": statistics.median(share_s.values()),
                    "client_mask_s": statistics.median(mask_s),
                    "client_unmask_s": statistics.median(unmask_s),
                    "quantisation_bound": bound,
                    "max_error_beyond_float32": max(error, 0.0),
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
    parser.add_argument("--quick", action="store_true", help="the digits CNN only")
    parser.add_argument("--clients", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None)
    parser.add_argument("--repeats", type=int, default=3, help="rounds per setting; the table shows medians")
    parser.add_argument("--out", default=None, help="JSON path (default experiments/results/bench_secagg_stage1.json)")
    args = parser.parse_args(argv)
    models = args.models or (["digits-cnn"] if args.quick else ["digits-cnn", "resnet18"])
    load_before = os.getloadavg()
    table, records = [], []
    for name in models:
        model = MODELS[name]()
        entries = sum(int(v.numel()) for v in trainable_state(model).values())
        for n in args.clients:
            print(f"{name} ({entries} entries), {n} clients ...", flush=True)
            states, counts = client_states(model, n, seed=1000 * n + entries % 997)
            plains, secures = [], []
            for _ in range(args.repeats):  # alternately, so that a load spike hits both alike
                plains.append(plain_round(model, states, counts))
                secures.append(secure_round(model, states, counts, [0, 1]))
            del states
            for i, row in enumerate(secures[0]["rounds"]):
                sent = row["client_bytes"]

                def median(key: str, i: int = i) -> float:
                    return statistics.median(s["rounds"][i][key] for s in secures)

                table.append(
                    {
                        "model": name,
                        "entries": entries,
                        "clients": n,
                        "dropouts": row["dropouts"],
                        "plain server s": statistics.median(p["server_s"] for p in plains),
                        "secure server s": median("server_s"),
                        "client keys s": median("client_keys_s"),
                        "client shares s": median("client_shares_s"),
                        "client mask s": median("client_mask_s"),
                        "client unmask s": median("client_unmask_s"),
                        "plain MiB/client": plains[0]["client_upload_bytes"] / 2**20,
                        "secure MiB/client": sum(sent.values()) / 2**20,
                    }
                )
            records.append({"model": name, "entries": entries, "clients": n, "plain": plains, "secure": secures})
    load_after = os.getloadavg()
    print(format_table(table, list(table[0])))
    path = write_json(
        "bench_secagg_stage1",
        {
            "settings": {
                "fraction_bits": FRACTION_BITS,
                "min_clients": MIN_CLIENTS,
                "signed_keys": True,
                "weighted_fedavg": True,
                "wire_dtype_plain": "float32",
                "torch_threads": torch.get_num_threads(),
                "repeats": args.repeats,
            },
            "loadavg_before": list(load_before),
            "loadavg_after": list(load_after),
            "table": table,
            "runs": records,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
