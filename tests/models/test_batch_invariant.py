"""The batch-invariant numerics (`logra_jax.reduction`,
`DecoderConfig.batch_invariant`): the sums' documented order, their
invariance to appended zeros, and the same math as the default numerics.
Bitwise sampler-vs-learner equality needs XLA flags set before JAX starts:
`tests/test_experiments.py` and `tests/rl/test_trainer.py` run it in fresh
processes."""

import os

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from logra_jax import configs
from logra_jax import models
from logra_jax import reduction
import numpy as np
import pytest
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

# Finite terms other than -0 (-0 + 0 is +0) and not subnormal (XLA:CPU
# flushes a subnormal it adds): where the sums' claims hold.
_floats = st.lists(
    st.floats(-1e6, 1e6, allow_subnormal=False, width=32).map(
        lambda v: v + 0.0
    ),
    min_size=1,
    max_size=40,
)
bits = lambda x: np.asarray(x, np.float32).view(np.uint32)


def test_the_sums_add_in_their_documented_order():
  """In float32, 1e8 + 1 rounds to 1e8, so the order decides the result:
  neighbours first gives (1e8 + 1) + (-1e8 + 1) = 0; halves first gives
  [1e8 + -1e8, 1 + 1] = 2; left to right would give 1."""
  x = jnp.asarray([1e8, 1.0, -1e8, 1.0], jnp.float32)
  assert float(reduction.pairwise_sum(list(x))) == 0.0
  assert float(reduction.tree_sum(x)) == 2.0
  with pytest.raises(ValueError, match="at least one part"):
    reduction.pairwise_sum([])


@settings(max_examples=40, deadline=None)
@given(_floats, st.integers(1, 40))
def test_appended_zeros_leave_the_bits(values, zeros):
  x = np.asarray(values, np.float32)
  padded = np.concatenate([x, np.zeros(zeros, np.float32)])
  np.testing.assert_array_equal(
      bits(reduction.tree_sum(jnp.asarray(padded))),
      bits(reduction.tree_sum(x)),
  )
  np.testing.assert_array_equal(
      bits(reduction.pairwise_sum(list(jnp.asarray(padded)))),
      bits(reduction.pairwise_sum(list(jnp.asarray(x)))),
  )


@settings(max_examples=40, deadline=None)
@given(_floats, st.integers(0, 40), st.integers(0, 40))
def test_tree_sum_ignores_where_the_terms_sit(values, before, after):
  """The halves-first tree adds slot ``i`` to slot ``i + n/2``: it sums the
  classes of slots modulo ``n/2, n/4, ...``, which a shift only renames, so
  terms moved along a zero-padded axis (a row's keys at another offset, as
  a multi-turn episode's are in the sampler's turn and in the learner's
  row) add to the same bits (float addition commutes)."""
  x = np.asarray(values, np.float32)
  placed = np.concatenate(
      [np.zeros(before, np.float32), x, np.zeros(after, np.float32)]
  )
  np.testing.assert_array_equal(
      bits(reduction.tree_sum(jnp.asarray(placed))),
      bits(reduction.tree_sum(x)),
  )


def test_with_matrix_rows_makes_a_single_row_two_and_keeps_the_others():
  """One row reaches the product as two (the second zero, dropped from the
  result) along the last row axis, negative axes included; several rows,
  or none, reach it as they are."""
  seen = []
  einsum = lambda x, w: jnp.einsum("bgtn,nm->bgtm", x, w)
  product = lambda x, w: seen.append(x.shape) or einsum(x, w)
  w = jnp.arange(6.0).reshape(3, 2)
  one = jnp.ones((4, 1, 1, 3))
  for row_axes in ((1, 2), (-3, -2)):
    out = reduction.with_matrix_rows(product, one, row_axes, w)
    assert seen.pop() == (4, 1, 2, 3)
    np.testing.assert_array_equal(out, einsum(one, w))
  for x in (jnp.ones((4, 2, 1, 3)), jnp.ones((4, 0, 1, 3))):
    out = reduction.with_matrix_rows(product, x, (1, 2), w)
    assert seen.pop() == x.shape and out.shape == x.shape[:-1] + (2,)
  empty = reduction.blocked_dot(jnp.ones((0, 3)), jnp.ones((3, 2)))
  assert empty.shape == (0, 2)
  with pytest.raises(ValueError, match="at least one row axis"):
    reduction.with_matrix_rows(product, one, (), w)


