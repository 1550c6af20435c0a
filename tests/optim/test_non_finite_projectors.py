"""Refreshed projectors that are not finite are refused, replaced and counted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logra_jax as logra
from logra_jax import lowrank
from logra_jax.optim import sketch_grad
from logra_jax.optim import projection

PARAMS = {"a": jnp.ones((16, 8)), "b": jnp.ones((16, 8))}
X = jax.random.normal(jax.random.key(0), (5, 16))
# An infinite input makes the gradient of "b" (X^T dY) infinite, and with it
# the range finder's products and the SVD: the refreshed projector is NaN.
X_BAD = X.at[0, 3].set(jnp.inf)


def _tx(kind):
  return logra.scale_by_low_rank(rank=2, kind=kind, refresh_every=1)


def _loss(params, x, x_b):
  return jnp.sum(jnp.tanh(lowrank.matmul(x, params["a"]))) + jnp.sum(
      jnp.tanh(lowrank.matmul(x_b, params["b"]))
  )


def _grads(x_b):
  return jax.grad(_loss)(PARAMS, X, x_b)


def _projectors(state):
  return sketch_grad.project_state(state).projectors


def _random_projector(state, leaf, window):
  plan = sketch_grad.project_state(state).spec.plan_tree()[leaf]
  config = sketch_grad.project_state(state).spec.config
  return projection.random_window_projector(plan, config, window)


def _assert_orthonormal(p):
  np.testing.assert_allclose(
      jnp.swapaxes(p, 1, 2) @ p, jnp.eye(2)[None], atol=1e-5
  )


def _sketch_direct_step(tx, state, x_b):
  value, grads, projectors = logra.value_and_sketch_grad(_loss)(
      PARAMS, state, X, x_b
  )
  _, state = tx.update(grads, state, PARAMS, projectors=projectors)
  return grads, projectors.projectors, projectors.non_finite, state


def _dense_step(tx, state, x_b):
  _, state = tx.update(_grads(x_b), state, PARAMS)
  return None, _projectors(state), None, state


@pytest.mark.parametrize("kind", ["range", "svd"])
@pytest.mark.parametrize(
    "step", [_dense_step, _sketch_direct_step], ids=["dense", "sketch-direct"]
)
def test_a_non_finite_projector_is_replaced_and_counted(kind, step):
  tx = _tx(kind)
  state = tx.init(PARAMS)
  # First refresh: "b" has no previous projector and gets the window's
  # random one; "a" is refreshed as usual.
  grads, projectors, refused, state = step(tx, state, X_BAD)
  np.testing.assert_array_equal(
      projectors["b"], _random_projector(state, "b", 0)
  )
  _assert_orthonormal(projectors["a"])
  assert int(sketch_grad.project_state(state).non_finite) == 1
  if refused is not None:
    assert int(refused) == 1
    # The sketches were taken with the projectors in use (the range finder
    # reruns one pass for them).
    dense = _grads(X_BAD)["a"]
    np.testing.assert_allclose(
        grads["a"], projectors["a"].mT @ dense, rtol=1e-5, atol=1e-6
    )
  # A finite refresh, then a non-finite one: "b" keeps its previous
  # projector (the refresh is skipped for it), "a" moves on.
  _, before, _, state = step(tx, state, X)
  _, after, _, state = step(tx, state, X_BAD)
  np.testing.assert_array_equal(after["b"], before["b"])
  assert int(sketch_grad.project_state(state).non_finite) == 2
  for p in jax.tree.leaves(_projectors(state)):
    assert bool(jnp.all(jnp.isfinite(p)))


def test_each_matrix_of_a_batch_is_checked_on_its_own():
  params = {"w": jnp.ones((2, 16, 8))}  # two layers
  dims = {
      "w": logra.DimensionNumbers(
          reduction_axes=(1,), output_axes=(2,), batch_axes=(0,)
      )
  }
  tx = logra.scale_by_low_rank(rank=2, refresh_every=1, dimension_numbers=dims)
  g = jax.random.normal(jax.random.key(1), (2, 16, 8))
  state = tx.init(params)
  _, state = tx.update({"w": g}, state, params)
  first = _projectors(state)["w"]
  _, state = tx.update({"w": g.at[1, 0, 0].set(jnp.nan)}, state, params)
  second = _projectors(state)["w"]
  np.testing.assert_array_equal(second[1], first[1])  # refused: previous
  assert not np.array_equal(second[0], first[0])  # refreshed
  assert int(sketch_grad.project_state(state).non_finite) == 1


def test_sketch_direct_sketches_use_the_replacement():
  # A finite gradient whose range-finder products overflow: row 3 of the
  # gradient of "b" is 3e38 * c[0] (finite), its products with the Gaussian
  # test matrix exceed the float32 range, so the refreshed projector is NaN
  # and refused; the sketch is then retaken with the replacement P, and is
  # the finite P^T G.
  c = jax.random.uniform(jax.random.key(2), (5, 8), minval=-1.0, maxval=1.0)

  def loss(params, x, x_b):
    return jnp.sum(jnp.tanh(lowrank.matmul(x, params["a"]))) + jnp.sum(
        lowrank.matmul(x_b, params["b"]) * c
    )

  x_b = X.at[0, 3].set(3e38)
  tx = _tx("range")
  state = tx.init(PARAMS)
  _, grads, projectors = logra.value_and_sketch_grad(loss)(
      PARAMS, state, X, x_b
  )
  assert int(projectors.non_finite) == 1
  p_b = projectors.projectors["b"]
  np.testing.assert_array_equal(p_b, _random_projector(state, "b", 0))
  g_b = jax.grad(loss)(PARAMS, X, x_b)["b"]
  assert bool(jnp.all(jnp.isfinite(g_b)))
  np.testing.assert_allclose(grads["b"], p_b.mT @ g_b, rtol=1e-5)
  updates, state = tx.update(grads, state, PARAMS, projectors=projectors)
  assert int(sketch_grad.project_state(state).non_finite) == 1
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
