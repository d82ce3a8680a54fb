"""Run one fcl-flower experiment in Flower's Ray-backed simulation engine.

    fcl-sim --strategy fedran --num-clients 5 --beta 0.1
    python experiments/sim.py --strategy fedran --num-clients 5 --beta 0.1   # the same

Every run-config key of pyproject.toml is a flag here (``num-tasks`` -> ``--num-tasks``), with
the same default; ``--num-cpus``/``--num-gpus`` set the resources each simulated client gets.
The ServerApp and ClientApp are exactly the ones ``flwr run .`` uses.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.results import ResultsRecorder


class _OneLineErrorParser(argparse.ArgumentParser):
    """Bad flags end like bad config values: one ``error: ...`` line on stderr, exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]  # argparse says NoReturn; exit() does not return
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        description="Federated class-incremental learning with Flower (Ray simulation).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for knob in RunConfig.knobs():
        flag = "--" + RunConfig.key(knob.name)
        default = knob.default
        kwargs: dict[str, Any] = {"default": default, "help": knob.metadata["help"], "dest": knob.name}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = type(default)
            if RunConfig.choices(knob):
                kwargs["choices"] = RunConfig.choices(knob)
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPU cores reserved per simulated client.")
    parser.add_argument(
        "--num-gpus",
        type=float,
        default=None,
        help="GPU share per simulated client (e.g. 0.2 lets 5 clients share one GPU); "
        "default: the visible GPUs shared evenly by the clients, 0 without a GPU.",
    )
    parser.add_argument("--ray-verbose", action="store_true", help="Show Ray/Flower logs of the clients.")
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    values = {knob.name: getattr(args, knob.name) for knob in RunConfig.knobs()}
    return RunConfig(**values).validated()


def default_gpu_share(num_clients: int) -> float:
    """Each client's share when all visible GPUs are split evenly (0.0 on a CPU-only machine)."""
    gpus = _visible_gpus()
    return min(1.0, gpus / num_clients) if gpus else 0.0


def run_local(cfg: RunConfig) -> ResultsRecorder:
    """The same run without Ray: the real ServerApp logic and ClientApp, messages delivered in this
    process (``fcl_flower.local_grid.LocalGrid``). Used by ``compare.py --engine local``, the
    benchmarks and ``results_diff.py``."""
    from clients.app import app as client_app
    from fcl_flower.local_grid import LocalGrid
    from strategies.app import run_experiment

    return run_experiment(LocalGrid(client_app, cfg.num_clients, record=False), cfg)


def simulate(cfg: RunConfig, *, num_cpus: float = 1.0, num_gpus: float | None = None, verbose: bool = False) -> Path:
    """Run the simulation; returns the path of results.json."""
    from flwr.simulation import run_simulation

    from clients.app import app as client_app
    from fcl_flower.runtime import federated_split
    from strategies.app import build_server_app

    federated_split(cfg)  # fail fast, with a one-line error, before Ray starts
    if num_gpus is None:
        num_gpus = default_gpu_share(cfg.num_clients)
    backend_config = {
        "client_resources": {"num_cpus": num_cpus, "num_gpus": num_gpus},
        "init_args": {"num_cpus": os.cpu_count() or 1, "num_gpus": _visible_gpus(), "log_to_driver": verbose},
    }
    run_simulation(
        server_app=build_server_app(cfg.to_mapping()),
        client_app=client_app,
        num_supernodes=cfg.num_clients,
        backend_config=backend_config,
        verbose_logging=verbose,
    )
    return cfg.output_dir / "results.json"


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # pragma: no cover - torch always imports here
        return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        path = simulate(cfg, num_cpus=args.num_cpus, num_gpus=args.num_gpus, verbose=args.ray_verbose)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # data/model errors carry one-line messages for the user
        from strategies.app import USER_ERRORS

        if isinstance(err, USER_ERRORS):
            print(f"error: {err}", file=sys.stderr)
            return 2
        raise
    if not path.exists():
        print(f"error: the run produced no results (expected {path}); see the log above", file=sys.stderr)
        return 1
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
