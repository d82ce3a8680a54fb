"""The method registry: one :class:`MethodSpec` per FCIL method, and nothing else names methods.

A spec says everything the rest of the code needs to know about a method:

* its **name** (the ``strategy`` run-config value, the CLI choice, the results folder prefix);
* its **family** (``analytic``: a frozen backbone and closed-form statistics after stage 1;
  ``gradient``: every task trained by local SGD);
* its **strategy** (the server side) and one **client handler per phase**, as ``"module:attribute"``
  references. They are imported only when used: the core imports nothing above it, and a
  ClientApp process that serves a statistics message never imports the training code;
* its **capabilities** (secure aggregation, STAMP's task pool, backfill of missed statistics,
  noise on its statistics uploads);
* its **knobs**: the run-config keys it reads on top of :data:`COMMON_KNOBS`.

Adding a method (ARCHITECTURE.md has the checklist) is one :func:`register` call below, one
strategy module in ``strategies/``, one client handler module in ``clients/`` and its math.
``tests/test_registry.py`` registers a toy method this way and runs it end to end.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class RegistryError(ValueError):
    """A method name or registry entry that does not exist or does not fit; one line for the user."""


class Family(StrEnum):
    ANALYTIC = "analytic"
    GRADIENT = "gradient"


class Kind(StrEnum):
    """The Flower message type a round uses (``@app.train()`` / ``@app.query(...)`` on the client)."""

    TRAIN = "train"
    STATS = "query.stats"
    KEYS = "query.keys"
    SHARES = "query.shares"
    UNMASK = "query.unmask"
    INFO = "query.info"
    EVALUATE = "evaluate"


@dataclass(frozen=True)
class Phase:
    """One kind of round a method's strategy can ask for, and the client handler that answers it."""

    name: str
    kind: Kind
    handler: str  # "module:function" taking a clients.job.ClientJob and returning a protocol reply


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: Family
    summary: str
    strategy: str  # "module:Class", a strategies.base.StagedStrategy subclass
    phases: tuple[Phase, ...]
    knobs: tuple[str, ...] = ()  # run-config keys this method reads besides COMMON_KNOBS
    secure_aggregation: bool = False  # the server needs only sums over clients (masked uploads)
    task_pool: bool = False  # runs in STAMP's limitless task pool (partition = task-pool)
    backfill: bool = False  # a client that missed a statistics round sends them later
    upload_noise: tuple[str, ...] = ()  # blocks of its upload that noise can cover (fcl_flower/privacy/noise.py)
    pooled_data: bool = False  # the server trains on every client's data (joint bounds): no federated-only run
    factor_upload: bool = False  # a client may upload its rotated [features, labels] instead of the Gram (stats-form)
    anchor_dim: int = 0  # > 0: the model has an anchor head of this size (LANDER's label-text space)
    # its forget round (run config forget, docs/unlearning.md): "samples" (whole sites, a site's samples or
    # classes), "sites" (whole sites only), "" (none)
    forget: str = ""

    def phase(self, name: str) -> Phase:
        for phase in self.phases:
            if phase.name == name:
                return phase
        raise RegistryError(
            f"method '{self.name}' has no phase '{name}'; its phases: {', '.join(p.name for p in self.phases)}"
        )


#: Run-config keys every method reads (data, protocol, backbone, infrastructure).
COMMON_KNOBS: tuple[str, ...] = (
    "strategy",
    "dataset",
    "class-names",
    "task-plan",
    "task-plan-content",
    "data-root",
    "download",
    "num-tasks",
    "first-task-classes",
    "num-clients",
    "beta",
    "partition",
    "class-fraction",
    "classes-per-task",
    "initial-clients",
    "joining-per-task",
    "clients-per-round",
    "old-only-fraction",
    "seed",
    "backbone",
    "pretrained",
    "image-size",
    "batch-size",
    "train-head",
    "wire-dtype",
    "evaluation",
    "out",
    "run-name",
    "overwrite",
    "round-timeout",
    "require-all-clients",
    "round-retries",
    "resume",
    "device",
    "tracking",
    "tracking-uri",
)
#: Knobs of local SGD (stage 1 of the analytic methods, every task of the gradient ones).
SGD_KNOBS = ("stage1-rounds", "local-epochs", "lr", "momentum", "weight-decay", "weighted-fedavg", "stage1-exclude")
#: How the FedAvg rounds merge the models (strategies/fedavg.py): every method with FedAvg rounds.
AGGREGATION_KNOBS = ("stage1-aggregation", "stage1-trim-fraction", "stage1-byzantine", "stage1-multikrum-select")
GRADIENT_KNOBS = (*SGD_KNOBS, "rounds-per-task", *AGGREGATION_KNOBS)
#: Gradient methods without FedAvg rounds: pooled training (joint-gradient), STAMP's gradient matching.
UNAVERAGED_KNOBS = tuple(k for k in GRADIENT_KNOBS if k not in AGGREGATION_KNOBS)
RIDGE_KNOBS = (*SGD_KNOBS, *AGGREGATION_KNOBS, "rf-dim", "ridge", "head", "min-class-count", "feature-clip")
DENSE_RIDGE_KNOBS = (*RIDGE_KNOBS, "ridge-selection")  # the M × M solves (FedRAN's is in its subspace)
SECURE_KNOBS = (
    "secure-aggregation",
    "secagg-fraction-bits",
    "secagg-min-clients",
    "secagg-signed-keys",
    "secagg-failed-sum",
)
#: Knobs of the server's data-free generator (TARGET, LANDER).
GENERATOR_KNOBS = (
    "generator-rounds",
    "generator-steps",
    "generator-warmup",
    "synthesis-batch",
    "generator-bn",
    "student-steps",
)
NOISE_KNOBS = (
    "noise-q",
    "noise-s",
    "noise-on",
    "dp-epsilon",
    "dp-delta",
    "dp-scope",
    "dp-accountant",
    "noise-seeded",
)

