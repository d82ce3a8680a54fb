"""Run several strategies on identical partitions and seeds; write one comparison table + plots.

    python experiments/compare.py --config experiments/configs/stsa_table1_cifar100.toml
    python experiments/compare.py --config stsa_table1_cifar100 --offline --engine local

Every (sweep point, strategy, seed) of the config runs through Flower: ``--engine ray`` is the
Ray simulation of experiments/sim.py (the real engine; ~15 s start-up per run), ``--engine local``
delivers the same messages to the same ClientApp inside this process (fcl_flower.local_grid).
Identical partitions need nothing special: the split is a function of (dataset, seed, tasks,
clients, beta), so two strategies with the same seed see the same data on the same clients.

Outputs in ``--out`` (default ~/fcl-flower-results/compare/<config>[-offline]):
  <run-name>/results.json   one folder per run (written by the strategy)
  runs.csv                  one line per run
  stages.csv                per (method, sweep point, stage): accuracy, upload and time, mean ± std
  summary.md, summary.csv   per (method, sweep point): A_avg, A_T, F_T, upload bytes per client and
                            wall time per stage, mean ± std over seeds, next to the paper's numbers
  accuracy.png              accuracy over stages per method
  communication.png         upload bytes per client per stage per method (log scale)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.expconfig import (
    PAPER_METRICS,
    Experiment,
    ExperimentConfigError,
    PlannedRun,
    load_experiment,
    point_label,
)
from experiments.progress import flower_progress
from experiments.sim import completed_results
from fcl_flower.config import ConfigError, RunConfig

MIB = 2**20
METRICS = ("A_avg", "A_T", "F_T")


# ----------------------------------------------------------------------------- running
def run_local(cfg: RunConfig) -> Path:
    """One run through the real ClientApp, in this process (no Ray)."""
    from experiments.sim import run_local as run_in_process

    return run_in_process(cfg).path


def run_ray(cfg: RunConfig, *, num_cpus: float, num_gpus: float | None, verbose: bool) -> Path:
    from experiments.sim import simulate

    return simulate(cfg, num_cpus=num_cpus, num_gpus=num_gpus, verbose=verbose)


def is_complete(path: Path, cfg: RunConfig) -> bool:
    """results.json of a finished run with this very config (for --skip-existing)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    from strategies.checkpoint import differing_keys

    return (
        data.get("status") == "completed"
        and not differing_keys(data.get("config", {}), cfg.result_config())
        and len(data.get("stages", [])) == cfg.num_tasks
    )


@dataclass
class RunOutcome:
    run: PlannedRun
    path: Path | None
    seconds: float
    error: str = ""
    rounds_seen: int = 0


def execute(
    runs: Sequence[PlannedRun],
    *,
    engine: str,
    num_cpus: float = 1.0,
    num_gpus: float | None = None,
    verbose: bool = False,
    skip_existing: bool = False,
    show_progress: bool = True,
    on_start: Callable[[PlannedRun], None] | None = None,
) -> list[RunOutcome]:
    """Run every planned run in turn; a failed run is recorded and the others still run. After
    Ctrl-C (experiments/interrupt.py) the run in progress is not recorded and no other starts."""
    from tqdm import tqdm

    from fcl_flower.interrupt import RunInterrupted, stop_requested

    outcomes: list[RunOutcome] = []
    runs_bar = tqdm(
        total=len(runs), desc="runs", position=0, disable=None if show_progress else True, dynamic_ncols=True
    )
    stage_bar = tqdm(
        total=1, desc="stages", position=1, leave=False, disable=None if show_progress else True, dynamic_ncols=True
    )
    try:
        for run in runs:
            runs_bar.set_postfix_str(run.name, refresh=True)
            stage_bar.reset(total=run.cfg.num_tasks)
            path = run.cfg.output_dir / "results.json"
            began = time.perf_counter()
            if on_start is not None:
                on_start(run)
            if skip_existing and path.exists() and is_complete(path, run.cfg):
                outcomes.append(RunOutcome(run, path, 0.0))
                runs_bar.update(1)
                continue
            with flower_progress(stage_bar, verbose) as handler:
                try:
                    if engine == "local":
                        run_local(run.cfg)
                    else:
                        run_ray(run.cfg, num_cpus=num_cpus, num_gpus=num_gpus, verbose=verbose)
                    path = completed_results(run.cfg)
                    error = ""
                except RunInterrupted:  # Ctrl-C in a run of this process (--engine local)
                    break
                except (ConfigError, ValueError) as err:
                    error = f"{type(err).__name__}: {err}"
                except Exception as err:  # keep going: one broken method must not lose the others
                    error = f"{type(err).__name__}: {err}"
                    if verbose and not stop_requested():
                        traceback.print_exc()
            if stop_requested():
                break
            outcome = RunOutcome(run, None if error else path, time.perf_counter() - began, error, handler.rounds)
            if error:
                tqdm.write(f"run {run.name} failed: {error}", file=sys.stderr)
            outcomes.append(outcome)
            runs_bar.update(1)
    finally:
        stage_bar.close()
        runs_bar.close()
    return outcomes


