"""The colocated engine samples with the learner's own arrays: no copy of
the policy, no message."""

import jax
import numpy as np

from logra_jax import configs
from logra_jax import models
from logra_jax import policy_state
from logra_jax.optim import factored as factored_lib
from logra_jax.rl import setup
from logra_jax.rollout import engine as engine_lib

SMOKE = configs.get_preset("smoke")


def _learner_state(config, policy):
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  return policy_state.init_train_state(config.optimizer, tx, policy.params)


def test_the_shared_engine_samples_with_the_learners_arrays(policy_folder):
  config = configs.apply_overrides(SMOKE, [f"policy.path={policy_folder}"])
  policy = engine_lib.Policy.load(policy_folder)
  weights, opt_state = _learner_state(config, policy)
  assert policy_state.has_factored(weights)
  engine = engine_lib.SharedEngine(policy)
  stats = engine.follow((weights, opt_state))
  assert stats.message_bytes == 0
  # Zero copy: the arrays the sampler is given are the learner's, but for
  # the window's coordinates and scales laid out for the model (a wide
  # matrix's transposed): none the size of a weight.
  learner_arrays = {id(x) for x in jax.tree.leaves((weights, opt_state))}
  view = policy_state.model_view(weights, opt_state)
  factored = [
      w
      for w in jax.tree.leaves(weights, is_leaf=factored_lib.is_factored)
      if factored_lib.is_factored(w)
  ]
  small = sum(
      x.nbytes for w in factored for x in (w.coords, w.scale) if x is not None
  )
  laid_out = [x for x in jax.tree.leaves(view) if id(x) not in learner_arrays]
  assert sum(x.nbytes for x in laid_out) <= small
  assert {id(w.base) for w in factored} <= {
      id(x) for x in jax.tree.leaves(view)
  }
  task = setup.load_task(config)
  prompts = policy.encode([e["prompt"] for e in task.examples[:8]])
  out = engine.sample(prompts, jax.random.key(0), max_new_tokens=4)
  # The sampler's log-probs are the learner's forward on the same view up
  # to float32 rounding of its reductions (decoding one token at a time
  # sums in another order than the whole sequence at once): a few ulps of
  # log-probs of order 1, over a hidden size of 64.
  logp = models.token_logprobs(
      policy.graphdef,
      view,
      out.prompt_ids,
      out.prompt_mask,
      out.tokens,
      out.mask,
  )
  mask = np.asarray(out.mask, bool)
  gap = np.abs(np.asarray(logp) - np.asarray(out.logprobs))[mask]
  eps = np.finfo(np.float32).eps
  assert gap.max() <= 64 * eps * max(1.0, np.abs(np.asarray(logp)).max())


def test_a_factored_head_is_never_formed():
  """With the embeddings projected, the head is `c B + P A`: the sampling
  and log-prob programs apply it as `c (h B) + (h P) A`, so their
  temporaries stay below the `[D, V]` table they would otherwise form (XLA's
  memory analysis; the vocabulary is large enough for the table to dwarf the
  logits of a few tokens)."""
  model = models.init_model(models.DecoderConfig.tiny(vocab_size=32768), 0)
  graphdef, params = models.split_model(model)
  config = configs.OptimizerConfig(
      name="logra", project_embeddings=True, rank=8
  )
  tx = policy_state.make_optimizer(config, params)
  weights, opt_state = policy_state.init_train_state(config, tx, params)
  view = policy_state.model_view(weights, opt_state)
  head_bytes = model.config.hidden_size * model.config.vocab_size * 4
  ids, mask = models.pad_prompts([[1, 2, 3], [4, 5]], 4, 0)
  sampling = models.Sampler(model).lower_padded(
      view, ids, mask, jax.random.key(0), models.SamplingParams(4)
  )
  completion = jax.numpy.ones((2, 4), jax.numpy.int32)
  forward = jax.jit(models.token_logprobs, static_argnums=0).lower(
      graphdef, view, ids, mask, completion
  )
  for lowered in (sampling, forward):
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    assert temp < head_bytes / 2, (temp, head_bytes)
