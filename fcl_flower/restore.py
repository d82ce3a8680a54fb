"""Reading a restored state field by field: every value type-checked, tensors finite and of the
shape the configuration gives, or one :class:`RestoreError` naming the field.

A checkpoint is signed (fcl_flower/state_key.py), so a file that reaches these checks was written
by this installation; they are the second line: a state written by a buggy or older server, or
signed by someone holding the key, is still checked as strictly as a fresh upload, and never ends
in a traceback. Field names are paths in the checkpoint's ``state`` tree (``state/ridge/gram_packed``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch


class RestoreError(ValueError):
    """A restored field that does not hold what the server wrote there; one line naming the field."""

    def __init__(self, field: str, reason: str, *, message: str | None = None) -> None:
        super().__init__(message if message is not None else f"field '{field}' {reason}")
        self.field = field
        self.reason = reason

    @classmethod
    def worded(cls, message: str) -> RestoreError:
        """A refusal already worded with its field (e.g. by a lower layer's own check)."""
        return cls("", message, message=message)


def mapping(value: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise RestoreError(field, f"must be a mapping with string keys, not {kind(value)}")
    return value


def entry(tree: Mapping[str, Any], key: str, field: str) -> Any:
    """``tree[key]``, or RestoreError naming ``field/key`` when it is missing."""
    if key not in tree:
        raise RestoreError(f"{field}/{key}" if field else key, "is missing")
    return tree[key]


def integer(value: Any, field: str, low: int | None = None, high: int | None = None) -> int:
    """An int (not a bool) within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RestoreError(field, f"must be an integer, not {kind(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise RestoreError(
            field, f"is {value}, outside [{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        )
    return value


def number(value: Any, field: str, low: float | None = None) -> float:
    """A finite int or float (not a bool), at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RestoreError(field, f"must be a finite number, not {kind(value)}")
    if low is not None and value < low:
        raise RestoreError(field, f"is {value!r}, below {low!r}")
    return float(value)


def strings(value: Any, field: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RestoreError(field, f"must be a list of strings, not {kind(value)}")
    return list(value)


def integers(value: Any, field: str, low: int | None = None, high: int | None = None) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise RestoreError(field, f"must be a list of integers, not {kind(value)}")
    return [integer(v, f"{field}/{i}", low, high) for i, v in enumerate(value)]


def tensor(
    value: Any,
    field: str,
    shape: Sequence[int | None],
    dtype: torch.dtype | None = torch.float64,
    *,
    finite: bool = True,
) -> torch.Tensor:
    """A tensor of ``shape`` (None: any size on that axis) and ``dtype`` (None: any), finite."""
    if not isinstance(value, torch.Tensor):
        raise RestoreError(field, f"must be a tensor, not {kind(value)}")
    got = tuple(value.shape)
    if len(got) != len(shape) or any(want is not None and want != have for want, have in zip(shape, got)):
        wanted = tuple("*" if s is None else s for s in shape)
        raise RestoreError(field, f"has shape {got}, the configuration gives {wanted}")
    if dtype is not None and value.dtype != dtype:
        raise RestoreError(field, f"has dtype {value.dtype}, not {dtype}")
    if finite and value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise RestoreError(field, "holds NaN or infinite entries")
    return value


def kind(value: Any) -> str:
    """A short description of ``value`` for a message (its type, and the value when it is short)."""
    shown = repr(value)
    return f"{type(value).__name__} {shown}" if len(shown) <= 24 else type(value).__name__
