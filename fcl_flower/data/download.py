"""Finding a dataset folder, or downloading it, with one-line actionable errors.

Why a wrapper: torchvision's download helpers fail with long network tracebacks (or, for
missing data with ``download=False``, a generic RuntimeError). A user who is offline needs to
know one thing: which folder is expected and how to obtain it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .errors import DatasetError, one_line


def how_to_get(name: str, root: Path, url: str, archive_note: str = "") -> str:
    """The 'how to fix it' half of a missing-data message."""
    note = f" {archive_note}" if archive_note else ""
    return (
        f"run load_dataset('{name}', root='{root}', download=True) with network access, "
        f"or download {url} and extract it into {root}{note}"
    )


def missing_error(name: str, expected: Path, root: Path, url: str, archive_note: str = "") -> DatasetError:
    return DatasetError(
        f"{name}: expected folder {expected} not found and download=False; {how_to_get(name, root, url, archive_note)}"
    )


def download_failed_error(
    name: str, expected: Path, root: Path, url: str, exc: BaseException, archive_note: str = ""
) -> DatasetError:
    reason = one_line(f"{type(exc).__name__}: {exc}", limit=160)
    return DatasetError(
        f"{name}: download of {url} failed ({reason}); expected folder {expected}; "
        f"{how_to_get(name, root, url, archive_note)}"
    )


def download_archive(url: str, root: Path) -> None:
    """Download ``url`` into ``root`` and extract it there (delete the archive afterwards).

    Kept as a separate function so that tests can replace it to simulate a missing network.
    """
    from torchvision.datasets.utils import download_and_extract_archive

    download_and_extract_archive(url, download_root=str(root), extract_root=str(root), remove_finished=True)


def ensure_folder(
    name: str,
    *,
    root: Path,
    expected: Path,
    present: Callable[[], bool],
    url: str,
    download: bool,
    archive_note: str = "",
) -> None:
    """Make sure the dataset folder is present, downloading it if allowed; else DatasetError."""
    if present():
        return
    if not download:
        raise missing_error(name, expected, root, url, archive_note)
    try:
        root.mkdir(parents=True, exist_ok=True)
        download_archive(url, root)
    except Exception as exc:  # network, disk and archive errors all mean "not available"
        raise download_failed_error(name, expected, root, url, exc, archive_note) from None
    if not present():
        raise DatasetError(
            f"{name}: downloaded {url} but {expected} still does not have the expected layout; "
            f"delete it and retry, or {how_to_get(name, root, url, archive_note)}"
        )
