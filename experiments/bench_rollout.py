"""Rollout throughput: our jitted sampler vs `transformers` `generate` (CPU).

Both sample from the same random weights (built with `transformers`, saved,
loaded into ours): batch 64, prompt 32, exactly 64 new tokens (no EOS),
temperature 1 with no top-k / top-p. Compile time is excluded (one warm-up
call each); the table reports the median of `--repeats` timed runs.

Each side runs in its own fresh process so that neither library's thread
pools or floating-point state affect the other. PyTorch gets as many threads
as XLA's CPU client uses (every core) and flushes denormals to zero as XLA
does; without that, PyTorch is up to 50x slower on these small random models
and the ratio would flatter us. Run it on an otherwise idle machine: when
other processes compete for the cores, PyTorch's OpenMP barriers stall on
descheduled threads and `generate` slows down by an order of magnitude (the
load average is printed with the table).

Usage:
  python experiments/bench_rollout.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BATCH, PROMPT, NEW_TOKENS = 64, 32, 64


def _configs():
  import transformers

  common = dict(
      max_position_embeddings=256,
      bos_token_id=None,
      eos_token_id=None,
      pad_token_id=0,
  )
  return {
      "~1M": transformers.LlamaConfig(
          vocab_size=1024,
          hidden_size=128,
          intermediate_size=384,
          num_hidden_layers=4,
          num_attention_heads=4,
          num_key_value_heads=2,
          **common,
      ),
      "~4M": transformers.LlamaConfig(
          vocab_size=2048,
          hidden_size=256,
          intermediate_size=768,
          num_hidden_layers=4,
          num_attention_heads=8,
          num_key_value_heads=4,
          **common,
      ),
  }


def _median_seconds(fn, repeats: int) -> float:
  fn()  # Warm-up (compilation, caches).
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _prompts(vocab_size: int):
  import numpy as np

  return np.random.RandomState(0).randint(1, vocab_size, (BATCH, PROMPT))


def _worker_hf(path: str, repeats: int) -> float:
  """Tokens per second of `generate` on the checkpoint at `path`."""
  import torch

  torch.set_num_threads(os.cpu_count())
  torch.set_flush_denormal(True)
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32
  ).eval()
  prompts = torch.tensor(_prompts(model.config.vocab_size))

  def run():
    with torch.no_grad():
      out = model.generate(
          prompts,
          attention_mask=torch.ones_like(prompts),
          do_sample=True,
          temperature=1.0,
          top_k=0,
          top_p=1.0,
          max_new_tokens=NEW_TOKENS,
          min_new_tokens=NEW_TOKENS,
          pad_token_id=0,
      )
    assert out.shape == (BATCH, PROMPT + NEW_TOKENS), out.shape

  return BATCH * NEW_TOKENS / _median_seconds(run, repeats)


def _worker_ours(path: str, repeats: int) -> float:
  """Tokens per second of `logra_jax.models.Sampler` on `path`."""
  import jax

  from logra_jax import models

  model = models.load_pretrained(path)
  sampler = models.Sampler(model, bucket_size=16)
  _, params = models.split_model(model)
  prompts = _prompts(model.config.vocab_size).tolist()
  keys = iter(jax.random.split(jax.random.key(0), repeats + 1))

  def run():
    out = sampler.sample(
        params,
        prompts,
        next(keys),
        max_new_tokens=NEW_TOKENS,
        temperature=1.0,
        stop_ids=(),
    )
    jax.block_until_ready(out)
    assert int(out.lengths.min()) == NEW_TOKENS

  return BATCH * NEW_TOKENS / _median_seconds(run, repeats)


def _measure(side: str, path: str, repeats: int) -> float:
  """Runs one worker in a fresh interpreter and returns its tokens/s."""
  result = subprocess.run(
      [
          sys.executable,
          __file__,
          "--worker",
          side,
          "--path",
          path,
          "--repeats",
          str(repeats),
      ],
      check=True,
      capture_output=True,
      text=True,
      env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
  )
  return json.loads(result.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--worker", choices=("hf", "ours"))
  parser.add_argument("--path")
  args = parser.parse_args()
  if args.worker:
    worker = _worker_hf if args.worker == "hf" else _worker_ours
    print(json.dumps({"tokens_per_s": worker(args.path, args.repeats)}))
    return

  import torch
  import transformers

  load_before = os.getloadavg()[0]
  rows = []
  for name, hf_config in _configs().items():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, dtype=torch.float32
    )
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as path:
      model.save_pretrained(path)
      hf = _measure("hf", path, args.repeats)
      ours = _measure("ours", path, args.repeats)
    rows.append((name, n_params, hf, ours))

  print(
      f"\nbatch {BATCH}, prompt {PROMPT}, {NEW_TOKENS} new tokens, "
      f"temperature 1, {os.cpu_count()} CPU threads each, median of "
      f"{args.repeats}; load average before/after: {load_before:.1f}/"
      f"{os.getloadavg()[0]:.1f}\n"
  )
  print("| model | params | HF generate tok/s | logra-jax tok/s | ratio |")
  print("|---|---:|---:|---:|---:|")
  for name, n_params, hf, ours in rows:
    print(
        f"| {name} | {n_params / 1e6:.2f}M | {hf:,.0f} | {ours:,.0f} | "
        f"{ours / hf:.2f}x |"
    )


if __name__ == "__main__":
  main()
