"""Predicted-KL step control against brute-force Fisher forms, exact KLs and
closed-form scales."""

import warnings

from flax import nnx
import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logra_jax as logra
from logra_jax import models
from logra_jax import policy_state
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

VOCAB, B, T = 13, 3, 5


@pytest.fixture(scope="module")
def tiny_model():
  config = models.DecoderConfig.tiny(
      vocab_size=VOCAB,
      hidden_size=16,
      intermediate_size=24,
      num_layers=1,
      num_heads=2,
      num_kv_heads=1,
      head_dim=8,
  )
  graphdef, params = models.split_model(models.init_model(config, rngs=0))
  # Larger weights than the init, so that the policy is far from uniform.
  params = jax.tree.map(lambda p: 3.0 * p, params)
  ids_BxT = jax.random.randint(jax.random.key(1), (B, T), 0, VOCAB)
  mask_BxT = jnp.array(
      [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], jnp.float32
  )
  return graphdef, params, ids_BxT, mask_BxT


def _logits_fn(graphdef):
  return lambda params, ids: models.logits_fn(graphdef, params, ids)


def _features_fn(graphdef):
  def features(params, ids):
    decoder = nnx.merge(graphdef, params)
    hidden, _ = decoder.hidden_states(ids)
    return hidden, decoder.unembedding()

  return features


def _prediction_rtol(graphdef, params, tokens: int) -> float:
  """Two evaluations of a prediction in different orders (the bound of
  tests/tolerances.py): forward chain and its jvp, three sums over the
  vocabulary, the mean over the tokens; all terms of the mean are >= 0."""
  config = nnx.merge(graphdef, params).config
  n = 2 * decoder_reduction_length(config, T) + 3 * VOCAB + tokens
  return 2 * float_tolerance(np.float32, n)


def _direction(params, seed):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten(
      [jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)]
  )


def _brute_force_fisher_form(graphdef, params, ids_BxT, mask_BxT, update):
  """0.5 * mean_t D^T J_t^T (diag p_t - p_t p_t^T) J_t D from explicit
  Jacobians of the logits with respect to the flattened parameters."""
  flat, unravel = ravel_pytree(params)
  logits_of = lambda f: models.logits_fn(graphdef, unravel(f), ids_BxT)
  jac = jax.jacfwd(logits_of)(flat).reshape(B * T, VOCAB, flat.size)
  p = jax.nn.softmax(logits_of(flat).reshape(B * T, VOCAB), axis=-1)
  fisher = jnp.einsum("tv,tvi,tvj->tij", p, jac, jac) - jnp.einsum(
      "tv,tvi,tw,twj->tij", p, jac, p, jac
  )
  d = ravel_pytree(update)[0]
  per_token = 0.5 * jnp.einsum("i,tij,j->t", d, fisher, d).reshape(B, T)
  return float(jnp.sum(per_token * mask_BxT) / jnp.sum(mask_BxT))


def _exact_kl(graphdef, params, ids_BxT, mask_BxT, update, s):
  moved = jax.tree.map(lambda p, u: p + s * u, params, update)
  logp = jax.nn.log_softmax(models.logits_fn(graphdef, params, ids_BxT))
  logq = jax.nn.log_softmax(models.logits_fn(graphdef, moved, ids_BxT))
  kl_BxT = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
  return float(jnp.sum(kl_BxT * mask_BxT) / jnp.sum(mask_BxT))


@pytest.mark.parametrize(
    "form,chunk_size", [("logits", 128), ("pair", 2), ("pair", 128)]
)
def test_jvp_prediction_equals_brute_force_fisher_form(
    tiny_model, form, chunk_size
):
  graphdef, params, ids_BxT, mask_BxT = tiny_model
  update = _direction(params, seed=3)
  fn = _logits_fn(graphdef) if form == "logits" else _features_fn(graphdef)
  predictor = logra.make_kl_predictor(
      fn, params, ids_BxT, token_mask=mask_BxT, chunk_size=chunk_size
  )
  expected = _brute_force_fisher_form(
      graphdef, params, ids_BxT, mask_BxT, update
  )
  assert expected > 0
  np.testing.assert_allclose(float(predictor(update)), expected, rtol=1e-4)


def test_prediction_matches_exact_kl_for_small_steps(tiny_model):
  graphdef, params, ids_BxT, mask_BxT = tiny_model

  # A real update direction: the gradient of the batch's log-likelihood.
  def nll(p):
    logp = jax.nn.log_softmax(models.logits_fn(graphdef, p, ids_BxT))
    return -jnp.mean(jnp.take_along_axis(logp, ids_BxT[..., None], -1))

  update = jax.grad(nll)(params)
  predictor = logra.make_kl_predictor(
      _logits_fn(graphdef), params, ids_BxT, token_mask=mask_BxT
  )
  kappa = float(predictor(update))
  ratios = {}
  for target in (1e-5, 1e-4, 1e-3, 1e-2, 1e-1):
    s = (target / kappa) ** 0.5  # predicted KL of s * D is `target`
    ratios[target] = target / _exact_kl(
        graphdef, params, ids_BxT, mask_BxT, update, s
    )
  print("predicted / exact KL by predicted size:", ratios)
  for target in (1e-5, 1e-4, 1e-3):
    assert abs(ratios[target] - 1.0) < 0.1, ratios


