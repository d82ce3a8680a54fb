"""Mutation testing of the core, on demand (not part of .ci/run): score per module, survivors listed.

    python -m experiments.mutation                       # every enabled module of experiments/mutation.toml
    python -m experiments.mutation --module fcl_flower/metrics.py --module fcl_flower/analytic/ridge.py
    python -m experiments.mutation --list                # modules, their tests, pending ones
    python -m experiments.mutation --include-pending     # also the modules marked pending
    python -m experiments.mutation --report-only         # re-score the last runs (after editing equivalents)
    python -m experiments.mutation --module M --merge    # replace M's entry in the report, keep the others

Each module is mutated on its own with mutmut (the ``dev`` extra), in a scratch copy of the
repository under ``.mutation/<module>/`` (gitignored): the copy's ``pyproject.toml`` gets a
``[tool.mutmut]`` table from the ``[mutmut]`` settings of the config plus ``only_mutate`` = the
module and ``pytest_add_cli_args_test_selection`` = the tests listed for it. mutmut first runs those
tests once to learn which test calls which function, then, per mutant, only the tests that call the
mutated function, in ``--jobs`` forked workers (default: 2, one torch thread each).

The JSON report (``--out``, default from the config) has, per module: the counts by outcome, the
score = (killed + timeout) / (mutants − equivalent − skipped) in percent, whether it meets the
threshold, the run time (when it finished, the load average before and after: the machine may be
shared), every surviving (or untested, or suspicious) mutant with ``file:line``, the
line before and after the mutation and mutmut's name for it, and the equivalent mutants with the
one-line reason from the equivalents file. An equivalents entry matches a survivor by module,
function and the exact code before/after (not by mutmut's numbering, which shifts whenever a
function changes); entries that match nothing are reported as ``stale_equivalents``.

Exit status: 0 when every module run meets the threshold, 1 otherwise, 2 on a setup error.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "experiments" / "mutation.toml"
SCRATCH = ROOT / ".mutation"
COPIED = ("fcl_flower", "strategies", "clients", "experiments", "tests", "pyproject.toml")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "mutants")

# mutmut's exit codes per mutant (mutmut/stats.py), folded into the outcomes the report counts.
OUTCOME_BY_EXIT_CODE = {
    1: "killed",
    3: "killed",  # pytest internal error under the mutant: the mutant is detected
    0: "survived",
    5: "no_tests",
    33: "no_tests",
    34: "skipped",
    36: "timeout",
    24: "timeout",
    -24: "timeout",
    152: "timeout",
    255: "timeout",
    37: "killed",  # caught by the type checker (not configured here)
    -11: "killed",  # the mutant crashed the interpreter: detected
    -9: "killed",
    None: "not_checked",
}
DETECTED = ("killed", "timeout")
LISTED = ("survived", "no_tests", "suspicious", "not_checked")

# Run inside the scratch copy: mutmut's own diff of each named mutant, as JSON on stdout.
_DIFF_SCRIPT = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
path, names = sys.argv[1], sys.argv[2:]
out = {}
for name in names:
    try:
        out[name] = get_diff_for_mutant(name, path=path)
    except Exception as exc:  # a mutant mutmut cannot show: keep the name, say why
        out[name] = f"(no diff: {type(exc).__name__}: {exc})"
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Module:
    path: str
    tests: tuple[str, ...]
    pending: str | None = None

    @property
    def slug(self) -> str:
        return self.path.removesuffix(".py").replace("/", "__")

    @property
    def dotted(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")


@dataclass(frozen=True)
class Equivalent:
    module: str
    function: str
    before: str
    after: str
    why: str
    host: str = "any"  # "cpu-only": tells apart only with CUDA inputs; not excluded where CUDA exists


@dataclass
class Config:
    threshold: float
    module_timeout_s: float
    report: Path
    equivalent: Path
    mutmut: dict[str, Any]
    modules: list[Module] = field(default_factory=list)


class SetupError(RuntimeError):
    """The config, a test path or the scratch copy is wrong: nothing was measured."""


# --------------------------------------------------------------------------------------- config
def load_config(path: Path) -> Config:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    settings = data.get("settings", {})
    modules = []
    for entry in data.get("module", []):
        if not isinstance(entry.get("path"), str) or not entry.get("tests"):
            raise SetupError(f"{path}: every [[module]] needs a path and a non-empty tests list, got {entry!r}")
        modules.append(Module(entry["path"], tuple(entry["tests"]), entry.get("pending")))
    paths = [m.path for m in modules]
    if len(set(paths)) != len(paths):
        raise SetupError(f"{path}: a module is listed twice")
    mutmut = dict(data.get("mutmut", {}))
    for key in ("only_mutate", "pytest_add_cli_args_test_selection"):
        if key in mutmut:
            raise SetupError(f"{path}: [mutmut] must not set {key}: the runner sets it per module")
    return Config(
        threshold=float(settings.get("threshold", 90.0)),
        module_timeout_s=float(settings.get("module_timeout_s", 1800)),
        report=ROOT / settings.get("report", "experiments/results/mutation.json"),
        equivalent=ROOT / settings.get("equivalent", "experiments/mutation_equivalent.toml"),
        mutmut=mutmut,
        modules=modules,
    )


def load_equivalents(path: Path) -> list[Equivalent]:
    if not path.exists():
        return []
    entries = tomllib.loads(path.read_text(encoding="utf-8")).get("equivalent", [])
    out = []
    for entry in entries:
        missing = [k for k in ("module", "function", "before", "after", "why") if not entry.get(k, "").strip()]
        if missing:
            raise SetupError(f"{path}: equivalent entry {entry!r} lacks {', '.join(missing)}")
        host = entry.get("host", "any")
        if host not in ("any", "cpu-only"):
            raise SetupError(f"{path}: equivalent entry {entry!r}: host must be 'any' or 'cpu-only'")
        fields = {k: entry[k].strip() for k in ("module", "function", "before", "after", "why")}
        out.append(Equivalent(**fields, host=host))
    return out


def cuda_available() -> bool:
    """Whether the tests can put tensors on a CUDA device (then "cpu-only" equivalents must be killed)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise SetupError(f"unsupported [mutmut] value {value!r}")


