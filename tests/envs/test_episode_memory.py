"""The planner with multi-turn episodes: a later turn's sampling program
prefills the episode's history, and the shared engine's reservation holds
it."""

import pytest

from logra_jax import cli
from logra_jax import memory
from logra_jax import models

CONFIG = models.DecoderConfig.tiny()
ROLLOUT = {"seq_len": 64, "rollout_seqs": 8, "rollout_tokens": 64}


def test_the_reservation_covers_the_last_turn_after_the_longest_history():
  single = memory.plan_memory(CONFIG, **ROLLOUT)
  episodes = memory.plan_memory(CONFIG, rollout_turn_tokens=8, **ROLLOUT)
  # The last turn prefills 56 history tokens where the single-turn program
  # prefills 16: more temporaries, the rest of the plan unchanged.
  assert episodes.rollout > single.rollout
  assert episodes.train_total == single.train_total
  # The shared engine samples between steps: the plan holds the larger phase.
  assert episodes.total == episodes.train_total + max(
      0, episodes.rollout - episodes.step_phase
  )
  assert "turns of 8 tokens" in episodes.description
  # Turns of 48 tokens after a history of 16: the single-turn program.
  same = memory.plan_memory(CONFIG, rollout_turn_tokens=48, **ROLLOUT)
  assert same.rollout == single.rollout


def test_a_turn_as_long_as_the_rollout_is_refused(capsys):
  with pytest.raises(ValueError, match="rollout_turn_tokens must be below"):
    memory.plan_memory(CONFIG, rollout_turn_tokens=64, **ROLLOUT)
  status = cli.main(
      ["memory", "--model", "tiny", "--rollout-seqs", "8"]
      + ["--rollout-tokens", "64", "--rollout-turn-tokens", "64"]
  )
  assert status == 2
  assert "--rollout-turn-tokens must be below" in capsys.readouterr().err
