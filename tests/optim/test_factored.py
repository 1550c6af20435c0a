"""The factored policy W = c B + P A against dense LoGRA and its own claims."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logra_jax as logra
from logra_jax.optim import factored
from logra_jax import random_bits
from logra_jax.optim import state_queries
from logra_jax.optim.sketch_grad import factored_view
from logra_jax.lowrank import matmul
from tolerances import float_tolerance

LR = 1e-2
RANK = 2
REFRESH = 2
WINDOWS = 3
ROWS = 32
# Terms summed along the float32 chain from the weights to a step (see
# tests/tolerances.py): the two matmuls (16, 6) forward and backward, the
# sum over the rows, the sketch over the long side (<= 20), the expansion
# P N over the rank and the one add of the step.
CHAIN = 2 * (16 + 6) + ROWS + 20 + RANK + 1


def _normal(seed, shape, scale=1.0):
  """Test data from numpy's generator (nothing to compile)."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def _params():
  return {
      "w": _normal(0, (16, 8), 1 / 4),  # tall
      "v": _normal(1, (6, 20), 1 / 3),  # wide
      "b": jnp.zeros(8),
  }


def _logits(p, x_NxM):
  """A two-layer model that applies its matrices through ``matmul``."""
  h_NxH = jnp.tanh(matmul(x_NxM, p["w"]) + p["b"])
  return matmul(h_NxH[..., :6], p["v"])


def _loss(p, x_NxM):
  return jnp.mean(jnp.square(_logits(p, x_NxM) - 1.0))


def _inputs():
  return _normal(2, (ROWS, 16))


def _max_abs(tree) -> float:
  return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


def _run_both(kind, moment_policy, weight_decay=0.0):
  """Dense and factored LoGRA side by side for ``WINDOWS`` windows, in one
  jitted scan; returns the dense params and the factored arm's effective
  weights after every step (stacked)."""
  kwargs = dict(
      kind=kind,
      refresh_every=REFRESH,
      moment_policy=moment_policy,
      weight_decay=weight_decay,
  )
  tx = logra.logra(LR, RANK, **kwargs)
  tx_f = logra.logra(LR, RANK, factored=True, **kwargs)
  params, x = _params(), _inputs()
  state, state_f = tx.init(params), tx_f.init(params)
  weights = factored.factor(params, state_f, decay=weight_decay > 0)

  def step(carry, _):
    params, state, weights, state_f = carry
    updates, state = tx.update(jax.grad(_loss)(params, x), state, params)
    params = optax.apply_updates(params, updates)
    weights = factored.merge_at_refresh(weights, state_f, seed=0)
    _, sketches, projectors = logra.value_and_sketch_grad(_loss)(
        weights, state_f, x
    )
    updates_f, state_f = tx_f.update(
        sketches, state_f, weights, projectors=projectors
    )
    weights = factored.apply_updates(weights, updates_f)
    effective = factored.effective_weights(
        weights, state_queries.window_projectors(state_f)
    )
    return (params, state, weights, state_f), (params, effective)

  run = jax.jit(
      lambda carry: jax.lax.scan(step, carry, None, length=WINDOWS * REFRESH)[1]
  )
  return run((params, state, weights, state_f))


def _assert_trajectories_close(dense, effective, weight_decay):
  """After step t the two arms differ by at most the rounding of t steps:
  each step rounds weights of magnitude M and an Adam step of magnitude
  LR * (1 + weight_decay * M) (Adam's ratio is of order one) along a chain
  of CHAIN terms; with well separated singular values the projectors of the
  two arms move by the same order."""
  gamma = 2 * float_tolerance(np.float32, CHAIN)
  atol = 0.0
  for t in range(WINDOWS * REFRESH):
    dense_t = jax.tree.map(lambda a: a[t], dense)
    magnitude = _max_abs(dense_t)
    atol += gamma * (magnitude + LR * (1 + weight_decay * magnitude))
    for name in dense_t:
      np.testing.assert_allclose(
          effective[name][t],
          dense_t[name],
          rtol=0,
          atol=atol,
          err_msg=f"leaf {name} after step {t}",
      )
  return atol


