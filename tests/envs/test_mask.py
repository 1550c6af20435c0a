"""Environment tokens are context only: an episode's loss is the loss of the
model's turns alone, and its one row for the learner gives the same loss and
gradients as one row per model turn."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import envs
from logra_jax import models
from logra_jax.configs import LossConfig
from logra_jax.rl import algo
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

CONFIG = models.DecoderConfig.tiny(vocab_size=100, max_position_embeddings=64)
LOSS = dataclasses.replace(LossConfig(), beta=0.05)
# A two-turn episode: prompt, a tool call, the tool's result, the answer.
PROMPT, TURN_1, RESULT, TURN_2 = [1, 5, 6, 7], [40, 41, 42], [70, 71], [8, 2]
RNG = np.random.default_rng(0)
OLD_1, OLD_2 = (-RNG.uniform(0.1, 3.0, n).astype(np.float32) for n in (3, 2))
REF_1, REF_2 = (-RNG.uniform(0.1, 3.0, n).astype(np.float32) for n in (3, 2))
ADVANTAGE = jnp.array([0.7])


def episode():
  return envs.Episode(
      None,
      [],
      PROMPT,
      turns=[TURN_1, TURN_2],
      logprobs=[list(OLD_1), list(OLD_2)],
      contexts=[RESULT],
  )


def logprobs(params, prompt_BxP, mask_BxP, tokens_BxT, loss_BxT, attend_BxT):
  graphdef, _ = models.split_model(models.init_model(CONFIG, rngs=0))
  return models.token_logprobs(
      graphdef,
      params,
      prompt_BxP,
      mask_BxP,
      tokens_BxT,
      loss_BxT,
      context_mask_BxN=attend_BxT,
  )


def episode_row_loss(params, attend_environment=True):
  """The episode as the learner's one row: every token attended
  (``context_mask``), the loss masked to the model's tokens; the reference
  log-probs of the environment's tokens are NaN (never used)."""
  rows = envs.episode_rows([episode()], width=8)
  mask = jnp.asarray(rows.mask_ExT)
  attend = rows.context_mask_ExT if attend_environment else rows.mask_ExT
  logp_1xT = logprobs(
      params,
      jnp.asarray(rows.prompt_ids_ExP),
      jnp.asarray(rows.prompt_mask_ExP),
      jnp.asarray(rows.tokens_ExT),
      mask,
      jnp.asarray(attend),
  )
  ref = np.full((1, 8), np.nan, np.float32)
  ref[0, np.flatnonzero(rows.mask_ExT[0])] = np.concatenate([REF_1, REF_2])
  num, den, _ = algo.loss_terms(
      logp_1xT, mask, ADVANTAGE, jnp.asarray(rows.logprobs_ExT), ref, LOSS
  )
  return algo.finalize(num, den), (logp_1xT, mask)


def per_turn_loss(params):
  """The episode as one row per model turn: row ``j``'s prompt is the
  episode before turn ``j``, its completion turn ``j``."""
  history = PROMPT + TURN_1 + RESULT
  width = len(history)
  prompts = np.zeros((2, width), np.int32)
  prompts[0, width - len(PROMPT) :], prompts[1] = PROMPT, history
  tokens, mask = np.zeros((2, 3), np.int32), np.zeros((2, 3), np.int32)
  old, ref = np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)
  tokens[0], tokens[1, :2] = TURN_1, TURN_2
  mask[0], mask[1, :2] = 1, 1
  old[0], old[1, :2], ref[0], ref[1, :2] = OLD_1, OLD_2, REF_1, REF_2
  logp_RxT = logprobs(
      params,
      jnp.asarray(prompts),
      jnp.asarray(prompts > 0),
      jnp.asarray(tokens),
      jnp.asarray(mask),
      None,
  )
  num, den, _ = algo.loss_terms(
      logp_RxT,
      jnp.asarray(mask),
      jnp.repeat(ADVANTAGE, 2),
      jnp.asarray(old),
      jnp.asarray(ref),
      LOSS,
  )
  return algo.finalize(num, den), (logp_RxT, mask)


def test_the_masked_episode_loss_is_the_loss_of_the_model_turns_alone():
  _, params = models.split_model(models.init_model(CONFIG, rngs=0))
  loss, (logp_1xT, mask_1xT) = jax.jit(episode_row_loss)(params)
  model = np.asarray(mask_1xT[0]).astype(bool)
  alone, _, _ = algo.loss_terms(
      logp_1xT[:, model],
      jnp.ones((1, model.sum())),
      ADVANTAGE,
      jnp.array([np.concatenate([OLD_1, OLD_2])]),
      jnp.array([np.concatenate([REF_1, REF_2])]),
      LOSS,
  )
  assert np.isfinite(loss)
  # The same terms summed over 5 or 8 places (3 of them exact zeros).
  tol = 2 * float_tolerance(np.float32, model.size)
  np.testing.assert_allclose(loss, alone / model.sum(), rtol=tol)


def test_one_row_per_episode_trains_as_one_row_per_turn():
  """Loss and gradients of the episode's one row equal those of its rows
  per turn: the environment's tokens are attended to (context) but never
  scored, and the history is computed once."""
  _, params = models.split_model(models.init_model(CONFIG, rngs=0))
  (loss, (logp_1xT, mask_1xT)), grads = jax.jit(
      jax.value_and_grad(episode_row_loss, has_aux=True)
  )(params)
  (row_loss, (logp_RxT, mask_RxT)), row_grads = jax.jit(
      jax.value_and_grad(per_turn_loss, has_aux=True)
  )(params)
  model = np.asarray(mask_1xT[0]).astype(bool)
  rows = np.asarray(logp_RxT)[np.asarray(mask_RxT).astype(bool)]
  whole = np.asarray(logp_1xT[0])[model]
  # Same math, other padding and reduction order (tests/tolerances.py): the
  # forward chain, then the log-softmax over the vocabulary.
  length = len(PROMPT) + model.size
  forward = decoder_reduction_length(CONFIG, length) + CONFIG.vocab_size
  tol = 2 * float_tolerance(np.float32, forward)
  np.testing.assert_allclose(
      rows, whole, rtol=0, atol=tol * np.abs(whole).max()
  )
  np.testing.assert_allclose(row_loss, loss, rtol=0, atol=tol * abs(loss))
  tol = 2 * float_tolerance(np.float32, 2 * forward + length)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(row_grads)):
    np.testing.assert_allclose(b, a, rtol=0, atol=tol * np.abs(a).max())
  # Were the result not attended to, the second turn would score otherwise.
  _, (hidden, _) = jax.jit(episode_row_loss, static_argnums=1)(params, False)
  assert np.abs(np.asarray(hidden[0])[model] - whole).max() > 100 * tol