def test_blocked_dot_is_the_product():
  a = jax.random.normal(jax.random.key(0), (5, 600))
  b = jax.random.normal(jax.random.key(1), (600, 7))
  tol = 2 * float_tolerance(jnp.float32, 600)
  magnitude = np.abs(np.asarray(a)) @ np.abs(np.asarray(b))
  got = reduction.blocked_dot(a, b)
  np.testing.assert_array_less(
      np.abs(np.asarray(got) - np.asarray(a) @ np.asarray(b)), tol * magnitude
  )


def test_tree_sum_differentiates_as_the_plain_tree():
  """Only the value has the fixed order: through a nonlinear use (an RMS
  norm) the gradient is the one autodiff gives the tree of halves itself,
  bit for bit (a sum's gradient is a broadcast either way), and a
  forward-mode tangent is ``jnp.sum``'s."""
  x, x_dot = jax.random.normal(jax.random.key(5), (2, 3, 7, 300))
  for axis, keepdims in ((-1, True), (1, False)):
    mean_square = lambda total, x: jnp.expand_dims(
        total(x * x, axis, keepdims), () if keepdims else axis
    )
    norm = lambda total: lambda x: jnp.sum(
        jnp.tanh(x) * jax.lax.rsqrt(mean_square(total, x) + 1e-6)
    )
    np.testing.assert_array_equal(
        bits(jax.grad(norm(reduction.tree_sum))(x)),
        bits(jax.grad(norm(reduction._halves_first_sum))(x)),
    )
    tangent = lambda total: jax.jvp(
        lambda x: total(x, axis, keepdims), (x,), (x_dot,)
    )[1]
    np.testing.assert_array_equal(
        tangent(reduction.tree_sum),
        tangent(lambda x, a, k: jnp.sum(x, axis=a, keepdims=k)),
    )


def test_blocked_dot_differentiates_as_the_plain_product():
  """Only the value has the fixed order: a linear loss's gradient and a
  forward-mode tangent are `jnp.dot`'s, bit for bit (the same cotangent goes
  through the same transposed products), also with a frozen operand."""
  keys = jax.random.split(jax.random.key(4), 4)
  a, a_dot = (jax.random.normal(k, (3, 5, 600)) for k in keys[:2])
  b, b_dot = (jax.random.normal(k, (600, 7)) for k in keys[2:])
  weights = jnp.arange(3 * 5 * 7, dtype=jnp.float32).reshape(3, 5, 7)
  for product in (reduction.blocked_dot, jnp.dot):
    assert product(a, b).shape == (3, 5, 7)
  linear = lambda product: lambda a, b: jnp.sum(product(a, b) * weights)
  plain = jax.grad(linear(jnp.dot), (0, 1))(a, b)
  for got, want in zip(
      jax.grad(linear(reduction.blocked_dot), (0, 1))(a, b), plain
  ):
    np.testing.assert_array_equal(got, want)
  frozen = lambda product: lambda a: linear(product)(
      a, jax.lax.stop_gradient(b)
  )
  np.testing.assert_array_equal(
      jax.grad(frozen(reduction.blocked_dot))(a), plain[0]
  )
  tangent = lambda product: jax.jvp(product, (a, b), (a_dot, b_dot))[1]
  np.testing.assert_array_equal(
      tangent(reduction.blocked_dot), tangent(jnp.dot)
  )


