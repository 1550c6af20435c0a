"""Checks of scalar arguments, shared by every layer of the package.

A leaf module: it imports nothing of the package, so that configs and the
library below them can both use it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional


def _bounds(gt, ge, lt, le) -> str:
  """``"> 0"``, ``">= 2"``, ``"in [0, 1)"``: the bounds as the error says."""
  low = gt if gt is not None else ge
  high = lt if lt is not None else le
  if low is not None and high is not None:
    return (
        f"in {'(' if gt is not None else '['}{low}, {high}"
        f"{')' if lt is not None else ']'}"
    )
  if low is not None:
    return f"{'>' if gt is not None else '>='} {low}"
  if high is not None:
    return f"{'<' if lt is not None else '<='} {high}"
  return ""


def check_range(
    name: str,
    value: Any,
    *,
    gt: Optional[float] = None,
    ge: Optional[float] = None,
    lt: Optional[float] = None,
    le: Optional[float] = None,
) -> None:
  """Raises a one-line ValueError naming ``name`` unless ``value`` is a
  finite real number (not a bool) within the given bounds.

  Comparisons alone let NaN through (``nan <= 0`` is false), so finiteness
  is checked first; every bound is optional.

  Args:
    name: how the error names the value, e.g. ``"optimizer.b1"``.
    value: the number to check.
    gt: exclusive lower bound.
    ge: inclusive lower bound.
    lt: exclusive upper bound.
    le: inclusive upper bound.

  Raises:
    ValueError: ``"<name> must be in [0, 1), got 5.0"``, or ``"<name> must
      be a finite number in [0, 1), got nan"``.

  Example:
    >>> check_range("optimizer.b1", 0.9, ge=0, lt=1)
    >>> check_range("optimizer.b1", float("nan"), ge=0, lt=1)
    Traceback (most recent call last):
    ...
    ValueError: optimizer.b1 must be a finite number in [0, 1), got nan
    >>> check_range("seed", -1, ge=0)
    Traceback (most recent call last):
    ...
    ValueError: seed must be >= 0, got -1
  """
  bounds = _bounds(gt, ge, lt, le)
  if (
      not isinstance(value, numbers.Real)
      or isinstance(value, bool)
      or not math.isfinite(value)
  ):
    finite = f"a finite number {bounds}".rstrip()
    raise ValueError(f"{name} must be {finite}, got {value!r}")
  if (
      (gt is not None and not value > gt)
      or (ge is not None and value < ge)
      or (lt is not None and not value < lt)
      or (le is not None and value > le)
  ):
    raise ValueError(f"{name} must be {bounds}, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
  """Raises a one-line ValueError naming ``name`` and ``choices`` unless
  ``value`` is one of them.

  Example:
    >>> check_choice("optimizer.kind", "qr", ("range", "svd"))
    Traceback (most recent call last):
    ...
    ValueError: optimizer.kind must be one of ('range', 'svd'), got 'qr'
  """
  if value not in choices:
    raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_fields(
    section: str, config: Any, names: str, **bounds: float
) -> None:
  """:func:`check_range` on the fields ``names`` (space-separated) of
  ``config`` that are not None, each named ``section.field`` (as ``--set``
  spells it; the top-level fields have no section)."""
  for name in names.split():
    value = getattr(config, name)
    if value is not None:
      check_range(f"{section}.{name}" if section else name, value, **bounds)
