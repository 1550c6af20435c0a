"""Per-device train-step memory of dense Adam, LoRA and LoGRA on an 8-device mesh.

For each model preset (and `tiny`, the main job's model), compiles the real
train step (abstract inputs, 8 CPU devices unless 8 accelerators are present)
and reads XLA's memory analysis: seq 4096, micro-batch 1 per device, block
remat, fsdp=8, LoGRA rank 64, with LoGRA taking either full gradients
(`dense`, then projected) or sketch-direct ones (`sketch`, the default), and
in sketch mode with the embedding table and LM head projected too, and that
with a bfloat16 base (factored weights `W = c B + P A`). The system columns
are the train step plus the colocated rollout engine at its real cost: it
samples with the learner's own arrays (zero-copy, the default engine), so
it adds the sampling program's temporaries and outputs, the KV cache of 64
sequences x 8192 tokens among them (`memory.shared_rollout_bytes`); for
comparison, the asynchronous engine's own bfloat16 copy of the weights and
its KV cache (`memory.rollout_reservation`, `logra memory --rollout-copy`).
LoRA (AdamW on rank-64 adapters of every attention and MLP matrix,
everything else frozen) runs on a float32 and on a bfloat16 frozen base.
Writes `memory_table.md` (with a provenance footer: commit, date, machine,
versions, the command) and `memory_table.csv` under `--results` (default
`experiments/results/memory_table/`).

`--check` instead compares the planner with the peak resident memory measured
while the same step runs on this machine's CPU (one device), for a small
config, and prints the ratio.

Run: python experiments/memory_table.py [--models ...]
     [--results experiments/results/memory_table]
     python experiments/memory_table.py --check
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import dataclasses
import gc
import pathlib
import subprocess
import sys

import jax
import provenance
import study

from logra_jax import memory
from logra_jax import models
from logra_jax import parallel

GIB = 2**30


def _rss(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"{field} not in /proc/self/status")


def measured_vs_planned(
    optimizer: str, config: models.DecoderConfig, seq_len: int, micro_batch: int
) -> tuple[int, int]:
  """(measured peak bytes, planned total bytes) of one step on one CPU device.

  The measured figure is the growth of the process's resident set from just
  before the inputs are allocated to its high-water mark after the step
  (Linux, glibc: freed pages are returned with ``malloc_trim`` and the mark
  is reset through ``/proc/self/clear_refs`` once the inputs exist).
  """
  import jax.numpy as jnp
  from logra_jax import configs
  from logra_jax.rl import algo, learner
  from logra_jax import policy_state

  report = memory.plan_memory(
      config, optimizer=optimizer, seq_len=seq_len, micro_batch=micro_batch
  )
  config = dataclasses.replace(
      config,
      remat="block",
      dtype="bfloat16",
      param_dtype="float32",
      max_position_embeddings=seq_len,
  )
  mesh = parallel.make_mesh(parallel.MeshConfig(), jax.devices()[:1])
  opt_config = configs.OptimizerConfig(name=optimizer, rank=64, warmup_steps=0)
  graphdef, abstract = models.split_model(
      jax.eval_shape(lambda: models.init_model(config, rngs=0))
  )
  params_sharding = parallel.param_shardings(abstract, mesh)
  tx = policy_state.make_optimizer(opt_config, abstract)
  state_sharding = parallel.optimizer_state_shardings(
      tx, abstract, params_sharding, mesh
  )
  abstract_weights = policy_state.abstract_weights(opt_config, tx, abstract)
  weights_sharding = parallel.weight_shardings(
      abstract_weights, params_sharding, mesh
  )
  prompt = seq_len // 4
  tokens = lambda n: jax.random.randint(
      jax.random.key(n), (micro_batch, seq_len), 0, config.vocab_size
  )
  batch = algo.RolloutBatch(
      prompt_tokens_BxP=tokens(0)[:, :prompt],
      prompt_mask_BxP=jnp.ones((micro_batch, prompt), jnp.int32),
      completion_tokens_BxT=tokens(1)[:, prompt:],
      completion_mask_BxT=jnp.ones((micro_batch, seq_len - prompt), jnp.int32),
      old_logp_BxT=jnp.zeros((micro_batch, seq_len - prompt)),
      advantages_B=jnp.linspace(-1.0, 1.0, micro_batch),
      num_generations=micro_batch,
  )
  batch_sharding = parallel.data_shardings(batch, mesh)
  run = dataclasses.replace(configs.TrainConfig(), optimizer=opt_config)
  step = learner.make_train_step(
      graphdef,
      tx,
      run,
      shardings=(weights_sharding, state_sharding, batch_sharding),
  )
  abstract_state = jax.eval_shape(tx.init, abstract)
  compiled = step.lower(abstract_weights, abstract_state, batch).compile()
  batch = jax.device_put(batch, batch_sharding)
  init_params = jax.jit(
      lambda: models.split_model(models.init_model(config, rngs=0))[1],
      out_shardings=params_sharding,
  )
  init_state = jax.jit(
      lambda p: policy_state.init_train_state(opt_config, tx, p),
      out_shardings=(weights_sharding, state_sharding),
  )
  jax.block_until_ready(init_state(init_params()))  # compile both first
  trim = ctypes.CDLL("libc.so.6").malloc_trim  # return freed pages to the OS
  gc.collect()
  trim(0)
  before = _rss("VmRSS:")
  params, state = init_state(init_params())
  jax.block_until_ready((params, state, batch))
  trim(0)  # drop the initializers' scratch, keep the inputs
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark to the current resident set
  jax.block_until_ready(compiled(params, state, batch))
  return _rss("VmHWM:") - before, report.total


TINY = models.DecoderConfig.tiny(
    vocab_size=100,
    hidden_size=128,
    intermediate_size=384,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
)  # the `tiny` preset's policy
CHECK_CONFIG = models.DecoderConfig.tiny(
    vocab_size=16384,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
)


ARMS = (  # name, optimizer, gradients, embeddings projected, base, system
    ("adam", "adam", "dense", False, "float32", True),
    ("logra-dense", "logra", "dense", False, "float32", False),
    ("logra", "logra", "sketch", False, "float32", True),
    ("logra-embeddings", "logra", "sketch", True, "float32", True),
    ("logra-bf16-base", "logra", "sketch", True, "bfloat16", True),
    ("lora", "lora", "dense", False, "float32", False),
    ("lora-bf16-base", "lora", "dense", False, "bfloat16", False),
)


def plan_rows(args: argparse.Namespace) -> list[dict]:
  """One row per model and arm: the train step's plan and, for the arms of
  the system columns, the colocated zero-copy engine's reservation (the
  sampling program on the learner's own arrays) and the separate bfloat16
  copy of the asynchronous engine (``--rollout-copy``)."""
  mesh = parallel.MeshConfig.parse(args.mesh)
  rows = []
  for name in args.models:
    model = TINY if name == "tiny" else name
    config = TINY if name == "tiny" else memory.load_model_config(name)
    copy = memory.rollout_reservation(
        config, mesh, args.rollout_seqs, args.rollout_tokens
    )
    for arm, optimizer, gradient_mode, embeddings, base, system in ARMS:
      report = memory.plan_memory(
          model,
          mesh=mesh,
          optimizer=optimizer,
          rank=args.rank,
          seq_len=args.seq,
          rollout_seqs=args.rollout_seqs if system else 0,
          rollout_tokens=args.rollout_tokens if system else 0,
          device_memory_gib=args.device_memory_gib,
          gradient_mode=gradient_mode,
          project_embeddings=embeddings,
          base_dtype=base,
      )
      train_total = report.train_total
      limit = args.device_memory_gib * GIB
      rows.append(
          {
              "model": name,
              "optimizer": arm,
              **{
                  k: v
                  for k, v in report.to_dict().items()
                  if isinstance(v, int)
              },
              "train_total": train_total,
              "system_total": report.total if system else None,
              "system_fits": report.total <= limit if system else None,
              "rollout_copy": copy,
              "system_copy_total": train_total + copy,
              "system_copy_fits": train_total + copy <= limit,
          }
      )
      print(report.summary(), flush=True)
  return rows


def _gib(b: int) -> str:
  return f"{b / GIB:.1f}" if b >= GIB / 10 else f"{b / 2**20:.1f} MiB"


def header(args: argparse.Namespace) -> list[str]:
  """The settings line and the table's header."""
  return [
      f"GiB per device; mesh {args.mesh}, seq {args.seq}, micro-batch "
      f"1/device, block remat, LoGRA rank {args.rank}; weights: float32 "
      "(Adam, dense gradients), factored W = c B + P A with a float32 or "
      "bfloat16 base B (sketch-direct). System = the train step + the "
      "colocated rollout engine at its real cost: it samples with the "
      "learner's own arrays (zero-copy, the default engine), so it adds the "
      "sampling program's temporaries and outputs (the KV cache of "
      f"{args.rollout_seqs} x {args.rollout_tokens} tokens among them), "
      "compiled on the learner's layout. For comparison, the asynchronous "
      "engine (`logra memory --rollout-copy`) holds its own bfloat16 copy "
      "of the weights plus the KV cache. fits: <= "
      f"{args.device_memory_gib:g} GiB per device",
      "",
      "| model | params | Adam: state / grads / temps / train step | "
      "LoGRA, dense gradients: same | LoGRA, sketch-direct: same | "
      "LoGRA, sketch-direct, embeddings projected: same | "
      "same, bfloat16 base: params / state / temps / train step | "
      "temp + unaliased output: dense -> sketch gradients | train step vs "
      "Adam: LoGRA (sketch) / embeddings projected / + bfloat16 base | "
      "system (train step + zero-copy colocated engine): Adam | system: "
      "LoGRA (sketch) / embeddings projected / + bfloat16 base | colocated "
      "engine's reservation, LoGRA + bfloat16 base: zero-copy / own copy "
      "(asynchronous engine) | train step + own-copy engine: LoGRA + "
      "bfloat16 base | LoRA: params / state / temps / train step | LoRA, "
      "bfloat16 base: same | train step vs Adam: LoRA / LoRA, bfloat16 base "
      "|",
      "|---|---:|" + "---:|" * 14,
  ]


