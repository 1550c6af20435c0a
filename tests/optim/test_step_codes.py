"""Quantized step factors (``logra_jax.optim.step_codes``): the codes, their
bounds and error feedback against hand-derived values."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import logra_jax as logra
from logra_jax import configs
from logra_jax.optim import factored
from logra_jax.optim import non_finite
from logra_jax.optim import step_codes
from logra_jax.optim.dimension_numbers import plan_leaves
from logra_jax.optim.types import FactoredDelta


@pytest.mark.parametrize(
    "row,bits,exponent,decoded",
    [
        # peak 1 / 127 -> 2**-6.99: e = -6; 0.3 * 64 = 19.2 -> 19
        ([0.3, -1.0], 8, -6, [19 / 64, -1.0]),
        # peak 1 / 7 -> 2**-2.81: e = -2; 0.3 * 4 = 1.2 -> 1
        ([0.3, -1.0], 4, -2, [0.25, -1.0]),
        # peak 0.875 / 7 = 2**-3 exactly: e = -3, the largest code 7
        ([0.875, 0.1], 4, -3, [0.875, 0.125]),
        ([0.0, 0.0], 4, 0, [0.0, 0.0]),
    ],
)
def test_codes_of_a_row_by_hand(row, bits, exponent, decoded):
  codes, exponents, got = step_codes.encode(jnp.array([[row]]), bits)
  assert int(exponents[0, 0]) == exponent
  assert got[0, 0].tolist() == decoded
  assert step_codes.decode(codes, exponents, 2)[0, 0].tolist() == decoded


def test_a_non_finite_row_decodes_to_nan_alone():
  t = jnp.array([[[1.0, jnp.inf], [0.5, 0.25]]])
  _, _, decoded = step_codes.encode(t, 8)
  assert np.isnan(decoded[0, 0]).all()
  assert decoded[0, 1].tolist() == [0.5, 0.25]


finite_rows = st.lists(
    st.floats(-1e6, 1e6, width=32, allow_subnormal=False).filter(
        lambda v: v == 0 or abs(v) > 1e-30
    ),
    min_size=1,
    max_size=9,
)


@settings(deadline=None, max_examples=60)
@given(
    rows=st.lists(finite_rows, min_size=1, max_size=3),
    bits=st.sampled_from([4, 8]),
)
def test_rounding_is_to_the_nearest_code_of_an_exact_grid(rows, bits):
  width = max(map(len, rows))
  t = np.zeros((1, len(rows), width), np.float32)
  for i, row in enumerate(rows):
    t[0, i, : len(row)] = row
  codes, exponents, decoded = step_codes.encode(jnp.asarray(t), bits)
  q = step_codes.unpack_nibbles(codes, width) if bits == 4 else codes
  q, e = np.asarray(q, np.int64), np.asarray(exponents, np.int64)[..., None]
  top = 2 ** (bits - 1) - 1
  assert np.abs(q).max() <= top
  # The decoded step is exactly the code times a power of two ...
  np.testing.assert_array_equal(np.asarray(decoded), np.ldexp(q, e))
  # ... within half a quantum of the input, and the grid is the finest
  # whose codes reach the row's largest value.
  quantum = np.ldexp(1.0, e)
  assert np.all(np.abs(t - np.asarray(decoded)) <= quantum / 2)
  peak = np.abs(t).max(axis=-1, keepdims=True)
  assert np.all((peak == 0) | (peak <= top * quantum))
  assert np.all((peak == 0) | (peak > top * quantum / 2))


@settings(deadline=None, max_examples=40)
@given(
    codes=st.lists(st.integers(-8, 7), min_size=1, max_size=9),
)
def test_nibbles_round_trip(codes):
  q = jnp.asarray(codes, jnp.int8)[None]
  packed = step_codes.pack_nibbles(q)
  assert packed.dtype == jnp.uint8
  assert packed.shape == (1, (len(codes) + 1) // 2)
  assert step_codes.unpack_nibbles(packed, len(codes)).tolist() == [codes]


def _stage(refresh_every):
  params = {"w": jnp.zeros((16, 8))}
  plan = plan_leaves(params, 2, None, None)["w"]
  tx = step_codes.quantize_steps(4, rank=2, refresh_every=refresh_every)
  return plan, tx, tx.init(params)


def _steps(plan, count, seed=0):
  rng = np.random.default_rng(seed)
  return [
      jnp.asarray(1e-3 * rng.standard_normal(plan.sketch_shape), jnp.float32)
      for _ in range(count)
  ]


def test_error_feedback_keeps_the_sum_of_steps():
  """Within a window the applied steps add up to the unrounded ones but for
  the last residual, at most half a quantum of the last step."""
  plan, tx, state = _stage(refresh_every=100)
  raw, applied = _steps(plan, 40), []
  for delta in raw:
    update = {"w": FactoredDelta(coords=delta, decay=None, plan=plan)}
    update, state = tx.update(update, state)
    applied.append(np.asarray(update["w"].coords, np.float64))
  residual = np.asarray(state.residual[0], np.float64)
  total = np.sum(np.asarray(raw, np.float64), axis=0)
  # float32 sums of 40 terms of ~1e-3: a few ulps of 4e-2 each way.
  np.testing.assert_allclose(
      np.sum(applied, axis=0) + residual, total, rtol=0, atol=40 * 2**-24 * 4e-2
  )
  half_quantum = np.ldexp(0.5, np.asarray(state.exponents[0], np.int64))
  assert np.all(np.abs(residual) <= half_quantum[..., None])
  # The codes the state keeps are the last applied step's.
  np.testing.assert_array_equal(
      step_codes.decode(state.codes[0], state.exponents[0], plan.short),
      applied[-1],
  )


def test_a_refresh_drops_the_residual():
  """The update that refreshes the projector (count % refresh_every == 0)
  rounds its own step alone: the residual is in the old basis."""
  plan, tx, state = _stage(refresh_every=3)
  raw = _steps(plan, 4, seed=1)
  for delta in raw:
    update, state = tx.update(
        {"w": FactoredDelta(coords=delta, decay=None, plan=plan)}, state
    )
  _, _, alone = step_codes.encode(raw[-1], 4)
  np.testing.assert_array_equal(update["w"].coords, alone)


def test_one_non_finite_step_is_skipped_alone():
  """A step that decodes to a non-finite row (here an infinite learning rate
  at one update) is skipped by ``skip_non_finite`` and leaves no residual:
  the next updates apply, as without quantized steps."""

  def skipped(bits):
    params = {"w": jnp.ones((16, 8))}
    rate = lambda count: jnp.where(count == 1, jnp.inf, 1e-2)
    stages = [
        logra.scale_by_low_rank(rank=2, refresh_every=3, factored=True),
        optax.scale_by_learning_rate(rate),
    ]
    if bits:
      stages.append(step_codes.quantize_steps(bits, rank=2, refresh_every=3))
    tx = non_finite.skip_non_finite(optax.chain(*stages))
    state = tx.init(params)
    trainable = factored.without_base(factored.factor(params, state))
    rng = np.random.default_rng(0)
    counts = []
    for _ in range(6):
      grads = {"w": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)}
      _, state = tx.update(
          grads,
          state,
          trainable,
          apply_fn=lambda u: factored.apply_updates(trainable, u),
      )
      counts.append(int(state.skipped_steps))
    return counts

  assert skipped(4) == skipped(None) == [0, 1, 1, 1, 1, 1]


def test_a_skip_for_the_predicted_kl_applies_no_step():
  """The KL stage zeroes a step whose predicted KL is not finite; the
  rounding residual that quantize_steps would still add is not applied
  either: the skipped update's result is returned."""
  params = {"w": jnp.ones((16, 8))}
  tx = non_finite.skip_non_finite(
      optax.chain(
          logra.scale_by_low_rank(rank=2, refresh_every=100, factored=True),
          optax.scale_by_learning_rate(1e-2),
          logra.scale_by_predicted_kl(1e-3),
          step_codes.quantize_steps(4, rank=2, refresh_every=100),
      )
  )
  state = tx.init(params)
  weights = factored.factor(params, state)
  rng = np.random.default_rng(0)
  for predicted in (1e-4, np.nan):
    grads = {"w": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)}
    update, state = tx.update(
        grads, state, weights, kl_predictor=lambda u: jnp.float32(predicted)
    )
  assert non_finite.non_finite_reasons(state.reason) == ["predicted KL"]
  ((codes, exponents),) = step_codes.last_codes(state)
  # The stage rounded the residual to a step ...
  assert np.any(np.asarray(step_codes.decode(codes, exponents, 8)))
  assert not np.any(np.asarray(update["w"].coords))  # ... not applied


