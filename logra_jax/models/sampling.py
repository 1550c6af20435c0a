"""Jitted autoregressive sampler over a fixed-size KV cache.

Prompts of different lengths are left-padded into a length bucket (the next
multiple of `bucket_size`), prefilled in one pass, then decoded one token per
step inside `lax.while_loop`. One compiled function is kept per
`(batch, prompt bucket, max_new_tokens, temperature, top_k, top_p)`; stop ids
are a runtime argument (padded to a multiple of 8 slots), so changing them
does not recompile.

Log-prob convention: the sampler records `log softmax(logits / temperature)`
at the sampled token, *before* top-k / top-p truncation; for greedy decoding
(temperature 0) it records the temperature-1 log-prob. `token_logprobs` uses
the same convention.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import reduction
from logra_jax.models.cache import init_cache
from logra_jax.models.cache import KVCache
from logra_jax.models.decoder import Decoder
from logra_jax.models.decoder import project_logits
from logra_jax.models.decoder import split_model
from logra_jax.models.logprobs import completion_logits_scale
from logra_jax.parallel.sharding import activation_sharding
from logra_jax.parallel.sharding import logical_to_mesh
from logra_jax.parallel.sharding import param_shardings
from logra_jax.parallel.sharding import PARTITION_RULES

_STOP_SLOTS = 8


class SampleOutput(NamedTuple):
  """Result of `Sampler.sample` (all arrays; a pytree).

  Attributes:
    prompt_ids: `[B, P]` left-padded prompts (P is the bucket length).
    prompt_mask: `[B, P]` 1 for real prompt tokens.
    tokens: `[B, N]` completions; after a stop id, `pad_id`.
    mask: `[B, N]` 1 for generated tokens, including the stop token itself.
    lengths: `[B]` number of generated tokens (`mask.sum(-1)`).
    logprobs: `[B, N]` float32 sampler log-probs (0 where `mask` is 0).
  """

  prompt_ids: jax.Array
  prompt_mask: jax.Array
  tokens: jax.Array
  mask: jax.Array
  lengths: jax.Array
  logprobs: jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Sampling settings (all but `stop_ids` are part of the compile key).

  Attributes:
    max_new_tokens: N >= 1.
    temperature: 0 is greedy; must be >= 0.
    top_k: keep the k most likely tokens; 0 disables.
    top_p: nucleus mass in (0, 1]; 1 disables.
    stop_ids: generation of a row ends after any of these tokens.
  """

  max_new_tokens: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(
          f"max_new_tokens must be >= 1, got {self.max_new_tokens}."
      )
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}.")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
    object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))


