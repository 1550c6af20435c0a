"""The LoGRA chain against optax's own transforms and hand-derived values."""

import functools
import subprocess
import sys

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import logra_jax as logra
from logra_jax.optim import projection
from logra_jax.optim import projectors as proj_lib
from logra_jax.optim import moments
from tolerances import float_tolerance


def _chain(
    rank,
    kind="range",
    refresh_every=200,
    moment_policy="transfer",
    inner=None,
    scale=1.0,
    **kwargs,
):
  return logra.scale_by_low_rank(
      inner,
      rank=rank,
      kind=kind,
      refresh_every=refresh_every,
      moment_policy=moment_policy,
      scale=scale,
      **kwargs,
  )


def _project_stage(rank, kind, refresh_every=200, dimension_numbers=None):
  """The first stage of ``scale_by_low_rank`` alone: its output is the
  sketches, with their projectors."""
  rank, config = projection.projection_config(
      rank, kind, refresh_every, 1, 8, 0, "transfer"
  )
  spec_of = functools.partial(
      projection.projection_spec,
      rank=rank,
      config=config,
      dimension_numbers=dimension_numbers,
      mask=None,
  )
  return projection.project(spec_of, rank, config)


def _grads(params, step):
  key = jax.random.fold_in(jax.random.key(42), step)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return treedef.unflatten(
      [jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)]
  )


def _sketch_atol(g_MxN, rank: int) -> tuple[float, float]:
  """Bound on the difference of two evaluations of a sketch ``P^T G`` and
  of a rotation of it by an ``r x r`` basis change, in float32; and the bound
  ``K`` on the magnitude of the terms.

  Each entry sums ``m`` products ``p_i g_i`` whose magnitudes add up to at
  most ``K``, the largest column norm of ``G`` (unit columns of ``P``,
  Cauchy-Schwarz); see ``tests/tolerances.py``.
  """
  m = g_MxN.shape[-2]
  column_norm = float(jnp.max(jnp.linalg.norm(g_MxN, axis=-2)))
  return 2 * float_tolerance(np.float32, m + rank) * column_norm, column_norm