def test_values_beyond_the_exponent_range():
  """Rows below q_max 2**-126 round to zero where subnormals are flushed
  (or to the finest grid where they are not); a row near float32's largest
  value may decode to infinity, and its codes stay in range."""
  tiny = jnp.array([[[2.0**-120, 0.0]]])
  _, _, decoded = step_codes.encode(tiny, 8)
  assert float(decoded[0, 0, 0]) in (0.0, 2.0**-120)
  huge = jnp.array([[[np.finfo(np.float32).max, 1.0]]])
  codes, exponents, decoded = step_codes.encode(huge, 4)
  assert int(exponents[0, 0]) <= 127
  q = step_codes.unpack_nibbles(codes, 2)
  assert np.abs(np.asarray(q)).max() <= 7
  assert not np.isfinite(decoded[0, 0, 0]) or decoded[0, 0, 0] > 3e38


def test_logra_with_step_bits_applies_its_codes():
  params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
  tx = logra.logra(1e-2, rank=2, refresh_every=5, factored=True, step_bits=8)
  state = tx.init(params)
  grads = {"w": jnp.linspace(-1, 1, 128).reshape(16, 8), "b": jnp.ones(8)}
  updates, state = tx.update(grads, state, params)
  dense, (codes, exponents) = step_codes.last_codes(state)  # "b", "w"
  assert dense is None
  np.testing.assert_array_equal(
      updates["w"].coords, step_codes.decode(codes, exponents, 8)
  )
  assert codes.dtype == jnp.int8 and updates["b"].shape == (8,)


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: logra.logra(1e-2, rank=2, step_bits=4),
            "step_bits needs factored=True",
        ),
        (
            lambda: logra.logra(
                1e-2, rank=2, factored=True, weight_decay=0.1, step_bits=4
            ),
            "weight_decay=0.1",
        ),
        (
            lambda: step_codes.quantize_steps(2, rank=2, refresh_every=5),
            "bits must be one of",
        ),
        (
            lambda: configs.OptimizerConfig(step_bits=4.0),
            "must be an int of",
        ),
    ],
)
def test_bad_settings_are_refused(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_a_stage_of_another_rank_or_a_decayed_step_is_refused():
  plan, tx, state = _stage(refresh_every=10)
  wide = plan_leaves({"w": jnp.zeros((16, 8))}, 3, None, None)["w"]
  step = jnp.zeros(wide.sketch_shape)
  with pytest.raises(ValueError, match="initialized for \\(1, 2, 8\\)"):
    tx.update({"w": FactoredDelta(coords=step, decay=None, plan=wide)}, state)
  decayed = FactoredDelta(
      coords=jnp.zeros(plan.sketch_shape), decay=jnp.float32(0.1), plan=plan
  )
  with pytest.raises(ValueError, match="steps need weight_decay=0"):
    tx.update({"w": decayed}, state)
  with pytest.raises(ValueError, match="initialized for 1 parameter leaves"):
    tx.update({"w": decayed, "b": jnp.zeros(3)}, state)
