"""The LoRA baseline, W = W_0 + s D U, against the chain rule through the
dense weight, its own claims (a frozen base, rank-r updates, adapter-only
sync) and its bad inputs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logra_jax as logra

from logra_jax import memory
from logra_jax import models
from logra_jax import parallel
from logra_jax import sync
from logra_jax import configs
from logra_jax.optim import lora
from logra_jax.rl import algo
from logra_jax.rl import learner
from logra_jax import policy_state
from tolerances import float_tolerance

RANK, ALPHA = 4, 8.0
CONFIG = models.DecoderConfig.tiny()
OPTIMIZER = configs.OptimizerConfig(
    name="lora", rank=RANK, lora_alpha=ALPHA, warmup_steps=0
)


def _model():
  return models.split_model(models.init_model(CONFIG, rngs=0))


def _batch(rows=8, prompt=5, completion=6):
  rng = np.random.default_rng(0)
  tokens = lambda shape: jnp.asarray(rng.integers(0, CONFIG.vocab_size, shape))
  return algo.RolloutBatch(
      prompt_tokens_BxP=tokens((rows, prompt)),
      prompt_mask_BxP=jnp.ones((rows, prompt), jnp.int32),
      completion_tokens_BxT=tokens((rows, completion)),
      completion_mask_BxT=jnp.ones((rows, completion), jnp.int32),
      old_logp_BxT=jnp.full((rows, completion), -5.5, jnp.float32),
      advantages_B=jnp.asarray(rng.standard_normal(rows), jnp.float32),
      num_generations=4,
  )


def _adapted(path) -> bool:
  name = jax.tree_util.keystr(path)
  return any(f"['{t}']" in name for t in lora.DEFAULT_TARGETS)


def _adapted_leaves(weights):
  return [
      w
      for w in jax.tree.leaves(weights, is_leaf=lora.is_lora)
      if lora.is_lora(w)
  ]


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_adapters_start_at_the_frozen_weights(base_dtype):
  _, params = _model()
  weights = lora.add_adapters(
      params, rank=RANK, alpha=ALPHA, base_dtype=base_dtype
  )
  adapted = _adapted_leaves(weights)
  assert len(adapted) == len(lora.DEFAULT_TARGETS)
  for w in adapted:
    assert w.base.dtype == jnp.dtype(base_dtype)
    assert w.scale == ALPHA / RANK and not np.any(np.asarray(w.up))
    bound = 1 / np.sqrt(w.base.shape[-2])  # PEFT's Kaiming-uniform draw
    assert 0 < np.abs(np.asarray(w.down)).max() <= bound
  # U = 0: the merged weights are the params (rounded to the base dtype).
  merged = jax.tree_util.tree_flatten_with_path(
      policy_state.dense_weights(weights, None)
  )[0]
  for (path, x), y in zip(merged, jax.tree.leaves(params), strict=True):
    if _adapted(path):
      y = y.astype(base_dtype).astype(y.dtype)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("targets", [lora.DEFAULT_TARGETS, ("lm_head",)])
def test_gradients_are_the_chain_rule_through_the_dense_weight(targets):
  """dL/dD = s G U^T and dL/dU = s D^T G, with G = dL/dW at the merged
  weight W_0 + s D U, computed by the model's low-rank op without G (an
  adapted LM head too: its logits are `h W_0 + (h s D) U`, never formed)."""
  graphdef, params = _model()
  weights = lora.add_adapters(params, rank=RANK, alpha=ALPHA, targets=targets)
  rng = np.random.default_rng(1)
  weights = jax.tree.map(  # a nonzero U, so that both factors get gradients
      lambda w: (
          dataclasses.replace(
              w,
              up=jnp.asarray(
                  0.1 * rng.standard_normal(w.up.shape), jnp.float32
              ),
          )
          if lora.is_lora(w)
          else w
      ),
      weights,
      is_leaf=lora.is_lora,
  )
  batch = _batch()
  coefficients = jnp.asarray(
      rng.standard_normal(batch.completion_tokens_BxT.shape), jnp.float32
  )

  def loss(model_params):
    logp = models.token_logprobs(
        graphdef,
        model_params,
        batch.prompt_tokens_BxP,
        batch.prompt_mask_BxP,
        batch.completion_tokens_BxT,
        batch.completion_mask_BxT,
    )
    return jnp.sum(coefficients * logp)

  adapters = lora.trainable(weights)
  grads = jax.grad(lambda a: loss(lora.view(lora.with_frozen(a, weights))))(
      adapters
  )
  dense = jax.grad(loss)(lora.merge(weights))
  # Chain: the forward and backward passes (hidden, MLP, vocabulary and
  # sequence reductions) and the rank-r products of the chain rule.
  chain = (
      2
      * (
          CONFIG.num_layers * (CONFIG.hidden_size + CONFIG.intermediate_size)
          + CONFIG.vocab_size
          + 11
      )
      + 8 * 6
      + RANK
  )
  tolerance = 2 * float_tolerance(jnp.float32, chain)
  flat_w = jax.tree.leaves(weights, is_leaf=lora.is_lora)
  flat_g = jax.tree.leaves(
      grads, is_leaf=lambda x: x is None or lora.is_lora(x)
  )
  flat_dense = jax.tree.leaves(dense)
  checked = 0
  for w, g, big in zip(flat_w, flat_g, flat_dense, strict=True):
    if not lora.is_lora(w):
      continue
    g_d = w.scale * jnp.einsum("...mn,...rn->...mr", big, w.up)
    g_u = w.scale * jnp.einsum("...mr,...mn->...rn", w.down, big)
    # Magnitudes the bound is relative to: the products of absolute values.
    size_d = w.scale * jnp.einsum("...mn,...rn->...mr", abs(big), abs(w.up))
    size_u = w.scale * jnp.einsum("...mr,...mn->...rn", abs(w.down), abs(big))
    for got, want, size in ((g.down, g_d, size_d), (g.up, g_u, size_u)):
      assert float(jnp.abs(want).max()) > 0
      np.testing.assert_array_less(
          np.abs(np.asarray(got) - np.asarray(want)),
          tolerance * np.asarray(size) + np.finfo(np.float32).tiny,
      )
    checked += 1
  assert checked == len(targets)
  # The frozen leaves get no gradient at all.
  assert all(
      g is None or lora.is_lora(g)
      for g in jax.tree.leaves(
          grads, is_leaf=lambda x: x is None or lora.is_lora(x)
      )
  )


@pytest.fixture(scope="module")
def trained():
  """Three LoRA steps on one batch: the weights before and after, the
  learner's messages and a receiver that applied them."""
  graphdef, params = _model()
  config = dataclasses.replace(configs.get_preset("smoke"), optimizer=OPTIMIZER)
  tx = policy_state.make_optimizer(OPTIMIZER, params)
  weights, opt_state = policy_state.init_train_state(
      OPTIMIZER, tx, params, seed=3
  )
  before = jax.tree.map(
      jnp.copy, policy_state.dense_weights(weights, opt_state)
  )
  sender = sync.PolicySender(weights, opt_state, seed=0)
  receiver = sync.PolicyReceiver(
      policy_state.synced_state(weights, opt_state), seed=0
  )
  full = sender.message(weights, opt_state, full=True)
  receiver.apply(sync.decode(sync.encode(full)))
  step = learner.make_train_step(graphdef, tx, config)
  messages = []
  for _ in range(3):
    weights, opt_state, metrics = step(weights, opt_state, _batch())
    messages.append(sender.message(weights, opt_state))
    receiver.apply(sync.decode(sync.encode(messages[-1])))
  return dict(
      before=before,
      weights=weights,
      opt_state=opt_state,
      metrics=metrics,
      full=full,
      messages=messages,
      receiver=receiver,
  )