@pytest.mark.parametrize("moment_policy", ["transfer", "keep", "reset"])
@pytest.mark.parametrize("kind", ["range", "random", "svd"])
def test_factored_steps_equal_dense_steps(kind, moment_policy):
  """c B + P A after every step equals dense LoGRA's weights, over windows."""
  dense, effective = _run_both(kind, moment_policy)
  atol = _assert_trajectories_close(dense, effective, weight_decay=0.0)
  # The steps moved every leaf by far more than the tolerance.
  params = _params()
  for name in params:
    assert _max_abs(dense[name][-1] - params[name]) > 100 * atol, name


def test_factored_decay_equals_dense_decay():
  """With weight decay the scale c makes the factored steps exact."""
  decay = 0.5
  dense, effective = _run_both("svd", "transfer", weight_decay=decay)
  _assert_trajectories_close(dense, effective, weight_decay=decay)


def _window(base_dtype="float32", decay=True, coords_dtype="float32"):
  """Factored weights in the middle of a window (A != 0, c != 1) and
  orthonormal projectors, made by hand."""
  params = _params()
  tx = logra.logra(LR, RANK, factored=True)
  weights = factored.factor(params, tx.init(params), base_dtype, decay=decay)
  projectors = {"b": None}
  for seed, name in enumerate(("w", "v")):
    w = weights[name]
    q_BxLxR, _ = np.linalg.qr(
        np.asarray(_normal(10 + seed, (w.plan.batch, w.plan.long, w.plan.rank)))
    )
    projectors[name] = jnp.asarray(q_BxLxR)
    weights[name] = dataclasses.replace(
        w,
        coords=_normal(20 + seed, w.coords.shape, 0.1).astype(coords_dtype),
        scale=jnp.full(w.scale.shape, 0.93, jnp.float32) if decay else None,
    )
  return weights, projectors


def _merge_atol(weights, before) -> float:
  """Two evaluations of c B + P A (rank + 1 terms) in different orders."""
  return (
      2
      * float_tolerance(np.float32, RANK + 1)
      * (_max_abs(before) + _max_abs([w.coords for w in _factored(weights)]))
  )


def _factored(weights):
  return [
      w
      for w in jax.tree.leaves(weights, is_leaf=factored.is_factored)
      if factored.is_factored(w)
  ]


@jax.jit
def _merged(weights, projectors, step):
  """W before, the merged weights, and W after."""
  before = factored.effective_weights(weights, projectors, jnp.float32)
  merged = factored.merge(weights, projectors, seed=0, step=step)
  return (
      before,
      merged,
      factored.effective_weights(merged, projectors, jnp.float32),
  )


def _assert_window_reset(merged, base_dtype):
  """After a merge: A == 0, c == 1, B in the base dtype."""
  for w in _factored(merged):
    np.testing.assert_array_equal(w.coords, 0.0)
    np.testing.assert_array_equal(w.scale, 1.0)
    assert w.base.dtype == base_dtype


def test_merge_float32_keeps_the_weights():
  """A float32 merge zeroes A, sets c = 1 and keeps W to rounding."""
  weights, projectors = _window("float32")
  before, merged, after = _merged(weights, projectors, 4)
  _assert_window_reset(merged, jnp.float32)
  atol = _merge_atol(weights, before)
  for name in before:
    np.testing.assert_allclose(
        after[name], before[name], rtol=0, atol=atol, err_msg=name
    )


def _bf16_ulp(x_f32: np.ndarray) -> np.ndarray:
  """The spacing of bfloat16 (8 significant bits) in the binade of ``x``."""
  _, exponent = np.frexp(np.asarray(x_f32, np.float32))
  return np.ldexp(np.float32(1.0), exponent - 8)


