"""The learner: log-prob consistency, micro-batching, a short run, config errors."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from logra_jax import configs
from logra_jax import models
from logra_jax.optim import sketch_grad
from logra_jax.cli import main as cli_main
from logra_jax.rl import algo, learner, trainer
from logra_jax.rollout import engine
from logra_jax import policy_state
from logra_jax.optim import factored
from logra_jax.optim import non_finite
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

SMOKE = configs.get_preset("smoke")


def test_recomputed_old_logprobs_equal_the_samplers(rollout_batch):
  policy, batch, _ = rollout_batch
  logp = models.token_logprobs(
      policy.graphdef,
      policy.params,
      batch.prompt_tokens_BxP,
      batch.prompt_mask_BxP,
      batch.completion_tokens_BxT,
      batch.completion_mask_BxT,
      temperature=SMOKE.rollout.temperature,
  )
  # The sampler's cached decode and one full forward pass sum in other
  # orders: 2 gamma_n of the log-probs' scale (at least log V).
  config = models.load_pretrained(policy.folder).config
  length = batch.prompt_tokens_BxP.shape[1] + logp.shape[1]
  n = decoder_reduction_length(config, length) + config.vocab_size
  scale = max(float(np.abs(logp).max()), np.log(config.vocab_size))
  np.testing.assert_allclose(
      logp, batch.old_logp_BxT, atol=2 * float_tolerance(np.float32, n) * scale
  )


def _assert_same_sgd_step(policy, batch, first, second, metric_names):
  """Two SGD(1.0) steps from the policy's weights that sum the same tokens of
  ``batch`` in other groupings or orders, as ``(params, metrics)``: the
  updates agree within 2 gamma_n of the largest one, n the forward and
  backward chains plus the B x T tokens; the metrics within rounding."""
  (p1, m1), (p2, m2) = first, second
  config = models.load_pretrained(policy.folder).config
  length = (
      batch.prompt_tokens_BxP.shape[1] + batch.completion_tokens_BxT.shape[1]
  )
  n = 2 * decoder_reduction_length(config, length) + batch.batch_size * length
  for p0, a, b in zip(*(jax.tree.leaves(t) for t in (policy.params, p1, p2))):
    atol = 2 * float_tolerance(np.float32, n) * float(jnp.abs(b - p0).max())
    np.testing.assert_allclose(a, b, rtol=0, atol=atol + 1e-30)
  for name in metric_names:
    np.testing.assert_allclose(m1[name], m2[name], rtol=1e-4, atol=1e-6)


def test_micro_batched_step_equals_full_batch(rollout_batch):
  policy, batch, _ = rollout_batch
  # Non-trivial advantages, so that the gradient is not zero.
  batch = batch.replace(advantages_B=jnp.linspace(-1.0, 1.0, batch.batch_size))
  tx = non_finite.skip_non_finite(optax.sgd(1.0))  # params move by the gradient
  results = []
  for micro in (1, 4):
    config = dataclasses.replace(SMOKE, micro_batches=micro)
    params = jax.tree.map(jnp.copy, policy.params)
    step = learner.make_train_step(policy.graphdef, tx, config)
    results.append(step(params, tx.init(params), batch))
  (p1, _, m1), (p4, _, m4) = results
  _assert_same_sgd_step(
      policy,
      batch,
      (p1, m1),
      (p4, m4),
      ("loss", "grad_norm", "kl/realized", "clip_fraction", "entropy"),
  )
  assert float(m1["grad_norm"]) > 0
  # The step applies updates inside the non-finite guard; it says so when
  # the optimizer has none.
  with pytest.raises(TypeError, match="skip_non_finite"):
    step = learner.make_train_step(policy.graphdef, optax.sgd(1.0), SMOKE)
    step(
        jax.tree.map(jnp.copy, policy.params),
        optax.sgd(1.0).init(policy.params),
        batch,
    )


def test_a_step_on_the_trimmed_batch_equals_the_step_on_the_padded_one(
    rollout_batch,
):
  policy, batch, metrics = rollout_batch
  # The rollout cut the batch to its longest prompt and completion.
  assert batch.prompt_tokens_BxP.shape[1] == metrics["batch/prompt_width"]
  assert batch.completion_tokens_BxT.shape[1] == (
      metrics["batch/completion_width"]
  )
  assert int(batch.completion_mask_BxT.sum(1).max()) <= (
      metrics["batch/completion_width"]
  )
  batch = batch.replace(advantages_B=jnp.linspace(-1.0, 1.0, batch.batch_size))
  # The same rollouts padded with 5 more prompt and 7 more completion columns.
  pad = lambda x, left, right: jnp.pad(x, ((0, 0), (left, right)))
  padded = batch.replace(
      prompt_tokens_BxP=pad(batch.prompt_tokens_BxP, 5, 0),
      prompt_mask_BxP=pad(batch.prompt_mask_BxP, 5, 0),
      completion_tokens_BxT=pad(batch.completion_tokens_BxT, 0, 7),
      completion_mask_BxT=pad(batch.completion_mask_BxT, 0, 7),
      old_logp_BxT=pad(batch.old_logp_BxT, 0, 7),
  )
  tx = non_finite.skip_non_finite(optax.sgd(1.0))
  step = learner.make_train_step(policy.graphdef, tx, SMOKE)
  (p1, _, m1), (p2, _, m2) = (
      step(jax.tree.map(jnp.copy, policy.params), tx.init(policy.params), b)
      for b in (batch, padded)
  )
  # Padding adds exact zeros to each sum, in another order: the padded
  # length's reductions bound the difference (as for micro-batches).
  _assert_same_sgd_step(
      policy,
      padded,
      (p1, m1),
      (p2, m2),
      ("loss", "grad_norm", "kl/realized", "entropy"),
  )


def test_the_realized_kl_is_measured_on_the_first_and_every_nth_step(
    rollout_batch,
):
  policy, batch, _ = rollout_batch
  batch = batch.replace(advantages_B=jnp.linspace(-1.0, 1.0, batch.batch_size))
  config = configs.apply_overrides(SMOKE, ["logging.realized_kl_every=3"])
  tx = non_finite.skip_non_finite(optax.sgd(0.1))
  step = learner.make_train_step(policy.graphdef, tx, config)
  params = jax.tree.map(jnp.copy, policy.params)
  state = tx.init(params)
  measured = []
  for _ in range(6):
    params, state, metrics = step(params, state, batch)
    kl = float(metrics["kl/realized_k3"])
    assert np.isnan(kl) or kl > 0
    measured.append(not np.isnan(kl))
  assert measured == [True, False, True, False, False, True]
  # Two updates per step: the last one of steps 1, 3, 6.
  config = dataclasses.replace(config, num_iterations=2)
  step = learner.make_train_step(policy.graphdef, tx, config)
  state = tx.init(params)
  measured = []
  for _ in range(12):
    params, state, metrics = step(params, state, batch)
    measured.append(not np.isnan(float(metrics["kl/realized_k3"])))
  assert [i + 1 for i, m in enumerate(measured) if m] == [2, 6, 12]


@pytest.mark.parametrize("optimizer", ["adam", "logra", "galore"])
def test_each_optimizer_takes_a_finite_step(rollout_batch, optimizer):
  policy, batch, _ = rollout_batch
  batch = batch.replace(advantages_B=jnp.linspace(-1.0, 1.0, batch.batch_size))
  config = dataclasses.replace(
      SMOKE, optimizer=dataclasses.replace(SMOKE.optimizer, name=optimizer)
  )
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  params = jax.tree.map(jnp.copy, policy.params)
  step = learner.make_train_step(policy.graphdef, tx, config)
  new_params, _, metrics = step(
      *policy_state.init_train_state(config.optimizer, tx, params), batch
  )
  assert all(np.isfinite(float(v)) for v in metrics.values())
  assert float(metrics["update_norm"]) > 0
  assert float(metrics["kl/realized_k3"]) > 0


def _one_step(policy, batch, overrides):
  """One learner step of the smoke config with ``overrides`` from the
  policy's weights: ``(dense params, opt_state, metrics)``."""
  config = configs.apply_overrides(SMOKE, overrides)
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  params = jax.tree.map(jnp.copy, policy.params)
  step = learner.make_train_step(policy.graphdef, tx, config)
  params, state, metrics = step(
      *policy_state.init_train_state(config.optimizer, tx, params), batch
  )
  return policy_state.dense_weights(params, state), state, metrics


