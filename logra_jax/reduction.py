r"""Sums whose order is fixed by the shapes of one row (batch invariance).

XLA chooses its matmul and reduction kernels by the whole operand's shape, so
a row's result may depend on how many rows share the call: a sampler decoding
16 rows and a learner scoring thousands then get other bits for the same
token. The sums here fix the order instead: a pairwise tree over slices of
at most :data:`BLOCK` elements, so a row's bits depend on its own shapes only,
on kernels that are row-invariant for a reduced length up to ``BLOCK``
(XLA:CPU with XNNPACK off: ``experiments/kernel_invariance.py``).
``DecoderConfig.batch_invariant`` computes the decoder with them.

Appending zeros to what is summed does not change the bits (``x + 0 = x``
for a finite ``x`` other than ``-0``; XLA:CPU flushes a subnormal it adds),
so a longer, masked key axis gives the same attention output.

This module is a leaf of the package: it imports only JAX.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Sequence

import jax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp

# The longest reduction one kernel call may do: XLA:CPU's matmul (XNNPACK off)
# splits a longer reduced axis into blocks whose boundaries depend on the
# number of rows, and keeps a reduction of up to 256 in one pass.
BLOCK = 256

# XLA:CPU multiplies a matrix of fewer columns than this (a rank-4 factor)
# with kernels whose bits depend on the number of rows; zero columns
# appended keep it the row-invariant matrix product (a single row likewise
# needs a zero row: `with_matrix_rows`; experiments/kernel_invariance.py).
MIN_COLUMNS = 16

# The XLA:CPU flags under which each row of a matmul of up to `BLOCK` reduced
# elements gets the same bits for any number of rows (XNNPACK and YNNPACK
# choose kernels by the row count), at XLA's default optimization level, 3
# (the sampler's matmuls give the learner's bits only there:
# `CPU_SAMPLER_OPTIONS`).
CPU_FLAGS = (
    "--xla_cpu_use_xnnpack=false",
    "--xla_cpu_experimental_ynn_fusion_type=",
    "--xla_backend_optimization_level=3",
)

# XLA:CPU's compile options for a batch-invariant sampler: its matmuls on the
# calling thread. A decode step's attention is thousands of tiny matmuls (one
# per row and kv head), each of which multi-threaded Eigen hands to its pool
# at a cost above the product's. On one thread XLA computes small ones with
# its own kernels, whose bits are Eigen's (the learner's, multi-threaded) at
# optimization level 3 and not at 0 (a smoke run's rollout log-probs then
# differed from the learner's by up to 1e-6: docs/rl.md).
CPU_SAMPLER_OPTIONS = {"xla_cpu_multi_thread_eigen": False}


def backend_started() -> bool:
  """Whether JAX has started a backend: it reads ``XLA_FLAGS`` no more."""
  try:
    return bool(jax._src.xla_bridge._backends)  # noqa: SLF001
  except AttributeError:
    return True


def use_invariant_kernels(setting: str = "policy.batch_invariant") -> None:
  """Sets :data:`CPU_FLAGS` in ``XLA_FLAGS`` before JAX starts its backend
  (a process's children inherit them), replacing other values of the same
  flags.

  Raises:
    ValueError: JAX has started without them, or its version (before
      0.10, which these flags and the measurements are of) may not know
      them: naming ``setting`` and what to do.
  """
  version = tuple(int(part) for part in jax.__version__.split(".")[:2])
  if version < (0, 10):
    raise ValueError(
        f"{setting} needs jax >= 0.10 (its XLA:CPU flags), found "
        f"{jax.__version__}"
    )
  items = os.environ.get("XLA_FLAGS", "").split()
  wanted = dict(flag.split("=", 1) for flag in CPU_FLAGS)
  held = dict(item.partition("=")[::2] for item in items)
  if all(_same(held.get(name), value) for name, value in wanted.items()):
    return
  if backend_started():
    raise ValueError(
        f"{setting} needs XLA:CPU's row-invariant kernels, chosen when JAX "
        f"starts, and JAX has started without them: set XLA_FLAGS="
        f"'{' '.join(CPU_FLAGS)}' before the first computation"
    )
  kept = [item for item in items if item.partition("=")[0] not in wanted]
  os.environ["XLA_FLAGS"] = " ".join(kept + list(CPU_FLAGS))


def _same(held: str | None, wanted: str) -> bool:
  """Whether a flag's value is the wanted one (booleans in any spelling)."""
  booleans = {"0": "false", "1": "true"}
  norm = lambda value: booleans.get(value.lower(), value.lower())
  return held is not None and norm(held) == norm(wanted)


def pairwise_sum(parts: Sequence[jax.Array]) -> jax.Array:
  r"""``((p_0 + p_1) + (p_2 + p_3)) + \dots``: neighbours added level by level.

  An odd last part moves up a level unchanged, as if a zero were added to
  it, so trailing parts that are zero never change the bits.

  Example:
    >>> float(pairwise_sum([jnp.float32(1), 2.0, 3.0]))
    6.0
  """
  parts = list(parts)
  if not parts:
    raise ValueError("pairwise_sum needs at least one part")
  while len(parts) > 1:
    pairs = zip(parts[0::2], parts[1::2])
    parts = [a + b for a, b in pairs] + parts[len(parts) // 2 * 2 :]
  return parts[0]


def tree_sum(x: jax.Array, axis: int = -1, keepdims: bool = False):
  r"""The sum over ``axis`` as a tree of halves: ``x`` padded with zeros to a
  power-of-two length ``n``, then ``x[:n/2] + x[n/2:]`` until one element.

  Elementwise adds only, so each row's order is fixed by its own length,
  and zeros appended to ``x`` do not change the bits. Nor does where the
  terms sit among zeros: slot ``i`` meets slot ``i + n/2``, so the tree sums
  classes of slots modulo ``n/2, n/4, ...``, which a shift only renames
  (and float addition commutes): a row's keys at another offset of a
  masked key axis give the same sum. Both hold for finite terms other than
  ``-0`` (``-0 + 0`` is ``+0``), and for a lone term not subnormal (XLA:CPU
  flushes one it adds to zero), as attention's ``exp`` terms are.

  Only the value needs the order: the derivative is ``jnp.sum``'s (whose
  gradient, a broadcast, is the tree's exactly, without a pad per level).

  Example:
    >>> tree_sum(jnp.arange(5.0)).item()
    10.0
  """
  return _tree_sum(x, axis, keepdims)


def _halves_first_sum(x: jax.Array, axis: int, keepdims: bool) -> jax.Array:
  """:func:`tree_sum`'s value."""
  x = jnp.moveaxis(x, axis, -1)
  n = x.shape[-1]
  padded = 1 << max(n - 1, 0).bit_length()
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - n)])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  x = jnp.moveaxis(x, -1, axis)
  return x if keepdims else jnp.squeeze(x, axis)


