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


def test_a_strategy_override_of_a_swept_key_pins_the_strategy(tmp_path):
    base = (
        'strategies = ["stsa", "stsa-e"]\n[sweep]\nzip = true\nnoise-q = [0.0, 0.1, 0.1]\nnoise-s = [0.0, 1.0, 1.0]\n'
        'noise-on = ["features", "features", "counts"]\n'
    )
    experiment = load_experiment(write(tmp_path, base + '[strategy-overrides.stsa]\nnoise-on = "features"\n'))
    ran = [(r.strategy, r.cfg.noise_q, r.cfg.noise_on) for r in experiment.runs()]
    assert ran == [
        ("stsa", 0.0, "features"),
        ("stsa-e", 0.0, "features"),
        ("stsa", 0.1, "features"),
        ("stsa-e", 0.1, "features"),
        ("stsa-e", 0.1, "counts"),
    ]
    with pytest.raises(ExperimentConfigError, match="never takes"):
        load_experiment(write(tmp_path, base + '[strategy-overrides.stsa]\nnoise-on = "both"\n'))


@pytest.mark.parametrize("name", ["stsa_table7_noise", "stsa_table7_noise_vit"])
def test_every_cell_of_table7_runs_next_to_its_paper_number(name):
    """The grid is the paper's: no noise and its seven (q, s), STSA on the features, STSA-E on the
    features, the counts or both (E1-E3); every cell meets exactly one paper row, so summary.md
    prints our A_T next to the paper's."""
    experiment = load_experiment(name)
    cells = {(r.strategy, r.point) for r in experiment.runs()}
    settings = {(0.1, 0.1), (0.1, 0.5), (0.1, 1.0), (0.1, 5.0), (0.1, 0.05), (0.2, 0.05), (0.5, 0.05)}
    for strategy, targets in (("stsa", {"features"}), ("stsa-e", {"features", "counts", "both"})):
        noisy = {
            (p["noise-q"], p["noise-s"], p["noise-on"]) for s, pt in cells if s == strategy for p in [dict(pt)]
        } - {(0.0, 0.0, "features")}
        assert noisy == {(q, s, on) for q, s in settings for on in targets}
    rows = [compare.paper_match(experiment, {"strategy": s, **dict(point)}) for s, point in cells]
    assert all(row is not None and "A_T" in row for row in rows)
    assert len({id(row) for row in rows}) == len(rows) == len(experiment.paper_rows())
    assert load_experiment(name, offline=True).runs()  # the digits variant loads and plans


def test_the_digits_variant_of_table7_prints_the_papers_numbers_next_to_ours(tmp_path):
    """summary.md of the offline variant has the paper's A_T of the same (strategy, q, s, noise-on)
    in each row, under a header that says it is the full setting's."""
    experiment = load_experiment("stsa_table7_noise", offline=True)
    groups = []
    for i, run in enumerate(r for r in experiment.runs() if r.seed == experiment.seeds[0]):
        group: dict = {"strategy": run.strategy, **dict(run.point), "runs": 1, "seeds": "0", "stages": []}
        for field in compare.SUMMARY_FIELDS:
            group[f"{field}_mean"], group[f"{field}_std"] = 50.0 + i, 0.0
        groups.append(group)
    compare.write_tables(tmp_path, experiment, [], groups, [], "local")
    table = [line for line in (tmp_path / "summary.md").read_text().splitlines() if line.startswith("| ")]
    assert "paper A_T (full setting)" in table[0]
    column = table[0].strip("| ").split(" | ").index("paper A_T (full setting)")
    for group, line in zip(groups, table[1:], strict=True):
        expected = compare.paper_match(experiment, group)
        assert expected is not None
        assert line.strip("| ").split(" | ")[column] == str(expected["A_T"])
    with open(tmp_path / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [float(r["paper_A_T"]) for r in rows] == [compare.paper_match(experiment, g)["A_T"] for g in groups]
