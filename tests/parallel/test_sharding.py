"""Sharded training on 8 CPU devices: same numbers, stable layouts, clear errors."""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import configs
from logra_jax import models
from logra_jax import parallel
from logra_jax.optim import sketch_grad
from logra_jax.rl import algo, learner
from logra_jax import policy_state
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

VOCAB = 32
CONFIG = models.DecoderConfig.tiny(vocab_size=VOCAB, max_position_embeddings=32)
SMOKE = configs.get_preset("smoke")
RUN = dataclasses.replace(
    SMOKE,
    optimizer=dataclasses.replace(
        SMOKE.optimizer,
        name="logra",
        rank=4,
        refresh_every=2,
        learning_rate=1e-2,
    ),
    # The step's sharding is what is tested here, on the plain clipped loss
    # whose bounds below were set; the rollout correction's weights are
    # tested in tests/rl/test_rollout_correction.py.
    loss=dataclasses.replace(SMOKE.loss, rollout_correction="none"),
)


def _logprob_atol(logprobs, config, length: int) -> float:
  """Sharded and unsharded log-probs sum in other orders: the bound of
  tests/tolerances.py for the forward chain and the softmax over V, relative
  to the log-probs (>= log V here, above the tiny model's logits)."""
  n = decoder_reduction_length(config, length) + config.vocab_size
  return 2 * float_tolerance(np.float32, n) * np.abs(logprobs).max()


def _batch(rows=8, prompt=5, completion=6):
  keys = jax.random.split(jax.random.key(0), 3)
  return algo.RolloutBatch(
      prompt_tokens_BxP=jax.random.randint(keys[0], (rows, prompt), 3, VOCAB),
      prompt_mask_BxP=jnp.ones((rows, prompt), jnp.int32).at[::2, :2].set(0),
      completion_tokens_BxT=jax.random.randint(
          keys[1], (rows, completion), 3, VOCAB
      ),
      completion_mask_BxT=jnp.ones((rows, completion), jnp.int32)
      .at[1::2, 4:]
      .set(0),
      old_logp_BxT=-jnp.ones((rows, completion)),
      advantages_B=jnp.linspace(-1.0, 1.0, rows),
      num_generations=4,
  )


def _run(mesh_config, steps=3, run=RUN):
  graphdef, params = models.split_model(models.init_model(CONFIG, rngs=0))
  tx = policy_state.make_optimizer(run.optimizer, params)
  batch = _batch()
  if mesh_config is None:
    step = learner.make_train_step(graphdef, tx, run)
    params, state = policy_state.init_train_state(run.optimizer, tx, params)
  else:
    mesh = parallel.make_mesh(mesh_config, jax.devices()[: mesh_config.size])
    params_sharding = parallel.param_shardings(params, mesh)
    state_sharding = parallel.optimizer_state_shardings(
        tx, params, params_sharding, mesh
    )
    weights_sharding = parallel.weight_shardings(
        policy_state.abstract_weights(run.optimizer, tx, params),
        params_sharding,
        mesh,
    )
    batch_sharding = parallel.data_shardings(batch, mesh)
    step = learner.make_train_step(
        graphdef,
        tx,
        run,
        shardings=(weights_sharding, state_sharding, batch_sharding),
        activation_rules=parallel.PARTITION_RULES,
    )
    weights, state = policy_state.init_train_state(
        run.optimizer, tx, jax.device_put(params, params_sharding)
    )
    params = jax.device_put(weights, weights_sharding)
    state = jax.device_put(state, state_sharding)
    batch = jax.device_put(batch, batch_sharding)
  for _ in range(steps):  # across a projector refresh
    params, state, metrics = step(params, state, batch)
  return params, state, metrics


@pytest.fixture(scope="module")
def unsharded():
  return _run(None)


def _relative(a_tree, b_tree):
  diff = sum(
      float(np.sum(np.square(np.asarray(a) - np.asarray(b))))
      for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree))
  )
  return (
      diff
      / sum(
          float(np.sum(np.square(np.asarray(b))))
          for b in jax.tree.leaves(b_tree)
      )
  ) ** 0.5


