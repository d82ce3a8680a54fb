"""Which features cache a client handler uses: the process's, and the node's folder if it names one.

Node config (``flower-supernode --node-config "..."``):

* ``feature-cache = "<absolute folder>"`` -- keep the backbone's features of this node's data on disk as
  well, so that a later run (a new worker, a new process) with the same data and the same
  backbone reads them back (fcl_flower/feature_cache.py: keyed by content hash, checked on
  every read). The folder is made 0700 if absent; one of another user's, or open to group or
  others, is refused in one line and the node goes on without it.
* ``feature-cache-mib = <n>`` -- the in-memory cache of this process (a warm worker's lives
  between messages), least recently used out beyond n MiB (default 256; 0: none).

Every statistics, factor, FedRAN and federated-evaluation pass of an analytic method looks its
features up here; the log says for each task whether they were reused or computed.
"""

from __future__ import annotations

from logging import WARNING
from pathlib import Path

from flwr.common.logger import log

from clients.job import ClientJob
from clients.node_data import NodeConfigError
from fcl_flower.feature_cache import DEFAULT_MEMORY_MIB, PROCESS_CACHE, CacheUse, FeatureCacheError, check_folder

FOLDER_KEY = "feature-cache"
MEMORY_KEY = "feature-cache-mib"

_refused: set[str] = set()  # folders already refused in this process (one line each)


def cache_for(job: ClientJob, what: str) -> CacheUse | None:
    """The cache of this node's features of ``what`` (e.g. "task 2"); None: no cache at all."""
    config = job.context.node_config
    mib = config.get(MEMORY_KEY, DEFAULT_MEMORY_MIB)
    if isinstance(mib, bool) or not isinstance(mib, int) or mib < 0:
        raise NodeConfigError(f"node config {MEMORY_KEY} must be a whole number of MiB >= 0, not {mib!r}")
    PROCESS_CACHE.max_bytes = mib << 20
    folder = _folder(config.get(FOLDER_KEY))
    if mib == 0 and folder is None:
        return None
    return CacheUse(PROCESS_CACHE, folder, f"{what} (client {job.partition})")


def _folder(value: object) -> Path | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise NodeConfigError(f"node config {FOLDER_KEY} must name a folder, not {value!r}")
    path = Path(value).expanduser()
    try:
        if not path.is_absolute():  # the worker and the ClientApp run in different folders
            raise FeatureCacheError(f"node config {FOLDER_KEY} {value!r} is not an absolute path: refused")
        return check_folder(path)
    except FeatureCacheError as err:
        if value not in _refused:
            _refused.add(value)
            log(WARNING, "%s; this node goes on without a feature cache on disk", err)
        return None
