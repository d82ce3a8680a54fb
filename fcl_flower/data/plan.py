"""What the server needs to know about the data without opening it: the task plan and the layout.

* :class:`TaskPlan`: the class list in class order (position = global label), the classes of
  each task and the input shape. For a public dataset it follows from the dataset's name, the run
  seed (the seeded class order) and the task settings, with no file read; for ``dataset =
  custom`` (each site brings its own images) it comes from the run config's ``class-names`` or
  from a small plan file (``task-plan``)::

      {"classes": ["cat", "dog", "fox", "owl"],          # class order = global labels 0..C-1
       "tasks": [["cat", "dog"], ["fox", "owl"]],        # optional: else num-tasks / first-task-classes
       "image-shape": [3, 64, 64]}                        # optional: else 3 x image-size x image-size

* :class:`FederationLayout`: which clients hold data of which task (joining clients, LGA's
  memory-only clients, STAMP's per-client task sequences). Every part of it is drawn from the
  run seed alone, so the server and every client agree on it without any data.
  :class:`~fcl_flower.data.federated.FederatedSplit` is a layout plus the data.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .bundle import class_order
from .errors import DatasetError
from .paper_partitions import join_tasks, old_only_clients
from .synthetic import SyntheticSpec
from .task_pool import task_pool_classes
from .tasks import task_class_ranges

CUSTOM = "custom"
#: Public datasets: (number of classes, channels, native side), as their loaders produce them.
PUBLIC_SHAPES: dict[str, tuple[int, int, int]] = {
    "digits": (10, 1, 8),
    "synthetic": (SyntheticSpec().num_classes, SyntheticSpec().channels, SyntheticSpec().size),
    "cifar100": (100, 3, 32),
    "tiny-imagenet": (200, 3, 64),
    "imagenet-r": (200, 3, 224),
}


@dataclass(frozen=True)
class TaskPlan:
    dataset: str
    class_names: tuple[str, ...]  # position p = global label p
    tasks: tuple[range, ...]
    image_shape: tuple[int, int, int]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def label_of(self, name: str) -> int:
        """The global label of a class name; DatasetError naming the unknown class otherwise."""
        try:
            return self.class_names.index(name)
        except ValueError:
            shown = ", ".join(self.class_names[:8]) + (", ..." if self.num_classes > 8 else "")
            raise DatasetError(f"class {name!r} is not in the run's class list ({shown})") from None

    def task_of_label(self, label: int) -> int:
        for t, r in enumerate(self.tasks):
            if label in r:
                return t
        raise DatasetError(f"label {label} is in no task")


def plan_tasks(num_classes: int, num_tasks: int, first_task_classes: int, task_pool: bool) -> tuple[range, ...]:
    """The tasks' class ranges; under STAMP's task pool every task spans every class (one head)."""
    if task_pool:
        return (range(num_classes),) * num_tasks
    return tuple(task_class_ranges(num_classes, num_tasks, first_task_classes))


def public_plan(
    dataset: str, *, seed: int, num_tasks: int, first_task_classes: int, image_size: int, task_pool: bool = False
) -> TaskPlan:
    """A public dataset's plan: class names are the dataset's class ids in the seeded class order."""
    if dataset not in PUBLIC_SHAPES:
        raise DatasetError(f"unknown dataset {dataset!r}")
    num_classes, channels, side = PUBLIC_SHAPES[dataset]
    side = image_size or side
    names = tuple(str(int(c)) for c in class_order(num_classes, seed))
    return TaskPlan(
        dataset, names, plan_tasks(num_classes, num_tasks, first_task_classes, task_pool), (channels, side, side)
    )


def custom_plan(
    *,
    class_names: str,
    plan_file: str,
    num_tasks: int,
    first_task_classes: int,
    image_size: int,
    plan_text: str = "",
) -> TaskPlan:
    """The plan of a federation that brings its own data (``class-names``, a ``task-plan`` file
    or its text, ``task-plan-content``: what the clients get)."""
    shape: tuple[int, int, int] | None = None
    tasks: list[list[str]] | None = None
    if plan_text:
        names, tasks, shape = read_plan_text(plan_text)
    elif plan_file:
        path = Path(plan_file).expanduser()
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as err:
            raise DatasetError(f"cannot read the task plan {path}: {err}") from None
        names, tasks, shape = _read_plan(doc, path)
    else:
        names = [n.strip() for n in class_names.split(",")]
        if not class_names.strip() or any(not n for n in names):
            raise DatasetError("dataset 'custom' needs class-names ('cat,dog,...', no empty name) or a task-plan file")
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise DatasetError(f"class names must be unique; listed twice: {', '.join(twice)}")
    if tasks is not None:
        ranges, start = [], 0
        for task in tasks:
            ranges.append(range(start, start + len(task)))
            start += len(task)
    else:
        ranges = task_class_ranges(len(names), num_tasks, first_task_classes)
    if shape is None:
        if image_size < 1:
            raise DatasetError(
                "dataset 'custom' needs image-size (every image is resized to it), or image-shape in the plan"
            )
        shape = (3, image_size, image_size)
    return TaskPlan(CUSTOM, tuple(names), tuple(ranges), shape)


def read_plan_text(text: str) -> tuple[list[str], list[list[str]] | None, tuple[int, int, int] | None]:
    """(class names, tasks, image shape) of a task plan's JSON text; DatasetError (one line,
    naming ``task-plan-content``) on anything else, however deeply nested."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as err:
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err).splitlines()[0]
        raise DatasetError(f"task-plan-content is not JSON ({reason})") from None
    return _read_plan(doc, "task-plan-content")


