"""The GRPO-family learner: rollout -> rewards -> advantages -> update.

Host code orchestrates one step at a time; all tensor work of a step runs in
two compiled programs built once per run: the sampler (from
`logra_jax.models`) and :func:`make_train_step`, which computes the loss over
micro-batches, applies the optimizer and measures the realized KL of the
applied update, all inside one ``jax.jit`` with donated params and state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import optax
import optax.contrib

from logra_jax import optim
from logra_jax import models
from logra_jax import parallel
from logra_jax.optim import sketch_grad
from logra_jax import policy_state
from logra_jax.configs import TrainConfig
from logra_jax.models.logprobs import completion_logits_scale
from logra_jax.optim import factored as factored_lib
from logra_jax.optim import lora as lora_lib
from logra_jax.optim import non_finite
from logra_jax.rl import algo
from logra_jax.rl import losses


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    config: TrainConfig,
    shardings: tuple[Any, Any, Any] | None = None,
    activation_rules: dict[str, Any] | None = None,
) -> Callable:
  """Builds the jitted update ``(params, opt_state, batch) -> (params,
  opt_state, metrics)``.

  The loss is accumulated over ``config.micro_batches`` chunks with
  ``lax.scan`` as (numerator, denominator) pairs, so the gradient equals the
  full-batch gradient for every aggregation. When ``tx`` has a
  ``optim.project`` stage and ``gradient_mode="sketch"``, the weights are
  factored, ``W = c B + P A`` (start from :func:`init_train_state`; see
  :mod:`logra_jax.optim.factored`): at a refresh the window is merged into
  ``B``, the gradients are differentiated directly as low-rank sketches
  (:func:`optim.sketch_grad.value_and_sketch_grad`; micro-batches sum sketches, no full
  gradient of a projected weight exists) and the step updates only ``A``,
  ``c`` and the dense leaves. Weights with LoRA adapters
  (:mod:`logra_jax.optim.lora`) get gradients and updates of the adapters
  alone. ``grad_norm`` (and the global-norm clip) then
  measure the sketched gradient ``P^T G``, whose norm is at most that of
  ``G``. The loss is also handed to
  the optimizer (extra argument ``loss``) for the non-finite guard of
  :func:`make_optimizer`. Metrics include the gradient
  norm, the entropy of the policy and ``kl/realized``: the mean over the
  batch's tokens of ``log pi_old - log pi_new`` between the params before and
  after this update (and ``kl/realized_k3``, the k3 estimate), measured by
  one more forward pass on the last update of step 1 and of every
  ``config.logging.realized_kl_every``-th step (``config.num_iterations``
  updates per step, by the optimizer's update count), NaN on the others.
  With ``config.optimizer.target_kl``, a KL predictor is built on the same
  batch (or ``kl_subsample`` of its sequences) and handed to the optimizer;
  then ``kl/predicted`` is the predicted KL of the applied (scaled) step,
  ``kl/scale`` the scale, and ``kl/skipped`` counts the steps dropped so far
  for an invalid prediction. Under LoGRA, ``projector/non_finite`` counts the
  refreshed projectors refused so far for not being finite
  (``optim.project``). Under a rollout correction (``loss.rollout_correction``)
  the proximal log-probs are the batch's ``proximal_logp_BxT``
  (:func:`make_proximal_logprobs` fills them, as the learner does when a batch
  gets ``num_iterations > 1`` updates), or else each update's own.

  With ``shardings = (params, opt_state, batch)`` (trees of ``NamedSharding``
  from :mod:`logra_jax.parallel`), the step is jitted with those explicit
  input and output shardings (metrics replicated) and activations pinned by
  ``activation_rules`` (logical axis -> mesh axes, e.g.
  ``parallel.PARTITION_RULES``); otherwise XLA places everything on the
  default device.
  """
  step = _TrainStep(graphdef, tx, config)
  if shardings is None:
    return jax.jit(step.train_step, donate_argnums=(0, 1))
  params_sharding, state_sharding, batch_sharding = shardings
  mesh = jax.tree.leaves(params_sharding)[0].mesh
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def sharded_train_step(params, opt_state, batch):
    with parallel.activation_sharding(mesh, activation_rules):
      return step.train_step(params, opt_state, batch)

  return jax.jit(
      sharded_train_step,
      donate_argnums=(0, 1),
      in_shardings=(params_sharding, state_sharding, batch_sharding),
      out_shardings=(params_sharding, state_sharding, replicated),
  )


def make_merge_ahead(
    config: TrainConfig, shardings: tuple[Any, Any] | None = None
) -> Callable | None:
  """Builds the jitted ``(weights, opt_state) -> weights`` that merges a
  factored policy's window (:func:`factored.merge_at_refresh`) when the
  next update will refresh its projectors, and leaves the weights as they
  are otherwise (weights donated: in place). That update's own merge, which
  it begins with, then finds the coordinates zero and the scale one, and
  leaves every value as it is. None for weights that are not factored.

  With ``shardings = (weights, opt_state)`` the weights keep their layout.
  """
  if not policy_state.factored_policy(config.optimizer):
    return None
  merge = lambda weights, opt_state: policy_state.with_frozen(
      factored_lib.merge_at_refresh(
          policy_state.trainable(weights, config.optimizer),
          opt_state,
          seed=config.seed,
      ),
      weights,
  )
  if shardings is None:
    return jax.jit(merge, donate_argnums=0)
  return jax.jit(
      merge,
      donate_argnums=0,
      in_shardings=shardings,
      out_shardings=shardings[0],
  )


def make_proximal_logprobs(
    graphdef: nnx.GraphDef,
    config: TrainConfig,
    shardings: tuple[Any, Any, Any] | None = None,
    activation_rules: dict[str, Any] | None = None,
) -> Callable | None:
  """Builds the jitted ``(weights, opt_state, batch) -> batch`` that fills
  ``batch.proximal_logp_BxT`` with the learner's float32 log-probs of the
  completion tokens under its weights as they are (call it before a batch's
  first update); None where the train step takes its own: one update per
  batch (``config.num_iterations == 1``) or ``loss.rollout_correction``
  ``"none"``.

  The ``config.num_iterations`` updates of a batch then share the proximal
  policy of the rollout correction (``rl.algo.loss_terms``), never the moving
  weights. A forward pass of its own (the weights as the model consumes
  them, ``policy_state.model_view``): on the first update its log-probs may
  differ from the train step's by float rounding (another program, and a
  refresh merges the window before the step's forward pass).

  Args:
    graphdef: the policy's graph definition.
    config: the run's configuration.
    shardings: optional ``(weights, opt_state, batch)`` shardings as for
      :func:`make_train_step`; the output batch has the batch's sharding,
      ``proximal_logp_BxT`` split like the completions.
    activation_rules: logical axis -> mesh axes, with ``shardings``.

  Returns:
    The jitted function, or None.

  Example:
    >>> from logra_jax import configs
    >>> config = configs.get_preset("smoke")
    >>> make_proximal_logprobs(None, config) is None   # one update per batch
    True
  """
  if config.num_iterations == 1 or config.loss.rollout_correction == "none":
    return None

  def fill(weights, opt_state, batch: algo.RolloutBatch) -> algo.RolloutBatch:
    logp_BxT = models.token_logprobs(
        graphdef,
        policy_state.model_view(weights, opt_state),
        batch.prompt_tokens_BxP,
        batch.prompt_mask_BxP,
        batch.completion_tokens_BxT,
        batch.completion_mask_BxT,
        context_mask_BxN=batch.context_mask_BxT,
        temperature=config.rollout.temperature,
    )
    return batch.replace(proximal_logp_BxT=logp_BxT.astype(jnp.float32))

  if shardings is None:
    return jax.jit(fill)
  weights_sharding, state_sharding, batch_sharding = shardings
  mesh = jax.tree.leaves(weights_sharding)[0].mesh

  def sharded_fill(weights, opt_state, batch):
    with parallel.activation_sharding(mesh, activation_rules):
      return fill(weights, opt_state, batch)

  return jax.jit(
      sharded_fill,
      in_shardings=(weights_sharding, state_sharding, batch_sharding),
      out_shardings=batch_sharding.replace(
          proximal_logp_BxT=batch_sharding.completion_mask_BxT
      ),
  )


class _Totals(NamedTuple):
  """A batch's loss, gradients, metric sums and log-probs before the update,
  summed over its micro-batches."""

  loss: jax.Array
  grads: Any
  metrics: dict[str, Any]
  logp_before: jax.Array


def _totals(value, grad_sum) -> _Totals:
  """The :class:`_Totals` of micro-batch ``(numerator, denominator)`` pairs."""
  nums, (dens, metrics, logp_before) = value
  den = dens.sum()
  grads = jax.tree.map(lambda g: g / jnp.maximum(den, 1.0), grad_sum)
  return _Totals(
      algo.finalize(nums.sum(), den),
      grads,
      losses.reduce_metrics(metrics),
      logp_before,
  )


@dataclasses.dataclass(frozen=True, eq=False)
class _TrainStep:
  """One update of the policy, traced by :func:`make_train_step`: a shared
  loss (:meth:`micro_loss`) and metrics (:meth:`metrics`) around three ways
  to apply the optimizer, picked by the layout of the weights and the state:
  :meth:`dense_step` (dense weights, or LoRA adapters), :meth:`projected_step`
  (LoGRA on full gradients) and :meth:`factored_step` (LoGRA on sketches).

  Attributes:
    graphdef: the model's graph definition.
    tx: the optimizer (from :func:`policy_state.make_optimizer`).
    config: the run's configuration.
  """

  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  config: TrainConfig

  def train_step(self, params, opt_state, batch: algo.RolloutBatch):
    """``(params, opt_state, batch) -> (params, opt_state, metrics)``.

    The step moves :func:`policy_state.trainable` ``(params)``; the frozen
    rest (``optimizer.freeze_embeddings``) enters the model as constants,
    so no gradient of it is taken, and leaves the step unchanged."""
    step = self.path(params, opt_state)
    micro = batch.micro_batches(self.config.micro_batches)
    trainable = policy_state.trainable(params, self.config.optimizer)
    complete = lambda part: policy_state.with_frozen(part, params)
    new_trainable, opt_state, metrics = step(
        trainable, opt_state, batch, micro, complete
    )
    return complete(new_trainable), opt_state, metrics

  def path(self, params, opt_state) -> Callable:
    """The step for this layout of the weights and the optimizer's state;
    refuses an unguarded optimizer and weights of the wrong layout."""
    if not isinstance(opt_state, non_finite.SkipNonFiniteState):
      raise TypeError(
          "make_train_step needs an optimizer wrapped in "
          "skip_non_finite (make_optimizer wraps it), got a state "
          f"of type {type(opt_state).__name__}"
      )
    low_rank = sketch_grad.project_state(opt_state) is not None
    factored = self.config.optimizer.gradient_mode == "sketch" and low_rank
    if factored != policy_state.has_factored(params):
      raise ValueError(
          "make_train_step: "
          + (
              "LoGRA with sketch-direct gradients keeps projected weights "
              "factored; start from policy_state.init_train_state(...)"
              if factored
              else "the weights are factored but this optimizer "
              "and gradient mode do not keep them factored"
          )
      )
    if factored:
      return self.factored_step
    return self.projected_step if low_rank else self.dense_step

  def dense_step(self, params, opt_state, batch, micro, complete):
    """The optimizer moves the params, or only the adapters of LoRA weights
    (then completed with the frozen rest for the model)."""
    adapted = lora_lib.has_adapters(params)
    trainable = lora_lib.trainable(params) if adapted else params
    adapters = lambda t: lora_lib.with_frozen(t, params) if adapted else t
    # Under LoRA the unembedding (the LM head, or the tied embedding) moves
    # only when adapted.
    frozen_unembedding = adapted and not (
        {"lm_head", "embed"} & set(self.config.optimizer.lora_targets)
    )
    view = lambda t: complete(lora_lib.view(adapters(t)))
    extra = self.kl_extra(trainable, batch, view, frozen_unembedding)
    totals = self.gradients(trainable, view, micro)
    updates, opt_state = self.tx.update(
        totals.grads, opt_state, trainable, loss=totals.loss, **extra
    )
    new_params = adapters(optax.apply_updates(trainable, updates))
    update_norm = optax.global_norm(updates)
    return self.outputs(
        new_params,
        opt_state,
        batch,
        totals,
        update_norm,
        lambda p: complete(lora_lib.view(p)),
    )

  def projected_step(self, params, opt_state, batch, micro, complete):
    """LoGRA on dense weights: its updates ``P N`` are expanded and applied
    inside the guard, leaf by leaf, so that they need not all exist at once
    (a dense optimizer's update is cheaper returned, :meth:`dense_step`)."""
    view = lambda p: complete(lora_lib.view(p))
    extra = self.kl_extra(params, batch, view)
    totals = self.gradients(params, view, micro)
    (new_params, update_norm), opt_state = self.tx.update(
        totals.grads,
        opt_state,
        params,
        loss=totals.loss,
        apply_fn=lambda u: (
            optax.apply_updates(params, u),
            optax.global_norm(u),
        ),
        **extra,
    )
    return self.outputs(new_params, opt_state, batch, totals, update_norm, view)

  def factored_step(self, params, opt_state, batch, micro, complete):
    """The step on factored weights: the window merged at a refresh, the
    sketches taken at ``c B + P A``, and only ``A``, ``c`` and the dense
    leaves updated."""
    params = factored_lib.merge_at_refresh(
        params, opt_state, seed=self.config.seed
    )
    value, grad_sum, projectors = sketch_grad.value_and_sketch_grad(
        lambda view, micro: self.micro_loss(complete(view), micro),
        has_aux=True,
        micro_batched=True,
        constrain=parallel.constrain,
    )(params, opt_state, micro)
    totals = _totals(value, grad_sum)
    view = lambda w: complete(
        sketch_grad.factored_view(w, projectors.projectors)
    )
    extra = {"projectors": projectors, **self.kl_extra(params, batch, view)}
    trainable = factored_lib.without_base(params)
    step = sketch_grad.project_state(opt_state).count
    (new_trainable, update_norm), opt_state = self.tx.update(
        totals.grads,
        opt_state,
        params,
        loss=totals.loss,
        apply_fn=lambda u: (
            factored_lib.apply_updates(
                trainable, u, seed=self.config.seed, step=step
            ),
            factored_lib.update_norm(u, params, projectors.projectors),
        ),
        **extra,
    )
    new_params = factored_lib.with_base(new_trainable, params)
    return self.outputs(new_params, opt_state, batch, totals, update_norm, view)

  def gradients(self, trainable, view: Callable, micro) -> _Totals:
    """The :class:`_Totals` of the loss of ``view(trainable)``."""
    return _totals(
        *sketch_grad.value_and_grad_sum(
            lambda t, micro: self.micro_loss(view(t), micro), has_aux=True
        )(trainable, micro)
    )

  def logprobs(self, params, batch, with_entropy=False):
    """The completion's log-probs (and entropies) under ``params``."""
    return models.token_logprobs(
        self.graphdef,
        params,
        batch.prompt_tokens_BxP,
        batch.prompt_mask_BxP,
        batch.completion_tokens_BxT,
        batch.completion_mask_BxT,
        context_mask_BxN=batch.context_mask_BxT,
        temperature=self.config.rollout.temperature,
        return_entropy=with_entropy,
    )

  def micro_loss(self, params, micro):
    """One micro-batch's ``(numerator, (denominator, metrics, logp))``."""
    logp_BxT, entropy_BxT = self.logprobs(params, micro, with_entropy=True)
    num, den, metrics = algo.loss_terms(
        logp_BxT,
        micro.completion_mask_BxT,
        micro.advantages_B,
        micro.old_logp_BxT,
        micro.ref_logp_BxT,
        self.config.loss,
        micro.proximal_logp_BxT,
    )
    mask_BxT = micro.completion_mask_BxT.astype(jnp.float32)
    metrics["entropy"] = (
        jnp.sum(jax.lax.stop_gradient(entropy_BxT) * mask_BxT),
        mask_BxT.sum(),
    )
    return num, (den, metrics, jax.lax.stop_gradient(logp_BxT))

  def kl_extra(
      self, params, batch, view: Callable, frozen_unembedding: bool = False
  ) -> dict[str, Any]:
    """The optimizer's ``kl_predictor`` argument under KL control (else
    none): the predictor of updates of ``params``; ``view`` maps them to
    what the model takes (the factored view, whose coordinates the updates
    move, or the adapters completed with the frozen weights; frozen
    embeddings completed)."""
    if self.config.optimizer.target_kl is None:
      return {}
    scale = completion_logits_scale(self.config.rollout.temperature)

    def features(params, batch):
      hidden_BxTxD, w_DxV = models.completion_hidden_states(
          self.graphdef,
          view(params),
          batch.prompt_tokens_BxP,
          batch.prompt_mask_BxP,
          batch.completion_tokens_BxT,
          batch.completion_mask_BxT,
          batch.context_mask_BxT,
      )
      return hidden_BxTxD.astype(jnp.float32) / scale, w_DxV

    return {
        "kl_predictor": optim.make_kl_predictor(
            features,
            params,
            batch,
            token_mask=batch.completion_mask_BxT,
            subsample=self.config.optimizer.kl_subsample,
            frozen_unembedding=frozen_unembedding
            or self.config.optimizer.freeze_embeddings,
        )
    }

  def outputs(
      self, new_params, opt_state, batch, totals, update_norm, view
  ) -> tuple[Any, Any, dict[str, jax.Array]]:
    """``(new_params, opt_state, metrics)``; ``view`` maps the new params to
    the model's weights for the realized KL's forward pass."""
    return (
        new_params,
        opt_state,
        self.metrics(
            batch,
            opt_state,
            totals,
            update_norm,
            lambda: self.logprobs(view(new_params), batch),
        ),
    )

  def metrics(
      self, batch, opt_state, totals: _Totals, update_norm, logp_after
  ) -> dict[str, jax.Array]:
    """The step's metrics; ``logp_after()``, a forward pass of the updated
    weights, runs only on the steps that measure the realized KL."""
    config = self.config
    mask_BxT = batch.completion_mask_BxT.astype(jnp.float32)
    logp_before_BxT = totals.logp_before.reshape(mask_BxT.shape)
    # The last of a step's num_iterations updates (whose metrics the
    # trainer records) on step 1 and every realized_kl_every-th step.
    update, iterations = opt_state.count, config.num_iterations
    step = update // iterations
    logp_after_BxT = jax.lax.cond(
        (update % iterations == 0)
        & ((step == 1) | (step % config.logging.realized_kl_every == 0)),
        logp_after,
        lambda: jnp.full(mask_BxT.shape, jnp.nan),
    )
    tokens = jnp.maximum(mask_BxT.sum(), 1.0)
    log_ratio_BxT = (logp_before_BxT - logp_after_BxT) * mask_BxT
    out = algo.finalize_metrics(totals.metrics)
    out.update(
        {
            "loss": totals.loss,
            "grad_norm": optax.global_norm(totals.grads),
            "update_norm": update_norm,
            "kl/realized": log_ratio_BxT.sum() / tokens,
            "kl/realized_k3": jnp.sum(
                (jnp.expm1(-log_ratio_BxT) + log_ratio_BxT) * mask_BxT
            )
            / tokens,
        }
    )
    project = sketch_grad.project_state(opt_state)
    if project is not None:
      out["projector/non_finite"] = project.non_finite
    if config.optimizer.target_kl is not None:
      kl_state = optim.predicted_kl_state(opt_state)
      applied = jnp.square(kl_state.scale) * kl_state.predicted_kl
      out.update(
          {
              "kl/predicted": jnp.where(kl_state.scale > 0, applied, 0.0),
              "kl/scale": kl_state.scale,
              "kl/skipped": kl_state.skipped_steps,
          }
      )
    return out
