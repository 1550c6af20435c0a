"""The optimizer state as optax sees it: its structure follows the params',
matrices too small for the rank stay dense, and the public surface."""

import importlib.metadata

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import logra_jax as logra


def _small_tree():
  """A projected matrix, a vector and two matrices smaller than rank 8."""
  return {
      "w": jnp.linspace(-1.0, 1.0, 16 * 12).reshape(16, 12),
      "b": jnp.zeros(12),
      "square": jnp.ones((2, 2)),
      "wide": jnp.arange(6.0).reshape(2, 3),
  }


def _grads(params, step):
  keys = jax.random.split(jax.random.key(step), len(jax.tree.leaves(params)))
  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten(
      [jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)]
  )


def test_map_params_reaches_every_params_tree_of_the_state():
  params = _small_tree()
  tx = logra.logra(learning_rate=1e-2, rank=8)
  state = tx.init(params)
  _, state = tx.update(_grads(params, 0), state, params)
  seen = []

  def record(x):
    seen.append(x.shape)
    return x

  mapped = optax.tree.map_params(tx, record, state)
  assert jax.tree.structure(mapped) == jax.tree.structure(state)
  chex.assert_trees_all_equal(mapped, state)
  # Adam's two moments, at the sketch shape for the projected matrix and at
  # full size for the dense leaves; the stored projector of the matrix.
  assert sorted(seen) == sorted(
      [(1, 8, 12)] * 2 + [(12,), (2, 2), (2, 3)] * 2 + [(1, 16, 8)]
  )


def test_state_structure_depends_on_shapes_not_values():
  tx = logra.logra(learning_rate=1e-2, rank=8, keep_factors=True)
  zeros = jax.tree.map(jnp.zeros_like, _small_tree())
  a = tx.init(_small_tree())
  b = tx.init(zeros)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  _, a = tx.update(_grads(zeros, 0), a, zeros)
  assert jax.tree.structure(a) == jax.tree.structure(b)


def test_matrices_smaller_than_the_rank_are_kept_dense():
  params = _small_tree()
  tx = logra.logra(learning_rate=1e-2, rank=8)
  state = tx.init(params)
  assert logra.kept_dense_paths(state) == ("['square']", "['wide']")
  adam = optax.adam(1e-2)
  adam_state = adam.init(params)
  for step in range(2):
    grads = _grads(params, step)
    updates, state = tx.update(grads, state, params)
    expected, adam_state = adam.update(grads, adam_state, params)
    for name in ("b", "square", "wide"):
      np.testing.assert_array_equal(updates[name], expected[name])
  assert updates["w"].shape == (16, 12)


def test_rank_clipped_to_the_shorter_side_still_projects():
  state = logra.logra(1e-3, rank=9).init({"w": jnp.zeros((16, 4))})
  assert logra.kept_dense_paths(state) == ()
  assert state[0][0].projectors["w"].shape == (1, 16, 4)


def test_inject_hyperparams_on_a_tree_with_small_matrices():
  params = _small_tree()
  tx = optax.inject_hyperparams(logra.logra)(learning_rate=1e-2, rank=8)
  state = tx.init(params)
  update = jax.jit(tx.update)
  updates, state = update(_grads(params, 0), state, params)
  plain = logra.logra(learning_rate=1e-2, rank=8)
  expected, _ = plain.update(_grads(params, 0), plain.init(params), params)
  chex.assert_trees_all_close(updates, expected, rtol=1e-6, atol=1e-7)
  state.hyperparams["learning_rate"] = jnp.asarray(0.0)
  updates, state = update(_grads(params, 1), state, params)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))


def test_public_surface():
  assert logra.__version__ == importlib.metadata.version("logra-jax")
  for name in logra.__all__:
    assert getattr(logra, name) is not None, name
  for state_type in (
      logra.ProjectState,
      logra.LowRankMomentsState,
      logra.UnprojectState,
      logra.ScaleByPredictedKLState,
  ):
    assert state_type.__name__ in logra.__all__
