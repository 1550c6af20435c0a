"""Per-token log-probabilities of completions, chunked over the sequence."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp

from logra_jax.lowrank import LowRankDelta
from logra_jax.models.decoder import project_logits
from logra_jax.parallel.sharding import constrain


def completion_logits_scale(
    temperature: float | jax.Array,
) -> float | jax.Array:
  """The divisor applied to logits: `temperature`, or 1 for greedy (0)."""
  if isinstance(temperature, (int, float)):
    return 1.0 if temperature == 0 else float(temperature)
  return jnp.where(temperature == 0, 1.0, temperature)


def completion_hidden_states(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompt_ids_BxP: jax.Array,
    prompt_mask_BxP: jax.Array,
    completion_ids_BxN: jax.Array,
    completion_mask_BxN: jax.Array | None = None,
    context_mask_BxN: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | LowRankDelta]:
  """Final hidden states that predict each completion token, and the unembedding.

  One forward pass over `[prompt; completion]`; position `P - 1 + t` predicts
  completion token `t`, so `hidden_BxNxD @ w_DxV` are the logits of the
  completion tokens (before any temperature). The completion's attention
  mask (and positions) is `context_mask_BxN`, or `completion_mask_BxN` when
  it is None.

  Returns:
    `(hidden_BxNxD, w_DxV)` in the compute dtype; `w_DxV` is a factored
    `LowRankDelta` for a factored head (`project_logits` applies it).
  """
  hidden_BxNxD, model = _completion_forward(
      graphdef,
      params,
      prompt_ids_BxP,
      prompt_mask_BxP,
      completion_ids_BxN,
      completion_mask_BxN,
      context_mask_BxN,
  )
  return hidden_BxNxD, model.unembedding()


def _completion_forward(
    graphdef,
    params,
    prompt_ids_BxP,
    prompt_mask_BxP,
    completion_ids_BxN,
    completion_mask_BxN,
    context_mask_BxN,
):
  """`completion_hidden_states`'s hidden states, and the merged model."""
  B, P = prompt_ids_BxP.shape
  N = completion_ids_BxN.shape[1]
  if P < 1:
    raise ValueError(
        "completion log-probs need at least one prompt position (the "
        "first completion token is predicted from it)."
    )
  if completion_mask_BxN is None:
    completion_mask_BxN = jnp.ones((B, N), bool)
  if context_mask_BxN is not None:
    completion_mask_BxN = context_mask_BxN
  model = nnx.merge(graphdef, params)
  ids_BxT = jnp.concatenate([prompt_ids_BxP, completion_ids_BxN], axis=1)
  mask_BxT = jnp.concatenate(
      [prompt_mask_BxP.astype(bool), completion_mask_BxN.astype(bool)], axis=1
  )
  hidden_BxTxD, _ = model.hidden_states(
      ids_BxT.astype(jnp.int32), attention_mask=mask_BxT
  )
  hidden_BxNxD = hidden_BxTxD[:, P - 1 : P + N - 1]
  return constrain(hidden_BxNxD, ("batch", None, None)), model


