"""The non-finite guard also checks the update it applies."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logra_jax as logra
from logra_jax.optim import non_finite

PARAMS = {
    "w": jax.random.normal(jax.random.key(0), (8, 4)),
    "b": jnp.arange(4.0),
}
GRADS = jax.tree.map(lambda p: jnp.full_like(p, 0.5), PARAMS)


@pytest.mark.parametrize("learning_rate", [jnp.nan, jnp.inf])
def test_a_non_finite_update_is_returned_as_zeros(learning_rate):
  # A learning rate the config would refuse, handed to the chain directly.
  tx = non_finite.skip_non_finite(optax.adam(learning_rate))
  state = tx.init(PARAMS)
  updates, new = tx.update(GRADS, state, PARAMS, loss=jnp.asarray(1.0))
  for u in jax.tree.leaves(updates):
    np.testing.assert_array_equal(u, jnp.zeros_like(u))
  assert non_finite.non_finite_reasons(new.reason) == ["update"]
  assert int(new.skipped_steps) == int(new.consecutive_skips) == 1
  # The state is kept as the inner optimizer advanced it (restoring it would
  # hold two copies): the moments saw the gradient.
  assert int(new.inner_state[0].count) == 1


@pytest.mark.parametrize("learning_rate", [jnp.nan, jnp.inf])
def test_a_non_finite_applied_update_leaves_params_unchanged(learning_rate):
  # Under LoGRA the learner applies the update inside the guard (apply_fn):
  # the applied result is what is checked.
  # A schedule that goes non-finite (logra() refuses a non-finite float).
  tx = non_finite.skip_non_finite(
      logra.logra(lambda count: learning_rate, rank=2, refresh_every=1)
  )
  state = tx.init(PARAMS)
  apply = lambda u: optax.apply_updates(PARAMS, u)
  new_params, new = tx.update(GRADS, state, PARAMS, apply_fn=apply)
  for before, after in zip(
      jax.tree.leaves(PARAMS), jax.tree.leaves(new_params)
  ):
    np.testing.assert_array_equal(after, before)
  assert non_finite.non_finite_reasons(new.reason) == ["update"]
  assert int(new.skipped_steps) == 1
  # Finite, the same chain moves the params and clears the reason.
  tx = non_finite.skip_non_finite(logra.logra(1e-2, rank=2, refresh_every=1))
  new_params, new = tx.update(GRADS, tx.init(PARAMS), PARAMS, apply_fn=apply)
  assert int(new.reason) == 0 and int(new.skipped_steps) == 0
  assert not np.array_equal(new_params["w"], PARAMS["w"])


def test_an_overflowing_result_is_skipped():
  # A finite update whose sum with the params overflows float32.
  params = {"w": jnp.full((3,), 3e38)}
  tx = non_finite.skip_non_finite(optax.sgd(-1.0))
  new_params, new = tx.update(
      {"w": jnp.full((3,), 1e38)},
      tx.init(params),
      params,
      apply_fn=lambda u: optax.apply_updates(params, u),
  )
  np.testing.assert_array_equal(new_params["w"], params["w"])
  assert non_finite.non_finite_reasons(new.reason) == ["update"]


def _step_temporaries(tx, params, guarded):
  """XLA's temporaries of one update-and-apply step, params and state
  donated as the trainer donates them."""

  def step(p, s, g):
    if guarded:
      apply = lambda u: optax.apply_updates(p, u)
      return tx.update(g, s, p, apply_fn=apply, loss=jnp.sum(g["b"]))
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  compiled = (
      jax.jit(step, donate_argnums=(0, 1))
      .lower(params, tx.init(params), params)
      .compile()
  )
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_guard_holds_the_result_not_a_copy_of_the_state(dtype):
  # The guard decides on its inputs with lax.cond (no select between two
  # states) and holds the old params only until the result is known finite.
  params = {
      "w1": jnp.zeros((512, 512), dtype),
      "w2": jnp.zeros((512, 512), dtype),
      "b": jnp.zeros((512,), dtype),
  }
  leaves = jax.tree.leaves(params)
  params_bytes = sum(x.nbytes for x in leaves)
  elements = sum(x.size for x in leaves)
  adam = lambda: optax.adam(1e-3)
  extra = _step_temporaries(
      non_finite.skip_non_finite(adam()), params, True
  ) - _step_temporaries(adam(), params, False)
  # Adam's state is two copies of the params; the guard costs one: the old
  # params beside the result (so at least that: the guard is there), and
  # the result's finiteness, a byte per element (with 1% of the params for
  # XLA's small buffers).
  assert params_bytes <= extra <= params_bytes + elements + 0.01 * params_bytes
  if dtype != jnp.float32:
    return
  # Under LoGRA it costs less than optax's own guard, which selects between
  # the old and the new state.
  lo = lambda: logra.logra(1e-3, rank=8, refresh_every=5)
  ours = _step_temporaries(non_finite.skip_non_finite(lo()), params, True)
  optax_guard = optax.apply_if_finite(lo(), max_consecutive_errors=3)
  assert ours < _step_temporaries(optax_guard, params, False)
