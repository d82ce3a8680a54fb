"""Named experiment configs (``experiments/configs/*.toml``): load, validate, expand into runs.

One file per paper table or ablation (the schema is documented in experiments/configs/README.md):

    description = "..."
    strategies = ["stsa", "stsa-e"]
    seeds = [0, 1, 2]
    [run]                         # RunConfig keys, exactly the run-config keys of pyproject.toml
    [sweep]                       # optional: key = [values]; Cartesian product, or zipped with zip = true
    [strategy-overrides.<name>]   # optional: RunConfig keys for one strategy only; a swept key
                                  #   pins that strategy to the sweep points with its value
    [paper]                       # the paper's numbers, for the README and the summary table
    [offline]                     # the small variant on digits: overrides of all of the above

Every run a file expands to goes through :class:`fcl_flower.config.RunConfig`, so a misspelt
key fails at load time with one line, not hours into a run.
"""

from __future__ import annotations

import itertools
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fcl_flower.config import ConfigError, RunConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
TOP_LEVEL = {"description", "strategies", "seeds", "run", "sweep", "strategy-overrides", "paper", "offline"}
OFFLINE_KEYS = {"description", "strategies", "seeds", "run", "sweep", "strategy-overrides"}
PAPER_METRICS = ("A_avg", "A_T", "F_T", "upload_mib", "seconds")
METRIC_PERCENT = ("A_avg", "A_T", "F_T")
#: Keys the harness owns: the strategy and seed come from ``strategies``/``seeds``, the folders
#: from ``--out`` and the run's own name.
RESERVED = {"strategy", "seed", "out", "run-name", "resume"}


class ExperimentConfigError(ConfigError):
    """An experiment file that cannot work; one line naming the file."""


@dataclass(frozen=True)
class PlannedRun:
    """One (strategy, sweep point, seed) of an experiment, with its validated RunConfig."""

    strategy: str
    seed: int
    point: tuple[tuple[str, Any], ...]  # the sweep values of this run, in sweep-key order
    cfg: RunConfig

    @property
    def name(self) -> str:
        return self.cfg.run_name

    @property
    def point_label(self) -> str:
        return point_label(self.point)


@dataclass(frozen=True)
class Experiment:
    """A loaded experiment file (offline overrides already applied when ``offline``)."""

    name: str
    path: Path
    description: str
    offline: bool
    strategies: tuple[str, ...]
    seeds: tuple[int, ...]
    run: dict[str, Any]
    sweep: dict[str, list[Any]]
    sweep_zip: bool
    strategy_overrides: dict[str, dict[str, Any]]
    paper: dict[str, Any] = field(default_factory=dict)

    @property
    def sweep_keys(self) -> tuple[str, ...]:
        return tuple(self.sweep)

    def points(self) -> list[tuple[tuple[str, Any], ...]]:
        """The sweep points, each a tuple of (key, value); one empty point without a sweep."""
        keys = list(self.sweep)
        if not keys:
            return [()]
        values = [self.sweep[k] for k in keys]
        combos = zip(*values) if self.sweep_zip else itertools.product(*values)
        return [tuple(zip(keys, combo)) for combo in combos]

    def config_for(
        self,
        strategy: str,
        seed: int,
        point: tuple[tuple[str, Any], ...] = (),
        *,
        out: str | Path | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> RunConfig:
        """The RunConfig of one run: run → strategy overrides → extra → sweep point."""
        values: dict[str, Any] = dict(self.run)
        values.update(self.strategy_overrides.get(strategy, {}))
        values.update(extra or {})
        values.update(dict(point))
        values.update(strategy=strategy, seed=seed)
        values["run-name"] = run_name(strategy, values.get("dataset", RunConfig.dataset), seed, point)
        if out is not None:
            values["out"] = str(out)
        try:
            return RunConfig.from_mapping(values)
        except ConfigError as err:
            raise ExperimentConfigError(f"{self.path.name}: {strategy} {point_label(point)}: {err}") from None

    def runs_at(self, strategy: str, point: tuple[tuple[str, Any], ...]) -> bool:
        """Whether ``strategy`` runs at sweep ``point``: a strategy override of a swept key pins the
        strategy to the points where the key has the override's value (e.g. STSA's noise-on in
        the Table 7 grid, whose STSA-E columns sweep it)."""
        pinned = self.strategy_overrides.get(strategy, {})
        return all(_same(pinned[key], value) for key, value in point if key in pinned)

    def runs(
        self,
        *,
        strategies: Sequence[str] | None = None,
        seeds: Sequence[int] | None = None,
        out: str | Path | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> list[PlannedRun]:
        """Every run, sweep point by sweep point, then strategy, then seed."""
        chosen = tuple(strategies) if strategies else self.strategies
        chosen_seeds = tuple(int(s) for s in seeds) if seeds else self.seeds
        return [
            PlannedRun(strategy, seed, point, self.config_for(strategy, seed, point, out=out, extra=extra))
            for point in self.points()
            for strategy in chosen
            if self.runs_at(strategy, point)
            for seed in chosen_seeds
        ]

    def paper_rows(self) -> list[dict[str, Any]]:
        return list(self.paper.get("rows", []))


def _same(a: Any, b: Any) -> bool:
    """Equal as config values (1 and 1.0 alike)."""
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))
    if numbers:
        return float(a) == float(b)
    return bool(a == b)