# ----------------------------------------------------------------------------- summarising
def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single run); NaNs are skipped."""
    finite = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not finite:
        return math.nan, math.nan
    mean = sum(finite) / len(finite)
    if len(finite) < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in finite) / (len(finite) - 1)
    return mean, math.sqrt(var)


def _mean_over_clients(per_client: dict[str, int]) -> float:
    return sum(per_client.values()) / len(per_client) if per_client else 0.0


def run_row(run: PlannedRun, data: dict[str, Any]) -> dict[str, Any]:
    """The per-run numbers the summary averages over seeds."""
    stages = data["stages"]
    uploads = [_mean_over_clients(s["upload_bytes_per_client"]) for s in stages]
    seconds = [float(s["seconds"]) for s in stages]
    later = stages[1:]
    return {
        "strategy": run.strategy,
        **dict(run.point),
        "seed": run.seed,
        "run": run.name,
        "A_avg": float(data["A_avg"]),
        "A_T": float(data["A_T"]),
        "F_T": float(data["F_T"]),
        "upload_mib_per_client": sum(uploads) / MIB,
        "upload_mib_per_client_stage_after1": (sum(uploads[1:]) / len(later) / MIB) if later else math.nan,
        "stage1_seconds": seconds[0],
        "seconds_per_stage_after1": (sum(seconds[1:]) / len(later)) if later else math.nan,
        "total_seconds": sum(seconds),
        "stage_accuracy": [float(s["accuracy"]) for s in stages],
        "stage_upload_bytes": uploads,
        "stage_seconds": seconds,
    }


SUMMARY_FIELDS = (
    "A_avg",
    "A_T",
    "F_T",
    "upload_mib_per_client",
    "upload_mib_per_client_stage_after1",
    "stage1_seconds",
    "seconds_per_stage_after1",
    "total_seconds",
)


def group_rows(rows: Sequence[dict[str, Any]], sweep_keys: Sequence[str]) -> list[dict[str, Any]]:
    """Mean ± std over seeds of every summary field, per (strategy, sweep point), in first-seen order."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["strategy"], *(row[k] for k in sweep_keys)), []).append(row)
    out = []
    for key, members in groups.items():
        summary: dict[str, Any] = {
            "strategy": key[0],
            **dict(zip(sweep_keys, key[1:])),
            "seeds": " ".join(str(m["seed"]) for m in members),
            "runs": len(members),
        }
        for name in SUMMARY_FIELDS:
            summary[f"{name}_mean"], summary[f"{name}_std"] = mean_std([m[name] for m in members])
        summary["stages"] = stage_curves(members)
        out.append(summary)
    return out


