"""Tests for logra_jax.rl.algo against hand-computed values."""

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import configs
from logra_jax.configs.loss import ROLLOUT_CORRECTIONS
from logra_jax.rl import algo

# 2 prompts x 3 generations.
REWARDS = jnp.array([1.0, 0.0, 0.0, 2.0, 1.0, 0.0])


def test_grpo_advantages_by_hand():
  # Group 1: mean 1/3, population std sqrt(2/9); group 2: mean 1, std sqrt(2/3).
  s1, s2 = np.sqrt(2 / 9), np.sqrt(2 / 3)
  expected = [2 / 3 / s1, -1 / 3 / s1, -1 / 3 / s1, 1 / s2, 0.0, -1 / s2]
  np.testing.assert_allclose(
      algo.grpo_advantages(REWARDS, 3), expected, rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(expected[0], 1.4142135, rtol=1e-6)  # sqrt(2)


def test_dr_grpo_advantages_by_hand():
  np.testing.assert_allclose(
      algo.dr_grpo_advantages(REWARDS, 3),
      [2 / 3, -1 / 3, -1 / 3, 1.0, 0.0, -1.0],
      rtol=1e-6,
  )


def test_rloo_advantages_by_hand():
  # R_i - mean of the other two: 1 - 0, 0 - 1/2, 0 - 1/2, 2 - 1/2, 1 - 1, 0 - 3/2.
  np.testing.assert_allclose(
      algo.rloo_advantages(REWARDS, 3),
      [1.0, -0.5, -0.5, 1.5, 0.0, -1.5],
      rtol=1e-6,
  )


def test_the_configs_advantage_names_are_the_implemented_estimators():
  assert tuple(algo.ADVANTAGE_ESTIMATORS) == configs.ADVANTAGES


def test_equal_rewards_give_zero_advantage():
  rewards = jnp.ones(6)
  for name in algo.ADVANTAGE_ESTIMATORS:
    np.testing.assert_array_equal(
        algo.compute_advantages(rewards, 3, name), np.zeros(6)
    )


def test_advantage_errors():
  with pytest.raises(ValueError, match="num_generations >= 2"):
    algo.grpo_advantages(REWARDS, 1)
  with pytest.raises(ValueError, match="grouped contiguously"):
    algo.rloo_advantages(REWARDS, 4)
  with pytest.raises(
      ValueError, match="valid: \\['dr_grpo', 'grpo', 'rloo'\\]"
  ):
    algo.compute_advantages(REWARDS, 3, "ppo")


def test_advantages_jit():
  fn = jax.jit(algo.compute_advantages, static_argnums=(1, 2))
  np.testing.assert_allclose(
      fn(REWARDS, 3, "rloo"), algo.rloo_advantages(REWARDS, 3)
  )


def test_kl_estimators_by_hand():
  # delta = ref - logp = [0, ln 2, -ln 2]
  logp = jnp.log(jnp.array([[0.5, 0.25, 0.5]]))
  ref = jnp.log(jnp.array([[0.5, 0.5, 0.25]]))
  ln2 = np.log(2.0)
  np.testing.assert_allclose(
      algo.kl_penalty(logp, ref, "k1"), [[0.0, -ln2, ln2]], atol=1e-6
  )
  np.testing.assert_allclose(
      algo.kl_penalty(logp, ref, "k2"),
      [[0.0, 0.5 * ln2**2, 0.5 * ln2**2]],
      atol=1e-6,
  )
  # k3 = e^delta - delta - 1: 2 - ln2 - 1 and 1/2 + ln2 - 1.
  np.testing.assert_allclose(
      algo.kl_penalty(logp, ref, "k3"), [[0.0, 1 - ln2, ln2 - 0.5]], atol=1e-6
  )
  np.testing.assert_allclose(
      algo.kl_penalty(logp, ref, "k3"), [[0.0, 0.3068528, 0.1931472]], atol=1e-6
  )


def test_kl_clamp():
  logp, ref = jnp.array([[-30.0]]), jnp.array(
      [[-10.0]]
  )  # delta = 20, clamped to 10.
  np.testing.assert_allclose(
      algo.kl_penalty(logp, ref, "k3", clamp=10.0),
      [[np.exp(10.0) - 11.0]],
      rtol=1e-6,
  )
  np.testing.assert_allclose(
      algo.kl_penalty(logp, ref, "k1", clamp=10.0), [[-10.0]]
  )
  grad = jax.grad(lambda lp: algo.kl_penalty(lp, ref, "k3", clamp=10.0).sum())(
      logp
  )
  np.testing.assert_array_equal(
      grad, [[0.0]]
  )  # outside the clamp: no gradient.
  with pytest.raises(ValueError, match="valid: \\['k1', 'k2', 'k3'\\]"):
    algo.kl_penalty(logp, ref, "k4")


# Hand example for the loss: old log-probs 0, so ratio = exp(logp).
RATIOS = np.array([[1.0, 1.5, 0.5], [1.5, 0.5, 1.0]], np.float32)
LOGP = jnp.log(jnp.asarray(RATIOS))
OLD = jnp.zeros((2, 3))
MASK = jnp.array([[1, 1, 1], [1, 1, 0]])
ADV = jnp.array([1.0, -2.0])
# The ratio against OLD as the old policy: the loss without a rollout
# correction (with one, OLD would be the sampler's and the ratio's old policy
# the learner's own log-probs).
CLIP = dict(eps_low=0.2, eps_high=0.3, rollout_correction="none")
# Per-token losses -min(r A, clip(r, 0.8, 1.3) A):
#   seq 0 (A=+1): -1, -1.3 (clipped high), -0.5          -> sum -2.8 over 3 tokens
#   seq 1 (A=-2): +3, +1.6 (clipped low), [masked]       -> sum +4.6 over 2 tokens


@pytest.mark.parametrize(
    "aggregation, expected",
    [
        ("token-mean", 1.8 / 5),
        ("seq-mean-token-mean", (-2.8 / 3 + 4.6 / 2) / 2),
        ("seq-mean-token-sum-norm", 1.8 / (2 * 4)),
    ],
)
def test_loss_aggregations_by_hand(aggregation, expected):
  config = algo.LossConfig(**CLIP, aggregation=aggregation, max_len=4)
  num, den, _ = algo.loss_terms(LOGP, MASK, ADV, OLD, None, config)
  np.testing.assert_allclose(algo.finalize(num, den), expected, rtol=1e-5)


def test_loss_metrics_by_hand():
  num, den, metrics = algo.loss_terms(
      LOGP, MASK, ADV, OLD, None, algo.LossConfig(**CLIP)
  )
  np.testing.assert_allclose((num, den), (1.8, 5.0), rtol=1e-5)
  got = algo.finalize_metrics(metrics)
  np.testing.assert_allclose(got["clip_fraction"], 2 / 5, rtol=1e-6)
  np.testing.assert_allclose(got["clip_low_fraction"], 1 / 5, rtol=1e-6)
  np.testing.assert_allclose(got["clip_high_fraction"], 1 / 5, rtol=1e-6)
  np.testing.assert_allclose(
      got["ratio_mean"], (1 + 1.5 + 0.5 + 1.5 + 0.5) / 5, rtol=1e-6
  )
  np.testing.assert_allclose(got["pg_loss"], 1.8 / 5, rtol=1e-5)
  assert "kl_ref" not in got  # no reference given.
  # |log pi - log pi_old| over the valid tokens: |log r| of the same ratios.
  gaps = np.abs(np.log([1, 1.5, 0.5, 1.5, 0.5]))
  np.testing.assert_allclose(
      got["rollout/logprob_gap_mean"], gaps.mean(), rtol=1e-5
  )
  np.testing.assert_allclose(
      got["rollout/logprob_gap_max"], np.log(2), rtol=1e-5
  )


def test_clip_gradients_both_sides_by_hand():
  # d(token-mean)/d logp = -A r / 5 where the clip is inactive, 0 where it is active.
  config = algo.LossConfig(**CLIP)
  grad = jax.grad(
      lambda lp: algo.finalize(
          *algo.loss_terms(lp, MASK, ADV, OLD, None, config)[:2]
      )
  )
  np.testing.assert_allclose(
      grad(LOGP), [[-0.2, 0.0, -0.1], [0.6, 0.0, 0.0]], rtol=1e-5, atol=1e-7
  )


def test_symmetric_clip_differs_from_clip_higher():
  # With eps_high = 0.6 the ratio 1.5 at A > 0 is no longer clipped: -1.5 instead of -1.3.
  config = algo.LossConfig(eps_low=0.2, eps_high=0.6, rollout_correction="none")
  num, _, metrics = algo.loss_terms(LOGP, MASK, ADV, OLD, None, config)
  np.testing.assert_allclose(num, 1.8 - 0.2, rtol=1e-5)
  np.testing.assert_allclose(metrics["clip_high_fraction"][0], 0.0)


def test_on_policy_default_old_logp():
  # old = stop_gradient(logp): ratio 1 and gradient -A m / num_tokens.
  config = algo.LossConfig()
  loss = lambda lp: algo.finalize(
      *algo.loss_terms(lp, MASK, ADV, None, None, config)[:2]
  )
  np.testing.assert_allclose(loss(LOGP), -(1 + 1 + 1 - 2 - 2) / 5, rtol=1e-6)
  np.testing.assert_allclose(
      jax.grad(loss)(LOGP), [[-0.2, -0.2, -0.2], [0.4, 0.4, 0.0]], rtol=1e-6
  )


def test_padding_values_are_ignored():
  # -inf / NaN at the masked position change neither the loss nor any gradient.
  config = algo.LossConfig(**CLIP, beta=0.1)
  ref = LOGP - 0.3

  def loss(lp, old, rf):
    return algo.finalize(*algo.loss_terms(lp, MASK, ADV, old, rf, config)[:2])

  garbage = lambda x, v: x.at[1, 2].set(v)
  clean_loss, clean_grad = jax.value_and_grad(loss)(LOGP, OLD, ref)
  dirty_loss, dirty_grad = jax.value_and_grad(loss)(
      garbage(LOGP, -jnp.inf), garbage(OLD, jnp.nan), garbage(ref, jnp.inf)
  )
  # The same computation on the same unmasked values: bit for bit.
  np.testing.assert_array_equal(dirty_loss, clean_loss)
  np.testing.assert_array_equal(dirty_grad, clean_grad)
  assert dirty_grad[1, 2] == 0.0


def test_kl_term_added_with_beta():
  ref = LOGP - jnp.log(2.0)  # delta = -ln 2 on every token: k3 = ln 2 - 1/2.
  config = algo.LossConfig(**CLIP, beta=0.1)
  num, den, metrics = algo.loss_terms(LOGP, MASK, ADV, OLD, ref, config)
  k3 = np.log(2.0) - 0.5
  np.testing.assert_allclose(num, 1.8 + 0.1 * 5 * k3, rtol=1e-5)
  np.testing.assert_allclose(
      algo.finalize_metrics(metrics)["kl_ref"], k3, rtol=1e-5
  )
  # beta = 0 with a reference: reported, not in the loss.
  num0, _, metrics0 = algo.loss_terms(
      LOGP, MASK, ADV, OLD, ref, algo.LossConfig(**CLIP)
  )
  np.testing.assert_allclose(num0, 1.8, rtol=1e-5)
  assert "kl_ref" in metrics0


def test_loss_terms_jit_with_static_config():
  config = algo.LossConfig(**CLIP, aggregation="seq-mean-token-mean")
  jitted = jax.jit(algo.loss_terms, static_argnames="config")
  num, den, _ = jitted(LOGP, MASK, ADV, OLD, None, config=config)
  np.testing.assert_allclose(
      algo.finalize(num, den), (-2.8 / 3 + 4.6 / 2) / 2, rtol=1e-5
  )


def test_loss_config_errors():
  with pytest.raises(ValueError, match="needs ref_logp_BxT"):
    algo.loss_terms(LOGP, MASK, ADV, OLD, None, algo.LossConfig(beta=0.1))
  with pytest.raises(
      ValueError, match="loss.aggregation must be one of \\('token-mean'"
  ):
    algo.LossConfig(aggregation="mean")
  with pytest.raises(ValueError, match="needs loss.max_len"):
    algo.LossConfig(aggregation="seq-mean-token-sum-norm")
  with pytest.raises(ValueError, match="kl_estimator"):
    algo.LossConfig(kl_estimator="k5")
  with pytest.raises(ValueError, match="eps_low"):
    algo.LossConfig(eps_low=-0.1)
  with pytest.raises(ValueError, match="expected logp \\[B, T\\]"):
    algo.loss_terms(LOGP, MASK, ADV[:1], OLD, None, algo.LossConfig())


def _random_batch(num_generations=2, b=8, t=5, seed=0):
  rng = np.random.default_rng(seed)
  lengths = np.array([5, 3, 0, 1, 4, 5, 2, 3])  # row 2: all padding.
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)
  batch = algo.RolloutBatch(
      prompt_tokens_BxP=jnp.asarray(rng.integers(0, 10, (b, 3)), jnp.int32),
      prompt_mask_BxP=jnp.ones((b, 3), jnp.int32),
      completion_tokens_BxT=jnp.asarray(rng.integers(0, 10, (b, t)), jnp.int32),
      completion_mask_BxT=jnp.asarray(mask),
      old_logp_BxT=jnp.asarray(rng.normal(-1.0, 0.3, (b, t)), jnp.float32),
      advantages_B=jnp.asarray(rng.normal(size=b), jnp.float32),
      ref_logp_BxT=jnp.asarray(rng.normal(-1.0, 0.3, (b, t)), jnp.float32),
      num_generations=num_generations,
  )
  logp = jnp.asarray(rng.normal(-1.0, 0.3, (b, t)), jnp.float32)
  return batch, logp


