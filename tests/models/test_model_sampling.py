"""Sampler vs `transformers.generate`, log-prob consistency, compile cache."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from logra_jax import models
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

PROMPTS = [[5, 17, 3, 44, 9, 61, 2], [8], [33, 12, 90]]
token_logprobs = jax.jit(
    models.token_logprobs, static_argnums=0, static_argnames=("chunk_size",)
)


N = 12  # Most tests share one compiled sampler per setting.


@pytest.fixture(scope="module")
def samplers(loaded):
  return {
      name: models.Sampler(model, bucket_size=8)
      for name, model in loaded.items()
  }


@pytest.fixture(scope="module")
def qwen3(samplers, loaded):
  return samplers["qwen3"], *models.split_model(loaded["qwen3"])


def test_greedy_matches_hf_generate(family, checkpoints, loaded, samplers):
  """Ragged batch == HF greedy generate, per prompt and left-padded batched."""
  _, params = models.split_model(loaded[family])
  out = samplers[family].sample(
      params,
      PROMPTS,
      jax.random.key(0),
      max_new_tokens=N,
      temperature=0.0,
      stop_ids=(),
  )
  torch_model = checkpoints[family].torch_model
  settings = dict(
      do_sample=False, max_new_tokens=N, min_new_tokens=N, pad_token_id=0
  )
  for row, prompt in enumerate(PROMPTS):
    ref = torch_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        **settings,
    )
    assert out.tokens[row].tolist() == ref[0, len(prompt) :].tolist()
  ids, mask = models.pad_prompts(PROMPTS, 8)
  np.testing.assert_array_equal(out.prompt_ids, ids)
  np.testing.assert_array_equal(out.prompt_mask, mask)
  batched = torch_model.generate(
      torch.tensor(ids, dtype=torch.long),
      attention_mask=torch.tensor(mask),
      **settings,
  )
  np.testing.assert_array_equal(out.tokens, batched[:, 8:].numpy())
  assert out.mask.tolist() == [[1] * N] * 3 and out.lengths.tolist() == [N] * 3


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7, top_k=10, top_p=0.9),
        dict(temperature=0.0),
    ],
)
def test_sampler_logprobs_equal_token_logprobs(qwen3, settings):
  sampler, graphdef, params = qwen3
  out = sampler.sample(
      params,
      PROMPTS,
      jax.random.key(1),
      max_new_tokens=N,
      stop_ids=(7, 11, 13),
      **settings,
  )
  lp = token_logprobs(
      graphdef,
      params,
      out.prompt_ids,
      out.prompt_mask,
      out.tokens,
      out.mask,
      chunk_size=5,
      temperature=settings["temperature"],
  )
  valid = np.asarray(out.mask) > 0
  assert (np.asarray(out.logprobs)[valid] < 0).all()
  assert (np.asarray(out.logprobs)[~valid] == 0).all()
  # Cached decoding and one full forward sum in other orders: the bound of
  # tests/tolerances.py for the forward chain and the softmax over V,
  # relative to the log-probs (>= log V here, above the tiny model's logits).
  n = sampler.config.vocab_size + decoder_reduction_length(
      sampler.config, out.prompt_ids.shape[1] + N
  )
  np.testing.assert_allclose(
      lp,
      out.logprobs,
      rtol=0,
      atol=2 * float_tolerance(np.float32, n) * np.abs(lp).max(),
  )


@pytest.mark.parametrize(
    "settings, allowed",
    [
        (dict(temperature=0.5), 8),
        (dict(temperature=0.5, top_k=3), 3),
        (dict(temperature=2.0, top_p=0.6), None),
        (dict(temperature=0.5, top_k=5, top_p=0.8), None),
    ],
)
def test_sample_token_frequencies_match_truncated_softmax(settings, allowed):
  """20k rows with the same logits: empirical frequencies vs the target."""
  logits_V = jnp.asarray([1.0, 3.0, -2.0, 2.5, 0.0, 2.9, -1.0, 1.5])
  rows = 20_000
  params = models.SamplingParams(max_new_tokens=1, **settings)
  tokens, logprobs = jax.jit(models.sample_token, static_argnums=2)(
      jnp.broadcast_to(logits_V, (rows, 8)), jax.random.key(7), params
  )
  scaled = np.asarray(logits_V, np.float64) / settings["temperature"]
  probs = np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()
  order = np.argsort(-probs)
  keep = np.zeros(8, bool)
  top_k = settings.get("top_k") or 8
  kept = probs[order[:top_k]] / probs[order[:top_k]].sum()
  before = np.cumsum(kept) - kept
  keep[order[:top_k][before < settings.get("top_p", 1.0)]] = True
  assert allowed is None or keep.sum() == allowed
  target = np.where(keep, probs, 0) / probs[keep].sum()
  freq = np.bincount(np.asarray(tokens), minlength=8) / rows
  np.testing.assert_allclose(freq, target, atol=0.012)
  assert (freq[~keep] == 0).all()
  # Log-probs are those of the untruncated tempered softmax.
  np.testing.assert_allclose(
      logprobs, np.log(probs)[np.asarray(tokens)], atol=1e-5
  )


def test_sample_token_greedy_uses_temperature_one_logprobs():
  logits_BxV = jnp.asarray([[0.0, 2.0, 1.0], [3.0, 3.0, -1.0]])
  tokens, logprobs = models.sample_token(
      logits_BxV, jax.random.key(0), models.SamplingParams(1, temperature=0)
  )
  assert tokens.tolist() == [1, 0]  # Ties go to the first index.
  np.testing.assert_allclose(
      logprobs,
      [
          jax.nn.log_softmax(logits_BxV[0])[1],
          jax.nn.log_softmax(logits_BxV[1])[0],
      ],
      atol=1e-6,
  )


def test_stop_ids_end_rows(qwen3):
  sampler, _, params = qwen3
  free = sampler.sample(
      params,
      PROMPTS,
      jax.random.key(3),
      max_new_tokens=N,
      temperature=0.0,
      stop_ids=(),
  )
  stop = int(free.tokens[0, 2])
  traces = sampler.num_traces
  out = sampler.sample(
      params,
      PROMPTS,
      jax.random.key(3),
      max_new_tokens=N,
      temperature=0.0,
      stop_ids=(stop, 1000),
  )
  assert sampler.num_traces == traces  # Stop ids are not compiled in.
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
  assert mask[0].tolist() == [1, 1, 1] + [0] * (N - 3)
  assert tokens[0, :3].tolist() == free.tokens[0, :3].tolist()
  assert (tokens[0, 3:] == 0).all() and (out.logprobs[0, 3:] == 0).all()
  for row in range(3):
    n = int(out.lengths[row])
    assert mask[row].sum() == n and mask[row, :n].all()
    np.testing.assert_array_equal(tokens[row, :n], free.tokens[row, :n])
    hits = np.flatnonzero(tokens[row, :n] == stop)
    assert n == N or hits.tolist() == [n - 1]


def test_deterministic_and_no_recompile(qwen3, caplog):
  sampler, _, params = qwen3
  # The settings of test_sampler_logprobs_equal_token_logprobs[settings0].
  kwargs = dict(
      max_new_tokens=N,
      temperature=0.7,
      top_k=10,
      top_p=0.9,
      stop_ids=(7, 11, 13),
  )
  a = sampler.sample(params, PROMPTS, jax.random.key(4), **kwargs)
  traces = sampler.num_traces
  assert traces >= 1
  b = sampler.sample(params, PROMPTS, jax.random.key(4), **kwargs)
  new_params = jax.tree.map(lambda x: x * 1.01, params)
  c = sampler.sample(
      new_params, [[1, 2, 3, 4, 5], [3], [4]], jax.random.key(5), **kwargs
  )
  other = sampler.sample(params, PROMPTS, jax.random.key(6), **kwargs)
  assert sampler.num_traces == traces  # Same shapes: no new trace.
  # And jax's own cache holds one executable per compiled program.
  assert {f._cache_size() for f in sampler._compiled.values()} == {1}
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.logprobs, b.logprobs)
  assert not np.array_equal(a.tokens, c.tokens)
  assert not np.array_equal(a.tokens, other.tokens)
  # `lower_padded` is the program just run: no new trace or executable.
  length = sampler.bucket_length(max(map(len, PROMPTS)), N)
  ids, mask = models.pad_prompts(PROMPTS, length, sampler.pad_id)
  settings = models.SamplingParams(**kwargs)
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    compiled = sampler.lower_padded(
        params, ids, mask, jax.random.key(4), settings
    ).compile()
  assert not [r for r in caplog.records if "Compiling" in r.getMessage()]
  assert sampler.num_traces == traces
  assert compiled.memory_analysis().temp_size_in_bytes > 0


def test_token_logprobs_chunked_equals_full_softmax_with_grads(qwen3):
  sampler, graphdef, params = qwen3
  rng = np.random.RandomState(0)
  prompt, completion = rng.randint(0, 101, (2, 5)), rng.randint(0, 101, (2, 9))
  prompt_mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
  completion_mask = np.array([[1] * 9, [1] * 6 + [0] * 3])
  temperature = 0.8

  def chunked(p):
    return models.token_logprobs(
        graphdef,
        p,
        prompt,
        prompt_mask,
        completion,
        completion_mask,
        temperature=temperature,
        chunk_size=4,
        return_entropy=True,
    )

  def full(p):
    ids = jnp.concatenate([prompt, completion], 1)
    mask = jnp.concatenate([prompt_mask, completion_mask], 1)
    logits = models.logits_fn(graphdef, p, ids, attention_mask=mask)[:, 4:-1]
    logp = jax.nn.log_softmax(logits / temperature)
    lp = jnp.take_along_axis(logp, jnp.asarray(completion)[..., None], -1)[
        ..., 0
    ]
    ent = -jnp.sum(jnp.exp(logp) * logp, -1)
    return lp * completion_mask, ent * completion_mask

  @jax.jit
  def both(p):
    loss = lambda f: lambda q: jnp.sum(f(q)[0] ** 2)  # noqa: E731
    return (
        chunked(p),
        full(p),
        jax.grad(loss(chunked))(p),
        jax.grad(loss(full))(p),
    )

  (lp, ent), (lp_ref, ent_ref), g, g_ref = both(params)
  # Chunks sum in another order: the bound of tests/tolerances.py for the
  # forward chain and the sums over V, relative to the log-probs (>= log V
  # here, above the tiny model's logits); gradients add the backward chain
  # and the sum over the tokens.
  n = sampler.config.vocab_size + decoder_reduction_length(sampler.config, 14)
  tol = 2 * float_tolerance(np.float32, n) * np.abs(lp_ref).max()
  np.testing.assert_allclose(lp, lp_ref, rtol=0, atol=tol)
  np.testing.assert_allclose(ent, ent_ref, rtol=0, atol=tol)
  assert (lp[1, 6:] == 0).all() and (ent[1, 6:] == 0).all()
  tol = 2 * float_tolerance(np.float32, 2 * n + completion.size)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(top_k=-1), "top_k must be >= 0"),
        (dict(max_new_tokens=60), "does not fit the cache of 64"),
    ],
)
def test_sampler_rejects_bad_settings(loaded, kwargs, match):
  sampler = models.Sampler(loaded["qwen2"], max_length=64)
  _, params = models.split_model(loaded["qwen2"])
  kwargs = {"max_new_tokens": 4, **kwargs}
  with pytest.raises(ValueError, match=match):
    sampler.sample(params, PROMPTS, jax.random.key(0), **kwargs)


def test_sampler_rejects_empty_and_too_long_prompts(loaded):
  sampler = models.Sampler(loaded["qwen2"], max_length=16)
  _, params = models.split_model(loaded["qwen2"])
  with pytest.raises(ValueError, match="at least one token"):
    sampler.sample(params, [[1], []], jax.random.key(0), max_new_tokens=2)
  with pytest.raises(ValueError, match="Prompt of 15 tokens"):
    sampler.sample(params, [[1] * 15], jax.random.key(0), max_new_tokens=2)
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    models.token_logprobs(
        *models.split_model(loaded["qwen2"]),
        jnp.ones((1, 2), jnp.int32),
        jnp.ones((1, 2)),
        jnp.ones((1, 2), jnp.int32),
        temperature=-1.0,
    )
