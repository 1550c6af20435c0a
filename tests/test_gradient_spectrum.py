"""experiments/gradient_spectrum.py's tally against fractions computed by
hand: gradients built from orthonormal directions with known singular
values, so each kept fraction is a ratio of their squares."""

import math
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "experiments"))
import gradient_spectrum  # noqa: E402

E = np.eye(4)  # e_0..e_3, the longer side's directions
F = np.eye(2)  # f_0, f_1, the shorter side's


def _grads(matrix, transpose=False):
  """A gradient tree with one stacked attention matrix ``[1, 4, 2]`` (or
  its transpose ``[1, 2, 4]``) and a norm vector, which is not tallied."""
  layer = matrix.T if transpose else matrix
  return {
      "layers": {"q_proj": layer[None], "input_norm": np.ones((1, 2))},
  }


@pytest.mark.parametrize("transpose", [False, True])
def test_fresh_stale_and_random_by_hand(transpose):
  """Step 0: G = 3 e0 f0' + 1 e1 f1' (sigma^2 = 9, 1), the window's
  projector at rank 1 is e0. Step 1: G = 2 e1 f0' + 1 e0 f1' (sigma^2 = 4,
  1): fresh keeps 4/5, the stale e0 keeps 1/5, rank 2 (e0, e1) all of it;
  a random rank-r projector on the longer side (4) keeps r/4."""
  tally = gradient_spectrum.Tally([1, 2], windows=[10])
  step0 = 3 * np.outer(E[0], F[0]) + np.outer(E[1], F[1])
  step1 = 2 * np.outer(E[1], F[0]) + np.outer(E[0], F[1])
  tally.add(0, _grads(step0, transpose))
  tally.add(1, _grads(step1, transpose))
  first, second = (s["attention"] for s in tally.steps)
  assert first["fresh@1"] == pytest.approx(9 / 10)
  assert first["stale10@1"] == pytest.approx(9 / 10)  # its own projector
  assert second["fresh@1"] == pytest.approx(4 / 5)
  assert second["stale10@1"] == pytest.approx(1 / 5)
  assert second["stale10@2"] == pytest.approx(1.0)
  assert second["random@1"] == pytest.approx(1 / 4)
  summary = tally.summary()["attention"]
  assert summary["steps"] == 2
  assert summary["fresh@1"] == pytest.approx((9 / 10 + 4 / 5) / 2)
  assert summary["stale10@1"] == pytest.approx(1 / 5)  # step 1 only
  assert set(tally.summary()) == {"attention"}


def test_each_window_refreshes_on_its_own():
  """Windows of 1 and 3 steps: at step 1 the 1-step window's projector is
  step 1's own (keeps all of a rank-1 gradient), the 3-step one step 0's
  (orthogonal: keeps nothing); its stale mean skips step 0 only."""
  tally = gradient_spectrum.Tally([1], windows=[1, 3])
  tally.add(0, _grads(np.outer(E[0], F[0])))
  tally.add(1, _grads(np.outer(E[1], F[0])))
  second = tally.steps[1]["attention"]
  assert second["stale1@1"] == pytest.approx(1.0)
  assert second["stale3@1"] == pytest.approx(0.0)
  assert tally.kinds() == [
      "fresh",
      "stale1",
      "stale3",
      "summed1",
      "summed3",
      "random",
  ]
  assert math.isnan(tally.summary()["attention"]["stale1@1"])
  assert tally.summary()["attention"]["stale3@1"] == pytest.approx(0.0)


def test_summed_keeps_what_the_steps_share():
  """A 3-step window with projector e0 (step 0), then two steps whose e1
  parts cancel: each step's stale fraction is 1/10, the sum (2 e0 f0') is
  all kept. Step 3 starts a new window and records the first one."""
  tally = gradient_spectrum.Tally([1], windows=[3])
  shared = np.outer(E[0], F[0])
  noise = 3 * np.outer(E[1], F[1])
  for step, g in enumerate([shared, shared + noise, shared - noise, noise]):
    tally.add(step, _grads(g))
  assert tally.steps[1]["attention"]["stale3@1"] == pytest.approx(1 / 10)
  assert tally.steps[2]["attention"]["stale3@1"] == pytest.approx(1 / 10)
  assert tally.finished[3, "attention"] == [{"summed3@1": pytest.approx(1.0)}]
  summary = tally.summary()["attention"]
  assert summary["summed3@1"] == pytest.approx(1.0)  # the open window: none
  assert summary["stale3@1"] == pytest.approx(1 / 10)
  tally.add(4, _grads(noise + np.outer(E[2], F[0])))  # e1 kept: 9 of 10
  assert tally.summary()["attention"]["summed3@1"] == pytest.approx(
      (1.0 + 9 / 10) / 2
  )


def test_energy_weighs_a_groups_matrices():
  """Two layers: kept energy over total energy, not a mean of fractions:
  (9 + 1) / (9 + 1 + 1 + 1) at rank 1 where the layers keep 9/10 and 1/2."""
  tally = gradient_spectrum.Tally([1], windows=[10])
  big = 3 * np.outer(E[0], F[0]) + np.outer(E[1], F[1])
  even = np.outer(E[2], F[0]) + np.outer(E[3], F[1])
  tally.add(0, {"layers": {"down_proj": np.stack([big, even])}})
  assert tally.steps[0]["mlp"]["fresh@1"] == pytest.approx(10 / 12)


def test_a_zero_gradient_has_no_fractions_and_defers_the_window():
  """A step whose group's gradient is zero is not counted; a window that
  starts there takes its projectors at the next step with a gradient."""
  tally = gradient_spectrum.Tally([1], windows=[2])
  tally.add(0, _grads(np.zeros((4, 2))))
  tally.add(1, _grads(np.outer(E[1], F[0])))
  tally.add(2, _grads(np.outer(E[3], F[1])))  # a new window: refreshed
  tally.add(3, _grads(np.outer(E[1], F[0])))
  assert "attention" not in tally.steps[0]
  assert tally.steps[1]["attention"]["refresh2"]
  assert tally.steps[2]["attention"]["refresh2"]
  assert tally.steps[3]["attention"]["stale2@1"] == pytest.approx(0.0)
  assert tally.summary()["attention"]["steps"] == 3


@pytest.mark.parametrize(
    "name, group",
    [
        ("embed", "embedding"),
        ("lm_head", "embedding"),
        ("v_proj", "attention"),
        ("gate_proj", "mlp"),
        ("final_norm", None),
    ],
)
def test_groups_follow_the_studys_levers(name, group):
  tally = gradient_spectrum.Tally([1], windows=[1])
  tally.add(0, {name: np.outer(E[0], F[0])})
  assert set(tally.steps[0]) - {"step"} == ({group} if group else set())
