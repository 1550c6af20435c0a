"""Which axes of a weight form the matrix that LoGRA projects.

A weight of any rank is viewed as a batch of matrices ``[B, m, n]``: the
``batch_axes`` enumerate independent matrices (a layer-stacked ``[L, m, n]``
weight gets ``L`` projectors), the ``reduction_axes`` form the rows ``m`` (the
layer's input dimension) and the ``output_axes`` the columns ``n``. The
projector lives on the longer of the two sides.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

Axes = Union[int, Sequence[int]]


class DimensionNumbers(NamedTuple):
  """Axes of a weight that form the projected matrix.

  Attributes:
    reduction_axes: axis or axes forming the rows (the input dimension).
    output_axes: axis or axes forming the columns (the output dimension).
    batch_axes: axes that index independent matrices (e.g. the layer axis of a
      layer-stacked weight); every axis of the weight must be in exactly one of
      the three groups.

  Example:
    >>> import logra_jax as logra
    >>> # A layer-stacked attention weight [layers, embed, heads * head_dim].
    >>> spec = logra.DimensionNumbers(
    ...     reduction_axes=1, output_axes=2, batch_axes=0)
  """

  reduction_axes: Axes = 0
  output_axes: Axes = 1
  batch_axes: Axes = ()


SpecTree = Union[DimensionNumbers, Any, Callable[[Any], Any]]


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """Static description of how one parameter leaf is optimized.

  A leaf with ``rank == 0`` is dense: it goes through the inner transform at
  full size. Otherwise the weight is viewed as ``[batch, m, n]`` and projected
  on its longer side with ``rank`` columns. A matrix smaller than the rank on
  both sides is ``kept_dense`` (``rank == 0``, its ``m x n`` recorded).
  """

  path: str
  index: int
  shape: tuple[int, ...]
  dtype: np.dtype
  perm: tuple[int, ...] = ()
  batch: int = 1
  m: int = 0
  n: int = 0
  rank: int = 0
  param_spec: tuple[Any, ...] = ()
  groups: tuple[int, int, int] = (0, 0, 0)
  kept_dense: bool = False

  @property
  def projected(self) -> bool:
    return self.rank > 0

  @property
  def left(self) -> bool:
    """Whether the projector acts on the rows (``m >= n``)."""
    return self.m >= self.n

  @property
  def long(self) -> int:
    return max(self.m, self.n)

  @property
  def short(self) -> int:
    return min(self.m, self.n)

  @property
  def sketch_shape(self) -> tuple[int, int, int]:
    """Shape of the low-rank coordinates ``[batch, rank, short]``."""
    return (self.batch, self.rank, self.short)

  @property
  def projector_shape(self) -> tuple[int, int, int]:
    """Shape of the projector ``[batch, long, rank]``."""
    return (self.batch, self.long, self.rank)

  @property
  def dense_spec(self) -> Optional[PartitionSpec]:
    """The parameter's layout under an explicitly sharded mesh, else None."""
    return PartitionSpec(*self.param_spec) if self.param_spec else None

  def _group_axes(self) -> list[list[Any]]:
    """Mesh axes of the transposed leaf's axes, by group (batch, rows,
    columns); a group of several axes is gathered (None) before the reshape
    to ``[batch, m, n]``, an axis alone keeps its split."""
    permuted = [self.param_spec[a] for a in self.perm]
    groups, start = [], 0
    for size in self.groups:
      groups.append(
          permuted[start : start + size] if size == 1 else [None] * size
      )
      start += size
    return groups

  @property
  def matrix_spec(self) -> Optional[PartitionSpec]:
    """Layout of the ``[batch, m, n]`` view; None without an explicit
    layout."""
    if not self.param_spec:
      return None
    return PartitionSpec(
        *(g[0] if len(g) == 1 else None for g in self._group_axes())
    )

  def _permuted_spec(self) -> Optional[PartitionSpec]:
    """Layout of the transposed leaf around the reshape to ``[batch, m, n]``."""
    if not self.param_spec:
      return None
    return PartitionSpec(*(a for group in self._group_axes() for a in group))

  @property
  def projector_spec(self) -> Optional[PartitionSpec]:
    """Layout of the ``[batch, long, rank]`` projector: the long axis split
    like the parameter's; None without an explicit layout."""
    if not self.param_spec:
      return None
    batch, m, n = self.matrix_spec
    return PartitionSpec(batch, m if self.left else n, None)

  @property
  def sketch_spec(self) -> Optional[PartitionSpec]:
    """Layout of the ``[batch, rank, short]`` coordinates (and moments): the
    short axis split like the parameter's; None without an explicit layout."""
    if not self.param_spec:
      return None
    batch, m, n = self.matrix_spec
    return PartitionSpec(batch, None, n if self.left else m)

  @property
  def small_spec(self) -> Optional[PartitionSpec]:
    """Layout of ``[batch, rank, rank]`` products such as ``P_new^T P_old``:
    split along the batch only; None without an explicit layout."""
    if not self.param_spec:
      return None
    return PartitionSpec(self.matrix_spec[0], None, None)

  def to_long_view(self, x: jax.Array) -> jax.Array:
    """Reshapes a leaf to ``[batch, long, short]`` (transposed if wide)."""
    x_BxMxN = self.to_matrix(x)
    return x_BxMxN if self.left else jnp.swapaxes(x_BxMxN, 1, 2)

  def sketch(self, p_BxLxR: jax.Array, x: jax.Array) -> jax.Array:
    """``P^T G`` (or ``P^T G^T`` for wide matrices) as ``[batch, rank, short]``.

    Contracts in the weight's own orientation, so no transpose of the full
    matrix is materialized.
    """
    g_BxMxN = self.to_matrix(x).astype(jnp.float32)
    if self.left:
      return jnp.einsum(
          "bmr,bmn->brn", p_BxLxR, g_BxMxN, out_sharding=self.sketch_spec
      )
    # G P with G as the left operand, then the small transpose: on XLA:CPU
    # 3.4x faster than contracting into [r, m] directly (768 x 3072, r = 64).
    spec = self.sketch_spec
    return jnp.swapaxes(
        jnp.einsum(
            "bmn,bnr->bmr",
            g_BxMxN,
            p_BxLxR,
            out_sharding=None
            if spec is None
            else PartitionSpec(spec[0], spec[2], spec[1]),
        ),
        1,
        2,
    )

  def expand(self, p_BxLxR: jax.Array, n_BxRxS: jax.Array) -> jax.Array:
    """``P N`` back in the leaf's shape (the inverse map of :meth:`sketch`)."""
    spec = self.matrix_spec
    if self.left:
      u_BxMxN = jnp.einsum("bmr,brn->bmn", p_BxLxR, n_BxRxS, out_sharding=spec)
    else:
      u_BxMxN = jnp.einsum("brm,bnr->bmn", n_BxRxS, p_BxLxR, out_sharding=spec)
    permuted_shape = tuple(self.shape[a] for a in self.perm)
    u = jax.lax.reshape(
        u_BxMxN, permuted_shape, out_sharding=self._permuted_spec()
    )
    u = jnp.transpose(u, np.argsort(self.perm))
    return u if spec is None else jax.sharding.reshard(u, self.dense_spec)

  def to_matrix(self, x: jax.Array) -> jax.Array:
    """Reshapes a leaf to ``[batch, m, n]`` without changing orientation."""
    x = jnp.transpose(x, self.perm)
    if not self.param_spec:
      return x.reshape(self.batch, self.m, self.n)
    x = jax.sharding.reshard(x, self._permuted_spec())
    return jax.lax.reshape(
        x,
        (self.batch, self.m, self.n),
        out_sharding=self.matrix_spec,
    )


