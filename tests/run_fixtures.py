"""Fixtures and helpers of the tests that train, checkpoint and resume the
smoke run on a tiny policy (tests/rl/test_resume.py,
tests/checkpoint/test_checkpoint.py)."""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from logra_jax import checkpoint
from logra_jax import configs
from logra_jax import models
from logra_jax import policy_state
from logra_jax.data.tokenizer import char_tokenizer
from logra_jax.rl import trainer
from logra_jax.rollout import engine

SMOKE = configs.get_preset("smoke")
QUIET = lambda s: None


def make_policy(folder, **overrides):
  tokenizer = char_tokenizer()
  config = models.DecoderConfig.tiny(
      **{
          "vocab_size": len(tokenizer),
          "max_position_embeddings": 64,
          "eos_token_ids": (tokenizer.eos_token_id,),
          "bos_token_id": tokenizer.bos_token_id,
          "pad_token_id": tokenizer.pad_token_id,
          **overrides,
      }
  )
  models.save_pretrained(models.init_model(config, rngs=0), folder)
  tokenizer.save_pretrained(folder)
  return folder


@pytest.fixture(scope="module")
def policy_folder(tmp_path_factory):
  return make_policy(tmp_path_factory.mktemp("policy") / "tiny")


def run_overrides(policy_folder, steps=6, every=2):
  return [
      f"policy.path={policy_folder}",
      f"steps={steps}",
      f"checkpoint.every_steps={every}",
  ]


@pytest.fixture(scope="module")
def config(policy_folder):
  return configs.apply_overrides(SMOKE, run_overrides(policy_folder))


@pytest.fixture(scope="module")
def straight(config, tmp_path_factory):
  """6 steps in one go."""
  out = tmp_path_factory.mktemp("straight")
  trainer.train(config, out, progress=False, log=QUIET)
  return out


def final_state(run, config, step=None):
  """Params, optimizer state and loop of a run's checkpoint (the latest)."""
  policy = engine.Policy.load(config.policy.path)
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  one = jax.tree.leaves(policy.params)[0].sharding
  opt_state = checkpoint.abstract_state(
      policy_state.abstract_opt_state(config.optimizer, tx, policy.params), one
  )
  params = checkpoint.abstract_state(
      policy_state.abstract_weights(config.optimizer, tx, policy.params), one
  )
  with checkpoint.Checkpointer(run / "checkpoints", read_only=True) as ckpt:
    return ckpt.restore(step, params=params, opt_state=opt_state)


def run_metrics(run):
  """metrics.jsonl without the timings and compilation counts."""
  lines = (run / "metrics.jsonl").read_text().splitlines()
  return [
      {
          k: v
          for k, v in json.loads(line).items()
          if not k.startswith(("time/", "compile/"))
      }
      for line in lines
  ]


def assert_same_state(a, b):
  for x, y in zip(
      jax.tree.leaves((a.params, a.opt_state)),
      jax.tree.leaves((b.params, b.opt_state)),
      strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert a.loop.data_position == b.loop.data_position
  np.testing.assert_array_equal(
      jax.random.key_data(a.loop.key), jax.random.key_data(b.loop.key)
  )


def copy_run(run, tmp_path):
  return pathlib.Path(shutil.copytree(run, tmp_path / "copy"))


def largest_file(folder):
  return max(
      (p for p in folder.rglob("*") if p.is_file()),
      key=lambda p: p.stat().st_size,
  )


def flip_bytes(path, count=64):
  """XORs ``count`` bytes in the middle of a file: damage that keeps its
  size and, for an array's data, its format."""
  data = bytearray(path.read_bytes())
  middle = len(data) // 2
  data[middle : middle + count] = bytes(
      b ^ 0xFF for b in data[middle : middle + count]
  )
  path.write_bytes(bytes(data))


def set_aside(folder):
  return sorted(p.name.split("-")[0] for p in folder.glob("*.corrupt-*"))