def test_merge_bfloat16_within_one_ulp():
  """A bfloat16 merge lands within one bf16 ulp of the float32 c B + P A."""
  weights, projectors = _window("bfloat16")
  before, merged, after = _merged(weights, projectors, 4)
  _assert_window_reset(merged, jnp.bfloat16)
  atol = _merge_atol(weights, before)
  for name in ("w", "v"):
    want = np.asarray(before[name])
    err = np.abs(np.asarray(after[name]) - want)
    assert np.all(err <= _bf16_ulp(want) + atol), name
    # Not round to nearest: some elements went to the farther neighbour.
    assert np.any(err > _bf16_ulp(want) / 2 + atol), name
  np.testing.assert_array_equal(after["b"], before["b"])
  # Two holders of (B, P, A) merge to the same bits; another step does not.
  _, again, _ = _merged(weights, projectors, 4)
  _, other, _ = _merged(weights, projectors, 6)
  for name in ("w", "v"):
    np.testing.assert_array_equal(
        again[name].base.view(jnp.uint16), merged[name].base.view(jnp.uint16)
    )
    assert np.any(other[name].base != merged[name].base), name


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_a_merged_window_merges_again_to_the_same_bits(base_dtype):
  """A merge leaves A = 0 and c = 1, so merging again (with the same or
  another step's rounding key) gives back every value (a zero's sign
  aside: 1 * -0 + 0 is +0): the learner's merge ahead of a refresh
  (``Learner.merge_ahead``) leaves the refresh step's own merge nothing to
  change."""
  weights, projectors = _window(base_dtype)
  merge = jax.jit(lambda w, p, step: factored.merge(w, p, seed=0, step=step))
  once = merge(weights, projectors, 4)
  for step in (4, 5):
    again = merge(once, projectors, step)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(once)):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(a, b)  # -0 == +0


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_a_merge_in_blocks_of_rows_is_the_whole_matrix_merge(
    base_dtype, monkeypatch
):
  """A matrix whose float32 copy exceeds factored.MERGE_BLOCK_BYTES merges
  in blocks of rows (bounding its temporaries), tall (projected rows) and
  wide (projected columns) alike: each block gets the whole matrix's rows of
  P A, to rounding (the block's dot may sum in another order), and its
  random bits, so a bfloat16 base has the same bits but where that rounding
  moved a value across a rounding boundary (a wrong offset would draw other
  bits for every element: about half would differ)."""
  weights, projectors = _window(base_dtype)
  merge = lambda: jax.jit(lambda w, p: factored.merge(w, p, seed=0, step=4))(
      weights, projectors
  )
  whole = merge()
  monkeypatch.setattr(factored, "MERGE_BLOCK_BYTES", 4 * 20 * 2)
  # "w" [16, 8]: blocks of 4 rows; "v" [6, 20]: blocks of 2.
  assert factored.merge_rows(16, 8) == 4 and factored.merge_rows(6, 20) == 2
  blocks = merge()
  before = factored.effective_weights(weights, projectors, jnp.float32)
  atol = _merge_atol(weights, before)
  for name in ("w", "v"):
    got = np.asarray(blocks[name].base.astype(jnp.float32))
    want = np.asarray(whole[name].base.astype(jnp.float32))
    if base_dtype == "float32":
      np.testing.assert_allclose(got, want, rtol=0, atol=atol)
      continue
    assert np.all(np.abs(got - want) <= _bf16_ulp(want) + atol), name
    assert np.mean(got != want) < 0.1, name


