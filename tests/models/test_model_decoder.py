"""Decoder parity with PyTorch `transformers`, cache, masks, pure functions."""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from logra_jax import models
from logra_jax import parallel
from logra_jax import policy_state
from logra_jax.optim import DimensionNumbers
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

ATOL = 1e-4
VOCAB = 101  # conftest's checkpoints.


_logits = jax.jit(models.logits_fn, static_argnums=0)
_step = nnx.jit(lambda m, x, a, c: m(x, attention_mask=a, cache=c))


def forward(model, ids, **kwargs):
  """Jitted logits of `model` (eager NNX calls re-trace the layer scan)."""
  graphdef, params = models.split_model(model)
  return np.asarray(
      _logits(graphdef, params, jnp.asarray(ids, jnp.int32), **kwargs)
  )


def _ids(batch, length, seed=0):
  return np.random.RandomState(seed).randint(0, VOCAB, (batch, length))


def test_full_forward_matches_hf(family, checkpoints, loaded):
  name = family
  ids = _ids(2, 24)
  ours = forward(loaded[name], ids)
  ref = checkpoints[name].logits(ids)
  assert ours.dtype == np.float32 and ours.shape == (2, 24, VOCAB)
  assert np.abs(ref).max() > 1.0  # The comparison is not trivially small.
  np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


def test_cached_decode_matches_hf(family, checkpoints, loaded):
  name = family
  model = loaded[name]
  ids = _ids(2, 12, seed=1)
  cache = models.init_cache(model.config, batch_size=2, max_length=12)
  ones = jnp.ones((2, 8), jnp.int32)
  logits, cache = _step(model, jnp.asarray(ids[:, :8], jnp.int32), ones, cache)
  chunks = [logits]
  for t in range(8, 12):
    logits, cache = _step(
        model, jnp.asarray(ids[:, t : t + 1], jnp.int32), ones[:, :1], cache
    )
    chunks.append(logits)
  assert int(cache.index) == 12 and bool(cache.mask[:, :12].all())
  np.testing.assert_allclose(
      np.concatenate(chunks, 1),
      checkpoints[name].logits(ids),
      atol=ATOL,
      rtol=0,
  )


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_hf(side, checkpoints, loaded):
  name = "qwen3"
  lengths, T = [10, 4, 7], 10
  ids = _ids(3, T, seed=2)
  mask = np.zeros((3, T), np.int64)
  for row, n in enumerate(lengths):
    if side == "left":
      mask[row, T - n :] = 1
    else:
      mask[row, :n] = 1
  positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
  ours = forward(loaded[name], ids, attention_mask=jnp.asarray(mask))
  ref = checkpoints[name].logits(
      ids, attention_mask=mask, position_ids=positions
  )
  valid = mask.astype(bool)
  assert np.isfinite(ours).all()
  np.testing.assert_allclose(ours[valid], ref[valid], atol=ATOL, rtol=0)


def test_left_padded_cached_decode_matches_unpadded(checkpoints, loaded):
  """Each row of a left-padded cached batch equals the row run alone."""
  name = "llama_gqa_llama3"
  model = loaded[name]
  prompts = [_ids(1, n, seed=n)[0] for n in (6, 3)]
  ids, mask = models.pad_prompts(prompts, 8)
  cache = models.init_cache(model.config, batch_size=2, max_length=12)
  _, cache = _step(model, jnp.asarray(ids), jnp.asarray(mask), cache)
  nxt = np.array([[5], [9]])
  logits, cache = _step(
      model, jnp.asarray(nxt, jnp.int32), jnp.ones((2, 1), jnp.int32), cache
  )
  assert cache.mask.sum(1).tolist() == [7, 4]
  for row, prompt in enumerate(prompts):
    alone = checkpoints[name].logits([list(prompt) + [int(nxt[row, 0])]])
    np.testing.assert_allclose(logits[row, -1], alone[0, -1], atol=ATOL)


