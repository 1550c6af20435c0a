"""Rollout throughput: our jitted sampler vs `transformers` `generate` (CPU).

Both sample from the same random weights (built with `transformers`, saved,
loaded into ours): batch 64, prompt 32, exactly 64 new tokens (no EOS),
temperature 1 with no top-k / top-p. Compile time is excluded (one warm-up
call each); the table reports the median of `--repeats` timed runs. PyTorch
runs with denormals flushed to zero, as XLA does.

Usage:
  python experiments/bench_rollout.py [--threads N] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def _configs():
  import transformers

  common = dict(max_position_embeddings=256, bos_token_id=None,
                eos_token_id=None, pad_token_id=0)
  return {
      "~1M": transformers.LlamaConfig(
          vocab_size=1024, hidden_size=128, intermediate_size=384,
          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
          **common),
      "~4M": transformers.LlamaConfig(
          vocab_size=2048, hidden_size=256, intermediate_size=768,
          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
          **common),
  }


def _median_seconds(fn, repeats: int) -> float:
  fn()  # Warm-up (compilation, caches).
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  # XLA's CPU client uses every core of the machine; give torch as many.
  parser.add_argument("--threads", type=int, default=os.cpu_count())
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--prompt", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=64)
  args = parser.parse_args()
  import jax
  import numpy as np
  import torch
  import transformers

  from logra_jax import models

  torch.set_num_threads(args.threads)
  # XLA flushes denormals to zero on CPU; without this, PyTorch is several
  # times slower on these small random models and the ratio would flatter us.
  torch.set_flush_denormal(True)
  B, P, N = args.batch, args.prompt, args.new_tokens
  rows = []
  for name, hf_config in _configs().items():
    torch.manual_seed(0)
    torch_model = transformers.AutoModelForCausalLM.from_config(
        hf_config, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in torch_model.parameters())
    with tempfile.TemporaryDirectory() as path:
      torch_model.save_pretrained(path)
      model = models.load_pretrained(path)
    prompts = np.random.RandomState(0).randint(1, hf_config.vocab_size, (B, P))

    def run_hf():
      with torch.no_grad():
        out = torch_model.generate(
            torch.tensor(prompts), attention_mask=torch.ones(B, P,
                                                             dtype=torch.long),
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=N, min_new_tokens=N, pad_token_id=0)
      assert out.shape == (B, P + N), out.shape

    sampler = models.Sampler(model, bucket_size=16)
    _, params = models.split_model(model)
    keys = iter(jax.random.split(jax.random.key(0), args.repeats + 1))

    def run_ours():
      out = sampler.sample(params, prompts.tolist(), next(keys),
                           max_new_tokens=N, temperature=1.0, stop_ids=())
      jax.block_until_ready(out)
      assert int(out.lengths.min()) == N

    t_hf = _median_seconds(run_hf, args.repeats)
    t_ours = _median_seconds(run_ours, args.repeats)
    rows.append((name, n_params, B * N / t_hf, B * N / t_ours))

  print(f"\nbatch {B}, prompt {P}, {N} new tokens, temperature 1, "
        f"{args.threads} threads, median of {args.repeats}\n")
  print("| model | params | HF generate tok/s | logra-jax tok/s | ratio |")
  print("|---|---:|---:|---:|---:|")
  for name, n_params, hf, ours in rows:
    print(f"| {name} | {n_params / 1e6:.2f}M | {hf:,.0f} | {ours:,.0f} | "
          f"{ours / hf:.2f}x |")


if __name__ == "__main__":
  main()
