"""The data the LoGRA stages hand each other, and their states.

Between the stages the updates travel as a pytree whose leaves are
:class:`Sketched` nodes: the low-rank coordinates of each projected weight
(``[batch, rank, short]``) together with the projector that produced them and
the leaf's static plan, or the float32 gradient itself for dense leaves.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import optax

from logra_jax.optim.dimension_numbers import LeafPlan

MOMENT_POLICIES = ("transfer", "keep", "reset")


@dataclasses.dataclass(frozen=True)
class ProjectionConfig:
  """Static settings of a ``project`` stage, carried with its updates."""

  kind: str
  refresh_every: int
  power_iters: int
  oversample: int
  seed: int
  moment_policy: str


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["value", "projector", "basis_change", "refreshed"],
    meta_fields=["plan", "config"],
)
@dataclasses.dataclass(frozen=True, eq=False)
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

  value: Any
  projector: Any = None
  basis_change: Any = None
  refreshed: Any = None
  plan: LeafPlan = dataclasses.field(kw_only=True)
  config: ProjectionConfig = dataclasses.field(kw_only=True)

  def replace(self, **kwargs) -> "Sketched":
    """A copy with the given fields replaced."""
    return dataclasses.replace(self, **kwargs)


def is_sketched(x) -> bool:
  return isinstance(x, Sketched)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class PlanNode:
  """A :class:`LeafPlan` as a pytree node without children (no arrays)."""

  plan: LeafPlan


def _is_plan_node(x) -> bool:
  return isinstance(x, PlanNode)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["nodes"],
    meta_fields=["config"],
)
@dataclasses.dataclass(frozen=True)
class ProjectionSpec:
  """Static part of a ``project`` state: its settings and the leaf plans.

  Adds no arrays to the state; it lets code that holds only the optimizer
  state (:mod:`logra_jax.optim.sketch_grad`) know how every parameter is
  projected. ``nodes`` is a tree like the parameters of :class:`PlanNode`, so
  that the state's structure follows the parameters' (what
  ``optax.tree.map_params`` needs).

  Attributes:
    config: the stage's settings.
    nodes: per parameter leaf, its plan as a :class:`PlanNode`.
  """

  config: ProjectionConfig
  nodes: Any

  @property
  def treedef(self) -> Any:
    """The parameters' tree structure."""
    return jax.tree.structure(self.nodes, is_leaf=_is_plan_node)

  @property
  def plans(self) -> tuple[LeafPlan, ...]:
    """The plans of the parameter leaves, in their flattening order."""
    leaves = jax.tree.leaves(self.nodes, is_leaf=_is_plan_node)
    return tuple(node.plan for node in leaves)

  def plan_tree(self) -> Any:
    """The plans as a tree like the parameters."""
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

  Emitted by ``logra.scale_by_low_rank(factored=True)`` with ``decay=None``
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
