"""Grouped-query attention of the decoder blocks, over keys and values that
come in blocks (``[past cache;] new``) and are never concatenated.

Three ways, one result: a single decoded token (``T == 1``) as elementwise
products and reductions, which read the layer's slice of the stacked cache in
place; query blocks of ``config.attention_chunk`` rows (``"chunked"``), each
seeing every key, so only one ``C x S`` score block is alive at a time; or
``jax.nn.dot_product_attention`` (``"xla"`` / ``"cudnn"``).

Shape letters: B batch, T query length, S key length (past plus new), H query
heads, K kv heads, G = H // K, h head dim, C query block, n query blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.reduction import BLOCK, pairwise_sum, tree_sum, with_matrix_rows

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def attention(
    q_BxTxHxh: jax.Array,
    k_BxTxKxh: jax.Array,
    v_BxTxKxh: jax.Array,
    mask_BxTxS: jax.Array,
    past_k_BxKxSxh: jax.Array | None,
    past_v_BxKxSxh: jax.Array | None,
    *,
    chunk: int,
    implementation: str = "chunked",
    lengths_B: jax.Array | None = None,
    batch_invariant_at: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""Causal grouped-query attention of new queries over past and new keys.

  .. math:: \mathrm{softmax}\big(q k^\top / \sqrt{h} + \log m\big)\, v

  with ``m`` the boolean mask (masked scores get a large negative value),
  scores and softmax in float32, the probabilities cast to the queries'
  dtype, and their products with the values summed in float32 over the key
  blocks and cast to the queries' dtype once: a decoded token (keys in two
  blocks, cache and new) is rounded as often as the same token in a
  whole-sequence forward (one block).

  Args:
    q_BxTxHxh: the new queries (RoPE applied).
    k_BxTxKxh: the new keys (RoPE applied).
    v_BxTxKxh: the new values.
    mask_BxTxS: True where a query sees a key, over ``[past; new]`` keys.
    past_k_BxKxSxh: the cached keys of earlier tokens, or None.
    past_v_BxKxSxh: the cached values, or None.
    chunk: C, the query block of the chunked attention.
    implementation: ``"chunked"``, or a ``jax.nn.dot_product_attention``
      implementation (used when ``T > 1``).
    lengths_B: packed rows (real tokens first, no cache): attention is
      causal over each row's first ``lengths_B`` keys.
    batch_invariant_at: the batch-invariant path
      (``DecoderConfig.batch_invariant``), with the slot of the past blocks
      where the new keys go (0 without a cache): the new keys and values are
      written there first and the queries attend over that one block, as
      the same tokens do in a forward pass; the softmax is a tree sum and
      the value sum a pairwise sum over blocks of 256 keys counted from
      each row's first.

  Returns:
    ``(attn_BxTxKxGxh, k_BxKxTxh, v_BxKxTxh)``: the attention output and the
    new keys and values heads-major, as the cache keeps them.

  Example:
    >>> q = jnp.ones((1, 3, 4, 8)); kv = jnp.ones((1, 3, 2, 8))
    >>> mask = jnp.tril(jnp.ones((3, 3), bool))[None]
    >>> attention(q, kv, kv, mask, None, None, chunk=2)[0].shape
    (1, 3, 2, 2, 8)
  """
  B, T, H, h = q_BxTxHxh.shape
  K = k_BxTxKxh.shape[2]
  dt = q_BxTxHxh.dtype
  # Heads-major layout: every (batch, kv head) pair is one contiguous matmul,
  # which is several times faster on CPU than sequence-major when decoding.
  q_BxKxGxTxh = q_BxTxHxh.reshape(B, T, K, H // K, h).transpose(0, 2, 3, 1, 4)
  k_BxKxTxh = k_BxTxKxh.transpose(0, 2, 1, 3)
  v_BxKxTxh = v_BxTxKxh.transpose(0, 2, 1, 3)
  # Keys/values come in blocks ([past cache;] new) that are never
  # concatenated (only the small score blocks are): no cache copy per step.
  blocks = [(k_BxKxTxh, v_BxKxTxh)]
  if past_k_BxKxSxh is not None:
    blocks.insert(0, (past_k_BxKxSxh.astype(dt), past_v_BxKxSxh.astype(dt)))
  if batch_invariant_at is not None:
    blocks, mask_BxTxS = _written_first(blocks, mask_BxTxS, batch_invariant_at)
    blocks, mask_BxTxS, rotate_B = _from_first_key(blocks, mask_BxTxS, T)
    products = _invariant_products(rotate_B)
  elif implementation != "chunked" and T > 1:
    attn_BxTxKxGxh = _fused_attention(
        q_BxTxHxh,
        blocks,
        mask_BxTxS,
        lengths_B,
        implementation,
    ).reshape(B, T, K, H // K, h)
    return attn_BxTxKxGxh, k_BxKxTxh, v_BxKxTxh
  else:
    products = _decode_products() if T == 1 else _prefill_products()

  def attend(q_BxKxGxTxh, mask_BxTxS):
    return _attend(q_BxKxGxTxh, blocks, mask_BxTxS, *products)

  if T <= chunk:
    attn_BxKxGxTxh = attend(q_BxKxGxTxh, mask_BxTxS)
  else:
    attn_BxKxGxTxh = _by_query_blocks(attend, q_BxKxGxTxh, mask_BxTxS, chunk)
  attn_BxTxKxGxh = attn_BxKxGxTxh.transpose(0, 3, 1, 2, 4)
  return attn_BxTxKxGxh, k_BxKxTxh, v_BxKxTxh


def _written_first(blocks, mask_BxTxS, at):
  """``[past; new]`` as one block: the new keys and values (and their mask
  columns) written into the past block at slot ``at``."""
  if len(blocks) == 1:
    return blocks, mask_BxTxS
  (past_k, past_v), (new_k, new_v) = blocks
  S = past_k.shape[2]
  write = lambda past, new: jax.lax.dynamic_update_slice_in_dim(
      past, new, at, axis=2
  )
  keys, values = write(past_k, new_k), write(past_v, new_v)
  mask_BxTxS = jax.lax.dynamic_update_slice_in_dim(
      mask_BxTxS[..., :S], mask_BxTxS[..., S:], at, axis=2
  )
  return [(keys, values)], mask_BxTxS


def _from_first_key(blocks, mask_BxTxS, T):
  """Keys past one block counted from each row's first: the one block's
  values rotated so that each row's first key any query sees sits at slot
  0, so that each 256-key block of the value sum holds the same keys
  wherever a sampler's turn or a learner's row lays the row. The
  probabilities must follow: a forward pass rotates the keys and mask
  columns once (its probabilities come out rotated); a decoded token
  rotates its one row of probabilities instead of the cache's keys
  (returned: the rotation ``_invariant_products`` applies, or None). The
  scores and the softmax's tree sum do not depend on where the keys sit.
  Within one block nothing moves."""
  ((keys_BxKxSxh, values_BxKxSxh),) = blocks
  if keys_BxKxSxh.shape[2] <= BLOCK:
    return blocks, mask_BxTxS, None
  first_B = jnp.argmax(jnp.any(mask_BxTxS, axis=1), axis=1)
  values_BxKxSxh = _rotated(values_BxKxSxh, first_B, axis=2)
  if T == 1:
    return [(keys_BxKxSxh, values_BxKxSxh)], mask_BxTxS, first_B
  keys_BxKxSxh = _rotated(keys_BxKxSxh, first_B, axis=2)
  mask_BxTxS = _rotated(mask_BxTxS, first_B, axis=2)
  return [(keys_BxKxSxh, values_BxKxSxh)], mask_BxTxS, None


def _rotated(x: jax.Array, first_B: jax.Array, axis: int) -> jax.Array:
  """``x`` rotated along its key ``axis`` so that slot ``first_B[b]`` of row
  ``b`` comes first (the slots before it wrap to the end)."""
  S = x.shape[axis]
  slots_BxS = (jnp.arange(S)[None] + first_B[:, None]) % S
  shape = [1] * x.ndim
  shape[0], shape[axis] = x.shape[0], S
  return jnp.take_along_axis(x, slots_BxS.reshape(shape), axis=axis)


def _invariant_products(rotate_B: jax.Array | None):
  """``(qk, pv, softmax)`` of the batch-invariant path: the score
  matmul's reduction (the head dim) is short; the value sum is a pairwise
  sum of matmuls over blocks of ``BLOCK`` keys and the softmax's sum a
  tree sum, so a longer, masked key axis gives the same bits. A decoded
  token's ``G x T`` query rows (one where each KV head has one query head)
  stay a matrix product (``with_matrix_rows``). ``rotate_B``: each row's
  probabilities start at that slot before the value sum, as its values do
  (:func:`_from_first_key`)."""
  matmul_qk, matmul_pv = _prefill_products()

  def qk(q_BxKxGxTxh, keys_BxKxSxh):
    return with_matrix_rows(matmul_qk, q_BxKxGxTxh, (2, 3), keys_BxKxSxh)

  def pv(probs_BxKxGxTxS, values_BxKxSxh, dtype):
    if rotate_B is not None:
      probs_BxKxGxTxS = _rotated(probs_BxKxGxTxS, rotate_B, axis=4)
    S = values_BxKxSxh.shape[2]
    parts = [
        with_matrix_rows(
            matmul_pv,
            probs_BxKxGxTxS[..., i : i + BLOCK],
            (2, 3),
            values_BxKxSxh[:, :, i : i + BLOCK],
            jnp.float32,
        )
        for i in range(0, S, BLOCK)
    ]
    return pairwise_sum(parts).astype(dtype)

  def softmax(scores):
    exp = jnp.exp(scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True)))
    return exp / tree_sum(exp, keepdims=True)

  return qk, pv, softmax


