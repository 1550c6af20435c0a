"""optimizer.freeze_embeddings: the embedding table and LM head stay as they
are, hold no optimizer state and travel only in full sync messages."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from logra_jax import configs
from logra_jax import models
from logra_jax import policy_state
from logra_jax import sync
from logra_jax.optim import non_finite
from logra_jax.rl import learner
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

SMOKE = configs.get_preset("smoke")
FROZEN = ("embed", "lm_head")


def _trajectory(policy, batch, overrides, steps=2):
  """The learner's ``(weights, opt_state, metrics)`` from the policy's
  weights (metrics None) and after each of ``steps`` steps of the smoke
  config with ``overrides`` (a step may donate the arrays yielded before)."""
  config = configs.apply_overrides(SMOKE, overrides)
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  params = jax.tree.map(jnp.copy, policy.params)
  weights, state = policy_state.init_train_state(config.optimizer, tx, params)
  yield weights, state, None
  step = learner.make_train_step(policy.graphdef, tx, config)
  for _ in range(steps):
    weights, state, metrics = step(weights, state, batch)
    yield weights, state, metrics


def _keys(tree) -> set[str]:
  """Every dict key on the paths of ``tree``'s leaves."""
  paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {str(getattr(k, "key", "")) for path, _ in paths for k in path}


ADAM = [
    "optimizer.name=adam",
    "optimizer.freeze_embeddings=true",
    "optimizer.max_grad_norm=0",
    "optimizer.warmup_steps=2",
]


def test_frozen_adam_equals_optax_masking_the_embeddings(spread_batch):
  """Adam with the embeddings frozen against optax's own masking: AdamW
  under ``multi_transform`` with ``set_to_zero`` for the embedding table
  and head, on the whole policy (gradient clipping off: its global norm
  would include the frozen leaves' gradients)."""
  policy, batch = spread_batch
  run = _trajectory(policy, batch, ADAM)
  initial = jax.tree.map(jnp.copy, next(run)[0])
  *_, (weights, state, _) = run
  assert not _keys(state) & set(FROZEN)
  config = configs.apply_overrides(
      SMOKE, [o for o in ADAM if "freeze" not in o]
  )
  opt = config.optimizer
  assert opt.warmup_steps > 0  # below: optax's warmup
  adam = optax.adamw(
      optax.linear_schedule(0.0, opt.learning_rate, opt.warmup_steps),
      b1=opt.b1,
      b2=opt.b2,
      weight_decay=opt.weight_decay,
  )
  label = lambda path, _: "frozen" if path[0].key in FROZEN else "train"
  masked = non_finite.skip_non_finite(
      optax.multi_transform(
          {"train": adam, "frozen": optax.set_to_zero()},
          lambda params: jax.tree_util.tree_map_with_path(label, params),
      )
  )
  reference = jax.tree.map(jnp.copy, policy.params)
  state = masked.init(reference)
  step = learner.make_train_step(policy.graphdef, masked, config)
  for _ in range(2):
    reference, state, _ = step(reference, state, batch)
  model = models.load_pretrained(policy.folder).config
  length = (
      batch.prompt_tokens_BxP.shape[1] + batch.completion_tokens_BxT.shape[1]
  )
  n = 2 * decoder_reduction_length(model, length) + batch.batch_size * length
  for key in policy.params:
    for p0, a, b in zip(
        *(jax.tree.leaves(t[key]) for t in (initial, weights, reference))
    ):
      if key in FROZEN:
        assert np.array_equal(a, p0) and np.array_equal(b, p0)
        continue
      # Adam's steps are about the learning rate per coordinate: the two
      # runs' gradients differ by rounding, amplified by at most 1/eps'
      # relative to the moments.
      atol = 2 * float_tolerance(np.float32, n) * float(jnp.abs(b - p0).max())
      np.testing.assert_allclose(a, b, rtol=0, atol=max(atol, 1e-6))
      assert not np.array_equal(a, p0)