class ChainVariantsTest(chex.TestCase):
  """The core chain properties, each with and without ``jax.jit``."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("matrix", (16, 16), None),
      ("stacked", (3, 8, 8), logra.DimensionNumbers(1, 2, 0)),
  )
  def test_identity_projector_equals_inner_transform(self, shape, spec):
    params = {"w": jnp.zeros(shape), "b": jnp.zeros(shape[-1])}
    tx = _chain(
        rank=shape[-1],
        kind="svd",
        refresh_every=10_000,
        dimension_numbers=None if spec is None else {"w": spec, "b": None},
    )
    state = tx.init(params)
    # Install an identity projector and move past the refresh at step 0.
    eye = jnp.broadcast_to(
        jnp.eye(shape[-1]), (int(np.prod(shape[:-2])),) + shape[-2:]
    )
    project_state = state[0]._replace(
        count=jnp.ones([], jnp.int32), projectors={"w": eye, "b": None}
    )
    state = (project_state,) + state[1:]
    adam = optax.scale_by_adam()
    adam_state = adam.init(params)
    update = self.variant(tx.update)
    for step in range(5):
      grads = _grads(params, step)
      ours, state = update(grads, state, params)
      ref, adam_state = adam.update(grads, adam_state, params)
      chex.assert_trees_all_close(ours, ref, rtol=1e-5, atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_transfer_policy_rotates_adam_moments_at_refresh(self):
    params = {"w": jnp.zeros((24, 10))}
    rank = 4
    tx = _chain(rank, kind="svd", refresh_every=1)
    update = self.variant(tx.update)
    state = tx.init(params)
    g0, g1 = _grads(params, 0), _grads(params, 1)
    _, state = update(g0, state, params)
    p0 = state[0].projectors["w"]
    adam_state_0 = state[1].inner_state
    _, state = update(g1, state, params)
    p1 = state[0].projectors["w"]
    # Expected: rotate step-0 moments by C = P1^T P0 (LDAdam), then one Adam
    # step.
    c = jnp.swapaxes(p1, 1, 2) @ p0
    sketch = logra.Sketched(
        None,
        basis_change=c,
        plan=jax.tree.leaves(
            logra.optim.dimension_numbers.plan_leaves(params, rank, None, None)
        )[0],
        config=None,
    )
    mu, nu = moments._transfer_adam(
        sketch,
        adam_state_0.mu["w"],
        adam_state_0.nu["w"],
        adam_state_0.count,
        0.9,
        0.999,
    )
    s1 = jnp.swapaxes(p1, 1, 2) @ g1["w"][None]
    adam = optax.scale_by_adam()
    _, expected = adam.update(
        {"w": s1}, adam_state_0._replace(mu={"w": mu}, nu={"w": nu})
    )
    atol, norm = max(_sketch_atol(g["w"], rank) for g in (g0, g1))
    chex.assert_trees_all_close(
        state[1].inner_state.mu, expected.mu, rtol=0, atol=atol
    )
    # Second moments sum r products of two such entries.
    chex.assert_trees_all_close(
        state[1].inner_state.nu, expected.nu, rtol=0, atol=rank * norm * atol
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_reset_and_keep_policies(self):
    params = {"w": jnp.zeros((24, 10))}
    g0, g1 = _grads(params, 0), _grads(params, 1)
    states = {}
    for policy in ("reset", "keep"):
      tx = _chain(4, kind="svd", refresh_every=1, moment_policy=policy)
      update = self.variant(tx.update)
      state = tx.init(params)
      _, state = update(g0, state, params)
      mu0 = state[1].inner_state.mu["w"]
      _, state = update(g1, state, params)
      states[policy] = (mu0, state)
    p1 = states["reset"][1][0].projectors["w"]
    s1 = jnp.swapaxes(p1, 1, 2) @ g1["w"][None]
    atol, _ = _sketch_atol(g1["w"], 4)
    chex.assert_trees_all_close(
        states["reset"][1][1].inner_state.mu["w"], 0.1 * s1, rtol=0, atol=atol
    )
    mu0 = states["keep"][0]
    chex.assert_trees_all_close(
        states["keep"][1][1].inner_state.mu["w"],
        0.9 * mu0 + 0.1 * s1,
        rtol=0,
        atol=atol,
    )

  @chex.variants(with_jit=True, without_jit=True)
  def test_bfloat16_params_float32_state(self):
    params = {
        "w": jnp.zeros((32, 16), jnp.bfloat16),
        "b": jnp.zeros(16, jnp.bfloat16),
    }
    tx = logra.logra(1e-2, rank=4)
    state = tx.init(params)
    updates, state = self.variant(tx.update)(_grads(params, 0), state, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
    float_leaves = [
        x
        for x in jax.tree.leaves(state)
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert float_leaves and all(x.dtype == jnp.float32 for x in float_leaves)


@pytest.mark.parametrize("shape", [(48, 20), (20, 48)], ids=["tall", "wide"])
def test_svd_keep_reproduces_optax_galore(shape):
  params = {"w": jnp.zeros(shape), "b": jnp.zeros(shape[1])}
  refresh_every, rank = 3, 5
  ours = _chain(
      rank,
      kind="svd",
      refresh_every=refresh_every,
      moment_policy="keep",
      scale=0.5,
  )
  galore = optax.contrib.scale_by_galore(
      rank=rank, update_proj_gap=refresh_every, scale=0.5
  )
  ours_state, galore_state = ours.init(params), galore.init(params)
  ours_update, galore_update = jax.jit(ours.update), jax.jit(galore.update)
  for step in range(3 * refresh_every + 1):  # four refresh windows
    grads = _grads(params, step)
    u, ours_state = ours_update(grads, ours_state, params)
    v, galore_state = galore_update(grads, galore_state, params)
    chex.assert_trees_all_close(
        u, v, rtol=2e-4, atol=2e-5, custom_message=f"step {step}"
    )


@pytest.mark.parametrize("kind", ["range", "random", "svd"])
def test_projectors_are_orthonormal(kind):
  params = {"w": jnp.zeros((4, 40, 24))}
  tx = _project_stage(
      6,
      kind=kind,
      dimension_numbers=logra.DimensionNumbers(
          reduction_axes=2, output_axes=1, batch_axes=0
      ),
  )
  sketches, _ = tx.update(_grads(params, 0), tx.init(params), params)
  p = sketches["w"].projector
  assert p.shape == (4, 40, 6)
  gram = jnp.swapaxes(p, 1, 2) @ p
  np.testing.assert_allclose(
      gram, jnp.broadcast_to(jnp.eye(6), gram.shape), atol=1e-5
  )


def test_range_finder_captures_svd_energy():
  key_u, key_v, key_n, key_o = jax.random.split(jax.random.key(0), 4)
  m, n, true_rank, rank = 256, 128, 16, 16
  u, _ = jnp.linalg.qr(jax.random.normal(key_u, (m, true_rank)))
  v, _ = jnp.linalg.qr(jax.random.normal(key_v, (n, true_rank)))
  spectrum = jnp.linspace(10.0, 1.0, true_rank)
  g = (u * spectrum) @ v.T + 0.05 * jax.random.normal(key_n, (m, n))
  captured = lambda p: float(jnp.sum((p[0].T @ g) ** 2))
  p_range = proj_lib.range_projector(
      g[None], key_o, rank, oversample=8, power_iters=1
  )
  p_svd = proj_lib.svd_projector(g[None], rank, left=True)
  assert captured(p_range) >= 0.95 * captured(p_svd)


def test_moment_transfer_matches_hand_computed_example():
  plan = logra.optim.LeafPlan(
      path="w",
      index=0,
      shape=(2, 1),
      dtype=np.float32,
      perm=(0, 1),
      m=2,
      n=1,
      rank=2,
  )
  c = jnp.array([[[0.6, 0.8], [0.8, -0.6]]])
  sketch = logra.Sketched(None, basis_change=c, plan=plan, config=None)
  m = jnp.array([[[1.0], [2.0]]])
  v = jnp.array([[[3.0], [5.0]]])
  # b1 = 0.5, b2 = 0.75 after one step: bias corrections 0.5 and 0.25.
  # m_hat = [2, 4], v_hat = [12, 20]; C m_hat = [4.4, -0.8];
  # (C o C)(v_hat - m_hat^2) = [[.36, .64], [.64, .36]] @ [8, 4] = [5.44, 6.56];
  # v_hat' = [5.44 + 19.36, 6.56 + 0.64] = [24.8, 7.2].
  m_new, v_new = moments._transfer_adam(
      sketch, m, v, jnp.array(1), b1=0.5, b2=0.75
  )
  np.testing.assert_allclose(m_new[0, :, 0], [2.2, -0.4], rtol=1e-6)
  np.testing.assert_allclose(v_new[0, :, 0], [6.2, 1.8], rtol=1e-6)


def test_many_projectors_at_once_do_not_deadlock():
  # Independent batched QRs in one program (one per weight, as every step of
  # kind="random" computes them) used to hang XLA:CPU: each jaxlib LAPACK
  # call blocked a thread of the small intra-op pool waiting for its own
  # pieces. Run in a subprocess, so that a hang fails instead of blocking.
  code = """
