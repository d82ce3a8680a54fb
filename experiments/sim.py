"""Run one fcl-flower experiment in Flower's Ray-backed simulation engine.

    fcl-sim --strategy fedran --num-clients 5 --beta 0.1
    python experiments/sim.py --strategy fedran --num-clients 5 --beta 0.1   # the same

Every run-config key of pyproject.toml is a flag here (``num-tasks`` -> ``--num-tasks``), with
the same default; ``--num-cpus``/``--num-gpus`` set the resources each simulated client gets.
The ServerApp and ClientApp are exactly the ones ``flwr run .`` uses.

``--ray-address HOST:PORT`` joins a Ray cluster that is already running (``ray start --head`` on
one machine, ``ray start --address HOST:PORT`` on the others; docs/simulation.md, "A Ray cluster") instead of
starting Ray on this machine: the simulated clients are spread over the cluster's nodes as their
resources allow, and the run gives the same results as on one machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from experiments.benchlib import OneLineErrorParser
from fcl_flower.config import RunConfig
from fcl_flower.results import ResultsRecorder, StageRecord, format_stage_table


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(  # bad flags end like bad config values
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
        "default: the visible GPUs shared evenly by the clients, 0 without a GPU or with --ray-address.",
    )
    parser.add_argument("--ray-verbose", action="store_true", help="Show Ray/Flower logs of the clients.")
    parser.add_argument(
        "--ray-address",
        default="",
        help="Join this running Ray cluster (HOST:PORT of its head, or 'auto') instead of starting Ray "
        "here; default: a new Ray instance on this machine.",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    values = {knob.name: getattr(args, knob.name) for knob in RunConfig.knobs()}
    return RunConfig(**values).validated()


def default_gpu_share(num_clients: int) -> float:
    """Each client's share when all visible GPUs are split evenly (0.0 on a CPU-only machine)."""
    gpus = _visible_gpus()
    return min(1.0, gpus / num_clients) if gpus else 0.0


def run_local(cfg: RunConfig, node_configs: Sequence[Mapping[str, Any]] | None = None) -> ResultsRecorder:
    """The same run without Ray: the real ServerApp logic and ClientApp, messages delivered in this
    process (``fcl_flower.local_grid.LocalGrid``). Used by ``compare.py --engine local``, the
    benchmarks and ``results_diff.py``. ``node_configs`` (one per client) replaces the nodes'
    partition ids, as ``--node-config`` does on real SuperNodes: under ``dataset = custom`` each
    names a site's own ``data-dir`` and ``partition-id`` (the simulation of a federation of folders)."""
    from clients.app import app as client_app
    from fcl_flower.local_grid import LocalGrid
    from strategies.app import run_experiment

    share_data_root(cfg)
    return run_experiment(LocalGrid(client_app, cfg.num_clients, record=False, node_configs=node_configs), cfg)


def share_data_root(cfg: RunConfig) -> None:
    """The simulated clients run on this machine: give them the run's ``data-root`` as their own
    (``$FCL_DATA_ROOT``, inherited by the Ray workers started here; a client never takes the
    folder from the server's run config, clients/node_data.py). A Ray cluster joined with
    ``--ray-address`` keeps each machine's own setting."""
    from fcl_flower.data.registry import ROOT_ENV

    if cfg.data_root:
        os.environ[ROOT_ENV] = cfg.data_dir


