"""experiments/stats.py against values computed by hand (written out below)
and against scipy.stats' own tests."""

import doctest
import math
import pathlib
import sys

import pytest
from scipy import stats as scipy_stats

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "experiments"))
import stats  # noqa: E402


def test_confidence_interval_by_hand():
  # [1, 2, 3]: mean 2, s = 1, se = 1 / sqrt(3) = 0.577350;
  # t_{0.975, 2} = 4.302653, half width 4.302653 * 0.577350 = 2.484138.
  interval = stats.mean_ci([1.0, 2.0, 3.0])
  assert interval.mean == 2.0 and interval.n == 3
  assert interval.low == pytest.approx(2 - 2.484138, abs=1e-6)
  assert interval.high == pytest.approx(2 + 2.484138, abs=1e-6)
  # Eight seeds of accuracies: mean 0.6, s^2 = 0.0012 / 7 = 1.714286e-4,
  # se = sqrt(1.714286e-4 / 8) = 4.629100e-3, t_{0.975, 7} = 2.364624,
  # half width 0.010946.
  values = [0.58, 0.59, 0.60, 0.61, 0.62, 0.60, 0.61, 0.59]
  interval = stats.mean_ci(values)
  assert interval.mean == pytest.approx(0.6)
  assert interval.high - interval.mean == pytest.approx(0.010946, abs=1e-6)
  one = stats.mean_ci([0.5])
  assert one.mean == 0.5 and math.isnan(one.low) and str(one) == "0.500 (n=1)"


def test_welch_by_hand_and_against_scipy():
  # a = [1, 2, 3]: s_a^2 / n_a = 1 / 3; b = [4, 5, 6, 7]: s_b^2 / n_b =
  # (5 / 3) / 4 = 5 / 12; se = sqrt(3 / 4) = 0.866025, t = -3.5 / se =
  # -4.041452, df = 0.5625 / ((1/3)^2 / 2 + (5/12)^2 / 3) = 4.959184.
  a, b = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]
  p = stats.welch_t_test(a, b)
  assert p == pytest.approx(2 * scipy_stats.t.sf(4.041452, 4.959184), rel=1e-5)
  assert p == pytest.approx(
      scipy_stats.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-12
  )


def test_non_inferiority_by_hand_and_against_scipy():
  # a = [.60, .62, .64], b = [.61, .63, .65]: difference -0.01, each
  # s^2 / n = 0.0004 / 3, se = sqrt(0.0008 / 3) = 0.0163299, df = 4;
  # margin 0.05: t = 0.04 / se = 2.449490, one-sided p = 0.035242
  # (t_{0.95, 4} = 2.131847 < t < t_{0.975, 4} = 2.776445: 0.025 < p < 0.05).
  a, b = [0.60, 0.62, 0.64], [0.61, 0.63, 0.65]
  c = stats.compare(a, b, margin=0.05)
  assert c.difference == pytest.approx(-0.01)
  assert c.non_inferiority_p == pytest.approx(0.035242, abs=1e-6)
  assert c.low == pytest.approx(-0.01 - 2.776445 * 0.0163299, abs=1e-6)
  # scipy: H1 mean(a + margin) > mean(b) is the same one-sided test.
  shifted = scipy_stats.ttest_ind(
      [x + 0.05 for x in a], b, equal_var=False, alternative="greater"
  )
  assert c.non_inferiority_p == pytest.approx(shifted.pvalue, rel=1e-9)
  assert stats.verdict(c) == "non-inferior at margin 0.05, p = 0.0352"
  # A margin of 0.01: t = 0 and p = 0.5, inconclusive.
  tight = stats.compare(a, b, margin=0.01)
  assert tight.non_inferiority_p == pytest.approx(0.5)
  assert stats.verdict(tight).startswith("inconclusive at margin 0.01")


def test_verdict_worse_and_too_few_seeds():
  worse = stats.compare([0.40, 0.41, 0.42], [0.60, 0.61, 0.62], margin=0.02)
  assert stats.verdict(worse).startswith("worse by 0.200 (95% CI [")
  assert stats.verdict(
      stats.compare([0.5], [0.6, 0.7], margin=0.02)
  ).startswith("inconclusive (too few seeds")
  with pytest.raises(ValueError, match="margin must be > 0"):
    stats.compare([0.5, 0.6], [0.6, 0.7], margin=0)


def test_holm_by_hand():
  # Holm 1979 on p = (0.01, 0.04, 0.03, 0.005), m = 4: sorted 0.005, 0.01,
  # 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04; running maximum
  # 0.02, 0.03, 0.06, 0.06; back in the given order:
  adjusted = stats.holm([0.01, 0.04, 0.03, 0.005])
  assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02])
  # Capped at 1; a NaN stays NaN and does not count in m (here m = 2).
  adjusted = stats.holm([0.6, math.nan, 0.02])
  assert adjusted[0] == pytest.approx(0.6) and math.isnan(adjusted[1])
  assert adjusted[2] == pytest.approx(0.04)
  assert stats.holm([0.7, 0.8]) == [1.0, 1.0]
  # Ties: both of two equal p-values get 2 p.
  assert stats.holm([0.02, 0.02]) == pytest.approx([0.04, 0.04])
  assert stats.holm([]) == []


def test_docstring_examples_run():
  result = doctest.testmod(stats)
  assert result.failed == 0 and result.attempted > 0


def test_samples_without_spread_make_certain_tests():
  same = stats.compare([0.5, 0.5], [0.5, 0.5], margin=0.02)
  assert (same.welch_p, same.non_inferiority_p) == (1.0, 0.0)
  assert stats.verdict(same) == "non-inferior at margin 0.02, p = 0"
  below = stats.compare([0.4, 0.4], [0.5, 0.5], margin=0.02)
  assert (below.welch_p, below.non_inferiority_p) == (0.0, 1.0)
  assert stats.verdict(below).startswith("worse by 0.100")