def run_name(strategy: str, dataset: str, seed: int, point: tuple[tuple[str, Any], ...] = ()) -> str:
    """``<strategy>-<dataset>[-<key><value>...]-seed<seed>``: one folder per run."""
    parts = [strategy, dataset] + [f"{k}{_short(v)}" for k, v in point] + [f"seed{seed}"]
    return "-".join(parts)


def point_label(point: tuple[tuple[str, Any], ...]) -> str:
    return " ".join(f"{k}={_short(v)}" for k, v in point)


def _short(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}" if abs(value) >= 1e6 else str(value)
    return str(value)


def config_paths(directory: Path = CONFIG_DIR) -> list[Path]:
    return sorted(directory.glob("*.toml"))


def load_experiment(path: str | Path, *, offline: bool = False) -> Experiment:
    """Read and validate ``path``; ``offline`` applies its ``[offline]`` table.

    Every run of the chosen variant is built once here, so any bad key or value fails now.
    """
    path = Path(path)
    if not path.exists() and not path.suffix:
        path = CONFIG_DIR / f"{path}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ExperimentConfigError(f"no experiment config at {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise ExperimentConfigError(f"{path.name}: not valid TOML: {err}") from None
    where = path.name
    _only(data, TOP_LEVEL, where)
    if offline:
        if "offline" not in data:
            raise ExperimentConfigError(f"{where}: has no [offline] table")
        _only(data["offline"], OFFLINE_KEYS, f"{where} [offline]")
    off = data.get("offline", {}) if offline else {}

    offline_run = _run_table(off.get("run", {}), f"{where} [offline]")
    run = {**_run_table(data.get("run", {}), where), **offline_run}
    overrides = _overrides(data.get("strategy-overrides", {}), where)
    for values in overrides.values():  # layers: run < strategy-overrides < offline.run < offline.strategy-overrides
        for key in offline_run:
            values.pop(key, None)
    for strategy, values in _overrides(off.get("strategy-overrides", {}), f"{where} [offline]").items():
        overrides[strategy] = {**overrides.get(strategy, {}), **values}
    sweep_table = off["sweep"] if "sweep" in off else data.get("sweep", {})
    sweep, sweep_zip = _sweep(sweep_table, where)
    strategies = _string_list(off.get("strategies", data.get("strategies")), "strategies", where)
    seeds = _int_list(off.get("seeds", data.get("seeds", [0])), "seeds", where)
    experiment = Experiment(
        name=path.stem,
        path=path,
        description=str(off.get("description", data.get("description", ""))),
        offline=offline,
        strategies=tuple(strategies),
        seeds=tuple(seeds),
        run=run,
        sweep=sweep,
        sweep_zip=sweep_zip,
        strategy_overrides=overrides,
        paper=_paper(data.get("paper", {}), where),
    )
    for name, values in overrides.items():
        if name not in strategies:
            raise ExperimentConfigError(f"{where}: [strategy-overrides.{name}] names a strategy not in 'strategies'")
        for key in set(values) & set(sweep):
            if not any(_same(values[key], v) for v in sweep[key]):
                raise ExperimentConfigError(
                    f"{where}: [strategy-overrides.{name}] pins {key} = {values[key]!r}, a value the sweep never takes"
                )
    experiment.runs()  # validates every run
    return experiment


# ------------------------------------------------------------------------ validation helpers
def _only(table: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ExperimentConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )


def _run_table(table: Any, where: str) -> dict[str, Any]:
    if not isinstance(table, Mapping):
        raise ExperimentConfigError(f"{where}: [run] must be a table of run-config keys")
    reserved = sorted(set(table) & RESERVED)
    if reserved:
        raise ExperimentConfigError(
            f"{where}: {', '.join(reserved)} may not be set in [run] (use 'strategies', 'seeds' and --out)"
        )
    try:
        # unknown keys and bad values, with the key's name; the strategy comes from 'strategies', so
        # a placeholder that runs under every partition stands in (each run is validated in full)
        RunConfig.from_mapping({**dict(table), "strategy": "finetune"})
    except ConfigError as err:
        raise ExperimentConfigError(f"{where}: {err}") from None
    return dict(table)


def _overrides(table: Any, where: str) -> dict[str, dict[str, Any]]:
    if not isinstance(table, Mapping):
        raise ExperimentConfigError(f"{where}: [strategy-overrides] must be a table of tables")
    return {str(name): _run_table(values, f"{where} [strategy-overrides.{name}]") for name, values in table.items()}


def _sweep(table: Any, where: str) -> tuple[dict[str, list[Any]], bool]:
    if not isinstance(table, Mapping):
        raise ExperimentConfigError(f"{where}: [sweep] must be a table")
    table = dict(table)
    zipped = table.pop("zip", False)
    if not isinstance(zipped, bool):
        raise ExperimentConfigError(f"{where}: [sweep] zip must be true or false")
    known = {RunConfig.key(f.name) for f in RunConfig.knobs()}
    sweep: dict[str, list[Any]] = {}
    for key, values in table.items():
        if key not in known:
            raise ExperimentConfigError(f"{where}: [sweep] unknown config key: {key}")
        if key in RESERVED:
            raise ExperimentConfigError(f"{where}: [sweep] may not sweep '{key}' (use 'strategies'/'seeds')")
        if not isinstance(values, list) or not values:
            raise ExperimentConfigError(f"{where}: [sweep] {key} must be a non-empty list")
        sweep[key] = values
    if zipped and len({len(v) for v in sweep.values()}) > 1:
        raise ExperimentConfigError(f"{where}: [sweep] zip = true needs lists of equal length")
    return sweep, zipped


def _string_list(values: Any, name: str, where: str) -> list[str]:
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise ExperimentConfigError(f"{where}: '{name}' must be a non-empty list of strategy names")
    return list(values)


def _int_list(values: Any, name: str, where: str) -> list[int]:
    if (
        not isinstance(values, list)
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    ):
        raise ExperimentConfigError(f"{where}: '{name}' must be a non-empty list of integers")
    return list(values)


def _paper(table: Any, where: str) -> dict[str, Any]:
    if not isinstance(table, Mapping):
        raise ExperimentConfigError(f"{where}: [paper] must be a table")
    allowed = {"source", "setting", "note", "rows"}
    _only(table, allowed, f"{where} [paper]")
    known = {RunConfig.key(f.name) for f in RunConfig.knobs()}
    for i, row in enumerate(table.get("rows", [])):
        if not isinstance(row, Mapping) or "method" not in row:
            raise ExperimentConfigError(f"{where}: [paper] rows[{i}] needs a 'method'")
        extra = sorted(set(row) - known - set(PAPER_METRICS) - {"method", "note"})
        if extra:
            raise ExperimentConfigError(
                f"{where}: [paper] rows[{i}] unknown key(s) {', '.join(extra)}; use run-config keys, "
                f"'method', 'note' or {', '.join(PAPER_METRICS)}"
            )
    return dict(table)


# ------------------------------------------------------------------------ README listing
def _metric_cell(row: Mapping[str, Any]) -> str:
    parts = []
    for name, label, unit in (
        ("A_avg", "A_avg ", ""),
        ("A_T", "A_T ", ""),
        ("F_T", "F_T ", ""),
        ("upload_mib", "", " MiB"),
        ("seconds", "", " s"),
    ):
        if name in row:
            value = row[name]
            parts.append(f"{label}{value:.2f}{unit}" if name in METRIC_PERCENT else f"{label}{value:g}{unit}")
    if row.get("note"):
        parts.append(f"({row['note']})")
    return ", ".join(parts) if parts else "–"


def paper_table_markdown(experiment: Experiment) -> str:
    """The paper rows as a markdown table; pivoted on the sweep key when the rows carry one."""
    rows = experiment.paper_rows()
    if not rows:
        return ""
    pivot = next((k for k in experiment.sweep_keys if all(k in r for r in rows)), None)
    if pivot is None or len(experiment.sweep_keys) != 1:
        keys = [k for k in experiment.sweep_keys if any(k in r for r in rows)]
        head = ["method", "ours", *keys, "paper"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += [
            "| "
            + " | ".join([r["method"], r.get("strategy", "–"), *(str(r.get(k, "")) for k in keys), _metric_cell(r)])
            + " |"
            for r in rows
        ]
        return "\n".join(lines)
    values = list(dict.fromkeys(r[pivot] for r in rows))
    head = ["method", "ours", *(f"{pivot} = {_short(v)}" for v in values)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        cells = [method, mine[0].get("strategy", "–")]
        for v in values:
            hit = next((r for r in mine if r[pivot] == v), None)
            cells.append(_metric_cell(hit) if hit else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_markdown(directory: Path = CONFIG_DIR) -> str:
    """The README section: every config, its commands and the paper's numbers."""
    out = []
    for path in config_paths(directory):
        full = load_experiment(path)
        offline = load_experiment(path, offline=True)
        rel = f"experiments/configs/{path.name}"
        out.append(f"### `{path.stem}`\n")
        out.append(full.description + "\n")
        out.append(f"- full ({len(full.runs())} runs): `python experiments/compare.py --config {rel}`")
        out.append(
            f"- offline ({len(offline.runs())} runs, digits): "
            f"`python experiments/compare.py --config {rel} --offline --engine local`"
        )
        if full.paper.get("source"):
            out.append(f"- paper: {full.paper['source']}")
        if full.paper.get("setting"):
            out.append(f"- setting: {full.paper['setting']}")
        if full.paper.get("note"):
            out.append(f"- note: {full.paper['note']}")
        table = paper_table_markdown(full)
        out.append("")
        if table:
            out.append(table + "\n")
    return "\n".join(out)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--readme"]:
        print(readme_markdown())
    else:
        for p in config_paths():
            exp = load_experiment(p)
            print(f"{p.stem}: {len(exp.runs())} runs; offline {len(load_experiment(p, offline=True).runs())} runs")
