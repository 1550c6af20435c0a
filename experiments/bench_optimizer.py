"""Update time and optimizer-state memory: optax.adam, optax.contrib.galore, LoGRA.

For a GPT-2-small-shaped and a 1B-shaped (TinyLlama-1.1B) parameter tree, prints
a markdown table of

* optimizer-state bytes, counted on abstract shapes (`jax.eval_shape`) for the
  full trees, so nothing is allocated;
* the median time of a jitted `update` + `apply_updates` step, for refresh
  steps (projector recomputed) and non-refresh steps separately, on real
  arrays; for the 1B tree on its first `--layers-1b` transformer blocks (all
  blocks have the same shapes, so per-block time scales linearly);

each as a ratio to `optax.adam` measured in the same run, and the time of only
the two rank-r products of every projected matrix (`P^T G`, `P S`), the floor of
a non-refresh LoGRA step that takes full gradients. Embeddings and the
LM head stay dense for GaLore and LoGRA alike; every transformer-block matrix
is projected at the same rank. LoGRA with factored weights (`W = B + P A`,
updated from sketches; `logra_jax.optim.factored`) is timed on its
non-refresh update, with the window's projectors as the learner's sketch
gradients hand them over (stored ones passed through, random ones
regenerated), and, in the refresh column, the update plus the merge of the
window into `B` that a factored run does once per refresh.

`--arms` restricts the rows to optimizers whose name contains one of the given
strings (optax.adam always runs: it is the reference); `--rounds N` times every
arm N times, interleaved, and reports the median of the N medians (steadier on a
busy machine).

Run: python experiments/bench_optimizer.py [--rank 64] [--repeats 20]
     [--trees gpt2 1b] [--arms adam factored] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
import optax.contrib

import logra_jax as logra
from logra_jax.optim import sketch_grad
from logra_jax.optim import factored
from logra_jax.optim import state_queries

GPT2_SMALL = dict(
    vocab=50257,
    positions=1024,
    d=768,
    heads_dim=768,
    kv_dim=768,
    mlp=3072,
    layers=12,
    gated=False,
)
LLAMA_1B = dict(
    vocab=32000,
    positions=0,
    d=2048,
    heads_dim=2048,
    kv_dim=256,
    mlp=5632,
    layers=22,
    gated=True,
)


def param_shapes(cfg: dict, layers: int | None = None) -> dict:
  """Per-layer 2-d leaves of a decoder, as `jax.ShapeDtypeStruct`s."""
  d, f32 = cfg["d"], jnp.float32
  tree = {
      "embed": jax.ShapeDtypeStruct((cfg["vocab"], d), f32),
      "final_norm": jax.ShapeDtypeStruct((d,), f32),
  }
  if cfg["positions"]:
    tree["positions"] = jax.ShapeDtypeStruct((cfg["positions"], d), f32)
  if cfg["gated"]:
    tree["lm_head"] = jax.ShapeDtypeStruct((d, cfg["vocab"]), f32)
  for i in range(cfg["layers"] if layers is None else layers):
    block = {
        "q": (d, cfg["heads_dim"]),
        "k": (d, cfg["kv_dim"]),
        "v": (d, cfg["kv_dim"]),
        "o": (cfg["heads_dim"], d),
        "up": (d, cfg["mlp"]),
        "down": (cfg["mlp"], d),
        "norm1": (d,),
        "norm2": (d,),
    }
    if cfg["gated"]:
      block["gate"] = (d, cfg["mlp"])
    tree[f"block{i:02d}"] = {
        k: jax.ShapeDtypeStruct(s, f32) for k, s in block.items()
    }
  return tree


def block_dimension_numbers(params):
  """Block matrices are projected; embeddings, head and vectors stay dense."""

  def spec(path, p):
    in_block = str(path[0].key).startswith("block")
    return (
        optax.contrib.GaLoreDimensionNumbers()
        if (in_block and len(p.shape) == 2)
        else None
    )

  return jax.tree_util.tree_map_with_path(spec, params)


def logra_dimension_numbers(params):
  """:func:`block_dimension_numbers` as LoGRA's dimension numbers."""
  return jax.tree.map(
      lambda s: None if s is None else logra.DimensionNumbers(),
      block_dimension_numbers(params),
      is_leaf=lambda x: x is None
      or isinstance(x, optax.contrib.GaLoreDimensionNumbers),
  )


