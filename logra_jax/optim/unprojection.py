"""``unproject``: low-rank updates back to the parameters' shapes and dtypes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from logra_jax.optim.types import _LATEST_PLAN
from logra_jax.optim.types import FactoredDelta
from logra_jax.optim.types import LowRankFactor
from logra_jax.optim.types import Sketched
from logra_jax.optim.types import UnprojectState
from logra_jax.optim.types import is_sketched


def unproject(
    scale: float = 1.0, keep_factors: bool = False, factored: bool = False
) -> optax.GradientTransformation:
  r"""Maps low-rank updates back to the parameters' shapes and dtypes.

  For a projected leaf with projector ``P`` and low-rank update ``N`` from
  :func:`low_rank_moments`, the update is :math:`U = \alpha P N` (transposed
  back for wide matrices); dense leaves pass through unscaled (as in GaLore).
  Updates are cast to the parameters' dtype.

  Args:
    scale: :math:`\alpha`.
    keep_factors: also keep ``alpha * N`` of the last step in the state, so
      that the factored update ``(P, alpha N)`` is available from
      :func:`factored_updates` (for low-rank policy sync and factored KL
      prediction) at a cost of ``rank * short`` floats per matrix.
    factored: emit a :class:`FactoredDelta` ``(alpha N)`` for each projected
      leaf instead of the dense ``alpha P N``, for params kept factored
      (:mod:`logra_jax.optim.factored`); no ``m x n`` update is formed.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp, optax, logra_jax as logra
    >>> tx = optax.chain(logra.project(rank=2), logra.low_rank_moments(),
    ...                  logra.unproject(keep_factors=True))
    >>> params = {"w": jnp.ones((8, 4))}
    >>> updates, state = tx.update(params, tx.init(params))
    >>> factored = logra.factored_updates(state)
    >>> bool(jnp.allclose(factored["w"].dense(), updates["w"], atol=1e-6))
    True
  """

  def init_fn(params):
    if not keep_factors:
      return UnprojectState(factors=None)
    latest = _LATEST_PLAN.get()
    if latest is None or latest[0] != jax.tree.structure(params):
      raise ValueError("unproject must follow logra.project in the same chain")
    _, plans, config = latest

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
            "unproject expects the output of logra.low_rank_moments; got a "
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