@pytest.mark.parametrize("mesh", ["fsdp=4,tp=2", "dp=2,fsdp=2,tp=2", "dp=8"])
def test_sharded_logra_step_equals_unsharded(unsharded, mesh):
  params, state, metrics = _run(parallel.MeshConfig.parse(mesh))
  ref_params, ref_state, ref_metrics = unsharded
  # The weights W = c B + P A, not their factors: the window's update A is
  # small, so its own relative rounding difference is larger.
  params = policy_state.dense_weights(params, state)
  ref_params = policy_state.dense_weights(ref_params, ref_state)

  # Sharded reductions sum in another order; Adam's m / sqrt(v) turns those
  # float32 rounding differences of near-zero gradients into differences of
  # a few 1e-5 of single weights, so the bound is on the whole tree.
  assert _relative(params, ref_params) <= 1e-5
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    assert _relative(a, b) <= 1e-4
  for name in ("loss", "grad_norm", "kl/realized_k3"):
    np.testing.assert_allclose(
        float(metrics[name]), float(ref_metrics[name]), rtol=1e-4
    )


@pytest.mark.slow
def test_sharded_step_with_projected_embeddings_equals_unsharded():
  # The vocabulary-split table and LM head, projected too: their sketches
  # come from `take` and the vocabulary-parallel logits.
  run = dataclasses.replace(
      RUN, optimizer=dataclasses.replace(RUN.optimizer, project_embeddings=True)
  )
  params, state, _ = _run(parallel.MeshConfig.parse("fsdp=4,tp=2"), run=run)
  ref_params, ref_state, _ = _run(None, run=run)
  assert (
      _relative(
          policy_state.dense_weights(params, state),
          policy_state.dense_weights(ref_params, ref_state),
      )
      <= 1e-5
  )
  plans = jax.tree.leaves(sketch_grad.project_state(state).spec.plans)
  assert {p.path for p in plans if p.projected} >= {
      "['embed'].value",
      "['lm_head'].value",
  }


def test_derived_state_shardings_are_what_update_produces():
  """An un-annotated `jit(tx.update)` on sharded inputs returns the state with
  exactly the derived shardings, so no step has to re-lay it out."""
  mesh = parallel.make_mesh(parallel.MeshConfig(fsdp=4, tp=2))
  graphdef, params = models.split_model(models.init_model(CONFIG, rngs=0))
  params_sharding = parallel.param_shardings(params, mesh)
  tx = policy_state.make_optimizer(RUN.optimizer, params)
  state_sharding = parallel.optimizer_state_shardings(
      tx, params, params_sharding, mesh
  )
  params = jax.device_put(params, params_sharding)
  state = jax.device_put(tx.init(params), state_sharding)
  update = jax.jit(tx.update)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-2), params)
  for _ in range(3):
    _, state = update(grads, state, params)
    for leaf, expected in zip(
        jax.tree.leaves(state), jax.tree.leaves(state_sharding)
    ):
      assert leaf.sharding.is_equivalent_to(expected, leaf.ndim), (
          leaf.shape,
          leaf.sharding,
          expected,
      )
  # Projectors follow the parameter's long axis, moments its short axis:
  # q_proj [L, D=64 (fsdp), H*h=64 (tp)] is square, so P is split like D.
  specs = {
      jax.tree_util.keystr(path): s.spec
      for path, s in jax.tree_util.tree_flatten_with_path(state_sharding)[0]
  }
  projector = next(
      v for k, v in specs.items() if "projectors" in k and "down_proj" in k
  )
  assert projector == jax.sharding.PartitionSpec(None, "tp")  # [L, F, r]
  moment = next(v for k, v in specs.items() if ".mu" in k and "down_proj" in k)
  assert moment == jax.sharding.PartitionSpec(None, None, "fsdp")  # [L, r, D]