def _as_axes(axes: Axes) -> tuple[int, ...]:
  if isinstance(axes, (int, np.integer)):
    return (int(axes),)
  return tuple(int(a) for a in axes)


def _is_spec_leaf(x) -> bool:
  return x is None or isinstance(x, DimensionNumbers)


def _spec_for_shape(
    path: str, shape: tuple[int, ...], spec: DimensionNumbers
) -> tuple[tuple[int, ...], ...]:
  """Normalizes ``spec`` against ``shape``; raises naming ``path`` if invalid."""
  ndim = len(shape)
  groups = []
  for name in ("reduction_axes", "output_axes", "batch_axes"):
    axes = _as_axes(getattr(spec, name))
    for a in axes:
      if not -ndim <= a < ndim:
        raise ValueError(
            f"dimension numbers for parameter {path!r} with shape {shape}: "
            f"{name} contains axis {a}, out of range for a {ndim}-d weight "
            f"(got {spec})"
        )
    groups.append(tuple(a % ndim for a in axes))
  reduction, output, batch = groups
  if not reduction or not output:
    raise ValueError(
        f"dimension numbers for parameter {path!r} with shape {shape}: "
        f"reduction_axes and output_axes must be non-empty (got {spec})"
    )
  flat = reduction + output + batch
  if len(set(flat)) != len(flat):
    raise ValueError(
        f"dimension numbers for parameter {path!r} with shape {shape}: "
        f"axes overlap (got {spec})"
    )
  if sorted(flat) != list(range(ndim)):
    missing = sorted(set(range(ndim)) - set(flat))
    raise ValueError(
        f"dimension numbers for parameter {path!r} with shape {shape}: "
        f"axes {missing} are in no group; every axis must be a reduction, "
        f"output or batch axis (got {spec})"
    )
  return reduction, output, batch