def _decode_products():
  """``(qk, pv)`` for one query token: as elementwise products and
  reductions (not matmuls) the layer's slice of the stacked cache is read in
  place inside the fusion; a matmul would first copy it out, which costs
  more than the math."""

  def qk(q_BxKxGxTxh, keys_BxKxSxh):
    return jnp.sum(
        q_BxKxGxTxh.astype(jnp.float32)
        * keys_BxKxSxh[:, :, None].astype(jnp.float32),
        axis=-1,
        keepdims=True,
    ).swapaxes(-1, -2)

  def pv(probs_BxKxGxTxS, values_BxKxSxh, dtype):
    return jnp.sum(
        probs_BxKxGxTxS.swapaxes(-1, -2).astype(jnp.float32)
        * values_BxKxSxh[:, :, None].astype(jnp.float32),
        axis=-2,
        keepdims=True,
    ).astype(dtype)

  return qk, pv


def _prefill_products():
  """``(qk, pv)`` for many query tokens, as matmuls."""

  def qk(q_BxKxGxTxh, keys_BxKxSxh):
    return jnp.einsum(
        "bkgth,bksh->bkgts",
        q_BxKxGxTxh,
        keys_BxKxSxh,
        preferred_element_type=jnp.float32,
    )

  def pv(probs_BxKxGxTxS, values_BxKxSxh, dtype):
    return jnp.einsum(
        "bkgts,bksh->bkgth",
        probs_BxKxGxTxS,
        values_BxKxSxh,
        preferred_element_type=dtype,
    )

  return qk, pv


