"""Error type of the gradient-trained FCL baselines (LGA, STAMP, LwF distillation, exemplars).

Every bad input raises :class:`FCLInputError` (a ``ValueError``) with a one-line message, so
that a strategy or client can reject a malformed payload with a clear reason instead of a shape
error deep inside a matmul.
"""

from __future__ import annotations

__all__ = ["FCLInputError"]


class FCLInputError(ValueError):
    """An argument has the wrong shape, dtype, range or length."""
