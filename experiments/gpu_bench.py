"""Speed on one accelerator: train step, decoding and compile times.

(a) The executed train step of dense Adam, LoGRA and LoGRA on factored
weights with a bfloat16 base, at Qwen2.5-1.5B (4 x 4096 tokens) and
Qwen2.5-7B (2 x 4096 tokens) shapes: float32 master weights, bfloat16
compute, block remat, rank 64, attention `auto` (cuDNN's fused kernel on a
GPU). Median step time, the device's peak memory (`memory_stats`) and the
model FLOPs utilization: `6 N T + 12 L H h S T` FLOPs per step (`N`
parameters doing matmuls, `T` tokens, `S` the sequence length; the
rematerialized forward is not counted) over the chip's bfloat16 peak.
(b) Decoding with the sampler (bfloat16 weights and KV cache) at batch 64
and 256, prompt 256, exactly 512 new tokens, at Qwen2.5-0.5B and 1.5B
shapes: tokens per second beside the bandwidth bound, the tokens per second
at which one step reads the weights and the average valid KV cache once at
the device's memory bandwidth.
(c) The compile time of each program (`lower` + `compile`; for the sampler,
its first call minus a warm one).

Each program runs in a fresh process, so that peak memory is its own. The
weights are random (speed does not depend on their values). `--quick` runs
the same programs at tiny shapes on any device (in the tests). The full run
takes under 8 minutes on one H200.

Writes `gpu_bench.json` and `gpu_bench.md` to `experiments/results/gpu_bench/`
(`--results`; `--quick` to `gpu_bench-quick/`; one section alone to
`gpu_bench-train.*` or `gpu_bench-decode.*`).

Usage:
  python experiments/gpu_bench.py [--quick] [--results DIR]
      [--sections train decode]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import subprocess
import sys
import time

import study

# (model preset, rows per step), the sequence length, and timed repeats.
TRAIN_MODELS = [("qwen2.5-1.5b", 4), ("qwen2.5-7b", 2)]
TRAIN_ARMS = ("adam", "logra", "logra-bf16")
SEQ_LEN, RANK, TRAIN_REPEATS = 4096, 64, 3
DECODE_MODELS = ["qwen2.5-0.5b", "qwen2.5-1.5b"]
DECODE_BATCHES = (64, 256)
PROMPT, NEW_TOKENS = 256, 512
# --quick: tiny shapes of the same programs (LoGRA's through its factored
# bfloat16 variant, which covers the plain one's code).
QUICK = dict(
    seq_len=64,
    rows=2,
    prompt=16,
    new_tokens=16,
    arms=("adam", "logra-bf16"),
    batches=(4,),
)

# Dense bfloat16 peak FLOP/s and memory bandwidth (bytes/s) by device kind.
PEAKS = {
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.0e12),
}


def _device_peaks() -> tuple[float | None, float | None]:
  import jax

  kind = jax.devices()[0].device_kind
  for name, peaks in PEAKS.items():
    if name in kind:
      return peaks
  return None, None


def _config(model: str, quick: bool, dtype: str, param_dtype: str):
  from logra_jax import memory
  from logra_jax import models

  config = (
      models.DecoderConfig.tiny(vocab_size=512)
      if quick
      else memory.load_model_config(model)
  )
  return dataclasses.replace(
      config,
      dtype=dtype,
      param_dtype=param_dtype,
      remat="block",
      max_position_embeddings=max(config.max_position_embeddings, SEQ_LEN),
  )


def _peak_memory() -> int | None:
  import jax

  stats = jax.devices()[0].memory_stats()
  return None if stats is None else stats.get("peak_bytes_in_use")


def _matmul_params(config) -> int:
  """Parameters that take part in matmuls: all but the input embedding
  table (a lookup), plus the tied LM head."""
  from logra_jax.models.decoder import param_shapes

  total = sum(
      math.prod(shape)
      for path, shape in param_shapes(config).items()
      if path != ("embed",)
  )
  if config.tie_word_embeddings:
    total += config.vocab_size * config.hidden_size
  return total


def train_worker(model: str, arm: str, rows: int, quick: bool) -> dict:
  """One train program: compile time, median step time, peak memory, MFU."""
  import jax
  import jax.numpy as jnp

  from logra_jax import models
  from logra_jax import policy_state
  from logra_jax import configs
  from logra_jax.rl import algo
  from logra_jax.rl import learner

  seq_len = QUICK["seq_len"] if quick else SEQ_LEN
  config = _config(model, quick, "bfloat16", "float32")
  opt_config = configs.OptimizerConfig(
      name="logra" if arm.startswith("logra") else arm,
      rank=4 if quick else RANK,
      warmup_steps=0,
      base_dtype="bfloat16" if arm == "logra-bf16" else "float32",
  )
  run = dataclasses.replace(configs.TrainConfig(), optimizer=opt_config)
  graphdef, params = models.split_model(
      jax.jit(lambda: models.init_model(config, rngs=0))()
  )
  tx = policy_state.make_optimizer(opt_config, params)
  weights, state = jax.jit(
      lambda p: policy_state.init_train_state(opt_config, tx, p),
      donate_argnums=0,
  )(params)
  del params
  prompt = seq_len // 4
  ids = jax.random.randint(
      jax.random.key(0), (rows, seq_len), 0, config.vocab_size
  )
  batch = algo.RolloutBatch(
      prompt_tokens_BxP=ids[:, :prompt],
      prompt_mask_BxP=jnp.ones((rows, prompt), jnp.int32),
      completion_tokens_BxT=ids[:, prompt:],
      completion_mask_BxT=jnp.ones((rows, seq_len - prompt), jnp.int32),
      old_logp_BxT=jnp.full((rows, seq_len - prompt), -2.0),
      advantages_B=jnp.linspace(-1.0, 1.0, rows),
      num_generations=rows,
  )
  step = learner.make_train_step(graphdef, tx, run)
  start = time.perf_counter()
  compiled = step.lower(weights, state, batch).compile()
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(1 + TRAIN_REPEATS):
    start = time.perf_counter()
    weights, state, metrics = compiled(weights, state, batch)
    jax.block_until_ready((weights, metrics))
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times[1:])
  tokens = rows * seq_len
  flops = (
      6 * _matmul_params(config) * tokens
      + (12 * config.num_layers * config.num_heads * config.head_dim)
      * seq_len
      * tokens
  )
  peak_flops, _ = _device_peaks()
  peak_memory = _peak_memory()
  return {
      "compile_s": compile_s,
      "first_step_s": times[0],
      "step_s": step_s,
      "tokens": tokens,
      "tflops_per_s": flops / step_s / 1e12,
      "mfu": None if peak_flops is None else flops / step_s / peak_flops,
      "peak_memory_gib": None if peak_memory is None else peak_memory / 2**30,
      "loss_finite": bool(jnp.isfinite(metrics["loss"])),
  }


def decode_worker(model: str, batch: int, quick: bool) -> dict:
  """One sampler program: compile time, tokens/s, the bandwidth bound."""
  import jax
  import numpy as np

  from logra_jax import models

  prompt = QUICK["prompt"] if quick else PROMPT
  new_tokens = QUICK["new_tokens"] if quick else NEW_TOKENS
  config = _config(model, quick, "bfloat16", "bfloat16")
  model_ = jax.jit(lambda: models.init_model(config, rngs=0))()
  _, params = models.split_model(model_)
  sampler = models.Sampler(
      model_, bucket_size=16, max_length=prompt + new_tokens
  )
  prompts = (
      np.random.RandomState(0).randint(1, config.vocab_size, (batch, prompt))
  ).tolist()

  def run(seed: int) -> float:
    start = time.perf_counter()
    out = sampler.sample(
        params,
        prompts,
        jax.random.key(seed),
        max_new_tokens=new_tokens,
        temperature=1.0,
        stop_ids=(),
    )
    jax.block_until_ready(out)
    assert int(out.lengths.min()) == new_tokens
    return time.perf_counter() - start

  first = run(0)
  warm = statistics.median(run(seed) for seed in (1, 2))
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  kv_per_token = (
      2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
  )
  # Per decode step: every weight once, and the valid cache of each row at
  # its average length (prompt plus half the new tokens).
  step_bytes = weight_bytes + batch * kv_per_token * (prompt + new_tokens / 2)
  _, bandwidth = _device_peaks()
  tokens_per_s = batch * new_tokens / warm
  bound = None if bandwidth is None else batch * bandwidth / step_bytes
  return {
      "compile_s": first - warm,
      "seconds": warm,
      "tokens_per_s": tokens_per_s,
      "bound_tokens_per_s": bound,
      "fraction_of_bound": None if bound is None else tokens_per_s / bound,
      "step_bytes": step_bytes,
  }


def _in_fresh_process(args: list[str]) -> dict:
  """One program's figures, or ``{"error": ...}`` (its last line of
  stderr) when it fails: the others still run, as accelerator time is
  scarce."""
  out = subprocess.run(
      [sys.executable, __file__, "--worker", *args],
      capture_output=True,
      text=True,
      check=False,
  )
  if out.returncode:
    print(out.stderr[-4000:], file=sys.stderr, flush=True)
    lines = out.stderr.strip().splitlines() or ["(no output)"]
    return {"error": f"exit {out.returncode}: {lines[-1][:300]}"}
  return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def _table(
    head: list[str], rows: list[dict], key: list[str], cells
) -> list[str]:
  """A markdown table: ``key`` columns of each row, then ``cells(row)``, or
  the row's error across the rest."""
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for row in rows:
    rest = (
        [row["error"]] + [""] * (len(head) - len(key) - 1)
        if "error" in row
        else cells(row)
    )
    lines.append("| " + " | ".join([str(row[k]) for k in key] + rest) + " |")
  return lines


