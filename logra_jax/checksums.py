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

from logra_jax.optim.factored import flat_index
from logra_jax.optim.factored import mix32


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


def _array_checksum(x: jax.Array) -> jax.Array:
  """The uint32 sum over the elements of ``x`` of a mix of their bits and
  flat positions; see :func:`array_checksums`. An array of 3 or more axes
  (a stack of layers, whose leading axis is never sharded) is summed one
  slice of its leading axis at a time, so that the program's temporaries
  are a slice's words, not the whole array's (XLA:CPU does not fuse the mix
  into the sum: 30.8 GB of temporaries for Qwen2.5-7B's float32 weights in
  one program). On CPU, XLA widens a bfloat16 stack to float32 before the
  loop (as it does for the planner's weights; ``memory.plan_memory``
  compiles without that motion), which an accelerator does not."""
  if x.ndim < 3 or x.shape[0] == 1:
    return _mixed_sum(_bits(x))
  per_slice = math.prod(x.shape[1:]) * (2 if x.dtype.itemsize == 8 else 1)

  def slice_sum(args):
    piece, i = args
    return _mixed_sum(_bits(piece), i * np.uint32(per_slice % 2**32))

  sums = jax.lax.map(slice_sum, (x, jnp.arange(x.shape[0], dtype=jnp.uint32)))
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
