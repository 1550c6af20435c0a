r"""The factored policy: a projected weight kept as :math:`W = c\,B + P A`.

Within a projector window every update of a projected weight is ``P N_t``
with ``P`` fixed, so the weight need not be materialized at every step. A
projected leaf is held as a :class:`FactoredWeight`: its base ``B`` (the
parameter's shape, in the base dtype), the window's coordinates ``A``
(``[batch, rank, short]``, the sum of its step factors, float32 or, with
``coords_dtype="bfloat16"``, stochastically rounded to bfloat16 after every
step) and, with weight decay, one scale ``c`` per matrix. A step
:math:`D_t = a_t W + P \Delta_t` (a :class:`FactoredDelta`: ``a_t`` is the
step's decoupled weight decay, zero without it) is applied as

.. math::
  A \leftarrow (1 + a_t) A + \Delta_t, \qquad c \leftarrow (1 + a_t)\, c,

which is exactly :math:`W \leftarrow W + D_t`, with ``rank * short`` numbers
touched per matrix instead of ``m * n``. At a refresh, before the new
projector, the window is merged (:func:`merge`):
:math:`B \leftarrow \mathrm{round}(c B + P A)`, ``A <- 0``, ``c <- 1``. With a
bfloat16 base the rounding is stochastic (:func:`stochastic_round`), from
random bits that are a pure function of (seed, step, leaf path, matrix), so
every process that holds ``B``, ``P`` and ``A`` computes the same bits, and no
float32 copy of the weight exists anywhere.

The leaves are ordinary pytrees: checkpoints save ``B``, ``A`` and ``c``;
the projectors stay in the optimizer's ``project`` state (or are regenerated
from the seed for ``kind="random"``).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from logra_jax.optim import projection
from logra_jax.optim import state_queries
from logra_jax.optim.dimension_numbers import LeafPlan
from logra_jax.optim.types import FactoredDelta
from logra_jax.optim.types import ProjectState
from logra_jax.random_bits import stochastic_round

BASE_DTYPES = ("float32", "bfloat16")
COORDS_DTYPES = ("float32", "bfloat16")

_HIGHEST = jax.lax.Precision.HIGHEST
# A merge works on blocks of rows of at most this many float32 bytes (its
# low-rank term, merged values and random bits), so that merging a
# vocabulary-sized table does not hold table-sized float32 temporaries.
MERGE_BLOCK_BYTES = 64 * 2**20


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["base", "coords", "scale"],
    meta_fields=["plan"],
)
@dataclasses.dataclass(frozen=True)
class FactoredWeight:
  r"""One projected weight held as :math:`W = c\,B + P A`.

  Attributes:
    base: ``B``, the parameter's shape in the base dtype; None in the
      trainable part (:func:`without_base`).
    coords: ``A``, ``[batch, rank, short]`` in :data:`COORDS_DTYPES`: the
      sum of this window's step factors in the basis of its projector
      ``P``.
    scale: ``c``, ``[batch]`` float32, one per matrix (the window's product
      of weight-decay factors); None when the optimizer has no weight decay
      (then ``c = 1``).
    plan: the leaf's static plan (shape, orientation, rank).
  """

  base: Any
  coords: Any
  scale: Any
  plan: LeafPlan

  @property
  def shape(self) -> tuple[int, ...]:
    return self.plan.shape


def is_factored(x) -> bool:
  """Whether ``x`` is a :class:`FactoredWeight`."""
  return isinstance(x, FactoredWeight)


def _project_state(opt_state) -> ProjectState:
  found = state_queries.find_states(opt_state, ProjectState)
  if len(found) != 1:
    raise ValueError(
        "a factored policy needs an optimizer state with exactly "
        f"one logra.scale_by_low_rank stage; found {len(found)}"
    )
  return found[0]


def factor(
    params: Any,
    opt_state: optax.OptState,
    base_dtype: str = "float32",
    decay: bool = False,
    coords_dtype: str = "float32",
) -> Any:
  """The factored form of ``params``: each projected leaf as
  :class:`FactoredWeight` ``(B = param in base_dtype, A = 0, c = 1)``.

  Args:
    params: the parameters the optimizer state was initialized with.
    opt_state: an optimizer state with one ``scale_by_low_rank`` stage (its
      plans say which leaves are projected and at which rank).
    base_dtype: ``"float32"`` or ``"bfloat16"`` (:data:`BASE_DTYPES`).
    decay: keep a per-matrix scale ``c`` (needed when the optimizer has
      weight decay).
    coords_dtype: dtype of the coordinates ``A`` (:data:`COORDS_DTYPES`):
      with ``"bfloat16"`` every step's new ``A`` is stochastically rounded
      (:func:`apply_updates`), so that a sync message carries half the
      bytes and the learner holds exactly what it sends.

  Returns:
    A tree like ``params`` with :class:`FactoredWeight` at projected leaves.

  Raises:
    ValueError: for another base or coordinates dtype, params that do not
      match the state, or a projected leaf not laid out ``[*layers, in,
      out]`` (naming it).

  Example:
    >>> import jax.numpy as jnp, logra_jax as logra
    >>> params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
    >>> tx = logra.logra(1e-2, rank=2, factored=True)
    >>> weights = factor(params, tx.init(params), "bfloat16")
    >>> weights["w"].base.dtype, weights["w"].coords.shape
    (dtype(bfloat16), (1, 2, 8))
  """
  if base_dtype not in BASE_DTYPES:
    raise ValueError(
        f"base_dtype must be one of {BASE_DTYPES}, got " f"{base_dtype!r}"
    )
  if coords_dtype not in COORDS_DTYPES:
    raise ValueError(
        f"coords_dtype must be one of {COORDS_DTYPES}, got {coords_dtype!r}"
    )
  spec = _project_state(opt_state).spec
  flat = projection.flatten_like(spec, params, "params")
  leaves = []
  for plan, p in zip(spec.plans, flat):
    if tuple(jnp.shape(p)) != plan.shape:
      raise ValueError(
          f"parameter {plan.path!r} has shape {tuple(jnp.shape(p))}, but the "
          f"optimizer state was initialized for shape {plan.shape}"
      )
    if not plan.projected:
      leaves.append(p)
      continue
    check_layers_in_out(plan, "a factored policy")
    leaves.append(
        FactoredWeight(
            base=jnp.asarray(p).astype(base_dtype),
            coords=jnp.zeros(plan.sketch_shape, coords_dtype),
            scale=jnp.ones((plan.batch,), jnp.float32) if decay else None,
            plan=plan,
        )
    )
  return spec.treedef.unflatten(leaves)


def check_layers_in_out(plan: LeafPlan, what: str) -> None:
  """Raises unless a projected leaf is laid out ``[*layers, in, out]``."""
  ndim = len(plan.shape)
  if plan.perm != tuple(range(ndim)) or plan.shape[-2:] != (plan.m, plan.n):
    raise ValueError(
        f"{what} needs projected parameter {plan.path!r} laid out as "
        f"[*layers, in, out] with one input and one output axis; its "
        f"dimension numbers give shape {plan.shape} -> {plan.batch} x "
        f"{plan.m} x {plan.n}; use dense gradients for it"
    )


def without_base(params: Any) -> Any:
  """``params`` with every :class:`FactoredWeight`'s base dropped (None):
  the part a step changes."""
  return jax.tree.map(
      lambda p: dataclasses.replace(p, base=None) if is_factored(p) else p,
      params,
      is_leaf=is_factored,
  )


def with_base(trainable: Any, params: Any) -> Any:
  """``trainable`` (from :func:`without_base`) with the bases of ``params``
  put back."""
  return jax.tree.map(
      lambda t, p: dataclasses.replace(t, base=p.base) if is_factored(t) else t,
      trainable,
      params,
      is_leaf=is_factored,
  )


def apply_updates(
    params: Any,
    updates: Any,
    *,
    seed: Optional[int] = None,
    step: Optional[jax.Array] = None,
) -> Any:
  r"""``optax.apply_updates`` for factored params.

  At a :class:`FactoredWeight` the update must be a :class:`FactoredDelta`
  ``(Delta, a)``: :math:`A \leftarrow (1 + a) A + \Delta`,
  :math:`c \leftarrow (1 + a) c`; the base is not touched (it may be None,
  see :func:`without_base`). Other leaves: ``p + u`` in ``p``'s dtype.
  Bfloat16 coordinates are computed in float32 and rounded stochastically,
  :math:`A \leftarrow \mathrm{round}((1 + a) A + \Delta)`, with
  :func:`coords_key` ``(seed, step, path)``: unbiased, and a pure function
  of the run, so a receiver of the rounded ``A`` holds the learner's bits.

  Args:
    params: factored params (or their trainable part).
    updates: the optimizer's updates, a tree like ``params``.
    seed: the run's seed (needed with bfloat16 coordinates).
    step: the step being applied, traced int (needed with bfloat16
      coordinates).

  Raises:
    TypeError: naming the leaf, for a dense update of a factored weight or
      a decayed update of a weight kept without a scale.
    ValueError: bfloat16 coordinates without ``seed`` and ``step``.

  Example:
    >>> import jax.numpy as jnp, logra_jax as logra
    >>> params = {"w": jnp.ones((16, 8))}
    >>> tx = logra.logra(1e-2, rank=2, factored=True)
    >>> state = tx.init(params)
    >>> weights = factor(params, state, coords_dtype="bfloat16")
    >>> updates, state = tx.update({"w": jnp.ones((16, 8))}, state, weights)
    >>> new = apply_updates(weights, updates, seed=0, step=0)
    >>> new["w"].coords.dtype
    dtype(bfloat16)
  """

  def leaf(p, u):
    if not is_factored(p):
      return (
          None if p is None else (jnp.asarray(p) + u).astype(jnp.result_type(p))
      )
    if not isinstance(u, FactoredDelta):
      raise TypeError(
          f"factored parameter {p.plan.path!r} needs a "
          f"FactoredDelta update, got {type(u).__name__}"
      )
    if u.decay is None:
      return dataclasses.replace(p, coords=_rounded(p, _f32(p) + u.coords))
    if p.scale is None:
      raise TypeError(
          f"factored parameter {p.plan.path!r} was made without a scale "
          "(factor(..., decay=False)) but the update decays it"
      )
    keep = 1.0 + u.decay
    return dataclasses.replace(
        p,
        coords=_rounded(p, keep * _f32(p) + u.coords),
        scale=keep * p.scale,
    )

  def _f32(p):
    return p.coords.astype(jnp.float32)

  def _rounded(p, coords):
    if p.coords.dtype == jnp.float32:
      return coords
    if seed is None or step is None:
      raise ValueError(
          f"factored parameter {p.plan.path!r} keeps {p.coords.dtype} "
          "coordinates: apply_updates needs the run's seed and the step to "
          "round them"
      )
    return stochastic_round(
        coords, p.coords.dtype, coords_key(seed, step, p.plan.path)
    )

  return jax.tree.map(leaf, params, updates, is_leaf=is_factored)


def _low_rank_term(
    plan: LeafPlan, p_LxR: jax.Array, a_RxS: jax.Array
) -> jax.Array:
  """``P A`` of one matrix as ``[m, n]`` float32 (transposed when wide)."""
  term = jnp.dot(p_LxR, a_RxS.astype(jnp.float32), precision=_HIGHEST)
  return term if plan.left else term.T


def rounding_key(seed: int, step: jax.Array, path: str) -> jax.Array:
  """The key of a leaf's merge at ``step``: a pure function of the run seed,
  the step and the leaf's path (threefry, the same on every backend)."""
  key = jax.random.key(seed, impl="threefry2x32")
  key = jax.random.fold_in(key, step)
  return jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)