def report(results: dict, command: str) -> str:
  """The markdown tables."""
  train = _table(
      [
          "model",
          "optimizer",
          "tokens",
          "step, s",
          "compile, s",
          "peak memory, GiB",
          "TFLOP/s",
          "MFU",
      ],
      results["train"],
      ["model", "arm"],
      lambda row: [
          str(row["tokens"]),
          f"{row['step_s']:.3f}",
          f"{row['compile_s']:.1f}",
          _fmt(row["peak_memory_gib"], ".1f"),
          f"{row['tflops_per_s']:.1f}",
          _fmt(row["mfu"], ".1%"),
      ],
  )
  decode = _table(
      [
          "model",
          "batch",
          "tokens/s",
          "bandwidth bound, tokens/s",
          "of the bound",
          "compile, s",
      ],
      results["decode"],
      ["model", "batch"],
      lambda row: [
          f"{row['tokens_per_s']:.0f}",
          _fmt(row["bound_tokens_per_s"], ".0f"),
          _fmt(row["fraction_of_bound"], ".1%"),
          f"{row['compile_s']:.1f}",
      ],
  )
  lines = train + [""] + decode
  return "\n".join(lines) + f"\n\n{study.footer(command)}\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--results", type=pathlib.Path)
  parser.add_argument(
      "--sections",
      nargs="+",
      choices=("train", "decode"),
      default=["train", "decode"],
      help="what to measure (both by default; one each to split the run)",
  )
  parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    kind, model, *rest = args.worker
    quick = rest[-1] == "quick"
    result = (
        train_worker(model, rest[0], int(rest[1]), quick)
        if kind == "train"
        else decode_worker(model, int(rest[0]), quick)
    )
    print(json.dumps(result))
    return
  mode = "quick" if args.quick else "full"
  results_dir = args.results or study.RESULTS / (
      "gpu_bench-quick" if args.quick else "gpu_bench"
  )
  train_models = TRAIN_MODELS[:1] if args.quick else TRAIN_MODELS
  decode_models = DECODE_MODELS[:1] if args.quick else DECODE_MODELS
  if "train" not in args.sections:
    train_models = []
  if "decode" not in args.sections:
    decode_models = []
  results: dict = {"train": [], "decode": []}
  start = time.perf_counter()
  for model, rows in train_models:
    rows = QUICK["rows"] if args.quick else rows
    for arm in QUICK["arms"] if args.quick else TRAIN_ARMS:
      row = _in_fresh_process(["train", model, arm, str(rows), mode])
      label = "tiny" if args.quick else model
      results["train"].append({"model": label, "arm": arm, **row})
      print(json.dumps(results["train"][-1]), flush=True)
  batches = QUICK["batches"] if args.quick else DECODE_BATCHES
  for model in decode_models:
    for batch in batches:
      row = _in_fresh_process(["decode", model, str(batch), mode])
      label = "tiny" if args.quick else model
      results["decode"].append({"model": label, "batch": batch, **row})
      print(json.dumps(results["decode"][-1]), flush=True)
  results["seconds"] = time.perf_counter() - start
  command = " ".join(["python experiments/gpu_bench.py"] + sys.argv[1:])
  results_dir.mkdir(parents=True, exist_ok=True)
  # A run of one section writes files of its own, beside the other's.
  stem = "gpu_bench" + (
      "" if len(args.sections) == 2 else f"-{args.sections[0]}"
  )
  (results_dir / f"{stem}.json").write_text(
      json.dumps({"command": command, **results}, indent=1) + "\n"
  )
  table = report(results, command)
  (results_dir / f"{stem}.md").write_text(table)
  print(table)
  failed = [r for r in results["train"] + results["decode"] if "error" in r]
  if failed:
    raise SystemExit(f"{len(failed)} program(s) failed; see the tables")


if __name__ == "__main__":
  main()