def test_train_step_outputs_keep_their_shardings():
  mesh_config = parallel.MeshConfig(fsdp=4, tp=2)
  params, _, _ = _run(mesh_config, steps=2)
  mesh = parallel.make_mesh(mesh_config, jax.devices()[:8])
  _, dense = models.split_model(models.init_model(CONFIG, rngs=0))
  expected = parallel.weight_shardings(
      params, parallel.param_shardings(dense, mesh), mesh
  )
  for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
  q_proj = expected["layers"]["q_proj"].value  # factored: B, A
  assert q_proj.base.spec == jax.sharding.PartitionSpec(
      None, "fsdp", "tp"
  )  # [L, D, H*h]: hidden by fsdp, heads by tp
  assert q_proj.coords.spec == jax.sharding.PartitionSpec(
      None, None, "fsdp"
  )  # [L, r, short]


def test_sampler_runs_sharded():
  mesh = parallel.make_mesh(parallel.MeshConfig(fsdp=4, tp=2))
  model = models.init_model(CONFIG, rngs=0)
  graphdef, params = models.split_model(model)
  sampler = models.Sampler(model, max_length=24)
  prompts = [[3, 4, 5], [6, 7], [8], [9, 10, 11, 12]] * 2
  kwargs = dict(max_new_tokens=5, temperature=0.0, stop_ids=())
  expected = sampler.sample(params, prompts, jax.random.key(0), **kwargs)
  sharded_sampler = models.Sampler(model, max_length=24, mesh=mesh)
  sharded = jax.device_put(params, parallel.param_shardings(params, mesh))
  out = sharded_sampler.sample(sharded, prompts, jax.random.key(0), **kwargs)
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  np.testing.assert_allclose(
      out.logprobs,
      expected.logprobs,
      rtol=0,
      atol=_logprob_atol(expected.logprobs, CONFIG, 24),
  )
  rows = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(("dp", "fsdp"), None)
  )
  assert out.tokens.sharding.is_equivalent_to(rows, 2)


@pytest.mark.parametrize(
    "mesh, heads_axis", [("fsdp=4,tp=2", "tp"), ("fsdp=2,tp=4", None)]
)
def test_kv_cache_is_split_like_the_rows_and_kv_heads(mesh, heads_axis):
  """The cache a prefill writes (each decode step writes it through the same
  function) is laid out like the activations that fill it: rows over the
  data axes, the key/value heads over tp where tp divides them (2 heads over
  tp=4: not split)."""
  device_mesh = parallel.make_mesh(parallel.MeshConfig.parse(mesh))
  model = models.init_model(CONFIG, rngs=0)
  graphdef, params = models.split_model(model)

  @jax.jit
  def prefill(params, ids_BxT):
    with parallel.activation_sharding(device_mesh, parallel.PARTITION_RULES):
      cache = models.init_cache(CONFIG, batch_size=8, max_length=12)
      model = nnx.merge(graphdef, params)
      return model.hidden_states(ids_BxT, cache=cache)[1]

  cache = prefill(
      jax.device_put(params, parallel.param_shardings(params, device_mesh)),
      jnp.full((8, 5), 3, jnp.int32),
  )
  P = jax.sharding.PartitionSpec
  heads = jax.sharding.NamedSharding(
      device_mesh, P(None, "fsdp", heads_axis, None, None)
  )
  assert cache.k.sharding.is_equivalent_to(heads, 5)
  assert cache.v.sharding.is_equivalent_to(heads, 5)
  rows = jax.sharding.NamedSharding(device_mesh, P("fsdp", None))
  assert cache.mask.sharding.is_equivalent_to(rows, 2)