def mutmut_table(cfg: Config, module: Module, tests: list[str]) -> str:
    settings = {**cfg.mutmut, "only_mutate": [module.path], "pytest_add_cli_args_test_selection": tests}
    return "\n[tool.mutmut]\n" + "".join(f"{key} = {_toml_value(value)}\n" for key, value in settings.items())


# --------------------------------------------------------------------------------------- one module
def prepare_scratch(cfg: Config, module: Module) -> tuple[Path, list[str]]:
    """A fresh copy of the repository with the module's [tool.mutmut]; the test paths that exist."""
    if not (ROOT / module.path).is_file():
        raise SetupError(f"module {module.path} does not exist")
    tests = []
    for test in module.tests:
        if (ROOT / test.split("::")[0]).exists():
            tests.append(test)
        else:
            print(f"  warning: {module.path}: test path {test} does not exist, skipped", file=sys.stderr)
    if not tests:
        raise SetupError(f"{module.path}: none of its test paths exists")
    work = SCRATCH / module.slug
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, work / name, ignore=IGNORED)
        else:
            shutil.copy2(source, work / name)
    pyproject = (work / "pyproject.toml").read_text(encoding="utf-8")
    if "[tool.mutmut]" in pyproject:
        raise SetupError("pyproject.toml has its own [tool.mutmut]; the runner owns that table (move it to the config)")
    (work / "pyproject.toml").write_text(pyproject + mutmut_table(cfg, module, tests), encoding="utf-8")
    return work, tests


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the scratch copy's mutants/ must be what the tests import
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"  # one thread per forked worker: 2 workers on 2 cores, no oversubscription
    env["PYTHONHASHSEED"] = "0"
    env.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    return env


