"""The server side: the ServerApp (:mod:`strategies.app`) and one Flower strategy per FCIL method.

A method's strategy is named in its registry entry (fcl_flower/methods.py) and imported only
when a run uses it; :func:`build_strategy` does that.
"""

from __future__ import annotations

from fcl_flower import methods
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import FederationLayout
from fcl_flower.results import ResultsRecorder
from strategies.base import StagedStrategy


def strategy_class(name: str) -> type[StagedStrategy]:
    """The strategy class of method ``name`` (ConfigError for an unknown name)."""
    try:
        spec = methods.get(name)
    except methods.RegistryError as err:
        raise ConfigError(str(err)) from None
    cls = methods.load(spec.strategy)
    if not (isinstance(cls, type) and issubclass(cls, StagedStrategy)):
        raise ConfigError(f"registry entry '{name}' names {spec.strategy}, which is not a StagedStrategy")
    return cls


def build_strategy(cfg: RunConfig, split: FederationLayout, recorder: ResultsRecorder) -> StagedStrategy:
    return strategy_class(cfg.strategy)(cfg, split, recorder)


__all__ = ["StagedStrategy", "build_strategy", "strategy_class"]
