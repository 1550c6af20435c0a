"""Decoder-only transformer (Llama / Qwen2 / Qwen3) in Flax NNX.

Layer weights are stacked along a leading layer axis `[L, ...]` and the blocks
run under one `jax.lax.scan`. Linear weights are stored `[in, out]` (`x @ W`).
Every `nnx.Param` carries logical axis names in its `out_sharding` metadata
("layers", "embed", "heads", "kv_heads", "mlp", "vocab");
`parallel.logical_to_mesh` turns them into mesh shardings.

Shape letters: B batch, T query length, S cache length, D hidden, F MLP width,
H query heads, K kv heads, G = H // K, h head dim, V vocab, L layers.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from logra_jax.models.attention import attention
from logra_jax.models.cache import KVCache
from logra_jax.models.cache import write_cache
from logra_jax.models.config import attention_implementation
from logra_jax.models.config import DecoderConfig
from logra_jax.models.rope import apply_rope
from logra_jax.models.rope import rope_inv_freq
from logra_jax.parallel.sharding import constrain
from logra_jax.lowrank import LowRankDelta
from logra_jax.lowrank import matmul
from logra_jax.lowrank import take
from logra_jax.reduction import tree_sum

# Logical axis names of every parameter, by path (the sharding hook). The
# vocabulary tables are split along the vocabulary only (see PARTITION_RULES).
LOGICAL_AXES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    ("embed",): ("vocab", None),
    ("final_norm",): ("embed",),
    ("lm_head",): (None, "vocab"),
    ("layers", "attn_norm"): ("layers", "embed"),
    ("layers", "q_proj"): ("layers", "embed", "heads"),
    ("layers", "k_proj"): ("layers", "embed", "kv_heads"),
    ("layers", "v_proj"): ("layers", "embed", "kv_heads"),
    ("layers", "o_proj"): ("layers", "heads", "embed"),
    ("layers", "q_bias"): ("layers", "heads"),
    ("layers", "k_bias"): ("layers", "kv_heads"),
    ("layers", "v_bias"): ("layers", "kv_heads"),
    ("layers", "o_bias"): ("layers", "embed"),
    ("layers", "q_norm"): ("layers", None),
    ("layers", "k_norm"): ("layers", None),
    ("layers", "mlp_norm"): ("layers", "embed"),
    ("layers", "gate_proj"): ("layers", "embed", "mlp"),
    ("layers", "up_proj"): ("layers", "embed", "mlp"),
    ("layers", "down_proj"): ("layers", "mlp", "embed"),
}


def param_shapes(
    config: DecoderConfig,
) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Returns the shape of every parameter of `config`'s decoder, by path.

  Args:
    config: the decoder config.

  Returns:
    `{path: shape}`; optional parameters (biases, q/k norms, untied LM head)
    appear only when the config enables them.

  Example:
    >>> param_shapes(DecoderConfig.tiny(vocab_size=10))[("layers", "q_proj")]
    (2, 64, 64)
  """
  c = config
  L, D, F, V, h = (
      c.num_layers,
      c.hidden_size,
      c.intermediate_size,
      c.vocab_size,
      c.head_dim,
  )
  Hh, Kh = c.num_heads * h, c.num_kv_heads * h
  shapes = {
      ("embed",): (V, D),
      ("final_norm",): (D,),
      ("layers", "attn_norm"): (L, D),
      ("layers", "q_proj"): (L, D, Hh),
      ("layers", "k_proj"): (L, D, Kh),
      ("layers", "v_proj"): (L, D, Kh),
      ("layers", "o_proj"): (L, Hh, D),
      ("layers", "mlp_norm"): (L, D),
      ("layers", "gate_proj"): (L, D, F),
      ("layers", "up_proj"): (L, D, F),
      ("layers", "down_proj"): (L, F, D),
  }
  if not c.tie_word_embeddings:
    shapes[("lm_head",)] = (D, V)
  if c.attention_bias:
    shapes.update(
        {
            ("layers", "q_bias"): (L, Hh),
            ("layers", "k_bias"): (L, Kh),
            ("layers", "v_bias"): (L, Kh),
        }
    )
  if c.attention_out_bias:
    shapes[("layers", "o_bias")] = (L, D)
  if c.qk_norm:
    shapes.update({("layers", "q_norm"): (L, h), ("layers", "k_norm"): (L, h)})
  return shapes


