"""What the app's FAB carries (issue 32): its code, and nothing else.

Flower sends the FAB with every message a SuperNode hands to a ``flwr-clientapp`` process, which
unpacks it and checks each file's hash before it loads the app; docs, experiments and results
made that 3.2 MB of 307 files, paid by every client in every round. ``fab-include`` in
pyproject.toml keeps the FAB to the three packages the ServerApp and the ClientApp import.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk
from flwr.cli.install import install_from_fab

from experiments.bench_deployment import federation_module

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fcl_flower", "clients", "strategies")


@cache
def _fab() -> bytes:
    return build_fab_from_disk(ROOT)  # exactly what `flwr run .` sends


def test_the_fab_holds_the_app_packages_code_and_nothing_else() -> None:
    names = set(zipfile.ZipFile(io.BytesIO(_fab())).namelist())
    code = {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert code and code <= names, f"missing from the FAB: {sorted(code - names)[:5]}"
    assert names - code == {"pyproject.toml", "LICENSE", ".info/CONTENT"}


def test_the_app_loads_from_the_installed_fab_alone(tmp_path) -> None:
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home")}
    os.environ["FLWR_HOME"], saved = env["FLWR_HOME"], os.environ.get("FLWR_HOME")
    try:
        installed = install_from_fab(_fab(), skip_prompt=True)
    finally:
        if saved is None:
            del os.environ["FLWR_HOME"]
        else:
            os.environ["FLWR_HOME"] = saved
    assert not (installed / "tests").exists() and not (installed / "experiments").exists()
    # the ServerApp, the ClientApp and the warm worker import from the FAB's folder, as Flower loads them
    probe = (
        "import clients.app, clients.worker, strategies.app, fcl_flower; "
        "print(clients.app.__file__); print(strategies.app.__file__); print(fcl_flower.__file__)"
    )
    env["PYTHONPATH"] = str(installed)
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=installed, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for loaded in out.stdout.strip().splitlines()[-3:]:
        assert Path(loaded).resolve().is_relative_to(installed.resolve()), loaded


def test_the_launchers_app_snapshot_builds_the_very_same_fab(tmp_path) -> None:
    """deploy/local_federation.py hands `flwr run` a copy of the app without what .gitignore
    excludes (Flower walks every file of the folder, a virtual environment inside it included):
    the FAB built from the copy is the repository's, byte for byte."""
    snapshot = federation_module().app_snapshot(ROOT, tmp_path / "app", skip=(tmp_path,))
    assert build_fab_from_disk(snapshot) == _fab()
    assert not (snapshot / ".git").exists() and not (snapshot / ".venv").exists()
    assert (snapshot / "clients" / "app.py").read_bytes() == (ROOT / "clients" / "app.py").read_bytes()


def test_the_launcher_refuses_a_folder_that_is_no_app_in_one_line(tmp_path) -> None:
    fed = federation_module()
    federation = fed.LocalFederation(tmp_path / "federation", fed.node_configs_for(1, None))
    with pytest.raises(fed.FederationError, match=r"^cannot copy the app .* for flwr run: .*no pyproject.toml\)$"):
        federation.app_folder(tmp_path / "missing")
