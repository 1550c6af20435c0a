"""Tests for logra_jax.rl.losses: each policy loss's value and gradient
against the paper's equation written out by hand in float64, the identities
between the losses, their metrics, and DAPO's overlong shaping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import configs
from logra_jax.rl import algo
from logra_jax.rl import losses

EPS_LOW, EPS_HIGH = 0.2, 0.3
# Three sequences, old log-probs 0 so the token ratio is exp(logp):
#   seq 0 (A=+1):   ratios 2, 1.5, 1     s = 3^(1/3) = 1.442 > 1.3: clipped high
#   seq 1 (A=-2):   ratios 0.5, 1.2, -   s = 0.6^(1/2) = 0.775 < 0.8: clipped low
#   seq 2 (A=+0.5): ratios 1.1, 0.9, -   s = 0.99^(1/2) = 0.995: inside
RATIOS = np.array([[2.0, 1.5, 1.0], [0.5, 1.2, 1.0], [1.1, 0.9, 1.0]])
MASK = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
ADV = np.array([1.0, -2.0, 0.5])
LENGTHS = MASK.sum(axis=1)
SEQ_RATIOS = np.array([3 ** (1 / 3), 0.6**0.5, 0.99**0.5])


def _clip(x):
  return np.clip(x, 1 - EPS_LOW, 1 + EPS_HIGH)


def _value_and_grad(loss_fn, objective, **kwargs):
  """The per-token loss and the gradient of ``objective(loss_BxT)`` with
  respect to the log-probabilities, in float64."""
  with jax.enable_x64(True):
    logp = jnp.log(jnp.asarray(RATIOS, jnp.float64)) * MASK
    old, mask = jnp.zeros_like(logp), jnp.asarray(MASK)
    adv = jnp.asarray(ADV)
    run = lambda lp: loss_fn(lp, old, mask, adv, EPS_LOW, EPS_HIGH, **kwargs)
    loss_BxT, metrics = run(logp)
    grad = jax.grad(lambda lp: objective(run(lp)[0]))(logp)
    assert loss_BxT.dtype == jnp.float64
    return (
        np.asarray(loss_BxT),
        np.asarray(grad),
        algo.finalize_metrics(metrics),
    )


def _seq_mean(loss_BxT):
  """GSPO's objective: the mean over sequences of each one's token mean."""
  return ((loss_BxT * MASK).sum(axis=1) / LENGTHS).mean()


def _token_mean(loss_BxT):
  return (loss_BxT * MASK).sum() / MASK.sum()


def test_the_sequence_ratio_is_the_geometric_mean_of_the_token_ratios():
  with jax.enable_x64(True):
    log_s = losses.sequence_log_ratio(
        jnp.log(jnp.asarray(RATIOS)) * MASK, jnp.zeros((3, 3)), MASK
    )
  np.testing.assert_allclose(np.exp(log_s), SEQ_RATIOS, rtol=1e-14)


@pytest.mark.parametrize("loss_fn", [losses.gspo_loss, losses.gspo_token_loss])
def test_gspo_value_and_gradient_by_hand(loss_fn):
  # J = -(1/G) sum_i min(s_i A_i, clip(s_i) A_i) (arXiv 2507.18071, eq. 5);
  # on every token of sequence i the loss is that sequence's term.
  s, a = SEQ_RATIOS, ADV
  per_seq = -np.minimum(s * a, _clip(s) * a)
  np.testing.assert_allclose(per_seq, [-1.3, 1.6, -0.5 * s[2]], rtol=1e-14)
  loss, grad, _ = _value_and_grad(loss_fn, _seq_mean)
  np.testing.assert_allclose(loss * MASK, per_seq[:, None] * MASK, rtol=1e-14)
  # grad_theta s_i = s_i / |y_i| sum_t grad log pi(y_t) (eq. 8): sequences 0
  # and 1 are clipped, so only sequence 2 moves, each token by -A s / (3 |y|).
  expected = np.zeros((3, 3))
  expected[2, :2] = -a[2] * s[2] / (3 * LENGTHS[2])
  np.testing.assert_allclose(grad, expected, rtol=1e-13, atol=1e-16)


def test_gspo_metrics_by_hand():
  _, _, got = _value_and_grad(losses.gspo_loss, _seq_mean)
  expected = {
      "seq_clip_high_fraction": 1 / 3,  # sequence 0
      "seq_clip_low_fraction": 1 / 3,  # sequence 1
      "seq_clip_fraction": 2 / 3,
      "clip_high_fraction": 3 / 7,  # sequence 0's 3 of 7 tokens
      "clip_low_fraction": 2 / 7,
      "clip_fraction": 5 / 7,
      "ratio_mean": (2 + 1.5 + 1 + 0.5 + 1.2 + 1.1 + 0.9) / 7,
      "ratio_min": 0.5,
      "ratio_max": 2.0,
      "seq_ratio_mean": SEQ_RATIOS.mean(),
      "seq_ratio_min": SEQ_RATIOS[1],
      "seq_ratio_max": SEQ_RATIOS[0],
  }
  assert set(got) == set(expected)
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_value_and_gradient_by_hand(level):
  # J = (1 / sum_i |o_i|) sum_i sum_t sg(clip(r_it)) A_i log pi(o_it)
  # (arXiv 2506.13585, eq. 4); the loss is -J, its gradient -clip(r) A.
  r = (
      RATIOS
      if level == "token"
      else np.broadcast_to(SEQ_RATIOS[:, None], (3, 3))
  )
  weight = _clip(r)
  logp = np.log(RATIOS) * MASK
  loss, grad, _ = _value_and_grad(
      losses.cispo_loss, _token_mean, importance_level=level
  )
  np.testing.assert_allclose(
      loss * MASK, -weight * ADV[:, None] * logp * MASK, rtol=1e-14, atol=1e-16
  )
  np.testing.assert_allclose(
      grad, -weight * ADV[:, None] * MASK / MASK.sum(), rtol=1e-14
  )


def test_cispo_keeps_the_gradient_that_clip_drops():
  _, clip_grad, _ = _value_and_grad(losses.clip_loss, _token_mean)
  _, cispo_grad, got = _value_and_grad(losses.cispo_loss, _token_mean)
  # clip zeroes the tokens whose ratio left the range on the advantage's side
  # (2 and 1.5 at A > 0, 0.5 at A < 0); CISPO moves every valid token.
  dropped = (clip_grad == 0) & (MASK > 0)
  np.testing.assert_array_equal(
      dropped, [[True, True, False], [True, False, False], [False] * 3]
  )
  assert np.all(cispo_grad[MASK > 0] != 0)
  # Its weight was cut on those tokens, whatever the advantage's sign.
  np.testing.assert_allclose(got["clip_high_fraction"], 2 / 7, rtol=1e-6)
  np.testing.assert_allclose(got["clip_low_fraction"], 1 / 7, rtol=1e-6)


def _loss_terms_value_and_grad(config, logp, mask, adv, old):
  """The loss with ``old`` as the ratio's old policy: the sampler's and, under
  a rollout correction, the proximal one too (weight exactly 1)."""
  terms = lambda lp: algo.loss_terms(lp, mask, adv, old, None, config, old)
  value, grad = jax.value_and_grad(lambda lp: algo.finalize(*terms(lp)[:2]))(
      logp
  )
  return value, grad, terms(logp)[2]


def _random(b=8, t=5, seed=0):
  rng = np.random.default_rng(seed)
  lengths = np.array([5, 3, 0, 1, 4, 5, 2, 3])[:b]
  mask = jnp.asarray((np.arange(t)[None, :] < lengths[:, None]).astype(int))
  old = jnp.asarray(rng.normal(-1.0, 0.3, (b, t)), jnp.float32)
  logp = old + jnp.asarray(rng.normal(0.0, 0.3, (b, t)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=b), jnp.float32)
  return logp, mask, adv, old


@pytest.mark.parametrize("aggregation", configs.AGGREGATIONS)
def test_gspo_with_one_token_per_sequence_is_token_level_clipping(aggregation):
  logp, _, adv, old = _random()
  mask = jnp.zeros_like(logp, jnp.int32).at[:, 2].set(1)  # one token each
  results = [
      _loss_terms_value_and_grad(
          configs.LossConfig(
              policy_loss=name,
              eps_low=0.1,
              eps_high=0.15,
              aggregation=aggregation,
              max_len=5,
          ),
          logp,
          mask,
          adv,
          old,
      )
      for name in ("clip", "gspo")
  ]
  (clip_value, clip_grad, clip_m), (gspo_value, gspo_grad, gspo_m) = results
  # The same numbers: the mean of one log ratio is that log ratio.
  np.testing.assert_array_equal(gspo_value, clip_value)
  np.testing.assert_array_equal(gspo_grad, clip_grad)
  for name in ("clip_fraction", "clip_low_fraction", "clip_high_fraction"):
    np.testing.assert_array_equal(gspo_m[name], clip_m[name])
  assert float(clip_m["clip_fraction"][0]) > 0  # the clip acts somewhere


@pytest.mark.parametrize("aggregation", configs.AGGREGATIONS)
def test_gspo_token_equals_gspo_with_one_advantage_per_sequence(aggregation):
  # The paper's section 4.3: with A_it = A_i the two have the same value,
  # clipping and gradient, for any aggregation here.
  logp, mask, adv, old = _random()
  gspo, token = [
      _loss_terms_value_and_grad(
          configs.LossConfig(
              policy_loss=name,
              eps_low=0.02,
              eps_high=0.03,
              aggregation=aggregation,
              max_len=5,
          ),
          logp,
          mask,
          adv,
          old,
      )
      for name in ("gspo", "gspo_token")
  ]
  # float32, sums of at most 5 tokens of terms of order 1.
  np.testing.assert_allclose(token[0], gspo[0], rtol=1e-6)
  np.testing.assert_allclose(token[1], gspo[1], rtol=1e-5, atol=1e-7)
  assert float(jnp.abs(gspo[1]).sum()) > 0
  for name, pair in gspo[2].items():
    np.testing.assert_allclose(token[2][name], pair, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "policy_loss, level",
    [
        ("gspo", None),
        ("gspo_token", None),
        ("cispo", "token"),
        ("cispo", "sequence"),
    ],
)
def test_micro_batches_reduce_to_the_full_batch(policy_loss, level):
  logp, mask, adv, old = _random()
  config = configs.LossConfig(
      policy_loss=policy_loss,
      importance_level=level,
      eps_low=0.1,
      eps_high=0.15,
  )
  terms = lambda lp, m, a, o: algo.loss_terms(lp, m, a, o, None, config, o)
  full_value, full_grad, full_metrics = _loss_terms_value_and_grad(
      config, logp, mask, adv, old
  )
  split = lambda x: x.reshape((4, -1) + x.shape[1:])

  def micro(lp, m, a, o):
    (num, (den, metrics)), grad = jax.value_and_grad(
        lambda x: (lambda n, d, mt: (n, (d, mt)))(*terms(x, m, a, o)),
        has_aux=True,
    )(lp)
    return num, den, metrics, grad

  nums, dens, metrics_M, grads = jax.lax.map(
      lambda xs: micro(*xs), tuple(map(split, (logp, mask, adv, old)))
  )
  np.testing.assert_allclose(
      algo.finalize(nums.sum(), dens.sum()), full_value, rtol=1e-6
  )
  np.testing.assert_allclose(
      grads.reshape(logp.shape) / dens.sum(), full_grad, rtol=1e-5, atol=1e-8
  )
  got = algo.finalize_metrics(losses.reduce_metrics(metrics_M))
  expected = algo.finalize_metrics(full_metrics)
  assert set(got) == set(expected) and "ratio_min" in got
  for name, value in expected.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)


def test_the_default_clip_loss_keeps_its_metrics():
  logp, mask, adv, old = _random()
  _, _, metrics = _loss_terms_value_and_grad(
      configs.LossConfig(), logp, mask, adv, old
  )
  assert set(metrics) == {
      "clip_fraction",
      "clip_low_fraction",
      "clip_high_fraction",
      "ratio_mean",
      "pg_loss",
      "rollout/logprob_gap_mean",
      "rollout/logprob_gap_max",
      "rollout/is_weight_mean",  # the default's rollout correction, "tis"
      "rollout/is_truncated_fraction",
  }


def test_the_configs_loss_names_are_the_implemented_losses():
  assert tuple(losses.POLICY_LOSSES) == configs.POLICY_LOSSES


@pytest.mark.parametrize(
    "length, expected",
    [
        (1, 0.0),
        (4, 0.0),  # max - buffer: the buffer's inner edge, no penalty yet
        (5, -0.25 * 0.5),
        (7, -0.75 * 0.5),
        (8, -1.0 * 0.5),  # the budget: the whole penalty
    ],
)
def test_overlong_penalty_at_the_buffers_edges(length, expected):
  # DAPO (arXiv 2503.14476) eq. 13 with L_max = 8, L_cache = 4, factor 0.5.
  got = losses.overlong_penalty(np.array([length]), 8, 4, 0.5)
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, [expected], rtol=1e-7)


def test_overlong_penalty_errors_and_zero_buffer():
  np.testing.assert_array_equal(
      losses.overlong_penalty(np.array([3, 8]), 8, 0, 1.0), [0.0, 0.0]
  )
  for buffer in (8, 9, -1):
    with pytest.raises(ValueError, match=f"buffer={buffer} must be in"):
      losses.overlong_penalty(np.array([3]), 8, buffer, 1.0)


def test_truncated_means_the_budget_ran_out_before_a_stop_token():
  tokens = np.array([[5, 2, 0, 0], [5, 5, 5, 5], [5, 5, 5, 2], [5, 7, 0, 0]])
  lengths = np.array([2, 4, 4, 2])
  np.testing.assert_array_equal(
      losses.truncated(tokens, lengths, 4, (2, 7)), [False, True, False, False]
  )
  # Without stop ids every completion of the budget's length is cut.
  np.testing.assert_array_equal(
      losses.truncated(tokens, lengths, 4, ()), [False, True, True, False]
  )
