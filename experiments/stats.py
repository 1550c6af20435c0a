"""Statistics of the studies: means, 95% confidence intervals, Welch's
t-test and a one-sided non-inferiority test, with verdict words derived
from the test (never from a rule on standard deviations).

For samples ``a`` (n_a values) and ``b`` (n_b values) with means ``m`` and
sample variances ``s^2`` (denominator ``n - 1``):

* confidence interval of a mean: ``m ± t_{0.975, n-1} s / sqrt(n)``
  (Student t);
* Welch: ``se = sqrt(s_a^2 / n_a + s_b^2 / n_b)``, ``t = (m_a - m_b) / se``,
  degrees of freedom (Welch-Satterthwaite)
  ``df = se^4 / ((s_a^2/n_a)^2 / (n_a-1) + (s_b^2/n_b)^2 / (n_b-1))``,
  two-sided ``p = 2 (1 - F_t(|t|; df))``;
* non-inferiority of ``a`` against a baseline ``b`` at margin ``delta``:
  ``H0: m_a - m_b <= -delta`` against ``H1: m_a - m_b > -delta``,
  ``t = (m_a - m_b + delta) / se`` with Welch's ``se`` and ``df``,
  one-sided ``p = 1 - F_t(t; df)``; the difference's 95% interval is
  ``m_a - m_b ± t_{0.975, df} se``.

Several tests in one table: Holm's step-down adjustment (Holm 1979, which
holds the family-wise error rate at ``alpha`` under any dependence between
the tests). For ``m`` p-values sorted ascending, ``p_(1) <= ... <= p_(m)``,
the adjusted ``p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))``; a test is
rejected in the family at ``alpha`` when ``p~ < alpha``.

``F_t`` is Student's t distribution (scipy.stats.t). Samples of one value
have no variance estimate: their intervals and p-values are NaN and the
verdict is "inconclusive". Two samples without any spread make the tests
certain: Welch's p is 1 for equal means and 0 otherwise, the
non-inferiority p is 0 when ``m_a - m_b > -delta`` and 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Sequence

from scipy import stats as scipy_stats

ALPHA = 0.05


@dataclasses.dataclass(frozen=True)
class Interval:
  """A mean and its 95% confidence interval (NaN bounds for one value)."""

  mean: float
  low: float
  high: float
  n: int

  def __str__(self) -> str:
    if math.isnan(self.low):
      return f"{self.mean:.3f} (n={self.n})"
    return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


@dataclasses.dataclass(frozen=True)
class Comparison:
  """Arm ``a`` against baseline ``b``: the difference of means, its 95%
  interval (Welch), Welch's two-sided p-value and the non-inferiority
  test's one-sided p-value at ``margin``."""

  difference: float
  low: float
  high: float
  welch_p: float
  non_inferiority_p: float
  margin: float


def t_half_width(std, n: int, level: float = 0.95):
  """Half width of the Student-t interval of a mean of ``n`` values of
  sample standard deviation ``std`` (a number or an array):
  ``t_{(1+level)/2, n-1} std / sqrt(n)``.

  Example:
    >>> round(t_half_width(1.0, 3), 6)
    2.484138
  """
  return float(scipy_stats.t.ppf((1 + level) / 2, n - 1)) * std / math.sqrt(n)


def mean_ci(values: Sequence[float], level: float = 0.95) -> Interval:
  """The mean and its Student-t confidence interval.

  ``m ± t_{(1+level)/2, n-1} s / sqrt(n)``.

  Args:
    values: the sample (e.g. one accuracy per seed).
    level: the interval's confidence level.

  Returns:
    An :class:`Interval`.

  Example:
    >>> str(mean_ci([1.0, 2.0, 3.0]))
    '2.000 [-0.484, 4.484]'
  """
  n = len(values)
  mean = statistics.fmean(values)
  if n < 2:
    return Interval(mean, math.nan, math.nan, n)
  half = t_half_width(statistics.stdev(values), n, level)
  return Interval(mean, float(mean - half), float(mean + half), n)


def _welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
  """Welch's standard error of ``mean(a) - mean(b)`` and its degrees of
  freedom (NaN when either sample has one value; 0 and NaN without spread)."""
  if len(a) < 2 or len(b) < 2:
    return math.nan, math.nan
  va = statistics.variance(a) / len(a)
  vb = statistics.variance(b) / len(b)
  se = math.sqrt(va + vb)
  if se == 0:
    return 0.0, math.nan
  df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
  return se, df