@pytest.mark.parametrize("correction", ROLLOUT_CORRECTIONS)
@pytest.mark.parametrize("aggregation", configs.AGGREGATIONS)
@pytest.mark.parametrize("num_micro", [2, 4])
def test_micro_batches_equal_full_batch(aggregation, num_micro, correction):
  batch, logp_BxT = _random_batch()
  config = algo.LossConfig(
      eps_low=0.1,
      eps_high=0.15,
      beta=0.05,
      aggregation=aggregation,
      max_len=7,
      rollout_correction=correction,
  )

  def terms(lp, b):
    return algo.loss_terms(
        lp,
        b.completion_mask_BxT,
        b.advantages_B,
        b.old_logp_BxT,
        b.ref_logp_BxT,
        config,
    )

  full_loss, full_grad = jax.value_and_grad(
      lambda lp: algo.finalize(*terms(lp, batch)[:2])
  )(logp_BxT)
  full_metrics = algo.finalize_metrics(terms(logp_BxT, batch)[2])

  @jax.jit
  def accumulate(logp_MxBxT, mb):
    def body(carry, xs):
      lp, b = xs

      def numerator(x):
        num, den, metrics = terms(x, b)
        return num, (den, metrics)

      (num, (den, metrics)), g = jax.value_and_grad(numerator, has_aux=True)(lp)
      carry = jax.tree.map(jnp.add, carry, (num, den, metrics))
      return carry, g

    zero = jax.tree.map(
        jnp.zeros_like,
        jax.eval_shape(
            lambda: terms(logp_MxBxT[0], jax.tree.map(lambda x: x[0], mb))
        ),
    )
    (num, den, metrics), grads = jax.lax.scan(body, zero, (logp_MxBxT, mb))
    return num, den, metrics, grads

  mb = batch.micro_batches(num_micro)
  num, den, metrics, grads_MxBxT = accumulate(
      logp_BxT.reshape(num_micro, -1, 5), mb
  )
  np.testing.assert_allclose(
      algo.finalize(num, den), full_loss, rtol=1e-5, atol=1e-7
  )
  np.testing.assert_allclose(
      grads_MxBxT.reshape(logp_BxT.shape) / den, full_grad, rtol=1e-5, atol=1e-7
  )
  for name, value in algo.finalize_metrics(metrics).items():
    if name.endswith(("_min", "_max")):  # reduced by min / max, not summed
      continue
    np.testing.assert_allclose(value, full_metrics[name], rtol=1e-5, atol=1e-7)
  assert float(jnp.abs(full_grad).sum()) > 0


