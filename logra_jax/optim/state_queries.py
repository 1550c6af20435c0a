"""Questions asked of a LoGRA optimizer state: its stages, the last update in
factored form, the window's projectors, its size in bytes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logra_jax.optim.projection import random_window_projector
from logra_jax.optim.types import FactoredUpdate
from logra_jax.optim.types import LowRankFactor
from logra_jax.optim.types import ProjectionSpec
from logra_jax.optim.types import ProjectState
from logra_jax.optim.types import UnprojectState


def find_states(state, cls) -> list:
  """Every sub-state of type ``cls`` in a (possibly nested) optax state."""
  found = []

  def walk(node):
    if isinstance(node, cls):
      found.append(node)
    elif isinstance(node, (tuple, list)):
      for c in node:
        walk(c)
    elif isinstance(node, dict):
      for c in node.values():
        walk(c)

  walk(state)
  return found


def factored_updates(opt_state: optax.OptState) -> Any:
  """Returns the last step's projected updates in factored form.

  Looks up the states of ``scale_by_low_rank(keep_factors=True)`` inside
  a (possibly nested) optax state and pairs each leaf's projector with its
  coefficients, without any decomposition. Random projectors are regenerated
  from their seed.

  Args:
    opt_state: the state of a chain containing
      ``scale_by_low_rank(keep_factors=True)``, after at least one update.

  Returns:
    A pytree matching the parameters with a :class:`FactoredUpdate` at each
    projected leaf and None at dense leaves.

  Raises:
    ValueError: if the state holds no such pair of stages.
  """
  projects = find_states(opt_state, ProjectState)
  unprojects = [
      s for s in find_states(opt_state, UnprojectState) if s.factors is not None
  ]
  if len(projects) != 1 or len(unprojects) != 1:
    raise ValueError(
        "factored_updates needs exactly one "
        "logra.scale_by_low_rank(keep_factors=True) in the optimizer state; "
        f"found {len(projects)} projections and {len(unprojects)} kept "
        "factors"
    )
  factors = unprojects[0].factors

  def pair(factor, projector):
    if factor is None:
      return None
    return FactoredUpdate(projector, factor.coefficients, factor.plan)

  is_leaf = lambda x: x is None or isinstance(x, LowRankFactor)
  return jax.tree.map(
      pair, factors, window_projectors(opt_state), is_leaf=is_leaf
  )


def window_projectors(opt_state: optax.OptState) -> Any:
  """The projectors of the window of the last update, as a tree like the
  params (None at dense leaves).

  The stored ones for ``kind="range"``/``"svd"``; for ``"random"`` the
  window's regenerated from the seed (:func:`random_projectors`). Before
  the first update: the stored zeros (or window 0's random projectors).

  Raises:
    ValueError: if the state has no, or more than one, ``scale_by_low_rank``.
  """
  state = _one_project_state(opt_state, "window_projectors")
  config = state.spec.config
  if config.kind != "random":
    return state.projectors
  return random_projectors(state.spec, window_index(state))


def window_index(state: ProjectState) -> jax.Array:
  """The refresh window of the last update (window 0 before the first):
  the update at count ``t`` belongs to window ``t // refresh_every``."""
  return jnp.maximum(state.count - 1, 0) // state.spec.config.refresh_every


def random_projectors(spec: ProjectionSpec, window) -> Any:
  """The ``kind="random"`` projectors of refresh window ``window`` (the
  update at count ``t`` uses window ``t // refresh_every``), regenerated
  from the seed, as a tree like the params (None at dense leaves).

  Takes the state's static spec (``ProjectState.spec``, also that of an
  abstract state from ``jax.eval_shape`` of ``tx.init``): a receiver of sync
  messages regenerates the learner's projectors bit for bit from its
  config alone.
  """
  return spec.treedef.unflatten(
      [
          random_window_projector(plan, spec.config, window)
          if plan.projected
          else None
          for plan in spec.plans
      ]
  )


def _one_project_state(opt_state: optax.OptState, caller: str) -> ProjectState:
  """The one ``scale_by_low_rank`` state of ``opt_state``.

  Raises:
    ValueError: none, or more than one.
  """
  projects = find_states(opt_state, ProjectState)
  if len(projects) != 1:
    raise ValueError(
        f"{caller} needs exactly one logra.scale_by_low_rank "
        f"stage in the optimizer state; found {len(projects)}"
    )
  return projects[0]


def optimizer_state_bytes(state: Any) -> int:
  """Total bytes of the arrays in an optimizer state (or its abstract shapes).

  Works on concrete arrays and on ``jax.ShapeDtypeStruct`` trees from
  ``jax.eval_shape(tx.init, params)``, so memory can be counted without
  allocating it.

  Example:
    >>> import jax, jax.numpy as jnp, optax, logra_jax as logra
    >>> params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
    >>> adam = jax.eval_shape(optax.adam(1e-3).init, params)
    >>> logra.optimizer_state_bytes(adam) // 2**20
    128
  """
  total = 0
  for leaf in jax.tree.leaves(state):
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      total += int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
  return total


def kept_dense_paths(opt_state: optax.OptState) -> tuple[str, ...]:
  """The paths of the matrices kept dense because both their sides are
  smaller than the rank (see :func:`logra_jax.project`).

  Such a matrix (e.g. a ``2 x 3`` weight at ``rank=8``) goes through the
  inner transform at full size, like a vector; its count is the length of
  the result.

  Raises:
    ValueError: if the state has no, or more than one, ``scale_by_low_rank``.

  Example:
    >>> import jax.numpy as jnp, logra_jax as logra
    >>> params = {"w": jnp.ones((64, 32)), "small": jnp.ones((2, 3))}
    >>> state = logra.logra(learning_rate=1e-2, rank=8).init(params)
    >>> logra.kept_dense_paths(state)
    ("['small']",)
  """
  projects = find_states(opt_state, ProjectState)
  if len(projects) != 1:
    raise ValueError(
        "kept_dense_paths needs exactly one logra.scale_by_low_rank stage "
        f"in the optimizer state; found {len(projects)}"
    )
  return tuple(p.path for p in projects[0].spec.plans if p.kept_dense)