def pad_prompts(
    prompts: Sequence[Sequence[int]], length: int, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token lists into `[B, length]` ids and a 0/1 mask.

  Args:
    prompts: B non-empty token lists, each at most `length` long.
    length: the padded length.
    pad_id: the filler id.

  Returns:
    `(ids_BxP, mask_BxP)` int32 numpy arrays.

  Example:
    >>> pad_prompts([[5, 6], [7]], 3)[0].tolist()
    [[0, 5, 6], [0, 0, 7]]
  """
  ids = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), np.int32)
  for row, prompt in enumerate(prompts):
    if len(prompt):
      ids[row, length - len(prompt) :] = prompt
      mask[row, length - len(prompt) :] = 1
  return ids, mask


def _argmax(x_BxV: jax.Array) -> jax.Array:
  """First index of the row maximum (as `jnp.argmax`).

  Written as max + masked min because XLA:CPU's fused variadic argmax
  reduction is several times slower here, and it runs at every step.
  """
  iota_V = jnp.arange(x_BxV.shape[-1], dtype=jnp.int32)
  is_max_BxV = x_BxV == jnp.max(x_BxV, axis=-1, keepdims=True)
  first_B = jnp.min(jnp.where(is_max_BxV, iota_V, x_BxV.shape[-1]), axis=-1)
  return jnp.minimum(first_B, x_BxV.shape[-1] - 1)  # All-NaN rows: stay valid.


def sample_token(
    logits_BxV: jax.Array, key: jax.Array, params: SamplingParams
) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row; returns `(tokens_B, logprobs_B)`.

  The log-prob is taken from the untruncated `softmax(logits / temperature)`
  (temperature 1 for greedy).

  Args:
    logits_BxV: float32 logits.
    key: PRNG key.
    params: sampling settings.

  Returns:
    The int32 tokens and their float32 log-probs.

  Example:
    >>> sample_token(jnp.array([[0., 5.]]), jax.random.key(0),
    ...              SamplingParams(1, temperature=0.0))[0].tolist()
    [1]
  """
  scaled_BxV = logits_BxV / completion_logits_scale(params.temperature)
  logp_BxV = jax.nn.log_softmax(scaled_BxV, axis=-1)
  if params.temperature == 0:
    tokens_B = _argmax(logits_BxV)
  elif params.top_k == 0 and params.top_p == 1:
    tokens_B = _argmax(scaled_BxV + jax.random.gumbel(key, scaled_BxV.shape))
  else:
    if params.top_k:
      kept_BxK, index_BxK = jax.lax.top_k(
          scaled_BxV, min(params.top_k, scaled_BxV.shape[-1])
      )
    else:
      index_BxK = jnp.argsort(-scaled_BxV, axis=-1)
      kept_BxK = jnp.take_along_axis(scaled_BxV, index_BxK, axis=-1)
    if params.top_p < 1:
      probs_BxK = jax.nn.softmax(kept_BxK, axis=-1)
      mass_before_BxK = jnp.cumsum(probs_BxK, axis=-1) - probs_BxK
      kept_BxK = jnp.where(mass_before_BxK < params.top_p, kept_BxK, -jnp.inf)
    choice_B = _argmax(kept_BxK + jax.random.gumbel(key, kept_BxK.shape))
    tokens_B = jnp.take_along_axis(index_BxK, choice_B[:, None], axis=-1)[:, 0]
  tokens_B = tokens_B.astype(jnp.int32)
  logprobs_B = jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]
  return tokens_B, logprobs_B


