"""Content checksums of arrays, computed where the arrays are.

Checkpoints record one per array and check it on restore; policy-sync
messages carry one per leaf and the receiver checks its weights against them.
"""

from __future__ import annotations

from typing import Any

import math

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.random_bits import flat_index
from logra_jax.random_bits import mix32


def array_name(path: tuple) -> str:
  """Orbax's name of the array at a pytree key path (``"mu.embed.value"``)."""
  parts = []
  for key in path:
    for field in ("key", "name", "idx"):
      if hasattr(key, field):
        parts.append(str(getattr(key, field)))
        break
    else:
      parts.append(str(key))
  return ".".join(parts)


def _bits(x: jax.Array) -> jax.Array:
  """``x``'s bits as unsigned integers of its width (a bitcast; 64-bit
  types as a trailing axis of two uint32 words)."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  bits = min(8 * x.dtype.itemsize, 32)
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}"))


def _mixed_sum(bits: jax.Array, offset: jax.Array | int = 0) -> jax.Array:
  """The uint32 sum of the mixed words of ``bits``, their flat positions
  counted from ``offset``."""
  words = bits.astype(jnp.uint32)
  # An odd factor: distinct positions get distinct keys.
  keys = (flat_index(words.shape) + jnp.uint32(offset)) * np.uint32(0x9E3779B9)
  return jnp.sum(mix32(words ^ keys), dtype=jnp.uint32)


# Words mixed and summed at once: XLA:CPU does not fuse the mix into the sum,
# so a program's temporaries are a few arrays of this many uint32 words
# (4 MiB each) whatever the size of the arrays checked.
CHUNK_WORDS = 1 << 20


def _array_checksum(x: jax.Array) -> jax.Array:
  """The uint32 sum over the elements of ``x`` of a mix of their bits and
  flat positions; see :func:`array_checksums`.

  An array of more than :data:`CHUNK_WORDS` words is summed in blocks of at
  most that many (one ``lax.map`` of ``dynamic_slice``): blocks of
  ``rows`` indices of the first axis ``k`` whose trailing axes fit in a
  block, at every index of the axes before it (a stack of layers, whose
  leading axis is never sharded). The temporaries are a block's words, not
  the array's or a layer's (the figures at Qwen2.5-7B and 27B shapes:
  ``experiments/results/sync_bytes/sync_bytes.md``). On CPU, XLA widens a
  bfloat16 stack to float32 before the loop (as it does for the planner's
  weights; ``memory.plan_memory`` compiles without that motion), which an
  accelerator does not."""
  words = 2 if x.dtype.itemsize == 8 else 1
  if x.ndim == 0 or x.size * words <= CHUNK_WORDS:
    return _mixed_sum(_bits(x))
  # strides[a]: words per index of axis a.
  strides = [math.prod(x.shape[a + 1 :]) * words for a in range(x.ndim)]
  k = next(a for a in range(x.ndim) if strides[a] <= CHUNK_WORDS)
  rows = min(CHUNK_WORDS // strides[k], x.shape[k])
  blocks, rest = divmod(x.shape[k], rows)
  outer = math.prod(x.shape[:k])
  total = _blocks_sum(x, k, rows, strides, outer * blocks, blocks, 0)
  if rest:
    total += _blocks_sum(x, k, rest, strides, outer, 1, blocks * rows)
  return total


def _blocks_sum(x, k, rows, strides, count, per_outer, first_row):
  """The mixed sum of ``count`` blocks of ``x``: ``rows`` indices of axis
  ``k`` from ``first_row`` + ``rows * (i % per_outer)``, at the index
  ``i // per_outer`` (row-major) of the axes before ``k``."""

  def one(i):
    index, block = i // per_outer, i % per_outer
    starts = []
    for a in reversed(range(k)):
      starts.insert(0, index % x.shape[a])
      index = index // x.shape[a]
    starts.append(first_row + block * rows)
    offset = sum(
        start.astype(jnp.uint32) * np.uint32(strides[a] % 2**32)
        for a, start in enumerate(starts)
    )
    sizes = [1] * k + [rows] + list(x.shape[k + 1 :])
    piece = jax.lax.dynamic_slice(x, starts + [0] * (x.ndim - k - 1), sizes)
    return _mixed_sum(_bits(piece), offset)

  sums = jax.lax.map(one, jnp.arange(count, dtype=jnp.int32))
  return jnp.sum(sums, dtype=jnp.uint32)


@jax.jit
def leaf_checksums(leaves: list[jax.Array]) -> list[jax.Array]:
  """The checksums of :func:`array_checksums` of a list of arrays, as uint32
  scalars, computed where the arrays are (one jitted call)."""
  return [_array_checksum(x) for x in leaves]


def array_checksums(tree: Any) -> dict[str, str]:
  """A 32-bit content checksum of each array of ``tree``, by its Orbax name.

  Per element, its bits (as uint32 words) are XORed with a key made from
  its flat position and mixed (MurmurHash3's finalizer); the checksum is
  the sum of these over the elements, mod 2**32. For a given position the
  mix is a bijection, so a change of any one element always changes the
  checksum; several changes (or moved elements) go unseen with probability
  about 2**-32, as with a CRC-32. The sum does not depend on the order of
  the reduction, so the checksum is computed where the arrays are, in one
  jitted call (no copy to the host; on a mesh each device reduces its own
  shards), and is the same for any layout, mesh or number of processes.

  Args:
    tree: a pytree of ``jax.Array`` (or arrays ``jnp.asarray`` takes).

  Returns:
    ``{name: 8 hex digits}``.

  Example:
    >>> sums = array_checksums({"w": jnp.arange(3.0), "b": jnp.zeros(2)})
    >>> sorted(sums), len(sums["w"])
    (['b', 'w'], 8)
    >>> sums == array_checksums({"w": jnp.arange(3.0), "b": jnp.zeros(2)})
    True
    >>> sums["w"] == array_checksums({"w": jnp.arange(3.0) + 1e-7})["w"]
    False
  """
  named = jax.tree_util.tree_flatten_with_path(tree)[0]
  values = jax.device_get(leaf_checksums([x for _, x in named]))
  return {
      array_name(path): f"{int(value):08x}"
      for (path, _), value in zip(named, values)
  }
