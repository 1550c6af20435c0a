"""Bytes per step of policy sync: LoGRA's message vs a full bfloat16
broadcast vs a sparse delta of the changed bfloat16 values.

For each model and rank, builds the learner's factored policy on abstract
shapes (`policy_state.abstract_receiver`: nothing is allocated) and sums the
arrays a `logra_jax.sync.SyncMessage` carries: per step the window
coordinates A (`[batch, rank, short]` per projected matrix, float32, or
bfloat16 with ``optimizer.coords_dtype=bfloat16``), the
scales c and the dense leaves (float32); at a refresh also the new
projectors (float32 `[batch, long, rank]`, shown per refresh and amortized
over `--refresh-every` steps). Against: a full
broadcast of the bfloat16 weights (2 bytes per parameter, what TRL and
OpenRLHF send) and a sparse delta of the bfloat16 values that changed
(int32 index + bfloat16 value, 6 bytes per changed value, as verl-style
delta sync sends) at 1% and 3% changed values; and LoRA's message at the
same ranks (its float32 adapters every step, which the engine merges into
its copy of the frozen weights). The row of the default configuration
(``configs.OptimizerConfig()``: its rank, embeddings and refresh period)
is marked. Prints the markdown table and writes it, with the learner-side
figures and a provenance footer (commit, date, machine, versions, the
command; no numerics fingerprint: nothing here trains), to
``sync_bytes.md`` and the rows to ``sync_bytes.json`` under ``--results``
(default ``experiments/results/sync_bytes/``).

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
printed, for the default configuration's policy state.

Run: python experiments/sync_bytes.py [--models qwen2.5-7b qwen3-style-27b]
     [--ranks 8 16 32] [--refresh-every 50] [--run runs/default]
     [--results experiments/results/sync_bytes]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import jax
import numpy as np
import provenance
import study

from logra_jax import checksums
from logra_jax import memory
from logra_jax import models
from logra_jax import configs
from logra_jax import sync
from logra_jax import policy_state
from logra_jax.optim import step_codes

SPARSE_BYTES_PER_VALUE = 4 + 2  # int32 index + bfloat16 value


EMBEDDINGS = ("dense", "projected", "frozen")


def model_policy_state(
    model: str,
    rank: int,
    embeddings: str,
    optimizer: str = "logra",
    coords_dtype: str = "float32",
    kind: str = "range",
) -> tuple[dict, tuple[str, ...], bool, int]:
  """The shapes of the learner's :func:`policy_state.synced_state` for
  ``model`` (float32 weights, default settings of ``optimizer``, "logra" or
  "lora"; LoGRA's ``embeddings`` one of :data:`EMBEDDINGS`), the weights it
  leaves frozen, whether a receiver regenerates its projectors, and its
  parameter count."""
  config = dataclasses.replace(
      memory.load_model_config(model), dtype="bfloat16", param_dtype="float32"
  )
  _, params = models.split_model(
      jax.eval_shape(lambda: models.init_model(config, rngs=0))
  )
  opt_config = configs.OptimizerConfig(
      name=optimizer,
      rank=rank,
      project_embeddings=embeddings == "projected" and optimizer == "logra",
      freeze_embeddings=embeddings == "frozen" and optimizer == "logra",
      coords_dtype=coords_dtype,
      kind=kind,
  )
  count = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  state, source = policy_state.abstract_receiver(opt_config, params)
  frozen = policy_state.frozen_keys(opt_config)
  return state, frozen, source is not None, count


def checksum_temp_bytes(state: dict) -> int:
  """Temporaries of the compiled checksum program over every array of an
  abstract policy state (what the learner computes for each message)."""
  leaves = [x for _, x in sync.named_arrays(state).values()]
  return memory.compiled_memory(
      checksums.leaf_checksums.lower(leaves)
  ).temp_size_in_bytes


def message_bytes(
    model: str,
    rank: int,
    embeddings: str,
    optimizer: str = "logra",
    coords_dtype: str = "float32",
    kind: str = "range",
    step_bits: int | None = None,
) -> dict[str, int]:
  """Bytes a sync message carries, by kind of array (a refresh's
  projectors: none when the receiver regenerates them; with ``step_bits``,
  a step's codes and exponents in place of the coordinates), and the
  parameters."""
  state, frozen, regenerated, count = model_policy_state(
      model, rank, embeddings, optimizer, coords_dtype, kind
  )
  named = sync.named_arrays(state, frozen)
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
    if kind == sync.COORDS and step_bits is not None:
      codes = step_codes.code_shape(x.shape, step_bits)
      out[kind] += int(np.prod(codes)) + int(np.prod(x.shape[:2]))
      out[kind] -= int(np.prod(x.shape)) * x.dtype.itemsize
  if regenerated:
    out[sync.PROJECTOR] = 0
  out["params"] = count
  return out


def per_step(
    message: dict[str, int], optimizer: str, refresh_every: int
) -> tuple[int, int, float]:
  """Of :func:`message_bytes`: the bytes each step's message carries
  (LoGRA's coordinates or step codes, scales and dense leaves; LoRA's
  adapters and dense leaves), those a refresh adds (LoGRA's projectors,
  none when regenerated), and their mean a step with a refresh every
  ``refresh_every`` steps."""
  if optimizer == "lora":  # adapters every step, merged by the engine
    step, projector = message[sync.ADAPTER] + message[sync.DENSE], 0
  else:
    step = sum(message[k] for k in (sync.COORDS, sync.SCALE, sync.DENSE))
    projector = message[sync.PROJECTOR]
  return step, projector, step + projector / refresh_every


def embeddings_of(config: configs.OptimizerConfig) -> str:
  """The :data:`EMBEDDINGS` entry of ``config``."""
  if config.freeze_embeddings:
    return "frozen"
  return "projected" if config.project_embeddings else "dense"


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


def is_default(
    optimizer: str,
    rank: int,
    embeddings: str,
    refresh_every: int,
    coords_dtype: str,
    kind: str,
    step_bits: int | None,
) -> bool:
  """Whether a row is the default configuration (``OptimizerConfig()``)."""
  default = configs.OptimizerConfig()
  row = (
      optimizer,
      rank,
      embeddings,
      refresh_every,
      coords_dtype,
      step_bits,
  )
  return row == (
      default.name,
      default.rank,
      embeddings_of(default),
      default.refresh_every,
      default.coords_dtype,
      default.step_bits,
  ) and (optimizer != "logra" or kind == default.kind)


def model_rows(model: str, ranks: list[int], refresh_every: int) -> list[dict]:
  """Bytes per step of LoGRA's message (embeddings dense, projected,
  projected with bfloat16 coordinates, and so with random projectors, which
  the receiver regenerates; projected with 4-bit steps, with range and
  random projectors, and 8-bit steps with random ones; frozen, with 4-bit
  steps, with range and random projectors) and of LoRA's at each rank, with
  the full bfloat16 broadcast and sparse deltas beside them."""
  rows = []
  arms = [
      ("logra", "dense", "float32", "range", None),
      ("logra", "projected", "float32", "range", None),
      ("logra", "projected", "bfloat16", "range", None),
      ("logra", "projected", "bfloat16", "random", None),
      ("logra", "projected", "float32", "range", 4),
      ("logra", "projected", "float32", "random", 4),
      ("logra", "projected", "float32", "random", 8),
      ("logra", "frozen", "float32", "range", 4),
      ("logra", "frozen", "float32", "random", 4),
      ("lora", "dense", "float32", "range", None),
  ]
  for optimizer, embeddings, coords_dtype, kind, step_bits in arms:
    for rank in ranks:
      b = message_bytes(
          model,
          rank,
          embeddings,
          optimizer,
          coords_dtype,
          kind,
          step_bits,
      )
      step, projector, mean = per_step(b, optimizer, refresh_every)
      if optimizer == "lora":
        embeddings = "LoRA adapters"
      else:
        label = embeddings
        if coords_dtype != "float32":
          label += f", {coords_dtype} A"
        if step_bits is not None:
          label += f", {step_bits}-bit steps"
        if kind != "range":
          label += f", {kind} P"
      rows.append(
          {
              "model": model,
              "embeddings": label if optimizer == "logra" else embeddings,
              "rank": rank,
              "coords_dtype": coords_dtype,
              "step_bits": step_bits,
              "kind": kind,
              "default": is_default(
                  optimizer,
                  rank,
                  embeddings,
                  refresh_every,
                  coords_dtype,
                  kind,
                  step_bits,
              ),
              "step_bytes": step,
              "projector_bytes": projector,
              "mean_bytes": mean,
              "full_bf16_bytes": 2 * b["params"],
              "params": b["params"],
          }
      )
  return rows


def table(rows: list[dict], refresh_every: int, run: dict | None) -> str:
  """The markdown table of :func:`model_rows` (and a run's measured
  changed fraction as one more sparse column)."""
  mb = lambda b: f"{b / 1e6:,.1f}"
  fractions = [0.01, 0.03] + ([] if run is None else [run["changed"]])
  names = ["sparse 1% MB", "sparse 3% MB"] + (
      []
      if run is None
      else [f"sparse {100 * run['changed']:.1f}% (measured) MB"]
  )
  lines = [
      "| model | embeddings | rank | LoGRA step MB (A + c + dense) | "
      "+ projectors per refresh MB | LoGRA mean MB/step (refresh every "
      f"{refresh_every}) | full bf16 MB | "
      + " | ".join(names)
      + " | full / LoGRA | sparse 1% / LoGRA |",
      "|---|---|---:|" + "---:|" * (len(names) + 6),
  ]
  for r in rows:
    sparse = [f * r["params"] * SPARSE_BYTES_PER_VALUE for f in fractions]
    lines.append(
        f"| {r['model']} | {r['embeddings']}"
        + (" (**default**)" if r["default"] else "")
        + f" | {r['rank']} | {mb(r['step_bytes'])} | "
        + (mb(r["projector_bytes"]) if r["projector_bytes"] else "-")
        + f" | {mb(r['mean_bytes'])} | {mb(r['full_bf16_bytes'])} | "
        + " | ".join(mb(s) for s in sparse)
        + f" | {r['full_bf16_bytes'] / r['mean_bytes']:,.0f}x | "
        f"{sparse[0] / r['mean_bytes']:.1f}x |"
    )
  return "\n".join(lines)


def learner_side(model: str) -> dict:
  """The checksum program's compiled temporaries for the default
  configuration's policy state, and the snapshot a sparse delta needs."""
  default = configs.OptimizerConfig()
  state, _, _, count = model_policy_state(
      model, default.rank, embeddings_of(default)
  )
  return {
      "model": model,
      "rank": default.rank,
      "embeddings": embeddings_of(default),
      "checksum_temp_bytes": checksum_temp_bytes(state),
      "snapshot_bf16_bytes": 2 * count,
  }


def run_line(path: pathlib.Path, run: dict) -> str:
  """One sentence of a finished run's measured sync figures."""
  return (
      f"Measured ({path}, steps 2-{run['steps'] + 1}, means per "
      f"step): LoGRA message {run['bytes'] / 1e3:,.1f} kB, full bf16 "
      f"{run['full'] / 1e3:,.1f} kB ({run['full'] / run['bytes']:.1f}x), "
      f"sparse delta {run['sparse'] / 1e3:,.1f} kB "
      f"({run['sparse'] / run['bytes']:.2f}x) at "
      f"{100 * run['changed']:.1f}% of the bfloat16 values changed; "
      f"sync {1e3 * run['seconds']:.1f} ms; {run['resyncs']:.0f} resyncs"
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--models", nargs="+", default=["qwen2.5-7b", "qwen3-style-27b"]
  )
  parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
  parser.add_argument("--refresh-every", type=int, default=50)
  parser.add_argument(
      "--run",
      type=pathlib.Path,
      help="a finished logra train folder to measure",
  )
  parser.add_argument(
      "--results",
      type=pathlib.Path,
      default=study.RESULTS / "sync_bytes",
      help="folder for sync_bytes.md and sync_bytes.json",
  )
  args = parser.parse_args()
  if args.refresh_every < 1 or min(args.ranks) < 1:
    parser.error("--refresh-every and --ranks must be >= 1")
  unknown = sorted(set(args.models) - set(memory.MODEL_PRESETS))
  if unknown:
    parser.error(f"--models: unknown presets {unknown}")
  run = None if args.run is None else measured(args.run)
  parts = [] if run is None else [run_line(args.run, run), ""]
  rows = [
      r
      for m in args.models
      for r in model_rows(m, args.ranks, args.refresh_every)
  ]
  parts.append(table(rows, args.refresh_every, run))
  print("\n".join(parts), flush=True)
  learner = [learner_side(m) for m in args.models]
  for s in learner:
    parts.append(
        f"\nLearner side, {s['model']} (rank {s['rank']}, embeddings "
        f"{s['embeddings']}): the "
        "message's checksums compile to "
        f"{s['checksum_temp_bytes'] / 1e6:,.1f} MB of temporaries; no "
        "snapshot (a sparse delta diffs against one: "
        f"{s['snapshot_bf16_bytes'] / 1e6:,.1f} MB in bfloat16)"
    )
    print(parts[-1], flush=True)
  command = provenance.this_command()
  record = provenance.collect(command, "not computed")
  parts.append("\n" + provenance.footer(record))
  args.results.mkdir(parents=True, exist_ok=True)
  (args.results / "sync_bytes.md").write_text("\n".join(parts) + "\n")
  (args.results / "sync_bytes.json").write_text(
      json.dumps(
          {"rows": rows, "learner": learner, "run": run, "provenance": record},
          indent=1,
      )
      + "\n"
  )


if __name__ == "__main__":
  main()
