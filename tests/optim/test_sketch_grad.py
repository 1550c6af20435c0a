"""Sketch-direct gradients equal the projected dense gradients, and misuse fails."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logra_jax as logra
from logra_jax import models
from logra_jax import lowrank
from logra_jax import policy_state
from logra_jax.optim import sketch_grad
from logra_jax.optim import projectors as proj_lib

VOCAB = 32


def _decoder(tie_word_embeddings: bool):
  config = models.DecoderConfig.tiny(
      vocab_size=VOCAB, tie_word_embeddings=tie_word_embeddings
  )
  graphdef, params = models.split_model(models.init_model(config, rngs=0))
  ids_BxT = jax.random.randint(jax.random.key(1), (4, 9), 0, VOCAB)

  def loss(params, ids_BxT):
    logits_BxTxV = models.logits_fn(graphdef, params, ids_BxT[:, :-1])
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV)
    return -jnp.mean(jnp.take_along_axis(logp_BxTxV, ids_BxT[:, 1:, None], -1))

  return params, ids_BxT, loss


@pytest.fixture(scope="module")
def decoder():
  # Tied embeddings: the table [32, 64] is gathered (`take`) and used as the
  # LM head (`matmul` of its transpose). q/k/v/o [2, 64, 64] and down
  # [2, 128, 64] are projected on the left, gate/up [2, 64, 128] on the right.
  return _decoder(tie_word_embeddings=True)


def _optimizer(params, include_embeddings=False, **kwargs):
  dims = policy_state.matrix_dimension_numbers(
      params, include_embeddings=include_embeddings
  )
  return logra.logra(
      1e-2, rank=8, refresh_every=2, dimension_numbers=dims, **kwargs
  )


def _plans(opt_state):
  return sketch_grad.project_state(opt_state).spec


def _relative(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _check_sketches(params, ids_BxT, loss, tx, kind):
  """Two steps (a refresh, then the stored projector): each sketch equals the
  dense gradient projected; returns the projected leaves' paths and sides."""
  opt_state = tx.init(params)
  fn = jax.jit(logra.value_and_sketch_grad(loss))
  loss_value, dense_grads = jax.jit(jax.value_and_grad(loss))(params, ids_BxT)
  sides = set()
  projected = set()
  for step in range(2):  # a refresh step, then one with the stored projector
    value, grads, projectors = fn(params, opt_state, ids_BxT)
    np.testing.assert_allclose(value, loss_value, rtol=1e-6)
    spec = _plans(opt_state)
    for plan, s, p, g in zip(
        spec.plans,
        spec.treedef.flatten_up_to(grads),
        spec.treedef.flatten_up_to(projectors.projectors),
        spec.treedef.flatten_up_to(dense_grads),
    ):
      if not plan.projected:
        assert p is None
        assert _relative(s, g) <= 1e-6, plan.path
        continue
      sides.add(plan.left)
      projected.add(plan.path.removesuffix(".value"))
      assert s.shape == (plan.batch, 8, plan.short)
      assert p.shape == (plan.batch, plan.long, 8)
      np.testing.assert_allclose(
          jnp.swapaxes(p, 1, 2) @ p,
          jnp.broadcast_to(jnp.eye(8), (plan.batch, 8, 8)),
          atol=1e-5,
      )
      assert _relative(s, plan.sketch(p, g)) <= 1e-5, (kind, step, plan.path)
      if step == 0 and kind == "range":
        # The refresh from thin products is the dense range finder's.
        key = proj_lib.window_key(0, plan.index, 0)
        reference = proj_lib.range_projector(plan.to_long_view(g), key, 8, 8, 1)
        np.testing.assert_allclose(p, reference, atol=1e-4)
      if step == 0 and kind == "svd":
        reference = proj_lib.svd_projector(plan.to_matrix(g), 8, plan.left)
        np.testing.assert_allclose(jnp.abs(p), jnp.abs(reference), atol=1e-4)
    _, opt_state = jax.jit(tx.update)(
        grads, opt_state, params, projectors=projectors
    )
  return projected, sides


@pytest.mark.parametrize("kind", ["range", "random", "svd"])
def test_sketch_equals_projected_dense_gradient(decoder, kind):
  params, ids_BxT, loss = decoder
  projected, sides = _check_sketches(
      params, ids_BxT, loss, _optimizer(params, kind=kind), kind
  )
  assert sides == {True, False}
  assert "['embed']" not in projected and len(projected) == 7