def run_mutmut(work: Path, jobs: int, timeout_s: float, log: Path) -> int:
    command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)]
    with log.open("w", encoding="utf-8") as out:
        process = subprocess.Popen(command, cwd=work, env=_environment(), stdout=out, stderr=subprocess.STDOUT)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            return -1


def read_outcomes(work: Path, module: Module) -> dict[str, str]:
    meta = work / "mutants" / (module.path + ".meta")
    if not meta.exists():
        return {}
    codes = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
    return {name: OUTCOME_BY_EXIT_CODE.get(code, "suspicious") for name, code in codes.items()}


def mutant_diffs(work: Path, module: Module, names: list[str]) -> dict[str, str]:
    if not names:
        return {}
    result = subprocess.run(
        [sys.executable, "-c", _DIFF_SCRIPT, module.path, *names],
        cwd=work,
        env=_environment(),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        return {name: f"(no diff: {result.stderr.strip().splitlines()[-1:]})" for name in names}
    return json.loads(result.stdout)


# --------------------------------------------------------------------------------------- mutants
def function_of(mutant: str) -> str:
    """``pkg.mod.x_fn__mutmut_3`` -> ``fn``; ``pkg.mod.xǁClsǁmeth__mutmut_3`` -> ``Cls.meth``."""
    mangled = mutant.rpartition(".")[2].partition("__mutmut_")[0]
    if "ǁ" in mangled:
        _, cls, method = mangled.split("ǁ", 2)
        return f"{cls}.{method}"
    return mangled.removeprefix("x_")


def _function_lines(source: str) -> dict[str, tuple[int, int]]:
    """Qualified function name -> (first line incl. decorators, last line), 1-based."""
    spans: dict[str, tuple[int, int]] = {}

    def visit(nodes: list[ast.stmt], prefix: str) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                spans[prefix + node.name] = (first, node.end_lineno or node.lineno)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".")

    visit(ast.parse(source).body, "")
    return spans