FEDAVG = Phase("fedavg", Kind.TRAIN, "clients.fedavg:handle_fedavg")

_REGISTRY: dict[str, MethodSpec] = {}


def register(spec: MethodSpec, *, replace: bool = False) -> MethodSpec:
    """Add a method. Its knobs must be run-config keys (checked in tests/test_registry.py)."""
    if spec.name in _REGISTRY and not replace:
        raise RegistryError(f"method '{spec.name}' is already registered")
    names = [p.name for p in spec.phases]
    if len(set(names)) != len(names):
        raise RegistryError(f"method '{spec.name}' lists a phase twice: {names}")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def get(name: str) -> MethodSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise RegistryError(f"unknown strategy '{name}'; choose one of: {', '.join(names())}") from None


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def specs() -> tuple[MethodSpec, ...]:
    return tuple(_REGISTRY.values())


def with_capability(flag: str) -> tuple[str, ...]:
    """Names of the methods whose ``flag`` capability (e.g. ``secure_aggregation``) is set."""
    return tuple(spec.name for spec in _REGISTRY.values() if getattr(spec, flag))


def load(reference: str) -> Any:
    """Import ``"module:attribute"`` (a strategy class or a client handler) on first use."""
    module, _, attribute = reference.partition(":")
    if not module or not attribute:
        raise RegistryError(f"registry reference '{reference}' is not 'module:attribute'")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise RegistryError(f"cannot load '{reference}': {err}") from None


def knobs_of(spec: MethodSpec) -> frozenset[str]:
    return frozenset((*COMMON_KNOBS, *spec.knobs))


def _all(*groups: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(k for group in groups for k in group))