@pytest.mark.parametrize("stack", [1, 3])
@pytest.mark.parametrize("split_rows", [True, False])
@pytest.mark.parametrize("tall", [True, False])
def test_a_merge_of_a_sharded_weight_stays_on_its_devices(
    tall, split_rows, stack, monkeypatch
):
  """A [512, 64] (or [64, 512]) bfloat16 base, alone or a stack of 3, split
  over 8 devices by rows or by columns, merged in 8 blocks of rows: each
  block is strided (rows j, j + 8, ...), so it is split as the base is and
  no device gathers a matrix (a contiguous block of rows lives on one
  device, and a traced slice of it gathered the whole base; a carry that
  merged the block axis with the columns gathered a base split over its
  columns: temporaries at least one matrix's 64 KiB)."""
  m, n = (512, 64) if tall else (64, 512)
  shape, dimension_numbers, axes = (m, n), None, ()
  if stack > 1:
    shape, axes = (stack, m, n), (None,)
    dimension_numbers = {
        "w": logra.DimensionNumbers(
            reduction_axes=1, output_axes=2, batch_axes=0
        )
    }
  params = {"w": jnp.zeros(shape, jnp.float32)}
  tx = logra.logra(LR, 4, factored=True, dimension_numbers=dimension_numbers)
  weights = factored.factor(params, tx.init(params), "bfloat16")
  w = weights["w"]
  rows = m if tall else n
  monkeypatch.setattr(factored, "MERGE_BLOCK_BYTES", 4 * m * n // 8)
  assert factored.merge_rows(w.plan.m, w.plan.n) == w.plan.m // 8
  mesh = jax.make_mesh((8,), ("x",))
  split = jax.sharding.NamedSharding(
      mesh,
      jax.sharding.PartitionSpec(*axes, "x")
      if split_rows
      else jax.sharding.PartitionSpec(*axes, None, "x"),
  )
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  projectors = {"w": jnp.zeros((stack, rows, 4), jnp.float32)}
  merge = jax.jit(
      lambda w, p: factored.merge(w, p, seed=0, step=0),
      in_shardings=(
          {"w": dataclasses.replace(w, base=split, coords=whole)},
          {"w": whole},
      ),
      out_shardings={"w": dataclasses.replace(w, base=split, coords=whole)},
  )
  memory = merge.lower(weights, projectors).compile().memory_analysis()
  assert memory.temp_size_in_bytes < 2 * m * n, memory


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_a_traced_merge_decision_is_exact_and_branch_free(base_dtype):
  """``merge(when=...)`` decided in the program: true gives the merge's very
  bits, false the weights as they were (coordinates, scales and bases), and
  no conditional of ``merge_at_refresh``'s compiled program carries a base
  (under ``lax.cond`` one did, and XLA:GPU copied every base stack the
  branch wrote: docs/planner.md, "The whole system on one device")."""
  weights, projectors = _window(base_dtype)
  merge = jax.jit(
      lambda w, p, when: factored.merge(w, p, seed=0, step=4, when=when)
  )
  want = jax.jit(lambda w, p: factored.merge(w, p, seed=0, step=4))(
      weights, projectors
  )
  for when, expected in ((True, want), (False, weights)):
    got = merge(weights, projectors, jnp.asarray(when))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A Python bool keeps the loops static: reverse-mode still goes through.
  grad = jax.jit(
      jax.grad(
          lambda w: sum(
              jnp.sum(x.base.astype(jnp.float32))
              for x in _factored(factored.merge(w, projectors, seed=0, step=4))
          )
      )
  )(weights)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(grad))
  state = logra.logra(LR, RANK, factored=True).init(_params())
  compiled = (
      jax.jit(lambda w, s: factored.merge_at_refresh(w, s, seed=0))
      .lower(weights, state)
      .compile()
      .as_text()
  )
  conditionals = [
      line for line in compiled.splitlines() if " conditional(" in line
  ]
  for name in ("w", "v"):
    base = weights[name].base
    shape = f"{jnp.dtype(base.dtype).name.replace('float', 'f')}"
    shape += f"[{','.join(map(str, base.shape))}]"
    assert not any(shape in line for line in conditionals), (
        shape,
        conditionals,
    )