def test_a_step_moves_only_the_adapters_by_rank_r(trained):
  after = policy_state.dense_weights(trained["weights"], trained["opt_state"])
  assert np.isfinite(float(trained["metrics"]["loss"]))
  moved = 0
  for path, x in jax.tree_util.tree_flatten_with_path(after)[0]:
    y = dict(jax.tree_util.tree_flatten_with_path(trained["before"])[0])[path]
    name = jax.tree_util.keystr(path)
    if not _adapted(path):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
      continue
    delta = np.asarray(x, np.float64) - np.asarray(y, np.float64)
    assert np.abs(delta).max() > 0, name
    for layer in delta:
      singular = np.linalg.svd(layer, compute_uv=False)
      # Beyond the rank: only the float32 rounding of W_0 + s D U.
      assert singular[RANK:].max(initial=0) <= 1e-5 * singular[0], name
    moved += 1
  assert moved == len(lora.DEFAULT_TARGETS)


def test_sync_sends_the_adapters_and_follows_bit_for_bit(trained):
  adapted = _adapted_leaves(trained["weights"])
  adapter_bytes = sum(w.down.nbytes + w.up.nbytes for w in adapted)
  for message in trained["messages"]:
    assert message.nbytes == adapter_bytes
    assert all(n.endswith((".down", ".up")) for n in message.arrays)
  # A full message also carries the frozen bases and the other leaves.
  dense_bytes = sum(
      x.nbytes for x in jax.tree.leaves(trained["before"])
  )  # float32 policy, float32 bases
  assert trained["full"].nbytes == dense_bytes + adapter_bytes
  ours = policy_state.dense_weights(trained["weights"], trained["opt_state"])
  theirs = trained["receiver"].effective_weights()
  for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(targets=("q_proj", "qkv")), r"LoRA targets \['qkv'\] name no"),
        (dict(targets=("final_norm",)), "adapters need a matrix"),
        (dict(rank=33), "LoRA rank 33 exceeds the smaller side"),
        (dict(rank=0), "LoRA rank must be >= 1"),
        (dict(alpha=0.0), "LoRA alpha must be > 0"),
        (dict(base_dtype="float16"), "base_dtype must be float32 or bfloat16"),
    ],
)
def test_bad_adapter_settings_are_named(kwargs, match):
  _, params = _model()
  settings = dict(rank=RANK, alpha=ALPHA) | kwargs
  with pytest.raises(ValueError, match=match):
    lora.add_adapters(params, **settings)


