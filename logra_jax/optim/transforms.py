"""The LoGRA chain: ``project`` -> ``low_rank_moments`` -> ``unproject``.

Between the stages the updates travel as a pytree whose leaves are
:class:`Sketched` nodes: the low-rank coordinates of each projected weight
(``[batch, rank, short]``) together with the projector that produced them, or
the float32 gradient itself for dense leaves. ``unproject`` turns them back into
ordinary updates with the parameters' shapes and dtypes.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from typing import Any, NamedTuple, Optional
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logra_jax.optim import projectors as proj_lib
from logra_jax.optim.dimension_numbers import LeafPlan, SpecTree, plan_leaves

MOMENT_POLICIES = ("transfer", "keep", "reset")

# `low_rank_moments.init` must allocate its moments at the low-rank shapes that
# `project.init` chose. optax initializes the stages of a chain in order with
# the same params, so `project.init` publishes its plan here and the next
# `low_rank_moments.init` on the same params tree reads it.
_LATEST_PLAN: contextvars.ContextVar = contextvars.ContextVar(
    "logra_latest_projection_plan", default=None
)


@dataclasses.dataclass(frozen=True)
class ProjectionConfig:
  """Static settings of a ``project`` stage, carried with its updates."""

  kind: str
  refresh_every: int
  power_iters: int
  oversample: int
  seed: int
  moment_policy: str


@jax.tree_util.register_pytree_node_class
class Sketched:
  """One leaf of the updates inside the LoGRA chain.

  Attributes:
    value: ``[batch, rank, short]`` low-rank coordinates for a projected leaf
      (the sketch ``P^T G`` after ``project``, the inner transform's output
      ``N`` after ``low_rank_moments``), or the full float32 array for a dense
      leaf.
    projector: ``[batch, long, rank]`` orthonormal projector of this step, or
      None for dense leaves.
    basis_change: ``[batch, rank, rank]`` matrix ``C = P_new^T P_old`` used to
      carry moments across a refresh (None unless ``moment_policy='transfer'``).
    refreshed: scalar bool, True on steps where the projector was recomputed.
    plan: static ``LeafPlan`` (shapes, dtype, orientation).
    config: static ``ProjectionConfig``.
  """

  def __init__(
      self,
      value,
      projector=None,
      basis_change=None,
      refreshed=None,
      *,
      plan: LeafPlan,
      config: ProjectionConfig,
  ):
    self.value = value
    self.projector = projector
    self.basis_change = basis_change
    self.refreshed = refreshed
    self.plan = plan
    self.config = config

  def tree_flatten(self):
    children = (self.value, self.projector, self.basis_change, self.refreshed)
    return children, (self.plan, self.config)

  @classmethod
  def tree_unflatten(cls, aux, children):
    plan, config = aux
    return cls(*children, plan=plan, config=config)

  def replace(self, **kwargs) -> "Sketched":
    fields = dict(
        value=self.value,
        projector=self.projector,
        basis_change=self.basis_change,
        refreshed=self.refreshed,
    )
    fields.update(kwargs)
    return Sketched(**fields, plan=self.plan, config=self.config)


def _is_sketched(x) -> bool:
  return isinstance(x, Sketched)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ProjectionSpec:
  """Static part of a ``project`` state: its settings and the leaf plans.

  A pytree node without children, so it adds no arrays to the state; it lets
  code that holds only the optimizer state (:mod:`logra_jax.optim.sketch_grad`)
  know how every parameter is projected.
  """

  config: ProjectionConfig
  treedef: Any
  plans: tuple[LeafPlan, ...]

  def plan_tree(self) -> Any:
    return self.treedef.unflatten(self.plans)


class ProjectState(NamedTuple):
  """State of :func:`project`.

  Attributes:
    count: number of updates taken.
    projectors: per leaf, the ``[batch, long, rank]`` float32 projector of the
      current window, or None (dense leaves, and ``kind='random'``, whose
      projectors are regenerated from the seed instead of stored).
    non_finite: refreshed projectors refused so far because they were not
      finite (one per matrix of the batch; see
      :func:`refuse_non_finite_projector`).
    spec: the static :class:`ProjectionSpec` (no arrays).
  """

  count: jax.Array
  projectors: Any
  non_finite: jax.Array
  spec: ProjectionSpec


class SketchProjectors(NamedTuple):
  """This step's projectors from :func:`logra_jax.value_and_sketch_grad`.

  Hand it to the optimizer as is (``tx.update(..., projectors=...)``).

  Attributes:
    projectors: a pytree like the parameters: the ``[batch, long, rank]``
      projector ``P`` of each projected leaf, None elsewhere.
    non_finite: int32 count of refreshed projectors refused this step (see
      :func:`refuse_non_finite_projector`); the sketches were taken with
      their replacements.
  """

  projectors: Any
  non_finite: jax.Array


class LowRankMomentsState(NamedTuple):
  """State of :func:`low_rank_moments`: the inner transform's state, whose
  moments have the low-rank shapes ``[batch, rank, short]``."""

  inner_state: optax.OptState


class UnprojectState(NamedTuple):
  """State of :func:`unproject`.

  Attributes:
    factors: with ``keep_factors=True``, per projected leaf a
      :class:`LowRankFactor` holding the last update's coefficients (already
      multiplied by ``scale``); otherwise None.
  """

  factors: Any


@jax.tree_util.register_pytree_node_class
class LowRankFactor:
  """Coefficients ``N`` of the last update of one projected leaf.

  The update of the leaf is ``P @ N`` (in the leaf's shape) with the projector ``P``
  of the same step; :func:`factored_updates` pairs the two.
  """

  def __init__(self, coefficients, *, plan: LeafPlan, config: ProjectionConfig):
    self.coefficients = coefficients
    self.plan = plan
    self.config = config

  def tree_flatten(self):
    return (self.coefficients,), (self.plan, self.config)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, plan=aux[0], config=aux[1])


class FactoredUpdate(NamedTuple):
  """The factored form of an update: ``U = projector @ coefficients``.

  Attributes:
    projector: ``[batch, long, rank]`` float32, orthonormal columns.
    coefficients: ``[batch, rank, short]`` float32.
    plan: static ``LeafPlan`` describing the leaf's shape and orientation.
  """

  projector: jax.Array
  coefficients: jax.Array
  plan: LeafPlan

  def dense(self) -> jax.Array:
    """Materializes the update with the parameter's shape and dtype."""
    return self.plan.expand(self.projector, self.coefficients).astype(
        self.plan.dtype
    )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["coords", "decay"],
    meta_fields=["plan"],
)
@dataclasses.dataclass(frozen=True)
class FactoredDelta:
  r"""The update of one projected weight, :math:`D = a W + P \Delta`.

  Emitted by ``logra.unproject(factored=True)`` with ``decay=None``
  (:math:`a = 0`); :func:`logra_jax.optim.factored.add_decayed_weights`
  sets ``decay``. Later stages that scale updates (learning rate,
  predicted-KL scale) scale both fields, since ``D`` is linear in them. Apply it with
  :func:`logra_jax.optim.factored.apply_updates`.

  Attributes:
    coords: :math:`\Delta`, ``[batch, rank, short]`` float32, in the basis of
      this step's projector.
    decay: :math:`a`, a float32 scalar, or None for 0.
    plan: the leaf's static plan.
  """

  coords: Any
  decay: Any
  plan: LeafPlan


