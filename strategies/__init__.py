"""One Flower strategy per FCIL method; :func:`build_strategy` picks it by name."""

from __future__ import annotations

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import FederatedSplit
from fcl_flower.results import ResultsRecorder
from strategies.analytic import AnalyticStrategy, JointStrategy, STSAEStrategy
from strategies.base import RoundPlan, StagedStrategy
from strategies.baselines import EWCStrategy, JointGradientStrategy, LwFStrategy
from strategies.fedran import FedRANStrategy
from strategies.gradient import FedAvgStrategy, FinetuneStrategy
from strategies.lga import LGAStrategy
from strategies.stamp import STAMPStrategy

STRATEGIES: dict[str, type[StagedStrategy]] = {
    "stsa": AnalyticStrategy,
    "stsa-e": STSAEStrategy,
    "fedran": FedRANStrategy,
    "joint": JointStrategy,
    "finetune": FinetuneStrategy,
    "lga": LGAStrategy, "stamp": STAMPStrategy,
    "lwf": LwFStrategy, "ewc": EWCStrategy, "joint-gradient": JointGradientStrategy,
}


def build_strategy(cfg: RunConfig, split: FederatedSplit, recorder: ResultsRecorder) -> StagedStrategy:
    try:
        cls = STRATEGIES[cfg.strategy]
    except KeyError:
        raise ConfigError(
            f"strategy '{cfg.strategy}' is not available; choose one of: {', '.join(sorted(STRATEGIES))}"
        ) from None
    return cls(cfg, split, recorder)


__all__ = ["STRATEGIES", "RoundPlan", "StagedStrategy", "FedAvgStrategy", "build_strategy"]
