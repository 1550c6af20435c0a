"""The frozen reference policy of ``loss.beta > 0``: weights, log-probs on a
mesh, a run with the penalty, its exact resume and its planned memory."""

import dataclasses
import json

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import checkpoint
from logra_jax import configs
from logra_jax import memory
from logra_jax import models
from logra_jax import parallel
from logra_jax.rl import learner
from logra_jax.rl import reference
from logra_jax.rl import scoring
from logra_jax.rl import setup
from logra_jax.rl import trainer
from logra_jax.rollout import engine
from logra_jax import policy_state
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

QUIET = lambda s: None


@pytest.fixture(scope="module")
def config(policy_folder):
  return configs.apply_overrides(
      configs.get_preset("smoke"),
      [
          f"policy.path={policy_folder}",
          "loss.beta=0.04",
          "steps=4",
          "checkpoint.every_steps=2",
      ],
  )


@pytest.fixture(scope="module")
def rollout_batch(policy_folder, config):
  policy = engine.Policy.load(policy_folder)
  task = setup.load_task(config)
  batch, _ = scoring.rollout(
      policy,
      policy.params,
      list(task.examples[:4]),
      config,
      [(setup.task_verifier(task), 1.0)],
      jax.random.key(1),
  )
  return policy, batch


def test_reference_weights_are_a_frozen_cast_copy(rollout_batch):
  policy, _ = rollout_batch
  ref = reference.reference_params(policy.params, jnp.bfloat16)
  for p, r in zip(
      jax.tree.leaves(policy.params), jax.tree.leaves(ref), strict=True
  ):
    assert r.dtype == jnp.bfloat16 and r.shape == p.shape
    np.testing.assert_array_equal(
        np.asarray(r), np.asarray(p.astype(jnp.bfloat16))
    )
  # A copy, not an alias: donating the params to a train step leaves it.
  same = reference.reference_params(policy.params, jnp.float32)
  assert all(
      a is not b
      for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(policy.params))
  )


def test_reference_logprobs_of_the_initial_policy(rollout_batch, config):
  policy, batch = rollout_batch
  fill = reference.make_reference_logprobs(
      policy.graphdef, config.rollout.temperature
  )
  # A float32 reference runs the learner's math in another XLA program
  # (fusion may sum in other orders): 2 gamma_n of the log-probs' scale.
  same = fill(reference.reference_params(policy.params, jnp.float32), batch)
  mask = np.asarray(batch.completion_mask_BxT, bool)
  logp = models.token_logprobs(
      policy.graphdef,
      policy.params,
      batch.prompt_tokens_BxP,
      batch.prompt_mask_BxP,
      batch.completion_tokens_BxT,
      batch.completion_mask_BxT,
      temperature=config.rollout.temperature,
  )
  decoder = models.load_pretrained(policy.folder).config
  length = batch.prompt_tokens_BxP.shape[1] + logp.shape[1]
  n = decoder_reduction_length(decoder, length) + decoder.vocab_size
  scale = max(float(np.abs(logp).max()), np.log(decoder.vocab_size))
  np.testing.assert_allclose(
      np.asarray(same.ref_logp_BxT)[mask],
      np.asarray(logp)[mask],
      rtol=0,
      atol=2 * float_tolerance(np.float32, n) * scale,
  )
  # bfloat16 weights round each weight by at most 2^-8 relative, which moves
  # a log-prob by O(2^-8 |logit|): close, not equal.
  rounded = fill(reference.reference_params(policy.params, jnp.bfloat16), batch)
  assert rounded.ref_logp_BxT.dtype == jnp.float32
  diff = np.abs(np.asarray(rounded.ref_logp_BxT) - np.asarray(logp))[mask]
  assert 0 < diff.max() < 0.05
  # Everything else in the batch is passed through.
  np.testing.assert_array_equal(rounded.old_logp_BxT, batch.old_logp_BxT)


def test_reference_logprobs_on_a_mesh_equal_the_unsharded(
    rollout_batch, config
):
  policy, batch = rollout_batch
  mesh = parallel.make_mesh(parallel.MeshConfig(fsdp=4, tp=2))
  params_sharding = parallel.param_shardings(policy.params, mesh)
  ref = jax.device_put(
      reference.reference_params(policy.params, jnp.bfloat16), params_sharding
  )
  batch_sharding = parallel.data_shardings(batch, mesh)
  fill = reference.make_reference_logprobs(
      policy.graphdef,
      config.rollout.temperature,
      shardings=(params_sharding, batch_sharding),
      activation_rules=parallel.PARTITION_RULES,
  )
  sharded = fill(ref, jax.device_put(batch, batch_sharding))
  assert sharded.ref_logp_BxT.sharding.spec == (
      batch_sharding.completion_mask_BxT.spec
  )
  plain = reference.make_reference_logprobs(
      policy.graphdef, config.rollout.temperature
  )(reference.reference_params(policy.params, jnp.bfloat16), batch)
  mask = np.asarray(batch.completion_mask_BxT, bool)
  # The same sums split over devices: float32 reductions in another order,
  # over the hidden size D and the vocabulary V (relative error <= n eps).
  vocab, hidden = policy.params["embed"].value.shape
  expected = np.asarray(plain.ref_logp_BxT)[mask]
  tolerance = (
      (vocab + hidden) * np.finfo(np.float32).eps * (1 + np.abs(expected).max())
  )
  np.testing.assert_allclose(
      np.asarray(sharded.ref_logp_BxT)[mask], expected, atol=tolerance
  )