def test_factored_update_gives_the_same_prediction(tiny_model):
  graphdef, params, ids_BxT, _ = tiny_model
  dims = policy_state.matrix_dimension_numbers(params)
  tx = logra.scale_by_low_rank(
      optax.scale_by_adam(), rank=2, dimension_numbers=dims, keep_factors=True
  )
  state = tx.init(params)
  dense, state = tx.update(_direction(params, seed=4), state, params)
  factored = logra.factored_updates(state)
  mixed = jax.tree.map(
      lambda f, u: u if f is None else f,
      factored,
      dense,
      is_leaf=lambda x: x is None or isinstance(x, logra.FactoredUpdate),
  )
  assert any(
      isinstance(x, logra.FactoredUpdate)
      for x in jax.tree.leaves(
          mixed, is_leaf=lambda x: isinstance(x, logra.FactoredUpdate)
      )
  )
  predictor = logra.make_kl_predictor(_logits_fn(graphdef), params, ids_BxT)
  np.testing.assert_allclose(
      float(predictor(mixed)),
      float(predictor(dense)),
      rtol=_prediction_rtol(graphdef, params, B * T),
  )


def test_subsample_uses_evenly_strided_rows(tiny_model):
  graphdef, params, _, _ = tiny_model
  ids_BxT = jax.random.randint(jax.random.key(5), (6, T), 0, VOCAB)
  update = _direction(params, seed=6)
  sub = logra.make_kl_predictor(
      _logits_fn(graphdef), params, ids_BxT, subsample=3
  )
  strided = logra.make_kl_predictor(_logits_fn(graphdef), params, ids_BxT[::2])
  np.testing.assert_allclose(
      float(sub(update)),
      float(strided(update)),
      rtol=_prediction_rtol(graphdef, params, 3 * T),
  )


def test_predictor_inside_jit_and_no_recompile(tiny_model):
  graphdef, params, ids_BxT, mask_BxT = tiny_model
  tx = logra.scale_by_predicted_kl(target_kl=1e-4)
  traces = []

  @jax.jit
  def step(params, state, update, ids):
    traces.append(1)
    predictor = logra.make_kl_predictor(
        _logits_fn(graphdef), params, ids, token_mask=mask_BxT
    )
    scaled, state = tx.update(update, state, params, kl_predictor=predictor)
    return scaled, state, predictor(scaled)

  state = tx.init(params)
  for seed in (7, 8):
    _, state, predicted = step(params, state, _direction(params, seed), ids_BxT)
    np.testing.assert_allclose(float(predicted), 1e-4, rtol=1e-3)
  assert len(traces) == 1
  assert int(state.count) == 2 and int(state.scaled_steps) == 2


class QuadraticPredictor:
  """kappa(D) = a * |D|^2 per token on two tokens with weights (1, 3)."""

  token_mask = jnp.ones(2)

  def __init__(self, a=1.0):
    self.a = a

  def token_kl(self, update):
    sq = sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(update))
    return self.a * sq * jnp.array([0.5, 1.5])

  def __call__(self, update):
    return jnp.mean(self.token_kl(update))


@pytest.mark.parametrize(
    "mode,min_scale,max_scale,norm2,expected",
    [
        ("clamp", 0.0, None, 4.0, (1e-2 / 4.0) ** 0.5),  # shrink
        ("clamp", 0.0, None, 1e-4, 1.0),  # small step untouched
        ("clamp", 0.2, None, 4.0, 0.2),  # floor
        ("target", 0.0, None, 1e-4, 10.0),  # grow, capped at 10
        ("target", 0.0, 100.0, 1e-4, 10.0),  # grow to the target
        ("target", 0.5, 2.0, 4.0, 0.5),
    ],
)
def test_scale_matches_closed_form(mode, min_scale, max_scale, norm2, expected):
  tx = logra.scale_by_predicted_kl(
      1e-2, mode=mode, min_scale=min_scale, max_scale=max_scale
  )
  update = {"w": jnp.full((4,), norm2**0.5 / 2)}  # |D|^2 = norm2
  state = tx.init(update)
  out, state = tx.update(update, state, kl_predictor=QuadraticPredictor())
  np.testing.assert_allclose(float(state.scale), expected, rtol=1e-5)
  np.testing.assert_allclose(out["w"], expected * update["w"], rtol=1e-5)
  np.testing.assert_allclose(float(state.predicted_kl), norm2, rtol=1e-5)
  assert int(state.scaled_steps) == int(abs(expected - 1.0) > 1e-6)


def test_token_quantile_cap_bounds_the_largest_token():
  predictor = QuadraticPredictor()
  tx = logra.scale_by_predicted_kl(1.0, token_quantile_cap=1e-2, quantile=1.0)
  update = {"w": jnp.ones(4) / 2}  # |D|^2 = 1: tokens 0.5 and 1.5, mean 1
  out, state = tx.update(update, tx.init(update), kl_predictor=predictor)
  np.testing.assert_allclose(float(state.scale), (1e-2 / 1.5) ** 0.5, rtol=1e-5)
  assert float(jnp.max(predictor.token_kl(out))) == pytest.approx(
      1e-2, rel=1e-5
  )