def _read_plan(doc: Any, path: Path | str) -> tuple[list[str], list[list[str]] | None, tuple[int, int, int] | None]:
    if not isinstance(doc, dict) or not isinstance(doc.get("classes"), list):
        raise DatasetError(f"task plan {path}: expected an object with a 'classes' list")
    names = [str(n) for n in doc["classes"]]
    tasks = doc.get("tasks")
    if tasks is not None:
        if not isinstance(tasks, list) or not all(isinstance(t, list) and t for t in tasks):
            raise DatasetError(f"task plan {path}: 'tasks' must be a list of non-empty lists of class names")
        flat = [str(n) for t in tasks for n in t]
        if sorted(flat) != sorted(names):
            raise DatasetError(f"task plan {path}: 'tasks' must hold every class of 'classes' exactly once")
        names = flat  # the class order is the task order
        tasks = [[str(n) for n in t] for t in tasks]
    shape = doc.get("image-shape")
    if shape is not None:
        if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and v > 0 for v in shape)):
            raise DatasetError(f"task plan {path}: 'image-shape' must be [channels, height, width]")
        if shape[0] not in (1, 3):
            raise DatasetError(f"task plan {path}: images have 1 or 3 channels (got {shape[0]})")
        shape = (shape[0], shape[1], shape[2])
    return names, tasks, shape