_tree_sum = jax.custom_jvp(_halves_first_sum, nondiff_argnums=(1, 2))


@_tree_sum.defjvp
def _tree_sum_jvp(axis, keepdims, primals, tangents):
  """The value in the tree's order, the tangent as ``jnp.sum``."""
  (x,), (x_dot,) = primals, tangents
  value = _halves_first_sum(x, axis, keepdims)
  return value, jnp.sum(x_dot, axis=axis, keepdims=keepdims)


def blocked_dot(
    a: jax.Array,
    b: jax.Array,
    preferred_element_type: Any = None,
    block: int = BLOCK,
) -> jax.Array:
  r"""``a @ b`` (``a``'s last axis against ``b``'s first) as
  :func:`pairwise_sum` of the products over ``block``-long slices:

  .. math:: a b = \sum_j a_{[:, jK:(j+1)K]}\, b_{[jK:(j+1)K]},\quad K = \text{block}.

  Only the value needs the fixed order: its derivatives are ``jnp.dot``'s,
  :math:`\dot a\, b + a\, \dot b` (so a gradient costs what the plain
  product's does, not a transpose per slice). A ``b`` of fewer than
  :data:`MIN_COLUMNS` columns gets zero columns, and a single row of ``a``
  a zero row, for the product (dropped from the result): XLA:CPU computes
  such products with kernels of other bits.

  Example:
    >>> a, b = jnp.ones((2, 600)), jnp.ones((600, 3))
    >>> blocked_dot(a, b).tolist()[0]
    [600.0, 600.0, 600.0]
  """
  return _blocked_dot(a, b, preferred_element_type, block)