def test_sketch_mode_step_equals_dense_mode_step(rollout_batch):
  """LoGRA's learner step with sketch-direct gradients (micro-batched)
  against projecting full gradients."""
  policy, batch, _ = rollout_batch
  batch = batch.replace(advantages_B=jnp.linspace(-1.0, 1.0, batch.batch_size))
  (p_s, _, m_s), (p_d, _, m_d) = (
      _one_step(
          policy,
          batch,
          [
              f"optimizer.gradient_mode={mode}",
              "optimizer.kind=random",
              "optimizer.max_grad_norm=0",
              "micro_batches=2",
          ],
      )
      for mode in ("sketch", "dense")
  )
  for p0, a, b in zip(*(jax.tree.leaves(t) for t in (policy.params, p_s, p_d))):
    # Relative to the step (params round at ~1e-9 absolute).
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b - p0)) <= 1e-4
  np.testing.assert_allclose(m_s["loss"], m_d["loss"], rtol=1e-6)
  # In sketch mode the norm (and its clip) is that of the sketched gradient,
  # at most the full one.
  assert 0 < float(m_s["grad_norm"]) <= float(m_d["grad_norm"])


def test_a_nan_learning_rate_leaves_the_weights_unchanged(rollout_batch):
  policy, batch, _ = rollout_batch
  batch = batch.replace(advantages_B=jnp.linspace(-1.0, 1.0, batch.batch_size))
  optimizer = dataclasses.replace(SMOKE.optimizer)
  # Past the config's validation, as a hand-built chain would be, and as
  # an array (which logra() leaves to optax; a float NaN it refuses).
  object.__setattr__(optimizer, "learning_rate", jnp.asarray(float("nan")))
  tx = policy_state.make_optimizer(optimizer, policy.params)
  step = learner.make_train_step(policy.graphdef, tx, SMOKE)
  params, state, metrics = step(
      *policy_state.init_train_state(
          optimizer, tx, jax.tree.map(jnp.copy, policy.params)
      ),
      batch,
  )
  for before, after in zip(
      jax.tree.leaves(policy.params),
      jax.tree.leaves(policy_state.dense_weights(params, state)),
      strict=True,
  ):
    np.testing.assert_array_equal(after, before)
  guard = non_finite.non_finite_state(state)
  assert non_finite.non_finite_reasons(guard.reason) == ["update"]
  assert int(guard.skipped_steps) == 1
  assert float(metrics["update_norm"]) == 0.0
  assert np.isfinite(float(metrics["loss"]))
  assert int(metrics["projector/non_finite"]) == 0