def resolve_specs(
    params: Any, dimension_numbers: SpecTree | None, mask: Any | None
) -> list[DimensionNumbers | None]:
  """Returns one ``DimensionNumbers`` (or None: dense) per leaf of ``params``.

  ``dimension_numbers`` is None (every 2-d leaf is a matrix, other leaves are
  dense), a single ``DimensionNumbers`` (applied to every leaf of rank >= 2),
  a pytree of ``DimensionNumbers``/None whose structure is a prefix of
  ``params`` (e.g. one entry per ``nnx.Param``), or a callable of ``params``
  returning such a pytree. ``mask`` (a pytree prefix of bools, or a callable)
  turns projection off where it is False.
  """
  leaves = jax.tree.leaves(params)
  if dimension_numbers is None:
    specs = [DimensionNumbers() if jnp.ndim(p) == 2 else None for p in leaves]
  elif isinstance(dimension_numbers, DimensionNumbers):
    specs = [dimension_numbers if jnp.ndim(p) >= 2 else None for p in leaves]
  else:
    tree = (
        dimension_numbers(params)
        if callable(dimension_numbers)
        else dimension_numbers
    )
    specs = _broadcast_prefix("dimension_numbers", tree, params, _is_spec_leaf)
  if mask is not None:
    mask_tree = mask(params) if callable(mask) else mask
    keep = _broadcast_prefix("mask", mask_tree, params, lambda x: x is None)
    specs = [s if k else None for s, k in zip(specs, keep)]
  return specs


def _broadcast_prefix(name: str, tree: Any, params: Any, is_leaf) -> list:
  """Repeats each leaf of ``tree`` over the params leaves below it."""
  tree_leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
  try:
    subtrees = treedef.flatten_up_to(params)
  except (ValueError, TypeError):
    params_paths = {
        jax.tree_util.keystr(k)
        for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    tree_paths = {
        jax.tree_util.keystr(k)
        for k, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[
            0
        ]
    }
    missing = sorted(
        p for p in params_paths if not any(p.startswith(t) for t in tree_paths)
    )
    extra = sorted(
        t for t in tree_paths if not any(p.startswith(t) for p in params_paths)
    )
    raise ValueError(
        f"{name} does not match the parameters: missing entries for "
        f"{missing[:5]}, entries for unknown parameters {extra[:5]}"
    ) from None
  return [
      leaf
      for leaf, sub in zip(tree_leaves, subtrees)
      for _ in jax.tree.leaves(sub)
  ]


def explicit_spec(x: Any) -> tuple[Any, ...]:
  """The mesh axes of each dimension of ``x`` when it is laid out on a mesh
  with explicit axes (``jax.sharding.AxisType.Explicit``, under
  ``jax.set_mesh``) and split on at least one of them; else ``()``.

  The optimizer lays out its state for such a parameter to match it; under
  automatic sharding XLA does that and nothing is recorded.
  """
  try:
    aval = jax.typeof(x)
  except TypeError:
    return ()
  sharding = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not any(
      t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())
  ):
    return ()
  spec = tuple(sharding.spec) + (None,) * (len(aval.shape) - len(sharding.spec))
  return spec if any(entry is not None for entry in spec) else ()


def plan_leaves(
    params: Any, rank: int, dimension_numbers: SpecTree | None, mask: Any | None
) -> Any:
  """Builds the static ``LeafPlan`` of every parameter leaf.

  A matrix whose two sides are both smaller than ``rank`` is kept dense (its
  plan has ``kept_dense=True``); otherwise the rank is clipped to the shorter
  side.

  Raises:
    ValueError: naming the parameter path, for dimension numbers that overlap,
      miss axes or do not fit the weight.
  """
  specs_flat = resolve_specs(params, dimension_numbers, mask)
  params_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
  plans = []
  for index, ((key, p), spec) in enumerate(zip(params_with_path, specs_flat)):
    path = jax.tree_util.keystr(key)
    shape, dtype = tuple(jnp.shape(p)), np.dtype(jnp.result_type(p))
    if spec is None:
      plans.append(
          LeafPlan(
              path=path,
              index=index,
              shape=shape,
              dtype=dtype,
              param_spec=explicit_spec(p),
          )
      )
      continue
    reduction, output, batch = _spec_for_shape(path, shape, spec)
    m = math.prod(shape[a] for a in reduction)
    n = math.prod(shape[a] for a in output)
    if rank > max(m, n):
      plans.append(
          LeafPlan(
              path=path,
              index=index,
              shape=shape,
              dtype=dtype,
              m=m,
              n=n,
              param_spec=explicit_spec(p),
              kept_dense=True,
          )
      )
      continue
    plans.append(
        LeafPlan(
            path=path,
            index=index,
            shape=shape,
            dtype=dtype,
            perm=batch + reduction + output,
            batch=math.prod(shape[a] for a in batch),
            m=m,
            n=n,
            rank=min(rank, m, n),
            param_spec=explicit_spec(p),
            groups=(len(batch), len(reduction), len(output)),
        )
    )
  return jax.tree.unflatten(treedef, plans)