import jax
from logra_jax.optim import projectors
make = jax.jit(lambda key: [projectors.random_projector(
    jax.random.fold_in(key, i), 4, 384, 32) for i in range(12)])
for step in range(5):
  jax.block_until_ready(make(jax.random.key(step)))
print("done")
"""
  result = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, timeout=240
  )
  assert result.returncode == 0 and "done" in result.stdout, result.stderr


def test_random_projector_is_regenerated_not_stored():
  params = {"w": jnp.zeros((64, 16))}
  tx = _project_stage(4, kind="random", refresh_every=3)
  state = tx.init(params)
  assert state.projectors["w"] is None
  seen = []
  for step in range(6):
    sketches, state = tx.update(_grads(params, step), state, params)
    seen.append(sketches["w"].projector)
  np.testing.assert_array_equal(seen[0], seen[2])
  np.testing.assert_array_equal(seen[3], seen[5])
  assert not np.allclose(seen[2], seen[3])


def test_stacked_weight_gets_independent_projectors():
  stacked = {"w": jnp.zeros((3, 20, 12))}
  separate = {f"w{i}": jnp.zeros((20, 12)) for i in range(3)}
  spec = {"w": logra.DimensionNumbers(1, 2, 0)}
  tx_stacked = _chain(4, kind="svd", refresh_every=2, dimension_numbers=spec)
  tx_separate = _chain(4, kind="svd", refresh_every=2)
  s_stacked, s_separate = (tx_stacked.init(stacked), tx_separate.init(separate))
  for step in range(4):
    g = _grads(stacked, step)
    u_stacked, s_stacked = tx_stacked.update(g, s_stacked, stacked)
    g_sep = {f"w{i}": g["w"][i] for i in range(3)}
    u_sep, s_separate = tx_separate.update(g_sep, s_separate, separate)
    chex.assert_trees_all_close(
        list(u_stacked["w"]),
        [u_sep[f"w{i}"] for i in range(3)],
        rtol=1e-4,
        atol=1e-5,
    )


def test_factored_updates_equal_dense_updates():
  params = {
      "w": jnp.zeros((40, 12)),
      "v": jnp.zeros((12, 40)),
      "b": jnp.zeros(12),
  }
  for kind in ("range", "random", "svd"):
    tx = logra.scale_by_low_rank(
        rank=3, kind=kind, refresh_every=2, scale=0.25, keep_factors=True
    )
    state, update = tx.init(params), jax.jit(tx.update)
    for step in range(3):
      updates, state = update(_grads(params, step), state, params)
    factored = logra.factored_updates(state)
    assert factored["b"] is None
    chex.assert_trees_all_close(
        {name: factored[name].dense() for name in ("w", "v")},
        {name: updates[name] for name in ("w", "v")},
        atol=1e-6,
    )


def test_state_bytes_match_closed_form():
  params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
  r, n, f32 = 64, 4096, 4
  scalars = 3 * 4  # project count, projector refusals, Adam count (int32)
  for kind, projector in (
      ("random", 0),
      ("range", r * n * f32),
      ("svd", r * n * f32),
  ):
    tx = logra.logra(1e-3, rank=r, kind=kind)
    state = jax.eval_shape(tx.init, params)
    assert logra.optimizer_state_bytes(state) == (
        2 * r * n * f32 + projector + scalars
    )
  adam = jax.eval_shape(optax.adam(1e-3).init, params)
  assert logra.optimizer_state_bytes(adam) == 2 * 4096 * 4096 * f32 + 4


def test_jit_does_not_recompile():
  params = {"w": jnp.zeros((32, 16)), "b": jnp.zeros(16)}
  tx = logra.logra(1e-3, rank=4, refresh_every=2)
  update = jax.jit(tx.update)
  state = tx.init(params)
  for step in range(3):
    _, state = update(_grads(params, step), state, params)
  assert update._cache_size() == 1


def test_inject_hyperparams_and_multisteps():
  params = {"w": jnp.zeros((32, 16)), "b": jnp.zeros(16)}
  tx = optax.inject_hyperparams(
      logra.logra,
      static_args=(
          "rank",
          "kind",
          "refresh_every",
          "power_iters",
          "oversample",
          "seed",
      ),
  )(learning_rate=1e-2, rank=4)
  state = tx.init(params)
  updates, state = tx.update(_grads(params, 0), state, params)
  state.hyperparams["learning_rate"] = jnp.asarray(0.0)
  updates, state = tx.update(_grads(params, 1), state, params)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))

  base = logra.logra(1e-2, rank=4, refresh_every=100)
  multi = optax.MultiSteps(base, every_k_schedule=2)
  m_state, b_state = multi.init(params), base.init(params)
  # Gradients on a grid of 2^-6, so that MultiSteps' running mean and
  # (g0 + g1) / 2 are both exact: the step then sees the same gradient, and
  # LoGRA's range finder (whose projector is as sensitive to a rounding of
  # its input as the singular gaps are small) the same matrix.
  grid = lambda g: jax.tree.map(lambda x: jnp.round(64 * x) / 64, g)
  g0, g1 = grid(_grads(params, 0)), grid(_grads(params, 1))
  u0, m_state = jax.jit(multi.update)(g0, m_state, params)
  chex.assert_trees_all_equal(u0, jax.tree.map(jnp.zeros_like, params))
  u1, m_state = jax.jit(multi.update)(g1, m_state, params)
  mean = jax.tree.map(lambda a, b: (a + b) / 2, g0, g1)
  expected, _ = jax.jit(base.update)(mean, b_state, params)
  # The same math compiled inside MultiSteps' cond: other fusions, so the
  # projector's chain of reductions (range finder, QR and the projection,
  # over the 32 x 16 matrix) runs in another order.
  n = 4 * (32 + 16)
  atol = (
      2
      * float_tolerance(np.float32, n)
      * max(float(jnp.abs(x).max()) for x in jax.tree.leaves(expected))
  )
  chex.assert_trees_all_close(u1, expected, rtol=0, atol=atol)


def test_masked_and_multi_transform():
  params = {
      "w": jnp.zeros((32, 16)),
      "emb": jnp.zeros((50, 16)),
      "b": jnp.zeros(16),
  }
  labels = {"w": "logra", "emb": "adam", "b": "adam"}
  tx = optax.multi_transform(
      {"logra": logra.logra(1e-2, rank=4), "adam": optax.adam(1e-2)}, labels
  )
  state = tx.init(params)
  g = _grads(params, 0)
  updates, state = jax.jit(tx.update)(g, state, params)
  adam_updates, _ = optax.adam(1e-2).update(g, optax.adam(1e-2).init(params))
  # The same elementwise Adam, compiled otherwise: each entry goes through
  # about 16 rounded operations (Lemma 3.1 of Higham, tests/tolerances.py).
  chex.assert_trees_all_close(
      {k: updates[k] for k in ("emb", "b")},
      {k: adam_updates[k] for k in ("emb", "b")},
      rtol=2 * float_tolerance(np.float32, 16),
  )
  assert updates["w"].shape == (32, 16)

  masked = optax.masked(
      logra.logra(1e-2, rank=4), {"w": True, "emb": False, "b": False}
  )
  state = masked.init(params)
  updates, state = masked.update(g, state, params)
  np.testing.assert_array_equal(updates["emb"], g["emb"])
  assert not np.allclose(updates["w"], g["w"])


def test_mask_keeps_leaves_dense():
  params = {"w": jnp.zeros((32, 16)), "emb": jnp.zeros((50, 16))}
  tx = logra.logra(1e-2, rank=4, mask={"w": True, "emb": False})
  state = tx.init(params)
  moments = state[0][1].inner_state.mu
  assert moments["w"].shape == (1, 4, 16)
  assert moments["emb"].shape == (50, 16)


def test_update_preserves_state_shardings():
  devices = np.array(jax.devices()[:8])
  if devices.size < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.sharding.Mesh(devices.reshape(4, 2), ("fsdp", "tp"))
  spec = lambda *axes: jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(*axes)
  )
  shardings = {
      "w": spec("fsdp", "tp"),
      "v": spec(None, "fsdp"),
      "b": spec("tp"),
  }
  params = jax.device_put(
      {"w": jnp.zeros((64, 32)), "v": jnp.zeros((16, 64)), "b": jnp.zeros(32)},
      shardings,
  )
  tx = logra.logra(1e-2, rank=4, refresh_every=2)
  state = tx.init(params)
  update = jax.jit(tx.update)
  grads = jax.device_put(_grads(params, 0), shardings)
  _, state = update(grads, state, params)
  after_first = jax.tree.map(lambda x: x.sharding, state)
  for _ in range(3):  # across a refresh and back
    updates, state = update(grads, state, params)
  after = jax.tree.map(lambda x: x.sharding, state)
  for b, a in zip(jax.tree.leaves(after_first), jax.tree.leaves(after)):
    assert a == b, (b, a)
  # Projectors follow the parameter's long axis, moments its short axis.
  project_state, moments = state[0][0], state[0][1].inner_state
  assert project_state.projectors[
      "w"
  ].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
  assert project_state.projectors[
      "v"
  ].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
  assert moments.mu["w"].sharding.spec == jax.sharding.PartitionSpec(
      None, None, "tp"
  )
  for name in params:
    assert updates[name].sharding.is_equivalent_to(
        params[name].sharding, params[name].ndim
    )


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(rank=0), ValueError, "rank"),
        (dict(rank=2.5), TypeError, "rank"),
        (dict(rank="8"), TypeError, "rank"),
        (dict(rank=4, kind="qr"), ValueError, "kind"),
        (dict(rank=4, moment_policy="rotate"), ValueError, "moment_policy"),
        (dict(rank=4, refresh_every=0), ValueError, "refresh_every"),
    ],
)
def test_bad_hyperparameters_raise_at_construction(kwargs, error, match):
  with pytest.raises(error, match=match):
    logra.scale_by_low_rank(**kwargs)


@pytest.mark.parametrize(
    "spec,match",
    [
        (logra.DimensionNumbers(0, 0), "overlap"),
        (logra.DimensionNumbers(1, 2), r"axes \[0\] are in no group"),
        (logra.DimensionNumbers(1, 3, 0), "out of range"),
    ],
)
def test_bad_dimension_numbers_name_the_leaf(spec, match):
  params = {"layers": {"attn": jnp.zeros((2, 8, 8))}}
  tx = logra.logra(1e-3, rank=2, dimension_numbers={"layers": {"attn": spec}})
  with pytest.raises(ValueError, match=match) as info:
    tx.init(params)
  assert "['layers']['attn']" in str(info.value)


def test_spec_tree_must_match_params():
  params = {"w": jnp.zeros((8, 4)), "u": jnp.zeros((8, 4))}
  tx = logra.logra(
      1e-3, rank=2, dimension_numbers={"w": logra.DimensionNumbers()}
  )
  with pytest.raises(ValueError, match=r"missing entries for \[\"\['u'\]\"\]"):
    tx.init(params)
