"""Property-based tests of the LoGRA optax chain on random pytrees.

For any tree of scalars, vectors, 2-d to 4-d and zero-size float32/bfloat16
leaves (and None), any rank, projector kind and moment policy, ``init`` and
three ``update`` steps under ``jax.jit`` (crossing a refresh) either give
finite updates with the parameters' shapes and dtypes, or raise a ValueError
naming the offending leaf before anything runs.

Examples are derandomized (see the profiles in ``tests/conftest.py``);
``HYPOTHESIS_PROFILE=explore`` searches further by hand.
"""

import chex
from hypothesis import event
from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import optax
import pytest

import logra_jax as logra

DTYPES = (jnp.float32, jnp.bfloat16)
STEPS = 3

# A leaf is (shape, dtype): 0-d to 4-d, sides up to 8, zero-size included;
# or None, an empty subtree.
leaves = st.one_of(
    st.tuples(
        st.lists(st.integers(0, 8), max_size=4).map(tuple),
        st.sampled_from(DTYPES),
    ),
    st.none(),
)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.dictionaries(st.sampled_from("abc"), children, max_size=3),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
    ),
    max_leaves=4,
)
# Container roots, so that every leaf has a non-empty path to name.
roots = st.dictionaries(
    st.sampled_from(("w", "v", "u")), trees, min_size=1, max_size=3
)


def _is_shape_dtype(x) -> bool:
  return (
      isinstance(x, tuple)
      and len(x) == 2
      and isinstance(x[0], tuple)
      and x[1] in DTYPES
  )


def _stacked_spec(p):
  """Matrices from the last two axes, earlier axes batch; None below 2-d."""
  if p.ndim < 2:
    return None
  return logra.DimensionNumbers(
      p.ndim - 2, p.ndim - 1, tuple(range(p.ndim - 2))
  )


def _dimension_numbers(which: str):
  if which == "default":  # 2-d leaves are matrices, the rest dense.
    return None
  if which == "single":  # one (0, 1) spec for every >= 2-d leaf.
    return logra.DimensionNumbers()
  return lambda params: jax.tree.map(_stacked_spec, params)


def _expected_error_path(params, which: str):
  """The path of the first leaf the chain must refuse, or None."""
  for key, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    path = jax.tree_util.keystr(key)
    if p.ndim < 2 or (which == "default" and p.ndim != 2):
      continue
    if which == "single" and p.ndim > 2:
      return path  # axes beyond the first two are in no group
  return None


def _kl_predictor(update):
  """A positive quadratic form standing in for a model's Fisher metric."""
  return 0.5 * sum(
      jnp.sum(jnp.square(u.astype(jnp.float32)))
      for u in jax.tree.leaves(update)
  )


def _make_tx(
    chain, rank, kind, refresh_every, moment_policy, dimension_numbers
):
  if chain == "alias":
    return logra.logra(
        learning_rate=1e-2,
        rank=rank,
        kind=kind,
        refresh_every=refresh_every,
        moment_policy=moment_policy,
        weight_decay=1e-4,
        target_kl=1e-3,
        dimension_numbers=dimension_numbers,
    )
  return optax.chain(
      logra.scale_by_low_rank(
          optax.scale_by_adam(),
          rank=rank,
          kind=kind,
          refresh_every=refresh_every,
          moment_policy=moment_policy,
          dimension_numbers=dimension_numbers,
          scale=0.5,
          keep_factors=True,
      ),
      logra.scale_by_predicted_kl(target_kl=1e-3, mode="target"),
  )


@given(
    spec=roots,
    chain=st.sampled_from(("alias", "stages")),
    rank=st.integers(1, 10),
    kind=st.sampled_from(("range", "random", "svd")),
    moment_policy=st.sampled_from(("transfer", "keep", "reset")),
    refresh_every=st.integers(1, 2),
    which=st.sampled_from(("default", "single", "stacked")),
    grad_scale=st.sampled_from((1.0, 0.0, 1e-20)),
)
def test_chain_runs_finite_or_names_the_leaf(
    spec, chain, rank, kind, moment_policy, refresh_every, which, grad_scale
):
  shapes, treedef = jax.tree.flatten(spec, is_leaf=_is_shape_dtype)
  params = treedef.unflatten(
      [jnp.ones(shape, dtype) for shape, dtype in shapes]
  )
  tx = _make_tx(
      chain, rank, kind, refresh_every, moment_policy, _dimension_numbers(which)
  )
  bad_path = _expected_error_path(params, which)
  event("refused" if bad_path is not None else "ran")
  if bad_path is not None:
    with pytest.raises(ValueError) as info:
      jax.jit(tx.init)(params)
    assert bad_path in str(info.value)
    return

  state = jax.jit(tx.init)(params)
  update = jax.jit(
      lambda g, s, p: tx.update(g, s, p, kl_predictor=_kl_predictor)
  )
  for step in range(STEPS):
    keys = jax.random.split(jax.random.key(step), max(len(shapes), 1))
    grads = treedef.unflatten(
        [
            (grad_scale * jax.random.normal(k, s, jnp.float32)).astype(d)
            for k, (s, d) in zip(keys, shapes)
        ]
    )
    updates, state = update(grads, state, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
    chex.assert_tree_all_finite(updates)
    chex.assert_tree_all_finite(
        [
            x
            for x in jax.tree.leaves(state)
            if jnp.issubdtype(x.dtype, jnp.floating)
        ]
    )
    if grad_scale == 0.0 and chain == "stages":  # Adam maps 0 to 0.
      assert not any(jnp.any(u) for u in jax.tree.leaves(updates))