def stage_curves(members: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Per stage: accuracy, upload bytes per client and seconds, mean ± std over the seeds."""
    num = min(len(m["stage_accuracy"]) for m in members)
    curves = []
    for t in range(num):
        entry: dict[str, float] = {"stage": t + 1}
        for name, column in (
            ("accuracy", "stage_accuracy"),
            ("upload_bytes", "stage_upload_bytes"),
            ("seconds", "stage_seconds"),
        ):
            entry[f"{name}_mean"], entry[f"{name}_std"] = mean_std([m[column][t] for m in members])
        curves.append(entry)
    return curves


def paper_match(experiment: Experiment, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The paper row for this (strategy, sweep point): same strategy, and every run-config key the
    row names equal to this run's value."""
    for row in experiment.paper_rows():
        if row.get("strategy") != summary["strategy"]:
            continue
        cfg = experiment.config_for(
            summary["strategy"], experiment.seeds[0], tuple((k, summary[k]) for k in experiment.sweep_keys)
        ).to_mapping()
        if all(
            cfg.get(k) == _coerce_like(cfg.get(k), v)
            for k, v in row.items()
            if k not in PAPER_METRICS and k not in ("method", "note", "strategy")
        ):
            return row
    return None


def _coerce_like(reference: Any, value: Any) -> Any:
    try:
        return type(reference)(value) if reference is not None else value
    except (TypeError, ValueError):
        return value


def fmt(mean: float, std: float, runs: int, digits: int = 2) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if runs > 1 else f"{mean:.{digits}f}"


def write_tables(
    out: Path,
    experiment: Experiment,
    rows: list[dict[str, Any]],
    groups: list[dict[str, Any]],
    failures: Sequence[RunOutcome],
    engine: str,
) -> None:
    sweep_keys = list(experiment.sweep_keys)
    # The paper's numbers go next to ours in the offline (digits) variant too: its absolute numbers
    # are not comparable (another dataset and backbone), but the trend is (e.g. what noise costs).
    with_paper = bool(experiment.paper_rows())
    # runs.csv: the raw per-run numbers
    run_fields = ["strategy", *sweep_keys, "seed", "run", *SUMMARY_FIELDS]
    with open(out / "runs.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=run_fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    # stages.csv: the curves behind the plots
    with open(out / "stages.csv", "w", newline="") as handle:
        fields = [
            "strategy",
            *sweep_keys,
            "stage",
            "accuracy_mean",
            "accuracy_std",
            "upload_bytes_mean",
            "upload_bytes_std",
            "seconds_mean",
            "seconds_std",
        ]
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for g in groups:
            for entry in g["stages"]:
                writer.writerow({"strategy": g["strategy"], **{k: g[k] for k in sweep_keys}, **entry})
    # summary.csv
    fields = ["strategy", *sweep_keys, "runs", "seeds"]
    for name in SUMMARY_FIELDS:
        fields += [f"{name}_mean", f"{name}_std"]
    if with_paper:
        fields += [f"paper_{m}" for m in PAPER_METRICS]
    with open(out / "summary.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for g in groups:
            paper = paper_match(experiment, g) if with_paper else None
            writer.writerow({**g, **{f"paper_{m}": (paper or {}).get(m, "") for m in PAPER_METRICS}})
    # summary.md
    head = [
        "method",
        *sweep_keys,
        "seeds",
        "A_avg %",
        "A_T %",
        "F_T %",
        "upload/client MiB",
        "upload/client/stage t≥2 MiB",
        "stage 1 s",
        "s/stage t≥2",
        "total s",
    ]
    if with_paper:
        setting = " (full setting)" if experiment.offline else ""
        head += [f"paper A_avg{setting}", f"paper A_T{setting}", f"paper F_T{setting}", f"paper MiB{setting}"]
    lines = [
        f"# {experiment.name}{' (offline variant)' if experiment.offline else ''}",
        "",
        experiment.description,
        "",
        f"Engine: `{engine}`. Mean ± sample std over seeds. Upload: numeric payload per client, mean over "
        "clients (all rounds; stage 1 includes its FedAvg rounds). Wall time per stage includes client work, "
        "aggregation, solve and evaluation.",
        "",
    ]
    if with_paper:
        source = experiment.paper.get("source", "")
        lines += [f"Paper numbers: {source}.", ""]
        if experiment.offline:
            lines += [
                "This is the offline variant (digits, small settings): the paper's numbers are those of the full "
                "setting, shown for the trend across the sweep (e.g. what noise costs), not to compare absolute values.",
                "",
            ]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        n = g["runs"]
        cells = [
            g["strategy"],
            *(str(g[k]) for k in sweep_keys),
            g["seeds"],
            fmt(g["A_avg_mean"], g["A_avg_std"], n),
            fmt(g["A_T_mean"], g["A_T_std"], n),
            fmt(g["F_T_mean"], g["F_T_std"], n),
            fmt(g["upload_mib_per_client_mean"], g["upload_mib_per_client_std"], n, 3),
            fmt(g["upload_mib_per_client_stage_after1_mean"], g["upload_mib_per_client_stage_after1_std"], n, 3),
            fmt(g["stage1_seconds_mean"], g["stage1_seconds_std"], n, 1),
            fmt(g["seconds_per_stage_after1_mean"], g["seconds_per_stage_after1_std"], n, 2),
            fmt(g["total_seconds_mean"], g["total_seconds_std"], n, 1),
        ]
        if with_paper:
            paper = paper_match(experiment, g) or {}
            cells += [str(paper.get(m, "–")) for m in ("A_avg", "A_T", "F_T", "upload_mib")]
        lines.append("| " + " | ".join(cells) + " |")
    if failures:
        lines += ["", "Failed runs:", ""] + [f"- `{f.run.name}`: {f.error}" for f in failures]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def write_plots(out: Path, experiment: Experiment, groups: list[dict[str, Any]]) -> list[Path]:
    """accuracy.png and communication.png: one panel per sweep point, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep_keys = list(experiment.sweep_keys)
    points: dict[str, list[dict[str, Any]]] = {}
    for g in groups:
        points.setdefault(point_label(tuple((k, g[k]) for k in sweep_keys)), []).append(g)
    written = []
    for filename, column, ylabel, log in (
        ("accuracy.png", "accuracy", "accuracy on seen classes (%)", False),
        ("communication.png", "upload_bytes", "upload bytes per client", True),
    ):
        cols = min(3, len(points))
        nrows = math.ceil(len(points) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
        for ax, (label, members) in zip(axes.flat, points.items()):
            for g in members:
                x = [e["stage"] for e in g["stages"]]
                y = [e[f"{column}_mean"] for e in g["stages"]]
                s = [e[f"{column}_std"] for e in g["stages"]]
                (line,) = ax.plot(x, y, marker="o", label=g["strategy"])
                if g["runs"] > 1:
                    ax.fill_between(
                        x,
                        [a - b for a, b in zip(y, s)],
                        [a + b for a, b in zip(y, s)],
                        color=line.get_color(),
                        alpha=0.15,
                    )
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("stage")
            ax.set_ylabel(ylabel)
            ax.set_title(label or experiment.name, fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(points) :]:
            ax.axis("off")
        fig.suptitle(experiment.name + (" (offline)" if experiment.offline else ""), fontsize=10)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
        written.append(out / filename)
    return written


def summarise_outcomes(
    out: Path, experiment: Experiment, outcomes: Sequence[RunOutcome], engine: str
) -> list[dict[str, Any]]:
    rows = [run_row(o.run, json.loads(o.path.read_text())) for o in outcomes if o.path is not None]
    groups = group_rows(rows, experiment.sweep_keys)
    failures = [o for o in outcomes if o.error]
    write_tables(out, experiment, rows, groups, failures, engine)
    if groups:
        write_plots(out, experiment, groups)
    return groups


# ----------------------------------------------------------------------------- CLI
def parse_set(items: Sequence[str]) -> dict[str, str]:
    """``--set key=value`` pairs (run-config keys; values are coerced by RunConfig)."""
    values = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ExperimentConfigError(f"--set expects key=value, got '{item}'")
        values[key.strip()] = value.strip()
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--config", required=True, help="experiments/configs/<name>.toml, or just <name>")
    parser.add_argument("--offline", action="store_true", help="Run the config's small [offline] variant (digits).")
    parser.add_argument("--seeds", type=int, nargs="+", help="Override the config's seeds.")
    parser.add_argument("--strategies", nargs="+", help="Override the config's strategies.")
    parser.add_argument("--out", help="Output folder (default ~/fcl-flower-results/compare/<config>[-offline]).")
    parser.add_argument(
        "--engine",
        choices=("ray", "local"),
        default="ray",
        help="ray: Flower's Ray simulation (sim.py); local: same apps in this process.",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="Extra run-config values for every run, e.g. data-root=/data device=cuda.",
    )
    parser.add_argument("--num-cpus", type=float, default=1.0, help="Ray: CPU cores per simulated client.")
    parser.add_argument(
        "--num-gpus",
        type=float,
        default=None,
        help="Ray: GPU share per simulated client (default: sim.py's, the visible GPUs shared evenly by the clients).",
    )
    parser.add_argument(
        "--skip-existing", action="store_true", help="Reuse finished runs whose results.json has the same config."
    )
    parser.add_argument("--dry-run", action="store_true", help="List the runs and exit.")
    parser.add_argument("--verbose", action="store_true", help="Show Flower's log lines.")
    parser.add_argument("--no-progress", action="store_true", help="No progress bars.")
    return parser


def main(argv: list[str] | None = None, *, on_done: Callable[[Path], None] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        experiment = load_experiment(args.config, offline=args.offline)
        suffix = "-offline" if args.offline else ""
        out = (
            Path(args.out or Path("~/fcl-flower-results/compare") / f"{experiment.name}{suffix}").expanduser().resolve()
        )
        runs = experiment.runs(strategies=args.strategies, seeds=args.seeds, out=out, extra=parse_set(args.set))
        from fcl_flower import methods

        unavailable = sorted({r.strategy for r in runs} - set(methods.names()))
        if unavailable:
            raise ExperimentConfigError(
                f"strategy not available yet: {', '.join(unavailable)}; available: {', '.join(sorted(methods.names()))}"
            )
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        for run in runs:
            print(run.name)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    print(f"{experiment.name}: {len(runs)} run(s) -> {out}", file=sys.stderr)
    from experiments.interrupt import compare_line, sigint_stops

    started: list[PlannedRun] = []
    argv = sys.argv[1:] if argv is None else argv
    with sigint_stops(lambda: compare_line([r.cfg for r in started], len(runs), argv)) as stop:
        outcomes = execute(
            runs,
            engine=args.engine,
            num_cpus=args.num_cpus,
            num_gpus=args.num_gpus,
            verbose=args.verbose,
            skip_existing=args.skip_existing,
            show_progress=not args.no_progress,
            on_start=started.append,
        )
        if stop.happened:  # no summary of a partial comparison: the one line says how to go on
            stop.end_children()
            return stop.say()
    summarise_outcomes(out, experiment, outcomes, args.engine)
    print((out / "summary.md").read_text())
    if on_done is not None:
        on_done(out)
    failed = [o for o in outcomes if o.error]
    if failed:
        print(f"{len(failed)} of {len(outcomes)} run(s) failed; see summary.md", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
