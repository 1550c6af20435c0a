"""``project``: gradients of matrix weights onto a rank-``r`` subspace, and the
projector refresh (range finder, random, SVD) with its non-finite guard."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logra_jax.optim import projectors as proj_lib
from logra_jax.optim.dimension_numbers import LeafPlan
from logra_jax.optim.dimension_numbers import SpecTree
from logra_jax.optim.dimension_numbers import plan_leaves
from logra_jax.optim.types import MOMENT_POLICIES
from logra_jax.optim.types import PlanNode
from logra_jax.optim.types import ProjectionConfig
from logra_jax.optim.types import ProjectionSpec
from logra_jax.optim.types import ProjectState
from logra_jax.optim.types import Sketched
from logra_jax.optim.types import SketchProjectors


def _as_int(name: str, value, low: int) -> Optional[int]:
  """``value`` as a Python int ``>= low``, or None for a traced integer.

  Accepts Python and NumPy ints and concrete integer scalar arrays (what
  ``optax.inject_hyperparams`` passes); a traced one (the same inside
  ``jax.jit``) is only known to the state, which then decides.
  """
  is_array = isinstance(value, (np.ndarray, jax.Array))
  if (
      is_array
      and np.ndim(value) == 0
      and jnp.issubdtype(value.dtype, jnp.integer)
  ):
    if isinstance(value, jax.core.Tracer):
      return None
  elif isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    error = TypeError if name == "rank" else ValueError
    raise error(
        f"{name} must be an int >= {low}, got {value!r} of type "
        f"{type(value).__name__}"
    )
  if int(value) < low:
    raise ValueError(f"{name} must be an int >= {low}, got {int(value)}")
  return int(value)


def projection_config(
    rank, kind, refresh_every, power_iters, oversample, seed, moment_policy
) -> tuple[Optional[int], Optional[ProjectionConfig]]:
  """Validates the hyperparameters of :func:`project` at construction time.

  Returns:
    ``(rank, config)`` as static values, each None where a hyperparameter is
    traced (then the state's own settings hold).
  """
  if kind not in proj_lib.KINDS:
    raise ValueError(f"kind must be one of {proj_lib.KINDS}, got {kind!r}")
  if moment_policy not in MOMENT_POLICIES:
    raise ValueError(
        f"moment_policy must be one of {MOMENT_POLICIES}, got {moment_policy!r}"
    )
  ints = dict(
      refresh_every=_as_int("refresh_every", refresh_every, 1),
      power_iters=_as_int("power_iters", power_iters, 0),
      oversample=_as_int("oversample", oversample, 0),
      seed=_as_int("seed", seed, np.iinfo(np.int64).min),
  )
  rank = _as_int("rank", rank, 1)
  if any(value is None for value in ints.values()):
    return rank, None
  return rank, ProjectionConfig(kind=kind, moment_policy=moment_policy, **ints)


def projection_spec(
    params: Any,
    rank: int,
    config: ProjectionConfig,
    dimension_numbers: Optional[SpecTree],
    mask: Any,
) -> ProjectionSpec:
  """The static plan of every leaf of ``params`` and the stage's settings.

  A function of the parameters' structure and shapes only: each stage of
  :func:`scale_by_low_rank` calls it at ``init`` and gets the same answer.
  """
  plans = plan_leaves(params, rank, dimension_numbers, mask)
  return ProjectionSpec(config, jax.tree.map(PlanNode, plans))


def project(
    spec_of: Callable[[optax.Params], ProjectionSpec],
    rank: Optional[int],
    config: Optional[ProjectionConfig],
) -> optax.GradientTransformationExtraArgs:
  r"""The first stage of :func:`scale_by_low_rank`: sketches the gradients.

  Emits, per projected leaf, the :class:`Sketched` sketch ``S = P^T G`` with
  this step's projector ``P`` (refreshed every ``config.refresh_every``
  steps), and the dense float32 gradient for other leaves.

  Args:
    spec_of: maps the params to their :class:`ProjectionSpec`.
    rank: the checked rank, or None where it is traced.
    config: the checked settings (:func:`projection_config`), or None where
      one of them is traced (the state's own settings then hold).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (extra argument:
    ``projectors``, in sketch-direct mode).

  Example:
    >>> import functools, jax.numpy as jnp
    >>> from logra_jax.optim import projection
    >>> rank, config = projection.projection_config(
    ...     2, "range", 200, 1, 8, 0, "transfer")
    >>> spec_of = functools.partial(projection.projection_spec, rank=rank,
    ...     config=config, dimension_numbers=None, mask=None)
    >>> stage = projection.project(spec_of, rank, config)
    >>> state = stage.init({"w": jnp.ones((8, 4))})
    >>> sketches, state = stage.update({"w": jnp.ones((8, 4))}, state)
    >>> sketches["w"].value.shape
    (1, 2, 4)
  """

  def init_fn(params):
    if rank is None or config is None:
      raise ValueError(
          "scale_by_low_rank's integer hyperparameters (rank, refresh_every, "
          "power_iters, oversample, seed) shape the state: initialize it "
          "outside jax.jit, or mark them static_args of "
          "optax.inject_hyperparams"
      )
    spec = spec_of(params)
    plans = spec.plan_tree()

    def init_projector(plan):
      if not plan.projected or config.kind == "random":
        return None
      return jnp.zeros(
          plan.projector_shape, jnp.float32, out_sharding=plan.projector_spec
      )

    return ProjectState(
        count=jnp.zeros([], jnp.int32),
        projectors=jax.tree.map(init_projector, plans),
        non_finite=jnp.zeros([], jnp.int32),
        spec=spec,
    )

  def update_fn(updates, state, params=None, *, projectors=None, **extra_args):
    del params, extra_args
    _check_spec(state.spec, config, rank)
    refused = jnp.zeros([], jnp.int32)
    if isinstance(projectors, SketchProjectors):
      refused = projectors.non_finite
      projectors = projectors.projectors
    sketches, new_projectors, refused = _sketch_leaves(
        state, updates, projectors, refused
    )
    new_state = ProjectState(
        count=optax.safe_increment(state.count),
        projectors=state.spec.treedef.unflatten(new_projectors),
        non_finite=state.non_finite + refused,
        spec=state.spec,
    )
    return state.spec.treedef.unflatten(sketches), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _sketch_leaves(state: ProjectState, updates, projectors, refused):
  """Per leaf, the :class:`Sketched` update and the projector to store, and
  ``refused`` plus the refreshed projectors refused as non-finite."""
  config = state.spec.config
  window = state.count // config.refresh_every
  refresh = state.count % config.refresh_every == 0
  flat_updates = flatten_like(state.spec, updates, "updates")
  flat_given = (
      None
      if projectors is None
      else flatten_like(state.spec, projectors, "projectors")
  )
  flat_projectors = state.spec.treedef.flatten_up_to(state.projectors)
  sketches, new_projectors = [], []
  for i, (g, plan, p_old) in enumerate(
      zip(flat_updates, state.spec.plans, flat_projectors)
  ):
    if not plan.projected:
      _check_shape(g, plan.shape, plan, "gradient")
      sketches.append(Sketched(g.astype(jnp.float32), plan=plan, config=config))
      new_projectors.append(None)
      continue
    if flat_given is None:
      _check_shape(g, plan.shape, plan, "gradient")
      p_new, n_refused = _new_projector(g, p_old, plan, config, state.count)
      refused += n_refused
      s_BxRxS = plan.sketch(p_new, g)
    else:
      _check_shape(g, plan.sketch_shape, plan, "sketched gradient")
      p_new = flat_given[i]
      _check_shape(p_new, plan.projector_shape, plan, "projector")
      s_BxRxS = g.astype(jnp.float32)
    change = _basis_change(p_new, p_old, plan, config, window, refresh)
    sketches.append(
        Sketched(s_BxRxS, p_new, change, refresh, plan=plan, config=config)
    )
    new_projectors.append(None if config.kind == "random" else p_new)
  return sketches, new_projectors, refused


def _check_spec(
    spec: ProjectionSpec,
    config: Optional[ProjectionConfig],
    rank: Optional[int],
) -> None:
  """Refuses a state made by a ``project`` stage with other settings (those
  not known here, being traced, are not compared)."""
  if config is not None and spec.config != config:
    raise ValueError(
        "this optimizer state was initialized by a project stage with "
        f"{spec.config}, but is updated by one with {config}; re-initialize "
        "the state (tx.init) for the new settings"
    )
  for plan in () if rank is None else spec.plans:
    if plan.kept_dense and rank <= max(plan.m, plan.n):
      raise ValueError(
          f"this optimizer state keeps parameter {plan.path!r} dense, but the "
          f"project stage has rank={rank}; the state comes from another "
          "configuration"
      )
    if plan.projected and plan.rank != min(rank, plan.m, plan.n):
      raise ValueError(
          f"this optimizer state projects parameter {plan.path!r} at rank "
          f"{plan.rank}, but the project stage has rank={rank}; the state "
          "comes from another configuration"
      )


def flatten_like(spec: ProjectionSpec, tree: Any, name: str) -> list:
  """Flattens ``tree`` to the leaves of the parameters the state knows."""
  try:
    return spec.treedef.flatten_up_to(tree)
  except (ValueError, TypeError):
    known = [plan.path for plan in spec.plans]
    got = [
        jax.tree_util.keystr(k)
        for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    raise ValueError(
        f"{name} do not match the parameters this optimizer state was "
        f"initialized with: unknown leaves {sorted(set(got) - set(known))[:5]}, "
        f"missing leaves {sorted(set(known) - set(got))[:5]}"
    ) from None


def _check_shape(x, shape, plan: LeafPlan, what: str) -> None:
  if x is None or tuple(jnp.shape(x)) != tuple(shape):
    got = None if x is None else tuple(jnp.shape(x))
    raise ValueError(
        f"{what} for parameter {plan.path!r} has shape {got}, expected "
        f"{tuple(shape)}"
        + (
            "; sketched gradients need the projectors= argument from "
            "logra.value_and_sketch_grad"
            if what == "gradient"
            and plan.projected
            and got == plan.sketch_shape
            else ""
        )
    )


def _new_projector(g, p_old, plan: LeafPlan, config: ProjectionConfig, count):
  """This step's projector of a leaf from its full gradient ``g``, and the
  number of its matrices refused as non-finite.

  Refresh runs under ``lax.cond`` so that non-refresh steps pay nothing for it.
  """
  window = count // config.refresh_every
  if config.kind == "random":
    return (
        random_window_projector(plan, config, window),
        jnp.zeros([], jnp.int32),
    )

  def recompute():
    if config.kind == "svd":
      factorize = lambda g_BxMxN: proj_lib.svd_projector(
          g_BxMxN, plan.rank, plan.left
      )
      args = (plan.to_matrix(g),)
    else:
      factorize = lambda g_BxLxS, key: proj_lib.range_projector(
          g_BxLxS, key, plan.rank, config.oversample, config.power_iters
      )
      key = proj_lib.window_key(config.seed, plan.index, window)
      args = (plan.to_long_view(g), key)
    if plan.projector_spec is not None:
      # Under explicit sharding XLA lays out the factorization: the range
      # finder's QRs gather r-column sketches (never the m x n gradient; an
      # exact SVD needs its matrix), and the projector comes out split like
      # the state's.
      factorize = jax.sharding.auto_axes(
          factorize, out_sharding=plan.projector_spec
      )
    p = factorize(*args)
    return refuse_non_finite_projector(p, p_old, plan, config, count)

  return jax.lax.cond(
      count % config.refresh_every == 0,
      recompute,
      lambda: (p_old, jnp.zeros([], jnp.int32)),
  )


def refuse_non_finite_projector(
    p_new, p_old, plan: LeafPlan, config: ProjectionConfig, count
) -> tuple[jax.Array, jax.Array]:
  """A refreshed projector with every non-finite matrix replaced.

  Each matrix of the batch (e.g. one layer) is checked on its own. One with a
  NaN or infinite entry is refused and replaced by its previous projector
  ``p_old``, so that its refresh is skipped and its moments stay in their
  basis; where there is none (the first refresh, ``count == 0``, whose stored
  projector is the zeros of ``init``) or it is not finite either, by the
  window's random orthonormal projector (``kind="random"``'s, from the seed).

  Args:
    p_new: ``[batch, long, rank]`` refreshed projector.
    p_old: ``[batch, long, rank]`` projector of the previous window.
    plan: the leaf's plan.
    config: the stage's settings.
    count: the stage's update count.

  Returns:
    ``(projector, refused)``: the projector to use and the int32 number of
    matrices replaced.
  """
  ok_B = jnp.all(jnp.isfinite(p_new), axis=(1, 2))

  def replace():
    window = count // config.refresh_every
    old_ok_B = (count > 0) & jnp.all(jnp.isfinite(p_old), axis=(1, 2))
    fallback = jnp.where(
        old_ok_B[:, None, None],
        p_old,
        random_window_projector(plan, config, window),
    )
    return jnp.where(ok_B[:, None, None], p_new, fallback)

  p = jax.lax.cond(jnp.all(ok_B), lambda: p_new, replace)
  return p, jnp.sum(~ok_B, dtype=jnp.int32)


def random_window_projector(
    plan: LeafPlan, config: ProjectionConfig, window
) -> jax.Array:
  """The ``kind='random'`` projector of a leaf for one refresh window."""
  key = proj_lib.window_key(config.seed, plan.index, window)
  p = proj_lib.random_projector(key, plan.batch, plan.long, plan.rank)
  if plan.projector_spec is None:
    return p
  return jax.sharding.reshard(p, plan.projector_spec)


def _basis_change(
    p_new, p_old, plan: LeafPlan, config: ProjectionConfig, window, refresh
):
  """``C = P_new^T P_old`` on refresh steps (identity otherwise), for moment
  transfer; None unless ``moment_policy='transfer'``."""
  if config.moment_policy != "transfer":
    return None
  eye = jnp.broadcast_to(
      jnp.eye(plan.rank, dtype=jnp.float32),
      (plan.batch, plan.rank, plan.rank),
      out_sharding=plan.small_spec,
  )
  overlap = lambda p_other: jnp.einsum(
      "blr,bls->brs", p_new, p_other, out_sharding=plan.small_spec
  )
  if config.kind == "random":

    def changed():
      p_prev = random_window_projector(plan, config, jnp.maximum(window - 1, 0))
      return overlap(p_prev)

    return jax.lax.cond(refresh & (window > 0), changed, lambda: eye)
  return jax.lax.cond(refresh, lambda: overlap(p_old), lambda: eye)
