"""The optax chain under JAX's explicit sharding (``AxisType.Explicit``,
``jax.set_mesh``) on 8 CPU devices: ``init`` and ``update`` run for every
projector kind with weights split along either side, the state keeps its
types (shapes, dtypes, shardings) through updates, and the numbers are those
of the unsharded chain."""

import math
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import logra_jax as logra
from tolerances import float_tolerance

DIMS = {
    "tall": logra.DimensionNumbers(0, 1),
    "wide": logra.DimensionNumbers(0, 1),
    "stacked": logra.DimensionNumbers(1, 2, batch_axes=0),
    "merged": logra.DimensionNumbers((1, 2), 3, batch_axes=0),
    "bias": None,
}
SHAPES = {
    "tall": (64, 16),
    "wide": (16, 64),
    "stacked": (2, 32, 48),
    "merged": (2, 8, 4, 40),
    "bias": (16,),
}
# Each weight split along its long side, its short side, or both.
LAYOUTS = {
    "long": {
        "tall": P("x", None),
        "wide": P(None, "x"),
        "stacked": P(None, None, "x"),
        "merged": P(None, "x", None, None),
        "bias": P("x"),
    },
    "short": {
        "tall": P(None, "x"),
        "wide": P("x", None),
        "stacked": P(None, "x", None),
        "merged": P(None, None, None, "x"),
        "bias": P(),
    },
    "both": {
        "tall": P("x", "y"),
        "wide": P("y", "x"),
        "stacked": P("y", None, "x"),
        "merged": P(None, "x", "y", None),
        "bias": P("y"),
    },
}


def _values():
  keys = jax.random.split(jax.random.key(0), 2 * len(SHAPES))
  params = {
      k: jax.random.normal(keys[i], s)
      for i, (k, s) in enumerate(SHAPES.items())
  }
  grads = [
      {
          k: jax.random.normal(keys[len(SHAPES) + i], s) * (step + 1)
          for i, (k, s) in enumerate(SHAPES.items())
      }
      for step in range(3)
  ]
  return params, grads


def _chain(kind):
  return logra.logra(
      learning_rate=1e-2,
      rank=4,
      kind=kind,
      refresh_every=2,
      dimension_numbers=DIMS,
      weight_decay=0.1,
  )


def _run(tx, params, grads):
  state = jax.jit(tx.init)(params)
  types = jax.tree.map(jax.typeof, state)
  update = jax.jit(tx.update)
  for g in grads:  # across a refresh
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
    assert jax.tree.map(jax.typeof, state) == types
  return params, state, updates


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", ["range", "random", "svd"])
def test_chain_runs_and_keeps_state_types_under_explicit_sharding(kind, layout):
  params, grads = _values()
  ref_params, _, _ = _run(_chain(kind), params, grads)
  mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    put = lambda tree: {
        k: jax.device_put(v, NamedSharding(mesh, LAYOUTS[layout][k]))
        for k, v in tree.items()
    }
    got, state, updates = _run(
        _chain(kind), put(params), [put(g) for g in grads]
    )
  for k in SHAPES:
    expected = NamedSharding(mesh, LAYOUTS[layout][k])
    assert updates[k].sharding.is_equivalent_to(expected, len(SHAPES[k]))
  # The state lives split like the weights: every projector along the
  # weight's long side, every moment along its short side.
  long_axis, short_axis = LAYOUTS[layout]["tall"]
  moments = state[0][1].inner_state
  assert moments.mu["tall"].sharding.spec == P(None, None, short_axis)
  if kind != "random":  # random projectors are regenerated, not stored
    projector = state[0][0].projectors["tall"]
    assert projector.sharding.spec == P(None, long_axis, None)
  for k in SHAPES:
    ref = np.asarray(ref_params[k])
    # Sharded contractions sum in another order. Per step, the reductions
    # chained into an update: the range finder's products and QRs (3 over
    # the long side of 64, one over the short side of 48) and the sketch
    # (64), then the expansion over the rank (4); 3 steps.
    tol = 2 * float_tolerance(np.float32, 3 * (4 * 64 + 48 + 4))
    np.testing.assert_allclose(
        np.asarray(got[k]), ref, atol=tol * np.abs(ref).max(), rtol=0
    )


@pytest.mark.parametrize("layout", ["long", "both"])
def test_range_finder_gathers_sketches_not_weights(layout):
  """The QR of the range finder needs whole columns: XLA gathers the
  ``long x (rank + oversample)`` sketches, never a weight-sized gradient
  (except where several axes are merged into one side: those are gathered
  before the reshape)."""
  params, grads = _values()
  mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    put = lambda tree: {
        k: jax.device_put(v, NamedSharding(mesh, LAYOUTS[layout][k]))
        for k, v in tree.items()
    }
    tx = _chain("range")
    state = jax.jit(tx.init)(put(params))
    hlo = (
        jax.jit(tx.update)
        .lower(put(grads[0]), state, put(params))
        .compile()
        .as_text()
    )
  gathered = {
      tuple(int(d) for d in dims.split(",") if d)
      for dims in re.findall(r"= f32\[([0-9,]*)\][^\n]*all-gather\(", hlo)
  }
  assert gathered, "expected the sketches to be gathered"
  weights = {SHAPES[k] for k in ("tall", "wide", "stacked")}
  for shape in gathered - {SHAPES["merged"]}:
    assert shape not in weights and math.prod(shape) <= 2 * 32 * 12, shape
