"""How far the sampler's token log-probs are from the learner's forward, on
this machine's backend.

The sampler decodes one token at a time over a KV cache (`models.Sampler`);
the learner scores the same completions in one forward pass over the whole
sequence (`models.token_logprobs`). Both use the same weights and compute
dtype, so they differ only where the backend sums in another order: a
matmul kernel chosen by the number of rows, attention over two key blocks
(cache and new) instead of one, a fusion chosen by size. For each model
shape, compute dtype and batch size B this records, over the completion
tokens of B random prompts (temperature 1, 24 new tokens):

- sampler vs forward: the fraction of tokens whose log-probs are bitwise
  equal, the largest and the mean absolute gap;
- batch invariance: the first 8 rows computed alone (padded as in the
  batch) against the same rows inside the batch of B, for the forward (the
  fraction of log-probs bitwise equal) and for the sampler (the fraction of
  tokens sampled with the same token and a bitwise-equal log-prob).

Shapes (random weights): ``tiny`` (`DecoderConfig.tiny`, D = 64, vocab 512),
``mid`` (D = 256, 4 heads, 2 kv heads, F = 1024, vocab 2048: its
``down_proj`` reduces over 1024, longer than XLA:CPU keeps in one pass),
``mid-mha`` (``mid`` with 4 kv heads: multi-head attention, one query head
per kv head, so a decoded token's attention is a product of one row) and
``wide`` (2 layers of SmolLM2-135M's widths: D = 576, 9 heads, 3 kv heads,
F = 1536, vocab 2048).

``--batch-invariant`` measures the models with
``DecoderConfig.batch_invariant`` under ``logra_jax.reduction.CPU_FLAGS``
(set before JAX starts) and writes ``logprob_agreement-batch-invariant.md``
and ``.json`` instead.

Writes ``logprob_agreement.md`` and ``.json`` to
``experiments/results/logprob_agreement/`` (``--results``).

Run: python experiments/logprob_agreement.py [--quick] [--batch-invariant]
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

import provenance
import study
from logra_jax import models
from logra_jax import reduction

MID = dict(
    vocab_size=2048,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=1024,
)
SHAPES = {
    "tiny": dict(vocab_size=512),
    "mid": MID,
    "mid-mha": dict(MID, num_kv_heads=4),
    "wide": dict(
        vocab_size=2048,
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
    ),
}
ALONE = 8  # rows scored alone for the batch-invariance columns


def _model(shape: str, dtype: str, batch_invariant: bool):
  config = models.DecoderConfig.tiny(
      **SHAPES[shape], dtype=dtype, batch_invariant=batch_invariant
  )
  model = models.init_model(config, 0)
  return model, *models.split_model(model)


def _prompts(rows: int, vocab: int) -> list[list[int]]:
  rng = np.random.default_rng(0)
  return [
      [int(t) for t in rng.integers(1, vocab, size=rng.integers(3, 12))]
      for _ in range(rows)
  ]


def measure(
    shape: str,
    dtype: str,
    rows: int,
    new_tokens: int,
    batch_invariant: bool = False,
) -> dict:
  """One row of the table: sampler vs forward, and batch invariance."""
  model, graphdef, params = _model(shape, dtype, batch_invariant)
  sampler = models.Sampler(model, max_length=128)
  score = jax.jit(models.token_logprobs, static_argnums=0)
  prompts = _prompts(rows, model.config.vocab_size)
  length = sampler.bucket_length(max(map(len, prompts)), new_tokens)
  ids, mask = models.pad_prompts(prompts, length, sampler.pad_id)
  settings = models.SamplingParams(max_new_tokens=new_tokens, stop_ids=())

  def sample(n):  # the first n rows, padded as in the whole batch
    return sampler.sample_padded(
        params, ids[:n], mask[:n], jax.random.key(0), settings
    )

  def forward(out, n):
    return np.asarray(
        score(
            graphdef,
            params,
            out.prompt_ids[:n],
            out.prompt_mask[:n],
            out.tokens[:n],
            out.mask[:n],
        )
    )

  out = sample(rows)
  kept = np.asarray(out.mask, bool)
  learner, sampled = forward(out, rows), np.asarray(out.logprobs)
  gap = np.abs(learner - sampled)[kept]
  alone, first = sample(ALONE), kept[:ALONE]
  # A token counts as invariant when the same token comes with the same
  # log-prob (the key is the same, so a changed token is a changed
  # distribution).
  same_sample = (np.asarray(alone.tokens) == np.asarray(out.tokens)[:ALONE]) & (
      np.asarray(alone.logprobs) == sampled[:ALONE]
  )
  return {
      "shape": shape,
      "dtype": dtype,
      "rows": rows,
      "tokens": int(kept.sum()),
      "bitwise": float((gap == 0).mean()),
      "max_gap": float(gap.max()),
      "mean_gap": float(gap.mean()),
      "forward_batch_invariant": float(
          (forward(out, ALONE) == learner[:ALONE])[first].mean()
      ),
      "sampler_batch_invariant": float(same_sample[first].mean()),
  }


def table(rows: list[dict], record: dict, batch_invariant: bool) -> str:
  """The markdown report."""
  numerics = (
      "Models with `DecoderConfig.batch_invariant`, XLA flags "
      f"`{' '.join(reduction.CPU_FLAGS)}`."
      if batch_invariant
      else "Default numerics and XLA flags."
  )
  lines = [
      "Sampler (one token at a time, KV cache) vs learner forward (whole "
      "sequence) token log-probs, same weights and compute dtype, random "
      "prompts, temperature 1. Batch invariance: the first 8 rows alone vs "
      "inside the batch, fraction of tokens bitwise equal. " + numerics,
      "",
      "| shape | dtype | batch | tokens | bitwise equal | max gap "
      "| mean gap | forward batch-invariant | sampler batch-invariant |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
        f"| {r['shape']} | {r['dtype']} | {r['rows']} | {r['tokens']} "
        f"| {r['bitwise']:.3f} | {r['max_gap']:.3g} | {r['mean_gap']:.3g} "
        f"| {r['forward_batch_invariant']:.3f} "
        f"| {r['sampler_batch_invariant']:.3f} |"
    )
  return "\n".join(lines + ["", provenance.footer(record)]) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--quick",
      action="store_true",
      help="one small row (tiny, float32, 8 rows; other choices ignored)",
  )
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--rows", nargs="+", type=int, default=[8, 16, 32, 64])
  parser.add_argument(
      "--batch-invariant",
      action="store_true",
      help="models with DecoderConfig.batch_invariant, under its CPU flags",
  )
  parser.add_argument("--results")
  parser.add_argument("--fingerprint-cache", default="runs/fingerprints")
  args = parser.parse_args()
  if args.batch_invariant:  # before anything starts JAX
    reduction.use_invariant_kernels("--batch-invariant")
  if args.quick:
    args.shapes, args.dtypes, args.rows = ["tiny"], ["float32"], [ALONE]
  for name in args.shapes:
    if name not in SHAPES:
      study.fail(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
  for dtype in args.dtypes:
    if dtype not in ("float32", "bfloat16"):
      study.fail(f"unknown dtype {dtype!r}; known: float32, bfloat16")
  if min(args.rows) < ALONE:
    study.fail(f"--rows must each be >= {ALONE}, got {min(args.rows)}")
  results = study.results_path(args, "logprob_agreement")
  record = study.provenance_record(args)  # before the runs: fails early
  new_tokens = 4 if args.quick else 24
  rows = [
      measure(shape, dtype, n, new_tokens, args.batch_invariant)
      for shape in args.shapes
      for dtype in args.dtypes
      for n in args.rows
  ]
  results.mkdir(parents=True, exist_ok=True)
  text = table(rows, record, args.batch_invariant)
  name = "logprob_agreement" + (
      "-batch-invariant" if args.batch_invariant else ""
  )
  (results / f"{name}.md").write_text(text)
  (results / f"{name}.json").write_text(
      json.dumps({"rows": rows, "provenance": record}, indent=1) + "\n"
  )
  print(text)


if __name__ == "__main__":
  main()