@pytest.mark.parametrize("remat", ["none", "dots_saveable", "block"])
def test_batch_invariant_gradient_costs_the_default_flops(remat):
  """Blocked projections (D = 512, F = 640 > 256) differentiate like plain
  ones under every rematerialization policy: XLA's compiled flop count of
  the gradient within 2% of the default numerics' (the fixed-order sums
  add elementwise work only; a product hidden from ``dots_saveable`` would
  be recomputed: +20%)."""
  ids = jnp.zeros((4, 32), jnp.int32)

  def flops(batch_invariant):
    config = models.DecoderConfig.tiny(
        vocab_size=64,
        hidden_size=512,
        intermediate_size=640,
        batch_invariant=batch_invariant,
        remat=remat,
    )
    graphdef, params = models.split_model(models.init_model(config, 0))
    loss = lambda p: jnp.mean(models.logits_fn(graphdef, p, ids) ** 2)
    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.cost_analysis()["flops"]

  assert flops(True) <= 1.02 * flops(False)


def test_batch_invariant_decoder_computes_the_same_logits():
  """Blocked down_proj (F = 640 > 256), tree-sum norms and softmax,
  write-first decoding: the default forward's logits, to the bound of two
  summation orders, in a forward pass and decoding over a cache."""
  config = models.DecoderConfig.tiny(vocab_size=64, intermediate_size=640)
  invariant = config.replace(batch_invariant=True)
  ids = jax.random.randint(jax.random.key(2), (2, 12), 0, 64)
  graphdef, params = models.split_model(models.init_model(config, 0))
  logits = lambda c: models.logits_fn(c, params, ids)
  plain = np.asarray(jax.jit(logits, static_argnums=0)(graphdef))
  graphdef_inv, _ = models.split_model(models.init_model(invariant, 0))
  ours = np.asarray(jax.jit(logits, static_argnums=0)(graphdef_inv))
  tol = 2 * float_tolerance(jnp.float32, decoder_reduction_length(config, 12))
  np.testing.assert_allclose(
      ours, plain, rtol=0, atol=tol * np.abs(plain).max()
  )
  model = models.init_model(invariant, 0)
  cache = models.init_cache(invariant, batch_size=2, max_length=12)
  step = jax.jit(lambda m, x, c: m(x, cache=c))
  chunks = []
  for start, stop in ((0, 8), (8, 9), (9, 10), (10, 11), (11, 12)):
    out, cache = step(model, ids[:, start:stop], cache)
    chunks.append(np.asarray(out))
  np.testing.assert_allclose(
      np.concatenate(chunks, 1), plain, rtol=0, atol=tol * np.abs(plain).max()
  )


def test_batch_invariance_refuses_a_fused_attention_and_a_started_backend(
    monkeypatch,
):
  with pytest.raises(ValueError, match="batch_invariant computes attention"):
    models.DecoderConfig.tiny(batch_invariant=True, attention="xla")
  with pytest.raises(ValueError, match="policy.batch_invariant computes"):
    configs.load_config(
        "smoke", [], ["policy.batch_invariant=true", "policy.attention=cudnn"]
    )
  jax.numpy.zeros(1).block_until_ready()  # the backend has started
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_xnnpack=true")
  with pytest.raises(
      ValueError, match="XLA_FLAGS='--xla_cpu_use_xnnpack=false"
  ):
    reduction.use_invariant_kernels()
  monkeypatch.setenv("XLA_FLAGS", " ".join(reduction.CPU_FLAGS))
  reduction.use_invariant_kernels()  # present: nothing to do
  # Another spelling of the same values is theirs too.
  spelled = (
      "--xla_cpu_use_xnnpack=0 --xla_cpu_experimental_ynn_fusion_type= "
      "--xla_backend_optimization_level=3"
  )
  monkeypatch.setenv("XLA_FLAGS", spelled)
  reduction.use_invariant_kernels()
  monkeypatch.setattr(reduction, "backend_started", lambda: False)
  monkeypatch.setenv(
      "XLA_FLAGS", "--xla_cpu_use_xnnpack=true --xla_dump_to=/tmp/x"
  )
  reduction.use_invariant_kernels()  # before JAX starts: replaced
  assert os.environ["XLA_FLAGS"].split() == [
      "--xla_dump_to=/tmp/x",
      *reduction.CPU_FLAGS,
  ]