def test_bad_lora_configs_are_refused_naming_the_field():
  with pytest.raises(ValueError, match="optimizer.lora_targets must name"):
    configs.OptimizerConfig(name="lora", lora_targets=[])
  with pytest.raises(ValueError, match="lora adapts the matrices"):
    configs.OptimizerConfig(name="lora", project_embeddings=True)
  assert configs.OptimizerConfig(name="lora", base_dtype="bfloat16")


@pytest.mark.slow
def test_sharded_adapters_follow_their_weight_and_the_planner_counts_them():
  """On fsdp=4, tp=2 the down projection splits like the weight's input
  axis, the up projection like its output axis; the planner compiles the
  sharded step and counts the adapters' gradients and moments."""
  _, params = _model()
  mesh = parallel.make_mesh(parallel.MeshConfig(fsdp=4, tp=2))
  weights = policy_state.abstract_weights(
      OPTIMIZER, policy_state.make_optimizer(OPTIMIZER, params), params
  )
  shardings = parallel.weight_shardings(
      weights, parallel.param_shardings(params, mesh), mesh
  )
  for w, s in zip(
      _adapted_leaves(weights), _adapted_leaves(shardings), strict=True
  ):
    layers, rows, cols = tuple(s.base.spec) + (None,) * (3 - len(s.base.spec))
    # Each adapter's long side is split, by its own side's mesh axes or,
    # where the weight splits only the other side, by that side's.
    assert tuple(s.down.spec) == (layers, rows or cols, None), w.path
    assert tuple(s.up.spec) == (layers, None, cols or rows), w.path
    assert rows or cols, w.path
  reports = {
      name: memory.plan_memory(
          CONFIG,
          mesh=parallel.MeshConfig(fsdp=8),
          optimizer=name,
          rank=RANK,
          seq_len=32,
      )
      for name in ("adam", "lora")
  }
  adapters = sum(
      4 * (np.prod(w.down.shape) + np.prod(w.up.shape))
      for w in _adapted_leaves(weights)
  )
  lora_report = reports["lora"]
  assert lora_report.optimizer_state < reports["adam"].optimizer_state
  assert lora_report.grads <= adapters  # sharded over 8 devices
  assert lora_report.optimizer_state >= 2 * lora_report.grads


def test_the_kl_predictor_of_an_adapter_step_is_the_exact_kl_to_second_order():
  """The learner's predictor (the adapters' tangent through the frozen
  weights, jitted) against the exact KL between the policies before and
  after a small adapter step, in float64 so that rounding does not hide the
  comparison: their ratio is 1 up to the Taylor remainder, O(step size)."""
  size = 1e-5
  with jax.enable_x64(True):
    config = dataclasses.replace(CONFIG, dtype="float64", param_dtype="float64")
    graphdef, params = models.split_model(models.init_model(config, rngs=0))
    weights = lora.add_adapters(params, rank=RANK, alpha=ALPHA)
    weights = jax.tree.map(
        lambda w: (
            dataclasses.replace(
                w, down=w.down.astype(jnp.float64), up=w.up.astype(jnp.float64)
            )
            if lora.is_lora(w)
            else w
        ),
        weights,
        is_leaf=lora.is_lora,
    )
    batch = _batch()
    adapters = lora.trainable(weights)
    rng = np.random.default_rng(2)
    step = jax.tree.map(
        lambda x: jnp.asarray(size * rng.standard_normal(x.shape), x.dtype),
        adapters,
    )
    view = lambda a: lora.view(lora.with_frozen(a, weights))

    def features(a, batch):
      return models.completion_hidden_states(
          graphdef,
          view(a),
          batch.prompt_tokens_BxP,
          batch.prompt_mask_BxP,
          batch.completion_tokens_BxT,
          batch.completion_mask_BxT,
      )

    @jax.jit
    def predicted_and_exact(adapters, step):
      predict = logra.make_kl_predictor(
          features, adapters, batch, frozen_unembedding=True
      )
      logp = [
          jax.nn.log_softmax(jnp.einsum("btd,dv->btv", *features(a, batch)))
          for a in (adapters, jax.tree.map(jnp.add, adapters, step))
      ]
      exact = jnp.mean(jnp.sum(jnp.exp(logp[0]) * (logp[0] - logp[1]), -1))
      return predict(step), exact

    predicted, exact = predicted_and_exact(adapters, step)
  assert float(exact) > 0
  # The third-order term relative to the second: a few times the step size
  # (about 1e-2 at size 1e-2 in float32 runs); 1e-3 leaves a wide margin.
  assert abs(float(predicted) / float(exact) - 1) < 1e-3