def test_rollout_batch_is_a_pytree_with_static_generations():
  batch, _ = _random_batch()
  leaves = jax.tree.leaves(batch)
  assert len(leaves) == 7  # num_generations is static, not a leaf.
  mb = batch.micro_batches(4)
  assert mb.completion_tokens_BxT.shape == (4, 2, 5) and mb.num_generations == 2
  no_ref = batch.replace(ref_logp_BxT=None)
  assert len(jax.tree.leaves(no_ref.micro_batches(2))) == 6
  with pytest.raises(ValueError, match="divide the batch size 8"):
    batch.micro_batches(3)
  episodes = batch.replace(context_mask_BxT=jnp.ones((8, 5), jnp.int32))
  assert episodes.micro_batches(4).context_mask_BxT.shape == (4, 2, 5)


@hypothesis.settings(deadline=None, max_examples=200)
@hypothesis.given(limit=st.integers(1, 5000), fraction=st.floats(0.0, 1.0))
def test_bucket_widths_fit_the_rows_with_little_padding(limit, fraction):
  longest = int(fraction * limit)
  width = algo.bucket_width(longest, limit)
  assert longest <= width <= limit
  # Beyond 4 tokens, padding stays under a third of the width (each bucket
  # is at most 1.5 times the one before it).
  if width < limit and longest > 4:
    assert width - longest < width / 3
  # Widths are few: one of 4, 6, 8, 12, 16, ... or the limit.
  assert width == limit or width in {m << k for m in (4, 6) for k in range(12)}
  # Longer rows never get a narrower batch.
  assert algo.bucket_width(min(longest + 1, limit), limit) >= width


def test_a_trimmed_batch_keeps_the_last_prompt_and_first_completion_columns():
  batch, _ = _random_batch()  # [8, 5] completions
  batch = batch.replace(
      prompt_tokens_BxP=jnp.array([[0, 0, 7, 8]] * 8),
      prompt_mask_BxP=jnp.array([[0, 0, 1, 1]] * 8),
  )
  trimmed = batch.trimmed(3, 4)
  np.testing.assert_array_equal(trimmed.prompt_tokens_BxP, [[0, 7, 8]] * 8)
  np.testing.assert_array_equal(trimmed.old_logp_BxT, batch.old_logp_BxT[:, :4])
  assert trimmed.ref_logp_BxT.shape == (8, 4)
  assert trimmed.context_mask_BxT is None
  episodes = batch.replace(context_mask_BxT=jnp.ones((8, 5), jnp.int32))
  assert episodes.trimmed(3, 4).context_mask_BxT.shape == (8, 4)
  for widths, name in (((0, 4), "prompt_width"), ((3, 6), "completion_width")):
    with pytest.raises(ValueError, match=name):
      batch.trimmed(*widths)
  with pytest.raises(ValueError, match="longest=9"):
    algo.bucket_width(9, 8)
