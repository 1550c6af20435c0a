"""The rollout-to-learner correction (``loss.rollout_correction``): truncated
and masked importance weights against hand-computed values, ``"none"`` as
the loss without it, micro-batches against the full batch, the proximal
log-probs shared by a batch's updates, and bad config input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from logra_jax import configs
from logra_jax import models
from logra_jax.cli import main as cli_main
from logra_jax.configs.loss import ROLLOUT_CORRECTIONS
from logra_jax.optim import non_finite
from logra_jax.rl import algo
from logra_jax.rl import learner
from logra_jax.rl import learner_state
from logra_jax.rl import losses
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

SMOKE = configs.get_preset("smoke")
CAP = 2.0
# Two sequences, the sampler's log-probs q = 0, so w = exp(p) with the
# proximal p: weights 3 and 2.5 are above the cap (2 of 5 valid tokens).
WEIGHTS = np.array([[3.0, 1.5, 0.5], [1.0, 2.5, 1.0]], np.float32)
MASK = jnp.array([[1, 1, 1], [1, 1, 0]])
ROLLOUT = jnp.zeros((2, 3))
PROXIMAL = jnp.log(jnp.asarray(WEIGHTS))
# The policy's ratios to the proximal log-probs, and the clip loss's per
# token -min(r A, clip(r, 0.8, 1.3) A) (as in test_algo):
#   seq 0 (A=+1): -1, -1.3 (clipped high), -0.5
#   seq 1 (A=-2): +3, +1.6 (clipped low), [masked]
RATIOS = np.array([[1.0, 1.5, 0.5], [1.5, 0.5, 1.0]], np.float32)
LOGP = PROXIMAL + jnp.log(jnp.asarray(RATIOS))
ADV = jnp.array([1.0, -2.0])
CLIP_LOSS = np.array([[-1.0, -1.3, -0.5], [3.0, 1.6, 0.0]])
# d(clip loss)/d logp: -A r where the clip is inactive, 0 where it acts.
CLIP_GRAD = np.array([[-1.0, 0.0, -0.5], [3.0, 0.0, 0.0]])
APPLIED = {
    "tis": np.array([[2.0, 1.5, 0.5], [1.0, 2.0, 1.0]]),
    "mis": np.array([[0.0, 1.5, 0.5], [1.0, 0.0, 1.0]]),
}
# float32 values of a few exp/log roundings summed over at most 5 tokens.
RTOL = 2 * float_tolerance(np.float32, 5 + 4)


def _config(correction, cap=CAP):
  return configs.LossConfig(
      eps_low=0.2,
      eps_high=0.3,
      rollout_correction=correction,
      rollout_correction_cap=cap,
  )


def _loss(correction, logp=LOGP, proximal=PROXIMAL, cap=CAP):
  """The token-mean loss, its gradient in ``logp`` and the metrics."""
  config = _config(correction, cap)
  terms = lambda lp: algo.loss_terms(
      lp, MASK, ADV, ROLLOUT, None, config, proximal
  )
  value, grad = jax.value_and_grad(lambda lp: algo.finalize(*terms(lp)[:2]))(
      logp
  )
  return value, grad, algo.finalize_metrics(terms(logp)[2])


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_the_weights_by_hand(correction):
  weight, metrics = losses.rollout_weights(
      PROXIMAL, ROLLOUT, MASK.astype(jnp.float32), correction, CAP
  )
  np.testing.assert_allclose(weight, APPLIED[correction], rtol=RTOL)
  got = algo.finalize_metrics(metrics)
  valid = np.asarray(MASK, bool)
  np.testing.assert_allclose(
      got["rollout/is_weight_mean"],
      APPLIED[correction][valid].mean(),
      rtol=RTOL,
  )
  assert got["rollout/is_truncated_fraction"] == np.float32(2 / 5)


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_the_corrected_clip_loss_and_gradient_by_hand(correction):
  # Each token's clip loss (its ratio to the proximal log-probs) times its
  # weight; the weight carries no gradient.
  w = APPLIED[correction] * np.asarray(MASK)
  value, grad, metrics = _loss(correction)
  np.testing.assert_allclose(value, (w * CLIP_LOSS).sum() / 5, rtol=RTOL)
  np.testing.assert_allclose(grad, w * CLIP_GRAD / 5, rtol=RTOL, atol=1e-7)
  np.testing.assert_allclose(
      metrics["ratio_mean"], RATIOS[np.asarray(MASK, bool)].mean(), rtol=RTOL
  )
  np.testing.assert_allclose(metrics["clip_fraction"], 2 / 5, rtol=RTOL)


def test_below_the_cap_tis_and_mis_are_the_plain_weight():
  # Below the cap both weights are exp(p - q); with the cap above every
  # weight, both are the plain importance weight.
  tis = _loss("tis", cap=4.0)
  mis = _loss("mis", cap=4.0)
  for a, b in zip(tis, mis):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  assert float(tis[2]["rollout/is_truncated_fraction"]) == 0


def test_none_is_the_loss_without_a_correction_bit_for_bit():
  # "none": the sampler's log-probs are the ratio's old policy, no weight,
  # no metric of it, the proximal ones unused: the policy loss's own sum.
  config = _config("none")
  mask = MASK.astype(jnp.float32)

  def by_hand(lp):
    pg_BxT, _ = losses.clip_loss(lp * mask, ROLLOUT, mask, ADV, 0.2, 0.3)
    return (pg_BxT * mask).sum() / mask.sum()

  def loss(lp, proximal):
    terms = algo.loss_terms(lp, MASK, ADV, ROLLOUT, None, config, proximal)
    return algo.finalize(*terms[:2])

  for proximal in (None, PROXIMAL):
    value, grad = jax.value_and_grad(loss)(LOGP, proximal)
    expected, expected_grad = jax.value_and_grad(by_hand)(LOGP)
    np.testing.assert_array_equal(value, expected)
    np.testing.assert_array_equal(grad, expected_grad)
  metrics = algo.loss_terms(LOGP, MASK, ADV, ROLLOUT, None, config)[2]
  assert not any(name.startswith("rollout/is_") for name in metrics)


@pytest.mark.parametrize("correction", ["tis", "mis"])
@pytest.mark.parametrize("policy_loss", configs.POLICY_LOSSES)
def test_the_samplers_logprobs_as_proximal_ones_change_nothing(
    correction, policy_loss
):
  # p = q: every weight is exp(0) = 1 exactly, so the corrected loss is the
  # uncorrected one bit for bit, for every policy loss.
  def run(c):
    config = configs.LossConfig(policy_loss=policy_loss, rollout_correction=c)
    terms = lambda lp: algo.loss_terms(
        lp, MASK, ADV, PROXIMAL, None, config, PROXIMAL
    )
    return jax.value_and_grad(lambda lp: algo.finalize(*terms(lp)[:2]))(LOGP)

  for a, b in zip(run(correction), run("none")):
    np.testing.assert_array_equal(a, b)


def test_one_update_per_batch_takes_its_own_logprobs_as_proximal():
  # proximal None: p = stop_gradient(logp), ratio exactly 1, w = exp(logp - q).
  value, grad, metrics = _loss("tis", logp=PROXIMAL, proximal=None)
  w = APPLIED["tis"] * np.asarray(MASK)
  adv_BxT = np.asarray(ADV)[:, None] * np.asarray(MASK)
  np.testing.assert_allclose(value, -(w * adv_BxT).sum() / 5, rtol=RTOL)
  np.testing.assert_allclose(grad, -w * adv_BxT / 5, rtol=RTOL)
  assert float(metrics["ratio_mean"]) == 1


@pytest.mark.parametrize("correction", ROLLOUT_CORRECTIONS)
@pytest.mark.parametrize(
    "policy_loss, level",
    [("clip", None), ("gspo", None), ("gspo_token", None), ("cispo", None)]
    + [("cispo", "sequence")],
)
@pytest.mark.parametrize("aggregation", configs.AGGREGATIONS)
def test_micro_batches_reduce_to_the_full_batch(
    correction, policy_loss, level, aggregation
):
  rng = np.random.default_rng(0)
  b, t = 8, 5
  lengths = np.array([5, 3, 0, 1, 4, 5, 2, 3])
  mask = jnp.asarray((np.arange(t)[None, :] < lengths[:, None]).astype(int))
  draw = lambda scale: jnp.asarray(rng.normal(0.0, scale, (b, t)), jnp.float32)
  rollout = draw(0.3) - 1.0
  proximal = rollout + draw(0.5)  # weights on both sides of the cap
  logp = proximal + draw(0.2)
  adv = jnp.asarray(rng.normal(size=b), jnp.float32)
  config = configs.LossConfig(
      policy_loss=policy_loss,
      importance_level=level,
      eps_low=0.1,
      eps_high=0.15,
      aggregation=aggregation,
      max_len=t,
      rollout_correction=correction,
  )

  def terms(lp, m, a, q, p):
    num, den, metrics = algo.loss_terms(lp, m, a, q, None, config, p)
    return num, (den, metrics)

  inputs = (logp, mask, adv, rollout, proximal)
  (num, (den, full_metrics)), full_grad = jax.value_and_grad(
      terms, has_aux=True
  )(*inputs)
  split = lambda x: x.reshape((4, -1) + x.shape[1:])
  (nums, (dens, metrics_M)), grads = jax.lax.map(
      lambda xs: jax.value_and_grad(terms, has_aux=True)(*xs),
      tuple(map(split, inputs)),
  )
  # Sums of at most b * t terms in another grouping.
  tol = 2 * float_tolerance(np.float32, b * t)
  np.testing.assert_allclose(
      algo.finalize(nums.sum(), dens.sum()),
      algo.finalize(num, den),
      rtol=tol,
      atol=tol,
  )
  np.testing.assert_array_equal(dens.sum(), den)
  np.testing.assert_allclose(
      grads.reshape(logp.shape) / dens.sum(), full_grad / den, atol=tol
  )
  got = algo.finalize_metrics(losses.reduce_metrics(metrics_M))
  expected = algo.finalize_metrics(full_metrics)
  assert set(got) == set(expected)
  # Each metric is a mean of terms of at most max|A| x max(ratio,
  # 1 + eps_high) x cap in magnitude: the sums' error bound is tol times
  # that, whatever cancellation leaves of the mean (pg_loss 0.003).
  ratio = float(jnp.max(jnp.exp(logp - proximal)))
  scale = (
      float(jnp.max(jnp.abs(adv)))
      * max(ratio, 1 + config.eps_high)
      * config.rollout_correction_cap
  )
  for name, value in expected.items():
    np.testing.assert_allclose(
        got[name], value, rtol=tol, atol=tol * scale, err_msg=name
    )
  if correction != "none":
    assert 0 < float(expected["rollout/is_truncated_fraction"]) < 1


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("rollout_correction_cap", 0.0, "must be > 0, got 0.0"),
        ("rollout_correction_cap", -1.0, "must be > 0, got -1.0"),
        ("rollout_correction_cap", float("nan"), "finite number > 0, got nan"),
        ("rollout_correction_cap", float("inf"), "finite number > 0, got inf"),
        ("rollout_correction", "is", "one of ('none', 'tis', 'mis'), got 'is'"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(field, value, message):
  with pytest.raises(ValueError) as error:
    configs.LossConfig(**{field: value})
  text = str(error.value)
  assert text.startswith(f"loss.{field} must be ") and "\n" not in text
  assert text.endswith(message), text


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "loss.rollout_correction_cap=0",
            "loss.rollout_correction_cap must be",
        ),
        ("loss.rollout_correction_cap=.nan", "got nan"),
        ("loss.rollout_correction_cap=.inf", "got inf"),
        ("loss.rollout_correction_cap=-2", "must be > 0, got -2"),
        (
            "loss.rollout_correction=importance",
            "loss.rollout_correction must be one of ('none', 'tis', 'mis')",
        ),
    ],
)
def test_bad_input_exits_2_before_the_run(override, message, tmp_path, capsys):
  out = tmp_path / "out"
  args = ["train", "--preset=smoke", "--no-progress", f"--out={out}", override]
  assert cli_main(args) == 2
  err = capsys.readouterr().err
  assert err.startswith("logra train: error: ") and err.count("\n") == 1, err
  assert message in err
  assert not out.exists()


def test_a_batchs_updates_share_the_first_updates_proximal_logprobs(
    spread_batch,
):
  policy, batch = spread_batch
  config = dataclasses.replace(SMOKE, num_iterations=2)
  tx = non_finite.skip_non_finite(optax.sgd(1.0))
  step = learner.make_train_step(policy.graphdef, tx, config)

  def two_updates(batch, fill):
    params = jax.tree.map(jnp.copy, policy.params)
    state = tx.init(params)
    if fill is not None:
      batch = fill(params, state, batch)
    params, state, first = step(params, state, batch)
    _, _, second = step(params, state, batch)
    return batch, first, second

  fill = learner.make_proximal_logprobs(policy.graphdef, config)
  filled, first, second = two_updates(batch, fill)
  # The proximal policy stays the first update's: the weights exp(p - q)
  # are the same numbers on both updates, and the ratio to p moves.
  assert float(first["rollout/is_weight_mean"]) > 0
  assert first["rollout/is_weight_mean"] == second["rollout/is_weight_mean"]
  assert second["ratio_mean"] != 1
  # Without them each update would take its own log-probs: moving weights.
  _, moving_first, moving_second = two_updates(batch, None)
  assert moving_second["ratio_mean"] == 1
  assert (
      moving_first["rollout/is_weight_mean"]
      != moving_second["rollout/is_weight_mean"]
  )
  # The filled log-probs are the learner's under the first update's weights:
  # the same forward pass in another program, within 2 gamma_n of the
  # log-probs' scale (n the decoder's reductions and the vocabulary).
  logp = models.token_logprobs(
      policy.graphdef,
      policy.params,
      batch.prompt_tokens_BxP,
      batch.prompt_mask_BxP,
      batch.completion_tokens_BxT,
      batch.completion_mask_BxT,
      temperature=SMOKE.rollout.temperature,
  )
  model = models.load_pretrained(policy.folder).config
  length = batch.prompt_tokens_BxP.shape[1] + logp.shape[1]
  n = decoder_reduction_length(model, length) + model.vocab_size
  scale = max(float(np.abs(logp).max()), np.log(model.vocab_size))
  np.testing.assert_allclose(
      filled.proximal_logp_BxT,
      logp,
      atol=2 * float_tolerance(np.float32, n) * scale,
  )


@pytest.mark.parametrize(
    "overrides, fills",
    [
        ([], False),  # one update per batch: the step takes its own
        (["num_iterations=2"], True),
        (["num_iterations=2", "loss.rollout_correction=none"], False),
    ],
)
def test_the_learner_fills_the_proximal_logprobs_when_updates_share_them(
    spread_batch, overrides, fills
):
  policy, batch = spread_batch
  config = configs.apply_overrides(SMOKE, overrides)
  run = learner_state.build_learner(config, policy, None)
  run.init()
  prepared = run.prepare(batch)
  assert (prepared.proximal_logp_BxT is not None) == fills