def table_line(name: str, rows: list[dict]) -> str:
  """The table's row of one model."""
  adam, dense, sketch, embeddings, bf16, lora, lora_bf16 = (
      next(r for r in rows if r["model"] == name and r["optimizer"] == arm)
      for arm, *_ in ARMS
  )
  size = (
      f"{adam['num_params'] / 1e9:.2f}B"
      if adam["num_params"] > 1e8
      else f"{adam['num_params'] / 1e6:.2f}M"
  )
  cell = lambda r: (
      f"{_gib(r['optimizer_state'])} / {_gib(r['grads'])} / "
      f"{_gib(r['temporaries'])} / **{_gib(r['train_total'])}**"
  )
  fits = lambda total, ok: f"{_gib(total)} ({'fits' if ok else 'OOM'})"
  system = lambda r: fits(r["system_total"], r["system_fits"])
  step = lambda r: r["grads"] + r["temporaries"] + r["outputs"]
  change = lambda r: (
      f"{100 * (r['train_total'] / adam['train_total'] - 1):+.1f}%"
  )
  with_params = lambda r: (
      f"{_gib(r['params'])} / {_gib(r['optimizer_state'])} / "
      f"{_gib(r['temporaries'])} / **{_gib(r['train_total'])}**"
  )
  return (
      f"| {name} | {size} | {cell(adam)} | {cell(dense)} | {cell(sketch)} | "
      f"{cell(embeddings)} | {with_params(bf16)} | {_gib(step(dense))} -> "
      f"{_gib(step(sketch))} | {change(sketch)} / {change(embeddings)} / "
      f"{change(bf16)} | {system(adam)} | {system(sketch)} / "
      f"{system(embeddings)} / {system(bf16)} | {_gib(bf16['rollout'])} / "
      f"{_gib(bf16['rollout_copy'])} | "
      f"{fits(bf16['system_copy_total'], bf16['system_copy_fits'])} | "
      f"{with_params(lora)} | {with_params(lora_bf16)} | "
      f"{change(lora)} / {change(lora_bf16)} |"
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--models", nargs="+", default=["tiny", *memory.MODEL_PRESETS]
  )
  parser.add_argument("--mesh", default="fsdp=8")
  parser.add_argument("--rank", type=int, default=64)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--rollout-seqs", type=int, default=64)
  parser.add_argument("--rollout-tokens", type=int, default=8192)
  parser.add_argument("--device-memory-gib", type=float, default=80.0)
  parser.add_argument(
      "--results",
      type=pathlib.Path,
      default=study.RESULTS / "memory_table",
      help="folder for memory_table.md and memory_table.csv",
  )
  parser.add_argument("--check", action="store_true")
  parser.add_argument(
      "--check-one", choices=["adam", "logra"], help=argparse.SUPPRESS
  )
  args = parser.parse_args()
  if args.check:  # one fresh process per optimizer: a clean resident set
    for optimizer in ("adam", "logra"):
      subprocess.run(
          [sys.executable, __file__, "--check-one", optimizer], check=True
      )
    return
  if args.check_one:
    measured, planned = measured_vs_planned(
        args.check_one, CHECK_CONFIG, 512, 8
    )
    print(
        f"{args.check_one}: planned {planned / 2**20:.1f} MiB, measured "
        f"peak {measured / 2**20:.1f} MiB, measured / planned "
        f"{measured / planned:.3f}"
    )
    return
  unknown = sorted(set(args.models) - {"tiny", *memory.MODEL_PRESETS})
  if unknown:
    parser.error(f"--models: unknown presets {unknown}")
  rows = plan_rows(args)
  record = provenance.collect(provenance.this_command(), "not computed")
  args.results.mkdir(parents=True, exist_ok=True)
  with open(args.results / "memory_table.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=["commit", "date", *rows[0]])
    writer.writeheader()
    writer.writerows(
        {"commit": record["commit"], "date": record["date"], **r} for r in rows
    )
  lines = header(args) + [table_line(name, rows) for name in args.models]
  table = "\n".join(lines + ["", provenance.footer(record)])
  (args.results / "memory_table.md").write_text(table + "\n")
  print(table)


if __name__ == "__main__":
  main()