def welch_t_test(a: Sequence[float], b: Sequence[float]) -> float:
  """Welch's two-sided p-value for ``mean(a) == mean(b)``.

  Example:
    >>> round(welch_t_test([1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]), 4)
    0.0101
  """
  se, df = _welch(a, b)
  if math.isnan(se):
    return math.nan
  if se == 0:
    return float(statistics.fmean(a) == statistics.fmean(b))
  t = (statistics.fmean(a) - statistics.fmean(b)) / se
  return float(2 * scipy_stats.t.sf(abs(t), df))


def compare(
    a: Sequence[float], b: Sequence[float], margin: float
) -> Comparison:
  """Arm ``a`` against baseline ``b``: difference, 95% interval, Welch's
  p-value and the one-sided non-inferiority p-value at ``margin``.

  ``H0: mean_a - mean_b <= -margin``; ``t = (m_a - m_b + margin) / se``,
  ``p = 1 - F_t(t; df)`` (Welch's ``se`` and ``df``).

  Args:
    a: the arm's values (one per seed).
    b: the baseline's values.
    margin: the non-inferiority margin, ``> 0``, in the values' units.

  Returns:
    A :class:`Comparison`.

  Example:
    >>> c = compare([0.60, 0.62, 0.64], [0.61, 0.63, 0.65], margin=0.05)
    >>> round(c.difference, 3), round(c.non_inferiority_p, 4)
    (-0.01, 0.0352)
  """
  if margin <= 0:
    raise ValueError(f"the margin must be > 0, got {margin}")
  difference = statistics.fmean(a) - statistics.fmean(b)
  se, df = _welch(a, b)
  if math.isnan(se):
    return Comparison(
        difference, math.nan, math.nan, math.nan, math.nan, margin
    )
  if se == 0:  # no spread in either sample: the tests are certain
    return Comparison(
        difference,
        difference,
        difference,
        float(difference == 0),
        float(difference + margin <= 0),
        margin,
    )
  half = float(scipy_stats.t.ppf(1 - ALPHA / 2, df)) * se
  return Comparison(
      difference=difference,
      low=difference - half,
      high=difference + half,
      welch_p=welch_t_test(a, b),
      non_inferiority_p=float(scipy_stats.t.sf((difference + margin) / se, df)),
      margin=margin,
  )


def holm(p_values: Sequence[float]) -> list[float]:
  """Holm's adjusted p-values, in the order given.

  ``p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))`` over the ``m``
  p-values that are not NaN, sorted ascending; a NaN (a test too few seeds
  allowed) stays NaN and does not count in ``m``.

  Args:
    p_values: one p-value per test of the family.

  Returns:
    The adjusted p-values, one per input, in its order.

  Example:
    >>> [round(p, 3) for p in holm([0.01, 0.04, 0.03])]
    [0.03, 0.06, 0.06]
  """
  order = sorted(
      (i for i, p in enumerate(p_values) if not math.isnan(p)),
      key=lambda i: p_values[i],
  )
  adjusted = [math.nan] * len(p_values)
  running = 0.0
  for rank, i in enumerate(order):
    running = max(running, min(1.0, (len(order) - rank) * p_values[i]))
    adjusted[i] = running
  return adjusted


def verdict(comparison: Comparison, alpha: float = ALPHA) -> str:
  """Words from the tests: "non-inferior" when the one-sided test rejects
  ``H0: difference <= -margin`` at ``alpha``; "worse by ..." when Welch's
  test finds a difference and the whole 95% interval lies below
  ``-margin``; otherwise "inconclusive".

  Example:
    >>> verdict(compare([0.60, 0.62, 0.64], [0.61, 0.63, 0.65], 0.05))
    'non-inferior at margin 0.05, p = 0.0352'
  """
  c = comparison
  if math.isnan(c.non_inferiority_p):
    return "inconclusive (too few seeds for a test)"
  if c.non_inferiority_p < alpha:
    return f"non-inferior at margin {c.margin:g}, p = {c.non_inferiority_p:.3g}"
  if c.welch_p < alpha and c.high < -c.margin:
    return (
        f"worse by {-c.difference:.3f} (95% CI [{-c.high:.3f}, "
        f"{-c.low:.3f}]), Welch p = {c.welch_p:.3g}"
    )
  return (
      f"inconclusive at margin {c.margin:g} (non-inferiority p = "
      f"{c.non_inferiority_p:.3g})"
  )
