"""The method registry: every name set derives from it, and adding a method is one entry.

* a toy method (tests/toy_method.py) registered with one MethodSpec runs end to end through the
  real ServerApp logic and ClientApp, and its classifier equals the direct computation;
* the registry, pyproject's [tool.flwr.app.config] and RunConfig agree;
* every entry's strategy and handlers load, and nothing else keeps a list of method names.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import torch

from fcl_flower import methods
from fcl_flower.analytic import random_features, random_projection
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.methods import FEDAVG, RIDGE_KNOBS, Family, Kind, MethodSpec, Phase
from fcl_flower.runtime import build_model, federated_split
from strategies import strategy_class
from strategies.base import StagedStrategy

ROOT = Path(__file__).resolve().parents[1]
KEYS = {RunConfig.key(f.name) for f in RunConfig.knobs()}


@pytest.fixture
def toy():
    spec = methods.register(
        MethodSpec(
            name="toy-means",
            family=Family.ANALYTIC,
            summary="nearest class mean on random features",
            strategy="tests.toy_method:ToyStrategy",
            phases=(FEDAVG, Phase("toy-stats", Kind.STATS, "tests.toy_method:handle_toy")),
            knobs=RIDGE_KNOBS,
        )
    )
    yield spec
    methods.unregister(spec.name)


def test_a_toy_method_registered_with_one_spec_runs_end_to_end(toy, tmp_path: Path) -> None:
    from experiments.sim import run_local
    from tests.toy_method import ToyStrategy, class_means

    cfg = RunConfig(
        strategy="toy-means", num_tasks=5, num_clients=3, stage1_rounds=0, rf_dim=100, device="cpu", out=str(tmp_path)
    ).validated()
    recorder = run_local(cfg)
    results = json.loads(recorder.path.read_text())
    assert results["strategy"] == "toy-means" and len(results["stages"]) == 5
    assert all(s["rounds"] == 1 and len(s["clients"]) == 3 for s in results["stages"])
    # the classifier is the class means of all seen data, computed directly
    split = federated_split(cfg)
    model = build_model(cfg, split).eval()
    projection = random_projection(model.backbone.feature_dim, cfg.rf_dim, seed=cfg.seed)
    images, labels = split.bundle.train_eval.subset(torch.arange(len(split.bundle.train)).numpy()).tensors()
    with torch.no_grad():
        phi = random_features(model.features(images), projection)
    onehot = torch.nn.functional.one_hot(labels, split.bundle.num_classes).double()
    expected = class_means(phi.T @ onehot, onehot.sum(dim=0))
    assert strategy_class("toy-means") is ToyStrategy
    # the run's final accuracy is the nearest-mean accuracy of that classifier
    from fcl_flower.analytic import predict

    test_images, test_labels = split.seen_test(4).tensors()
    with torch.no_grad():
        test_phi = random_features(model.features(test_images), projection)
    accuracy = 100.0 * float((predict(test_phi, expected, cfg.head) == test_labels).double().mean())
    assert results["A_T"] == pytest.approx(accuracy, abs=1e-9)


def test_an_unknown_method_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig(strategy="toy-means").validated()
    assert "\n" not in str(err.value) and "stsa" in str(err.value)


def test_registry_pyproject_and_runconfig_agree() -> None:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        pyproject = tomllib.load(handle)["tool"]["flwr"]["app"]["config"]
    assert set(pyproject) == KEYS
    strategy = next(f for f in RunConfig.knobs() if f.name == "strategy")
    assert RunConfig.choices(strategy) == methods.names()
    assert pyproject["strategy"] in methods.names()
    used = set(methods.COMMON_KNOBS)
    for spec in methods.specs():
        assert set(spec.knobs) <= KEYS, f"{spec.name} names knobs RunConfig lacks: {set(spec.knobs) - KEYS}"
        used |= set(spec.knobs)
    assert used == KEYS, f"knobs no method reads: {sorted(KEYS - used)}"


@pytest.mark.parametrize("name", methods.names())
def test_every_entry_loads_its_strategy_and_handlers(name: str) -> None:
    spec = methods.get(name)
    cls = strategy_class(name)
    assert issubclass(cls, StagedStrategy)
    for phase in spec.phases:
        assert callable(methods.load(phase.handler)), phase
        assert phase.kind in (Kind.TRAIN, Kind.STATS)
    assert not (spec.secure_aggregation and spec.family is Family.GRADIENT)


def test_capabilities_drive_the_config_checks() -> None:
    for name in methods.names():
        spec = methods.get(name)
        pool = RunConfig(strategy=name, partition="task-pool")
        if spec.task_pool:
            pool.validated()
        else:
            with pytest.raises(ConfigError, match="task-pool"):
                pool.validated()
        secure = RunConfig(strategy=name, secure_aggregation=True)
        if spec.secure_aggregation:
            secure.validated()
        else:
            with pytest.raises(ConfigError, match="secure-aggregation"):
                secure.validated()


def test_unused_knobs_are_named() -> None:
    assert RunConfig(strategy="stsa", rank=64).unused_knobs() == ["rank"]
    assert RunConfig(strategy="fedran", rank=64).unused_knobs() == []
    assert RunConfig().unused_knobs() == []


def test_no_other_module_lists_the_method_names() -> None:
    """The library and both apps hold no list of method names: they ask the registry (benchmarks
    under experiments/ may choose which methods they time)."""
    pattern = re.compile(r'"stsa-e",\s*"fedran"|"finetune",\s*"lwf"')
    offenders = [
        str(p.relative_to(ROOT))
        for folder in ("fcl_flower", "strategies", "clients")
        for p in (ROOT / folder).rglob("*.py")
        if pattern.search(p.read_text())
    ]
    assert offenders == []


def test_registering_twice_or_a_phase_twice_is_refused() -> None:
    with pytest.raises(methods.RegistryError, match="already registered"):
        methods.register(methods.get("stsa"))
    with pytest.raises(methods.RegistryError, match="phase twice"):
        methods.register(
            MethodSpec(name="twice", family=Family.GRADIENT, summary="", strategy="x:y", phases=(FEDAVG, FEDAVG))
        )
    with pytest.raises(methods.RegistryError, match="no phase 'nope'"):
        methods.get("stsa").phase("nope")
    with pytest.raises(methods.RegistryError, match="cannot load"):
        methods.load("strategies.nothing:Here")