@pytest.mark.parametrize(
    "overrides",
    [
        # factored, sketch-direct gradients, the frozen weights held like
        # the bases in bfloat16
        ["optimizer.target_kl=0.01", "optimizer.base_dtype=bfloat16"],
        ["optimizer.gradient_mode=dense"],  # LoGRA on full gradients
    ],
    ids=["factored-kl", "dense-gradients"],
)
def test_logra_keeps_frozen_embeddings_and_sends_them_once(
    spread_batch, overrides
):
  """Under LoGRA the frozen leaves keep every bit (in the base's dtype) and
  hold no optimizer state, while the rest of the policy moves; a receiver
  follows bit for bit, the frozen leaves only in the full message, and a
  receiver that does not know them frozen refuses the sender's messages."""
  policy, batch = spread_batch
  overrides = ["optimizer.freeze_embeddings=true", *overrides]
  config = configs.apply_overrides(SMOKE, overrides)
  frozen = policy_state.frozen_keys(config.optimizer)
  assert frozen == FROZEN
  run = _trajectory(policy, batch, overrides)
  weights, state, _ = next(run)
  initial = jax.tree.map(jnp.copy, weights)
  sender = sync.PolicySender(weights, state, seed=0, frozen=frozen)
  template = policy_state.abstract_policy_state(config.optimizer, policy.params)
  receiver = sync.PolicyReceiver(template, seed=0, frozen=frozen)
  unaware = sync.PolicyReceiver(template, seed=0)
  full = sender.message(weights, state, full=True)
  with pytest.raises(sync.SyncError, match="another policy"):
    unaware.apply(full)
  receiver.apply(full)
  frozen_names = {
      n for n in full.arrays if n.startswith(("['embed']", "['lm_head']"))
  }
  assert len(frozen_names) == 2
  for weights, state, metrics in run:
    message = sender.message(weights, state)
    assert message.arrays and not frozen_names & set(message.arrays)
    receiver.apply(message)  # raises on any checksum mismatch
  ours = sync.named_arrays(receiver.state, frozen)
  theirs = sync.named_arrays(policy_state.synced_state(weights, state), frozen)
  assert ours.keys() == theirs.keys()
  assert all(np.array_equal(ours[n][1], theirs[n][1]) for n in ours)
  assert not _keys(state) & set(FROZEN)
  # (the realized KL is measured on the first step only, here)
  nan = {k for k, v in metrics.items() if not np.isfinite(float(v))}
  assert nan <= {"kl/realized", "kl/realized_k3"}, nan
  assert float(metrics["update_norm"]) > 0
  for key in policy.params:
    same = all(
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(initial[key]), jax.tree.leaves(weights[key])
        )
    )
    assert same == (key in FROZEN), key
  base = jnp.dtype(config.optimizer.base_dtype)
  assert {x.dtype for k in FROZEN for x in jax.tree.leaves(weights[k])} == {
      base
  }
  free = configs.apply_overrides(SMOKE, overrides[1:])
  tx = policy_state.make_optimizer(free.optimizer, policy.params)
  free_state = jax.eval_shape(
      lambda p: policy_state.init_train_state(free.optimizer, tx, p)[1],
      policy.params,
  )
  assert {"embed", "lm_head"} <= _keys(free_state)


def test_frozen_weights_are_held_in_the_narrower_dtype(spread_batch):
  """Under the factored policy the frozen table and head take
  ``base_dtype`` where it is narrower than theirs, and are never widened
  (a bfloat16 policy keeps them in bfloat16 under a float32 base)."""
  policy, _ = spread_batch
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), policy.params)
  for params, base, held in (
      (policy.params, "float32", jnp.float32),
      (policy.params, "bfloat16", jnp.bfloat16),
      (bf16, "float32", jnp.bfloat16),
  ):
    config = configs.OptimizerConfig(freeze_embeddings=True, base_dtype=base)
    tx = policy_state.make_optimizer(config, params)
    weights = policy_state.abstract_weights(config, tx, params)
    dtypes = {x.dtype for k in FROZEN for x in jax.tree.leaves(weights[k])}
    assert dtypes == {jnp.dtype(held)}, (base, dtypes)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            [
                "optimizer.freeze_embeddings=true",
                "optimizer.project_embeddings=true",
            ],
            "exclude each other",
        ),
        (
            ["optimizer.freeze_embeddings=true", "optimizer.name=lora"],
            "does not apply to lora",
        ),
        (["optimizer.freeze_embeddings=maybe"], "not a valid bool"),
    ],
)
def test_bad_frozen_embeddings_settings_are_refused(overrides, match):
  with pytest.raises(ValueError, match=match):
    configs.apply_overrides(SMOKE, overrides)