def test_a_prefill_into_an_empty_cache_is_the_forward_pass_without_one():
  """``prefill=True`` reads only the new keys (no score over the empty
  slots): the hidden states of the forward pass without a cache, the same
  keys and values written as a prefill over the whole cache writes, and the
  next token decodes alike."""
  config = models.DecoderConfig.tiny(vocab_size=VOCAB)
  model = models.init_model(config, rngs=0)
  ids, mask = models.pad_prompts([_ids(1, 6, 1)[0], _ids(1, 3, 2)[0]], 8)
  ids, mask = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)
  empty = models.init_cache(config, batch_size=2, max_length=12)
  run = nnx.jit(
      lambda m, cache, prefill: m.hidden_states(
          ids, attention_mask=mask, cache=cache, prefill=prefill
      ),
      static_argnums=2,
  )
  plain, _ = run(model, None, False)
  short, filled = run(model, empty, True)
  long, reference = run(model, empty, False)
  # Hidden states are RMS-normed (magnitude ~1 per element).
  n = decoder_reduction_length(config, 12)
  tol = 2 * float_tolerance(jnp.float32, n) * np.sqrt(config.hidden_size)
  valid = np.asarray(mask)
  for got in (short, long):
    np.testing.assert_allclose(
        np.asarray(got)[valid], np.asarray(plain)[valid], atol=tol, rtol=0
    )
  np.testing.assert_array_equal(filled.mask, reference.mask)
  assert int(filled.index) == int(reference.index) == 8
  slots = lambda kv: np.asarray(kv).transpose(1, 3, 0, 2, 4)[filled.mask]
  for got, want in ((filled.k, reference.k), (filled.v, reference.v)):
    np.testing.assert_allclose(slots(got), slots(want), atol=tol, rtol=0)
  nxt = jnp.asarray([[5], [9]], jnp.int32)
  after = [
      _step(model, nxt, jnp.ones((2, 1), jnp.int32), c)[0]
      for c in (filled, reference)
  ]
  np.testing.assert_allclose(after[0], after[1], atol=ATOL, rtol=0)
  with pytest.raises(ValueError, match="prefill=True writes into a cache"):
    model.hidden_states(ids, attention_mask=mask, prefill=True)


def test_config_from_hf_fields(checkpoints):
  cfg = lambda n: models.DecoderConfig.from_hf(  # noqa: E731
      transformers.AutoConfig.from_pretrained(checkpoints[n].path)
  )
  llama3 = cfg("llama_gqa_llama3")
  assert llama3.rope_scaling == models.RopeScaling("llama3", 4.0, 1.0, 4.0, 32)
  assert (llama3.num_heads, llama3.num_kv_heads) == (4, 2)
  tied = cfg("llama_linear_tied")
  assert tied.tie_word_embeddings and tied.rope_scaling.kind == "linear"
  assert tied.attention_bias and tied.attention_out_bias
  qwen2 = cfg("qwen2")
  assert qwen2.attention_bias and not qwen2.attention_out_bias
  qwen3 = cfg("qwen3")
  assert qwen3.qk_norm and qwen3.head_dim == 24


def test_config_to_hf_round_trip(family, checkpoints):
  name = family
  hf = transformers.AutoConfig.from_pretrained(checkpoints[name].path)
  cfg = models.DecoderConfig.from_hf(hf)
  back = cfg.to_hf()
  assert type(back) is type(hf)
  assert models.DecoderConfig.from_hf(back) == cfg


def test_unsupported_architectures_name_the_supported_ones():
  with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
    models.DecoderConfig.from_hf(transformers.GPT2Config())
  mistral_named = transformers.LlamaConfig(architectures=["MistralForCausalLM"])
  with pytest.raises(ValueError, match="MistralForCausalLM"):
    models.DecoderConfig.from_hf(mistral_named)
  yarn = transformers.LlamaConfig(
      rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
  )
  with pytest.raises(ValueError, match="rope type 'yarn'"):
    models.DecoderConfig.from_hf(yarn)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(head_dim=15), "even"),
        (dict(remat="full"), "remat"),
        (dict(dtype="int8"), "dtype"),
        (dict(family="gpt2"), "family"),
        (dict(hidden_size=0), "hidden_size"),
    ],
)
def test_config_validation(changes, match):
  with pytest.raises(ValueError, match=match):
    models.DecoderConfig.tiny().replace(**changes)


