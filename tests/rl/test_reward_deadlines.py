"""Rewards under deadlines: an import that blocks is refused like a call
that does, and a reward slower than its batch deadline stops there with a
warning naming it and its time."""

import time

import pytest

from logra_jax.rl import rewards

SLACK_S = 5.0  # a loaded machine's scheduling, not the rewards' time


def test_a_reward_module_whose_import_blocks_is_refused(tmp_path):
  path = tmp_path / "blocks.py"
  path.write_text(
      "import time\ntime.sleep(30)\n\n"
      "def score(completions, **columns):\n  return [0.0] * len(completions)\n"
  )
  start = time.monotonic()
  with pytest.raises(
      ValueError, match=r"did not finish importing within 0.5 s"
  ):
    rewards.load_reward_function(f"{path}:score", timeout_s=0.5)
  assert time.monotonic() - start < 0.5 + SLACK_S


def _slow(completions, **columns):
  time.sleep(0.2)
  return [1.0]


def test_a_reward_slower_than_its_batch_deadline_stops_with_a_warning():
  n = 20  # 4 s of work against a 1 s deadline
  start = time.monotonic()
  report = rewards.evaluate_rewards(
      [(_slow, 1.0)], ["q"] * n, ["a"] * n, timeout_s=5.0, batch_timeout_s=1.0
  )
  assert time.monotonic() - start < 1.0 + SLACK_S
  scored = int(report.per_function["_slow"].sum())
  assert 0 < scored < n and report.timeouts["_slow"] == n - scored
  assert report.late["_slow"] >= 1.0
  lines = []
  rewards.RewardFailureWarnings(lines.append)(report)
  assert lines[0].startswith(
      f"warning: reward _slow took {report.late['_slow']:.1f} s on a batch "
      f"of {n} samples and was stopped at its batch deadline; {n - scored} "
      "sample(s) scored 0 as timeouts"
  )


def test_a_reward_within_its_batch_deadline_is_not_late():
  report = rewards.evaluate_rewards(
      [(rewards.exact_match, 1.0)], ["q"] * 4, ["1"] * 4, {"answer": ["1"] * 4}
  )
  assert report.late == {} and report.timeouts == {"exact_match": 0}
  assert report.rewards.tolist() == [1.0] * 4