def _check_rank(rank) -> None:
  if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
    raise TypeError(
        f"rank must be a positive int, got {rank!r} "
        f"of type {type(rank).__name__}"
    )
  if rank < 1:
    raise ValueError(f"rank must be a positive int, got {rank}")


def check_projection_args(
    rank, kind, refresh_every, power_iters, oversample, moment_policy
) -> None:
  """Validates the hyperparameters of :func:`project` at construction time."""
  _check_rank(rank)
  if kind not in proj_lib.KINDS:
    raise ValueError(f"kind must be one of {proj_lib.KINDS}, got {kind!r}")
  if moment_policy not in MOMENT_POLICIES:
    raise ValueError(
        f"moment_policy must be one of {MOMENT_POLICIES}, got {moment_policy!r}"
    )
  for name, value, low in (
      ("refresh_every", refresh_every, 1),
      ("power_iters", power_iters, 0),
      ("oversample", oversample, 0),
  ):
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value < low
    ):
      raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def project(
    rank: int,
    kind: str = "range",
    refresh_every: int = 200,
    power_iters: int = 1,
    oversample: int = 8,
    seed: int = 0,
    dimension_numbers: Optional[SpecTree] = None,
    mask: Any = None,
    moment_policy: str = "transfer",
) -> optax.GradientTransformationExtraArgs:
  r"""Projects gradients of matrix weights onto a rank-``r`` subspace.

  For a weight viewed as ``G`` (``m x n``, ``m >= n``; the wide case is the
  transpose) with an orthonormal projector ``P`` (``m x r``) on the longer
  side, emits the sketch

  .. math:: S = P^\top G \in \mathbb{R}^{r \times n},

  so that the moments of the next stage live on the shorter side. ``P`` is
  recomputed every ``refresh_every`` steps (and at step 0) with ``lax.cond``:

  * ``"range"``: randomized range finder with ``power_iters`` power iterations
    and ``oversample`` extra columns, float32 QR (Halko et al., 2011);
  * ``"random"``: an orthonormalized Gaussian regenerated from
    ``fold_in(seed, window)`` every step, never stored (Flora);
  * ``"svd"``: the exact top-``r`` singular vectors (GaLore).

  Must be followed by :func:`low_rank_moments` and :func:`unproject` in the
  same ``optax.chain``; leaves that are not projected (vectors, and whatever
  ``mask`` or ``dimension_numbers`` exclude) pass through as dense float32
  gradients.

  Sketch-direct mode: when the gradients were sketched during
  differentiation (:func:`logra_jax.sketch_grad.value_and_sketch_grad`), the
  projected leaves of ``updates`` already hold ``S`` (``[batch, rank,
  short]``) and the extra argument ``projectors`` gives this step's ``P`` per
  leaf (a pytree like the parameters, or the :class:`SketchProjectors` that
  function returns); the stage then only records them (and the basis change
  for the moments), so no full gradient is ever needed.

  A refreshed projector that is not finite (``"range"`` or ``"svd"``, e.g.
  from an overflow or a failed decomposition) is never used: see
  :func:`refuse_non_finite_projector`. Refusals are counted in
  ``ProjectState.non_finite`` and reported once with a warning.

  Sharding: under automatic sharding (``jax.jit`` with shardings) XLA lays
  out the state. Under explicit sharding (a mesh of
  ``jax.sharding.AxisType.Explicit`` axes set with ``jax.set_mesh``) the
  state is laid out from each parameter's type at ``init``: a projector
  split along the weight's long side, the sketches and moments along its
  short side; ``update`` keeps those types, and the factorizations run under
  ``jax.sharding.auto_axes``, which gathers the ``long x (rank + oversample)``
  columns a QR needs ("range"; "svd" gathers the matrix it decomposes). A
  side formed by several axes (``DimensionNumbers`` with tuples) is gathered
  whole.

  Args:
    rank: projection rank ``r``; clipped to the shorter side of each matrix.
    kind: ``"range"``, ``"random"`` or ``"svd"``.
    refresh_every: steps between projector refreshes.
    power_iters: power iterations of the range finder.
    oversample: extra Gaussian columns of the range finder.
    seed: seed of the Gaussian test matrices and random projectors.
    dimension_numbers: None (2-d leaves are matrices), a
      :class:`DimensionNumbers`, a pytree of them (None marks dense leaves) or
      a callable of the params returning one.
    mask: pytree of bools (or callable of the params); False keeps a leaf dense.
    moment_policy: how :func:`low_rank_moments` treats its moments when the
      basis changes: ``"transfer"`` (rotate them into the new basis, LDAdam),
      ``"keep"`` (GaLore) or ``"reset"`` (zero them).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (extra argument:
    ``projectors``, only in sketch-direct mode).

  Example:
    >>> import jax.numpy as jnp, optax, logra_jax as logra
    >>> params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
    >>> tx = optax.chain(logra.project(rank=4), logra.low_rank_moments(),
    ...                  logra.unproject(), optax.scale(-1e-3))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> updates["w"].shape
    (64, 32)

  References:
    Zhao et al., `GaLore <https://arxiv.org/abs/2403.03507>`_, 2024;
    Hao et al., `Flora <https://arxiv.org/abs/2402.03293>`_, 2024;
    Robert et al., `LDAdam <https://arxiv.org/abs/2410.16103>`_, 2024;
    Halko, Martinsson & Tropp, `Finding structure with randomness
    <https://arxiv.org/abs/0909.4061>`_, 2011.
  """
  check_projection_args(
      rank, kind, refresh_every, power_iters, oversample, moment_policy
  )
  config = ProjectionConfig(
      kind=kind,
      refresh_every=int(refresh_every),
      power_iters=int(power_iters),
      oversample=int(oversample),
      seed=int(seed),
      moment_policy=moment_policy,
  )

  def init_fn(params):
    plans = plan_leaves(params, int(rank), dimension_numbers, mask)
    _LATEST_PLAN.set((jax.tree.structure(params), plans, config))

    def init_projector(plan):
      if not plan.projected or kind == "random":
        return None
      return jnp.zeros(
          plan.projector_shape, jnp.float32, out_sharding=plan.projector_spec
      )

    flat_plans, treedef = jax.tree.flatten(
        plans, is_leaf=lambda x: isinstance(x, LeafPlan)
    )
    return ProjectState(
        count=jnp.zeros([], jnp.int32),
        projectors=jax.tree.map(init_projector, plans),
        non_finite=jnp.zeros([], jnp.int32),
        spec=ProjectionSpec(config, treedef, tuple(flat_plans)),
    )

  def update_fn(updates, state, params=None, *, projectors=None, **extra_args):
    del params, extra_args
    _check_spec(state.spec, config, int(rank))
    window = state.count // config.refresh_every
    refresh = state.count % config.refresh_every == 0
    flat_updates = _flatten_like(state.spec, updates, "updates")
    refused = jnp.zeros([], jnp.int32)
    if isinstance(projectors, SketchProjectors):
      refused = projectors.non_finite
      projectors = projectors.projectors
    flat_given = (
        None
        if projectors is None
        else _flatten_like(state.spec, projectors, "projectors")
    )
    flat_projectors = state.spec.treedef.flatten_up_to(state.projectors)
    sketches, new_projectors = [], []
    for i, (g, plan, p_old) in enumerate(
        zip(flat_updates, state.spec.plans, flat_projectors)
    ):
      if not plan.projected:
        _check_shape(g, plan.shape, plan, "gradient")
        sketches.append(
            Sketched(g.astype(jnp.float32), plan=plan, config=config)
        )
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
      new_projectors.append(None if kind == "random" else p_new)
    jax.lax.cond(
        refused > 0,
        lambda: jax.debug.callback(
            _warn_non_finite_projectors, refused, state.count
        ),
        lambda: None,
    )
    new_state = ProjectState(
        count=optax.safe_increment(state.count),
        projectors=state.spec.treedef.unflatten(new_projectors),
        non_finite=state.non_finite + refused,
        spec=state.spec,
    )
    return state.spec.treedef.unflatten(sketches), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_spec(
    spec: ProjectionSpec, config: ProjectionConfig, rank: int
) -> None:
  """Refuses a state made by a ``project`` stage with other settings."""
  if spec.config != config:
    raise ValueError(
        "this optimizer state was initialized by a project stage with "
        f"{spec.config}, but is updated by one with {config}; re-initialize "
        "the state (tx.init) for the new settings"
    )
  for plan in spec.plans:
    if plan.projected and plan.rank != min(rank, plan.m, plan.n):
      raise ValueError(
          f"this optimizer state projects parameter {plan.path!r} at rank "
          f"{plan.rank}, but the project stage has rank={rank}; the state "
          "comes from another configuration"
      )


