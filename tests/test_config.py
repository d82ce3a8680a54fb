"""One knob, one name, one default: RunConfig vs pyproject.toml vs the sim.py flags, and bad
values ending in one-line errors (in Python and on the command line)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fcl_flower.config import ConfigError, RunConfig

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "experiments" / "sim.py"
KNOBS = {RunConfig.key(f.name): f for f in RunConfig.knobs()}


@pytest.fixture(scope="module")
def sim():
    from experiments import sim

    return sim


# --------------------------------------------------------------------------- one name, one default
def test_pyproject_run_config_matches_runconfig_both_ways() -> None:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        toml = tomllib.load(handle)["tool"]["flwr"]["app"]["config"]
    assert sorted(toml) == sorted(KNOBS), "pyproject.toml [tool.flwr.app.config] and RunConfig differ"
    for key, knob in KNOBS.items():
        value = toml[key]
        assert type(value) is type(knob.default), f"{key}: {value!r} vs {knob.default!r}"
        assert value == knob.default, f"{key}: pyproject says {value!r}, RunConfig says {knob.default!r}"
    assert RunConfig.from_mapping(toml) == RunConfig()


def test_every_knob_is_a_sim_flag_with_the_same_default_help_and_choices(sim) -> None:
    parser = sim.build_parser()
    actions = {a.dest: a for a in parser._actions}
    for key, knob in KNOBS.items():
        action = actions[knob.name]
        assert f"--{key}" in action.option_strings
        assert action.default == knob.default and type(action.default) is type(knob.default)
        assert action.help == knob.metadata["help"]
        if isinstance(knob.default, bool):
            assert isinstance(action, argparse.BooleanOptionalAction)
            assert f"--no-{key}" in action.option_strings
        else:
            assert action.type is type(knob.default)
            assert tuple(action.choices or ()) == tuple(RunConfig.choices(knob) or ())
    # no stray flags: only the knobs plus the simulation's own resources/logging
    extra = {a.dest for a in parser._actions} - {f.name for f in RunConfig.knobs()}
    assert extra == {"help", "num_cpus", "num_gpus", "ray_verbose", "ray_address"}


def test_parsed_defaults_give_the_default_config_and_flags_override(sim) -> None:
    parser = sim.build_parser()
    assert sim.config_from_args(parser.parse_args([])) == RunConfig()
    args = parser.parse_args(
        [
            "--num-tasks",
            "2",
            "--beta",
            "0.1",
            "--no-download",
            "--ridge",
            "1e4",
            "--strategy",
            "stsa-e",
            "--wire-dtype",
            "float64",
        ]
    )
    cfg = sim.config_from_args(args)
    assert cfg == RunConfig(num_tasks=2, beta=0.1, download=False, ridge="1e4", strategy="stsa-e", wire_dtype="float64")
    assert cfg.ridge_value() == 1e4


# --------------------------------------------------------------------------- from_mapping
def test_from_mapping_coerces_types() -> None:
    cfg = RunConfig.from_mapping(
        {
            "num-tasks": "2",
            "beta": "0.25",
            "download": "false",
            "pretrained": "yes",
            "rf-dim": 300.0,
            "lr": 1,
            "ridge": 10000.0,
            "seed": True,
            "weighted-fedavg": 0,
        }
    )
    assert (cfg.num_tasks, cfg.beta, cfg.download, cfg.pretrained, cfg.rf_dim) == (2, 0.25, False, True, 300)
    assert type(cfg.num_tasks) is int and type(cfg.rf_dim) is int
    assert type(cfg.beta) is float and type(cfg.lr) is float and cfg.lr == 1.0
    assert cfg.ridge == "10000.0" and cfg.ridge_value() == 1e4
    assert cfg.seed == 1 and cfg.weighted_fedavg is False
    # every knob survives the ConfigRecord round trip
    full = RunConfig(strategy="fedran", num_clients=7, beta=0.05, ridge="auto", k_mode="per-class")
    assert RunConfig.from_mapping(full.to_mapping()) == full


def test_from_mapping_rejects_unknown_keys() -> None:
    with pytest.raises(ConfigError, match="unknown config key 'num_tasks' \\(did you mean 'num-tasks'\\?\\)") as err:
        RunConfig.from_mapping({"num_tasks": 3})  # Python name instead of the run-config key
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"unknown config keys 'bogus', 'zzz'$"):  # no close match: no guess
        RunConfig.from_mapping({"zzz": 1, "bogus": 2, "seed": 3})
    assert RunConfig.from_mapping({"bogus": 1, "seed": 3}, strict=False) == RunConfig(seed=3)


BAD_VALUES = [
    ({"strategy": "nope"}, "strategy"),
    ({"dataset": "nope"}, "dataset"),
    ({"backbone": "resnet999"}, "backbone"),
    ({"wire-dtype": "float16"}, "wire-dtype"),
    ({"beta": 0}, "beta"),
    ({"beta": -0.5}, "beta"),
    ({"beta": "much"}, "beta"),
    ({"ridge": "abc"}, "ridge"),
    ({"ridge": "-1"}, "ridge"),
    ({"ridge": "0"}, "ridge"),
    ({"num-tasks": 0}, "num-tasks"),
    ({"num-clients": 0}, "num-clients"),
    ({"num-clients": 2.5}, "num-clients"),
    ({"stage1-rounds": -1}, "stage1-rounds"),
    ({"rf-dim": -5}, "rf-dim"),
    ({"lr": 0}, "lr"),
    ({"label-ratio": 1.5}, "label-ratio"),
    ({"pseudo-threshold": 2.0}, "pseudo-threshold"),
    ({"round-timeout": 0}, "round-timeout"),
    ({"download": "maybe"}, "download"),
]


@pytest.mark.parametrize("values, key", BAD_VALUES, ids=[f"{k}={next(iter(v.values()))}" for v, k in BAD_VALUES])
def test_bad_values_raise_one_line_config_errors(values: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig.from_mapping(values)
    message = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "\n" not in message and key in message and len(message) < 300


def test_replace_and_validated_check_like_from_mapping() -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig(strategy="nope").validated()
    assert "stsa-e" in str(err.value) and "finetune" in str(err.value)  # the choices are listed
    with pytest.raises(ConfigError, match="beta"):
        RunConfig().replace(beta=0.0)
    with pytest.raises(ConfigError, match="ridge"):
        RunConfig().replace(ridge="abc")


# --------------------------------------------------------------------------- the command line
CLI_FAILURES = [
    (["--beta", "0"], "beta"),
    (["--dataset", "nope"], "nope"),
    (["--num-tasks", "11"], "num_tasks=11"),
    (["--num-clients", "5000"], "num_clients=5000"),
    (["--dataset", "cifar100", "--no-download", "--data-root", "{empty}"], "download"),
    (["--ridge", "abc"], "ridge"),
    (["--num-tasks", "two"], "--num-tasks"),
]


def test_cli_bad_input_exits_2_with_one_error_line(tmp_path: Path) -> None:
    """Every failure happens before Ray starts; they run side by side to keep the test short."""
    empty = tmp_path / "empty"
    empty.mkdir()
    procs = []
    for i, (argv, needle) in enumerate(CLI_FAILURES):
        argv = [a.replace("{empty}", str(empty)) for a in argv]
        cmd = [sys.executable, str(SIM), *argv, "--out", str(tmp_path / f"out{i}")]
        procs.append(
            (
                argv,
                needle,
                subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            )
        )
    for i, (argv, needle, proc) in enumerate(procs):
        out, err = proc.communicate(timeout=240)
        lines = err.strip().splitlines()
        assert proc.returncode == 2, (argv, err)
        assert len(lines) == 1, (argv, err)
        assert lines[0].startswith("error: ") and needle in lines[0], (argv, err)
        assert "Traceback" not in err + out
        assert not (tmp_path / f"out{i}").exists()  # nothing was run, no folder left behind
    assert list(empty.iterdir()) == []  # --no-download downloaded nothing


def test_cli_help_lists_every_flag() -> None:
    proc = subprocess.run([sys.executable, str(SIM), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for key, knob in KNOBS.items():
        assert f"--{key}" in proc.stdout
        if isinstance(knob.default, bool):
            assert f"--no-{key}" in proc.stdout
    for flag in ("--num-cpus", "--num-gpus", "--ray-verbose"):
        assert flag in proc.stdout