@pytest.mark.parametrize(
    "mesh, vocab_axes",
    [
        ("fsdp=8", None),
        ("fsdp=4,tp=2", "tp"),
        ("dp=2,fsdp=2,tp=2", ("fsdp", "tp")),
    ],
)
def test_weights_loads_and_sampler_share_one_layout(mesh, vocab_axes, tmp_path):
  """The default task's vocabulary (100) is not divisible by fsdp=8: the
  weights, a policy loaded onto the mesh and the sampler all fall back to
  the same layout (once they disagreed and the sampler failed)."""
  config = dataclasses.replace(CONFIG, vocab_size=100)
  model = models.init_model(config, rngs=0)
  models.save_pretrained(model, tmp_path / "policy")
  device_mesh = parallel.make_mesh(parallel.MeshConfig.parse(mesh))
  _, params = models.split_model(model)
  expected = parallel.param_shardings(params, device_mesh)
  _, loaded = models.split_model(
      models.load_pretrained(tmp_path / "policy", mesh=device_mesh)
  )
  sampler = models.Sampler(model, max_length=24, mesh=device_mesh)
  specs = lambda tree: [s.spec for s in jax.tree.leaves(tree)]
  assert [x.sharding.spec for x in jax.tree.leaves(loaded)] == specs(expected)
  assert specs(sampler._params_sharding) == specs(expected)
  assert expected["embed"].spec == jax.sharding.PartitionSpec(vocab_axes, None)
  out = sampler.sample(
      jax.device_put(params, expected),
      [[3, 4, 5], [6, 7]],
      jax.random.key(0),
      max_new_tokens=3,
      temperature=0.0,
  )
  assert out.tokens.shape == (2, 3)


def test_logical_to_mesh_falls_back_only_where_rules_do_not_divide():
  mesh = parallel.make_mesh(parallel.MeshConfig(fsdp=4, tp=2))
  P = jax.sharding.PartitionSpec
  vocab = lambda size: parallel.logical_to_mesh(
      ("vocab", None), mesh, shape=(size, 8)
  ).spec
  assert vocab(96) == P(("fsdp", "tp"), None)
  assert vocab(100) == P("tp", None)
  with pytest.raises(
      ValueError,
      match=r"cannot shard logits \(shape \(4, 99\)\): dimension 1 "
      r"\('vocab', size 99\) is not divisible by mesh axis tp of size 2",
  ):
    parallel.logical_to_mesh(
        ("batch", "vocab"), mesh, shape=(4, 99), name="logits"
    )
  # Without a shape the rules are taken as given; unknown names replicate.
  assert parallel.logical_to_mesh(("vocab", "other"), mesh).spec == P(
      ("fsdp", "tp"), None
  )
  # A sketch's long side (a projected vocabulary of 98 over fsdp=4):
  # split where the data axes divide it, else whole on every device.
  sketch = lambda size: parallel.logical_to_mesh(
      ("sketch_long", None), mesh, shape=(size, 8)
  ).spec
  assert sketch(96) == P("fsdp", None)
  assert sketch(98) == P(None, None)


def test_vocabulary_tables_split_along_the_vocabulary():
  _, params = models.split_model(
      jax.eval_shape(lambda: models.init_model(CONFIG, rngs=0))
  )
  mesh = parallel.make_mesh(parallel.MeshConfig(fsdp=4, tp=2))
  spec = parallel.param_shardings(params, mesh)["embed"].value.spec
  assert spec == jax.sharding.PartitionSpec(("fsdp", "tp"), None)
  # A vocabulary that fsdp * tp does not divide (GPT-2's 50257 on fsdp=8)
  # falls back to tp alone.
  odd = dataclasses.replace(CONFIG, vocab_size=34)
  _, params = models.split_model(
      jax.eval_shape(lambda: models.init_model(odd, rngs=0))
  )
  shardings = parallel.param_shardings(params, mesh)
  assert shardings["embed"].value.spec == jax.sharding.PartitionSpec("tp", None)
  # ... and the log-probs still run split that way, with the same numbers.
  graphdef, params = models.split_model(models.init_model(odd, rngs=0))
  batch = _batch()

  def logprobs(params, batch):
    return models.token_logprobs(
        graphdef,
        params,
        batch.prompt_tokens_BxP,
        batch.prompt_mask_BxP,
        batch.completion_tokens_BxT,
        batch.completion_mask_BxT,
    )

  def sharded(params, batch):
    with parallel.activation_sharding(mesh, parallel.PARTITION_RULES):
      return logprobs(params, batch)

  got = jax.jit(
      sharded, in_shardings=(shardings, parallel.data_shardings(batch, mesh))
  )(params, batch)
  ref = logprobs(params, batch)
  np.testing.assert_allclose(got, ref, rtol=0, atol=_logprob_atol(ref, odd, 11))