@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_sketches_of_projected_embeddings(tie_word_embeddings):
  # The table [32, 64] (projected on the right; the range finder's refresh
  # passes use both forms of the low-rank term) is gathered by `take` and,
  # when tied, is also the LM head (`matmul` of `.T`); an untied LM head
  # [64, 32] is projected on the left.
  params, ids_BxT, loss = _decoder(tie_word_embeddings)
  tx = _optimizer(params, include_embeddings=True, kind="range")
  projected, _ = _check_sketches(params, ids_BxT, loss, tx, "range")
  assert "['embed']" in projected
  assert ("['lm_head']" in projected) == (not tie_word_embeddings)


@pytest.mark.parametrize("kind,tolerance", [("random", 1e-5), ("range", 1e-3)])
def test_sketch_steps_equal_dense_steps(decoder, kind, tolerance):
  # Random projectors are the same arrays in both modes, so the steps agree
  # to float rounding. Range projectors are recomputed from differently
  # rounded products (agreeing to ~1e-5), and Adam's first steps, close to
  # sign(g), amplify that on near-zero coordinates.
  params, ids_BxT, loss = decoder
  tx = _optimizer(params, kind=kind)

  @jax.jit
  def dense_step(params, opt_state):
    grads = jax.grad(loss)(params, ids_BxT)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  @jax.jit
  def sketch_step(params, opt_state):
    _, grads, projectors = logra.value_and_sketch_grad(loss)(
        params, opt_state, ids_BxT
    )
    updates, opt_state = tx.update(
        grads, opt_state, params, projectors=projectors
    )
    return optax.apply_updates(params, updates), opt_state

  dense = sketch = (params, tx.init(params))
  for _ in range(3):  # refresh, stored projector, refresh
    dense, sketch = dense_step(*dense), sketch_step(*sketch)
  for p0, a, b in zip(
      *(jax.tree.leaves(p) for p in (params, sketch[0], dense[0]))
  ):
    assert _relative(a - p0, b - p0) <= tolerance
  for a, b in zip(jax.tree.leaves(sketch[1]), jax.tree.leaves(dense[1])):
    if jnp.issubdtype(a.dtype, jnp.floating) and jnp.any(b != 0):
      assert _relative(a, b) <= tolerance
    else:
      np.testing.assert_array_equal(a, b)


def test_micro_batched_sketches_equal_the_full_batch(decoder):
  params, ids_BxT, loss = decoder
  tx = _optimizer(params, kind="random")
  opt_state = tx.init(params)
  total = lambda p, ids: loss(p, ids) * ids.shape[0]  # sum over sequences
  _, full, _ = logra.value_and_sketch_grad(total)(params, opt_state, ids_BxT)
  values, summed, _ = logra.value_and_sketch_grad(total, micro_batched=True)(
      params, opt_state, ids_BxT.reshape(2, 2, -1)
  )
  assert values.shape == (2,)
  for a, b in zip(jax.tree.leaves(summed), jax.tree.leaves(full)):
    assert _relative(a, b) <= 1e-5


def test_value_and_grad_sum_is_the_gradient_of_the_sum():
  loss = lambda w, x: jnp.sum(jnp.sin(w * x))
  w, x_MxN = 0.7, jnp.arange(6.0).reshape(3, 2)
  values, grad = sketch_grad.value_and_grad_sum(loss)(w, x_MxN)
  np.testing.assert_allclose(values, jnp.sin(w * x_MxN).sum(1), rtol=1e-6)
  np.testing.assert_allclose(
      grad, jnp.sum(x_MxN * jnp.cos(w * x_MxN)), rtol=1e-6
  )


