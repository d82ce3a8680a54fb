"""Splitting the class-order positions 0..num_classes-1 into consecutive tasks.

Because labels are already class-order positions, a task is simply a ``range`` of labels.
Two schemes (docs/methods/stsa.md §4.1): equal tasks (e.g. CIFAR-100, 10 x 10), or a larger first
task followed by equal tasks (e.g. 50 base classes + 10 x 5, "large first task", Table 4).
"""

from __future__ import annotations

import numbers

from .errors import DatasetError


def _check_int(name: str, value: object) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise DatasetError(f"{name} must be an integer, got {value!r}")
    return int(value)


def task_class_ranges(num_classes: int, num_tasks: int, first_task_classes: int = 0) -> list[range]:
    """Consecutive label ranges, one per task, covering ``range(num_classes)`` exactly.

    ``first_task_classes == 0``: all tasks get ``num_classes / num_tasks`` classes.
    ``first_task_classes > 0``: task 0 gets that many, the remaining classes are split equally
    over the other ``num_tasks - 1`` tasks. Uneven splits are refused rather than silently
    rounded, because the paper's metrics assume the stated task sizes.
    """
    num_classes = _check_int("num_classes", num_classes)
    num_tasks = _check_int("num_tasks", num_tasks)
    first = _check_int("first_task_classes", first_task_classes)
    if num_classes < 1:
        raise DatasetError(f"num_classes must be >= 1, got {num_classes}")
    if num_tasks < 1:
        raise DatasetError(f"num_tasks must be >= 1, got {num_tasks}")
    if num_tasks > num_classes:
        raise DatasetError(f"num_tasks={num_tasks} exceeds num_classes={num_classes}; every task needs >= 1 class")
    if first < 0:
        raise DatasetError(f"first_task_classes must be >= 0 (0 = equal tasks), got {first}")
    if first == 0:
        if num_classes % num_tasks:
            raise DatasetError(
                f"{num_classes} classes do not divide into {num_tasks} equal tasks; "
                f"choose num_tasks dividing {num_classes} or set first_task_classes"
            )
        size = num_classes // num_tasks
        return [range(t * size, (t + 1) * size) for t in range(num_tasks)]
    if first > num_classes:
        raise DatasetError(f"first_task_classes={first} exceeds num_classes={num_classes}")
    rest = num_classes - first
    if num_tasks == 1:
        if rest:
            raise DatasetError(
                f"with num_tasks=1 the first task must hold all {num_classes} classes, got first_task_classes={first}"
            )
        return [range(num_classes)]
    if rest < num_tasks - 1:
        raise DatasetError(
            f"after a first task of {first} classes only {rest} remain for {num_tasks - 1} tasks; "
            "every task needs >= 1 class"
        )
    if rest % (num_tasks - 1):
        raise DatasetError(
            f"the remaining {rest} classes (after a first task of {first}) do not divide into "
            f"{num_tasks - 1} equal tasks; change first_task_classes or num_tasks"
        )
    size = rest // (num_tasks - 1)
    return [range(first)] + [range(first + t * size, first + (t + 1) * size) for t in range(num_tasks - 1)]