@pytest.mark.parametrize("optimizer", ["adam", "logra"])
def test_kl_control_scales_the_step_to_the_target(rollout_batch, optimizer):
  policy, batch, _ = rollout_batch
  batch = batch.replace(advantages_B=jnp.linspace(-1.0, 1.0, batch.batch_size))
  _, _, metrics = _one_step(
      policy,
      batch,
      [
          f"optimizer.name={optimizer}",
          "optimizer.learning_rate=0.1",
          "optimizer.target_kl=1e-5",
          "optimizer.kl_subsample=8",
      ],
  )
  assert 0 < float(metrics["kl/scale"]) < 1
  np.testing.assert_allclose(float(metrics["kl/predicted"]), 1e-5, rtol=1e-3)
  assert int(metrics["kl/skipped"]) == 0
  # The realized KL of the scaled step is of the predicted size (a sampled
  # estimate on 16 completions, so only its order of magnitude is checked).
  assert 1e-6 < float(metrics["kl/realized_k3"]) < 1e-4


def test_logra_state_is_smaller_than_dense_adam(policy_folder):
  policy = engine.Policy.load(policy_folder)
  config = dataclasses.replace(SMOKE.optimizer, rank=2)
  state = policy_state.make_optimizer(config, policy.params).init(policy.params)
  from logra_jax import optimizer_state_bytes

  assert optimizer_state_bytes(state) < policy_state.dense_adam_state_bytes(
      policy.params
  )


