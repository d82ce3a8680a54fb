"""experiments/compare.py and the named configs of experiments/configs/.

* every paper config and its offline variant parse into validated RunConfigs, and bad files
  fail with one line naming the key;
* a tiny comparison (2 strategies x 2 seeds on digits, in-process engine) writes the tables
  and plots, its mean ± std are the mean and sample std of the per-run results.json, the
  strategies saw identical partitions, and the progress bar saw every round.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from experiments import compare
from experiments.expconfig import ExperimentConfigError, config_paths, load_experiment
from fcl_flower.config import RunConfig

EXPECTED = {
    "stsa_table1_cifar100",
    "stsa_table1_tiny_imagenet",
    "stsa_table2_cifar100_vit",
    "stsa_table2_imagenet_r_vit",
    "stsa_table4_large_first_resnet",
    "stsa_table4_large_first_vit",
    "stsa_table5_cost_resnet",
    "stsa_table5_cost_vit",
    "stsa_ablation_rf_dim",
    "stsa_ablation_clients",
    "stsa_ablation_dummy_clients",
    "fedran_table3_cifar100",
    "fedran_table3_imagenet_r",
    "fedran_table6_vit_cifar100",
    "fedran_table6_vit_imagenet_r",
    "fedran_ablation_rank",
    "fedran_label_scarcity",
}


def test_every_config_and_its_offline_variant_validate():
    names = {p.stem for p in config_paths()}
    assert names >= EXPECTED
    for path in config_paths():
        full, offline = load_experiment(path), load_experiment(path, offline=True)
        for experiment in (full, offline):
            runs = experiment.runs()
            assert runs and all(isinstance(r.cfg, RunConfig) for r in runs)
            assert len({r.name for r in runs}) == len(runs)  # one folder per run
            for row in experiment.paper_rows():
                assert row.get("strategy") in (None, *full.strategies), (path.name, row)
        assert all(r.cfg.dataset == "digits" for r in offline.runs()), path.name
        assert len(offline.runs()) <= 12, f"{path.name}: offline variant should stay small"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('strategies = ["stsa"]\n[run]\nnum-taks = 3\n', "unknown config key 'num-taks' (did you mean 'num-tasks'?)"),
        ('strategies = ["stsa"]\nbogus = 1\n', "unknown key(s) bogus"),
        ('strategies = ["stsa"]\n[run]\nseed = 3\n', "seed may not be set in [run]"),
        ('strategies = ["stsa"]\n[sweep]\nrf-dims = [1, 2]\n', "unknown config key: rf-dims"),
        ('strategies = ["stsa"]\n[sweep]\nzip = true\nrf-dim = [1, 2]\nrank = [1]\n', "equal length"),
        ('strategies = ["nope"]\n', "unknown strategy 'nope'"),
        ('strategies = ["stsa"]\n[run]\nbeta = -1.0\n', "beta must be > 0"),
    ],
)
def test_bad_files_fail_with_one_line(tmp_path, text, fragment):
    with pytest.raises(ExperimentConfigError) as info:
        load_experiment(write(tmp_path, text))
    message = str(info.value)
    assert fragment in message and "\n" not in message and "exp.toml" in message


def test_sweeps_expand_as_product_or_zip(tmp_path):
    base = 'strategies = ["stsa", "stsa-e"]\nseeds = [0, 1]\n[sweep]\n'
    product = load_experiment(write(tmp_path, base + "rf-dim = [10, 20, 30]\nrank = [1, 2]\n"))
    assert len(product.points()) == 6 and len(product.runs()) == 6 * 2 * 2
    zipped = load_experiment(write(tmp_path, base + "zip = true\nrf-dim = [10, 20]\nrank = [1, 2]\n"))
    assert [dict(p) for p in zipped.points()] == [{"rf-dim": 10, "rank": 1}, {"rf-dim": 20, "rank": 2}]
    run = zipped.runs(strategies=["stsa"], seeds=[5])[1]
    assert (run.cfg.rf_dim, run.cfg.rank, run.cfg.seed, run.cfg.strategy) == (20, 2, 5, "stsa")


def test_offline_and_strategy_overrides_layer_in_order(tmp_path):
    path = write(
        tmp_path,
        """