def check_before_start(cfg: RunConfig) -> None:
    """Everything that can fail before any training, checked before the engine starts (ConfigError
    and friends, one line): the run folder is writable, not locked by another server and not another
    configuration's, under resume its checkpoint is this configuration's, the tracking backends are
    installed, the dataset loads and splits. The server checks the folder again when it starts, and
    holds its lock while it runs."""
    from fcl_flower.config import ConfigError
    from fcl_flower.runtime import federated_split
    from fcl_flower.tracking import require_tracking_packages
    from strategies.checkpoint import LOCK_FILE, check_run_folder

    if cfg.dataset == "custom":
        raise ConfigError(
            "dataset 'custom' runs on SuperNodes that each bring their own data-dir (deploy/README.md); "
            "the simulation has only partitions of a public dataset"
        )

    folder = cfg.output_dir
    created = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        check_run_folder(cfg)
        require_tracking_packages(cfg)
        federated_split(cfg)
    except BaseException:
        if created:  # leave no empty folders behind a run that never started
            with contextlib.suppress(OSError):
                (folder / LOCK_FILE).unlink(missing_ok=True)
        for path in created:
            with contextlib.suppress(OSError):
                path.rmdir()
        raise


def ray_init_args(*, address: str = "", verbose: bool = False) -> dict[str, Any]:
    """What Flower's Ray backend passes to ``ray.init`` (``backend_config["init_args"]``).

    Without ``address``: a new Ray instance with this machine's CPUs and GPUs. With one: join that
    cluster; its nodes declared their own CPUs and GPUs to ``ray start``, and ``ray.init`` refuses
    ``num_cpus``/``num_gpus`` when it connects to a running cluster."""
    if address:
        return {"address": address, "log_to_driver": verbose}
    return {"num_cpus": os.cpu_count() or 1, "num_gpus": _visible_gpus(), "log_to_driver": verbose}


def simulate(
    cfg: RunConfig,
    *,
    num_cpus: float = 1.0,
    num_gpus: float | None = None,
    verbose: bool = False,
    ray_address: str = "",
) -> Path:
    """Run the simulation; returns the path of results.json of a completed run. ``ray_address``:
    join that running Ray cluster instead of starting Ray here.

    Raises the ServerApp's :class:`~strategies.app.RunAborted` (one-line message, ``exit_code``) or
    any other exception it ended on; :class:`RunIncomplete` if it ended without completing.

    Flower 1.41 deprecates ``flwr.simulation.run_simulation`` in favour of the ``flwr run`` CLI and
    offers no supported Python launcher (its simulation runtime needs a SuperLink); :func:`run_on_ray`
    is the one place that calls it (docs/simulation.md, "The Python launcher").
    """
    from clients.app import app as client_app
    from strategies.app import build_server_app

    check_before_start(cfg)
    share_data_root(cfg)
    run_on_ray(
        build_server_app(cfg.to_mapping()),
        client_app,
        cfg.num_clients,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        verbose=verbose,
        ray_address=ray_address,
    )
    return completed_results(cfg)


def ray_backend_config(
    num_clients: int,
    *,
    num_cpus: float = 1.0,
    num_gpus: float | None = None,
    verbose: bool = False,
    ray_address: str = "",
) -> dict[str, Any]:
    """Flower's Ray backend config of a simulation of ``num_clients`` SuperNodes: each client's
    resources (``num_gpus`` None: the visible GPUs shared evenly, 0 on a joined cluster) and
    :func:`ray_init_args`."""
    if num_gpus is None:  # on a cluster this machine's GPUs say nothing about the others': ask
        num_gpus = 0.0 if ray_address else default_gpu_share(num_clients)
    return {
        "client_resources": {"num_cpus": num_cpus, "num_gpus": num_gpus},
        "init_args": ray_init_args(address=ray_address, verbose=verbose),
    }


def run_on_ray(
    server_app: Any,
    client_app: Any,
    num_clients: int,
    *,
    num_cpus: float = 1.0,
    num_gpus: float | None = None,
    verbose: bool = False,
    ray_address: str = "",
) -> None:
    """Run ``server_app`` with ``num_clients`` SuperNodes of ``client_app`` in Flower's Ray
    simulation (:func:`ray_backend_config`): :func:`simulate`'s engine, also used by the
    framework-overhead benchmark's minimal app (Flower's transport floor, on the same settings)."""
    from flwr.simulation import run_simulation

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=num_clients,
        backend_config=ray_backend_config(
            num_clients, num_cpus=num_cpus, num_gpus=num_gpus, verbose=verbose, ray_address=ray_address
        ),
        verbose_logging=verbose,
    )


