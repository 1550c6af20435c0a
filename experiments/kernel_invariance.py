"""Which of the decoder's kernels give a row the same bits whatever the
number of rows beside it, on this machine's XLA:CPU?

The sampler computes a decoded token's layer with B rows (one per sequence);
the learner's forward computes the same token's layer among B x T rows.
Their log-probs can only be bitwise equal if every kernel on the way is
row-invariant: row r of the result depends on row r of the input alone, not
on how many rows the kernel was handed (``experiments/logprob_agreement.py``
measures the end result). For each of the decoder's operations at three
model widths this records, over 16 sequences x 40 positions of random
inputs, the fraction of the last position's rows that come out bitwise
equal computed alone (16 rows, a decode step) and among all 640 (the
forward), and whether one sequence's row alone (a batch of one) does:

- ``matmul K x N``: ``x @ W`` in float32 for each dense weight of the
  model (attention projections, MLP, LM head) at the widths ``tiny``
  (`DecoderConfig.tiny`, D = 64), ``mid`` (D = 256) and ``wide``
  (SmolLM2-135M's D = 576, F = 1536), vocabulary 512 / 2048 / 2048;
- ``matmul D x 4``: a rank-4 factor's product ``x P`` (LoGRA's factored
  weights at rank 4), as is and as ``reduction.blocked_dot``
  (``DecoderConfig.batch_invariant``) computes it: zero columns up to 16,
  a lone row a zero row;
- ``RMSNorm``: the decoder's mean of squares over the hidden size (an XLA
  reduction), and the same as a pairwise tree of elementwise additions
  (``reduction.tree_sum``), whose order is fixed by the reduced length
  alone;
- ``softmax``: ``jax.nn.softmax`` over 40 keys per query row and head, as
  attention takes it (the width's number of query heads);
- ``attention scores``: a decoded query's scores over 40 keys (its
  sequence's, one query head per kv head), as the forward pass computes
  them (a batched matmul over all positions' queries) against three ways a
  decode step can: the same batched matmul for the one query row, the same
  with a zero row appended (``reduction.with_matrix_rows``, what
  ``DecoderConfig.batch_invariant`` decodes with), and the default decoding
  path's elementwise products summed over the head dim (which reads the
  cache in place).

Each is measured under two XLA:CPU settings, each in a process of its own
(XLA reads its flags once; each replaces any ``XLA_FLAGS`` of the caller's,
and the JSON records them): ``default``, and ``no-xnnpack``
(``--xla_cpu_use_xnnpack=false --xla_cpu_experimental_ynn_fusion_type=``:
dots and fusions from XLA's own emitters and Eigen instead of XNNPACK /
YNNPACK). Random inputs, float32.

Writes ``kernel_invariance.md`` and ``.json`` to
``experiments/results/kernel_invariance/`` (``--results``).

Run: python experiments/kernel_invariance.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import provenance
import study
from logra_jax import reduction

SETTINGS = {
    "default": "",
    "no-xnnpack": (
        "--xla_cpu_use_xnnpack=false --xla_cpu_experimental_ynn_fusion_type="
    ),
}
SEQUENCES, POSITIONS = 16, 40
# (hidden D, query heads H, head dim h, kv width K*h, MLP F, vocabulary V)
WIDTHS = {
    "tiny": (64, 4, 16, 32, 128, 512),
    "mid": (256, 8, 64, 128, 1024, 2048),
    "wide": (576, 9, 64, 192, 1536, 2048),
}


def _same_rows(fn, x: np.ndarray, *args) -> tuple[float, float]:
  """``x`` is ``[sequences, positions, ...]``: the fractions of the last
  position's rows, computed alone (one row per sequence, as a decode step
  does) and for the first sequence alone (a batch of one), whose ``fn``
  values are bitwise equal to the same rows computed among all of ``x``'s
  (as the forward pass does)."""
  run = jax.jit(fn)
  whole = np.asarray(run(x, *args))[:, -1]
  part = np.asarray(run(x[:, -1:], *args))[:, 0]
  one = np.asarray(run(x[:1, -1:], *args))[:, 0]
  equal = lambda a, b: (a == b).reshape(len(a), -1).all(axis=1)
  return float(equal(part, whole).mean()), float(equal(one, whole[:1]).mean())


def measure(width: str) -> list[dict]:
  """Every operation's row invariance at one model width."""
  D, H, h, kv, F, V = WIDTHS[width]
  q = H * h
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape, np.float32)
  rows = []
  for name, (k, n) in {
      "q_proj": (D, q),
      "k_proj / v_proj": (D, kv),
      "o_proj": (q, D),
      "gate_proj / up_proj": (D, F),
      "down_proj": (F, D),
      "lm_head": (D, V),
  }.items():
    part, one = _same_rows(
        jnp.matmul, normal(SEQUENCES, POSITIONS, k), normal(k, n)
    )
    rows.append(dict(op=f"matmul {k} x {n} ({name})", part=part, one=one))
  factor = normal(D, 4)  # x P of a rank-4 factored weight
  for name, fn in {
      "": jnp.matmul,
      ", padded as reduction.blocked_dot pads it": reduction.blocked_dot,
  }.items():
    part, one = _same_rows(fn, normal(SEQUENCES, POSITIONS, D), factor)
    rows.append(
        dict(op=f"matmul {D} x 4 (a rank-4 factor){name}", part=part, one=one)
    )
  hidden = normal(SEQUENCES, POSITIONS, D)
  for name, fn in {
      "RMSNorm mean of squares (XLA reduce)": lambda x: jnp.mean(x * x, -1),
      "RMSNorm mean of squares (tree sum)": (
          lambda x: reduction.tree_sum(x * x) / D
      ),
  }.items():
    part, one = _same_rows(fn, hidden)
    rows.append(dict(op=f"{name}, D = {D}", part=part, one=one))
  scores = normal(SEQUENCES, POSITIONS, H, POSITIONS)
  part, one = _same_rows(lambda s: jax.nn.softmax(s, axis=-1), scores)
  rows.append(
      dict(op=f"softmax over {POSITIONS} keys, {H} heads", part=part, one=one)
  )
  rows += _decoded_scores(normal(SEQUENCES, POSITIONS, H, h), h)
  return [dict(row, width=width) for row in rows]


