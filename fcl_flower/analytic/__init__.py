"""Pure math of the analytic FCIL methods (no Flower, no I/O).

Re-exports the STSA / STSA-E modules. The FedRAN modules (``lowrank``, ``subspace``,
``pseudolabel``) are not re-exported here: import them directly, e.g.
``from fcl_flower.analytic.lowrank import ...``.
"""

from .communication import (
    Table5Row,
    bytes_for,
    fedran_upload_numbers,
    mib,
    paper_table5,
    stsa_e_upload_numbers,
    stsa_upload_numbers,
)
from .errors import AnalyticInputError, NotPositiveDefiniteError
from .estimator import K_MODES, estimate_gram, split_into_dummy_clients
from .heads import HEADS, logits, predict
from .packing import pack_upper, packed_length, unpack_upper
from .random_features import clip_rows, random_features, random_projection
from .ridge import GCVRow, default_ridge_grid, ridge_residual, select_ridge_gcv, solve_ridge
from .statistics import ClassStatistics, StatisticsAccumulator, accumulate_over_stages, aggregate

__all__ = [
    "HEADS",
    "K_MODES",
    "AnalyticInputError",
    "ClassStatistics",
    "GCVRow",
    "NotPositiveDefiniteError",
    "StatisticsAccumulator",
    "Table5Row",
    "accumulate_over_stages",
    "aggregate",
    "bytes_for",
    "clip_rows",
    "default_ridge_grid",
    "estimate_gram",
    "fedran_upload_numbers",
    "logits",
    "mib",
    "pack_upper",
    "packed_length",
    "paper_table5",
    "predict",
    "random_features",
    "random_projection",
    "ridge_residual",
    "select_ridge_gcv",
    "solve_ridge",
    "split_into_dummy_clients",
    "stsa_e_upload_numbers",
    "stsa_upload_numbers",
    "unpack_upper",
]
