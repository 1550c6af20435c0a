"""DAPO's dynamic sampling (``rollout.dynamic_sampling``): groups of equal
rewards are never trained on, more prompts are drawn until the batch is
full or the bound is spent, and a run with it resumes bit for bit, with the
engine in its own process and asynchronous rollouts."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from logra_jax import configs
from logra_jax.rl import scoring
from logra_jax.rl import trainer
from logra_jax.rollout import engine
from run_fixtures import assert_same_state
from run_fixtures import final_state
from run_fixtures import run_metrics

SMOKE = configs.get_preset("smoke")
QUIET = lambda s: None
GROUP, PROMPTS = SMOKE.rollout.num_generations, SMOKE.rollout.prompts_per_step


def flat_or_parity(prompts, completions, flat, **_):
  """1 for every completion of a flat prompt (a group of equal rewards);
  else the parity of the completion's characters (groups of mixed
  rewards, mostly)."""
  return [
      1.0 if f else float(sum(map(ord, c)) % 2)
      for f, c in zip(flat, completions)
  ]


def _examples(flat, count, start=0):
  return [
      {"prompt": f"{i}+{i}=", "answer": str(2 * i), "flat": flat}
      for i in range(start, start + count)
  ]


@pytest.fixture(scope="module")
def rollout(policy_folder):
  policy = engine.Policy.load(policy_folder)
  config = configs.apply_overrides(
      SMOKE, ["rollout.dynamic_sampling=true", "rollout.max_resample_rounds=3"]
  )
  return functools.partial(
      scoring.rollout_with,
      policy,
      functools.partial(policy.sampler.sample, policy.params),
      config=config,
      rewards=[(flat_or_parity, 1.0)],
  )


def _groups(batch):
  """Per group: whether any of its tokens is trained on, whether its
  advantages are all nonzero."""
  tokens_P = np.asarray(batch.completion_mask_BxT).reshape(PROMPTS, -1).sum(1)
  adv_PxG = np.asarray(batch.advantages_B).reshape(PROMPTS, GROUP)
  return tokens_P > 0, np.all(adv_PxG != 0, axis=1)


def test_groups_of_equal_rewards_are_replaced_never_trained_on(rollout):
  pool = _examples(True, 8) + _examples(False, 8, start=8)
  batch, metrics = rollout(
      examples=_examples(True, PROMPTS), key=jax.random.key(0), pool=pool
  )
  trained_P, varied_P = _groups(batch)
  # Every group trained on has mixed rewards; the others are masked.
  np.testing.assert_array_equal(trained_P, varied_P)
  assert varied_P.any()
  assert metrics["rollout/masked_groups"] == PROMPTS - varied_P.sum()
  # Round 0's 4 flat groups at least were dropped, and no more rounds were
  # spent than needed or allowed.
  assert metrics["rollout/dropped_groups"] >= PROMPTS
  assert 1 <= metrics["rollout/resample_rounds"] <= 3
  if metrics["rollout/masked_groups"]:
    assert metrics["rollout/resample_rounds"] == 3
  # A rollout depends only on its examples and key: the same again.
  again, _ = rollout(
      examples=_examples(True, PROMPTS), key=jax.random.key(0), pool=pool
  )
  for x, y in zip(jax.tree.leaves(batch), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_resampling_stops_after_its_bound(rollout):
  batch, metrics = rollout(
      examples=_examples(True, PROMPTS),
      key=jax.random.key(1),
      pool=_examples(True, 12),
  )
  assert metrics["rollout/resample_rounds"] == 3
  assert metrics["rollout/dropped_groups"] == 4 * PROMPTS
  assert metrics["rollout/masked_groups"] == PROMPTS
  assert not np.asarray(batch.completion_mask_BxT).any()
  assert batch.batch_size == PROMPTS * GROUP  # the learner's shapes stay


def test_it_needs_the_prompts_to_draw_from(rollout):
  with pytest.raises(ValueError, match="dynamic_sampling needs the training"):
    rollout(examples=_examples(True, PROMPTS), key=jax.random.key(2), pool=())


REWARDS = """
def half_flat(prompts, completions, **_):
  # The prompts whose first term is even get 1 for every completion, a group
  # of equal rewards; the others the parity of the completion's characters.
  return [
      1.0 if int(p[0]) % 2 == 0 else float(sum(map(ord, c)) % 2)
      for p, c in zip(prompts, completions)
  ]
"""


def test_a_run_with_it_resumes_bit_exactly(policy_folder, tmp_path):
  (tmp_path / "rewards.py").write_text(REWARDS)
  config = configs.apply_overrides(
      SMOKE,
      [
          f"policy.path={policy_folder}",
          "steps=3",
          "checkpoint.every_steps=1",
          "rollout.dynamic_sampling=true",
          f"rewards=[{{function: '{tmp_path}/rewards.py:half_flat'}}]",
      ],
  )
  trainer.train(config, tmp_path / "straight", progress=False, log=QUIET)
  resumed = tmp_path / "resumed"
  trainer.train(
      dataclasses.replace(config, steps=2), resumed, progress=False, log=QUIET
  )
  trainer.train(config, resumed, progress=False, log=QUIET, resume=True)
  assert_same_state(
      final_state(tmp_path / "straight", config), final_state(resumed, config)
  )
  rows = run_metrics(tmp_path / "straight")
  assert run_metrics(resumed) == rows
  # Groups were dropped and replaced, and the run trained on the rest.
  assert sum(row["rollout/dropped_groups"] for row in rows) > 0
  assert all(row["rollout/masked_groups"] < PROMPTS for row in rows)
  assert all(row["grad_norm"] > 0 for row in rows)


def test_it_runs_with_the_engine_in_a_process_one_step_off_policy(
    policy_folder, tmp_path
):
  config = configs.apply_overrides(
      SMOKE,
      [
          f"policy.path={policy_folder}",
          "steps=2",
          "rollout.dynamic_sampling=true",
          "rollout.max_staleness=1",
          "rollout.engine=process",
      ],
  )
  trainer.train(config, tmp_path, progress=False, log=QUIET)
  rows = run_metrics(tmp_path)
  assert [row["rollout/version_lag"] for row in rows] == [0.0, 1.0]
  assert all(row["rollout/resample_rounds"] == 3 for row in rows)
  assert all(np.isfinite(row["loss"]) for row in rows)
