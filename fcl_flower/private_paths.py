"""Paths only this user may use: the one test behind the warm worker's folder and socket
(clients/worker.py) and the features cache's folder (fcl_flower/feature_cache.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def private_path_problem(path: Path, kind: str) -> str | None:
    """Why ``path`` is not a private ``kind`` ("folder" or "socket") of this user's, as the end of
    one line ("is not a folder", "belongs to uid 7, not 0", "is open to group or others (mode
    750)", or the error of ``lstat``); None when it is one. A symbolic link is never the kind."""
    try:
        info = os.lstat(path)
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    is_kind = stat.S_ISDIR(info.st_mode) if kind == "folder" else stat.S_ISSOCK(info.st_mode)
    if not is_kind:
        return f"is not a {kind}"
    if info.st_uid != os.getuid():
        return f"belongs to uid {info.st_uid}, not {os.getuid()}"
    if info.st_mode & 0o077:
        return f"is open to group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None
