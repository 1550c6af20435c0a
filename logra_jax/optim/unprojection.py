"""``unproject``: low-rank updates back to the parameters' shapes and dtypes."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from logra_jax.optim.types import FactoredDelta
from logra_jax.optim.types import LowRankFactor
from logra_jax.optim.types import ProjectionSpec
from logra_jax.optim.types import Sketched
from logra_jax.optim.types import UnprojectState
from logra_jax.optim.types import is_sketched


def unproject(
    spec_of: Callable[[optax.Params], ProjectionSpec],
    scale: float = 1.0,
    keep_factors: bool = False,
    factored: bool = False,
) -> optax.GradientTransformation:
  r"""The last stage of :func:`scale_by_low_rank`: back to the params' shapes.

  For a projected leaf with projector ``P`` and low-rank update ``N``, the
  update is :math:`U = \alpha P N` (transposed back for wide matrices), cast
  to the parameter's dtype; dense leaves pass through unscaled (as in
  GaLore).

  Args:
    spec_of: maps the params to the projection's :class:`ProjectionSpec`;
      sets the shapes of the kept factors.
    scale: :math:`\alpha`.
    keep_factors: also keep ``alpha * N`` of the last step in the state (see
      :func:`scale_by_low_rank`).
    factored: emit a :class:`FactoredDelta` ``(alpha N)`` for each projected
      leaf instead of the dense ``alpha P N``.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp
    >>> from logra_jax.optim import projection, unprojection
    >>> _, config = projection.projection_config(2, "range", 200, 1, 8, 0,
    ...                                          "transfer")
    >>> stage = unprojection.unproject(
    ...     lambda p: projection.projection_spec(p, 2, config, None, None),
    ...     keep_factors=True)
    >>> state = stage.init({"w": jnp.ones((8, 4))})
    >>> state.factors["w"].coefficients.shape
    (1, 2, 4)
  """

  def init_fn(params):
    if not keep_factors:
      return UnprojectState(factors=None)
    spec = spec_of(params)
    plans, config = spec.plan_tree(), spec.config

    def factor(plan):
      if not plan.projected:
        return None
      return LowRankFactor(
          jnp.zeros(
              plan.sketch_shape, jnp.float32, out_sharding=plan.sketch_spec
          ),
          plan=plan,
          config=config,
      )

    return UnprojectState(factors=jax.tree.map(factor, plans))

  def update_fn(updates, state, params=None):
    del params
    for leaf in jax.tree.leaves(updates, is_leaf=is_sketched):
      if not is_sketched(leaf):
        raise TypeError(
            "unproject expects the output of low_rank_moments; got a "
            f"leaf of type {type(leaf).__name__}"
        )

    def to_dense(s: Sketched):
      if not s.plan.projected:
        return s.value.astype(s.plan.dtype)
      if factored:
        return FactoredDelta(scale * s.value, None, s.plan)
      return (scale * s.plan.expand(s.projector, s.value)).astype(s.plan.dtype)

    dense = jax.tree.map(to_dense, updates, is_leaf=is_sketched)
    if not keep_factors:
      return dense, state

    def factor(s: Sketched):
      if not s.plan.projected:
        return None
      return LowRankFactor(scale * s.value, plan=s.plan, config=s.config)

    return dense, UnprojectState(
        factors=jax.tree.map(factor, updates, is_leaf=is_sketched)
    )

  return optax.GradientTransformation(init_fn, update_fn)
