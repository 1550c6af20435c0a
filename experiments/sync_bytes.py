"""Bytes per step of policy sync: LoGRA's message vs a full bfloat16
broadcast vs a sparse delta of the changed bfloat16 values.

For each model and rank, builds the learner's factored policy on abstract
shapes (`learner.init_train_state` under `jax.eval_shape`: nothing is
allocated) and sums the arrays a `logra_jax.rollout.sync.SyncMessage`
carries: per step the window coordinates A (float32 `[batch, rank, short]`
per projected matrix), the scales c and the dense leaves (float32); at a
refresh also the new projectors (float32 `[batch, long, rank]`, shown per
refresh and amortized over `--refresh-every` steps). Against: a full
broadcast of the bfloat16 weights (2 bytes per parameter, what TRL and
OpenRLHF send) and a sparse delta of the bfloat16 values that changed
(int32 index + bfloat16 value, 6 bytes per changed value, as verl-style
delta sync sends) at 1% and 3% changed values. Writes nothing; prints a
markdown table.

Run: python experiments/sync_bytes.py [--models qwen2.5-7b qwen3-style-27b]
     [--ranks 16 32 64] [--refresh-every 50]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np

from logra_jax import memory
from logra_jax import models
from logra_jax.configs import train as train_config
from logra_jax.rl import learner
from logra_jax import sync

SPARSE_BYTES_PER_VALUE = 4 + 2   # int32 index + bfloat16 value


def message_bytes(model: str, rank: int, project_embeddings: bool
                  ) -> dict[str, int]:
  """Bytes a sync message carries, by kind of array, and the parameters."""
  config = dataclasses.replace(memory.load_model_config(model),
                               dtype="bfloat16", param_dtype="float32")
  _, params = models.split_model(
      jax.eval_shape(lambda: models.init_model(config, rngs=0)))
  opt_config = train_config.OptimizerConfig(
      rank=rank, project_embeddings=project_embeddings)
  tx = learner.make_optimizer(opt_config, params)

  def state(params):
    weights, opt_state = learner.init_train_state(opt_config, tx, params)
    return sync.policy_state(weights, opt_state)

  named = sync.named_arrays(jax.eval_shape(state, params))
  out = {kind: 0 for kind in (sync.BASE, sync.COORDS, sync.SCALE,
                              sync.PROJECTOR, sync.DENSE)}
  for kind, x in named.values():
    out[kind] += int(np.prod(x.shape)) * x.dtype.itemsize
  out["params"] = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+",
                      default=["qwen2.5-7b", "qwen3-style-27b"])
  parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
  parser.add_argument("--refresh-every", type=int, default=50)
  args = parser.parse_args()
  mb = lambda b: f"{b / 1e6:,.1f}"
  print("| model | embeddings | rank | LoGRA step MB (A + c + dense) | "
        f"+ projectors per refresh MB | LoGRA mean MB/step (refresh every "
        f"{args.refresh_every}) | full bf16 MB | sparse 1% MB | sparse 3% MB "
        "| full / LoGRA | sparse 1% / LoGRA |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for model in args.models:
    for project_embeddings in (False, True):
      for rank in args.ranks:
        b = message_bytes(model, rank, project_embeddings)
        step = b[sync.COORDS] + b[sync.SCALE] + b[sync.DENSE]
        mean = step + b[sync.PROJECTOR] / args.refresh_every
        full = 2 * b["params"]
        sparse = lambda f: f * b["params"] * SPARSE_BYTES_PER_VALUE
        print(f"| {model} | {'projected' if project_embeddings else 'dense'}"
              f" | {rank} | {mb(step)} | {mb(b[sync.PROJECTOR])} | "
              f"{mb(mean)} | {mb(full)} | {mb(sparse(0.01))} | "
              f"{mb(sparse(0.03))} | {full / mean:,.0f}x | "
              f"{sparse(0.01) / mean:.1f}x |", flush=True)


if __name__ == "__main__":
  main()