def _attend(q_BxKxGxTxh, blocks, mask_BxTxS, qk, pv, softmax=jax.nn.softmax):
  """Softmax attention of the queries over the key/value blocks."""
  h = q_BxKxGxTxh.shape[-1]
  dt = q_BxKxGxTxh.dtype
  scores_BxKxGxTxS = jnp.concatenate(
      [qk(q_BxKxGxTxh, keys) for keys, _ in blocks], axis=-1
  ) * (h**-0.5)
  scores_BxKxGxTxS = jnp.where(
      mask_BxTxS[:, None, None], scores_BxKxGxTxS, _MASK_VALUE
  )
  probs_BxKxGxTxS = softmax(scores_BxKxGxTxS).astype(dt)
  # Several blocks are summed in float32 and rounded once; a single block is
  # rounded by its matmul (training's backward stays in the compute dtype).
  out_dtype = jnp.float32 if len(blocks) > 1 else dt
  attn_BxKxGxTxh, start = 0, 0
  for _, values in blocks:
    size = values.shape[2]
    attn_BxKxGxTxh += pv(
        probs_BxKxGxTxS[..., start : start + size], values, out_dtype
    )
    start += size
  return attn_BxKxGxTxh.astype(dt)


def _by_query_blocks(attend, q_BxKxGxTxh, mask_BxTxS, C):
  """``attend`` over query blocks of C rows: each sees every key, so the
  result is exact; only one ``C x S`` score block is alive at a time,
  forward and backward."""
  B, K, G, T, h = q_BxKxGxTxh.shape
  n = -(-T // C)
  pad = n * C - T
  q_nxBxKxGxCxh = (
      jnp.pad(q_BxKxGxTxh, ((0, 0),) * 3 + ((0, pad), (0, 0)))
      .reshape(B, K, G, n, C, h)
      .transpose(3, 0, 1, 2, 4, 5)
  )
  mask_nxBxCxS = (
      jnp.pad(mask_BxTxS, ((0, 0), (0, pad), (0, 0)))
      .reshape(B, n, C, -1)
      .swapaxes(0, 1)
  )
  attn_nxBxKxGxCxh = jax.lax.map(
      lambda a: jax.checkpoint(attend)(*a), (q_nxBxKxGxCxh, mask_nxBxCxS)
  )
  return attn_nxBxKxGxCxh.transpose(1, 2, 3, 0, 4, 5).reshape(
      B, K, G, n * C, h
  )[:, :, :, :T]


def _fused_attention(
    q_BxTxHxh: jax.Array,
    blocks: list[tuple[jax.Array, jax.Array]],
    mask_BxTxS: jax.Array,
    lengths_B: jax.Array | None,
    implementation: str,
) -> jax.Array:
  """Attention by `jax.nn.dot_product_attention` (`[B, T, H, h]`).

  Packed rows (`lengths_B`): causal over each row's first `lengths_B` keys,
  given as sequence lengths, so no mask is materialized and cuDNN's flash
  kernel skips the masked blocks. Otherwise (a prefill into a cache) the
  boolean mask over `[past; new]` keys.
  """
  to_BxSxKxh = lambda x_BxKxSxh: x_BxKxSxh.transpose(0, 2, 1, 3)
  if lengths_B is not None:
    ((k_BxKxTxh, v_BxKxTxh),) = blocks
    return jax.nn.dot_product_attention(
        q_BxTxHxh,
        to_BxSxKxh(k_BxKxTxh),
        to_BxSxKxh(v_BxKxTxh),
        is_causal=True,
        query_seq_lengths=lengths_B,
        key_value_seq_lengths=lengths_B,
        implementation=implementation,
    )
  keys_BxSxKxh, values_BxSxKxh = (
      jnp.concatenate([to_BxSxKxh(block[i]) for block in blocks], axis=1)
      for i in (0, 1)
  )
  return jax.nn.dot_product_attention(
      q_BxTxHxh,
      keys_BxSxKxh,
      values_BxSxKxh,
      mask=mask_BxTxS[:, None],
      implementation=implementation,
  )
