"""The key/value cache of incremental decoding: fixed size, laid out like the
activations that fill it.

Shape letters: L layers, B batch, K kv heads, S slots, T new tokens, h head
dim.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from logra_jax.models.config import DecoderConfig
from logra_jax.parallel.sharding import constrain


class KVCache(NamedTuple):
  """Fixed-size key/value cache for incremental decoding (a pytree).

  Attributes:
    k: keys `[L, B, K, S, h]` (RoPE applied; heads-major for fast decoding).
    v: values `[L, B, K, S, h]`.
    mask: `[B, S]` bool, True where a slot holds a real (non-pad) token.
    index: int32 scalar, the next slot to write (shared by the batch, so
      ragged prompts are left-padded).
  """

  k: jax.Array
  v: jax.Array
  mask: jax.Array
  index: jax.Array

  @property
  def max_length(self) -> int:
    """S, the number of slots."""
    return self.k.shape[3]


def init_cache(
    config: DecoderConfig, batch_size: int, max_length: int, dtype: Any = None
) -> KVCache:
  """Returns an empty cache of `max_length` slots.

  Args:
    config: the decoder config.
    batch_size: B.
    max_length: S, prompt plus generated tokens must fit.
    dtype: cache dtype; defaults to the compute dtype.

  Returns:
    A zero `KVCache` with `index == 0` and no valid slot.

  Example:
    >>> cache = init_cache(DecoderConfig.tiny(), batch_size=2, max_length=8)
    >>> cache.k.shape
    (2, 2, 2, 8, 16)
  """
  shape = (
      config.num_layers,
      batch_size,
      config.num_kv_heads,
      max_length,
      config.head_dim,
  )
  dtype = dtype or config.dtype
  return constrain_cache(
      KVCache(
          k=jnp.zeros(shape, dtype),
          v=jnp.zeros(shape, dtype),
          mask=jnp.zeros((batch_size, max_length), bool),
          index=jnp.zeros((), jnp.int32),
      )
  )


def constrain_cache(cache: KVCache) -> KVCache:
  """The cache laid out like the activations that fill it: rows split along
  the batch axes, keys and values along the key/value heads where tp divides
  them ("cache_kv_heads"; whole otherwise), under
  `parallel.activation_sharding` (unchanged outside it)."""
  heads = (None, "batch", "cache_kv_heads", None, None)
  return cache._replace(
      k=constrain(cache.k, heads),
      v=constrain(cache.v, heads),
      mask=constrain(cache.mask, ("batch", None)),
  )


def write_cache(
    cache: KVCache,
    k_LxBxKxTxh: jax.Array,
    v_LxBxKxTxh: jax.Array,
    attention_mask_BxT: jax.Array,
) -> KVCache:
  """The cache with the new keys, values and mask written at its index.

  Args:
    cache: the cache (the caller keeps ``index + T <= S``).
    k_LxBxKxTxh: the new keys of every layer.
    v_LxBxKxTxh: the new values.
    attention_mask_BxT: True for the real (non-pad) new tokens.

  Returns:
    The cache, ``index`` advanced by T.

  Example:
    >>> cache = init_cache(DecoderConfig.tiny(), batch_size=2, max_length=8)
    >>> new_kv = jnp.ones((2, 2, 2, 3, 16))
    >>> int(write_cache(cache, new_kv, new_kv, jnp.ones((2, 3), bool)).index)
    3
  """
  at = (0, 0, 0, cache.index, 0)
  return constrain_cache(
      KVCache(
          k=jax.lax.dynamic_update_slice(
              cache.k, k_LxBxKxTxh.astype(cache.k.dtype), at
          ),
          v=jax.lax.dynamic_update_slice(
              cache.v, v_LxBxKxTxh.astype(cache.v.dtype), at
          ),
          mask=jax.lax.dynamic_update_slice(
              cache.mask, attention_mask_BxT, (0, cache.index)
          ),
          index=cache.index + attention_mask_BxT.shape[1],
      )
  )