@pytest.mark.parametrize("bad", [jnp.nan, -1.0, jnp.inf])
def test_invalid_prediction_skips_the_step(bad):
  tx = logra.scale_by_predicted_kl(1e-3)
  update = {"w": jnp.ones(3)}
  state = tx.init(update)
  out, state = jax.jit(
      lambda u, s: tx.update(u, s, kl_predictor=lambda _: jnp.asarray(bad))
  )(update, state)
  np.testing.assert_array_equal(out["w"], 0.0)
  assert int(state.skipped_steps) == 1 and float(state.scale) == 0.0
  out, state = tx.update(update, state, kl_predictor=lambda _: 1e-4)
  np.testing.assert_array_equal(out["w"], 1.0)  # later steps apply again
  assert int(state.skipped_steps) == 1 and int(state.count) == 2


def test_batch_without_tokens_is_an_error_or_a_skip(tiny_model):
  graphdef, params, ids_BxT, _ = tiny_model
  empty = jnp.zeros((B, T))
  with pytest.raises(ValueError, match="selects no token"):
    logra.make_kl_predictor(
        _logits_fn(graphdef), params, ids_BxT, token_mask=empty
    )
  tx = logra.scale_by_predicted_kl(1e-3)

  @jax.jit
  def step(update, state, mask):  # traced mask: the error cannot be raised
    predictor = logra.make_kl_predictor(
        _logits_fn(graphdef), params, ids_BxT, token_mask=mask
    )
    return tx.update(update, state, kl_predictor=predictor)

  update = _direction(params, seed=9)
  out, state = step(update, tx.init(params), empty)
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(out))
  assert int(state.skipped_steps) == 1


def test_without_predictor_is_identity_and_warns_once():
  tx = logra.scale_by_predicted_kl(1e-3)
  update = {"w": jnp.ones(3)}
  state = tx.init(update)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out, state = tx.update(update, state)
    out, state = tx.update(update, state)
  assert len([w for w in caught if "no kl_predictor" in str(w.message)]) == 1
  np.testing.assert_array_equal(out["w"], 1.0)
  assert int(state.scaled_steps) == 0 and int(state.count) == 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(target_kl=0.0), "target_kl must be"),
        (dict(target_kl=-1e-3), "target_kl must be"),
        (dict(target_kl=1e-3, mode="exact"), "mode must be one of"),
        (
            dict(target_kl=1e-3, mode="target", min_scale=2.0, max_scale=1.0),
            r"min_scale \(2.0\) must be <= max_scale",
        ),
        (dict(target_kl=1e-3, max_scale=2.0), "only shrinks steps"),
        (dict(target_kl=1e-3, min_scale=-0.1), "min_scale must be >= 0"),
        (dict(target_kl=1e-3, token_quantile_cap=0.0), "token_quantile_cap"),
        (dict(target_kl=1e-3, quantile=1.5), "quantile must be"),
    ],
)
def test_bad_hyperparameters_are_rejected(kwargs, match):
  with pytest.raises(ValueError, match=match):
    logra.scale_by_predicted_kl(**kwargs)


def test_bad_predictor_arguments_are_rejected(tiny_model):
  graphdef, params, ids_BxT, _ = tiny_model
  with pytest.raises(ValueError, match="subsample must be in"):
    logra.make_kl_predictor(
        _logits_fn(graphdef), params, ids_BxT, subsample=B + 1
    )
  with pytest.raises(ValueError, match="token_mask has shape"):
    logra.make_kl_predictor(
        _logits_fn(graphdef), params, ids_BxT, token_mask=jnp.ones((B, T + 1))
    )
  predictor = logra.make_kl_predictor(_logits_fn(graphdef), params, ids_BxT)
  with pytest.raises(ValueError, match="does not match the structure"):
    predictor({"w": jnp.ones(3)})


def test_logra_alias_with_target_kl_meets_the_target(tiny_model):
  graphdef, params, ids_BxT, mask_BxT = tiny_model
  tx = logra.logra(
      learning_rate=1.0,
      rank=2,
      target_kl=1e-4,
      dimension_numbers=policy_state.matrix_dimension_numbers(params),
  )
  state = tx.init(params)
  predictor = logra.make_kl_predictor(
      _logits_fn(graphdef), params, ids_BxT, token_mask=mask_BxT
  )
  updates, state = tx.update(
      _direction(params, seed=10), state, params, kl_predictor=predictor
  )
  np.testing.assert_allclose(float(predictor(updates)), 1e-4, rtol=1e-3)
  kl_state = logra.predicted_kl_state(state)
  assert float(kl_state.scale) < 1 and int(kl_state.scaled_steps) == 1
  # The same chain without the keyword is the plain LoGRA step.
  assert logra.predicted_kl_state(logra.logra(1.0, rank=2).init(params)) is None