def optimizers(rank: int, refresh_every: int, params) -> dict:
  galore_dims = block_dimension_numbers(params)
  logra_dims = logra_dimension_numbers(params)
  lr = 1e-3
  out = {
      "optax.adam": optax.adam(lr),
      "optax.contrib.galore": optax.contrib.galore(
          lr,
          rank=rank,
          update_proj_gap=refresh_every,
          weight_dimension_numbers=galore_dims,
      ),
  }
  for kind in ("random", "range", "svd"):
    out[f"logra ({kind})"] = logra.logra(
        lr,
        rank=rank,
        kind=kind,
        refresh_every=refresh_every,
        dimension_numbers=logra_dims,
    )
  return out


def state_bytes(tx, shapes) -> int:
  return logra.optimizer_state_bytes(jax.eval_shape(tx.init, shapes))


def time_steps(tx, shapes, repeats: int) -> float:
  """Median seconds of a jitted update + apply step over `repeats` calls."""
  key = jax.random.key(0)
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(key, len(leaves))
  params = treedef.unflatten(
      [0.02 * jax.random.normal(k, s.shape) for k, s in zip(keys, leaves)]
  )
  grads = jax.tree.map(lambda p: 1e-3 * jnp.sin(p * 977.0), params)
  state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  start = time.perf_counter()
  params, state = jax.block_until_ready(step(params, state, grads))  # compile
  print(
      f"  compiled + first step in {time.perf_counter() - start:.1f}s",
      file=sys.stderr,
      flush=True,
  )
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    params, state = jax.block_until_ready(step(params, state, grads))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def time_factored_steps(tx, shapes, repeats: int, merge: bool) -> float:
  """Median seconds of a jitted update of factored weights ``W = B + P A``
  from sketches (what sketch-direct gradients hand over: ``[1, r, short]``
  per projected matrix, full gradients of the dense leaves) plus
  `factored.apply_updates`; with ``merge``, every step also merges the window
  into ``B`` (the ``m x n`` work a factored run does once per refresh)."""
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  params = treedef.unflatten(
      [0.02 * jax.random.normal(k, s.shape) for k, s in zip(keys, leaves)]
  )
  state = tx.init(params)
  weights = factored.factor(params, state)
  plans = sketch_grad.project_state(state).spec.plan_tree()
  is_plan = lambda x: isinstance(x, logra.optim.LeafPlan)
  grads = jax.tree.map(
      lambda plan, p: (
          1e-3 * jnp.ones(plan.sketch_shape)
          if plan.projected
          else 1e-3 * jnp.sin(p * 977.0)
      ),
      plans,
      params,
      is_leaf=is_plan,
  )
  projectors = jax.tree.map(
      lambda plan: jnp.linalg.qr(
          jax.random.normal(jax.random.key(plan.index), plan.projector_shape)
      )[0]
      if plan.projected
      else None,
      plans,
      is_leaf=is_plan,
  )

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(weights, state, grads, projectors):
    if projectors is None:
      # Within a window, as value_and_sketch_grad hands them over: the
      # stored projectors passed through, or the random ones regenerated.
      projectors = state_queries.window_projectors(state)
    updates, state = tx.update(grads, state, weights, projectors=projectors)
    weights = factored.apply_updates(weights, updates)
    if merge:
      weights = factored.merge(
          weights,
          projectors,
          seed=0,
          step=sketch_grad.project_state(state).count,
      )
    return weights, state

  # The first update stores the window's projectors; then compile the
  # in-window step.
  weights, state = step(weights, state, grads, projectors)
  weights, state = jax.block_until_ready(step(weights, state, grads, None))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    weights, state = jax.block_until_ready(step(weights, state, grads, None))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def time_products(shapes, rank: int, repeats: int) -> float:
  """Median seconds of only the two rank-``rank`` products of every projected
  block matrix, ``S = P^T G`` and ``P S`` (on the longer side): the floor of a
  non-refresh LoGRA step that receives full gradients, whatever the rest."""
  specs = jax.tree.leaves(
      block_dimension_numbers(shapes),
      is_leaf=lambda x: (
          x is None or isinstance(x, optax.contrib.GaLoreDimensionNumbers)
      ),
  )
  matrices = [
      s for s, spec in zip(jax.tree.leaves(shapes), specs) if spec is not None
  ]
  keys = jax.random.split(jax.random.key(0), 2 * len(matrices))
  grads = [jax.random.normal(k, s.shape) for k, s in zip(keys, matrices)]
  projectors = [
      jnp.linalg.qr(jax.random.normal(k, (max(s.shape), rank)))[0]
      for k, s in zip(keys[len(matrices) :], matrices)
  ]

  @jax.jit
  def products(projectors, grads):
    out = []
    for p, g in zip(projectors, grads):
      if g.shape[0] >= g.shape[1]:
        out.append(p @ (p.T @ g))
      else:
        out.append((g @ p) @ p.T)
    return out

  jax.block_until_ready(products(projectors, grads))  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(products(projectors, grads))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rank", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument(
      "--refresh-repeats",
      type=int,
      default=20,
      help="repeats of refresh steps (SVD refreshes are slow)",
  )
  parser.add_argument(
      "--trees", nargs="+", default=["gpt2", "1b"], choices=["gpt2", "1b"]
  )
  parser.add_argument(
      "--layers-1b",
      type=int,
      default=1,
      help="transformer blocks of the 1B tree to time",
  )
  parser.add_argument(
      "--arms",
      nargs="+",
      default=None,
      help="only optimizers whose name contains one of these",
  )
  parser.add_argument(
      "--rounds",
      type=int,
      default=1,
      help="interleaved timings of every arm (median taken)",
  )
  args = parser.parse_args()
  wanted = (
      lambda name: name == "optax.adam"
      or args.arms is None
      or any(arm in name for arm in args.arms)
  )
  print(
      f"JAX {jax.__version__} on {jax.devices()[0].platform}, "
      f"{jax.device_count()} device(s); rank {args.rank}\n"
  )
  print(
      "| tree | optimizer | state MiB | state / adam | non-refresh ms "
      "| / adam | refresh ms | / adam |"
  )
  print("|---|---|---:|---:|---:|---:|---:|---:|")
  trees = {
      "gpt2": ("GPT-2 small", GPT2_SMALL, None),
      "1b": (
          f"1B (time: {args.layers_1b} of 22 blocks)",
          LLAMA_1B,
          args.layers_1b,
      ),
  }
  for tree_name, cfg, timed_layers in (trees[t] for t in args.trees):
    full = param_shapes(cfg)
    timed = param_shapes(cfg, timed_layers)
    rows = {}
    for name, tx in optimizers(args.rank, 10**9, full).items():
      if wanted(name):
        rows[name] = [state_bytes(tx, full)]
    never = optimizers(args.rank, 10**9, timed)  # refresh only at step 0
    always = optimizers(args.rank, 1, timed)  # refresh on every step
    factored_kinds = [
        kind
        for kind in ("random", "range")
        if wanted(f"logra factored ({kind}), from sketches")
    ]
    factored_tx = {
        kind: logra.logra(
            1e-3,
            rank=args.rank,
            kind=kind,
            refresh_every=10**9,
            dimension_numbers=logra_dimension_numbers(timed),
            factored=True,
        )
        for kind in factored_kinds
    }
    timers = {}
    for name in rows:
      timers[name] = functools.partial(
          time_steps, never[name], timed, args.repeats
      )
    for kind, tx in factored_tx.items():
      timers[kind] = functools.partial(
          time_factored_steps, tx, timed, args.repeats, merge=False
      )
    times = {name: [] for name in timers}
    for _ in range(args.rounds):
      for name, timer in timers.items():
        print(f"{tree_name}: {name}", file=sys.stderr, flush=True)
        times[name].append(timer())
    for name in rows:
      rows[name].append(statistics.median(times[name]))
      refresh_repeats = 0 if name == "optax.adam" else args.refresh_repeats
      rows[name].append(
          time_steps(always[name], timed, refresh_repeats)
          if refresh_repeats
          else rows[name][1]
      )
    adam_bytes, adam_step, _ = rows["optax.adam"]
    for name, (nbytes, step, refresh) in rows.items():
      print(
          f"| {tree_name} | {name} | {nbytes / 2**20:,.1f} | "
          f"{nbytes / adam_bytes:.3f} | {1e3 * step:,.1f} | "
          f"{step / adam_step:.2f} | {1e3 * refresh:,.1f} | "
          f"{refresh / adam_step:.2f} |"
      )
    for kind, tx in factored_tx.items():
      name = f"logra factored ({kind}), from sketches"
      step = statistics.median(times[kind])
      merged = time_factored_steps(tx, timed, args.refresh_repeats, merge=True)
      nbytes = state_bytes(tx, full)
      print(
          f"| {tree_name} | {name} | {nbytes / 2**20:,.1f} | "
          f"{nbytes / adam_bytes:.3f} | {1e3 * step:,.1f} | "
          f"{step / adam_step:.2f} | {1e3 * merged:,.1f} (merge) | "
          f"{merged / adam_step:.2f} |"
      )
    if not wanted(f"rank-{args.rank} products"):
      continue
    floor = time_products(timed, args.rank, args.repeats)
    print(
        f"| {tree_name} | rank-{args.rank} products `P^T G`, `P S` only | - "
        f"| - | {1e3 * floor:,.1f} | {floor / adam_step:.2f} | - | - |"
    )


if __name__ == "__main__":
  main()