def coords_key(seed: int, step: jax.Array, path: str) -> jax.Array:
  """The key of a leaf's coordinates rounded at ``step`` (bfloat16
  coordinates, :func:`apply_updates`), apart from its merge's
  :func:`rounding_key`."""
  return rounding_key(seed, step, path + "#coords")


def merge_rows(m: int, n: int) -> int:
  """Rows of an ``[m, n]`` matrix merged at a time: all ``m`` when its
  float32 copy fits in :data:`MERGE_BLOCK_BYTES`, else the largest divisor of
  ``m`` that does (each row in exactly one block).

  Example:
    >>> merge_rows(8, 4), merge_rows(152064, 3584)
    (8, 4608)
  """
  most = max(MERGE_BLOCK_BYTES // (4 * n), 1)
  return m if m <= most else next(d for d in range(most, 0, -1) if m % d == 0)


def _low_rank_rows(
    plan: LeafPlan, p_LxR: jax.Array, a_RxS: jax.Array, j: Any, blocks: int
) -> jax.Array:
  """Rows ``j::blocks`` of :func:`_low_rank_term`."""
  a_RxS = a_RxS.astype(jnp.float32)
  if blocks == 1:
    return _low_rank_term(plan, p_LxR, a_RxS)
  rows = plan.m // blocks
  if plan.left:
    p_rows = p_LxR.reshape(rows, blocks, -1)
    p_rows = jax.lax.dynamic_index_in_dim(p_rows, j, axis=1, keepdims=False)
    return jnp.dot(p_rows, a_RxS, precision=_HIGHEST)
  a_cols = a_RxS.reshape(a_RxS.shape[0], rows, blocks)
  a_cols = jax.lax.dynamic_index_in_dim(a_cols, j, axis=2, keepdims=False)
  return jnp.dot(p_LxR, a_cols, precision=_HIGHEST).T


def _merge_leaf(
    w: FactoredWeight,
    p_BxLxR: jax.Array,
    seed: int,
    step: jax.Array,
    when: jax.typing.ArrayLike,
) -> FactoredWeight:
  """One leaf's window merged in place, one matrix at a time and, within
  it, one block of :func:`merge_rows` rows at a time. Block ``j`` holds
  rows ``j, j + k, j + 2k, ...`` (``k`` blocks): a weight sharded over its
  rows keeps every block sharded the same way, so each device merges its
  own rows (a contiguous block of a sharded matrix would be gathered).
  When ``when`` is false the loop over matrices runs zero times: the base
  is the loop's carry either way, so no branch holds a second copy of it."""
  plan = w.plan
  dtype = jnp.result_type(w.base)
  key = rounding_key(seed, step, plan.path)
  rows = merge_rows(plan.m, plan.n)
  blocks = plan.m // rows

  # Row r * blocks + j of a matrix is b[r, j] of its [rows, blocks, n] view:
  # a split of the rows stays on `rows` and one of the columns on `n` (a
  # carry that merged `blocks` and `n` into one axis gathered a base split
  # over its columns on every device). Each matrix is merged in a loop of
  # its own and written back whole: a carry of the whole [batch, rows,
  # blocks, n] stack was copied by XLA:CPU.
  def one(i, b_BxMxN):
    scale = 1.0 if w.scale is None else w.scale[i]

    def block(j, b_RxKxN):
      merged = scale * b_RxKxN[:, j].astype(jnp.float32) + _low_rank_rows(
          plan, p_BxLxR[i], w.coords[i], j, blocks
      )
      offset = jnp.asarray(j, jnp.uint32) * np.uint32(plan.n)
      rounded = stochastic_round(
          merged,
          dtype,
          jax.random.fold_in(key, i),
          offset,
          strides=(blocks * plan.n, 1),
      )
      return jax.lax.dynamic_update_index_in_dim(
          b_RxKxN, rounded.astype(dtype), j, axis=1
      )

    b_RxKxN = b_BxMxN[i].reshape(rows, blocks, plan.n)
    b_RxKxN = jax.lax.fori_loop(0, blocks, block, b_RxKxN)
    return jax.lax.dynamic_update_index_in_dim(
        b_BxMxN, b_RxKxN.reshape(plan.m, plan.n), i, axis=0
    )

  # A Python bool keeps a static trip count (reverse-differentiable).
  matrices = (
      (plan.batch if when else 0)
      if isinstance(when, bool)
      else jnp.where(when, plan.batch, 0)
  )
  b_BxMxN = jax.lax.fori_loop(
      0, matrices, one, w.base.reshape(plan.batch, plan.m, plan.n)
  )
  return FactoredWeight(
      base=b_BxMxN.reshape(plan.shape),
      coords=jnp.where(when, jnp.zeros_like(w.coords), w.coords),
      scale=None if w.scale is None else jnp.where(when, 1, w.scale),
      plan=plan,
  )


def merge(
    params: Any,
    projectors: Any,
    *,
    seed: int,
    step: jax.Array,
    when: jax.typing.ArrayLike = True,
) -> Any:
  r"""Every factored weight's window merged into its base.

  :math:`B \leftarrow \mathrm{round}(c B + P A)`, ``A <- 0``, ``c <- 1``,
  matrix by matrix (a ``[m, n]`` float32 temporary at a time). Rounding to a
  float32 base is to nearest; to a bfloat16 base it is
  :func:`stochastic_round` with :func:`rounding_key` ``(seed, step, path)``
  folded with the matrix index.

  Args:
    params: factored params.
    projectors: a tree like the params with each projected leaf's
      ``[batch, long, rank]`` projector (``state_queries.window_projectors``).
    seed: the run's seed.
    step: the step the merge belongs to (traced int).
    when: whether to merge (a traced boolean may decide it): false leaves
      ``params`` as they are, by loops that run zero times over the same
      buffers, so a program that merges only sometimes holds no second copy
      of the bases (under ``lax.cond`` XLA:GPU copied every base stack the
      branch writes: docs/planner.md, "The whole system on one device"). A
      traced ``when`` makes the loops' bounds dynamic, which reverse-mode
      differentiation does not support; a Python bool keeps them static.

  Returns:
    ``params`` with every :class:`FactoredWeight` merged if ``when`` holds,
    else ``params`` unchanged.
  """
  flat, treedef = jax.tree.flatten(params, is_leaf=is_factored)
  flat_p = treedef.flatten_up_to(projectors)
  return treedef.unflatten(
      [
          _merge_leaf(w, p, seed, step, when) if is_factored(w) else w
          for w, p in zip(flat, flat_p)
      ]
  )


def merge_at_refresh(
    params: Any, opt_state: optax.OptState, *, seed: int
) -> Any:
  """``params`` merged (:func:`merge`) when the optimizer's next update
  refreshes its projectors, unchanged otherwise (``merge``'s ``when``: in
  place either way); the step is the ``project`` stage's count."""
  state = _project_state(opt_state)
  due = state.count % state.spec.config.refresh_every == 0
  projectors = state_queries.window_projectors(opt_state)
  return merge(params, projectors, seed=seed, step=state.count, when=due)


def effective_weights(
    params: Any, projectors: Any, dtype: Optional[Any] = None
) -> Any:
  r"""The dense weights :math:`W = c B + P A` of factored params.

  Args:
    params: factored params (other leaves are returned as they are).
    projectors: as for :func:`merge`.
    dtype: dtype of the materialized weights; default each parameter's own
      (the plan's dtype).

  Returns:
    A tree like the original params, every leaf an array.
  """

  def dense(w, p_BxLxR):
    if not is_factored(w):
      return w
    plan = w.plan
    b_BxMxN = w.base.reshape(plan.batch, plan.m, plan.n).astype(jnp.float32)
    if w.scale is not None:
      b_BxMxN = w.scale[:, None, None] * b_BxMxN
    term = jax.vmap(functools.partial(_low_rank_term, plan))(p_BxLxR, w.coords)
    out = (b_BxMxN + term).reshape(plan.shape)
    return out.astype(plan.dtype if dtype is None else dtype)

  flat, treedef = jax.tree.flatten(params, is_leaf=is_factored)
  flat_p = treedef.flatten_up_to(projectors)
  return treedef.unflatten([dense(w, p) for w, p in zip(flat, flat_p)])


def add_decayed_weights(weight_decay: float) -> optax.GradientTransformation:
  r"""``optax.add_decayed_weights`` that also decays factored updates.

  Dense leaves: ``u + weight_decay * p``. A :class:`FactoredDelta` gets
  ``decay += weight_decay`` (the step :math:`a W` without touching ``W``),
  so the decayed update stays factored and exact.

  Example:
    >>> import jax.numpy as jnp
    >>> tx = add_decayed_weights(0.1)
    >>> updates, _ = tx.update({"b": jnp.ones(2)}, tx.init(None),
    ...                        {"b": jnp.full(2, 10.0)})
    >>> updates["b"].tolist()
    [2.0, 2.0]
  """

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(optax.NO_PARAMS_MSG)

    def leaf(u, p):
      if isinstance(u, FactoredDelta):
        decay = jnp.asarray(weight_decay, jnp.float32)
        return dataclasses.replace(
            u, decay=decay if u.decay is None else u.decay + decay
        )
      return None if u is None else u + weight_decay * p

    is_delta = lambda x: isinstance(x, FactoredDelta) or x is None
    return jax.tree.map(leaf, updates, params, is_leaf=is_delta), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


def update_norm(updates: Any, params: Any, projectors: Any) -> jax.Array:
  r"""The Frobenius norm of the step in weight space.

  For a :class:`FactoredDelta` at a :class:`FactoredWeight`,
  :math:`\|a W + P\Delta\|^2 = a^2\|W\|^2 + 2a\langle P^\top W, \Delta\rangle
  + \|\Delta\|^2` (``P`` has orthonormal columns), with
  :math:`P^\top W = c P^\top B + A`; the terms with ``W`` are only computed
  when the step decays.
  """
  flat_u, treedef = jax.tree.flatten(
      updates, is_leaf=lambda x: isinstance(x, FactoredDelta)
  )
  flat_w = treedef.flatten_up_to(params)
  flat_p = treedef.flatten_up_to(projectors)
  total = jnp.zeros([], jnp.float32)
  for u, w, p_BxLxR in zip(flat_u, flat_w, flat_p):
    if not isinstance(u, FactoredDelta):
      total += jnp.sum(jnp.square(jnp.asarray(u, jnp.float32)))
      continue
    total += jnp.sum(jnp.square(u.coords))
    if u.decay is None:
      continue
    plan = w.plan
    b_BxMxN = w.base.reshape(plan.batch, plan.m, plan.n)
    pt_b = (
        jnp.einsum(
            "bmr,bmn->brn", p_BxLxR, b_BxMxN, preferred_element_type=jnp.float32
        )
        if plan.left
        else jnp.einsum(
            "bmn,bnr->brm", b_BxMxN, p_BxLxR, preferred_element_type=jnp.float32
        )
    )
    scale = 1.0 if w.scale is None else w.scale[:, None, None]
    a_BxRxS = w.coords.astype(jnp.float32)
    pt_w = scale * pt_b + a_BxRxS
    # ||W||^2 = ||c B||^2 + 2 <c P^T B, A> + ||A||^2.
    b_sq = jnp.sum(jnp.square(b_BxMxN.astype(jnp.float32)), axis=(1, 2))
    c_sq = 1.0 if w.scale is None else jnp.square(w.scale)
    w_sq = (
        jnp.sum(c_sq * b_sq)
        + 2 * jnp.sum(scale * pt_b * a_BxRxS)
        + jnp.sum(jnp.square(a_BxRxS))
    )
    total += jnp.square(u.decay) * w_sq + 2 * u.decay * jnp.sum(pt_w * u.coords)
  return jnp.sqrt(jnp.maximum(total, 0.0))