def test_output_layer_never_holds_the_whole_unembedding():
  # Vocabulary-parallel log-probs on fsdp=8: the compiled per-device program
  # has the [V/8, D] slices of the table and its gradient, never [V, D] or
  # [D, V], in the forward or the backward pass.
  vocab, hidden = 4096, CONFIG.hidden_size
  config = dataclasses.replace(CONFIG, vocab_size=vocab)
  graphdef, params = models.split_model(models.init_model(config, rngs=0))
  mesh = parallel.make_mesh(parallel.MeshConfig(fsdp=8))
  shardings = parallel.param_shardings(params, mesh)
  batch = _batch()

  def loss(params, batch):
    with parallel.activation_sharding(mesh, parallel.PARTITION_RULES):
      return models.token_logprobs(
          graphdef,
          params,
          batch.prompt_tokens_BxP,
          batch.prompt_mask_BxP,
          batch.completion_tokens_BxT,
          batch.completion_mask_BxT,
      ).sum()

  grad = jax.jit(
      jax.grad(loss),
      in_shardings=(shardings, parallel.data_shardings(batch, mesh)),
      out_shardings=shardings,
  )
  hlo = grad.lower(params, batch).compile().as_text()
  assert f"[{vocab // 8},{hidden}]" in hlo
  assert f"[{vocab},{hidden}]" not in hlo and f"[{hidden},{vocab}]" not in hlo
  expected = jax.jit(jax.grad(loss))(params, batch)["embed"].value
  n = (
      2 * (decoder_reduction_length(config, 11) + vocab)
      + batch.completion_tokens_BxT.size
  )
  np.testing.assert_allclose(
      grad(params, batch)["embed"].value,
      expected,
      rtol=0,
      atol=2 * float_tolerance(np.float32, n) * np.abs(expected).max(),
  )


def test_mesh_size_must_match_devices():
  with pytest.raises(ValueError, match="needs 8 devices, but 4 are given"):
    parallel.make_mesh(parallel.MeshConfig(fsdp=8), jax.devices()[:4])


@pytest.mark.parametrize(
    "text,match",
    [
        ("fsdp=0", "must be a positive int"),
        ("pp=2", "expected axis=size"),
        ("fsdp", "expected axis=size"),
        ("tp=two", "size must be an int"),
    ],
)
def test_bad_mesh_spec_is_rejected(text, match):
  with pytest.raises(ValueError, match=match):
    parallel.MeshConfig.parse(text)


def test_axis_that_does_not_divide_names_tensor_axis_and_sizes():
  mesh = parallel.make_mesh(parallel.MeshConfig(fsdp=8))
  config = dataclasses.replace(CONFIG, hidden_size=60)
  _, params = models.split_model(
      jax.eval_shape(lambda: models.init_model(config, rngs=0))
  )
  with pytest.raises(
      ValueError,
      match=r"cannot shard \['final_norm'\] "
      r"\(shape \(60,\)\): dimension 0 \('embed', size 60\) is "
      r"not divisible by mesh axis fsdp of size 8",
  ):
    parallel.param_shardings(params, mesh)


def test_batch_that_does_not_divide_is_rejected():
  mesh = parallel.make_mesh(parallel.MeshConfig(dp=2, fsdp=4))
  with pytest.raises(
      ValueError,
      match="batch size 6 is not divisible by the " "data axes of size 8",
  ):
    parallel.data_shardings(_batch(rows=6), mesh)
