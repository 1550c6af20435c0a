"""Bytes per step of policy sync: LoGRA's message vs a full bfloat16
broadcast vs a sparse delta of the changed bfloat16 values.

For each model and rank, builds the learner's factored policy on abstract
shapes (`policy_state.abstract_policy_state`: nothing is allocated) and sums the
arrays a `logra_jax.sync.SyncMessage` carries: per step the window
coordinates A (float32 `[batch, rank, short]` per projected matrix), the
scales c and the dense leaves (float32); at a refresh also the new
projectors (float32 `[batch, long, rank]`, shown per refresh and amortized
over `--refresh-every` steps). Against: a full
broadcast of the bfloat16 weights (2 bytes per parameter, what TRL and
OpenRLHF send) and a sparse delta of the bfloat16 values that changed
(int32 index + bfloat16 value, 6 bytes per changed value, as verl-style
delta sync sends) at 1% and 3% changed values; and LoRA's message at the
same ranks (its float32 adapters every step, which the engine merges into
its copy of the frozen weights). Writes nothing; prints a markdown table.

With ``--run DIR`` (a finished ``logra train`` folder), also the run's
measured figures from its ``metrics.jsonl``: mean message bytes per step, a
full bfloat16 broadcast and the sparse delta of the bfloat16 values that
actually changed (measured by the engine), and the sparse delta of the big
models at that measured changed fraction.

The learner keeps no snapshot of its weights for sync (a sparse delta diffs
against one: 2 bytes per parameter): its message is arrays it holds anyway
plus their checksums, whose compiled temporaries (XLA's memory analysis of
the checksum program on the model's abstract policy state, compiled on CPU
as the memory planner compiles; summed in blocks of a million words) are
printed.

Run: python experiments/sync_bytes.py [--models qwen2.5-7b qwen3-style-27b]
     [--ranks 16 32 64] [--refresh-every 50] [--run runs/default]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import jax
import numpy as np

from logra_jax import checksums
from logra_jax import memory
from logra_jax import models
from logra_jax import configs
from logra_jax import sync
from logra_jax import policy_state

SPARSE_BYTES_PER_VALUE = 4 + 2  # int32 index + bfloat16 value


def model_policy_state(
    model: str, rank: int, project_embeddings: bool, optimizer: str = "logra"
) -> tuple[dict, int]:
  """The shapes of the learner's :func:`sync.policy_state` for ``model``
  (float32 weights, default settings of ``optimizer``, "logra" or "lora")
  and its parameter count."""
  config = dataclasses.replace(
      memory.load_model_config(model), dtype="bfloat16", param_dtype="float32"
  )
  _, params = models.split_model(
      jax.eval_shape(lambda: models.init_model(config, rngs=0))
  )
  opt_config = configs.OptimizerConfig(
      name=optimizer,
      rank=rank,
      project_embeddings=project_embeddings and optimizer == "logra",
  )
  count = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  return policy_state.abstract_policy_state(opt_config, params), count


def checksum_temp_bytes(state: dict) -> int:
  """Temporaries of the compiled checksum program over every array of an
  abstract policy state (what the learner computes for each message)."""
  leaves = [x for _, x in sync.named_arrays(state).values()]
  return memory.compiled_memory(
      checksums.leaf_checksums.lower(leaves)
  ).temp_size_in_bytes


def message_bytes(
    model: str, rank: int, project_embeddings: bool, optimizer: str = "logra"
) -> dict[str, int]:
  """Bytes a sync message carries, by kind of array, and the parameters."""
  state, count = model_policy_state(model, rank, project_embeddings, optimizer)
  named = sync.named_arrays(state)
  out = {
      kind: 0
      for kind in (
          sync.BASE,
          sync.COORDS,
          sync.SCALE,
          sync.PROJECTOR,
          sync.DENSE,
          sync.ADAPTER,
          sync.FROZEN,
      )
  }
  for kind, x in named.values():
    out[kind] += int(np.prod(x.shape)) * x.dtype.itemsize
  out["params"] = count
  return out


def measured(run: pathlib.Path) -> dict[str, float]:
  """Per-step means of a finished run's sync metrics, and the fraction of
  bfloat16 values that changed per step (the first step, a full message, is
  left out)."""
  rows = [json.loads(line) for line in (run / "metrics.jsonl").open()][1:]
  if not rows:
    raise SystemExit(f"{run}/metrics.jsonl has fewer than 2 steps")
  mean = lambda key: float(np.mean([r[key] for r in rows]))
  changed = np.mean(
      [
          r["sync/sparse_delta_bytes"]
          / SPARSE_BYTES_PER_VALUE
          / (r["sync/full_bf16_bytes"] / 2)
          for r in rows
      ]
  )
  return {
      "steps": len(rows),
      "bytes": mean("sync/bytes"),
      "full": mean("sync/full_bf16_bytes"),
      "sparse": mean("sync/sparse_delta_bytes"),
      "seconds": mean("time/sync_s"),
      "changed": float(changed),
      "resyncs": rows[-1]["sync/resyncs"],
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--models", nargs="+", default=["qwen2.5-7b", "qwen3-style-27b"]
  )
  parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
  parser.add_argument("--refresh-every", type=int, default=50)
  parser.add_argument(
      "--run",
      type=pathlib.Path,
      help="a finished logra train folder to measure",
  )
  args = parser.parse_args()
  mb = lambda b: f"{b / 1e6:,.1f}"
  run = None if args.run is None else measured(args.run)
  if run is not None:
    print(
        f"Measured ({args.run}, steps 2-{run['steps'] + 1}, means per "
        f"step): LoGRA message {run['bytes'] / 1e3:,.1f} kB, full bf16 "
        f"{run['full'] / 1e3:,.1f} kB ({run['full'] / run['bytes']:.1f}x), "
        f"sparse delta {run['sparse'] / 1e3:,.1f} kB "
        f"({run['sparse'] / run['bytes']:.2f}x) at "
        f"{100 * run['changed']:.1f}% of the bfloat16 values changed; "
        f"sync {1e3 * run['seconds']:.1f} ms; {run['resyncs']:.0f} "
        "resyncs\n"
    )
  measured_column = (
      ""
      if run is None
      else f" sparse {100 * run['changed']:.1f}% (measured) MB |"
  )
  print(
      "| model | embeddings | rank | LoGRA step MB (A + c + dense) | "
      f"+ projectors per refresh MB | LoGRA mean MB/step (refresh every "
      f"{args.refresh_every}) | full bf16 MB | sparse 1% MB | sparse 3% MB "
      f"|{measured_column} full / LoGRA | sparse 1% / LoGRA |"
  )
  print(
      "|---|---|---:|---:|---:|---:|---:|---:|---:|"
      + ("" if run is None else "---:|")
      + "---:|---:|"
  )
  for model in args.models:
    for project_embeddings in (False, True):
      for rank in args.ranks:
        b = message_bytes(model, rank, project_embeddings)
        step = b[sync.COORDS] + b[sync.SCALE] + b[sync.DENSE]
        mean = step + b[sync.PROJECTOR] / args.refresh_every
        full = 2 * b["params"]
        sparse = lambda f: f * b["params"] * SPARSE_BYTES_PER_VALUE
        print(
            f"| {model} | {'projected' if project_embeddings else 'dense'}"
            f" | {rank} | {mb(step)} | {mb(b[sync.PROJECTOR])} | "
            f"{mb(mean)} | {mb(full)} | {mb(sparse(0.01))} | "
            f"{mb(sparse(0.03))} |"
            + ("" if run is None else f" {mb(sparse(run['changed']))} |")
            + f" {full / mean:,.0f}x | "
            f"{sparse(0.01) / mean:.1f}x |",
            flush=True,
        )
    # LoRA at the same rank: its adapters (float32) every step, merged by
    # the engine into its copy of the frozen weights.
    for rank in args.ranks:
      b = message_bytes(model, rank, False, "lora")
      step = b[sync.ADAPTER] + b[sync.DENSE]
      full = 2 * b["params"]
      sparse = lambda f: f * b["params"] * SPARSE_BYTES_PER_VALUE
      print(
          f"| {model} | LoRA adapters | {rank} | {mb(step)} | - | {mb(step)}"
          f" | {mb(full)} | {mb(sparse(0.01))} | {mb(sparse(0.03))} |"
          + ("" if run is None else f" {mb(sparse(run['changed']))} |")
          + f" {full / step:,.0f}x | {sparse(0.01) / step:.1f}x |",
          flush=True,
      )
  for model in args.models:
    state, count = model_policy_state(model, min(args.ranks), True)
    print(
        f"\nLearner side, {model}: the message's checksums compile to "
        f"{mb(checksum_temp_bytes(state))} MB of temporaries; no snapshot "
        f"(a sparse delta diffs against one: {mb(2 * count)} MB in "
        "bfloat16)",
        flush=True,
    )


if __name__ == "__main__":
  main()