def test_merge_rounds_each_matrix_with_its_own_bits():
  """Equal layers of a stacked weight round with different bits (the key
  is folded with the matrix index), each within one bf16 ulp."""
  layer = np.asarray(_normal(40, (16, 8), 1 / 4))
  params = {"w": jnp.asarray(np.stack([layer] * 3))}
  tx = logra.logra(
      LR,
      RANK,
      factored=True,
      dimension_numbers={"w": logra.DimensionNumbers(1, 2, 0)},
  )
  w = factored.factor(params, tx.init(params), "bfloat16")["w"]
  q_LxR, _ = np.linalg.qr(np.asarray(_normal(41, (16, RANK))))
  projectors = {"w": jnp.asarray(np.stack([q_LxR] * 3))}
  coords = np.asarray(_normal(42, (RANK, 8), 0.1))
  weights = {
      "w": dataclasses.replace(w, coords=jnp.asarray(np.stack([coords] * 3)))
  }
  before, merged, _ = _merged(weights, projectors, 2)
  want = np.asarray(before["w"])
  np.testing.assert_array_equal(want[1:], want[:1].repeat(2, axis=0))
  bits = np.asarray(merged["w"].base.view(jnp.uint16))
  assert np.any(bits[0] != bits[1]) and np.any(bits[1] != bits[2])
  err = np.abs(np.asarray(merged["w"].base.astype(jnp.float32)) - want)
  assert np.all(err <= _bf16_ulp(want) + _merge_atol(weights, before))


def _between_bf16(seed, size):
  """float32 values strictly between bfloat16 neighbours, of both signs."""
  x = np.asarray(_normal(seed, (size,)))
  bits = x.view(np.uint32) | np.uint32(0x100)
  return jnp.asarray(bits.view(np.float32))


@functools.partial(jax.jit, static_argnums=3)
def _round_bf16(x, seed, step, path):
  key = factored.rounding_key(seed, step, path)
  return random_bits.stochastic_round(x, jnp.bfloat16, key)


def test_stochastic_round_is_a_function_of_its_key():
  """Same key: the same bits; another seed, step or path: other bits."""
  x = _between_bf16(3, 4096)
  ref = _round_bf16(x, 0, 5, "['w']")
  np.testing.assert_array_equal(
      _round_bf16(x, 0, 5, "['w']").view(jnp.uint16), ref.view(jnp.uint16)
  )
  for seed, step, path in ((1, 5, "['w']"), (0, 6, "['w']"), (0, 5, "['v']")):
    other = _round_bf16(x, seed, step, path)
    assert np.any(other.view(jnp.uint16) != ref.view(jnp.uint16)), (
        seed,
        step,
        path,
    )
  # Each result is within one bfloat16 ulp of x (one of its neighbours).
  err = np.abs(np.asarray(ref.astype(jnp.float32)) - np.asarray(x))
  assert np.all(err < _bf16_ulp(np.asarray(x)))


def test_stochastic_round_keeps_bfloat16_values_and_non_finites():
  """bf16-exact values (0, -0, subnormal, max) come back bit for bit; NaN
  stays NaN and inf stays inf."""
  finfo = jnp.finfo(jnp.bfloat16)
  exact = jnp.concatenate(
      [
          _normal(4, (1024,)).astype(jnp.bfloat16),
          jnp.array(
              [
                  0.0,
                  -0.0,
                  finfo.max,
                  -finfo.max,
                  finfo.tiny,
                  finfo.smallest_subnormal,
                  -finfo.smallest_subnormal,
              ],
              jnp.bfloat16,
          ),
      ]
  )
  special = jnp.array([jnp.nan, -jnp.nan, jnp.inf, -jnp.inf], jnp.float32)
  x = jnp.concatenate([exact.astype(jnp.float32), special])
  for step in range(3):
    y = _round_bf16(x, 0, step, "['w']")
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        y[: exact.size].view(jnp.uint16), exact.view(jnp.uint16)
    )
    tail = np.asarray(y[exact.size :].astype(jnp.float32))
    assert np.isnan(tail[:2]).all() and list(tail[2:]) == [np.inf, -np.inf]
  x = _between_bf16(5, 16)
  np.testing.assert_array_equal(
      random_bits.stochastic_round(
          x, jnp.float32, factored.rounding_key(0, 0, "['w']")
      ),
      x,
  )