def test_matmul_of_a_low_rank_delta():
  keys = jax.random.split(jax.random.key(0), 4)
  w, f, z = (
      jax.random.normal(k, s) for k, s in zip(keys, [(6, 5), (6, 2), (2, 5)])
  )
  x = jax.random.normal(keys[3], (3, 6))
  rows = lowrank.LowRankDelta(w, f, z, rows=True, path="w")
  np.testing.assert_allclose(
      lowrank.matmul(x, rows), x @ (w + f @ z), rtol=1e-5
  )
  # W + Z F^T with coordinates Z = f [6, 2] and factor F = z^T [5, 2].
  cols = lowrank.LowRankDelta(w, z.T, f, rows=False, path="w")
  np.testing.assert_allclose(
      lowrank.matmul(x, cols), x @ (w + f @ z), rtol=1e-5
  )
  y = jax.random.normal(keys[3], (3, 5))
  for delta in (rows, cols):
    np.testing.assert_allclose(
        lowrank.matmul(y, delta.T), y @ (w + f @ z).T, rtol=1e-5
    )
  ids = jnp.array([[5, 0], [2, 5]])
  for delta in (rows, cols):
    np.testing.assert_allclose(
        lowrank.take(delta, ids), (w + f @ z)[ids], rtol=1e-5
    )
  with pytest.raises(TypeError, match="parameter 'w'.*matmul"):
    jnp.sum(rows)
  with pytest.raises(ValueError, match="slice its layer axis"):
    lowrank.matmul(
        x,
        lowrank.LowRankDelta(w[None], f[None], z[None], rows=True, path="w"),
    )


def test_take_differentiates_the_coordinates_only():
  # d/dZ sum(take(W + F Z, ids) * c) = F_ids^T c; W gets no gradient.
  keys = jax.random.split(jax.random.key(1), 4)
  w, f, c = (
      jax.random.normal(k, s) for k, s in zip(keys, [(7, 3), (7, 2), (4, 3)])
  )
  ids = jnp.array([6, 1, 6, 0])

  def total(w, z):
    delta = lowrank.LowRankDelta(w, f, z, rows=True, path="embed")
    return jnp.sum(lowrank.take(delta, ids) * c)

  dw, dz = jax.grad(total, argnums=(0, 1))(w, jnp.zeros((2, 3)))
  np.testing.assert_array_equal(dw, jnp.zeros_like(w))
  np.testing.assert_allclose(dz, f[ids].T @ c, rtol=1e-5)


def test_a_loss_that_closes_over_params_is_refused(decoder):
  params, ids_BxT, loss = decoder
  tx = _optimizer(params)
  closed = lambda p, ids: loss(params, ids)
  with pytest.raises(ValueError, match=r"never used.*q_proj"):
    logra.value_and_sketch_grad(closed)(params, tx.init(params), ids_BxT)


def test_other_uses_of_a_projected_weight_are_refused(decoder):
  params, ids_BxT, loss = decoder
  tx = _optimizer(params, include_embeddings=True)
  # An L2 penalty reads the table directly: the error names it.
  penalized = lambda p, ids: loss(p, ids) + jnp.sum(jnp.square(p["embed"][...]))
  with pytest.raises(TypeError, match=r"parameter \"\['embed'\].*matmul"):
    logra.value_and_sketch_grad(penalized)(params, tx.init(params), ids_BxT)


def test_params_the_state_does_not_know_are_named(decoder):
  params, ids_BxT, loss = decoder
  opt_state = _optimizer(params).init(params)
  other = {"w": jnp.ones((4, 4))}
  with pytest.raises(ValueError, match=r"unknown leaves \[\"\['w'\]\"\]"):
    logra.value_and_sketch_grad(lambda p, x: 0.0)(other, opt_state, ids_BxT)


def test_stale_projector_state_is_named(decoder):
  params, ids_BxT, loss = decoder
  state_r8 = _optimizer(params).init(params)
  state_r4 = logra.logra(
      1e-2,
      rank=4,
      refresh_every=2,
      dimension_numbers=policy_state.matrix_dimension_numbers(params),
  ).init(params)
  # Projector arrays of another rank under this state's plan (e.g. restored
  # from a checkpoint of another configuration).
  project_r8, *stages = state_r8[0]
  stale = (
      (project_r8._replace(projectors=state_r4[0][0].projectors), *stages),
      *state_r8[1:],
  )
  with pytest.raises(ValueError, match=r"down_proj.*rank 8.*stale"):
    logra.value_and_sketch_grad(loss)(params, stale, ids_BxT)
  # A whole state of another rank handed to this optimizer.
  tx = _optimizer(params)
  grads = jax.grad(loss)(params, ids_BxT)
  with pytest.raises(ValueError, match=r"rank"):
    tx.update(grads, state_r4, params)


def test_sketched_gradients_without_projectors_are_refused(decoder):
  params, ids_BxT, loss = decoder
  tx = _optimizer(params)
  opt_state = tx.init(params)
  _, grads, _ = logra.value_and_sketch_grad(loss)(params, opt_state, ids_BxT)
  with pytest.raises(ValueError, match=r"projectors= argument"):
    tx.update(grads, opt_state, params)