def test_param_layout_and_sharding_metadata():
  cfg = models.DecoderConfig.tiny(
      vocab_size=50, family="qwen3", qk_norm=True, head_dim=24
  )
  _, params = models.split_model(
      nnx.eval_shape(lambda: models.init_model(cfg, 0))
  )
  layers = params["layers"]
  L, D, F = 2, 64, 128
  assert layers["q_proj"].shape == (L, D, 4 * 24)
  assert layers["k_proj"].shape == (L, D, 2 * 24)
  assert layers["o_proj"].shape == (L, 4 * 24, D)
  assert layers["gate_proj"].shape == (L, D, F)
  assert layers["down_proj"].shape == (L, F, D)
  assert params["embed"].shape == (50, D) and params["lm_head"].shape == (D, 50)

  def check(path, var):
    axes = var.get_metadata()["out_sharding"]
    assert len(axes) == var.ndim, path
    return axes

  axes = jax.tree_util.tree_map_with_path(
      check, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )
  assert axes["layers"]["q_proj"] == ("layers", "embed", "heads")
  assert axes["layers"]["down_proj"] == ("layers", "mlp", "embed")
  assert axes["embed"] == ("vocab", None)


def test_matrix_dimension_numbers():
  _, params = models.split_model(
      nnx.eval_shape(
          lambda: models.init_model(
              models.DecoderConfig.tiny(attention_bias=True), 0
          )
      )
  )
  dn = policy_state.matrix_dimension_numbers(params)
  stacked = DimensionNumbers(
      reduction_axes=(1,), output_axes=(2,), batch_axes=(0,)
  )
  for name in (
      "q_proj",
      "k_proj",
      "v_proj",
      "o_proj",
      "gate_proj",
      "up_proj",
      "down_proj",
  ):
    assert dn["layers"][name] == stacked
  for name in ("attn_norm", "mlp_norm", "q_bias"):
    assert dn["layers"][name] is None
  assert dn["embed"] is None and dn["lm_head"] is None
  with_emb = policy_state.matrix_dimension_numbers(
      params, include_embeddings=True
  )
  assert with_emb["lm_head"] == DimensionNumbers((0,), (1,))


def test_logits_fn_grad_jvp_and_remat_policies():
  """Under jit: gradients, a jvp, and identical gradients for every remat."""
  cfg = models.DecoderConfig.tiny(
      vocab_size=40, attention_bias=True, initializer_range=0.05
  )
  ids = jnp.asarray(_ids(2, 6, seed=4) % 40, jnp.int32)
  graphdefs = {
      remat: models.split_model(
          nnx.eval_shape(
              lambda r=remat: models.init_model(cfg.replace(remat=r), 0)
          )
      )[0]
      for remat in ("none", "block", "dots_saveable")
  }

  def loss(graphdef, p):
    return jnp.mean(jax.nn.logsumexp(models.logits_fn(graphdef, p, ids), -1))

  @jax.jit
  def run(p):
    grads = {r: jax.grad(loss, argnums=1)(g, p) for r, g in graphdefs.items()}
    _, tangent = jax.jvp(
        lambda q: loss(graphdefs["none"], q), (p,), (grads["none"],)
    )
    return grads, tangent

  _, params = models.split_model(models.init_model(cfg, 1))
  grads, tangent = run(params)
  ref = grads.pop("none")
  assert jax.tree.structure(ref) == jax.tree.structure(params)
  assert all(
      np.isfinite(g).all() and np.abs(g).max() > 0 for g in jax.tree.leaves(ref)
  )
  # The jvp in the gradient direction equals <grad, grad>.
  expected = sum(jnp.vdot(g, g) for g in jax.tree.leaves(ref))
  np.testing.assert_allclose(tangent, expected, rtol=1e-4)
  # Rematerialization recomputes the same math, but the compiler may fuse
  # it otherwise: the bound of tests/tolerances.py for the forward and
  # backward chains, the logsumexp over V and the mean over the B * T tokens.
  n = (
      2 * (decoder_reduction_length(cfg, ids.shape[1]) + cfg.vocab_size)
      + ids.size
  )
  tol = 2 * float_tolerance(np.float32, n)
  for remat_grads in grads.values():
    for a, b in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(ref)):
      np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