def token_logprobs(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompt_ids_BxP: jax.Array,
    prompt_mask_BxP: jax.Array,
    completion_ids_BxN: jax.Array,
    completion_mask_BxN: jax.Array | None = None,
    *,
    context_mask_BxN: jax.Array | None = None,
    temperature: float | jax.Array = 1.0,
    chunk_size: int = 128,
    return_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  r"""Log-probabilities `log pi(y_t | x, y_<t)` of completion tokens.

  One forward pass over `[prompt; completion]` gives the final hidden states;
  the unembedding and log-softmax then run over chunks of `chunk_size`
  completion positions under `lax.map` with rematerialization, so float32
  logits `[B, N, V]` never exist at once, in the forward or backward pass.

  Convention (same as the sampler): the distribution is
  `softmax(logits / temperature)` *before* any top-k / top-p truncation;
  temperature 0 (greedy) uses temperature 1.

  Args:
    graphdef: from `split_model`.
    params: from `split_model`; differentiable.
    prompt_ids_BxP: prompt ids, left- or right-padded.
    prompt_mask_BxP: 1 for real prompt tokens.
    completion_ids_BxN: completion tokens.
    completion_mask_BxN: 1 for real completion tokens; default all ones.
    context_mask_BxN: 1 for the completion's tokens attended to (an
      episode's environment tokens as well as the model's), the attention
      mask and positions of the completion; None: `completion_mask_BxN`.
      Log-probs are kept where `completion_mask_BxN` is 1 only.
    temperature: sampling temperature (>= 0); may be a traced scalar, so one
      compiled function serves every temperature.
    chunk_size: completion positions per chunk.
    return_entropy: also return the per-token entropy of the distribution.

  Returns:
    `logprobs_BxN` (float32, 0 where the completion mask is 0), and
    `entropy_BxN` if `return_entropy`.

  Example:
    >>> from logra_jax.models import DecoderConfig, init_model, split_model
    >>> graphdef, params = split_model(init_model(DecoderConfig.tiny(), 0))
    >>> prompt, completion = jnp.ones((2, 3), jnp.int32), jnp.ones((2, 4),
    ...                                                            jnp.int32)
    >>> token_logprobs(graphdef, params, prompt, prompt > 0, completion).shape
    (2, 4)
  """
  if isinstance(temperature, (int, float)) and temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}.")
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
  B, N = completion_ids_BxN.shape
  if completion_mask_BxN is None:
    completion_mask_BxN = jnp.ones((B, N), bool)
  hidden_BxNxD, model = _completion_forward(
      graphdef,
      params,
      prompt_ids_BxP,
      prompt_mask_BxP,
      completion_ids_BxN,
      completion_mask_BxN,
      context_mask_BxN,
  )
  w_DxV = model.unembedding()
  batch_invariant = model.config.batch_invariant
  scale = completion_logits_scale(temperature)

  C = min(chunk_size, N)
  n_chunks = -(-N // C)
  pad = n_chunks * C - N
  hidden_BxNxD = jnp.pad(hidden_BxNxD, ((0, 0), (0, pad), (0, 0)))
  targets_BxN = jnp.pad(
      completion_ids_BxN.astype(jnp.int32), ((0, 0), (0, pad))
  )
  D = hidden_BxNxD.shape[-1]
  hidden_nxBxCxD = hidden_BxNxD.reshape(B, n_chunks, C, D).swapaxes(0, 1)
  targets_nxBxC = targets_BxN.reshape(B, n_chunks, C).swapaxes(0, 1)

  @jax.checkpoint
  def chunk(args):
    hidden_BxCxD, targets_BxC = args
    # Under a mesh the unembedding is split along the vocabulary: gather this
    # chunk's hidden states over the model axes instead of the weight, so
    # each device computes its vocabulary slice of the logits (and of the
    # weight's gradient) for all of them.
    hidden_BxCxD = constrain(hidden_BxCxD, ("vocab_batch", None, None))
    logits_BxCxV = constrain(
        project_logits(hidden_BxCxD, w_DxV, batch_invariant) / scale,
        ("vocab_batch", None, "vocab"),
    )
    logp_BxCxV = jax.nn.log_softmax(logits_BxCxV, axis=-1)
    # A masked sum rather than a gather: it stays split by vocabulary. The
    # mask multiplies (exact: one term is kept, the others are zeros) rather
    # than selects: `where(mask, logp, 0)` broadcasts a constant zero that
    # does not depend on the chunk, which differentiating `lax.map` hoists
    # out of the loop as a [B, C, V] buffer alive for the whole loop.
    is_target_BxCxV = jnp.arange(logp_BxCxV.shape[-1]) == targets_BxC[..., None]
    logprobs_BxC = jnp.sum(
        logp_BxCxV * is_target_BxCxV.astype(jnp.float32), axis=-1
    )
    if not return_entropy:
      return (logprobs_BxC,)
    entropy_BxC = -jnp.sum(jnp.exp(logp_BxCxV) * logp_BxCxV, axis=-1)
    return logprobs_BxC, entropy_BxC

  outputs = jax.lax.map(chunk, (hidden_nxBxCxD, targets_nxBxC))
  keep_BxN = completion_mask_BxN.astype(bool)
  logprobs_BxN, *entropy_BxN = (
      jnp.where(keep_BxN, x_nxBxC.swapaxes(0, 1).reshape(B, -1)[:, :N], 0.0)
      for x_nxBxC in outputs
  )
  return (logprobs_BxN, *entropy_BxN) if return_entropy else logprobs_BxN
