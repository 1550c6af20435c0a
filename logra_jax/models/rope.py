"""Rotary position embeddings (RoPE) of the decoder: the inverse
frequencies, with HF's linear and llama3 scaling, and the rotation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.models.config import DecoderConfig


def rope_inv_freq(config: DecoderConfig) -> np.ndarray:
  """Inverse RoPE frequencies `[h/2]` (float32), with linear/llama3 scaling.

  Mirrors `transformers.modeling_rope_utils` so logits agree with HF.

  Args:
    config: the decoder config.

  Returns:
    The frequencies.

  Example:
    >>> rope_inv_freq(DecoderConfig.tiny()).shape
    (8,)
  """
  h = config.head_dim
  inv_freq = 1.0 / (
      np.float32(config.rope_theta)
      ** (np.arange(0, h, 2, dtype=np.float32) / np.float32(h))
  )
  inv_freq = inv_freq.astype(np.float32)
  s = config.rope_scaling
  if s is None:
    return inv_freq
  if s.kind == "linear":
    return (inv_freq / np.float32(s.factor)).astype(np.float32)
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * np.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (
      s.original_max_position_embeddings / wavelen - s.low_freq_factor
  ) / (s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x_BxTxNxh: jax.Array, cos_BxTxr: jax.Array, sin_BxTxr: jax.Array
) -> jax.Array:
  """Rotates halves (HF `rotate_half` convention); r = h / 2."""
  x1, x2 = jnp.split(x_BxTxNxh.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos_BxTxr[:, :, None], sin_BxTxr[:, :, None]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxh.dtype)