def _flatten_like(spec: ProjectionSpec, tree: Any, name: str) -> list:
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


def _warn_non_finite_projectors(refused, count) -> None:
  warnings.warn(
      f"logra.project: {int(refused)} refreshed projector(s) at update "
      f"{int(count)} were not finite and were replaced (the previous "
      "projector, or a random orthonormal one on the first refresh); the "
      "optimizer state counts them in ProjectState.non_finite",
      RuntimeWarning,
      stacklevel=1,
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


def low_rank_moments(
    inner: Optional[optax.GradientTransformation] = None,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
) -> optax.GradientTransformationExtraArgs:
  r"""Runs an optax transform on the low-rank sketches instead of gradients.

  The inner transform (default ``optax.scale_by_adam()``) must not need
  ``params``; its state is allocated at the sketch shapes
  ``[batch, rank, short]`` (``O(r \min(m, n))`` per matrix) in float32, and at
  full size for dense leaves.

  When the projector of a leaf is refreshed, the moments follow the basis
  according to the ``moment_policy`` of the preceding :func:`project`:

  * ``"transfer"`` (LDAdam): with :math:`C = P_{new}^\top P_{old}` and the
    bias-corrected moments :math:`\hat M, \hat V`,

    .. math::
      \hat M \leftarrow C \hat M, \qquad
      \hat V \leftarrow \max\big(0, (C \circ C)(\hat V - \hat M^2)
      + (C \hat M)^2\big),

    applied to every optax state with ``mu``/``nu`` fields (Adam-like);
    first moments without a second (``mu`` or ``trace``) rotate linearly and
    lone second moments (``nu``) map through :math:`C \circ C`;
  * ``"keep"``: moments stay as they are (GaLore);
  * ``"reset"``: moments are set to zero; the inner step count is kept.

  Args:
    inner: the transform to run in the low-rank space.
    betas: the ``(b1, b2)`` decay rates of ``inner``'s first and second
      moments, used only by ``"transfer"`` to bias-correct before rotating.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; extra arguments are passed
    on to ``inner``.

  Example:
    >>> import jax.numpy as jnp, optax, logra_jax as logra
    >>> tx = optax.chain(logra.project(rank=2),
    ...                  logra.low_rank_moments(optax.scale_by_lion()),
    ...                  logra.unproject())
    >>> state = tx.init({"w": jnp.ones((8, 4))})
  """
  inner = optax.with_extra_args_support(
      optax.scale_by_adam(*betas) if inner is None else inner
  )
  b1, b2 = betas

  def init_fn(params):
    latest = _LATEST_PLAN.get()
    if latest is None or latest[0] != jax.tree.structure(params):
      raise ValueError(
          "low_rank_moments must follow logra.project in the same chain, e.g. "
          "optax.chain(logra.project(rank), logra.low_rank_moments(), "
          "logra.unproject()); no matching project stage was initialized on "
          "these params"
      )
    _, plans, _ = latest

    def proxy(plan):
      if plan.projected:
        return jnp.zeros(
            plan.sketch_shape, jnp.float32, out_sharding=plan.sketch_spec
        )
      return jnp.zeros(plan.shape, jnp.float32, out_sharding=plan.dense_spec)

    return LowRankMomentsState(inner.init(jax.tree.map(proxy, plans)))

  def update_fn(updates, state, params=None, **extra_args):
    del params
    values = jax.tree.map(lambda s: s.value, updates, is_leaf=_is_sketched)
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
        is_leaf=_is_sketched,
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
        is_leaf=_is_sketched,
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
            lambda s, pair: pair[0], sketches, out, is_leaf=_is_sketched
        )
        nu = jax.tree.map(
            lambda s, pair: pair[1], sketches, out, is_leaf=_is_sketched
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
    for leaf in jax.tree.leaves(updates, is_leaf=_is_sketched):
      if not _is_sketched(leaf):
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

    dense = jax.tree.map(to_dense, updates, is_leaf=_is_sketched)
    if not keep_factors:
      return dense, state

    def factor(s: Sketched):
      if not s.plan.projected:
        return None
      return LowRankFactor(scale * s.value, plan=s.plan, config=s.config)

    return dense, UnprojectState(
        factors=jax.tree.map(factor, updates, is_leaf=_is_sketched)
    )

  return optax.GradientTransformation(init_fn, update_fn)


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

  Looks up the ``project`` and ``unproject(keep_factors=True)`` states inside
  a (possibly nested) optax state and pairs each leaf's projector with its
  coefficients, without any decomposition. Random projectors are regenerated
  from their seed.

  Args:
    opt_state: the state of a chain containing ``project`` and
      ``unproject(keep_factors=True)``, after at least one update.

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
        "factored_updates needs exactly one logra.project stage and one "
        "logra.unproject(keep_factors=True) stage in the optimizer state; "
        f"found {len(projects)} and {len(unprojects)}"
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
  window's regenerated from the seed. Before the first update: the stored
  zeros (or window 0's random projectors).

  Raises:
    ValueError: if the state has no, or more than one, ``project`` stage.
  """
  projects = find_states(opt_state, ProjectState)
  if len(projects) != 1:
    raise ValueError(
        "window_projectors needs exactly one logra.project "
        f"stage in the optimizer state; found {len(projects)}"
    )
  state = projects[0]
  config = state.spec.config
  if config.kind != "random":
    return state.projectors
  window = jnp.maximum(state.count - 1, 0) // config.refresh_every
  return state.spec.treedef.unflatten(
      [
          random_window_projector(plan, config, window)
          if plan.projected
          else None
          for plan in state.spec.plans
      ]
  )


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
