"""Train-step time of LoGRA with sketch-direct vs dense gradients (and Adam).

Times the learner's real jitted train step (loss over micro-batches, gradient,
optimizer, realized KL) on the main job's default model and rollout batch
(`tiny` preset: 4 layers, width 128, 64 prompts x 8 completions, rank 32), with
random weights and tokens. Non-refresh steps and refresh steps are timed
separately (median of `--repeats`); every figure is also given as a ratio to
the dense-gradient LoGRA step measured in the same run. Also prints the
compiled temp + output bytes of each step (`memory_analysis()`).

Run: python experiments/sketch_step.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from logra_jax import configs
from logra_jax import models
from logra_jax.data.tokenizer import char_tokenizer
from logra_jax.rl import algo
from logra_jax.rl import learner
from logra_jax import policy_state

PROMPT_LEN = 16


def synthetic_batch(
    config: configs.TrainConfig, vocab_size: int
) -> algo.RolloutBatch:
  rows = config.rollout.prompts_per_step * config.rollout.num_generations
  completion = config.rollout.max_new_tokens
  keys = jax.random.split(jax.random.key(0), 3)
  return algo.RolloutBatch(
      prompt_tokens_BxP=jax.random.randint(
          keys[0], (rows, PROMPT_LEN), 0, vocab_size
      ),
      prompt_mask_BxP=jnp.ones((rows, PROMPT_LEN), jnp.int32),
      completion_tokens_BxT=jax.random.randint(
          keys[1], (rows, completion), 0, vocab_size
      ),
      completion_mask_BxT=jnp.ones((rows, completion), jnp.int32),
      old_logp_BxT=jnp.full((rows, completion), -3.0),
      advantages_B=jax.random.normal(keys[2], (rows,)),
      num_generations=config.rollout.num_generations,
  )


def time_steps(
    graphdef, params, batch, config, refresh: bool, repeats: int
) -> tuple[float, int]:
  """(median seconds per step, compiled temp + output bytes)."""
  opt = dataclasses.replace(
      config.optimizer, refresh_every=1 if refresh else 10**6
  )
  config = dataclasses.replace(config, optimizer=opt)
  tx = policy_state.make_optimizer(opt, params)
  step = learner.make_train_step(graphdef, tx, config)
  params, state = policy_state.init_train_state(
      opt, tx, jax.tree.map(jnp.copy, params)
  )
  stats = step.lower(params, state, batch).compile().memory_analysis()
  params, state, _ = step(params, state, batch)  # step 0 refreshes
  jax.block_until_ready(params)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    params, state, metrics = step(params, state, batch)
    jax.block_until_ready((params, metrics))
    times.append(time.perf_counter() - start)
  return (
      statistics.median(times),
      stats.temp_size_in_bytes + stats.output_size_in_bytes,
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args()
  base = configs.get_preset("tiny")
  p = base.policy
  vocab = len(char_tokenizer())
  decoder = models.DecoderConfig.tiny(
      vocab_size=vocab,
      hidden_size=p.hidden_size,
      num_layers=p.num_layers,
      num_heads=p.num_heads,
      num_kv_heads=p.num_kv_heads,
      intermediate_size=p.intermediate_size,
      head_dim=p.hidden_size // p.num_heads,
  )
  graphdef, params = models.split_model(models.init_model(decoder, rngs=0))
  batch = synthetic_batch(base, vocab)
  arms = {
      "logra, dense gradients": dict(name="logra", gradient_mode="dense"),
      "logra, sketch-direct": dict(name="logra", gradient_mode="sketch"),
      "adam": dict(name="adam"),
  }
  results = {}
  for arm, fields in arms.items():
    config = dataclasses.replace(
        base, optimizer=dataclasses.replace(base.optimizer, **fields)
    )
    results[arm] = [
        time_steps(graphdef, params, batch, config, refresh, args.repeats)
        for refresh in (False, True)
    ]
    print(arm, results[arm], flush=True)
  reference = results["logra, dense gradients"]
  print(
      f"\ntiny preset ({sum(x.size for x in jax.tree.leaves(params)):,} "
      f"params, batch {batch.batch_size} x "
      f"{PROMPT_LEN + base.rollout.max_new_tokens} tokens, rank "
      f"{base.optimizer.rank}), median of {args.repeats} steps, "
      f"{jax.devices()[0].platform}\n"
  )
  print(
      "| arm | step (ms) | vs dense-gradient LoGRA | refresh step (ms) | vs "
      "dense-gradient LoGRA | compiled temp + output (MiB) |"
  )
  print("|---|---:|---:|---:|---:|---:|")
  for arm, ((t, mem), (t_refresh, _)) in results.items():
    print(
        f"| {arm} | {1e3 * t:.1f} | {t / reference[0][0]:.2f}x | "
        f"{1e3 * t_refresh:.1f} | {t_refresh / reference[1][0]:.2f}x | "
        f"{mem / 2**20:.1f} |"
    )


if __name__ == "__main__":
  main()
