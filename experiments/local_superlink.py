"""Stop the background SuperLink that ``flwr run .`` started for this ``FLWR_HOME``, and nothing else.

    fcl-stop-superlink            # stops it (by PID), or says there is none
    fcl-stop-superlink --dry-run  # only says which process it would stop

``flwr run`` (Flower 1.41) starts a detached ``flower-superlink --simulation`` that logs to
``$FLWR_HOME/local-superlink/superlink.log`` and reuses it for later runs; Flower has no command
to stop it. This finds the process of the current user whose command line is ``flower-superlink``
with that very log file, so another user's SuperLink, a SuperLink of another ``FLWR_HOME`` and a
production SuperLink on the same machine are never touched.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import psutil


def local_superlink_log() -> Path:
    from flwr.supercore.utils import get_flwr_home

    return get_flwr_home() / "local-superlink" / "superlink.log"


def find_local_superlinks(log_file: Path) -> list[psutil.Process]:
    """This user's ``flower-superlink`` processes that log to ``log_file``."""
    uid = os.getuid()
    found = []
    for process in psutil.process_iter(["cmdline", "uids"]):
        cmdline = process.info.get("cmdline") or []
        uids = process.info.get("uids")
        if uids is None or uids.real != uid:
            continue
        is_superlink = any(Path(part).name == "flower-superlink" for part in cmdline[:2])
        if is_superlink and "--log-file" in cmdline:
            index = cmdline.index("--log-file")
            if index + 1 < len(cmdline) and Path(cmdline[index + 1]) == log_file:
                found.append(process)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="Only print the process that would be stopped.")
    args = parser.parse_args(argv)
    log_file = local_superlink_log()
    processes = find_local_superlinks(log_file)
    if not processes:
        print(f"no local SuperLink of this FLWR_HOME is running (none logs to {log_file})")
        return 0
    for process in processes:
        if args.dry_run:
            print(f"would stop PID {process.pid}: {' '.join(process.cmdline())}")
            continue
        process.terminate()
        try:
            process.wait(timeout=15)
        except psutil.TimeoutExpired:
            process.kill()
        print(f"stopped the local SuperLink (PID {process.pid})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