@pytest.fixture(scope="module")
def straight(config, tmp_path_factory):
  out = tmp_path_factory.mktemp("beta-straight")
  summary = trainer.train(config, out, progress=False, log=QUIET)
  return out, summary


def _metrics(run):
  return [
      {
          k: v
          for k, v in json.loads(line).items()
          if not k.startswith(("time/", "compile/"))
      }
      for line in (run / "metrics.jsonl").read_text().splitlines()
  ]


def test_a_run_with_a_kl_penalty(straight, config):
  out, summary = straight
  metrics = _metrics(out)
  assert len(metrics) == config.steps
  assert all(m["skipped"] == 0 for m in metrics)
  kl_ref = [m["kl_ref"] for m in metrics]
  # Step 1 compares the initial policy with its bfloat16 copy: only rounding
  # (k3 of a log-ratio d is ~d^2 / 2). Later steps move away from it.
  assert 0 <= kl_ref[0] < 1e-4
  assert all(np.isfinite(kl_ref)) and max(kl_ref[1:]) > kl_ref[0]
  num_params = summary["num_params"]
  assert summary["reference_bytes"] == 2 * num_params  # bfloat16
  # The checkpoint holds the reference weights: the initial policy's.
  policy = engine.Policy.load(config.policy.path)
  with checkpoint.Checkpointer(out / "checkpoints", read_only=True) as ckpt:
    tx = policy_state.make_optimizer(config.optimizer, policy.params)
    restored = ckpt.restore(
        params=checkpoint.abstract_state(
            policy_state.abstract_weights(config.optimizer, tx, policy.params),
            jax.tree.leaves(policy.params)[0].sharding,
        ),
        ref_params=reference.reference_params(policy.params, jnp.bfloat16),
    )
  for initial, ref in zip(
      jax.tree.leaves(policy.params),
      jax.tree.leaves(restored.ref_params),
      strict=True,
  ):
    np.testing.assert_array_equal(
        np.asarray(initial.astype(jnp.bfloat16)), np.asarray(ref)
    )


def test_resumed_run_with_a_kl_penalty_is_exact(straight, config, tmp_path):
  out = tmp_path / "run"
  trainer.train(
      dataclasses.replace(config, steps=2), out, progress=False, log=QUIET
  )
  trainer.train(config, out, progress=False, log=QUIET, resume=True)
  assert _metrics(out) == _metrics(straight[0])


def test_loss_without_reference_log_probs_names_the_fix(rollout_batch, config):
  policy, batch = rollout_batch
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  step = learner.make_train_step(policy.graphdef, tx, config)
  with pytest.raises(ValueError, match="ref_logp_BxT"):
    step(
        *policy_state.init_train_state(config.optimizer, tx, policy.params),
        batch,
    )


def test_planner_counts_the_reference_policy():
  tiny = models.DecoderConfig.tiny()
  mesh = parallel.MeshConfig(fsdp=2)
  seq, prompt = 32, 32 // 4
  held = memory.plan_memory(
      tiny, mesh=mesh, seq_len=seq, reference_dtype="bfloat16"
  )
  # Every weight in bfloat16, split over fsdp=2 like the parameters.
  params = models.split_model(
      nnx.eval_shape(lambda: models.init_model(tiny, rngs=0))
  )[1]
  shardings = parallel.param_shardings(
      params, parallel.make_mesh(mesh, memory.ensure_devices(2))
  )
  expected = sum(
      int(np.prod(s.shard_shape(p.shape))) * 2
      for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings))
  )
  assert held.reference == expected
  assert held.total > held.params + held.reference
  # One row per device: four int32 token/mask rows, old and reference
  # float32 log-probs over the completion, one float32 advantage.
  completion = seq - prompt
  assert held.batch == 2 * prompt * 4 + 2 * completion * 4 + (
      2 * completion * 4 + 4
  )
  assert "bfloat16 reference policy" in held.description
  with pytest.raises(ValueError, match="reference_dtype"):
    memory.plan_memory(tiny, seq_len=32, reference_dtype="int8")