@pytest.mark.usefixtures("without_compilation_cache")
def test_short_run_writes_summary_and_metrics(policy_folder, tmp_path):
  # A TRL-style reward from a file, beside the task's verifier.
  (tmp_path / "my_rewards.py").write_text(
      "def short(completions, **kwargs):\n"
      "  return [float(len(c) <= 2) for c in completions]\n"
  )
  out = tmp_path / "run"
  config = configs.apply_overrides(
      SMOKE,
      [
          f"policy.path={policy_folder}",
          "steps=2",
          "optimizer.refresh_every=1",  # a window merged every step
          "rewards=[{function: task}, {function: "
          f"'{tmp_path}/my_rewards.py:short', weight: 0.5}}]",
          "logging.samples_every=2",
          "logging.samples_shown=3",
      ],
  )
  printed = []
  summary = trainer.train(config, out, progress=False, log=printed.append)
  tmp_path = out
  written = json.loads((tmp_path / "summary.json").read_text())
  for key in (
      "eval_accuracy_before",
      "eval_accuracy_after",
      "optimizer_state_bytes",
      "weights_bytes",
      "dense_adam_state_bytes",
      "wall_seconds",
  ):
    assert key in written
  assert 0.0 <= written["eval_accuracy_after"] <= 1.0
  # Factored float32 weights: the bases (the params) plus the coordinates.
  assert written["weights_bytes"] > 4 * summary["num_params"]
  assert written["optimizer_state_bytes"] < written["dense_adam_state_bytes"]
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 2 == summary["steps"]
  assert (tmp_path / "curves.png").stat().st_size > 0
  assert {"reward/total", "kl/realized", "loss"} <= set(json.loads(lines[0]))
  # The realized KL is measured on the first step and every 10th.
  assert "kl/realized" not in json.loads(lines[1])
  # The train step compiled once per batch shape, and no more.
  shapes = {
      (m["batch/prompt_width"], m["batch/completion_width"])
      for m in map(json.loads, lines)
  }
  assert json.loads(lines[-1])["compile/train_step"] == len(shapes)
  # The colocated engine samples with the learner's own arrays: no message,
  # no resync; a full bfloat16 broadcast is what it saves.
  for line in map(json.loads, lines):
    assert line["sync/resyncs"] == 0
    assert line["sync/bytes"] == 0 and line["time/sync_s"] >= 0
    assert line["sync/full_bf16_bytes"] == 2 * summary["num_params"]
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  # Both rewards scored every completion; the total is their weighted sum.
  first = json.loads(lines[0])
  assert first["reward/total"] == pytest.approx(
      first["reward/reasoning_gym_score"] + 0.5 * first["reward/short"]
  )
  # Sample tables at steps 1 and 2, on the console and in samples.jsonl.
  samples = [
      json.loads(line)
      for line in (tmp_path / "samples.jsonl").read_text().splitlines()
  ]
  assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2]
  assert {
      "prompt",
      "completion",
      "answer",
      "reward",
      "reward/short",
      "reward/reasoning_gym_score",
  } <= set(samples[0])
  assert sum("samples at step" in line for line in printed) == 2
  # The run folder's config.yaml is the run's config.
  assert configs.load_config("tiny", [tmp_path / "config.yaml"]) == config


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["rollout.num_generations=1"], "num_generations must be >= 2"),
        (["micro_batches=3"], "must divide the rollout batch"),
        (["optimizer.name=sgd"], "optimizer.name must be one of"),
        (["optimizer.rnak=4"], "unknown config key optimizer.rnak"),
        (
            ["steps=abc"],
            "steps: Value 'abc' of type 'str' could not be "
            "converted to Integer",
        ),
        (["advantage=ppo"], "advantage must be one of"),
        (["optimizer.target_kl=0"], "target_kl must be > 0"),
        (["optimizer.kl_mode=exact"], "kl_mode must be one of"),
        (["optimizer.kl_subsample=99"], "exceeds the rollout batch"),
        (["optimizer.gradient_mode=full"], "gradient_mode must be one of"),
        (
            ["optimizer.name=adam", "optimizer.project_embeddings=true"],
            "project_embeddings applies to logra and galore",
        ),
    ],
)
def test_bad_config_is_rejected_before_compiling(overrides, match):
  with pytest.raises(ValueError, match=match):
    configs.apply_overrides(SMOKE, overrides)


def test_unknown_preset_lists_valid_ones(capsys):
  assert cli_main(["train", "--preset", "huge"]) == 2
  assert "valid presets: ['smoke', 'tiny']" in capsys.readouterr().err


def test_unknown_task_is_a_clear_error(capsys):
  assert (
      cli_main(["eval", "--policy", "x", "--set", "task.name=no_such_task"])
      == 2
  )
  assert "no_such_task" in capsys.readouterr().err


