"""Training runs in environments: the smoke run with the calculator, and a
multi-turn run whose learner scores each turn as the sampler drew it."""

import json
import math
import textwrap

import numpy as np
import pytest

from logra_jax import configs
from logra_jax import models
from logra_jax.data.tokenizer import char_tokenizer
from logra_jax.rl import trainer
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

SMOKE = configs.get_preset("smoke")

ALWAYS_AGAIN = """
from logra_jax import envs

class Again:
  stop_strings = ()

  def reset(self, example):
    return [{"role": "user", "content": example["prompt"]}]

  def step(self, model_message):
    return envs.StepResult([{"role": "user", "content": "again"}], reward=0.5)

def again():
  return Again()
"""

# Every other environment made hangs in reset, the others in their first
# step, until the process ends.
HANGING = """
import threading

from logra_jax import envs

made = []

class Hanging:
  def __init__(self):
    made.append(self)
    self.in_reset = len(made) % 2 == 0

  def reset(self, example):
    if self.in_reset:
      threading.Event().wait()
    return [{"role": "user", "content": example["prompt"]}]

  def step(self, model_message):
    threading.Event().wait()

def hanging():
  return Hanging()
"""


def run(tmp_path, policy_folder, *overrides):
  config = configs.apply_overrides(
      SMOKE,
      [
          f"policy.path={policy_folder}",
          "steps=2",
          "task.eval_size=4",
          "rollout.prompts_per_step=2",
          *overrides,
      ],
  )
  summary = trainer.train(
      config, tmp_path / "run", progress=False, log=lambda s: None
  )
  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  return summary, [json.loads(line) for line in lines]


def test_a_smoke_run_with_the_calculator(tmp_path, policy_folder):
  summary, history = run(tmp_path, policy_folder, "task.environment=calculator")
  assert summary["steps"] == 2 and summary["skipped_steps"] == 0
  for metrics in history:
    assert metrics["env/turns_per_episode"] == 1.0  # max_turns=1
    assert metrics["env/failures"] >= 0 and metrics["env/tool_calls"] >= 0
    assert metrics["batch/completion_width"] <= SMOKE.rollout.max_new_tokens


def test_multi_turn_episodes_train_on_what_was_sampled(
    tmp_path, policy_folder, monkeypatch
):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "again.py").write_text(textwrap.dedent(ALWAYS_AGAIN))
  _, history = run(
      tmp_path,
      policy_folder,
      "task.environment=again.py:again",
      "rollout.max_turns=3",
  )
  # The decoder of the policy_folder fixture (run_fixtures.make_policy).
  config = models.DecoderConfig.tiny(
      vocab_size=len(char_tokenizer()), max_position_embeddings=64
  )
  # The sampler (prefill, then one token at a time against the cache) and
  # the learner (one pass over each row) run the same float32 math in
  # another order (tests/tolerances.py), over the context and the
  # vocabulary; |log p| of the random tiny policy is about log V, bounded
  # here by twice that.
  length = config.max_position_embeddings
  n = decoder_reduction_length(config, length) + config.vocab_size
  gap = 2 * float_tolerance(np.float32, n) * 2 * math.log(config.vocab_size)
  for metrics in history:
    assert metrics["env/turns_per_episode"] == 3.0
    assert metrics["env/truncated_fraction"] == 1.0
    assert metrics["reward/environment"] == pytest.approx(1.5)
    # The learner's log-probs of every turn, after the environment's
    # tokens, are the sampler's (same weights, same context).
    assert metrics["rollout/logprob_gap_max"] <= gap


def test_a_run_whose_environment_hangs_finishes_counting_timeouts(
    tmp_path, policy_folder, monkeypatch
):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "hanging.py").write_text(textwrap.dedent(HANGING))
  summary, history = run(
      tmp_path,
      policy_folder,
      "task.environment=hanging.py:hanging",
      "rollout.max_turns=2",
      "rollout.env_timeout_s=0.05",
  )
  assert summary["steps"] == 2
  episodes = 2 * SMOKE.rollout.num_generations  # prompts_per_step=2
  for metrics in history:
    assert metrics["env/timeouts"] == metrics["env/failures"] == episodes
    # Half hung in reset (no turn), half in their first step (one turn).
    assert metrics["env/turns_per_episode"] == 0.5
    assert metrics["reward/environment"] == 0.0
    assert metrics["env/truncated_fraction"] == 0.0