def with_matrix_rows(
    product: Callable[..., jax.Array],
    x: jax.Array,
    row_axes: Sequence[int],
    *operands: Any,
) -> jax.Array:
  """``product(x, *operands)``, where ``x``'s ``row_axes`` are the rows of a
  matrix product: a single row (every row axis of length 1) gets a zero row
  appended along the last row axis, dropped from the result at that axis,
  so ``product`` must keep that axis where ``x`` has it (as ``jnp.dot``
  keeps a row axis and ``"bkgth,bksh->bkgts"`` keeps ``g`` and ``t``).
  XLA:CPU multiplies a single row with a matrix-vector kernel whose bits
  differ from the matrix product's (``experiments/kernel_invariance.py``).

  Example:
    >>> x, w = jnp.ones((1, 3)), jnp.ones((3, 2))
    >>> with_matrix_rows(jnp.dot, x, (0,), w).tolist()
    [[3.0, 3.0]]
  """
  if not row_axes:
    raise ValueError("with_matrix_rows needs at least one row axis")
  axes = [axis % x.ndim for axis in row_axes]
  if math.prod(x.shape[axis] for axis in axes) != 1:
    return product(x, *operands)
  padding = [(0, int(i == axes[-1])) for i in range(x.ndim)]
  out = product(jnp.pad(x, padding), *operands)
  return jax.lax.slice_in_dim(out, 0, 1, axis=axes[-1])


def _fixed_order_product(a, b, preferred_element_type, block):
  """:func:`blocked_dot`'s value: operands padded where XLA:CPU would
  pick another kernel, then the pairwise sum of the slices' products."""
  rows, columns = math.prod(a.shape[:-1]), b.shape[-1]
  if b.ndim != 2 or (rows > 1 and columns >= MIN_COLUMNS):
    return _pairwise_products(a, b, preferred_element_type, block)
  b = jnp.pad(b, ((0, 0), (0, max(MIN_COLUMNS - columns, 0))))
  product = lambda a_MxK: _pairwise_products(
      a_MxK, b, preferred_element_type, block
  )
  out = with_matrix_rows(product, a.reshape(rows, a.shape[-1]), (0,))
  return out[:, :columns].reshape(*a.shape[:-1], columns)


def _pairwise_products(a, b, preferred_element_type, block):
  """The pairwise sum of the products over ``block``-long slices."""
  return pairwise_sum(
      [
          jnp.dot(
              a[..., i : i + block],
              b[i : i + block],
              preferred_element_type=preferred_element_type,
          )
          for i in range(0, a.shape[-1], block)
      ]
  )


# Its rule computes the value with the slices' products in plain sight, so a
# rematerialization policy that saves dots (``dots_saveable``) still sees them.
_blocked_dot = jax.custom_jvp(_fixed_order_product, nondiff_argnums=(2, 3))


@functools.partial(_blocked_dot.defjvp, symbolic_zeros=True)
def _blocked_dot_jvp(preferred_element_type, block, primals, tangents):
  """The product rule with ``jnp.dot``; a zero tangent (a frozen weight's)
  adds no product (JAX calls the rule only when one is not zero)."""
  (a, b), (a_dot, b_dot) = primals, tangents
  dot = functools.partial(
      jnp.dot, preferred_element_type=preferred_element_type
  )
  value = _fixed_order_product(a, b, preferred_element_type, block)
  terms = [
      dot(x, y)
      for x, y, tangent in ((a_dot, b, a_dot), (a, b_dot, b_dot))
      if not isinstance(tangent, SymbolicZero)
  ]
  return value, sum(terms[1:], terms[0])