class FederationLayout:
    """Which client holds data of which task; drawn from the seed alone (no data).

    ``partition`` "task-pool" gives every client its own sequence of ``classes_per_task``-class
    blocks (``client_classes``; ``tasks[t]`` is then every class, one head over all); otherwise
    the tasks are the plan's, clients join by ``join_task`` and ``old_only[t]`` are LGA's Z_o.
    """

    def __init__(
        self,
        plan: TaskPlan,
        num_clients: int,
        seed: int,
        partition: str,
        *,
        initial_clients: int = 0,
        joining_per_task: int = 0,
        old_only_fraction: float = 0.0,
        classes_per_task: int = 0,
    ) -> None:
        self.plan = plan
        self.num_clients = int(num_clients)
        self.seed = int(seed)
        self.partition = partition
        self.client_classes: np.ndarray | None = None
        if partition == "task-pool":  # plan.tasks: num_tasks times every class (task_pool_plan)
            if 0 < initial_clients < num_clients or old_only_fraction:
                raise DatasetError("partition task-pool has no joining or memory-only clients (STAMP B1.3)")
            classes = task_pool_classes(
                plan.num_classes, len(plan.tasks), classes_per_task, self.num_clients, self.seed
            )
            self.client_classes = classes
            self.tasks: list[range] = [range(plan.num_classes)] * classes.shape[1]
            self.join_task = np.zeros(self.num_clients, dtype=np.int64)
            self.old_only: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in self.tasks]
            return
        self.tasks = list(plan.tasks)
        self.join_task = join_tasks(self.num_clients, len(self.tasks), initial_clients, joining_per_task)
        self.old_only = []
        for t in range(len(self.tasks)):
            rng = np.random.default_rng([self.seed, t, 1])
            old_only = old_only_clients(self.join_task, t, old_only_fraction, rng)
            old_only.setflags(write=False)
            self.old_only.append(old_only)

    # -- the layout ------------------------------------------------------------------------
    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def num_classes(self) -> int:
        return self.plan.num_classes

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return self.plan.image_shape

    @property
    def is_task_pool(self) -> bool:
        """Whether every client has its own task sequence (STAMP's limitless task pool)."""
        return self.client_classes is not None

    def client_task_classes(self, task: int, client: int) -> np.ndarray:
        """The classes of client ``client``'s task ``task``: its own block under the task pool,
        else the shared task's classes (a Dirichlet client may hold samples of only some)."""
        task, client = self._task(task), self._client(client)
        if self.client_classes is not None:
            return self.client_classes[client, task]
        return np.arange(self.tasks[task].start, self.tasks[task].stop, dtype=np.int64)

    def stage_classes(self, task: int) -> list[int]:
        """Classes trained at stage ``task``: the task's, or (task pool) every client's block."""
        task = self._task(task)
        if self.client_classes is not None:
            return sorted(set(self.client_classes[:, task].reshape(-1).tolist()))
        return list(self.tasks[task])

    def classes_through(self, task: int) -> int:
        """Classes learnt by the end of ``task``, counted task by task (a client's; EWC's task
        weights): ``tasks[task].stop`` on the shared stream, ``(task + 1) * cpt`` in the pool."""
        task = self._task(task)
        if self.client_classes is not None:
            return (task + 1) * self.client_classes.shape[2]
        return self.tasks[task].stop

    def active_clients(self, task: int) -> np.ndarray:
        """Clients that have joined by task ``task`` (Z_o included: they train on their memory)."""
        return np.flatnonzero(self.join_task <= self._task(task)).astype(np.int64)

    def num_seen_classes(self, upto_task: int) -> int:
        """Number of classes in tasks ``0..upto_task``; they are labels ``0..n-1``."""
        return self.tasks[self._task(upto_task)].stop

    # -- validation ------------------------------------------------------------------------
    def _task(self, task: int) -> int:
        if not isinstance(task, numbers.Integral) or isinstance(task, bool) or not 0 <= task < len(self.tasks):
            raise DatasetError(f"task must be an integer in [0, {len(self.tasks)}), got {task!r}")
        return int(task)

    def _client(self, client: int) -> int:
        if not isinstance(client, numbers.Integral) or isinstance(client, bool) or not 0 <= client < self.num_clients:
            raise DatasetError(f"client must be an integer in [0, {self.num_clients}), got {client!r}")
        return int(client)

    def __getattr__(self, name: str) -> Any:
        """Data views (``seen_test``, ``task_train``, ...) exist only on a FederatedSplit."""
        if name.startswith("_"):  # copy/pickle probes, and attributes before __init__ ran
            raise AttributeError(name)
        raise DatasetError(
            f"split.{name} needs the dataset, but this server holds only the task plan "
            "(evaluation = federated); the clients hold the data"
        )
