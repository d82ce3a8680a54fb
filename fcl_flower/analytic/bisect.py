"""Group testing for a failing sum: which of the added items makes the sum fail a test?

The server certifies one sum per stage (the PSD test of :mod:`fcl_flower.analytic.checks` on the
sum the solve uses, issue 30) instead of one factorisation per upload. When the sum fails, the
test is *monotone under union*: if two disjoint groups each pass (each is PSD within a slack
relative to its own diagonal), so does their union (the slacks add, as the diagonals do). So a
failing group always has a failing half, and halving finds one failing item in ⌈log₂ K⌉ tests:
test the first half; if it passes, the second half must fail (no test needed); then one more test
confirms the single item that is left. Floating point can break monotonicity only at the edge of
the slack; then :func:`find_culprit` finds nobody and the caller falls back to testing every item.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def find_culprit(items: Sequence[T], passes: Callable[[Sequence[T]], bool]) -> tuple[list[T], int]:
    """([an item that fails ``passes`` on its own], the number of tests run), for ``items`` whose
    whole group is known to fail; ([], tests) when the halving ends on an item that passes alone
    (possible only through rounding at the edge of the test's slack)."""
    group = list(items)
    tests = 0
    while len(group) > 1:
        half = len(group) // 2
        tests += 1
        group = group[half:] if passes(group[:half]) else group[:half]
    if not group:
        return [], tests
    tests += 1
    return ([], tests) if passes(group) else (group, tests)
