"""Upload sizes of the analytic methods, in numbers and bytes (docs/methods/stsa.md §3; docs/methods/fedran.md §3.1).

All counts are per client per stage (uploads only; downloads are not counted, as in the
papers). ``paper_table5`` recomputes STSA's Table 5: per-stage numbers × 4 bytes (float32)
× 10 stages, in MiB (2²⁰ bytes) — the paper's "MB" are MiB (docs/methods/stsa.md §3.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import AnalyticInputError

__all__ = [
    "WIRE_DTYPE_BYTES",
    "Table5Row",
    "bytes_for",
    "fedran_upload_numbers",
    "mib",
    "paper_table5",
    "stsa_e_upload_numbers",
    "stsa_upload_numbers",
]

WIRE_DTYPE_BYTES: dict[str, int] = {"float32": 4, "float64": 8}
_MIB = 2**20


def _positive(name: str, value: int, allow_zero: bool = False) -> int:
    if not isinstance(value, int) or value < 0 or (value == 0 and not allow_zero):
        kind = "non-negative" if allow_zero else "positive"
        raise AnalyticInputError(f"{name} must be a {kind} int, got {value!r}")
    return value


def stsa_upload_numbers(rf_dim: int, classes_in_task: int, packed: bool = False, counts: bool = False) -> int:
    """STSA {G, C}: paper count (M + c_t)·M, or M(M+1)/2 + M·c_t with the packed upper triangle;
    ``counts`` adds the c_t class counts fcl-flower uploads so the server can check the upload."""
    m = _positive("rf_dim", rf_dim)
    c = _positive("classes_in_task", classes_in_task)
    gram = m * (m + 1) // 2 if packed else m * m
    return gram + m * c + (c if counts else 0)


def stsa_e_upload_numbers(rf_dim: int, classes_in_task: int, dummy_clients: int) -> int:
    """STSA-E {C_j, n_j} for j = 1..K_D: (M + 1)·c_t·K_D."""
    m = _positive("rf_dim", rf_dim)
    c = _positive("classes_in_task", classes_in_task)
    k_d = _positive("dummy_clients", dummy_clients)
    return (m + 1) * c * k_d


def fedran_upload_numbers(rf_dim: int, rank: int, num_classes: int) -> int:
    """FedRAN {V, σ, B}: M·r + r + M·C (docs/methods/fedran.md §3.1, Table 7).

    ``num_classes`` is C_t = |C_{1:t}|, the number of classes seen so far (B is M × C_t), not
    the task's c_t. ``rank`` is the effective r_{k,t} = min(r, ñ_{k,t}, M).
    """
    m = _positive("rf_dim", rf_dim)
    r = _positive("rank", rank, allow_zero=True)
    c = _positive("num_classes", num_classes, allow_zero=True)
    return m * r + r + m * c


def bytes_for(numbers: int, wire_dtype: str) -> int:
    """Bytes for ``numbers`` values sent as ``wire_dtype`` ("float32" or "float64")."""
    if wire_dtype not in WIRE_DTYPE_BYTES:
        raise AnalyticInputError(f"wire_dtype must be one of {tuple(WIRE_DTYPE_BYTES)}, got {wire_dtype!r}")
    return _positive("numbers", numbers, allow_zero=True) * WIRE_DTYPE_BYTES[wire_dtype]


def mib(num_bytes: int) -> float:
    """Bytes → MiB (2²⁰ bytes)."""
    return num_bytes / _MIB


@dataclass(frozen=True)
class Table5Row:
    """One communication row of STSA's Table 5, recomputed from the formulas."""

    setting: str
    method: str
    numbers_per_stage: int
    mib_total: float


def paper_table5(stages: int = 10, wire_dtype: str = "float32") -> list[Table5Row]:
    """STSA Table 5 communication: ResNet18 (M=5000, K_D=50) and ViT (M=1250, K_D=10), c_t=10.

    Expected (docs/methods/stsa.md §3.2): 955.58 / 95.39 / 60.08 / 4.77 MiB.
    """
    settings = (
        ("ResNet18, CIFAR-100, 10 tasks, M=5000, K_D=50", 5000, 10, 50),
        ("ViT-B/16, CIFAR-100, 10 tasks, M=1250, K_D=10", 1250, 10, 10),
    )
    rows: list[Table5Row] = []
    for setting, m, c_t, k_d in settings:
        for method, numbers in (
            ("STSA", stsa_upload_numbers(m, c_t, packed=False)),
            ("STSA-E", stsa_e_upload_numbers(m, c_t, k_d)),
        ):
            total = bytes_for(numbers, wire_dtype) * stages
            rows.append(Table5Row(setting, method, numbers, mib(total)))
    return rows
