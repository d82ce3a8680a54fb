"""What a client's upload may reveal, and how to reveal less: secure summation and the
minimum-count rule (no Flower, no I/O)."""

from .disclosure import disclosable, per_class_counts, withheld_cells
from .secagg import SecureAggregationError, decode_fixed_point, encode_fixed_point, mask_arrays, unmask_sum

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
