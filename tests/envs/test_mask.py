"""Environment tokens are context only: an episode's loss is the loss of the
model's turns alone, and its rows for the learner give the same loss and
gradients as the whole sequence with the environment masked out."""

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


def logprobs(params, prompt_BxP, mask_BxP, tokens_BxT, attend_BxT):
  graphdef, _ = models.split_model(models.init_model(CONFIG, rngs=0))
  return models.token_logprobs(
      graphdef, params, prompt_BxP, mask_BxP, tokens_BxT, attend_BxT
  )


def whole_sequence_loss(params):
  """The episode as one sequence, every token attended, the loss masked to
  the model's tokens; old and reference log-probs of the environment's
  tokens are NaN (never used)."""
  sequence, loss_mask = envs.episode_sequence(episode())
  sequence_1xT = jnp.array([sequence])
  logp_1xT = logprobs(
      params,
      jnp.array([PROMPT]),
      jnp.ones((1, len(PROMPT))),
      sequence_1xT,
      jnp.ones_like(sequence_1xT),
  )
  nan = np.full(len(RESULT), np.nan, np.float32)
  old = jnp.array([np.concatenate([OLD_1, nan, OLD_2])])
  ref = jnp.array([np.concatenate([REF_1, nan, REF_2])])
  mask = jnp.array([loss_mask])
  num, den, _ = algo.loss_terms(logp_1xT, mask, ADVANTAGE, old, ref, LOSS)
  return algo.finalize(num, den), (logp_1xT, mask)


def turn_rows_loss(params):
  """The episode as the learner's rows, one per model turn."""
  rows = envs.turn_rows([episode()], 2, width=4)
  logp_RxT = logprobs(
      params,
      jnp.asarray(rows.prompt_ids_RxP),
      jnp.asarray(rows.prompt_mask_RxP),
      jnp.asarray(rows.tokens_RxT),
      jnp.asarray(rows.mask_RxT),
  )
  ref = np.zeros((2, 4), np.float32)
  ref[0, :3], ref[1, :2] = REF_1, REF_2
  num, den, _ = algo.loss_terms(
      logp_RxT,
      jnp.asarray(rows.mask_RxT),
      jnp.repeat(ADVANTAGE, 2),
      jnp.asarray(rows.logprobs_RxT),
      jnp.asarray(ref),
      LOSS,
  )
  return algo.finalize(num, den), (logp_RxT, rows.mask_RxT)


def test_the_masked_episode_loss_is_the_loss_of_the_model_turns_alone():
  _, params = models.split_model(models.init_model(CONFIG, rngs=0))
  loss, (logp_1xT, mask_1xT) = jax.jit(whole_sequence_loss)(params)
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
  # The same terms summed over 5 or 7 places (2 of them exact zeros).
  tol = 2 * float_tolerance(np.float32, model.size)
  np.testing.assert_allclose(loss, alone / model.sum(), rtol=tol)


def test_turn_rows_train_as_the_masked_episode():
  """Loss and gradients of the rows equal the whole sequence's: the
  environment's tokens are attended to (context) but never scored."""
  _, params = models.split_model(models.init_model(CONFIG, rngs=0))
  (loss, (logp_1xT, mask_1xT)), grads = jax.jit(
      jax.value_and_grad(whole_sequence_loss, has_aux=True)
  )(params)
  (row_loss, (logp_RxT, mask_RxT)), row_grads = jax.jit(
      jax.value_and_grad(turn_rows_loss, has_aux=True)
  )(params)
  model = np.asarray(mask_1xT[0]).astype(bool)
  rows = np.asarray(logp_RxT)[np.asarray(mask_RxT).astype(bool)]
  whole = np.asarray(logp_1xT[0])[model]
  # Same math, other padding and reduction order (tests/tolerances.py): the
  # forward chain, then the log-softmax over the vocabulary.
  length = len(PROMPT) + model.size + len(RESULT)
  forward = decoder_reduction_length(CONFIG, length) + CONFIG.vocab_size
  tol = 2 * float_tolerance(np.float32, forward)
  np.testing.assert_allclose(
      rows, whole, rtol=0, atol=tol * np.abs(whole).max()
  )
  np.testing.assert_allclose(row_loss, loss, rtol=0, atol=tol * abs(loss))
  tol = 2 * float_tolerance(np.float32, 2 * forward + length)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(row_grads)):
    np.testing.assert_allclose(b, a, rtol=0, atol=tol * np.abs(a).max())
  # Were the result hidden, the second turn would be scored differently.
  hidden = logprobs(
      params,
      jnp.array([PROMPT]),
      jnp.ones((1, len(PROMPT))),
      jnp.array([envs.episode_sequence(episode())[0]]),
      mask_1xT,
  )
  assert np.abs(np.asarray(hidden[0])[model] - whole).max() > 100 * tol