def test_bfloat16_step_with_projected_tied_embeddings_is_finite():
  """Qwen2.5-0.5B's vocabulary and tied table, bfloat16 compute, rank 64
  (range-finder width 72) and sketch-direct gradients on a tiny body: three
  learner steps (a refresh, the stored projector, a refresh) are applied
  with finite loss, gradient and weights. It was NaN on every step on CPU:
  the sketch-direct forward multiplied the tied LM head's low-rank term by
  its zero coordinates, and XLA:CPU compiled that bfloat16 product, fused
  with the log-softmax's max over the vocabulary, to NaN."""
  vocab = 151936
  config = configs.apply_overrides(
      SMOKE,
      [
          "optimizer.rank=64",
          "optimizer.project_embeddings=true",
          "optimizer.gradient_mode=sketch",
          "micro_batches=1",
      ],
  )
  model_config = models.DecoderConfig.tiny(
      vocab_size=vocab,
      hidden_size=128,
      num_layers=1,
      tie_word_embeddings=True,
      dtype="bfloat16",
  )
  graphdef, params = models.split_model(models.init_model(model_config, 0))
  B, P, T = 4, 3, 5
  prompt_key, completion_key = jax.random.split(jax.random.key(0))
  batch = algo.RolloutBatch(
      prompt_tokens_BxP=jax.random.randint(prompt_key, (B, P), 0, vocab),
      prompt_mask_BxP=jnp.ones((B, P), jnp.int32),
      completion_tokens_BxT=jax.random.randint(
          completion_key, (B, T), 0, vocab
      ),
      completion_mask_BxT=jnp.ones((B, T), jnp.int32),
      old_logp_BxT=jnp.full((B, T), -np.log(vocab), jnp.float32),
      advantages_B=jnp.linspace(-1.0, 1.0, B),
      num_generations=2,
  )
  tx = policy_state.make_optimizer(config.optimizer, params)
  params, state = policy_state.init_train_state(config.optimizer, tx, params)
  assert (
      sketch_grad.project_state(state).spec.plan_tree()["embed"].value.projected
  )
  step = learner.make_train_step(graphdef, tx, config)
  for _ in range(3):
    params, state, metrics = step(params, state, batch)
    assert np.isfinite(float(metrics["loss"]))
    assert np.isfinite(float(metrics["grad_norm"]))
    assert float(metrics["update_norm"]) > 0
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
  assert int(non_finite.non_finite_state(state).skipped_steps) == 0


def _step_temporaries(
    vocab: int, hidden: int, projected: bool, kl_control: bool
) -> int:
  """Temporaries of the compiled sketch-direct train step (one refresh
  and merge included) of a one-layer decoder with an untied head, with
  or without predicted-KL step control."""
  model_config = models.DecoderConfig.tiny(
      vocab_size=vocab,
      hidden_size=hidden,
      num_layers=1,
      tie_word_embeddings=False,
  )
  graphdef, params = models.split_model(models.init_model(model_config, 0))
  B, P, T = 2, 3, 4
  batch = algo.RolloutBatch(
      prompt_tokens_BxP=jnp.ones((B, P), jnp.int32),
      prompt_mask_BxP=jnp.ones((B, P), jnp.int32),
      completion_tokens_BxT=jnp.ones((B, T), jnp.int32),
      completion_mask_BxT=jnp.ones((B, T), jnp.int32),
      old_logp_BxT=jnp.full((B, T), -np.log(vocab), jnp.float32),
      advantages_B=jnp.linspace(-1.0, 1.0, B),
      num_generations=2,
  )
  config = configs.apply_overrides(
      SMOKE,
      [
          "optimizer.rank=8",
          f"optimizer.project_embeddings={str(projected).lower()}",
          "optimizer.gradient_mode=sketch",
          "micro_batches=1",
      ]
      + (["optimizer.target_kl=0.01"] if kl_control else []),
  )
  tx = policy_state.make_optimizer(config.optimizer, params)
  weights, state = policy_state.init_train_state(config.optimizer, tx, params)
  step = learner.make_train_step(graphdef, tx, config)
  compiled = step.lower(weights, state, batch).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
@pytest.mark.parametrize("kl_control", [False, True])
def test_the_sketch_step_never_forms_a_projected_head(monkeypatch, kl_control):
  """With the embeddings projected, the LM head is `c B + P A` and its
  sketch-direct gradient is `(h P)^T dlogits`: doubling the vocabulary
  from V to 2V grows the compiled train step's temporaries (XLA's memory
  analysis) by less than half of the `[D, V]` head it adds; what grows is
  `O(V r)` (the range finder, the projector) and the logits of a few
  tokens. With the head and the table dense, their gradients alone grow
  by twice the head: the bound tells the two apart. A refresh merges the
  window into the base in blocks of rows (here of `[D, V] / 32`), each a
  temporary of its own. Under predicted-KL step control the predictor
  applies the factored head and its tangent unformed too."""
  vocab, hidden = 8192, 512
  head_bytes = hidden * vocab * 4
  monkeypatch.setattr(factored, "MERGE_BLOCK_BYTES", head_bytes // 32)
  growth = {
      projected: _step_temporaries(2 * vocab, hidden, projected, kl_control)
      - _step_temporaries(vocab, hidden, projected, kl_control)
      for projected in (True, False)
  }
  assert growth[True] < head_bytes / 2 <= growth[False], (growth, head_bytes)
