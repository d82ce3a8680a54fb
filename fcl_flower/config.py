"""One typed run configuration for every entry point.

`flwr run .` reads ``[tool.flwr.app.config]`` from pyproject.toml, ``experiments/sim.py`` reads
command-line flags and the ClientApp reads the ConfigRecord inside each message: all three go
through :class:`RunConfig`, so a knob has one name (``num-tasks`` in TOML and messages,
``--num-tasks`` on the command line, ``num_tasks`` in Python), one default and one validation.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import importlib.util
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fcl_flower import methods


class ConfigError(ValueError):
    """A run configuration that cannot work; the message is one line meant for the user."""


#: The rules of ``stage1-aggregation``: FedAvg's mean, or one of Flower's robust aggregators.
STAGE1_RULES = ("fedavg", "median", "trimmed-mean", "krum", "multikrum", "bulyan")


def stage1_shortfall(rule: str, clients: int, byzantine: int, trim_fraction: float) -> str | None:
    """Why ``rule`` over ``clients`` models cannot withstand ``byzantine`` of them; None: it can.

    median: a majority of honest clients (n >= 2f + 1); trimmed-mean: at least f clients cut at
    each end (Flower cuts int(beta * n)); krum, multikrum: n >= 2f + 3 (Blanchard et al. 2017);
    bulyan: n >= 4f + 3 (El Mhamdi et al. 2018; Flower's Bulyan skips the round below it).
    """
    f = byzantine
    need = {"median": 2 * f + 1, "krum": 2 * f + 3, "multikrum": 2 * f + 3, "bulyan": 4 * f + 3}.get(rule)
    if need is not None and clients < need:
        return f"{rule} withstands {f} malicious client(s) only among at least {need} (got {clients})"
    if rule == "trimmed-mean" and int(trim_fraction * clients) < f:
        return (
            f"trimmed-mean with stage1-trim-fraction {trim_fraction:g} cuts {int(trim_fraction * clients)} of "
            f"{clients} clients at each end, fewer than the {f} malicious one(s) it must withstand"
        )
    return None


#: the largest task plan (file or text) a run takes: a class list, not a data set
MAX_PLAN_BYTES = 1 << 20


def read_plan_file(path: str) -> str:
    """The text of the server's task-plan file (at most :data:`MAX_PLAN_BYTES`); ConfigError
    naming the file. Cached per file version: every instruction of a run carries it."""
    file = Path(path).expanduser()
    try:
        stat = file.stat()
    except OSError as err:
        raise ConfigError(f"cannot read the task plan {file}: {err.strerror or err}") from None
    return _read_plan_file(str(file), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _read_plan_file(path: str, _mtime: int, size: int) -> str:
    if size > MAX_PLAN_BYTES:
        raise ConfigError(f"the task plan {path} is over {MAX_PLAN_BYTES} bytes")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
        if len(data) > MAX_PLAN_BYTES:
            raise ConfigError(f"the task plan {path} is over {MAX_PLAN_BYTES} bytes")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read the task plan {path}: {err}") from None


Choices = tuple[str, ...] | Callable[[], tuple[str, ...]]


def _knob(default: Any, help: str, choices: Choices | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class RunConfig:
    """Every knob of an fcl-flower run, with its default."""

    # --- what to run -----------------------------------------------------------------------
    strategy: str = _knob("stsa", "FCIL method to run (fcl_flower/methods.py lists them).", methods.names)
    dataset: str = _knob(
        "digits",
        "Dataset (digits is bundled with scikit-learn and works offline; custom: every site brings its own "
        "images, the classes come from class-names or task-plan).",
        ("digits", "synthetic", "cifar100", "tiny-imagenet", "imagenet-r", "custom"),
    )
    class_names: str = _knob(
        "", "dataset custom: the federation's classes in class order, comma-separated ('cat,dog,fox,owl')."
    )
    task_plan: str = _knob(
        "",
        "dataset custom: a JSON plan file instead of class-names: {classes, optional tasks (lists of class "
        "names), optional image-shape [C, H, W]} (fcl_flower/data/plan.py). Read by the server only: the "
        "clients get its content (task-plan-content), never the path.",
    )
    task_plan_content: str = _knob(
        "",
        "dataset custom: the task plan's JSON text itself (what the server sends the clients in place of a "
        "task-plan file; may also be given directly).",
    )
    evaluation: str = _knob(
        "central",
        "Who scores the model after each stage: the server on the dataset's test set (central), the clients "
        "on their own held-out data, counts summed by the server (federated; the server then opens no "
        "dataset), or both (central numbers in the table, federated ones in each stage's extra).",
        ("central", "federated", "both"),
    )
    data_root: str = _knob("", "Folder for downloaded datasets (default ~/.cache/fcl-flower/data).")
    download: bool = _knob(True, "Download a missing dataset (needs the network).")
    num_tasks: int = _knob(5, "Number of tasks T the classes are split into.")
    first_task_classes: int = _knob(
        0, "Classes in the first task (0: all tasks equal; >0: the papers' large first task)."
    )
    num_clients: int = _knob(5, "Number of clients K (one SuperNode each).")
    beta: float = _knob(0.5, "Dirichlet concentration of the per-task label skew (smaller: more skew).")
    partition: str = _knob(
        "dirichlet",
        "Per-task client data: Dirichlet shares (project), LGA's random class subsets with all their "
        "images, or STAMP's limitless task pool (every client its own class sequence, all images of "
        "those classes, one head over all classes, each client scored on its own tasks).",
        ("dirichlet", "class-subsets", "task-pool"),
    )
    class_fraction: float = _knob(0.6, "class-subsets: share of a task's classes each client holds (LGA: 0.6).")
    classes_per_task: int = _knob(
        0,
        "task-pool: classes in each task of a client (0: classes / num-tasks; beyond, each client's "
        "class permutation repeats).",
    )
    initial_clients: int = _knob(
        0, "Clients holding data from task 0 (0: all); the others join later (LGA: 30 of 30 + 10/task)."
    )
    joining_per_task: int = _knob(0, "Clients that join at each later task when initial-clients > 0 (LGA: 10).")
    clients_per_round: int = _knob(
        0, "Clients sampled per local-training round among those joined (0: all; LGA: 10); statistics rounds reach all."
    )
    old_only_fraction: float = _knob(
        0.0,
        "Share of the clients joined before a task that get none of its data and train on memory only (LGA Z_o: 0.1).",
    )
    seed: int = _knob(0, "Seed for class order, partitions, initial weights and random features.")
    # --- backbone and gradient training ----------------------------------------------------
    backbone: str = _knob(
        "small-cnn", "Feature extractor.", ("small-cnn", "resnet18-cifar", "resnet18", "vit-b16-adapter")
    )
    pretrained: bool = _knob(False, "Load pretrained weights (ViT only; needs the network or a cache).")
    image_size: int = _knob(0, "Resize inputs to this size (0: the dataset's own; 224 for the ViT).")
    stage1_rounds: int = _knob(10, "FedAvg rounds on task 1 (0 keeps the seeded/pretrained backbone).")
    rounds_per_task: int = _knob(5, "FedAvg rounds on each later task (gradient baselines only).")
    local_epochs: int = _knob(2, "Local epochs per FedAvg round.")
    lr: float = _knob(0.05, "Initial SGD learning rate (cosine-annealed over each task's rounds).")
    momentum: float = _knob(0.9, "SGD momentum.")
    weight_decay: float = _knob(5e-4, "SGD weight decay.")
    batch_size: int = _knob(64, "Batch size for local training and feature extraction.")
    weighted_fedavg: bool = _knob(True, "Weight FedAvg by client sample counts (false: the STSA code's plain mean).")
    stage1_aggregation: str = _knob(
        "fedavg",
        "How the server merges the clients' models in FedAvg rounds (stage 1 of the analytic methods, every "
        "round of the gradient baselines): fedavg (the mean), or a Flower rule robust to clients that send "
        "arbitrary weights: median, trimmed-mean, krum, multikrum, bulyan. Needs each model in clear: not "
        "with secure-aggregation.",
        STAGE1_RULES,
    )
    stage1_trim_fraction: float = _knob(
        0.2, "stage1-aggregation trimmed-mean: share of clients cut at each end, per coordinate (Flower's beta)."
    )
    stage1_byzantine: int = _knob(
        1,
        "stage1-aggregation other than fedavg: malicious clients per round the rule must withstand (Krum's and "
        "Bulyan's f; checked against the clients per round).",
    )
    stage1_multikrum_select: int = _knob(
        0, "stage1-aggregation multikrum: models averaged per round (0: clients per round - stage1-byzantine)."
    )
    train_head: str = _knob("cosine", "Head used while training the backbone.", ("cosine", "linear"))
    # --- analytic methods ------------------------------------------------------------------
    rf_dim: int = _knob(1000, "Random-feature dimension M (0: no projection, use raw features).")
    ridge: str = _knob("auto", "Ridge gamma, a number, or 'auto' for GCV on the aggregated statistics.")
    ridge_selection: str = _knob(
        "auto",
        "How ridge 'auto' searches its grid: exact (eigendecomposition of G), krylov (shift-invert block Krylov "
        "with a stated error; falls back to exact when it cannot certify its choice), auto (krylov from M = 2048 with n >= 2 M).",
        ("auto", "exact", "krylov"),
    )
    head: str = _knob("cosine", "Analytic classifier head (cosine reproduces the paper).", ("cosine", "dot"))
    wire_dtype: str = _knob("float32", "Dtype of uploaded statistics.", ("float32", "float64"))
    check_tolerance: str = _knob(
        "float32",
        "STSA plain Gram uploads (a difference only with wire-dtype float64): the rounding their "
        "positive-semidefinite check allows. float32: 4(M + c)·2^-24 of the scaled Gram's spectrum whatever "
        "the wire dtype (a float64 upload is factorised in float32 first, in about two thirds of the time); "
        "wire: the run's wire dtype's own (float64 uploads are held to 2^-53, at the cost of a float64 "
        "factorisation per upload, about one solve's). Factor uploads and opened secure sums keep their own.",
        ("float32", "wire"),
    )
    stats_form: str = _knob(
        "gram",
        "STSA: upload the packed Gram (gram), or, where it is smaller (fewer samples than about M/2), the "
        "client's [features, labels] turned by a secret random rotation (factor): the same statistics, far fewer "
        "bytes, checked without a factorisation. Its rotation is drawn from NumPy's PCG64 seeded with 128 bits "
        "of OS entropy (not a cryptographic generator; from (seed, client, task) with noise-seeded, which lets "
        "the server undo it), so W equals the gram form's up to the wire dtype's rounding (float32 uploads "
        "differ by ~0.3 % at tiny ridge), not bit for bit.",
        ("gram", "factor"),
    )
    dummy_clients: int = _knob(1, "STSA-E: dummy clients K_D each client splits its data into.")
    k_mode: str = _knob(
        "global", "STSA-E estimator: paper's global K or unbiased per-class K.", ("global", "per-class")
    )
    rank: int = _knob(256, "FedRAN: rank r of the client and server low-rank summaries.")
    rank_budget_bytes: int = _knob(0, "FedRAN: set the rank from an upload budget in bytes (0: use --rank).")
    label_ratio: float = _knob(1.0, "FedRAN-SSL: fraction of each client's samples that are labelled.")
    pseudo_threshold: float = _knob(0.5, "FedRAN-SSL: cosine threshold tau for prototype pseudo-labels.")
    # --- privacy of the statistics uploads (fcl_flower/privacy) -----------------------------
    secure_aggregation: bool = _knob(
        False,
        "STSA: pairwise-masked uploads, the server sees only the sum over clients (on in the documented deployment).",
    )
    secagg_fraction_bits: int = _knob(
        24, "Secure aggregation: fixed-point fraction bits (rounding error 2^-(f+1) per entry)."
    )
    secagg_min_clients: int = _knob(2, "Secure aggregation: fewest participants a client accepts in a masked round.")
    feature_clip: float = _knob(
        0.0,
        "Analytic methods: scale every sample's random features to L2 norm at most this bound B "
        "(0: no clipping). Gives the server's upload check tr(G) <= n B^2 and the per-sample sensitivity of DP noise.",
    )
    noise_q: float = _knob(
        0.0,
        "The STSA paper's noise (arXiv 2506.01327 Eqs. 63-64): each client adds q·N(0, s²) element-wise to "
        "what noise-on names (0: off). Not a formal guarantee; see dp-epsilon.",
    )
    noise_s: float = _knob(0.0, "The paper's noise: standard deviation s of N(0, s²) (0: off).")
    noise_on: str = _knob(
        "both",
        "What the noise covers: features (STSA: G and C; STSA-E: class sums; FedRAN: its Gram before the "
        "truncated SVD, and B), counts (class counts; FedRAN: its sample count), or both. dp-epsilon needs both.",
        ("features", "counts", "both"),
    )
    dp_epsilon: float = _knob(
        0.0,
        "Differential privacy of every sample: the Gaussian mechanism on G, C and the counts, calibrated to "
        "(dp-epsilon, dp-delta) with sensitivities from feature-clip (0: off). Needs feature-clip > 0.",
    )
    dp_delta: float = _knob(1e-5, "Differential privacy: delta of the (epsilon, delta) target.")
    dp_scope: str = _knob(
        "run",
        "Differential privacy: the target holds for each stage's release (stage), or for their composition "
        "over all the run's stages (run).",
        ("run", "stage"),
    )
    dp_accountant: str = _knob(
        "pld", "Differential privacy: the dp-accounting accountant that calibrates and composes.", ("pld", "rdp")
    )
    noise_seeded: bool = _knob(
        False,
        "Draw the noise, and the rotation of a stats-form factor upload, from a generator seeded by (seed, "
        "client, task): reproducible, but the server can recompute and subtract the noise, and undo the "
        "rotation to read every sample's raw random features; for experiments and tests only (default: "
        "NumPy's PCG64 seeded with 128 bits of OS entropy).",
    )
    secagg_signed_keys: bool = _knob(
        False,
        "Secure aggregation: every client signs its round keys with its SuperNode key and checks its peers' "
        "signatures against the operator's list (node config secagg-signing-key, secagg-trusted-keys).",
    )
    secagg_failed_sum: str = _knob(
        "skip",
        "Secure aggregation: what the run does when an opened sum fails its checks. It is never opened again "
        "over another set (that would reveal a client by difference): 'skip' goes on without that stage's "
        "statistics (the previous classifier is kept), 'stop' ends the run with the reason.",
        ("skip", "stop"),
    )
    min_class_count: int = _knob(
        1,
        "Clients upload statistics only of classes with at least this many samples (1: all; 3 makes single samples unidentifiable).",
    )
    # --- unlearning (docs/unlearning.md) -----------------------------------------------------
    forget: str = _knob(
        "",
        "STSA, STSA-E, FedRAN: removals applied between stages, comma-separated: 'S:C' forgets site C (client id) "
        "wholly after "
        "stage S (the server operator's request; the site re-sends the uploads it kept under node config "
        "upload-store and takes no part in later stages), 'S' runs a forget round after stage S in which each "
        "site applies its own request (node config forget-samples; STSA only). Under secure-aggregation (STSA) the "
        "removal is its own secure round and a named site takes part only with node config forget-consent=true. "
        "Empty: none.",
    )
    stage1_exclude: str = _knob(
        "",
        "Sites (client ids, comma-separated) left out of the stage-1 FedAvg rounds from the start: the backbone "
        "never learns from them, so an analytic method can forget them exactly later (docs/unlearning.md).",
    )
    # --- gradient baselines ----------------------------------------------------------------
    lwf_alpha: float = _knob(3.0, "Fed-LwF: weight of the distillation loss (3 as in the TARGET/LANDER code).")
    lwf_temperature: float = _knob(2.0, "Fed-LwF: distillation temperature.")
    ewc_lambda: float = _knob(1000.0, "Fed-EWC: weight of the Fisher penalty.")
    ewc_fisher_max: float = _knob(
        1e-4,
        "Fed-EWC: clamp each client's diagonal Fisher at this value (1e-4 as in the TARGET/LANDER code; 0: no clamp).",
    )
    memory_size: int = _knob(200, "LGA/STAMP: exemplar/coreset memory per client (samples).")
    gm_c: float = _knob(0.5, "STAMP: CAGrad search radius kappa of the temporal and spatial gradient matching (Eq. 2).")
    proxy_iterations: int = _knob(
        50,
        "LGA: L-BFGS steps of the proxy's gradient inversion (paper/code 250; 0: no proxy, old model = last global model).",
    )
    # --- data-free generative replay (TARGET, LANDER) --------------------------------------
    generator_rounds: int = _knob(
        6, "TARGET/LANDER: generator synthesis rounds per task (code: TARGET 10 on CIFAR-100, LANDER 40 after warm-up)."
    )
    generator_steps: int = _knob(
        5, "TARGET/LANDER: generator iterations per synthesis round (code: TARGET 10, LANDER 40)."
    )
    generator_warmup: int = _knob(
        2,
        "TARGET/LANDER: synthesis rounds before the student and the adversarial term start (code: TARGET 20, LANDER 10).",
    )
    synthesis_batch: int = _knob(64, "TARGET/LANDER: synthetic images per synthesis round (code: 256).")
    generator_bn: float = _knob(
        1.0,
        "TARGET/LANDER: weight of the generator's BatchNorm-statistics (DeepInversion) term (code: LANDER 1; "
        "TARGET 10 on CIFAR-100, which on digits swamps the class term).",
    )
    student_steps: int = _knob(
        20,
        "TARGET/LANDER: server-side student distillation steps per round after warm-up (code: TARGET 400, LANDER 50).",
    )
    kd_weight: float = _knob(25.0, "TARGET: weight of the clients' distillation loss on synthetic data (code: 25).")
    lander_radius: float = _knob(0.015, "LANDER: radius r of the bounding loss around the label-text anchors.")
    lander_ltc: float = _knob(5.0, "LANDER: weight of the anchor (LTC) and feature-distillation terms.")
    lander_pre: float = _knob(0.4, "LANDER: base weight alpha_pre of the distillation from the previous task.")
    lander_cur: float = _knob(0.2, "LANDER: base weight alpha_cur of the current task's losses.")
    text_encoder: str = _knob(
        "openai/clip-vit-base-patch32",
        "LANDER: Hugging Face text encoder of the label-text embeddings; 'name-hash' (or an unavailable model) uses "
        "deterministic embeddings hashed from the class names.",
    )
    # --- infrastructure --------------------------------------------------------------------
    out: str = _knob("~/fcl-flower-results", "Output folder (made absolute); results.json goes in <out>/<run-name>.")
    run_name: str = _knob("", "Sub-folder name for this run (default <strategy>-<dataset>-seed<seed>-<config hash>).")
    overwrite: bool = _knob(
        False, "Replace the results of another configuration in the run folder (otherwise the run refuses)."
    )
    round_timeout: float = _knob(3600.0, "Seconds the server waits for client replies in a round.")
    require_all_clients: bool = _knob(
        False, "Retry a round until every client answered instead of going on without the missing ones."
    )
    round_retries: int = _knob(3, "With require-all-clients: how often a round is re-sent before giving up.")
    resume: bool = _knob(False, "Continue from the checkpoint in the output folder.")
    device: str = _knob("auto", "Device for training/feature extraction.", ("auto", "cpu", "cuda"))
    tracking: str = _knob(
        "none",
        "Experiment tracking of the run config, per-round and per-stage metrics, bytes and timings "
        "(needs the 'tracking' extra): TensorBoard event files, MLflow, or both.",
        ("none", "tensorboard", "mlflow", "both"),
    )
    tracking_uri: str = _knob(
        "", "MLflow tracking URI (default: a file store in <run folder>/mlruns; e.g. http://host:5000)."
    )

    # ------------------------------------------------------------------------------------
    def stage1_excluded(self) -> frozenset[int]:
        """The client ids of ``stage1-exclude``."""
        return frozenset(self._client_ids(self.stage1_exclude, "stage1-exclude"))

    def forget_requests(self) -> dict[int, tuple[int, ...]]:
        """``forget`` as {stage (1-based): the sites the server operator removes wholly after it}; a
        stage with no site runs a forget round for the sites' own requests."""
        requests: dict[int, list[int]] = {}
        for item in (part.strip() for part in self.forget.split(",") if part.strip()):
            stage_text, _, site = item.partition(":")
            if not stage_text.strip().isdigit() or not 1 <= int(stage_text) <= self.num_tasks:
                raise ConfigError(f"forget: '{item}' must start with a stage in 1..{self.num_tasks}")
            sites = requests.setdefault(int(stage_text), [])
            if site.strip():
                sites.extend(self._client_ids(site, "forget"))
        return {stage: tuple(sorted(set(sites))) for stage, sites in sorted(requests.items())}

    def check_forget(self) -> None:
        """``forget`` where the method has a forget round (the registry's ``forget``) and the server
        can check a removal against what it accepted: uploads without noise, STSA's in Gram form (under
        secure-aggregation, STSA only, the removal is its own secure round); a site's own requests (a bare stage 'S') only where the method forgets
        samples (docs/unlearning.md). ConfigError with the reason otherwise."""
        if not self.forget_requests():
            return
        able = methods.with_capability("forget")
        if self.strategy not in able:
            raise ConfigError(f"forget: strategy {self.strategy} has no forget round (it works with {', '.join(able)})")
        if self.upload_noise or self.stats_form != "gram":
            raise ConfigError(
                "forget works with uploads in Gram form without noise (stats-form gram, no noise): a removal must "
                "take out exactly what was added, and the server checks it"
            )
        bare = [item.strip() for item in self.forget.split(",") if item.strip() and ":" not in item]
        if bare and self.method.forget != "samples":
            samples = ", ".join(m.name for m in methods.specs() if m.forget == "samples")
            raise ConfigError(
                f"forget: '{bare[0]}' (the sites' own sample requests) works with strategy {samples}; "
                f"{self.strategy} forgets whole sites only ('S:C')"
            )

    def _client_ids(self, text: str, knob: str) -> list[int]:
        ids = []
        for part in (p.strip() for p in text.split(",") if p.strip()):
            if not part.isdigit() or int(part) >= self.num_clients:
                raise ConfigError(f"{knob}: '{part}' is not a client id in 0..{self.num_clients - 1}")
            ids.append(int(part))
        return ids

    @staticmethod
    def key(name: str) -> str:
        """Python field name -> run-config/message key (``num_tasks`` -> ``num-tasks``)."""
        return name.replace("_", "-")

    @classmethod
    def knobs(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @staticmethod
    def choices(knob: dataclasses.Field) -> tuple[str, ...] | None:
        """The allowed values of a knob (the registry's method names for ``strategy``), or None."""
        choices = knob.metadata.get("choices")
        return choices() if callable(choices) else choices

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, strict: bool = True) -> RunConfig:
        """Build from run-config/ConfigRecord keys, coercing types; unknown keys are named."""
        by_key = {cls.key(f.name): f for f in cls.knobs()}
        unknown = sorted(set(values) - set(by_key))
        if unknown and strict:
            raise ConfigError(unknown_keys_message(unknown, by_key))
        kwargs = {}
        for key, value in values.items():
            f = by_key.get(key)
            if f is not None:
                kwargs[f.name] = _coerce(key, value, type(f.default))
        return cls(**kwargs).validated()

    def to_mapping(self) -> dict[str, bool | int | float | str]:
        """Run-config keys -> scalar values (what a ConfigRecord carries)."""
        return {self.key(f.name): getattr(self, f.name) for f in self.knobs()}

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes).validated()

    # ------------------------------------------------------------------------------------
    def validated(self) -> RunConfig:
        """Check everything that can be checked without loading data; raise ConfigError."""
        for f in self.knobs():
            choices = self.choices(f)
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"unknown {self.key(f.name)} '{value}'; choose one of: {', '.join(choices)}")
        if self.beta <= 0:
            raise ConfigError(f"beta must be > 0 (got {self.beta})")
        if not 0.0 < self.class_fraction <= 1.0:
            raise ConfigError(f"class-fraction must be in (0, 1] (got {self.class_fraction})")
        if self.initial_clients < 0 or self.joining_per_task < 0:
            raise ConfigError("initial-clients and joining-per-task must be >= 0")
        if 0 < self.initial_clients < self.num_clients and self.joining_per_task < 1:
            raise ConfigError("joining-per-task must be >= 1 when initial-clients < num-clients")
        if not 0 <= self.clients_per_round <= self.num_clients:
            raise ConfigError(
                f"clients-per-round must be in [0, num-clients={self.num_clients}] (got {self.clients_per_round})"
            )
        if not 0.0 <= self.old_only_fraction < 1.0:
            raise ConfigError(f"old-only-fraction must be in [0, 1) (got {self.old_only_fraction})")
        if self.partition == "task-pool" and not self.method.task_pool:
            raise ConfigError(
                f"strategy '{self.strategy}' needs a shared task stream; partition task-pool "
                f"(STAMP's limitless task pool) runs with: {', '.join(methods.with_capability('task_pool'))}"
            )
        if self.partition == "task-pool" and (self.first_task_classes or 0 < self.initial_clients < self.num_clients):
            raise ConfigError(
                "partition task-pool has no large first task and no joining clients: "
                "set first-task-classes and initial-clients to 0"
            )
        positive = (
            "num_tasks",
            "num_clients",
            "local_epochs",
            "batch_size",
            "dummy_clients",
            "rank",
            "generator_rounds",
            "generator_steps",
            "synthesis_batch",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{self.key(name)} must be >= 1 (got {getattr(self, name)})")
        for name in (
            "stage1_rounds",
            "rounds_per_task",
            "rf_dim",
            "first_task_classes",
            "image_size",
            "rank_budget_bytes",
            "memory_size",
            "classes_per_task",
            "generator_warmup",
            "student_steps",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{self.key(name)} must be >= 0 (got {getattr(self, name)})")
        for name in ("generator_bn", "kd_weight", "lander_radius", "lander_ltc", "lander_pre", "lander_cur"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{self.key(name)} must be >= 0 (got {getattr(self, name)})")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0 (got {self.lr})")
        if not 0.0 < self.label_ratio <= 1.0:
            raise ConfigError(f"label-ratio must be in (0, 1] (got {self.label_ratio})")
        if not -1.0 <= self.pseudo_threshold <= 1.0:
            raise ConfigError(f"pseudo-threshold is a cosine, in [-1, 1] (got {self.pseudo_threshold})")
        if self.round_timeout <= 0:
            raise ConfigError(f"round-timeout must be > 0 seconds (got {self.round_timeout})")
        if not (self.feature_clip >= 0 and math.isfinite(self.feature_clip)):
            raise ConfigError(f"feature-clip must be a finite number >= 0 (got {self.feature_clip})")
        if self.min_class_count < 1:
            raise ConfigError(f"min-class-count must be >= 1 (got {self.min_class_count})")
        self.stage1_excluded()  # both parse, or say why not
        self.check_forget()
        if not 8 <= self.secagg_fraction_bits <= 48:
            raise ConfigError(f"secagg-fraction-bits must be in [8, 48] (got {self.secagg_fraction_bits})")
        if self.secagg_min_clients < 2:
            raise ConfigError(
                f"secagg-min-clients must be >= 2: a sum over one client is its upload (got {self.secagg_min_clients})"
            )
        if self.secure_aggregation and not self.method.secure_aggregation:
            secure = ", ".join(methods.with_capability("secure_aggregation"))
            raise ConfigError(
                f"secure-aggregation works with {secure} (sums over clients); "
                f"{self.strategy} needs per-client uploads: use min-class-count instead"
            )
        if self.task_plan and self.task_plan_content:
            raise ConfigError("task-plan (a file) and task-plan-content (its text) are one plan: give one of them")
        if len(self.task_plan_content.encode("utf-8")) > MAX_PLAN_BYTES:
            raise ConfigError(f"task-plan-content is over {MAX_PLAN_BYTES} bytes")
        if self.dataset == "custom":
            if not (self.class_names.strip() or self.task_plan or self.task_plan_content):
                raise ConfigError("dataset 'custom' needs class-names ('cat,dog,...') or task-plan (a JSON plan file)")
            if self.evaluation != "federated":
                raise ConfigError(
                    "dataset 'custom' has no test set on the server: use evaluation='federated' (clients score "
                    "the model on their own held-out data)"
                )
        elif self.class_names or self.task_plan or self.task_plan_content:
            raise ConfigError(
                "class-names and task-plan describe dataset 'custom'; the public datasets bring their own"
            )
        if self.evaluation == "federated" and self.method.pooled_data:
            raise ConfigError(
                f"{self.strategy} pools every client's training data on the server (an upper bound, not a "
                "federated method): it needs a public dataset and evaluation 'central' or 'both'"
            )
        self._validate_noise()
        self._validate_stats_form()
        self._validate_stage1_aggregation()
        self.ridge_value()  # parses or raises
        return self

    @property
    def paper_noise(self) -> bool:
        """Whether the STSA paper's noise q·N(0, s²) is on (noise-q and noise-s both > 0)."""
        return self.noise_q > 0 and self.noise_s > 0

    @property
    def dp(self) -> bool:
        """Whether calibrated differential privacy is on (dp-epsilon > 0)."""
        return self.dp_epsilon > 0

    @property
    def upload_noise(self) -> bool:
        """Whether the statistics uploads carry noise (the paper's or differential privacy's)."""
        return self.paper_noise or self.dp

    def _validate_stats_form(self) -> None:
        if self.stats_form == "gram":
            return
        if not self.method.factor_upload:
            factor = ", ".join(methods.with_capability("factor_upload"))
            raise ConfigError(f"stats-form factor works with {factor}; {self.strategy} uploads other statistics")
        if self.secure_aggregation:
            raise ConfigError("stats-form factor cannot be masked: secure aggregation sums Grams (use stats-form gram)")
        if self.upload_noise:
            raise ConfigError("stats-form factor carries no noise: noise goes on the Gram (use stats-form gram)")

    @property
    def stage1_clients(self) -> int:
        """Clients per FedAvg round of task 1 (the fewest of any task: clients only join later)."""
        joined = self.initial_clients if 0 < self.initial_clients < self.num_clients else self.num_clients
        return min(self.clients_per_round, joined) if self.clients_per_round else joined

    def _validate_stage1_aggregation(self) -> None:
        if not 0.0 <= self.stage1_trim_fraction < 0.5:
            raise ConfigError(f"stage1-trim-fraction must be in [0, 0.5) (got {self.stage1_trim_fraction})")
        if self.stage1_byzantine < 0 or self.stage1_multikrum_select < 0:
            raise ConfigError("stage1-byzantine and stage1-multikrum-select must be >= 0")
        rule = self.stage1_aggregation
        if rule == "fedavg":
            return
        if "stage1-aggregation" not in methods.knobs_of(self.method):
            raise ConfigError(f"stage1-aggregation {rule}: {self.strategy} has no FedAvg rounds to aggregate by it")
        if self.secure_aggregation:
            raise ConfigError(
                f"stage1-aggregation {rule} needs each client's model, but under secure-aggregation the server "
                "sees only their sum: use stage1-aggregation fedavg"
            )
        clients = self.stage1_clients
        shortfall = stage1_shortfall(rule, clients, self.stage1_byzantine, self.stage1_trim_fraction)
        if shortfall:
            raise ConfigError(f"stage1-aggregation {shortfall} per round: add clients or lower stage1-byzantine")
        if rule == "multikrum" and self.stage1_multikrum_select > clients - self.stage1_byzantine:
            raise ConfigError(
                f"stage1-multikrum-select must be at most clients per round - stage1-byzantine = "
                f"{clients - self.stage1_byzantine} (got {self.stage1_multikrum_select})"
            )

    def _validate_noise(self) -> None:
        for name in ("noise_q", "noise_s", "dp_epsilon"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{self.key(name)} must be a finite number >= 0 (got {value})")
        if (self.noise_q > 0) != (self.noise_s > 0):
            raise ConfigError(
                f"the paper's noise q·N(0, s²) needs both noise-q and noise-s > 0 (got {self.noise_q}, {self.noise_s})"
            )
        if not 0.0 < self.dp_delta < 1.0:
            raise ConfigError(f"dp-delta must be in (0, 1) (got {self.dp_delta})")
        if not self.upload_noise:
            return
        if not self.method.upload_noise:
            noisy = ", ".join(methods.with_capability("upload_noise"))
            raise ConfigError(f"noise on the uploads works with {noisy} (their statistics); {self.strategy} has none")
        if not self.dp:
            return
        if self.paper_noise:
            raise ConfigError("choose one noise: the paper's (noise-q, noise-s) or differential privacy (dp-epsilon)")
        if self.noise_on != "both":
            raise ConfigError("dp-epsilon protects everything an upload carries: noise-on must be 'both'")
        if self.feature_clip <= 0:
            raise ConfigError("dp-epsilon needs feature-clip B > 0: the noise is calibrated to the per-sample bound B")
        if self.min_class_count != 1:
            raise ConfigError(
                "dp-epsilon needs min-class-count 1: withholding a class depends on its count, "
                "which one sample can change (the accounting would not hold)"
            )
        if self.label_ratio != 1.0:
            raise ConfigError(
                "dp-epsilon needs label-ratio 1: pseudo-labels depend on every labelled sample "
                "(no per-sample bound on an upload)"
            )
        if importlib.util.find_spec("dp_accounting") is None:
            raise ConfigError("dp-epsilon needs the dp-accounting library: pip install 'fcl-flower[dp]'")

    @property
    def method(self) -> methods.MethodSpec:
        """This run's registry entry (the strategy name is validated against the registry)."""
        return methods.get(self.strategy)

    def unused_knobs(self) -> list[str]:
        """Knobs set to a non-default value that this run's method never reads (a likely mistake)."""
        used, default = methods.knobs_of(self.method), RunConfig()
        return [
            self.key(f.name)
            for f in self.knobs()
            if self.key(f.name) not in used and getattr(self, f.name) != getattr(default, f.name)
        ]

    def ridge_value(self) -> float | None:
        """The fixed ridge gamma, or None for 'auto' (generalised cross-validation)."""
        text = str(self.ridge).strip().lower()
        if text == "auto":
            return None
        try:
            gamma = float(text)
        except ValueError:
            raise ConfigError(f"ridge must be a number or 'auto' (got '{self.ridge}')") from None
        if gamma <= 0:
            raise ConfigError(f"ridge must be > 0 (got {gamma})")
        return gamma

    @property
    def data_dir(self) -> str:
        root = self.data_root or os.path.join("~", ".cache", "fcl-flower", "data")
        return str(Path(root).expanduser().resolve())

    def client_mapping(self) -> dict[str, bool | int | float | str]:
        """:meth:`to_mapping` as the clients get it: a ``task-plan`` file of the server becomes
        ``task-plan-content``, its text (a client never opens a path the server names)."""
        values = self.to_mapping()
        if self.task_plan:
            values["task-plan-content"] = read_plan_file(self.task_plan)
            values["task-plan"] = ""
        return values

    def result_config(self) -> dict[str, bool | int | float | str]:
        """The knobs that decide what a run computes (all but :data:`OPERATIONAL_KEYS`)."""
        return {k: v for k, v in self.to_mapping().items() if k not in OPERATIONAL_KEYS}

    def config_hash(self) -> str:
        """8 hex digits of SHA-256 over the result knobs that differ from their defaults.

        Defaults are left out, so a knob added later (with a default) keeps every hash; two runs
        that differ in any result knob get different run folders by default.
        """
        default = RunConfig().result_config()
        changed = {k: v for k, v in self.result_config().items() if v != default[k]}
        return hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:8]

    @property
    def output_dir(self) -> Path:
        """Absolute: under `flwr run` the app runs from $FLWR_HOME/apps/..., not from here."""
        name = self.run_name or f"{self.strategy}-{self.dataset}-seed{self.seed}-{self.config_hash()}"
        return Path(self.out).expanduser().resolve() / name


#: Knobs that say where and how a run executes, not what it computes: they may change between a run
#: and its resume, and stay out of the config hash of the run folder.
OPERATIONAL_KEYS = frozenset(
    {
        "out",
        "run-name",
        "overwrite",
        "resume",
        "round-timeout",
        "require-all-clients",
        "round-retries",
        "device",
        "tracking",
        "tracking-uri",
    }
)


def unknown_keys_message(unknown: list[str], known: Mapping[str, Any]) -> str:
    """``unknown config key 'rnk' (did you mean 'rank'?)`` for each unknown key, in one line."""
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, list(known), n=1)
        parts.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
    return f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(parts)}"


def _coerce(key: str, value: Any, kind: type) -> Any:
    """Turn TOML/CLI/ConfigRecord scalars into the knob's type, with a one-line error."""
    try:
        if kind is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered in ("true", "1", "yes", "on"):
                    return True
                if lowered in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            return bool(value)
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be of type {kind.__name__} (got {value!r})") from None
