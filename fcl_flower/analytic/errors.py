"""Error types of the analytic (closed-form) math.

Every bad input raises a subclass of ``ValueError`` with a one-line message, so that the
server can reject a malformed upload with a clear reason instead of a shape error deep inside
a matmul.
"""

from __future__ import annotations


class AnalyticInputError(ValueError):
    """An argument has the wrong shape, dtype, range or length."""


class NotPositiveDefiniteError(AnalyticInputError):
    """G + γI is not positive definite, so the ridge system has no Cholesky factor."""
