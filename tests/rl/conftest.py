"""Fixtures shared by the RL tests."""

import jax
import jax.numpy as jnp
import pytest

from logra_jax import configs
from logra_jax.rl import scoring, setup
from logra_jax.rollout import engine
from run_fixtures import config, straight  # noqa: F401
from run_fixtures import make_policy


@pytest.fixture(scope="module")
def policy_folder(tmp_path_factory):
  """A tiny random decoder with the character tokenizer, as an HF folder."""
  return make_policy(tmp_path_factory.mktemp("policy") / "tiny")


@pytest.fixture(scope="module")
def rollout_batch(policy_folder):
  """``(policy, batch, metrics)``: one rollout of 4 smoke-task prompts by
  the tiny policy, scored by the smoke config's rewards."""
  smoke = configs.get_preset("smoke")
  policy = engine.Policy.load(policy_folder)
  task = setup.load_task(smoke)
  batch, metrics = scoring.rollout(
      policy,
      policy.params,
      list(task.examples[:4]),
      smoke,
      setup.run_rewards(smoke, task),
      jax.random.key(1),
  )
  return policy, batch, metrics


@pytest.fixture(scope="module")
def spread_batch(rollout_batch):
  """``(policy, batch)``: :func:`rollout_batch` with advantages spread
  evenly over ``[-1, 1]``, so that a step's gradient is not zero."""
  policy, batch, _ = rollout_batch
  advantages = jnp.linspace(-1.0, 1.0, batch.batch_size)
  return policy, batch.replace(advantages_B=advantages)
