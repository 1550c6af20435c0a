"""``low_rank_moments``: an optax transform run on the low-rank sketches, its
moments following each refreshed basis."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax

from logra_jax.optim.types import LowRankMomentsState
from logra_jax.optim.types import ProjectionSpec
from logra_jax.optim.types import Sketched
from logra_jax.optim.types import is_sketched


def low_rank_moments(
    inner: Optional[optax.GradientTransformation],
    betas: tuple[float, float],
    spec_of: Callable[[optax.Params], ProjectionSpec],
) -> optax.GradientTransformationExtraArgs:
  r"""The middle stage of :func:`scale_by_low_rank`: ``inner`` on sketches.

  ``inner`` (default ``optax.scale_by_adam(*betas)``) must not need
  ``params``; its state is allocated at the sketch shapes
  ``[batch, rank, short]`` (``O(r \min(m, n))`` per matrix) in float32, and
  at full size for dense leaves. When a leaf's projector is refreshed, the
  moments follow the basis according to the ``moment_policy`` of the
  projection (see :func:`scale_by_low_rank`).

  Args:
    inner: the transform to run in the low-rank space.
    betas: the ``(b1, b2)`` decay rates of ``inner``'s first and second
      moments, used only by ``"transfer"`` to bias-correct before rotating.
    spec_of: maps the params to the projection's :class:`ProjectionSpec`
      (the same the ``project`` stage computes), which sets the shapes.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; extra arguments are passed
    on to ``inner``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from logra_jax.optim import moments, projection
    >>> _, config = projection.projection_config(2, "range", 200, 1, 8, 0,
    ...                                          "transfer")
    >>> stage = moments.low_rank_moments(
    ...     optax.scale_by_lion(), (0.9, 0.99),
    ...     lambda p: projection.projection_spec(p, 2, config, None, None))
    >>> state = stage.init({"w": jnp.ones((8, 4))})
    >>> state.inner_state.mu["w"].shape
    (1, 2, 4)
  """
  inner = optax.with_extra_args_support(
      optax.scale_by_adam(*betas) if inner is None else inner
  )
  b1, b2 = betas

  def init_fn(params):
    plans = spec_of(params).plan_tree()

    def proxy(plan):
      if plan.projected:
        return jnp.zeros(
            plan.sketch_shape, jnp.float32, out_sharding=plan.sketch_spec
        )
      return jnp.zeros(plan.shape, jnp.float32, out_sharding=plan.dense_spec)

    return LowRankMomentsState(inner.init(jax.tree.map(proxy, plans)))

  def update_fn(updates, state, params=None, **extra_args):
    del params
    values = jax.tree.map(lambda s: s.value, updates, is_leaf=is_sketched)
    inner_state = _follow_basis(
        state.inner_state, updates, jax.tree.structure(values), b1, b2
    )
    new_values, inner_state = inner.update(
        values, inner_state, None, **extra_args
    )
    new_updates = jax.tree.map(
        lambda s, v: s.replace(value=v),
        updates,
        new_values,
        is_leaf=is_sketched,
    )
    return new_updates, LowRankMomentsState(inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _follow_basis(inner_state, sketches, values_treedef, b1, b2):
  """Moves the moments in ``inner_state`` into each refreshed leaf's new basis."""

  def matches(x):
    return jax.tree.structure(x) == values_treedef

  def per_leaf(fn, *trees):
    return jax.tree.map(
        lambda *args: _apply_on_refresh(fn, args[-1], *args[:-1]),
        *trees,
        sketches,
        is_leaf=is_sketched,
    )

  def walk(node):
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      fields = node._fields
      mu = getattr(node, "mu", None) if "mu" in fields else None
      nu = getattr(node, "nu", None) if "nu" in fields else None
      if mu is not None and nu is not None and matches(mu) and matches(nu):
        count = getattr(node, "count", None)
        out = per_leaf(
            lambda s, m, v: _transfer_adam(s, m, v, count, b1, b2), mu, nu
        )
        mu = jax.tree.map(
            lambda s, pair: pair[0], sketches, out, is_leaf=is_sketched
        )
        nu = jax.tree.map(
            lambda s, pair: pair[1], sketches, out, is_leaf=is_sketched
        )
        return node._replace(mu=mu, nu=nu)
      replaced = {}
      for name in ("mu", "trace"):
        x = getattr(node, name, None) if name in fields else None
        if x is not None and matches(x):
          replaced[name] = per_leaf(_transfer_first, x)
      if nu is not None and matches(nu):
        replaced["nu"] = per_leaf(_transfer_second, nu)
      if replaced:
        return node._replace(**replaced)
      return type(node)(*(walk(c) for c in node))
    if isinstance(node, (tuple, list)):
      return type(node)(walk(c) for c in node)
    if isinstance(node, dict):
      return {k: walk(v) for k, v in node.items()}
    return node

  return walk(inner_state)


def _apply_on_refresh(fn, sketch: Sketched, *moments):
  """Applies ``fn(sketch, *moments)`` on refresh steps of projected leaves."""
  unpack = (lambda xs: xs[0]) if len(moments) == 1 else (lambda xs: xs)
  policy = sketch.config.moment_policy
  if not sketch.plan.projected or policy == "keep":
    return unpack(moments)
  if policy == "reset":
    changed = lambda: unpack(tuple(jnp.zeros_like(m) for m in moments))
  else:
    changed = lambda: fn(sketch, *moments)
  return jax.lax.cond(sketch.refreshed, changed, lambda: unpack(moments))


def _transfer_first(sketch: Sketched, m):
  return (sketch.basis_change @ m).astype(m.dtype)


def _transfer_second(sketch: Sketched, v):
  c = sketch.basis_change
  return jnp.maximum((c * c) @ v, 0).astype(v.dtype)


def _transfer_adam(sketch: Sketched, m, v, count, b1, b2):
  """LDAdam's rule on bias-corrected moments (arXiv 2410.16103)."""
  c = sketch.basis_change
  if count is None:
    c1 = c2 = jnp.ones([], jnp.float32)
  else:
    t = jnp.maximum(count, 1).astype(jnp.float32)
    c1, c2 = 1 - b1**t, 1 - b2**t
  m_hat, v_hat = m / c1, v / c2
  m_new = c @ m_hat
  v_new = jnp.maximum((c * c) @ (v_hat - m_hat**2) + m_new**2, 0)
  return (m_new * c1).astype(m.dtype), (v_new * c2).astype(v.dtype)
