"""Leaf: counter-based random bits and stochastic rounding, elementwise.

Each element's bits are a keyed hash of its flat position in a (possibly
larger) array, so that XLA computes each device's shard of a sharded array
locally, with no generator state or replicated temporaries, and any block of
an array, contiguous or strided, gets the whole array's bits.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np


def mix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's finalizer: a bijection of uint32 that mixes every bit."""
  h = (h ^ (h >> 16)) * np.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def flat_index(
    shape: tuple[int, ...], strides: Optional[tuple[int, ...]] = None
) -> jax.Array:
  r"""Each element's flat position, :math:`\sum_d i_d s_d` as uint32 (mod
  2**32), built from iotas so that a sharded array's shards compute theirs
  locally. ``strides`` (in elements) default to ``shape``'s row-major ones;
  other strides give a block's positions in the array it was cut from.

  Example:
    >>> flat_index((2, 3)).tolist()
    [[0, 1, 2], [3, 4, 5]]
    >>> flat_index((2, 3), strides=(6, 1)).tolist()  # rows 0 and 2 of [4, 3]
    [[0, 1, 2], [6, 7, 8]]
  """
  if strides is None:
    strides = tuple(int(np.prod(shape[d + 1 :])) for d in range(len(shape)))
  index = jnp.zeros(shape, jnp.uint32)
  for axis, stride in enumerate(strides):
    index += jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(
        stride % 2**32
    )
  return index


def uniform_bits(
    key: jax.Array,
    shape: tuple[int, ...],
    offset: Any = 0,
    strides: Optional[tuple[int, ...]] = None,
) -> jax.Array:
  """uint32 random bits of ``shape``: a keyed hash of each element's
  :func:`flat_index` plus ``offset`` (counter-based, like Philox).
  ``jax.random.bits`` on a ``[V, D]`` table held several table-sized uint32
  buffers per device. Rows ``r0:`` of an ``[m, n]`` array get the whole
  array's bits with ``offset = r0 * n``; rows ``j::k`` with ``offset = j *
  n`` and ``strides = (k * n, 1)``."""
  k0, k1 = (jnp.asarray(w, jnp.uint32) for w in jax.random.key_data(key))
  index = flat_index(shape, strides) + jnp.asarray(offset).astype(jnp.uint32)
  return mix32(mix32(index ^ k0) + k1)


def stochastic_round(
    x: jax.Array,
    dtype: Any,
    key: jax.Array,
    offset: Any = 0,
    strides: Optional[tuple[int, ...]] = None,
) -> jax.Array:
  r"""Rounds float32 ``x`` to ``dtype`` (float32 or bfloat16), stochastically.

  To bfloat16: ``x`` lies between two neighbours ``lo <= x < hi``; it
  becomes ``hi`` with probability ``(x - lo) / (hi - lo)``, so
  :math:`\mathbb{E}[\mathrm{round}(x)] = x`. Implemented on the bits: 16
  random bits are added to the 16 that bfloat16 drops, and the carry decides.
  Values that bfloat16 holds exactly are returned unchanged; NaN stays NaN.
  To float32: ``x`` itself. ``offset`` and ``strides``: ``x``'s place in a
  larger array being rounded in blocks (the bits are those of that array's
  elements, see :func:`uniform_bits`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jnp.full((10000,), 1.0 + 2.0**-10)   # 1/8 of a bf16 ulp above 1
    >>> y = stochastic_round(x, jnp.bfloat16, jax.random.key(0))
    >>> sorted(set(y.astype(float).tolist()))
    [1.0, 1.0078125]
    >>> abs(float(y.astype(jnp.float32).mean()) - (1.0 + 2.0**-10)) < 3e-4
    True
  """
  x = jnp.asarray(x, jnp.float32)
  if np.dtype(dtype) == np.float32:
    return x
  if np.dtype(dtype) != jnp.bfloat16:
    raise ValueError(
        f"stochastic_round rounds to float32 or bfloat16, got "
        f"{np.dtype(dtype)}"
    )
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  noise = uniform_bits(key, x.shape, offset, strides) >> 16
  rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
  y = jax.lax.bitcast_convert_type(rounded, jnp.float32)
  return jnp.where(jnp.isnan(x), x, y).astype(jnp.bfloat16)
