"""Rewards under deadlines: an import that blocks is refused like a call
that does, and a reward slower than its batch deadline stops there with a
warning naming it and its time."""

import time

import pytest

from logra_jax import configs
from logra_jax.cli import main as cli_main
from logra_jax.rl import rewards
from logra_jax.rl import setup

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
  assert report.late["_slow"].seconds >= 1.0
  assert report.late["_slow"].deadline_s == 1.0
  lines = []
  rewards.RewardFailureWarnings(lines.append)(report)
  assert lines[0].startswith(
      f"warning: reward _slow took {report.late['_slow'].seconds:.1f} s on a "
      f"batch of {n} samples and was stopped at its batch deadline of 1 s "
      f"(rewards.batch_timeout_s); {n - scored} sample(s) scored 0 as timeouts"
  )


def test_a_timed_reward_keeps_its_own_batch_deadline():
  n = 20
  timed = rewards.TimedReward(_slow, batch_timeout_s=0.5)
  start = time.monotonic()
  report = rewards.evaluate_rewards(
      [(timed, 1.0), (rewards.exact_match, 1.0)],
      ["q"] * n,
      ["a"] * n,
      {"answer": ["a"] * n},
      timeout_s=5.0,
      batch_timeout_s=600.0,  # the default of the others, not the timed one's
  )
  assert time.monotonic() - start < 0.5 + SLACK_S
  assert list(report.late) == ["_slow"]
  assert report.late["_slow"].deadline_s == 0.5
  assert report.per_function["exact_match"].tolist() == [1.0] * n


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), float("inf")])
def test_a_batch_deadline_must_be_a_positive_finite_number(seconds):
  with pytest.raises(ValueError, match=r"^rewards\.batch_timeout_s must be"):
    configs.RewardConfig(batch_timeout_s=seconds)
  with pytest.raises(ValueError, match=r"^rewards\.batch_timeout_s must be"):
    rewards.TimedReward(_slow, batch_timeout_s=seconds)


def test_a_runs_rewards_carry_their_configured_batch_deadlines():
  config = configs.TrainConfig(
      rewards=[
          configs.RewardConfig(batch_timeout_s=3.5),
          configs.RewardConfig(
              function="logra_jax.rl.rewards:exact_match", weight=0.5
          ),
      ]
  )
  task = setup.load_task(config)
  (verifier, _), (exact, weight) = setup.run_rewards(config, task)
  assert verifier.batch_timeout_s == 3.5
  assert exact.fn is rewards.exact_match and weight == 0.5
  assert exact.batch_timeout_s == configs.RewardConfig().batch_timeout_s


def test_a_reward_within_its_batch_deadline_is_not_late():
  report = rewards.evaluate_rewards(
      [(rewards.exact_match, 1.0)], ["q"] * 4, ["1"] * 4, {"answer": ["1"] * 4}
  )
  assert report.late == {} and report.timeouts == {"exact_match": 0}
  assert report.rewards.tolist() == [1.0] * 4


@pytest.mark.parametrize("seconds", ["0", "nan", ".inf"])
def test_a_bad_batch_deadline_is_refused_before_the_run_folder(
    seconds, tmp_path, capsys
):
  out = tmp_path / "out"
  reward = f"rewards=[{{function: task, batch_timeout_s: {seconds}}}]"
  args = ["train", "--preset=smoke", f"--out={out}", "--set", reward]
  assert cli_main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      "logra train: error: rewards.batch_timeout_s must be"
  ), err
  assert not out.exists()
