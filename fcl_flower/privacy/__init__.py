"""What a client's upload may reveal, and how to reveal less: secure summation and the
minimum-count rule (no Flower, no I/O).

The names are imported on first use (PEP 562): the secure-aggregation steps without a model
(keys, shares, unmask) import :mod:`.secagg` (NumPy and cryptography) and never torch, which
:mod:`.disclosure` needs (issue 32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fcl_flower.lazy import lazy_attributes

if TYPE_CHECKING:
    from .disclosure import disclosable, per_class_counts, withheld_cells
    from .secagg import SecureAggregationError, decode_fixed_point, encode_fixed_point, mask_arrays, unmask_sum

_WHERE = {
    "SecureAggregationError": "secagg",
    "decode_fixed_point": "secagg",
    "disclosable": "disclosure",
    "encode_fixed_point": "secagg",
    "mask_arrays": "secagg",
    "per_class_counts": "disclosure",
    "unmask_sum": "secagg",
    "withheld_cells": "disclosure",
}

__all__ = [
    "SecureAggregationError",
    "decode_fixed_point",
    "disclosable",
    "encode_fixed_point",
    "mask_arrays",
    "per_class_counts",
    "unmask_sum",
    "withheld_cells",
]


__getattr__ = lazy_attributes(__name__, _WHERE, globals())
