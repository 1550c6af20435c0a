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
