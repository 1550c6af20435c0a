"""The small factored LoGRA learner the policy-sync tests follow."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import logra_jax as logra
from logra_jax.lowrank import matmul
from logra_jax.optim import factored
from logra_jax.optim import sketch_grad

REFRESH = 25  # the projector window, in updates


def small_params():
  """A wide and a tall matrix and a dense bias."""
  rng = np.random.default_rng(0)
  normal = lambda shape, scale: jnp.asarray(
      scale * rng.standard_normal(shape), jnp.float32
  )
  return {
      "w": normal((6, 20), 0.3),  # wide
      "v": normal((12, 8), 0.3),  # tall
      "b": normal((20,), 0.1),
  }  # dense


def factored_learner(
    kind,
    base_dtype,
    weight_decay,
    donate=False,
    coords_dtype="float32",
    step_bits=None,
):
  """A factored LoGRA loop (docs/sketch.md's) on a small tree: ``(weights,
  state, step)``; ``donate``: the step donates its inputs, as the
  trainer's does."""
  params = small_params()
  tx = logra.logra(
      1e-2,
      rank=2,
      kind=kind,
      refresh_every=REFRESH,
      weight_decay=weight_decay,
      factored=True,
      step_bits=step_bits,
  )
  state = tx.init(params)
  weights = factored.factor(
      params,
      state,
      base_dtype=base_dtype,
      decay=weight_decay > 0,
      coords_dtype=coords_dtype,
  )

  def loss(p, x):
    h = jnp.tanh(matmul(x, p["v"]))  # [.., 12] -> [.., 8]
    h = jnp.concatenate([h, h[:, :4] ** 2], axis=-1)[:, :6]
    return jnp.mean(jnp.square(matmul(h, p["w"]) + p["b"] - 0.5))

  @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
  def step(weights, state, x):
    weights = factored.merge_at_refresh(weights, state, seed=7)
    _, sketches, projectors = logra.value_and_sketch_grad(loss)(
        weights, state, x
    )
    count = sketch_grad.project_state(state).count
    updates, state = tx.update(sketches, state, weights, projectors=projectors)
    return factored.apply_updates(weights, updates, seed=7, step=count), state

  return weights, state, step


def batch(i):
  """The ``i``-th batch of inputs."""
  return jax.random.normal(jax.random.key(i), (16, 12))


def same_bits(a, b):
  """Whether two trees hold the same dtypes and bits."""
  return jax.tree.all(
      jax.tree.map(
          lambda x, y: x.dtype == y.dtype
          and np.array_equal(
              np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)
          ),
          a,
          b,
      )
  )
