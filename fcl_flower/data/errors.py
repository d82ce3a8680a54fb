"""The one exception type of the data layer.

Every data problem a user can fix (unknown name, missing folder, impossible task split or
partition) is reported as a :class:`DatasetError` with a one-line message that says what
is wrong and what to do, so that callers never see a traceback from deep inside torchvision.
"""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset, task split or partition request that cannot be satisfied."""


def one_line(text: object, limit: int = 200) -> str:
    """Collapse an arbitrary message (e.g. a wrapped OS error) to a single short line."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
