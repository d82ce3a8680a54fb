"""Stage-1 FedAvg under secure aggregation: the vector a client masks, and what the server opens.

A client's upload of one FedAvg round is x_k = (n_k · w_k, n_k): its trainable state w_k (every
tensor of :func:`~fcl_flower.models.trainable_state`, flattened in key order, in float64) times its
sample count n_k, and n_k itself (``weighted-fedavg = false``: w_k and 1). Both are masked in fixed
point (fcl_flower/privacy/secagg.py ``mask_arrays``) and the server opens only Σ_{k ∈ U3} x_k over
the round's survivors; the average is Σ n_k w_k / Σ n_k.

Quantisation. Each entry of each client's vector is rounded to a multiple of 2^-f
(f = ``secagg-fraction-bits``, 24 by default): error ≤ 2^-(f+1) per entry and client. The counts
are integers and exact. So the opened average differs from the clear float64 FedAvg average by
at most ``quantisation_bound`` = P · 2^-(f+1) / N per entry (P survivors, N = Σ n_k; unweighted:
N = P, so 2^-(f+1)), before the cast back to the state's dtype (float32: one more rounding, as
the clear average has). With f = 24, P = 5 and N ≥ 5 that is ≤ 3·10^-8: below float32's resolution
for any weight of magnitude ≥ 0.25. The range: every entry |n_k · w_k| must stay below
2^(63-f) / P (≈ 1.1·10^11 for P = 5 at f = 24): weights |w| < 100 times 10^8 samples fit.

Integer buffers (BatchNorm's ``num_batches_tracked``) are counters that the clear FedAvg takes the
maximum of; a maximum cannot be opened from a sum, so under secure aggregation they get the
rounded weighted mean (it never exceeds the maximum; BatchNorm with a momentum never reads it).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

WEIGHTS, COUNT = "weights", "count"  # the masked arrays of a stage-1 upload


def state_length(state: Mapping[str, torch.Tensor]) -> int:
    """Entries of the flattened state."""
    return sum(int(t.numel()) for t in state.values())


def flatten_state(state: Mapping[str, torch.Tensor]) -> np.ndarray:
    """Every tensor of ``state`` in key order, as one float64 vector."""
    if not state:
        return np.zeros(0, dtype=np.float64)
    return np.concatenate([t.detach().cpu().reshape(-1).to(torch.float64).numpy() for t in state.values()])


def unflatten_state(vector: np.ndarray, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`flatten_state` with ``like``'s keys, shapes and dtypes (integers rounded)."""
    if vector.shape != (state_length(like),):
        raise ValueError(f"a vector of {vector.size} entries for a state of {state_length(like)}")
    out: dict[str, torch.Tensor] = {}
    start = 0
    for key, template in like.items():
        size = int(template.numel())
        part = torch.from_numpy(np.ascontiguousarray(vector[start : start + size])).reshape(template.shape)
        out[key] = part.to(template.dtype) if template.is_floating_point() else part.round().to(template.dtype)
        start += size
    return out


def upload_vector(state: Mapping[str, torch.Tensor], num_examples: int, weighted: bool) -> dict[str, np.ndarray]:
    """What one client masks: ``weights`` = n_k · w_k (or w_k) and ``count`` = [n_k] (or [1])."""
    weight = float(num_examples) if weighted else 1.0
    return {WEIGHTS: flatten_state(state) * weight, COUNT: np.array([weight], dtype=np.float64)}


def quantisation_bound(survivors: int, examples: float, fraction_bits: int) -> float:
    """Largest |secure average − clear float64 average| of one entry (see the module doc)."""
    return survivors * 2.0 ** -(fraction_bits + 1) / max(examples, 1.0)


class OpenedSumRejected(ValueError):
    """The opened sum is not the sum of some survivors' uploads (its count is not what it must be)."""


def opened_average(
    opened: Mapping[str, np.ndarray], survivors: int, weighted: bool, like: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor] | None, int]:
    """(the average state, N) from the opened Σ x_k; the state is None where N = 0 (no survivor
    trained on anything: the clear FedAvg's plain mean of unchanged states is the global model).

    The opened count must be an integer (each client's is, and fixed point adds integers exactly;
    a garbage upload makes it a fraction) and, unweighted, exactly the survivors."""
    count = float(np.asarray(opened[COUNT]).reshape(-1)[0])
    if not np.isfinite(count) or count != round(count) or count < 0:
        raise OpenedSumRejected(f"the opened sample count {count!r} is not a non-negative integer")
    if not weighted and count != survivors:
        raise OpenedSumRejected(f"the opened count is {count:g}, not the {survivors} survivors (weighted-fedavg=false)")
    if count == 0:
        return None, 0
    average = np.asarray(opened[WEIGHTS], dtype=np.float64) / count
    if not np.all(np.isfinite(average)):
        raise OpenedSumRejected("the opened average has non-finite entries")
    return unflatten_state(average, like), int(count)
