"""Fused attention (`jax.nn.dot_product_attention`) against the chunked
einsums it replaces: every mask, GQA ratio, dtype and a sharded mesh; the
sampler's greedy outputs; settings a platform cannot run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import models
from logra_jax import parallel
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

VOCAB, LENGTH = 96, 37  # V splits over a mesh of 8

# Rows of real tokens (1) and padding (0): left-padded prompts, right-padded
# completions, both, and a row with holes.
MASKS = {
    "left": [[0] * 5 + [1] * 32, [1] * 37, [0] * 20 + [1] * 17],
    "right": [[1] * 30 + [0] * 7, [1] * 37, [1] * 3 + [0] * 34],
    "prompt_and_completion": [
        [0] * 4 + [1] * 25 + [0] * 8,
        [0] * 9 + [1] * 28,
        [1] * 33 + [0] * 4,
    ],
    "holes": [[0, 1, 1, 0, 1] * 7 + [1, 0], [1] * 37, [1, 0] * 18 + [1]],
}


def _config(kv_heads=2, dtype="float32", attention="chunked"):
  # attention_chunk 8 < LENGTH: the reference runs over query blocks.
  return models.DecoderConfig.tiny(
      vocab_size=VOCAB,
      num_kv_heads=kv_heads,
      attention_chunk=8,
      dtype=dtype,
      attention=attention,
  )


def _logits_and_grads(config, mask):
  graphdef, params = models.split_model(models.init_model(config, rngs=0))
  ids = jnp.asarray(
      np.random.RandomState(0).randint(1, VOCAB, mask.shape), jnp.int32
  )

  def loss(p):
    logits = models.logits_fn(graphdef, p, ids, attention_mask=mask)
    # Only real positions count: padding's outputs are never used.
    return jnp.sum(jnp.sin(logits) * mask[..., None]), logits

  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return logits, grads


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_fused_attention_equals_the_chunked_one(kv_heads):
  mask = jnp.asarray(sum(MASKS.values(), []), bool)  # every kind of row
  (ref_logits, ref_grads), (logits, grads) = (
      _logits_and_grads(_config(kv_heads, attention=attention), mask)
      for attention in ("chunked", "xla")
  )
  real = np.asarray(mask)[..., None]
  # The same float32 math in another order (tests/tolerances.py): 2 gamma_n
  # of the magnitude for the forward chain of n terms; gradients add the
  # backward chain and the B * T tokens they sum over.
  config = _config(kv_heads)
  forward = decoder_reduction_length(config, LENGTH)
  tol = 2 * float_tolerance(np.float32, forward)
  a, b = (np.asarray(x) * real for x in (ref_logits, logits))
  np.testing.assert_allclose(b, a, rtol=0, atol=tol * np.abs(a).max())
  tol = 2 * float_tolerance(np.float32, 2 * forward + mask.size)
  for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads)):
    assert np.isfinite(b).all()
    np.testing.assert_allclose(b, a, rtol=0, atol=tol * np.abs(a).max())


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_fused_attention_in_bfloat16_is_as_close_to_float32(kv_heads):
  """bfloat16 rounds every layer's activations (n u >= 1 for the chain, so
  no a-priori bound holds): the fused path must be no further from the
  float32 result than twice the chunked path's own bfloat16 error."""
  mask = jnp.asarray(MASKS["prompt_and_completion"], bool)
  real = np.asarray(mask)[..., None]
  exact, _ = _logits_and_grads(_config(kv_heads), mask)
  chunked, fused = (
      _logits_and_grads(_config(kv_heads, "bfloat16", attention), mask)[0]
      for attention in ("chunked", "xla")
  )
  error = lambda x: np.abs((np.asarray(x, np.float32) - exact) * real).max()
  assert 0 < error(fused) <= 2 * error(chunked)


def test_the_samplers_greedy_outputs_are_unchanged():
  """Prefill through the fused path (the mask over [cache; prompt]),
  decoding through the shared in-place reduction."""
  prompts = [[5, 6, 7], list(range(1, 20)), [9] * 11]
  outputs = []
  for attention in ("chunked", "xla"):
    model = models.init_model(_config(attention=attention), rngs=0)
    sampler = models.Sampler(model, max_length=64)
    _, params = models.split_model(model)
    out = sampler.sample(
        params,
        prompts,
        jax.random.key(0),
        max_new_tokens=12,
        temperature=0.0,
        stop_ids=(),
    )
    outputs.append(np.asarray(out.tokens))
  np.testing.assert_array_equal(outputs[1], outputs[0])


def test_fused_attention_on_a_mesh_equals_the_chunked_one_on_one_device():
  mesh = parallel.make_mesh(parallel.MeshConfig(fsdp=4, tp=2))
  mask = jnp.asarray(MASKS["prompt_and_completion"] * 4, bool)  # 12 rows
  ids = jnp.asarray(
      np.random.RandomState(1).randint(1, VOCAB, mask.shape), jnp.int32
  )
  results = []
  for attention, on_mesh in (("chunked", False), ("xla", True)):
    config = _config(kv_heads=2, attention=attention)
    graphdef, params = models.split_model(models.init_model(config, rngs=0))

    def logprobs(p, graphdef=graphdef):
      return models.token_logprobs(
          graphdef, p, ids[:, :20], mask[:, :20], ids[:, 20:], mask[:, 20:]
      )

    if on_mesh:
      params = jax.device_put(params, parallel.param_shardings(params, mesh))
      with parallel.activation_sharding(mesh, parallel.PARTITION_RULES):
        results.append(np.asarray(jax.jit(logprobs)(params)))
    else:
      results.append(np.asarray(jax.jit(logprobs)(params)))
  config = _config()
  n = decoder_reduction_length(config, LENGTH) + config.vocab_size
  scale = max(np.abs(results[0]).max(), np.log(VOCAB))
  np.testing.assert_allclose(
      results[1],
      results[0],
      rtol=0,
      atol=2 * float_tolerance(np.float32, n) * scale,
  )


def test_settings_a_platform_cannot_run_are_refused_or_noticed():
  choose = models.attention_implementation
  assert choose("auto", "float32", "cpu") == ("chunked", None)
  assert choose("auto", "bfloat16", "gpu") == ("cudnn", None)
  assert choose("xla", "float32", "tpu") == ("xla", None)
  # "auto" falling back on an accelerator says so, in one line.
  for platform, dtype, reason in (
      ("gpu", "float32", "not float32"),
      ("tpu", "bfloat16", "for GPUs"),
  ):
    implementation, notice = choose("auto", dtype, platform, "policy.attention")
    assert implementation == "chunked"
    assert notice.startswith("policy.attention=auto: chunked attention on")
    assert reason in notice and "\n" not in notice
  for platform, dtype in (
      ("cpu", "bfloat16"),
      ("gpu", "float32"),
      ("tpu", "bfloat16"),
  ):
    with pytest.raises(
        ValueError, match=f"platform is {platform} and the dtype {dtype}"
    ):
      choose("cudnn", dtype, platform)
  with pytest.raises(ValueError, match="attention must be one of"):
    _config(attention="flash")
  # On this CPU, a model built for cuDNN fails when traced, never silently
  # running another kernel.
  graphdef, params = models.split_model(
      models.init_model(_config(attention="cudnn"), 0)
  )
  with pytest.raises(ValueError, match="attention='cudnn' runs on GPUs"):
    models.logits_fn(graphdef, params, jnp.ones((1, 4), jnp.int32))