def describe(diff: str, source_lines: list[str], span: tuple[int, int] | None) -> dict[str, Any]:
    """The changed code of a mutmut diff and the line of the original file it is on."""
    removed = [line[1:] for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    before = " / ".join(line.strip() for line in removed)
    after = " / ".join(line.strip() for line in added)
    line_no = None
    if removed and span is not None:
        first, last = span
        target = removed[0].strip()
        hits = [i + 1 for i in range(first - 1, min(last, len(source_lines))) if source_lines[i].strip() == target]
        line_no = hits[0] if len(hits) == 1 else None
        if len(hits) > 1:  # the same text twice in one function: use the hunk offset to choose
            offset = _hunk_offset(diff)
            line_no = min(hits, key=lambda h: abs(h - (first + offset))) if offset is not None else hits[0]
    return {"line": line_no, "before": before, "after": after}


def _hunk_offset(diff: str) -> int | None:
    """Offset of the first removed line from the function's first line, from the unified diff."""
    position = None
    for line in diff.splitlines():
        if line.startswith("@@"):
            position = int(line.split()[1].split(",")[0].lstrip("-")) - 1
            continue
        if position is None or line.startswith(("---", "+++")):
            continue
        if line.startswith("-"):
            return position
        if not line.startswith("+"):
            position += 1
    return None


def run_module(
    cfg: Config, module: Module, equivalents: list[Equivalent], jobs: int, report_only: bool = False
) -> dict[str, Any]:
    """Mutate one module (or, with ``report_only``, re-read its last run) and score it."""
    work = SCRATCH / module.slug
    log = work / "mutmut.log"
    if report_only:  # the last run's outcomes, scored with the current equivalents file
        if not (work / "run.json").exists():
            raise SetupError(f"{module.path}: no finished run under {work.relative_to(ROOT)} to report on")
        run_file = work / "run.json"
        run = json.loads(run_file.read_text(encoding="utf-8"))
        run.setdefault("finished", _utc(run_file.stat().st_mtime))  # runs recorded before "finished" existed
    else:
        started, load_before = time.monotonic(), _load()
        work, tests = prepare_scratch(cfg, module)
        code = run_mutmut(work, jobs, cfg.module_timeout_s, log)
        run = {
            "exit_code": code,
            "seconds": round(time.monotonic() - started, 1),
            "tests": tests,
            "finished": _utc(time.time()),
            "jobs": jobs,
            "load_avg_before": load_before,  # 1/5/15-minute load: the machine is shared
            "load_avg_after": _load(),
        }
        (work / "run.json").write_text(json.dumps(run), encoding="utf-8")
    code, tests = run["exit_code"], run["tests"]
    outcomes = read_outcomes(work, module)
    result: dict[str, Any] = {
        "module": module.path,
        "tests": tests,
        **{k: run[k] for k in ("seconds", "finished", "jobs", "load_avg_before", "load_avg_after") if k in run},
        "log": str(log.relative_to(ROOT)),
    }
    if code != 0 or not outcomes:
        tail = log.read_text(encoding="utf-8", errors="replace")[-2000:] if log.exists() else ""
        why = "timed out" if code == -1 else f"mutmut exited {code}"
        result.update(error=f"{why}; see {result['log']}", log_tail=tail, score=None, meets_threshold=False)
        return result

    source = (ROOT / module.path).read_text(encoding="utf-8")
    lines, spans = source.splitlines(), _function_lines(source)
    listed = sorted(name for name, outcome in outcomes.items() if outcome in LISTED)
    diffs = mutant_diffs(work, module, listed)
    mine = [e for e in equivalents if e.module == module.path]  # already filtered for this host
    used: set[int] = set()
    survivors, equivalent = [], []
    for name in listed:
        function = function_of(name)
        info = describe(diffs.get(name, ""), lines, spans.get(function))
        entry = {
            "mutant": name,
            "outcome": outcomes[name],
            "function": function,
            "location": f"{module.path}:{info['line'] if info['line'] is not None else '?'}",
            "before": info["before"],
            "after": info["after"],
        }
        match = next(
            (
                i
                for i, e in enumerate(mine)
                if e.function == function and e.before == info["before"] and e.after == info["after"]
            ),
            None,
        )
        if match is not None and outcomes[name] == "survived":
            used.add(match)
            equivalent.append({**entry, "why": mine[match].why, "host": mine[match].host})
        else:
            survivors.append(entry)
    counts = dict.fromkeys((*DETECTED, *LISTED, "skipped"), 0)
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    counted = len(outcomes) - len(equivalent) - counts["skipped"]
    detected = counts["killed"] + counts["timeout"]
    score = round(100.0 * detected / counted, 1) if counted else None
    result.update(
        mutants=len(outcomes),
        counts=counts,
        equivalent_count=len(equivalent),
        score=score,
        meets_threshold=score is None or score >= cfg.threshold,
        survivors=survivors,
        equivalent=equivalent,
        stale_equivalents=[
            {"function": e.function, "before": e.before, "after": e.after} for i, e in enumerate(mine) if i not in used
        ],
    )
    return result


# --------------------------------------------------------------------------------------- main
def _utc(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _mutmut_version() -> str:
    try:
        from importlib.metadata import version

        return version("mutmut")
    except Exception:
        return "not installed"


def merge_reports(path: Path, new: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """``new``'s modules in place of their entries of the report at ``path``; its other modules
    kept as they are (their ``run`` says which report they come from), in the config's order."""
    if not path.exists():
        return new
    old = json.loads(path.read_text(encoding="utf-8"))
    fresh = {r["module"]: r for r in new["modules"]}
    kept = [{**r, "run": r.get("run", old.get("date"))} for r in old.get("modules", []) if r["module"] not in fresh]
    rank = {p: i for i, p in enumerate(order)}
    modules = sorted(
        [*kept, *({**r, "run": new["date"]} for r in new["modules"])], key=lambda r: rank.get(r["module"], len(rank))
    )
    return {
        **new,
        "seconds": round(sum(r["seconds"] for r in modules), 1),
        "merged_from": sorted({r["run"] for r in kept}),
        "summary": {
            r["module"]: {"score": r.get("score"), "mutants": r.get("mutants"), "seconds": r["seconds"]}
            for r in modules
        },
        "modules": modules,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="module map (default: %(default)s)")
    parser.add_argument("--module", action="append", default=[], help="only this module path (repeatable)")
    parser.add_argument("--include-pending", action="store_true", help="also run modules marked pending")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="mutmut workers")
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default: the config's report)")
    parser.add_argument("--list", action="store_true", help="list the modules and their tests, run nothing")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="mutate nothing: score each module's last run under .mutation/ with the current equivalents file",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other modules' entries of the existing report (--out) and replace only those run now",
    )
    args = parser.parse_args(argv)

    try:
        cfg = load_config(args.config)
        equivalents = load_equivalents(cfg.equivalent)
    except (SetupError, tomllib.TOMLDecodeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cuda = cuda_available()
    if cuda:  # device mutants can be told apart here: they must be killed, not excused
        equivalents = [e for e in equivalents if e.host == "any"]
    if args.list:
        for m in cfg.modules:
            flag = f"  [pending: {m.pending}]" if m.pending else ""
            print(f"{m.path}{flag}\n    " + "\n    ".join(m.tests))
        return 0
    known = {m.path: m for m in cfg.modules}
    unknown = [p for p in args.module if p not in known]
    if unknown:
        print(f"error: not in {args.config.name}: {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.module:
        selected = [known[p] for p in args.module]
    else:
        selected = [m for m in cfg.modules if args.include_pending or not m.pending]
    if _mutmut_version() == "not installed":
        print('error: mutmut is not installed: pip install -e ".[dev]"', file=sys.stderr)
        return 2

    started = time.monotonic()
    results = []
    for module in selected:
        print(f"{module.path}: mutating, tests {', '.join(module.tests)}", flush=True)
        try:
            result = run_module(cfg, module, equivalents, args.jobs, args.report_only)
        except SetupError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        results.append(result)
        if result.get("error"):
            print(f"  ERROR {result['error']}\n{result['log_tail']}", flush=True)
            continue
        c = result["counts"]
        print(
            f"  {result['score']}% of {result['mutants'] - result['equivalent_count'] - c['skipped']} "
            f"(killed {c['killed']}, timeout {c['timeout']}, survived {c['survived']}, no tests {c['no_tests']}, "
            f"equivalent {result['equivalent_count']}) in {result['seconds']} s",
            flush=True,
        )
        for s in result["survivors"]:
            print(f"    {s['outcome']:<9} {s['location']:<45} {s['before']}  ->  {s['after']}")
        for s in result["stale_equivalents"]:
            print(f"    stale equivalent entry: {s['function']}: {s['before']}  ->  {s['after']}")

    report = {
        "tool": f"mutmut {_mutmut_version()}",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_count": os.cpu_count(),
        "cuda": cuda,
        "jobs": args.jobs,
        "threshold": cfg.threshold,
        # a re-scored report (--report-only) took no time itself: the modules' own run times add up
        "seconds": round(sum(r["seconds"] for r in results), 1)
        if args.report_only
        else round(time.monotonic() - started, 1),
        "report_only": args.report_only,
        "summary": {
            r["module"]: {"score": r.get("score"), "mutants": r.get("mutants"), "seconds": r["seconds"]}
            for r in results
        },
        "modules": results,
    }
    out = args.out or cfg.report
    if args.merge:
        report = merge_reports(out, report, [m.path for m in cfg.modules])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    failing = [r["module"] for r in results if not r.get("meets_threshold")]
    print(f"report: {out} ({report['seconds']} s)")
    if failing:
        print(f"below {cfg.threshold}% or failed: {', '.join(failing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