def _decoded_scores(q_SxTxHxh: np.ndarray, h: int) -> list[dict]:
  """The last position's attention scores over its sequence's 40 keys (in
  the decoder's heads-major layout, one query head per kv head; random
  keys: the kernels see only shapes), computed for that query alone in each
  way of decoding, against the forward's batched matmul over all positions'
  queries: the fractions of sequences bitwise equal, and whether the first
  sequence alone is."""
  q = q_SxTxHxh.transpose(0, 2, 1, 3)[:, :, None]  # [S, H, 1, T, h]
  keys = np.ascontiguousarray(q[:, :, 0, ::-1])  # [S, H, T, h]
  matmul = lambda q, k: jnp.einsum("skgth,sknh->skgtn", q, k)
  ways = {
      "a matmul of one row": matmul,
      "a matmul, a zero row appended": lambda q, k: reduction.with_matrix_rows(
          matmul, q, (2, 3), k
      ),
      "elementwise products": lambda q, k: jnp.sum(
          q[..., None, :] * k[:, :, None, None], -1
      ),
  }
  whole = np.asarray(jax.jit(matmul)(q, keys))[:, :, :, -1]
  equal = lambda a, b: (a == b).reshape(len(a), -1).all(axis=1)
  rows = []
  for name, fn in ways.items():
    run = jax.jit(fn)
    part = np.asarray(run(q[:, :, :, -1:], keys))[:, :, :, 0]
    one = np.asarray(run(q[:1, :, :, -1:], keys[:1]))[:, :, :, 0]
    rows.append(
        dict(
            op=f"attention scores, h = {h}: decoded by {name}",
            part=float(equal(part, whole).mean()),
            one=float(equal(one, whole[:1]).mean()),
        )
    )
  return rows


def child(widths: list[str]) -> None:
  """Measures in this process (its XLA flags set by the parent)."""
  print(json.dumps([row for width in widths for row in measure(width)]))


def run_setting(setting: str, widths: list[str]) -> list[dict]:
  """The rows of one XLA setting, measured in a fresh process."""
  env = dict(os.environ, XLA_FLAGS=SETTINGS[setting], JAX_PLATFORMS="cpu")
  done = subprocess.run(
      [sys.executable, __file__, "--child", *widths],
      env=env,
      capture_output=True,
      text=True,
      check=False,
  )
  lines = done.stdout.strip().splitlines()
  if done.returncode or not lines:
    study.fail(f"the {setting} measurement failed:\n{done.stderr[-3000:]}")
  rows = json.loads(lines[-1])
  return [dict(row, setting=setting) for row in rows]


def table(rows: list[dict], record: dict) -> str:
  """The markdown report: one line per operation and width, a column pair
  per XLA setting."""
  settings = list(dict.fromkeys(r["setting"] for r in rows))
  by = {(r["width"], r["op"], r["setting"]): r for r in rows}
  lines = [
      f"Row invariance on XLA:CPU, float32: of the last position's rows of "
      f"{SEQUENCES} sequences x {POSITIONS} positions, the fraction bitwise "
      f"equal when computed alone ({SEQUENCES} rows, a decode step) and "
      f"among all {SEQUENCES * POSITIONS} (the forward pass), and whether "
      "the first sequence's row alone (a batch of one) is.",
      "",
      "| width | operation | "
      + " | ".join(f"{s}: {SEQUENCES} rows | {s}: 1 row" for s in settings)
      + " |",
      "|---|---|" + "---:|---:|" * len(settings),
  ]
  for width, op in dict.fromkeys((r["width"], r["op"]) for r in rows):
    cells = " | ".join(
        f"{by[width, op, s]['part']:.3f} | {by[width, op, s]['one']:.0f}"
        for s in settings
    )
    lines.append(f"| {width} | {op} | {cells} |")
  return "\n".join(lines + ["", provenance.footer(record)]) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--quick", action="store_true", help="the tiny width only"
  )
  parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
  parser.add_argument("--results")
  args = parser.parse_args()
  if args.child:
    child(args.child)
    return
  widths = ["tiny"] if args.quick else list(WIDTHS)
  results = study.results_path(args, "kernel_invariance")
  # XLA's kernels are measured, not this package's numerics.
  record = provenance.collect(provenance.this_command(), "not computed")
  rows = [row for s in SETTINGS for row in run_setting(s, widths)]
  results.mkdir(parents=True, exist_ok=True)
  text = table(rows, record)
  (results / "kernel_invariance.md").write_text(text)
  (results / "kernel_invariance.json").write_text(
      json.dumps(
          {"rows": rows, "xla_flags": SETTINGS, "provenance": record}, indent=1
      )
      + "\n"
  )
  print(text)


if __name__ == "__main__":
  main()