# ---------------------------------------------------------------------------------- the methods
register(
    MethodSpec(
        name="stsa",
        family=Family.ANALYTIC,
        summary="STSA: exact Gram G and class sums C per client and stage; ridge in closed form",
        strategy="strategies.stsa:STSAStrategy",
        phases=(
            FEDAVG,
            Phase("stsa-stats", Kind.STATS, "clients.stsa:handle_stats"),
            Phase("stsa-forget", Kind.STATS, "clients.forget:handle_forget"),
        ),
        knobs=_all(DENSE_RIDGE_KNOBS, SECURE_KNOBS, NOISE_KNOBS, ("stats-form", "check-tolerance", "forget")),
        secure_aggregation=True,
        backfill=True,
        upload_noise=("gram", "sums", "counts"),
        factor_upload=True,
        forget="samples",
    )
)
register(
    MethodSpec(
        name="stsa-e",
        family=Family.ANALYTIC,
        summary="STSA-E: class sums and counts of dummy clients only; the server estimates G (Eq. 9)",
        strategy="strategies.stsa_e:STSAEStrategy",
        phases=(
            FEDAVG,
            Phase("stsa-e-stats", Kind.STATS, "clients.stsa_e:handle_stats"),
            Phase("stsa-e-forget", Kind.STATS, "clients.forget:handle_forget_site"),
        ),
        knobs=_all(DENSE_RIDGE_KNOBS, ("dummy-clients", "k-mode", "forget"), NOISE_KNOBS),
        backfill=True,
        upload_noise=("sums", "counts"),
        forget="sites",
    )
)
register(
    MethodSpec(
        name="fedran",
        family=Family.ANALYTIC,
        summary="FedRAN: truncated SVD of the Gram per client, QR-SVD merge, subspace ridge, pseudo-labels",
        strategy="strategies.fedran:FedRANStrategy",
        phases=(
            FEDAVG,
            Phase("fedran-stats", Kind.STATS, "clients.fedran:handle_stats"),
            Phase("fedran-forget", Kind.STATS, "clients.forget:handle_forget_site"),
        ),
        knobs=_all(
            RIDGE_KNOBS, ("rank", "rank-budget-bytes", "label-ratio", "pseudo-threshold", "forget"), NOISE_KNOBS
        ),
        upload_noise=("gram", "sums", "counts"),
        forget="sites",
    )
)
register(
    MethodSpec(
        name="joint",
        family=Family.ANALYTIC,
        summary="upper bound: the same features, ridge on all seen data pooled on the server",
        strategy="strategies.joint:JointStrategy",
        phases=(FEDAVG,),
        knobs=DENSE_RIDGE_KNOBS,
        pooled_data=True,
    )
)
register(
    MethodSpec(
        name="finetune",
        family=Family.GRADIENT,
        summary="lower bound: FedAvg fine-tuning task after task",
        strategy="strategies.finetune:FinetuneStrategy",
        phases=(FEDAVG,),
        knobs=GRADIENT_KNOBS,
        task_pool=True,
    )
)
register(
    MethodSpec(
        name="lwf",
        family=Family.GRADIENT,
        summary="Fed-LwF: FedAvg + distillation from the previous task's model",
        strategy="strategies.lwf:LwFStrategy",
        phases=(FEDAVG, Phase("lwf", Kind.TRAIN, "clients.lwf:handle_lwf")),
        knobs=_all(GRADIENT_KNOBS, ("lwf-alpha", "lwf-temperature")),
        task_pool=True,
    )
)
register(
    MethodSpec(
        name="ewc",
        family=Family.GRADIENT,
        summary="Fed-EWC: FedAvg + a Fisher penalty aggregated over clients",
        strategy="strategies.ewc:EWCStrategy",
        phases=(
            FEDAVG,
            Phase("ewc", Kind.TRAIN, "clients.ewc:handle_ewc"),
            Phase("ewc-stats", Kind.STATS, "clients.ewc:handle_fisher"),
        ),
        knobs=_all(GRADIENT_KNOBS, ("ewc-lambda", "ewc-fisher-max")),
        task_pool=True,
    )
)
register(
    MethodSpec(
        name="joint-gradient",
        family=Family.GRADIENT,
        summary="upper bound: the same model and schedule trained on all seen data pooled on the server",
        strategy="strategies.joint_gradient:JointGradientStrategy",
        phases=(),
        knobs=UNAVERAGED_KNOBS,
        pooled_data=True,
    )
)
register(
    MethodSpec(
        name="lga",
        family=Family.GRADIENT,
        summary="LGA: class-balanced + self-distillation loss, proxy server picks the old model",
        strategy="strategies.lga:LGAStrategy",
        phases=(Phase("lga", Kind.TRAIN, "clients.lga:handle_lga"),),
        knobs=_all(GRADIENT_KNOBS, ("memory-size", "proxy-iterations")),
    )
)
register(
    MethodSpec(
        name="stamp",
        family=Family.GRADIENT,
        summary="STAMP: temporal gradient matching on clients, spatial gradient matching on the server",
        strategy="strategies.stamp:STAMPStrategy",
        phases=(Phase("stamp", Kind.TRAIN, "clients.stamp:handle_stamp"),),
        knobs=_all(UNAVERAGED_KNOBS, ("memory-size", "gm-c")),
        task_pool=True,
    )
)
register(
    MethodSpec(
        name="target",
        family=Family.GRADIENT,
        summary="TARGET: the server trains a generator from the global model; clients distil it on synthetic data",
        strategy="strategies.target:TARGETStrategy",
        phases=(FEDAVG, Phase("target", Kind.TRAIN, "clients.target:handle_target")),
        knobs=_all(GRADIENT_KNOBS, GENERATOR_KNOBS, ("kd-weight",)),
    )
)
register(
    MethodSpec(
        name="lander",
        family=Family.GRADIENT,
        summary="LANDER: TARGET-style replay around label-text-embedding anchors, with bounding losses",
        strategy="strategies.lander:LANDERStrategy",
        phases=(Phase("lander", Kind.TRAIN, "clients.lander:handle_lander"),),
        knobs=_all(
            GRADIENT_KNOBS, GENERATOR_KNOBS, ("lander-radius", "lander-ltc", "lander-pre", "lander-cur", "text-encoder")
        ),
        anchor_dim=512,  # CLIP ViT-B's text embedding size, that of the LTE the LANDER code ships
    )
)