class RunIncomplete(RuntimeError):
    """The engine returned, but results.json does not say the run completed."""


def completed_results(cfg: RunConfig) -> Path:
    """results.json of ``cfg``'s run if it says ``completed``; RunIncomplete (one line) otherwise."""
    path = cfg.output_dir / "results.json"
    try:
        status = json.loads(path.read_text()).get("status")
    except (OSError, ValueError):
        raise RunIncomplete(f"the run left no readable {path}; see the log above") from None
    if status != "completed":
        raise RunIncomplete(f"the run ended with status '{status}' ({path}); see the log above")
    return path


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # pragma: no cover - torch always imports here
        return 0


def main(argv: list[str] | None = None) -> int:
    """0: completed; 2: bad flags, config, data or checkpoint (nothing run); 1: the run failed;
    130: stopped by Ctrl-C (one line: what is saved, how to continue; experiments/interrupt.py)."""
    args = build_parser().parse_args(argv)
    from experiments.interrupt import sigint_stops, sim_line
    from strategies.app import USER_ERRORS

    try:
        cfg = config_from_args(args)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    argv = sys.argv[1:] if argv is None else argv
    with sigint_stops(lambda: sim_line(cfg.output_dir / "results.json", cfg.num_tasks, argv)) as stop:
        code = _run(args, cfg)
        if stop.happened:  # whatever the engine ended on after Ctrl-C: the one line, nothing left behind
            stop.end_children()
            return stop.say()
    return code


def _run(args: argparse.Namespace, cfg: RunConfig) -> int:
    from fcl_flower.interrupt import stop_requested

    try:
        with single_run_progress(cfg, verbose=args.ray_verbose) as drawn:
            path = simulate(
                cfg,
                num_cpus=args.num_cpus,
                num_gpus=args.num_gpus,
                verbose=args.ray_verbose,
                ray_address=args.ray_address,
            )
    except BaseException as err:
        if stop_requested():
            return 130  # main() says what was saved
        if not isinstance(err, Exception):
            raise
        return _failure(err)
    if stop_requested():  # Ctrl-C as the run completed: main() says so, in one line
        return 130
    if drawn:  # the bar replaced the log lines, the table among them
        print(format_stage_table(load_stages(path)))
    print(f"results: {path}\n         {path.with_suffix('.csv')}\n         {path.with_suffix('.png')}")
    return 0


def _failure(err: Exception) -> int:
    """The exit code of a run that ended on ``err``, after its one line (a traceback first for a bug)."""
    from strategies.app import USER_ERRORS, RunAborted

    if isinstance(err, USER_ERRORS):
        print(f"error: {err}", file=sys.stderr)
        return 2
    if isinstance(err, RunAborted | RunIncomplete):
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code if isinstance(err, RunAborted) else 1
    traceback.print_exception(err)  # a bug: show where, then one line
    print(f"error: the run failed: {type(err).__name__}: {err}", file=sys.stderr)
    return 1


@contextmanager
def single_run_progress(cfg: RunConfig, *, verbose: bool) -> Iterator[bool]:
    """A bar over the stages with the ETA, on an interactive terminal only (experiments/progress.py);
    yields whether it is drawn."""
    from tqdm import tqdm

    from experiments.progress import flower_progress

    bar = tqdm(total=cfg.num_tasks, desc="stages", disable=None, dynamic_ncols=True)
    try:
        with flower_progress(bar, verbose):
            yield not bar.disable
    finally:
        bar.close()


def load_stages(path: Path) -> list[StageRecord]:
    return [StageRecord(**s) for s in json.loads(path.read_text())["stages"]]


if __name__ == "__main__":
    sys.exit(main())