strategies = ["stsa", "stsa-e"]
[run]
rf-dim = 5000
dummy-clients = 50
[strategy-overrides.stsa-e]
rf-dim = 4000
[offline]
strategies = ["stsa-e"]
[offline.run]
dataset = "digits"
rf-dim = 300
[offline.strategy-overrides.stsa-e]
dummy-clients = 3
""",
    )
    full = load_experiment(path)
    assert [r.cfg.rf_dim for r in full.runs()] == [5000, 4000]
    (offline_run,) = load_experiment(path, offline=True).runs()
    assert (offline_run.cfg.rf_dim, offline_run.cfg.dummy_clients) == (300, 3)


TINY = """
description = "tiny"
strategies = ["stsa", "stsa-e"]
seeds = [0, 1]
[run]
dataset = "digits"
num-tasks = 2
num-clients = 2
stage1-rounds = 1
local-epochs = 1
rf-dim = 100
ridge = "100.0"
dummy-clients = 2
batch-size = 256
device = "cpu"
[paper]
rows = [{ method = "STSA", strategy = "stsa", A_T = 1.0 }]
"""


def test_compare_local_writes_tables_and_plots_with_correct_mean_std(tmp_path):
    config = write(tmp_path, TINY)
    out = tmp_path / "out"
    experiment = load_experiment(config)
    runs = experiment.runs(out=out)
    outcomes = compare.execute(runs, engine="local", show_progress=False)
    assert all(not o.error for o in outcomes), [o.error for o in outcomes]
    # the progress hook saw every round: 1 FedAvg + 1 statistics round, then 1 statistics round
    assert [o.rounds_seen for o in outcomes] == [3, 3, 3, 3]
    # the CLI on the same runs: --skip-existing reuses them and writes the outputs
    assert (
        compare.main(
            ["--config", str(config), "--engine", "local", "--out", str(out), "--skip-existing", "--no-progress"]
        )
        == 0
    )
    for name in ("summary.md", "summary.csv", "runs.csv", "stages.csv", "accuracy.png", "communication.png"):
        assert (out / name).stat().st_size > 0, name
    for png in ("accuracy.png", "communication.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    results = {(r.strategy, r.seed): json.loads((r.cfg.output_dir / "results.json").read_text()) for r in runs}
    # identical partitions: the same seed gives both strategies the same samples per stage
    for seed in (0, 1):
        counts = [[s["extra"]["num_samples"] for s in results[(name, seed)]["stages"]] for name in ("stsa", "stsa-e")]
        assert counts[0] == counts[1]

    with open(out / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    expected_columns = {
        "strategy",
        "runs",
        "seeds",
        "A_avg_mean",
        "A_avg_std",
        "A_T_mean",
        "A_T_std",
        "F_T_mean",
        "F_T_std",
        "upload_mib_per_client_mean",
        "upload_mib_per_client_std",
        "seconds_per_stage_after1_mean",
        "stage1_seconds_mean",
        "total_seconds_mean",
    }
    assert expected_columns <= set(rows[0])
    assert [r["strategy"] for r in rows] == ["stsa", "stsa-e"]
    for row in rows:
        per_run = [results[(row["strategy"], seed)] for seed in (0, 1)]
        for metric in ("A_avg", "A_T", "F_T"):
            values = [r[metric] for r in per_run]
            assert math.isclose(float(row[f"{metric}_mean"]), float(np.mean(values)), rel_tol=1e-9)
            assert math.isclose(float(row[f"{metric}_std"]), float(np.std(values, ddof=1)), rel_tol=1e-9, abs_tol=1e-12)
        uploads = [np.mean(list(r["total_upload_bytes_per_client"].values())) / 2**20 for r in per_run]
        assert math.isclose(float(row["upload_mib_per_client_mean"]), float(np.mean(uploads)), rel_tol=1e-9)
        seconds = [np.mean([s["seconds"] for s in r["stages"][1:]]) for r in per_run]
        assert math.isclose(float(row["seconds_per_stage_after1_mean"]), float(np.mean(seconds)), rel_tol=1e-9)
        assert float(row["paper_A_T"] or "nan") == 1.0 or row["strategy"] != "stsa"
    summary = (out / "summary.md").read_text()
    assert "| stsa |" in summary and "| stsa-e |" in summary and " ± " in summary