def _rms_norm(
    x: jax.Array, weight: jax.Array, eps: float, batch_invariant: bool = False
) -> jax.Array:
  """RMSNorm over the last axis in float32, cast back, times `weight`; the
  mean of squares a `tree_sum` when `batch_invariant`."""
  x32 = x.astype(jnp.float32)
  sum_of_squares = tree_sum if batch_invariant else jnp.sum
  mean_square = sum_of_squares(x32 * x32, axis=-1, keepdims=True) / x.shape[-1]
  x32 = x32 * jax.lax.rsqrt(mean_square + eps)
  return weight.astype(x.dtype) * x32.astype(x.dtype)


def _pack(mask_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The order that moves each row's real tokens to its front, keeping their
  order (`[B, T]` indices), and its inverse."""
  order_BxT = jnp.argsort(~mask_BxT, axis=1, stable=True)
  return order_BxT, jnp.argsort(order_BxT, axis=1)


def _gather_rows(x_BxTx_: jax.Array, index_BxT: jax.Array) -> jax.Array:
  """`x[b, index[b, t]]` along the second axis."""
  index = index_BxT.reshape(index_BxT.shape + (1,) * (x_BxTx_.ndim - 2))
  return jnp.take_along_axis(x_BxTx_, index, axis=1)


def _remat(fn, policy: str):
  """Wraps the block function with the configured checkpoint policy."""
  if policy == "none":
    return fn
  if policy == "block":
    return jax.checkpoint(fn, prevent_cse=False)
  return jax.checkpoint(
      fn,
      prevent_cse=False,
      policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  )


def _block(
    config: DecoderConfig,
    x_BxTxD: jax.Array,
    w: dict[str, jax.Array],
    cos_BxTxr: jax.Array,
    sin_BxTxr: jax.Array,
    mask_BxTxS: jax.Array,
    past_k_BxKxSxh: jax.Array | None,
    past_v_BxKxSxh: jax.Array | None,
    implementation: str = "chunked",
    lengths_B: jax.Array | None = None,
    batch_invariant_at: jax.Array | None = None,
):
  """One pre-norm block; returns (x, new keys `[B, K, T, h]`, new values).

  The mask covers `[past; new]` keys: S = past length + T. With
  `lengths_B` (no cache), the rows are packed (real tokens first, in order)
  and attention is causal over the first `lengths_B` tokens of each row.
  `batch_invariant_at`: as in `attention` (`config.batch_invariant`).
  """
  c = config
  dt = x_BxTxD.dtype
  B, T, _ = x_BxTxD.shape
  H, K, h = c.num_heads, c.num_kv_heads, c.head_dim
  invariant = c.batch_invariant

  def dense(x, name):
    return matmul(x, w[name], dt, batch_invariant=invariant)

  def norm(x, name):
    return _rms_norm(x, w[name], c.rms_norm_eps, invariant)

  hn_BxTxD = norm(x_BxTxD, "attn_norm")
  q = dense(hn_BxTxD, "q_proj")
  k = dense(hn_BxTxD, "k_proj")
  v = dense(hn_BxTxD, "v_proj")
  if c.attention_bias:
    q = q + w["q_bias"].astype(dt)
    k = k + w["k_bias"].astype(dt)
    v = v + w["v_bias"].astype(dt)
  q_BxTxHxh = q.reshape(B, T, H, h)
  k_BxTxKxh = k.reshape(B, T, K, h)
  v_BxTxKxh = v.reshape(B, T, K, h)
  if c.qk_norm:
    q_BxTxHxh = norm(q_BxTxHxh, "q_norm")
    k_BxTxKxh = norm(k_BxTxKxh, "k_norm")
  q_BxTxHxh = apply_rope(q_BxTxHxh, cos_BxTxr, sin_BxTxr)
  k_BxTxKxh = apply_rope(k_BxTxKxh, cos_BxTxr, sin_BxTxr)

  attn_BxTxKxGxh, k_BxKxTxh, v_BxKxTxh = attention(
      q_BxTxHxh,
      k_BxTxKxh,
      v_BxTxKxh,
      mask_BxTxS,
      past_k_BxKxSxh,
      past_v_BxKxSxh,
      chunk=c.attention_chunk,
      implementation=implementation,
      lengths_B=lengths_B,
      batch_invariant_at=batch_invariant_at,
  )
  out_BxTxD = dense(attn_BxTxKxGxh.reshape(B, T, H * h), "o_proj")
  if c.attention_out_bias:
    out_BxTxD = out_BxTxD + w["o_bias"].astype(dt)
  x_BxTxD = x_BxTxD + out_BxTxD

  hn_BxTxD = norm(x_BxTxD, "mlp_norm")
  act_BxTxF = jax.nn.silu(dense(hn_BxTxD, "gate_proj")) * dense(
      hn_BxTxD, "up_proj"
  )
  x_BxTxD = x_BxTxD + dense(act_BxTxF, "down_proj")
  return x_BxTxD, k_BxKxTxh, v_BxKxTxh


def _positions(attention_mask_BxT: jax.Array, cache: KVCache | None):
  """RoPE positions: the running count of real tokens (so left padding is
  handled), continuing after the cache's tokens."""
  positions_BxT = jnp.cumsum(attention_mask_BxT, axis=1, dtype=jnp.int32) - 1
  if cache is not None:
    positions_BxT += jnp.sum(cache.mask, axis=1, dtype=jnp.int32)[:, None]
  return jnp.maximum(positions_BxT, 0)


def _attention_mask(attention_mask_BxT: jax.Array, cache: KVCache | None):
  """Which keys of ``[past; new]`` each new token sees (`[B, T, S]`)."""
  B, T = attention_mask_BxT.shape
  causal_TxT = jnp.tril(jnp.ones((T, T), bool))
  mask_BxTxS = causal_TxT[None] & attention_mask_BxT[:, None, :]
  if cache is not None:
    past_BxTxS = jnp.broadcast_to(
        cache.mask[:, None, :], (B, T, cache.max_length)
    )
    mask_BxTxS = jnp.concatenate([past_BxTxS, mask_BxTxS], axis=-1)
  return mask_BxTxS


def forward_hidden(
    config: DecoderConfig,
    weights: dict[str, Any],
    input_ids_BxT: jax.Array,
    *,
    positions_BxT: jax.Array | None = None,
    attention_mask_BxT: jax.Array | None = None,
    cache: KVCache | None = None,
    prefill: bool = False,
) -> tuple[jax.Array, KVCache | None]:
  """Pure forward pass up to the final RMSNorm.

  Args:
    config: the decoder config.
    weights: `{"embed", "final_norm", "layers": {...}, ["lm_head"]}` arrays,
      as laid out by `Decoder`.
    input_ids_BxT: int token ids.
    positions_BxT: RoPE positions; default: running count of real tokens
      (so left padding is handled), continuing after the cache's tokens.
    attention_mask_BxT: 1 for real tokens, 0 for padding; default all ones.
    cache: optional `KVCache`; the new keys/values are written at
      `cache.index` (the caller keeps `index + T <= S`).
    prefill: `cache` holds no token yet (a sampler's first call): attention
      reads the new keys only, `T x T` scores instead of `T x (S + T)` (the
      empty slots are all masked), and the new keys/values are written.

  Returns:
    `(hidden_BxTxD, new_cache)`; `new_cache` is None when `cache` is None.
  """
  c = config
  dt = jnp.dtype(c.dtype)
  B, T = input_ids_BxT.shape
  if attention_mask_BxT is None:
    attention_mask_BxT = jnp.ones((B, T), bool)
  attention_mask_BxT = attention_mask_BxT.astype(bool)
  if positions_BxT is None:
    positions_BxT = _positions(attention_mask_BxT, cache)
  freqs_BxTxr = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(
      rope_inv_freq(c)
  )
  cos_BxTxr, sin_BxTxr = jnp.cos(freqs_BxTxr), jnp.sin(freqs_BxTxr)
  if prefill and cache is None:
    raise ValueError("prefill=True writes into a cache: give one")
  attended = None if prefill else cache  # the cache the new tokens read
  mask_BxTxS = _attention_mask(attention_mask_BxT, attended)

  x_BxTxD = constrain(
      take(weights["embed"], input_ids_BxT, dt, c.batch_invariant),
      ("batch", None, None),
  )
  implementation, _ = (
      ("chunked", None)
      if c.batch_invariant
      else attention_implementation(c.attention, c.dtype)
  )
  # Batch-invariant attention writes the new keys into the cache first, at
  # its index (a forward pass without a cache: one block, slot 0).
  at = None
  if c.batch_invariant:
    at = jnp.zeros((), jnp.int32) if attended is None else attended.index
  # Fused attention without a cache: each row's real tokens packed to its
  # front (positions are already taken), so causal attention over their
  # count is exact for any padding; the hidden states are unpacked after.
  packed = implementation != "chunked" and cache is None and T > 1
  lengths_B = None
  if packed:
    order_BxT, unpack_BxT = _pack(attention_mask_BxT)
    lengths_B = jnp.sum(attention_mask_BxT, axis=1, dtype=jnp.int32)
    x_BxTxD, cos_BxTxr, sin_BxTxr = (
        _gather_rows(a, order_BxT) for a in (x_BxTxD, cos_BxTxr, sin_BxTxr)
    )

  def body(x_BxTxD, layer):
    w, past_k, past_v = layer
    x_BxTxD = constrain(x_BxTxD, ("batch", None, None))
    x_BxTxD, k_BxKxTxh, v_BxKxTxh = _block(
        c,
        x_BxTxD,
        w,
        cos_BxTxr,
        sin_BxTxr,
        mask_BxTxS,
        past_k,
        past_v,
        implementation,
        lengths_B,
        at,
    )
    new_kv = None if cache is None else (k_BxKxTxh, v_BxKxTxh)
    return x_BxTxD, new_kv

  body = _remat(body, c.remat)
  past = (attended.k, attended.v) if attended is not None else (None, None)
  x_BxTxD, new_kv = jax.lax.scan(body, x_BxTxD, (weights["layers"], *past))
  if packed:
    x_BxTxD = _gather_rows(x_BxTxD, unpack_BxT)
  hidden_BxTxD = _rms_norm(
      x_BxTxD, weights["final_norm"], c.rms_norm_eps, c.batch_invariant
  )
  if cache is None:
    return hidden_BxTxD, None
  return hidden_BxTxD, write_cache(cache, *new_kv, attention_mask_BxT)


def unembedding(
    config: DecoderConfig, weights: dict[str, Any]
) -> jax.Array | LowRankDelta:
  """The output projection `[D, V]` (tied or not) in compute dtype: an array,
  or a `LowRankDelta` whose base is cast (a factored head `c B + P A`, a
  LoRA-adapted one, or the sketch's term on top of one). Such a head is
  never formed: the logits are `c (h B) + (h P) A`. (A base stored in
  another dtype than the compute dtype is cast, like a dense head: a
  `[D, V]` copy in the compute dtype.)

  The cast happens here, once, rather than where the weight is used: in a
  rematerialized loop over chunks of logits (`token_logprobs`) the backward
  pass then reuses this compute-dtype copy instead of keeping the float32
  table alive to cast it again.
  """
  w_DxV = (
      weights["embed"].T if config.tie_word_embeddings else weights["lm_head"]
  )
  if isinstance(w_DxV, LowRankDelta):
    return w_DxV.with_base_dtype(config.dtype)
  return w_DxV.astype(config.dtype)


def project_logits(
    hidden_BxTxD: jax.Array,
    w_DxV: jax.Array | LowRankDelta,
    batch_invariant: bool = False,
) -> jax.Array:
  """`hidden @ W` in the hidden states' dtype, accumulated and returned in
  float32 (as `DecoderConfig.batch_invariant` computes it, when given)."""
  return matmul(
      hidden_BxTxD,
      w_DxV,
      hidden_BxTxD.dtype,
      preferred_element_type=jnp.float32,
      batch_invariant=batch_invariant,
  )


class Decoder(nnx.Module):
  """Causal LM decoder with stacked, scanned layers.

  Parameters (all `nnx.Param`, with logical `out_sharding` metadata):
  `embed [V, D]`, `final_norm [D]`, optional `lm_head [D, V]`, and under
  `layers`: `attn_norm [L, D]`, `q_proj [L, D, H*h]`, `k_proj`/`v_proj
  [L, D, K*h]`, `o_proj [L, H*h, D]`, optional biases and q/k norms,
  `mlp_norm [L, D]`, `gate_proj`/`up_proj [L, D, F]`, `down_proj [L, F, D]`.

  Example:
    >>> model = Decoder(DecoderConfig.tiny(vocab_size=32), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 32)
  """

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    self.config = config
    dtype = jnp.dtype(config.param_dtype)
    normal = jax.nn.initializers.normal(config.initializer_range)

    def param(path: tuple[str, ...], shape: tuple[int, ...]) -> nnx.Param:
      name = path[-1]
      if name.endswith("_norm"):
        value = jnp.ones(shape, dtype)
      elif name.endswith("_bias"):
        value = jnp.zeros(shape, dtype)
      else:
        value = normal(rngs.params(), shape, dtype)
      return nnx.Param(
          value, out_sharding=LOGICAL_AXES[path], eager_sharding=False
      )

    shapes = param_shapes(config)
    self.embed = param(("embed",), shapes[("embed",)])
    self.layers = nnx.Dict(
        {
            path[1]: param(path, shape)
            for path, shape in shapes.items()
            if path[0] == "layers"
        }
    )
    self.final_norm = param(("final_norm",), shapes[("final_norm",)])
    self.lm_head = (
        None
        if config.tie_word_embeddings
        else param(("lm_head",), shapes[("lm_head",)])
    )

  def weights(self) -> dict[str, Any]:
    """The raw parameter arrays as the dict `forward_hidden` takes."""
    weights = {
        "embed": self.embed[...],
        "final_norm": self.final_norm[...],
        "layers": {k: v[...] for k, v in self.layers.items()},
    }
    if self.lm_head is not None:
      weights["lm_head"] = self.lm_head[...]
    return weights

  def hidden_states(
      self,
      input_ids_BxT: jax.Array,
      *,
      positions: jax.Array | None = None,
      attention_mask: jax.Array | None = None,
      cache: KVCache | None = None,
      prefill: bool = False,
  ):
    """Final-norm hidden states `[B, T, D]` and the updated cache (or None);
    ``prefill``: the cache is empty (see :func:`forward_hidden`)."""
    return forward_hidden(
        self.config,
        self.weights(),
        input_ids_BxT,
        positions_BxT=positions,
        attention_mask_BxT=attention_mask,
        cache=cache,
        prefill=prefill,
    )

  def unembedding(self) -> jax.Array | LowRankDelta:
    """The output projection `[D, V]` in compute dtype (:func:`unembedding`)."""
    return unembedding(self.config, self.weights())

  def __call__(
      self,
      input_ids_BxT: jax.Array,
      *,
      positions: jax.Array | None = None,
      attention_mask: jax.Array | None = None,
      cache: KVCache | None = None,
  ):
    """Float32 logits `[B, T, V]`; with a cache, `(logits, new_cache)`.

    Args:
      input_ids_BxT: int32 token ids.
      positions: optional RoPE positions `[B, T]` (see `forward_hidden`).
      attention_mask: optional `[B, T]`, 1 for real tokens, 0 for padding
        (left or right). Outputs at padded positions are meaningless.
      cache: optional `KVCache` from `init_cache`; enables incremental
        decoding (prefill a chunk, then one token at a time).

    Returns:
      `logits_BxTxV` if `cache` is None, else `(logits_BxTxV, new_cache)`.
    """
    hidden_BxTxD, new_cache = self.hidden_states(
        input_ids_BxT,
        positions=positions,
        attention_mask=attention_mask,
        cache=cache,
    )
    logits_BxTxV = project_logits(
        hidden_BxTxD, self.unembedding(), self.config.batch_invariant
    )
    return logits_BxTxV if cache is None else (logits_BxTxV, new_cache)


def init_model(config: DecoderConfig, rngs: nnx.Rngs | int = 0) -> Decoder:
  """Builds a randomly initialized decoder.

  Args:
    config: the decoder config.
    rngs: `nnx.Rngs` or an int seed.

  Returns:
    The `Decoder`.

  Example:
    >>> model = init_model(DecoderConfig.tiny(vocab_size=64), rngs=0)
    >>> model.embed.shape
    (64, 64)
  """
  if isinstance(rngs, int):
    rngs = nnx.Rngs(rngs)
  return Decoder(config, rngs=rngs)


def split_model(model: Decoder) -> tuple[nnx.GraphDef, nnx.State]:
  """Splits a model into `(graphdef, params)`; `params` is an `nnx.State` pytree.

  Args:
    model: the decoder.

  Returns:
    The static graph definition and the parameters, for `logits_fn`,
    `token_logprobs`, the sampler and optax. `nnx.merge(graphdef, params)`
    rebuilds the module.

  Example:
    >>> graphdef, params = split_model(init_model(DecoderConfig.tiny()))
    >>> params["layers"]["q_proj"].shape
    (2, 64, 64)
  """
  return nnx.split(model, nnx.Param)


def logits_fn(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids_BxT: jax.Array,
    *,
    positions: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
) -> jax.Array:
  """Pure float32 logits `[B, T, V]`; usable under `jit`, `grad` and `jvp`.

  Args:
    graphdef: from `split_model`.
    params: from `split_model` (or a tangent/update of the same structure).
    input_ids_BxT: int32 token ids.
    positions: optional RoPE positions `[B, T]`.
    attention_mask: optional `[B, T]` padding mask.

  Returns:
    The logits.

  Example:
    >>> graphdef, params = split_model(init_model(DecoderConfig.tiny(), 0))
    >>> ids = jnp.zeros((1, 4), jnp.int32)
    >>> jax.jit(logits_fn, static_argnums=0)(graphdef, params, ids).shape
    (1, 4, 256)
  """
  model = nnx.merge(graphdef, params)
  return model(
      input_ids_BxT, positions=positions, attention_mask=attention_mask
  )