def test_stochastic_merges_are_unbiased():
  """1000 merges of 1/16 ulp each add up in the mean, for both signs;
  round to nearest would have dropped every one of them."""
  steps, m = 1000, 64
  sign_M = np.where(np.arange(m) < m // 2, 1.0, -1.0)[:, None]
  params = {"w": jnp.asarray(np.ones((m, m)) * sign_M, jnp.float32)}
  tx = logra.logra(LR, 1, factored=True)
  weights = factored.factor(params, tx.init(params), "bfloat16")
  ulp = 2.0**-7  # of bfloat16 in [1, 2), >= in [.5, 1)
  delta = ulp / 16
  # P = 1 / 8 (a unit column), A = 8 delta: P A = delta exactly.
  projectors = {"w": jnp.full((1, m, 1), 1 / np.sqrt(m), jnp.float32)}
  coords = jnp.full((1, 1, m), delta * np.sqrt(m), jnp.float32)

  def body(t, carry):
    w, nearest = carry
    w = dataclasses.replace(w, coords=coords)
    w = factored.merge({"w": w}, projectors, seed=0, step=t)["w"]
    nearest = (nearest.astype(jnp.float32) + delta).astype(jnp.bfloat16)
    return w, nearest

  w, nearest = jax.jit(
      lambda w: jax.lax.fori_loop(0, steps, body, (w, w.base))
  )(weights["w"])
  # Each merge adds a rounding error of mean 0 given the past and variance
  # <= ulp^2 / 4 (a Bernoulli between neighbours at most ulp apart): the
  # sum over the steps has variance <= steps ulp^2 / 4 per element, and the
  # elements round with independent bits.
  stderr = np.sqrt(steps * ulp**2 / 4 / (m * m // 2))
  merged = np.asarray(w.base.astype(jnp.float32))
  for rows, start in ((slice(None, m // 2), 1.0), (slice(m // 2, None), -1.0)):
    mean = merged[rows].mean()
    assert abs(mean - (start + steps * delta)) < 5 * stderr, (start, mean)
  # The check resolves a tenth of the sum; round to nearest lost all of it.
  assert 5 * stderr < steps * delta / 10
  np.testing.assert_array_equal(nearest, params["w"])


def test_bfloat16_coordinates_accumulate_unbiased_steps():
  """1000 steps of 1/16 ulp each: bfloat16 coordinates rounded
  stochastically add up in the mean (round to nearest would keep none of
  them), hold exactly the float32 sum of the old coordinates and the step
  rounded with :func:`factored.coords_key`, and repeat bit for bit."""
  steps, m = 1000, 64
  params = {"w": jnp.ones((m, m), jnp.float32)}
  tx = logra.logra(LR, 16, factored=True)  # A: [1, 16, 64]
  weights = factored.factor(params, tx.init(params), coords_dtype="bfloat16")
  plan = weights["w"].plan
  assert weights["w"].coords.dtype == jnp.bfloat16
  start, ulp = 1.0, 2.0**-7  # A starts at 1 (ulp 2^-7 in [1, 2))
  weights["w"] = dataclasses.replace(
      weights["w"], coords=jnp.full(plan.sketch_shape, start, jnp.bfloat16)
  )
  delta = logra.FactoredDelta(
      jnp.full(plan.sketch_shape, ulp / 16, jnp.float32), None, plan
  )

  def run(w):
    step = lambda t, w: factored.apply_updates(
        {"w": w}, {"w": delta}, seed=3, step=t
    )["w"]
    return jax.lax.fori_loop(0, steps, step, w)

  final = jax.jit(run)(weights["w"])
  a = np.asarray(final.coords.astype(jnp.float32))
  # Independent Bernoulli rounding errors of variance <= ulp^2 / 4 per step
  # (ulp 2^-7 up to A = 2, which 1000 / 16 ulps stay below).
  stderr = np.sqrt(steps * ulp**2 / 4 / a.size)
  assert abs(a.mean() - (start + steps * ulp / 16)) < 5 * stderr
  assert 5 * stderr < steps * ulp / 16 / 10
  again = jax.jit(run)(weights["w"])
  np.testing.assert_array_equal(
      np.asarray(again.coords).view(np.uint16),
      np.asarray(final.coords).view(np.uint16),
  )
  one = factored.apply_updates(weights, {"w": delta}, seed=3, step=5)["w"]
  expected = random_bits.stochastic_round(
      weights["w"].coords.astype(jnp.float32) + delta.coords,
      jnp.bfloat16,
      factored.coords_key(3, 5, plan.path),
  )
  np.testing.assert_array_equal(
      np.asarray(one.coords).view(np.uint16),
      np.asarray(expected).view(np.uint16),
  )


def _dense_update(updates, weights, projectors):
  """D = a W + P Delta materialized at factored leaves; dense elsewhere."""
  effective = factored.effective_weights(weights, projectors)

  def leaf(u, w, p):
    if not isinstance(u, logra.FactoredDelta):
      return u
    decay = 0.0 if u.decay is None else u.decay
    return decay * w + u.plan.expand(p, u.coords)

  is_delta = lambda x: isinstance(x, logra.FactoredDelta)
  return jax.tree.map(leaf, updates, effective, projectors, is_leaf=is_delta)


def _delta(weights, decay):
  """A step like the optimizer's: FactoredDelta at factored leaves, with
  ``a = decay`` (None: no decay)."""
  seeds = iter(range(30, 40))

  def leaf(w):
    if factored.is_factored(w):
      return logra.FactoredDelta(
          _normal(next(seeds), w.coords.shape, LR),
          None if decay is None else jnp.float32(decay),
          w.plan,
      )
    return _normal(next(seeds), w.shape, LR)

  return jax.tree.map(leaf, weights, is_leaf=factored.is_factored)


def _hidden_and_head(p, x_NxM):
  """``_logits`` in the pair form: the hidden states and the head ``v``
  (a factored one is handed over unformed)."""
  return jnp.tanh(matmul(x_NxM, p["w"]) + p["b"])[..., :6], p["v"]


@pytest.mark.parametrize("form", [_logits, _hidden_and_head])
@pytest.mark.parametrize("coords_dtype", ["float32", "bfloat16"])
def test_kl_predictor_on_factored_params_equals_dense(coords_dtype, form):
  """kappa of a FactoredDelta on c B + P A equals kappa of a W + P Delta
  on the dense weights, from the logits or from the pair (hidden states,
  factored head: its tangent taken without forming it); bfloat16
  coordinates do not round the step."""
  weights, projectors = _window("float32", coords_dtype=coords_dtype)
  updates = _delta(weights, -LR * 0.5)
  x_BxTxM = _normal(8, (4, 3, 16))
  logits_f = lambda w, x: form(factored_view(w, projectors), x)

  @jax.jit
  def both(weights, updates):
    dense = factored.effective_weights(weights, projectors)
    predict_f = logra.make_kl_predictor(logits_f, weights, x_BxTxM)
    kappa_d = logra.make_kl_predictor(form, dense, x_BxTxM)(
        _dense_update(updates, weights, projectors)
    )
    is_delta = lambda x: isinstance(x, logra.FactoredDelta)
    undecayed = jax.tree.map(
        lambda u: dataclasses.replace(u, decay=None) if is_delta(u) else u,
        updates,
        is_leaf=is_delta,
    )
    return predict_f(updates), kappa_d, predict_f(undecayed)

  kappa_f, kappa_d, kappa_undecayed = both(weights, updates)
  assert float(kappa_d) > 0
  # The decay term a W is part of the prediction.
  assert abs(float(kappa_undecayed) / float(kappa_d) - 1) > 1e-3
  # Forward chain (16, 6, rank + 1) and its jvp, three sums over the 20
  # logits, the mean over the 12 tokens; all terms of the mean are >= 0.
  n = 2 * (16 + 6 + RANK + 1) + 3 * 20 + 12
  np.testing.assert_allclose(
      kappa_f, kappa_d, rtol=2 * float_tolerance(np.float32, n)
  )


def test_bad_inputs_are_refused_with_the_leaf_named():
  """Wrong base dtype, dense or decayed updates of the wrong kind and
  params that do not match the state are refused, naming what is wrong."""
  params = _params()
  state = logra.logra(LR, RANK, factored=True).init(params)
  with pytest.raises(ValueError, match="base_dtype"):
    factored.factor(params, state, base_dtype="float16")
  with pytest.raises(ValueError, match="coords_dtype"):
    factored.factor(params, state, coords_dtype="float16")
  rounded = factored.factor(params, state, coords_dtype="bfloat16")
  with pytest.raises(ValueError, match=r"\['v'\].*bfloat16.*seed"):
    factored.apply_updates(rounded, _delta(rounded, None))
  weights = factored.factor(params, state)
  # A valid step for 'v', a dense one for 'w'.
  mixed = dict(_delta(weights, None), w=jnp.zeros_like(params["w"]))
  with pytest.raises(TypeError, match=r"\['w'\].*FactoredDelta"):
    factored.apply_updates(weights, mixed)
  decayed = dict(_delta(weights, None), w=_delta(weights, -1e-3)["w"])
  with pytest.raises(TypeError, match=r"\['w'\].*scale"):
    factored.apply_updates(weights, decayed)
  wrong_shape = dict(params, v=jnp.zeros((6, 21)))
  with pytest.raises(ValueError, match=r"\['v'\]"):
    factored.factor(wrong_shape, state)
  extra = dict(params, u=jnp.zeros(3))
  with pytest.raises(ValueError, match=r"\['u'\]"):
    factored.factor(extra, state)


@pytest.mark.parametrize("coords_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("decay", [None, -0.1])
def test_update_norm_is_the_frobenius_norm_of_the_step(decay, coords_dtype):
  """update_norm equals ||a W + P Delta|| (and the dense leaves') in full,
  in float32 whatever the coordinates' dtype."""
  weights, projectors = _window("float32", decay is not None, coords_dtype)
  updates = _delta(weights, decay)

  @jax.jit
  def norms(updates, weights):
    got = factored.update_norm(updates, weights, projectors)
    want = optax.global_norm(_dense_update(updates, weights, projectors))
    steps = [
        u.coords if isinstance(u, logra.FactoredDelta) else u
        for u in jax.tree.leaves(
            updates, is_leaf=lambda x: isinstance(x, logra.FactoredDelta)
        )
    ]
    weight = optax.global_norm(factored.effective_weights(weights, projectors))
    return got, want, abs(decay or 0.0) * weight + optax.global_norm(steps)

  got, want, magnitude = map(float, norms(updates, weights))
  # Squared norms: sums over 6 * 20 elements (the largest leaf) and, in
  # coordinates, over the long side (P^T W) and the rank; relative to the
  # squared sum of the magnitudes of the two terms.
  n = 6 * 20 + 20 + RANK + 1
  assert abs(got**2 - want**2) <= (
      2 * float_tolerance(np.float32, n) * magnitude**2
  ), (got, want)
  assert want > 0.5 * magnitude
