r"""Low-rank weight ops: a weight plus a low-rank term, applied without forming it.

:class:`LowRankDelta` is ``W + F Z`` (or ``W + Z F^T`` for a wide weight) with
``Z`` the coordinates that are differentiated. A model applies such a weight
with :func:`matmul` (``x W + (x F) Z``) and :func:`take` (``W[ids] + F[ids] Z``),
so neither the ``m x n`` sum nor its gradient is ever formed: the gradient
with respect to ``Z`` is ``(x F)^T dY``. The models call these ops on every
weight (a plain array passes straight through), the sketch-direct gradients of
:mod:`logra_jax.optim.sketch_grad` and the factored policy hand them
``LowRankDelta`` weights, and LoRA's adapters are one too.

This module imports only JAX and :mod:`logra_jax.reduction`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from logra_jax.reduction import blocked_dot

# Paths of the projected leaves that the loss multiplied with `matmul` while
# it was being traced by `value_and_sketch_grad` (None outside of it).
_CONSUMED: contextvars.ContextVar = contextvars.ContextVar(
    "logra_consumed_low_rank_deltas", default=None
)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["base", "factor", "coords", "base_scale"],
    meta_fields=["rows", "path", "at_zero"],
)
@dataclasses.dataclass(frozen=True, eq=False)
class LowRankDelta:
  r"""A weight plus a low-rank term in differentiable coordinates.

  ``rows=True``: :math:`W + F Z` with ``factor`` ``F`` (``[..., m, k]``) and
  ``coords`` ``Z`` (``[..., k, n]``); ``rows=False``: :math:`W + Z F^\top`
  with ``F`` ``[..., n, k]`` and ``Z`` ``[..., m, k]``. Leading (layer) axes
  are shared by all three arrays, so ``lax.scan`` over layers slices them
  together. Only ``coords`` is meant to be differentiated; ``base`` is used
  under ``stop_gradient``.

  ``base`` may itself be a ``LowRankDelta`` (a factored weight
  :math:`c B + P A` carrying its window's coordinates, see
  :func:`factored_view`, with a differentiable term on top), and
  ``base_scale`` (``[...]``, one per matrix, or None for 1) multiplies it:
  :math:`c\,W + F Z`.

  ``at_zero=True`` says that ``coords`` are zero, the point at which
  :func:`value_and_sketch_grad` differentiates: :func:`matmul` and
  :func:`take` then return the weight's product alone, without computing the
  low-rank term (its value is zero), and keep only the term's derivative.
  Besides saving the term's forward flops, this keeps products with a zero
  operand that is a broadcast constant out of the program: XLA:CPU (jaxlib
  0.10) compiles such a bfloat16 product, fused with the reduction that
  follows it (the log-softmax's max over the vocabulary), to all NaN.

  Models consume it through :func:`matmul`; any other use (``jnp`` functions,
  arithmetic) raises a ``TypeError`` naming the parameter.
  """

  base: Any
  factor: Any
  coords: Any
  rows: bool = dataclasses.field(kw_only=True)
  path: str = dataclasses.field(kw_only=True)
  at_zero: bool = dataclasses.field(default=False, kw_only=True)
  base_scale: Any = dataclasses.field(default=None, kw_only=True)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.base.shape

  @property
  def ndim(self) -> int:
    return self.base.ndim

  @property
  def dtype(self):
    return self.base.dtype

  @property
  def T(self) -> "LowRankDelta":
    r"""The transpose over the last two axes, still in coordinates ``Z``.

    :math:`(W + F Z)^\top = W^\top + Z^\top F^\top` and
    :math:`(W + Z F^\top)^\top = W^\top + F Z^\top`: the other form, with
    the same factor and transposed coordinates (e.g. a tied embedding table
    used as the unembedding).
    """
    swap = lambda a: jnp.swapaxes(a, -1, -2)
    base = (
        self.base.T if isinstance(self.base, LowRankDelta) else swap(self.base)
    )
    return dataclasses.replace(
        self, base=base, coords=swap(self.coords), rows=not self.rows
    )

  def with_base_dtype(self, dtype: Any) -> "LowRankDelta":
    """The same weight with its innermost base cast to ``dtype`` under
    ``stop_gradient``; the low-rank terms (a nested base's too: a factored
    weight ``c B + P A``, which :func:`matmul` applies as
    ``c (x B) + (x P) A`` without forming it) are unchanged."""
    if isinstance(self.base, LowRankDelta):
      base = self.base.with_base_dtype(dtype)
    else:
      base = jax.lax.stop_gradient(self.base).astype(dtype)
    return dataclasses.replace(self, base=base)

  def dense(self) -> jax.Array:
    """The weight it stands for, materialized in float32 (``[..., m, n]``)."""
    base = (
        jax.lax.stop_gradient(self.base).dense()  # as in `matmul` and `take`
        if isinstance(self.base, LowRankDelta)
        else self.base.astype(jnp.float32)
    )
    if self.base_scale is not None:
      base = self.base_scale[..., None, None] * base
    f = self.factor.astype(jnp.float32)
    z = self.coords.astype(jnp.float32)
    return base + (f @ z if self.rows else z @ jnp.swapaxes(f, -1, -2))

  def __getitem__(self, key):
    if key is Ellipsis:  # nnx.Variable[...] hands back its value
      return self
    raise TypeError(self._misuse("indexing"))

  def __jax_array__(self):
    raise TypeError(self._misuse("conversion to an array"))

  def _misuse(self, what: str) -> str:
    return (
        f"parameter {self.path!r} is a weight plus a low-rank term (a "
        "factored or LoRA weight, or one differentiated in sketch-direct "
        "mode) and only supports logra_jax.lowrank.matmul(x, w) and "
        f"take(w, ids), not {what}; apply it with those, or form it with "
        "its .dense()"
    )


def matmul(
    x: jax.Array,
    w: jax.Array | LowRankDelta,
    dtype: Any = None,
    preferred_element_type: Any = None,
    batch_invariant: bool = False,
) -> jax.Array:
  r"""``x @ w`` over the last axis of ``x``, for a weight or a :class:`LowRankDelta`.

  For an array ``w`` this is ``jnp.dot(x, w.astype(dtype))``. For a
  ``LowRankDelta`` (a 2-d slice ``[m, n]``, e.g. one layer under
  ``lax.scan``) it is

  .. math:: x\,\mathrm{sg}(W) + (x F) Z \quad\text{or}\quad
            x\,\mathrm{sg}(W) + (x Z) F^\top,

  whose gradient with respect to ``Z`` is ``F^T x^T dY`` (or ``x^T dY F``)
  without the ``m x n`` product ``x^T dY``.

  Args:
    x: ``[..., m]`` activations.
    w: ``[m, n]`` weight or ``LowRankDelta``.
    dtype: compute dtype the weight (and low-rank factors) are cast to;
      default: the weight's.
    preferred_element_type: accumulation and result dtype of the products
      with the weight (as in ``jnp.dot``), e.g. float32 logits from bfloat16
      operands.

  Returns:
    ``[..., n]``.

  Example:
    >>> import jax.numpy as jnp
    >>> matmul(jnp.ones((2, 3)), jnp.ones((3, 4))).shape
    (2, 4)
  """
  product = blocked_dot if batch_invariant else jnp.dot
  dot = lambda a, b, kind=preferred_element_type: product(
      a, b, preferred_element_type=kind
  )
  if not isinstance(w, LowRankDelta):
    return dot(x, w if dtype is None else w.astype(dtype))
  _consume(w, "matmul")
  dtype = w.dtype if dtype is None else dtype
  cast = lambda a: a.astype(dtype)
  base = jax.lax.stop_gradient(w.base)
  y = _scaled(
      w, matmul(x, base, dtype, preferred_element_type, batch_invariant)
  )
  if w.rows:
    term = lambda x, f, z: dot(dot(x, cast(f), None), cast(z))
  else:
    term = lambda x, f, z: dot(dot(x, cast(z), None), cast(f).T)
  return _plus_low_rank_term(w, term, y, x)


def take(
    w: jax.Array | LowRankDelta,
    ids: jax.Array,
    dtype: Any = None,
    batch_invariant: bool = False,
) -> jax.Array:
  r"""Rows ``w[ids]`` of an embedding table or a :class:`LowRankDelta`.

  For an array this is ``jnp.take(w, ids, axis=0)`` cast to ``dtype``. For a
  ``LowRankDelta`` ``[V, D]`` it gathers the rows of each term,

  .. math:: \mathrm{sg}(W)_{ids} + F_{ids} Z \quad\text{or}\quad
            \mathrm{sg}(W)_{ids} + Z_{ids} F^\top,

  so the gradient with respect to ``Z`` is ``F_{ids}^T dY`` (``[k, D]``) or
  a scatter of ``dY F`` into ``[V, k]``: never a ``[V, D]`` gradient.

  Args:
    w: ``[V, D]`` table or ``LowRankDelta``.
    ids: integer indices, any shape.
    dtype: dtype of the result; default: the table's.
    batch_invariant: the low-rank term's product as
      ``reduction.blocked_dot`` (as :func:`matmul`'s).

  Returns:
    ``[*ids.shape, D]``.

  Example:
    >>> import jax.numpy as jnp
    >>> take(jnp.eye(3), jnp.array([2, 0])).tolist()
    [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
  """
  dtype = w.dtype if dtype is None else dtype
  if not isinstance(w, LowRankDelta):
    return jnp.take(w, ids, axis=0).astype(dtype)
  _consume(w, "take")
  rows = lambda a, ids: jnp.take(a, ids, axis=0).astype(dtype)
  y = _scaled(w, take(jax.lax.stop_gradient(w.base), ids, dtype))
  dot = blocked_dot if batch_invariant else jnp.dot
  if w.rows:
    term = lambda ids, f, z: dot(rows(f, ids), z.astype(dtype))
  else:
    term = lambda ids, f, z: dot(rows(z, ids), f.astype(dtype).T)
  return _plus_low_rank_term(w, term, y, ids)


def _scaled(w: LowRankDelta, y: jax.Array) -> jax.Array:
  """``y`` times the base scale of ``w`` (a scalar: one matrix)."""
  return y if w.base_scale is None else y * w.base_scale.astype(y.dtype)


def _plus_low_rank_term(
    w: LowRankDelta, term: Callable, y: jax.Array, x: jax.Array
) -> jax.Array:
  """``y + term(x, w.factor, w.coords)``; at zero coordinates, ``y`` with the
  term's derivative."""
  if w.at_zero:
    return _plus_term_at_zero(term, y, x, w.factor, w.coords)
  return y + term(x, w.factor, w.coords)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _plus_term_at_zero(term, y, x, factor, coords):
  """``y + term(x, factor, coords)`` for ``coords == 0``: the value is ``y``
  (the term is not computed), the derivative the term's."""
  del term, x, factor, coords
  return y


@_plus_term_at_zero.defjvp
def _plus_term_at_zero_jvp(term, primals, tangents):
  y, x, factor, coords = primals
  dy, _, _, dcoords = tangents
  # The term is linear in the coordinates, which are zero: a change of x or of
  # the factor does not move it, only a change of the coordinates does.
  del coords
  return y, dy + term(x, factor, dcoords)


def _consume(w: LowRankDelta, fn: str) -> None:
  """Checks ``w`` is one matrix and records that the loss used it."""
  if w.ndim != 2:
    raise ValueError(
        f"{fn} takes one [in, out] matrix; parameter {w.path!r} has shape "
        f"{w.shape} (slice its layer axis first, e.g. with lax.scan)"
    )
  consumed = _CONSUMED.get()
  if consumed is not None:
    consumed.add(w.path)


@contextlib.contextmanager
def recording_uses() -> Iterator[set]:
  """Records the ``path`` of each :class:`LowRankDelta` that :func:`matmul` or
  :func:`take` applies while the block runs (at trace time), in the set it
  yields."""
  token = _CONSUMED.set(set())
  try:
    yield _CONSUMED.get()
  finally:
    _CONSUMED.reset(token)