def test_bfloat16_params_and_compute(checkpoints, loaded):
  name = "llama_gqa_llama3"
  model = models.load_pretrained(checkpoints[name].path, dtype=jnp.bfloat16)
  assert model.layers["q_proj"].dtype == jnp.bfloat16
  ids = _ids(2, 8, seed=5)
  logits = forward(model, ids)
  assert logits.dtype == np.float32
  ref = forward(loaded[name], ids)
  assert np.abs(logits - ref).max() < 0.1 * np.abs(ref).max()
  mixed = models.load_pretrained(
      checkpoints[name].path, dtype=jnp.bfloat16, compute_dtype=jnp.float32
  )
  assert mixed.config.dtype == "float32"
  assert mixed.config.param_dtype == "bfloat16"


def test_load_on_mesh_places_with_logical_rules(checkpoints, loaded):
  mesh = jax.make_mesh(
      (4, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  model = models.load_pretrained(
      checkpoints["qwen2"].path,
      mesh=mesh,
      sharding_rules={"embed": "fsdp", "mlp": "tp", "heads": "tp"},
  )
  gate = model.layers["gate_proj"][...]
  assert gate.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp")
  norm = model.final_norm[...]
  assert norm.sharding.spec == jax.sharding.PartitionSpec("fsdp")
  ids = _ids(2, 8, seed=6)
  # Sharded contractions sum partial results in another order.
  ref = forward(loaded["qwen2"], ids)
  tol = 2 * float_tolerance(
      np.float32, decoder_reduction_length(model.config, 8)
  )
  np.testing.assert_allclose(
      forward(model, ids), ref, rtol=0, atol=tol * np.abs(ref).max()
  )
  replicated = parallel.logical_to_mesh(("layers", "embed", "mlp"), mesh, {})
  assert replicated.spec == jax.sharding.PartitionSpec(None, None, None)


def test_init_model_statistics():
  cfg = models.DecoderConfig.tiny(
      vocab_size=40, attention_bias=True, initializer_range=0.05
  )
  model = models.init_model(cfg, nnx.Rngs(3))
  assert np.all(model.layers["attn_norm"][...] == 1)
  assert np.all(model.layers["q_bias"][...] == 0)
  assert abs(float(jnp.std(model.layers["up_proj"][...])) - 0.05) < 0.002
  other = models.init_model(cfg, 4)
  assert not np.allclose(model.embed[...], other.embed[...])


def test_query_chunked_attention_is_exact():
  """Chunking queries (T > attention_chunk) changes nothing but memory: the
  logits and gradients equal the single-block attention's, with padding and
  a length that is not a multiple of the chunk."""
  config = models.DecoderConfig.tiny(vocab_size=VOCAB)
  chunked = dataclasses.replace(config, attention_chunk=8)
  batch, length = 2, 37
  ids = jnp.asarray(_ids(batch, length), jnp.int32)
  mask = jnp.ones((batch, length), bool).at[0, :5].set(False)
  results = []
  for cfg in (config, chunked):
    graphdef, params = models.split_model(models.init_model(cfg, rngs=0))

    def loss(p, g=graphdef):
      logits = _logits(g, p, ids, attention_mask=mask)
      return jnp.sum(jnp.sin(logits)), logits

    results.append(jax.jit(jax.value_and_grad(loss, has_aux=True))(params))
  ((_, logits_a), grads_a), ((_, logits_b), grads_b) = results
  # The same float32 math in another order (tests/tolerances.py): the logits
  # within 2 gamma_n of their magnitude for the forward chain of n terms; the
  # gradients add the backward chain and the sum over the B * T tokens.
  forward = decoder_reduction_length(config, length)
  tol = 2 * float_tolerance(np.float32, forward)
  np.testing.assert_allclose(
      logits_a, logits_b, rtol=0, atol=tol * np.abs(logits_a).max()
  )
  tol = 2 * float_tolerance(np.float32, 2 * forward + batch * length)
  for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(a).max())