class Sampler:
  """Batched sampler with one compiled program per shape and setting.

  Args:
    model: the decoder; only its structure and config are kept (weights go
      in through `params` at each call, so new weights never recompile).
    max_length: cache size limit: prompt bucket + `max_new_tokens` must fit;
      default `config.max_position_embeddings`.
    bucket_size: prompts are left-padded to the next multiple of this.
    pad_id: filler for prompts and for completion slots after a stop.
    mesh: optional device mesh; under it the program is jitted with
      explicit shardings: weights by their logical axes, prompts, outputs
      and activations split along the batch (`sample` pads the batch to a
      multiple of the data axes with copies of its first prompt).
    rules: logical axis -> mesh axes under `mesh`; default
      `logra_jax.parallel.PARTITION_RULES`.

  Attributes:
    num_traces: how many times a sampling program was traced (compiled);
      a repeated call with the same shapes and settings leaves it unchanged.

  Example:
    >>> from logra_jax.models import DecoderConfig, init_model, split_model
    >>> model = init_model(DecoderConfig.tiny(), 0)
    >>> graphdef, params = split_model(model)
    >>> sampler = Sampler(model)
    >>> out = sampler.sample(params, [[1, 2, 3], [4]], jax.random.key(0),
    ...                      max_new_tokens=5, temperature=0.7, top_p=0.9)
    >>> out.tokens.shape
    (2, 5)
  """

  def __init__(
      self,
      model: Decoder,
      *,
      max_length: int | None = None,
      bucket_size: int = 16,
      pad_id: int = 0,
      mesh: jax.sharding.Mesh | None = None,
      rules: dict[str, Any] | None = None,
  ):
    if bucket_size < 1:
      raise ValueError(f"bucket_size must be >= 1, got {bucket_size}.")
    if mesh is None and rules is not None:
      raise ValueError("rules lay out a mesh: give the mesh too.")
    if mesh is not None and rules is None:
      rules = PARTITION_RULES
    self.mesh, self.rules = mesh, rules
    self.graphdef, params = split_model(model)
    self._params_sharding = (
        None if mesh is None else param_shardings(params, mesh, rules)
    )
    self._params_structure = jax.tree.structure(params)
    self.config = model.config
    self.max_length = max_length or self.config.max_position_embeddings
    self.bucket_size = bucket_size
    self.pad_id = pad_id
    self._compiled: dict[tuple[Any, ...], Callable[..., SampleOutput]] = {}
    self.num_traces = 0

  def bucket_length(self, longest_prompt: int, max_new_tokens: int) -> int:
    """The padded prompt length P for a batch whose longest prompt is given."""
    room = self.max_length - max_new_tokens
    if longest_prompt > room:
      raise ValueError(
          f"Prompt of {longest_prompt} tokens plus max_new_tokens="
          f"{max_new_tokens} does not fit the cache of {self.max_length} "
          "tokens."
      )
    bucket = -(-longest_prompt // self.bucket_size) * self.bucket_size
    return min(bucket, room)

  def sample(
      self,
      params: nnx.State,
      prompts: Sequence[Sequence[int]],
      key: jax.Array,
      *,
      max_new_tokens: int,
      temperature: float = 1.0,
      top_k: int = 0,
      top_p: float = 1.0,
      stop_ids: Sequence[int] | None = None,
  ) -> SampleOutput:
    """Samples completions of token-list prompts.

    Args:
      params: from `split_model`, or a tree of `lowrank.LowRankDelta` views
        of them (factored or adapted weights, applied without forming them).
      prompts: B non-empty token lists of any lengths.
      key: PRNG key; same key, params and prompts give the same output.
      max_new_tokens: N.
      temperature: 0 for greedy.
      top_k: 0 disables.
      top_p: 1 disables.
      stop_ids: default `config.eos_token_ids`; pass `()` to never stop.

    Returns:
      A `SampleOutput`.
    """
    settings = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_ids=tuple(
            self.config.eos_token_ids if stop_ids is None else stop_ids
        ),
    )
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("Every prompt needs at least one token.")
    length = self.bucket_length(max(len(p) for p in prompts), max_new_tokens)
    rows = len(prompts)
    if self.mesh is not None:  # the data axes must divide the batch
      axes = self.rules.get("batch") or ()
      multiple = int(
          np.prod(
              [
                  self.mesh.shape[a]
                  for a in ((axes,) if isinstance(axes, str) else axes)
              ]
          )
      )
      prompts = list(prompts) + [prompts[0]] * (-rows % multiple)
    ids, mask = pad_prompts(prompts, length, self.pad_id)
    out = self.sample_padded(params, ids, mask, key, settings)
    return (
        out if len(prompts) == rows else jax.tree.map(lambda x: x[:rows], out)
    )

  def sample_padded(
      self,
      params: nnx.State,
      prompt_ids_BxP: Any,
      prompt_mask_BxP: Any,
      key: jax.Array,
      settings: SamplingParams,
  ) -> SampleOutput:
    """Samples from prompts already left-padded to `[B, P]`.

    Args:
      params: from `split_model`.
      prompt_ids_BxP: left-padded ids (the last column holds real tokens).
      prompt_mask_BxP: 1 for real prompt tokens.
      key: PRNG key.
      settings: the sampling settings.

    Returns:
      A `SampleOutput`.
    """
    program, args = self._program(
        params, prompt_ids_BxP, prompt_mask_BxP, key, settings
    )
    return program(*args)

  def lower_padded(
      self,
      params: nnx.State,
      prompt_ids_BxP: Any,
      prompt_mask_BxP: Any,
      key: jax.Array,
      settings: SamplingParams,
  ) -> jax.stages.Lowered:
    """The very program `sample_padded` runs for these inputs, lowered: its
    ``compile()`` after a call with the same shapes is the program already
    compiled (no second compilation), e.g. to read its memory analysis.

    Example:
      >>> from logra_jax.models import DecoderConfig, init_model, split_model
      >>> model = init_model(DecoderConfig.tiny(), 0)
      >>> sampler = Sampler(model)
      >>> ids, mask = pad_prompts([[1, 2, 3]], 16, 0)
      >>> settings = SamplingParams(max_new_tokens=4)
      >>> lowered = sampler.lower_padded(split_model(model)[1], ids, mask,
      ...                                jax.random.key(0), settings)
      >>> lowered.compile().memory_analysis().temp_size_in_bytes > 0
      True
    """
    program, args = self._program(
        params, prompt_ids_BxP, prompt_mask_BxP, key, settings
    )
    return program.lower(*args)

  def _program(self, params, prompt_ids_BxP, prompt_mask_BxP, key, settings):
    """The jitted sampling program for these shapes and settings (one per
    shape and setting, kept) and its arguments."""
    B, P = np.shape(prompt_ids_BxP)
    if P + settings.max_new_tokens > self.max_length:
      raise ValueError(
          f"Prompt of {P} tokens plus max_new_tokens="
          f"{settings.max_new_tokens} does not fit the cache of "
          f"{self.max_length} tokens."
      )
    n_stop = -(-max(len(settings.stop_ids), 1) // _STOP_SLOTS) * _STOP_SLOTS
    stop_ids = np.full((n_stop,), -1, np.int32)
    stop_ids[: len(settings.stop_ids)] = settings.stop_ids
    static = dataclasses.replace(settings, stop_ids=())
    # Params of another structure (views of factored or adapted weights,
    # ``lowrank.LowRankDelta``) keep the shardings they have.
    laid_out = jax.tree.structure(params) == self._params_structure
    compile_key = (B, P, n_stop, static, laid_out)
    if compile_key not in self._compiled:
      self._compiled[compile_key] = self._jit(static, laid_out)
    return self._compiled[compile_key], (
        params,
        jnp.asarray(prompt_ids_BxP, jnp.int32),
        jnp.asarray(prompt_mask_BxP, bool),
        jnp.asarray(stop_ids),
        key,
    )

  def _jit(
      self, settings: SamplingParams, laid_out: bool = True
  ) -> Callable[..., SampleOutput]:
    """The sampling program; under a mesh, with explicit shardings: params
    by the partition rules (``laid_out``; otherwise as they are), prompts
    and outputs split along the batch."""
    options = (
        reduction.CPU_SAMPLER_OPTIONS
        if self.config.batch_invariant and jax.default_backend() == "cpu"
        else None
    )
    if self.mesh is None:
      return jax.jit(
          lambda *args: self.generate(*args, settings),
          compiler_options=options,
      )
    rows = lambda ndim: logical_to_mesh(
        ("batch",) + (None,) * (ndim - 1), self.mesh, self.rules
    )
    replicated = logical_to_mesh((), self.mesh, self.rules)

    def generate(*args):
      with activation_sharding(self.mesh, self.rules):
        return self.generate(*args, settings)

    outputs = SampleOutput(
        *(rows(2) for _ in range(4)), lengths=rows(1), logprobs=rows(2)
    )
    return jax.jit(
        generate,
        in_shardings=(
            self._params_sharding if laid_out else None,
            rows(2),
            rows(2),
            replicated,
            replicated,
        ),
        out_shardings=outputs,
        compiler_options=options,
    )

  def generate(
      self,
      params: nnx.State,
      prompt_ids_BxP: jax.Array,
      prompt_mask_BxP: jax.Array,
      stop_ids: jax.Array,
      key: jax.Array,
      settings: SamplingParams,
  ) -> SampleOutput:
    """The sampling program's body, to be traced under `jax.jit` (as
    `sample` does; the memory planner compiles it on abstract inputs):
    prefill, then a while loop of single-token steps. The KV cache is made
    inside it.

    `stop_ids` is padded with -1, which no token equals.
    """
    self.num_traces += 1
    model = nnx.merge(self.graphdef, params)
    B, P = prompt_ids_BxP.shape
    N = settings.max_new_tokens
    w_DxV = model.unembedding()

    cache = init_cache(self.config, B, P + N - 1)
    hidden_BxPxD, cache = model.hidden_states(
        prompt_ids_BxP,
        attention_mask=prompt_mask_BxP,
        cache=cache,
        prefill=True,
    )
    invariant = self.config.batch_invariant
    logits_BxV = project_logits(hidden_BxPxD[:, -1:], w_DxV, invariant)[:, 0]

    def body(state: _Decoding) -> _Decoding:
      state, token_B, live_B = _emit(
          state, key, stop_ids, settings, self.pad_id
      )
      hidden_Bx1xD, cache = model.hidden_states(
          token_B[:, None], attention_mask=live_B[:, None], cache=state.cache
      )
      logits_BxV = project_logits(hidden_Bx1xD, w_DxV, invariant)[:, 0]
      return state._replace(
          step=state.step + 1, cache=cache, logits_BxV=logits_BxV
      )

    def cond(state: _Decoding) -> jax.Array:
      return (state.step < N - 1) & ~jnp.all(state.done_B)

    state = _Decoding(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        logits_BxV=logits_BxV,
        done_B=jnp.zeros((B,), bool),
        tokens_BxN=jnp.full((B, N), self.pad_id, jnp.int32),
        mask_BxN=jnp.zeros((B, N), bool),
        logprobs_BxN=jnp.zeros((B, N), jnp.float32),
    )
    state = jax.lax.while_loop(cond, body, state)
    # The last token needs no forward pass after it (when every row stopped
    # early, this writes one more padding slot).
    state, _, _ = _emit(state, key, stop_ids, settings, self.pad_id)
    tokens_BxN, mask_BxN = state.tokens_BxN, state.mask_BxN
    return SampleOutput(
        prompt_ids=prompt_ids_BxP,
        prompt_mask=prompt_mask_BxP.astype(jnp.int32),
        tokens=tokens_BxN,
        mask=mask_BxN.astype(jnp.int32),
        lengths=jnp.sum(mask_BxN, axis=-1, dtype=jnp.int32),
        logprobs=state.logprobs_BxN,
    )


class _Decoding(NamedTuple):
  """The sampler's loop carry: the step, the cache, the logits of the next
  token, which rows stopped, and the tokens, mask and log-probs so far."""

  step: jax.Array
  cache: KVCache
  logits_BxV: jax.Array
  done_B: jax.Array
  tokens_BxN: jax.Array
  mask_BxN: jax.Array
  logprobs_BxN: jax.Array


def _emit(
    state: _Decoding,
    key: jax.Array,
    stop_ids: jax.Array,
    settings: SamplingParams,
    pad_id: int,
) -> tuple[_Decoding, jax.Array, jax.Array]:
  """Samples the token of ``state.step`` and writes it: ``(state, token_B,
  live_B)``, padding in the rows that had stopped."""
  token_B, logprob_B = sample_token(
      state.logits_BxV, jax.random.fold_in(key, state.step), settings
  )
  live_B = ~state.done_B
  token_B = jnp.where(live_B, token_B, pad_id)
  state = state._replace(
      tokens_BxN=state.tokens_BxN.at[:, state.step].set(token_B),
      mask_BxN=state.mask_BxN.at[:, state.step].set(live_B),
      logprobs_BxN=state.logprobs_BxN.at[:, state.step].set(
          jnp.where(live_B, logprob_B, 0.0)
      ),
      done_B=state.done_B | jnp.isin(token_B, stop_ids),
  )
  return state, token_B, live_B
