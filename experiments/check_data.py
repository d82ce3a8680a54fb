"""Check a site's own image folder before a run (``dataset = custom``): what the SuperNode will read.

    fcl-check-data /srv/images --run-config "dataset='custom' class-names='cat,dog,fox,owl' num-tasks=2 image-size=32"
    fcl-check-data /srv/images --run-config run.toml --node-config "partition-id=2 test-fraction=0.25"

Indexes the folder exactly as the client will (fcl_flower/data/own.py: image folders, per-task
folders, a CSV/JSON manifest or a Hugging Face ``datasets`` folder), decodes every image once, and
prints the samples per class per task, for training and held out (given by the folder, or drawn
with the run seed). Exit 0 when the folder can run; 2 when it cannot, with one ``error:`` line for
every problem of the folder (all of them in one run), each naming the file or folder: a class that
is not in the run's class list, an unreadable or corrupt image, an empty class or task folder, a
class in another task than the plan's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from clients.node_data import NodeConfigError, partition_of
from clients.own_data import START_HINT, own_settings
from experiments.benchlib import OneLineErrorParser
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.data import DatasetError
from fcl_flower.data.own import IMAGE_SUFFIXES, OwnData, Problems, index_folder, verify_images
from fcl_flower.runtime import task_plan

ERRORS = (ConfigError, DatasetError, NodeConfigError)


def parse_run_config(text: list[str]) -> RunConfig:
    """The run config as ``flwr run --run-config`` takes it; ``dataset`` defaults to ``custom`` and,
    for it, ``evaluation`` to ``federated`` (the only evaluation a custom run has)."""
    from flwr.common.config import parse_config_args

    try:
        values = dict(parse_config_args(text))
    except ValueError as err:
        raise ConfigError(f"cannot parse the run config: {err}") from None
    values.setdefault("dataset", "custom")
    if values["dataset"] != "custom":
        raise ConfigError(f"fcl-check-data checks own images (dataset 'custom'), not dataset {values['dataset']!r}")
    values.setdefault("evaluation", "federated")
    return RunConfig.from_mapping(values)


def parse_node_config(text: list[str]) -> dict[str, Any]:
    from flwr.common.config import parse_config_args

    try:
        return dict(parse_config_args(text))
    except ValueError as err:
        raise NodeConfigError(f"cannot parse the node config: {err}") from None


class FolderProblems(DatasetError):
    """Every problem of a folder, one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def check_folder(folder: str, cfg: RunConfig, node_config: Mapping[str, Any]) -> tuple[OwnData, float]:
    """Index and decode every image of ``folder`` as the client will; (data, seconds). Every
    problem of the folder is found before it raises :class:`FolderProblems` with all of them (one
    that stops the reading, such as a folder that is not one, raises alone)."""
    began = time.perf_counter()
    if "partition-id" in node_config:
        partition_of(node_config, cfg.num_clients)
    plan, settings = task_plan(cfg), own_settings(node_config, cfg)
    problems = Problems(collect=True)
    index = index_folder(Path(folder).expanduser().resolve(), plan, settings, problems)
    assert index.reader is not None
    verify_images(index.reader, problems)
    if problems.found:
        raise FolderProblems(problems.found)
    return OwnData(index, plan, settings), time.perf_counter() - began


def report(data: OwnData, cfg: RunConfig, node_config: Mapping[str, Any], seconds: float) -> str:
    plan, index = data.plan, data.index
    c, h, w = plan.image_shape
    if index.given_split:
        held = "held-out samples given by the folder"
    else:
        held = f"held-out samples drawn: test-fraction {data.settings.test_fraction}, seed {cfg.seed}"
    lines = [
        f"{data.root}: {index.format}, {len(index.names)} images; {held}",
        f"plan: {plan.num_classes} classes in {len(plan.tasks)} tasks, images {c}x{h}x{w}",
    ]
    rows = data.counts()
    width = max([len("class"), *(len(name) for _, name, _, _ in rows)])
    lines.append(f"{'task':>4}  {'class':<{width}}  {'train':>7}  {'held-out':>8}")
    for task in range(len(plan.tasks)):
        of_task = [r for r in rows if r[0] == task]
        if not of_task:
            lines.append(f"{task:>4}  {'(none)':<{width}}  {0:>7}  {0:>8}")
        for _, name, train, test in of_task:
            lines.append(f"{task:>4}  {name:<{width}}  {train:>7}  {test:>8}")
    lines.append(f"{'':>4}  {'total':<{width}}  {sum(r[2] for r in rows):>7}  {sum(r[3] for r in rows):>8}")
    held_names = {name for _, name, _, _ in rows}
    missing = [n for n in plan.class_names if n not in held_names]
    if missing:
        shown = ", ".join(missing[:10]) + (f", ... ({len(missing)})" if len(missing) > 10 else "")
        lines.append(f"note: classes of the plan this site does not hold (fine): {shown}")
    empty = [t for t in range(len(plan.tasks)) if not any(r[0] == t and r[2] for r in rows)]
    if empty:
        lines.append(f"note: no training images for task(s) {', '.join(map(str, empty))}: this site adds nothing there")
    if index.ignored:
        lines.append(
            f"note: ignored {len(index.ignored)} file(s) that are not {'/'.join(IMAGE_SUFFIXES)} images, "
            f"e.g. {index.ignored[0]}"
        )
    lines.extend(f"note: {note}" for note in index.notes or [])
    if "partition-id" not in node_config:
        lines.append(f"note: the SuperNode also needs its client id: {START_HINT}")
    lines.append(f"ok: every image read ({seconds:.1f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the site's data folder (node config data-dir)")
    parser.add_argument(
        "--run-config",
        nargs="+",
        required=True,
        help="the run config, as for flwr run --run-config: key=value pairs or a .toml file",
    )
    parser.add_argument(
        "--node-config", nargs="+", default=[], help="the SuperNode's node config (partition-id, test-fraction, ...)"
    )
    args = parser.parse_args(argv)
    try:
        cfg = parse_run_config(args.run_config)
        node_config = {**parse_node_config(args.node_config), "data-dir": str(args.folder)}
        data, seconds = check_folder(str(args.folder), cfg, node_config)
    except FolderProblems as err:
        for problem in err.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report(data, cfg, node_config, seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
