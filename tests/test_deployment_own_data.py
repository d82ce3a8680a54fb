"""A real federation of sites that bring their own images (``dataset = custom``).

Three sites, cut from scikit-learn's digits and written out as PNG folders
(experiments/digits_sites.py): uneven class counts, one site without any class of the second
task, three folder layouts (plain class folders with a drawn held-out split, train/ + test/,
per-task folders).

* The fast test runs ``stsa`` over the folders in this process (fcl_flower.local_grid, the real
  ClientApp and ServerApp logic) with a fourth, fifth and sixth site that each have one defect --
  a corrupt image, an unknown class name, an empty task folder -- and checks that each of those
  clients is left out of every stage with one generic line (the line naming its file stays in the
  site's log), while the run completes on the good sites.
* The end-to-end test (marked ``slow``, like tests/test_deployment.py) starts a real SuperLink
  and three real SuperNodes (deploy/local_federation.py: TLS, SuperNode auth), each with only
  ``data-dir=<its folder> partition-id=k``, runs ``stsa`` with ``evaluation = federated`` and
  the server's dataset root at an empty folder, and checks that the server opened no data (the
  folder stays empty) and that the ridge classifier W and every accuracy equal those of the
  in-process run of the same folders.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch

from clients.app import SITE_DATA_REASON
from experiments.digits_sites import RUN_CONFIG, write_sites
from experiments.sim import run_local
from fcl_flower.config import RunConfig
from fcl_flower.state_io import load_state
from tests.deploy_support import cannot_deploy, load_federation_module

# Cheap: one FedAvg round of one epoch, then the analytic stages. Plain statistics rounds: secure
# aggregation through real SuperNodes is tests/test_deployment.py's subject, and its three extra
# rounds per stage (keys, shares, unmask) would more than double this test's time (each round of a
# real SuperNode pays a ClientApp process start and Flower's 3 s polls).
RUN = {
    **RUN_CONFIG,
    "strategy": "stsa",
    "seed": 0,
    "stage1-rounds": 1,
    "local-epochs": 1,
    "rf-dim": 200,
    "ridge": "100.0",
    "wire-dtype": "float64",
    "batch-size": 256,
    "device": "cpu",
    "round-timeout": 300.0,
    "secure-aggregation": False,
}


def run_config(out: Path, **changes) -> RunConfig:
    return RunConfig.from_mapping({**RUN, "out": str(out), **changes})


def site_configs(folders: list[Path]) -> list[dict]:
    return [{"data-dir": str(folder), "partition-id": k} for k, folder in enumerate(folders)]


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> list[Path]:
    return write_sites(tmp_path_factory.mktemp("sites"))


def _final_weights(cfg: RunConfig) -> torch.Tensor:
    checkpoint = load_state(cfg.output_dir / "checkpoint.json")
    assert checkpoint["completed_tasks"] == cfg.num_tasks
    return checkpoint["state"]["weights"]


def _stages(cfg: RunConfig) -> list[dict]:
    results = json.loads((cfg.output_dir / "results.json").read_text())
    assert results["status"] == "completed"
    return results["stages"]


# ------------------------------------------------------------------------------ bad sites
def _corrupt_image(site: Path) -> str:
    target = sorted((site / "test" / "seven").glob("*.png"))[0]  # in the last task's held-out folder
    target.write_bytes(b"this is not a PNG")
    return str(target)


def _unknown_class(site: Path) -> str:
    (site / "task-2" / "nine").rename(site / "task-2" / "nein")
    return str(site / "task-2" / "nein")


def _empty_task_folder(site: Path) -> str:
    shutil.rmtree(site / "task-1" / "four")  # the site's only class of task 1
    return str(site / "task-1")


def test_a_site_with_a_bad_folder_is_left_out_with_one_line_naming_the_file(sites, tmp_path, caplog) -> None:
    """Clients 3, 4, 5 are copies of sites 1, 2 and 2 with one defect each; each is left out of
    every stage (training and evaluation) with one generic line (no path of the site reaches the
    server), the site's own log has the line naming the file, and the run completes on clients
    0..2 with exactly the classifier of those three alone."""
    bad = [tmp_path / "corrupt", tmp_path / "unknown", tmp_path / "empty-task"]
    shutil.copytree(sites[1], bad[0])
    shutil.copytree(sites[2], bad[1])
    shutil.copytree(sites[2], bad[2])
    named = [_corrupt_image(bad[0]), _unknown_class(bad[1]), _empty_task_folder(bad[2])]
    reasons = ["cannot read image", "is not in the run's class list", "empty task folder"]

    cfg = run_config(tmp_path / "with-bad", **{"num-clients": 6, "stage1-rounds": 0, "secure-aggregation": False})
    with caplog.at_level(logging.ERROR):
        run_local(cfg, site_configs([*sites, *bad]))
    site_log = [r.getMessage() for r in caplog.records if "the site's own data" in r.getMessage()]
    good = run_config(tmp_path / "good-only", **{"stage1-rounds": 0, "secure-aggregation": False})
    run_local(good, site_configs(sites))

    for stage in _stages(cfg):
        assert stage["clients"] == ["client-0", "client-1", "client-2"]
        assert set(stage["left_out"]) == {"client-3", "client-4", "client-5"}
        evaluation = stage["extra"]["evaluation"]
        assert evaluation["clients"] == ["client-0", "client-1", "client-2"]
        for k, (where, why) in enumerate(zip(named, reasons, strict=True)):
            for reason in (stage["left_out"][f"client-{k + 3}"], evaluation["left_out"][f"client-{k + 3}"]):
                assert "\n" not in reason and SITE_DATA_REASON in reason and str(tmp_path) not in reason, reason
            assert any(where in line and why in line and "\n" not in line for line in site_log), (where, site_log)
    assert torch.equal(_final_weights(cfg), _final_weights(good))
    assert [s["accuracy"] for s in _stages(cfg)] == [s["accuracy"] for s in _stages(good)]


# ------------------------------------------------------------------------------ processes


@pytest.mark.slow
def test_sites_own_folders_through_real_supernodes_equal_the_simulation(sites, tmp_path) -> None:
    reason = cannot_deploy()
    if reason:
        pytest.skip(reason)
    module = load_federation_module()
    empty = tmp_path / "server-data-root"
    empty.mkdir()
    cfg = run_config(tmp_path / "deployed", **{"data-root": str(empty)})
    if cfg.secure_aggregation:  # the deployed nodes sign with their SuperNode keys; the simulation has none
        cfg = cfg.replace(secagg_signed_keys=True)
    local = cfg.replace(out=str(tmp_path / "simulated"), secagg_signed_keys=False)
    fed = module.LocalFederation(tmp_path / "federation", module.node_configs_for(3, None, sites))
    try:
        fed.start()
        began = time.monotonic()
        run_id = fed.submit(cfg.to_mapping())
        run_local(local, site_configs(sites))  # overlaps the deployed run
        status = fed.wait_run(run_id, timeout=1200)  # generous: CI machines may be busy
        assert status == "finished:completed", f"{status}\n{fed.run_log(run_id)[-3000:]}"
        seconds = time.monotonic() - began
    finally:
        fed.stop()
    assert not fed.surviving(), f"processes left running: {fed.surviving()}"

    assert not any(empty.iterdir())  # the server opened (and downloaded) no dataset
    deployed, simulated = _stages(cfg), _stages(local)
    assert [s["stage"] for s in deployed] == [1, 2, 3]
    for stage in deployed:
        assert stage["clients"] == ["client-0", "client-1", "client-2"] and not stage["left_out"]
        assert stage["extra"]["evaluation"]["mode"] == "federated"
        assert stage["extra"]["evaluation"]["clients"] == ["client-0", "client-1", "client-2"]
    for d, s in zip(deployed, simulated, strict=True):
        assert d["accuracy"] == s["accuracy"] and d["per_task_accuracy"] == s["per_task_accuracy"]
        assert d["extra"]["evaluation"]["samples"] == s["extra"]["evaluation"]["samples"]
    w_deployed, w_simulated = _final_weights(cfg), _final_weights(local)
    assert w_deployed.dtype == w_simulated.dtype == torch.float64
    assert w_deployed.shape == w_simulated.shape == (cfg.rf_dim, 10)
    error = float((w_deployed - w_simulated).norm() / w_simulated.norm())
    assert error < 1e-6, error
    print(f"deployed run of three sites' folders: {seconds:.1f} s, relative difference of W: {error:.1e}")
