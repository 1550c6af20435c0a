"""The GRPO-family learner: rollout -> rewards -> advantages -> update.

Host code orchestrates one step at a time; all tensor work of a step runs in
two compiled programs built once per run: the sampler (from
`logra_jax.models`) and :func:`make_train_step`, which computes the loss over
micro-batches, applies the optimizer and measures the realized KL of the
applied update, all inside one ``jax.jit`` with donated params and state.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import optax
import optax.contrib

import logra_jax as logra
from logra_jax import models
from logra_jax import parallel
from logra_jax.optim import sketch_grad
from logra_jax import sync
from logra_jax.configs import OptimizerConfig, TrainConfig
from logra_jax.models.logprobs import completion_logits_scale
from logra_jax.optim import factored as factored_lib
from logra_jax.optim import lora as lora_lib
from logra_jax.optim import transforms
from logra_jax.optim.transforms import find_states
from logra_jax.rl import algo


def make_optimizer(
    config: OptimizerConfig, params: nnx.State
) -> optax.GradientTransformation:
  """The policy optimizer named by ``config``, with global-norm clipping.

  Layer-stacked matrices ``[L, m, n]`` get one projector per layer under
  LoGRA. ``optax.contrib.galore`` has no batch axes, so under ``"galore"`` a
  stacked weight is projected as one ``[L*m, n]`` matrix. Vectors stay dense
  (AdamW) in both, and so do embeddings and the LM head unless
  ``config.project_embeddings``. With ``config.target_kl``,
  every optimizer ends with :func:`logra.scale_by_predicted_kl` (so dense
  Adam with KL control is available as an ablation). The whole chain is
  wrapped in :func:`skip_non_finite`: an update with a non-finite loss,
  gradient, predicted KL or result leaves params unchanged. Under
  ``"lora"`` the chain is AdamW on the adapters (:func:`init_train_state`
  initializes it on :func:`logra_jax.optim.lora.trainable`).
  """
  schedule = (
      optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps)
      if config.warmup_steps
      else config.learning_rate
  )
  dims = models.matrix_dimension_numbers(
      params, include_embeddings=config.project_embeddings
  )
  if config.name == "logra":
    core = logra.logra(
        schedule,
        rank=config.rank,
        kind=config.kind,
        refresh_every=config.refresh_every,
        b1=config.b1,
        b2=config.b2,
        moment_policy=config.moment_policy,
        weight_decay=config.weight_decay,
        dimension_numbers=dims,
        target_kl=config.target_kl,
        kl_mode=config.kl_mode,
        factored=factored_policy(config),
    )
  elif config.name in ("adam", "lora"):
    core = optax.adamw(
        schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay
    )
  else:

    def galore_spec(d, param):
      spec = (
          None
          if d is None
          else optax.contrib.GaLoreDimensionNumbers(
              reduction_axis=tuple(d.batch_axes) + tuple(d.reduction_axes),
              output_axis=d.output_axes,
          )
      )
      return jax.tree.map(lambda _: spec, param)  # one entry per array

    galore_dims = jax.tree.map(
        galore_spec,
        dims,
        params,
        is_leaf=lambda x: x is None or isinstance(x, logra.DimensionNumbers),
    )
    core = optax.contrib.galore(
        schedule,
        rank=config.rank,
        update_proj_gap=config.refresh_every,
        base_optimizer=optax.scale_by_adam(b1=config.b1, b2=config.b2),
        weight_decay=config.weight_decay,
        weight_dimension_numbers=galore_dims,
    )
  if config.target_kl is not None and config.name != "logra":
    core = optax.chain(
        core, logra.scale_by_predicted_kl(config.target_kl, mode=config.kl_mode)
    )
  if config.max_grad_norm:
    core = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), core)
  return skip_non_finite(core)


def factored_policy(config: OptimizerConfig) -> bool:
  """Whether the learner keeps projected weights factored, ``W = c B + P A``
  (:mod:`logra_jax.optim.factored`): LoGRA with sketch-direct gradients."""
  return config.name == "logra" and config.gradient_mode == "sketch"


def init_train_state(
    config: OptimizerConfig,
    tx: optax.GradientTransformation,
    params: Any,
    seed: int = 0,
) -> tuple[Any, optax.OptState]:
  """``(weights, opt_state)`` to start :func:`make_train_step` from dense
  ``params``: the weights are ``params``, factored (base in
  ``config.base_dtype``) under :func:`factored_policy`, or with adapters
  under ``"lora"`` (:func:`logra_jax.optim.lora.add_adapters`, drawn from
  ``seed``); the state is ``tx.init`` of what the optimizer moves (the
  params, or the adapters).

  Example:
    >>> from logra_jax.configs import OptimizerConfig
    >>> _, params = models.split_model(
    ...     models.init_model(models.DecoderConfig.tiny(), rngs=0))
    >>> config = OptimizerConfig(rank=2)
    >>> tx = make_optimizer(config, params)
    >>> weights, state = init_train_state(config, tx, params)
    >>> type(weights["layers"]["q_proj"].value).__name__
    'FactoredWeight'
  """
  if config.name == "lora":
    weights = lora_lib.add_adapters(
        params,
        rank=config.rank,
        alpha=config.lora_alpha,
        targets=config.lora_targets,
        base_dtype=config.base_dtype,
        seed=seed,
    )
    return weights, tx.init(lora_lib.trainable(weights))
  opt_state = tx.init(params)
  if not factored_policy(config):
    return params, opt_state
  weights = factored_lib.factor(
      params, opt_state, config.base_dtype, decay=config.weight_decay > 0
  )
  return weights, opt_state


def abstract_weights(
    config: OptimizerConfig, tx: optax.GradientTransformation, params: Any
) -> Any:
  """The shapes and dtypes (``jax.ShapeDtypeStruct``) of the weights of
  :func:`init_train_state` for ``params``, without computing anything."""
  return jax.eval_shape(lambda p: init_train_state(config, tx, p)[0], params)


def abstract_opt_state(
    config: OptimizerConfig, tx: optax.GradientTransformation, params: Any
) -> Any:
  """The shapes and dtypes of the optimizer state of
  :func:`init_train_state` for ``params``, without computing anything."""
  return jax.eval_shape(lambda p: init_train_state(config, tx, p)[1], params)


def optimized(weights: Any, params: Any) -> Any:
  """What the optimizer moves (``tx.init``'s argument in
  :func:`init_train_state`), given the weights it made from ``params``: the
  adapters of LoRA weights (:func:`logra_jax.optim.lora.trainable`), else
  ``params``. Works on trees of shapes or of shardings too."""
  if lora_lib.has_adapters(weights):
    return lora_lib.trainable(weights)
  return params


def abstract_policy_state(
    config: OptimizerConfig, params: Any
) -> dict[str, Any]:
  """The shapes and dtypes of :func:`sync.policy_state` of the learner's
  state for dense ``params`` (what a rollout engine of this config holds),
  without computing anything."""
  tx = make_optimizer(config, params)

  def state(p):
    weights, opt_state = init_train_state(config, tx, p)
    return sync.policy_state(weights, opt_state)

  return jax.eval_shape(state, params)


def dense_weights(
    weights: Any, opt_state: optax.OptState, dtype: Any = None
) -> Any:
  """The learner's weights materialized as dense arrays (``W = c B + P A``
  for factored ones, ``W_0 + s D U`` for adapted ones, in the parameter's
  dtype or ``dtype``)."""
  if lora_lib.has_adapters(weights):
    return jax.tree.map(
        lambda w: w if dtype is None else w.astype(dtype),
        lora_lib.merge(weights),
    )
  if not _has_factored(weights):
    return (
        weights
        if dtype is None
        else jax.tree.map(lambda p: p.astype(dtype), weights)
    )
  return factored_lib.effective_weights(
      weights, transforms.window_projectors(opt_state), dtype
  )


def _has_factored(weights: Any) -> bool:
  return any(
      map(
          factored_lib.is_factored,
          jax.tree.leaves(weights, is_leaf=factored_lib.is_factored),
      )
  )


# What `SkipNonFiniteState.reason` bits stand for, lowest bit first.
NON_FINITE_REASONS = ("loss", "gradients", "predicted KL", "update")


class SkipNonFiniteState(NamedTuple):
  """State of :func:`skip_non_finite`.

  Attributes:
    count: updates seen, applied or skipped.
    inner_state: the wrapped optimizer's state (unchanged by a skipped update).
    skipped_steps: updates skipped so far.
    consecutive_skips: updates skipped in a row, ending with the last one (0
      when the last one was applied).
    reason: what was non-finite in the current run of skipped updates, as
      bits of :data:`NON_FINITE_REASONS` (1 loss, 2 gradients, 4 predicted
      KL, 8 update); 0 when the last update was applied.
  """

  count: jax.Array
  inner_state: optax.OptState
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  reason: jax.Array


def _all_finite(tree: Any) -> jax.Array:
  """True when every element of every leaf is finite (True for no leaves)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def skip_non_finite(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Skips an update with a non-finite loss, gradient, predicted KL or result.

  The loss (the optional ``loss`` extra argument) and the gradients are
  checked before ``inner`` runs: if either is not finite, ``inner`` is
  skipped altogether (``lax.cond``), so the update is zero and its state
  stays as it was. A non-finite predicted KL (when a
  ``kl_predictor`` is given, as recorded by ``logra.scale_by_predicted_kl``,
  which then zeroes the step itself) counts as a skip too, with the state
  advanced as ``inner`` left it. So does a non-finite result (reason
  ``"update"``: the update, or what ``apply_fn`` made of it, e.g. from a NaN
  or infinite learning rate or moments that overflowed): the result of a
  skipped update (zeros, or ``apply_fn`` of zeros: the old params) is
  returned instead, and the state is kept as ``inner`` advanced it. Each skip
  is counted in :class:`SkipNonFiniteState` (read it on the host with
  :func:`non_finite_state`). Like ``optax.apply_if_finite``, but it also
  looks at the loss, the predicted KL and the result, and reports why.

  Memory: the inputs are checked before the update, so no select between the
  new and the old state keeps a second copy of it (+15 GiB per device for
  Adam at 27B). The result can only be checked after it is computed, so the
  old values stay alive until all of it is known to be finite; the state is
  not restored for the same reason (if it went non-finite itself, the next
  updates are skipped too, for "update", until the trainer's limit of
  consecutive skips stops the run). Measured with :mod:`logra_jax.memory`
  on a 45M-parameter model (4 layers, D=512, V=32000, float32 weights), the
  check costs +65 MB of temporaries under LoGRA (about its largest leaf, the
  embedding table) and +82 MB under dense Adam, against params of 181 MB;
  checking the update before applying it instead cost LoGRA +146 MB, since
  every leaf's ``P N`` was then held at once.

  The keyword argument ``apply_fn`` (taken here, not passed on) is applied to
  the update inside the guard, and ``update`` then returns its result in
  place of the update, e.g. ``apply_fn=lambda u: optax.apply_updates(params,
  u)`` returns new params; a skipped update reaches it as zeros. XLA can then
  apply each leaf's update as soon as it is computed instead of holding the
  update of every parameter at once (a low-rank update ``P N`` is as large as
  its parameter).

  Args:
    inner: the optimizer to guard (any optax transformation; extra arguments
      such as ``kl_predictor`` are passed on to it).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> tx = skip_non_finite(optax.adam(0.1))
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.nan, 0.0])},
    ...                            state, params)
    >>> updates["w"].tolist(), int(state.skipped_steps)
    ([0.0, 0.0, 0.0], 1)
    >>> non_finite_reasons(state.reason)
    ['gradients']
    >>> tx = skip_non_finite(optax.sgd(float("inf")))
    >>> updates, state = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    >>> updates["w"].tolist(), non_finite_reasons(state.reason)
    ([0.0, 0.0, 0.0], ['update'])
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    zero = lambda: jnp.zeros([], jnp.int32)  # distinct buffers (donation)
    return SkipNonFiniteState(
        count=zero(),
        inner_state=inner.init(params),
        skipped_steps=zero(),
        consecutive_skips=zero(),
        reason=zero(),
    )

  def update_fn(
      updates, state, params=None, *, loss=None, apply_fn=None, **extra_args
  ):
    apply_fn = (lambda u: u) if apply_fn is None else apply_fn
    loss_ok = jnp.asarray(True) if loss is None else _all_finite(loss)
    grads_ok = _all_finite(updates)
    inputs_ok = loss_ok & grads_ok

    inner_update = lambda: inner.update(
        updates, state.inner_state, params, **extra_args
    )

    def run():
      new_updates, new_inner = inner_update()
      kl_ok = jnp.asarray(True)
      kl_state = (
          logra.predicted_kl_state(new_inner)
          if extra_args.get("kl_predictor") is not None
          else None
      )
      if kl_state is not None:
        kl_ok = jnp.isfinite(kl_state.predicted_kl)
      out = apply_fn(new_updates)
      update_ok = _all_finite(out)
      skipped_out = apply_fn(jax.tree.map(jnp.zeros_like, new_updates))
      out = jax.tree.map(
          lambda new, old: jnp.where(update_ok, new, old), out, skipped_out
      )
      return out, new_inner, kl_ok, update_ok

    def skip():
      zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(inner_update)[0])
      true = jnp.asarray(True)
      return apply_fn(zeros), state.inner_state, true, true

    # Decided from the inputs, before the update, with lax.cond: the state is
    # updated in place (a select between the new and the old state keeps a
    # second copy of the state alive: +15 GiB per device for Adam at 27B).
    out, new_inner, kl_ok, update_ok = jax.lax.cond(inputs_ok, run, skip)
    checks = (loss_ok, grads_ok, kl_ok, update_ok)
    reason = sum(
        jnp.where(ok, 0, 1 << i).astype(jnp.int32)
        for i, ok in enumerate(checks)
    )
    ok = reason == 0
    skipped = (~ok).astype(jnp.int32)
    return out, SkipNonFiniteState(
        count=optax.safe_increment(state.count),
        inner_state=new_inner,
        skipped_steps=state.skipped_steps + skipped,
        consecutive_skips=jnp.where(ok, 0, state.consecutive_skips + 1),
        reason=jnp.where(ok, 0, state.reason | reason),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def non_finite_state(opt_state: optax.OptState) -> SkipNonFiniteState | None:
  """The :func:`skip_non_finite` state inside ``opt_state``, or None."""
  found = find_states(opt_state, SkipNonFiniteState)
  return found[0] if found else None


def non_finite_reasons(reason: int) -> list[str]:
  """The names of the bits set in :attr:`SkipNonFiniteState.reason`."""
  return [
      name for i, name in enumerate(NON_FINITE_REASONS) if int(reason) >> i & 1
  ]


def dense_adam_state_bytes(params: Any) -> int:
  """Bytes dense Adam would hold for ``params``: float32 first and second
  moments of every parameter (plus its step count)."""
  f32 = jax.tree.map(
      lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params
  )
  return logra.optimizer_state_bytes(jax.eval_shape(optax.adam(1.0).init, f32))


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
  ``logra.project`` stage and ``gradient_mode="sketch"``, the weights are
  factored, ``W = c B + P A`` (start from :func:`init_train_state`; see
  :mod:`logra_jax.optim.factored`): at a refresh the window is merged into
  ``B``, the gradients are differentiated directly as low-rank sketches
  (:func:`logra.value_and_sketch_grad`; micro-batches sum sketches, no full
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
  (``logra.project``).

  With ``shardings = (params, opt_state, batch)`` (trees of ``NamedSharding``
  from :mod:`logra_jax.parallel`), the step is jitted with those explicit
  input and output shardings (metrics replicated) and activations pinned by
  ``activation_rules`` (logical axis -> mesh axes, e.g.
  ``parallel.PARTITION_RULES``); otherwise XLA places everything on the
  default device.
  """
  temperature = config.rollout.temperature
  kl_control = config.optimizer.target_kl is not None
  # Under LoRA the unembedding (the LM head, or the tied embedding) moves
  # only when adapted.
  lm_head_adapted = bool(
      {"lm_head", "embed"} & set(config.optimizer.lora_targets)
  )
  sketch_mode = config.optimizer.gradient_mode == "sketch"

  def logprobs(params, batch, with_entropy=False):
    return models.token_logprobs(
        graphdef,
        params,
        batch.prompt_tokens_BxP,
        batch.prompt_mask_BxP,
        batch.completion_tokens_BxT,
        batch.completion_mask_BxT,
        temperature=temperature,
        return_entropy=with_entropy,
    )

  def kl_predictor(
      params,
      batch: algo.RolloutBatch,
      view: Callable = lambda params: params,
      frozen_unembedding: bool = False,
  ):
    """The predictor of updates of ``params``; ``view`` maps them to what the
    model takes (the factored view, whose coordinates the updates move, or
    the adapters completed with the frozen weights)."""
    scale = completion_logits_scale(temperature)

    def features(params, batch):
      hidden_BxTxD, w_DxV = models.completion_hidden_states(
          graphdef,
          view(params),
          batch.prompt_tokens_BxP,
          batch.prompt_mask_BxP,
          batch.completion_tokens_BxT,
          batch.completion_mask_BxT,
      )
      return hidden_BxTxD.astype(jnp.float32) / scale, w_DxV

    return logra.make_kl_predictor(
        features,
        params,
        batch,
        token_mask=batch.completion_mask_BxT,
        subsample=config.optimizer.kl_subsample,
        frozen_unembedding=frozen_unembedding,
    )

  def micro_loss(params, micro):
    logp_BxT, entropy_BxT = logprobs(params, micro, with_entropy=True)
    num, den, metrics = algo.loss_terms(
        logp_BxT,
        micro.completion_mask_BxT,
        micro.advantages_B,
        micro.old_logp_BxT,
        micro.ref_logp_BxT,
        config.loss,
    )
    mask_BxT = micro.completion_mask_BxT.astype(jnp.float32)
    metrics["entropy"] = (
        jnp.sum(jax.lax.stop_gradient(entropy_BxT) * mask_BxT),
        mask_BxT.sum(),
    )
    return num, (den, metrics, jax.lax.stop_gradient(logp_BxT))

  def train_step(params, opt_state, batch: algo.RolloutBatch):
    if not isinstance(opt_state, SkipNonFiniteState):
      raise TypeError(
          "make_train_step needs an optimizer wrapped in "
          "skip_non_finite (make_optimizer wraps it), got a state "
          f"of type {type(opt_state).__name__}"
      )
    micro = batch.micro_batches(config.micro_batches)
    low_rank = sketch_grad.project_state(opt_state) is not None
    factored = sketch_mode and low_rank
    if factored != _has_factored(params):
      raise ValueError(
          "make_train_step: "
          + (
              "LoGRA with sketch-direct gradients keeps projected weights "
              "factored; start from learner.init_train_state(...)"
              if factored
              else "the weights are factored but this optimizer "
              "and gradient mode do not keep them factored"
          )
      )
    if factored:
      return factored_train_step(params, opt_state, batch, micro)
    # What the optimizer moves: the params, or only the adapters of LoRA
    # weights (then completed with the frozen rest for the model).
    adapted = lora_lib.has_adapters(params)
    trainable = lora_lib.trainable(params) if adapted else params
    complete = lambda t: lora_lib.with_frozen(t, params) if adapted else t
    view = lambda t: lora_lib.view(complete(t))
    extra = (
        {
            "kl_predictor": kl_predictor(
                trainable,
                batch,
                view,
                frozen_unembedding=adapted and not lm_head_adapted,
            )
        }
        if kl_control
        else {}
    )
    loss, grads, metrics, logp_before = totals(
        *sketch_grad.value_and_grad_sum(
            lambda t, micro: micro_loss(view(t), micro), has_aux=True
        )(trainable, micro)
    )
    if low_rank:
      # LoGRA's updates P N are expanded and applied inside the guard, leaf by
      # leaf, so that they need not all exist at once (7B, fsdp=8: -0.7 GiB
      # per device, `logra memory`). A dense optimizer's update is cheaper
      # returned: applied inside, it cost Adam +0.3 GiB at 7B, +4.3 at 27B.
      (new_params, update_norm), opt_state = tx.update(
          grads,
          opt_state,
          params,
          loss=loss,
          apply_fn=lambda u: (
              optax.apply_updates(params, u),
              optax.global_norm(u),
          ),
          **extra,
      )
    else:
      updates, opt_state = tx.update(
          grads, opt_state, trainable, loss=loss, **extra
      )
      new_params = complete(optax.apply_updates(trainable, updates))
      update_norm = optax.global_norm(updates)

    return (
        new_params,
        opt_state,
        step_metrics(
            batch,
            opt_state,
            loss,
            grads,
            update_norm,
            metrics,
            logp_before,
            lambda: logprobs(lora_lib.view(new_params), batch),
            low_rank,
        ),
    )

  def factored_train_step(params, opt_state, batch, micro):
    """The step on factored weights: the window merged at a refresh, the
    sketches taken at ``c B + P A``, and only ``A``, ``c`` and the dense
    leaves updated."""
    params = factored_lib.merge_at_refresh(params, opt_state, seed=config.seed)
    value, grad_sum, projectors = sketch_grad.value_and_sketch_grad(
        micro_loss,
        has_aux=True,
        micro_batched=True,
        constrain=parallel.constrain,
    )(params, opt_state, micro)
    loss, grads, metrics, logp_before = totals(value, grad_sum)
    view = lambda weights: sketch_grad.factored_view(
        weights, projectors.projectors
    )
    extra = {"projectors": projectors}
    if kl_control:
      extra["kl_predictor"] = kl_predictor(params, batch, view)
    trainable = factored_lib.without_base(params)
    (new_trainable, update_norm), opt_state = tx.update(
        grads,
        opt_state,
        params,
        loss=loss,
        apply_fn=lambda u: (
            factored_lib.apply_updates(trainable, u),
            factored_lib.update_norm(u, params, projectors.projectors),
        ),
        **extra,
    )
    new_params = factored_lib.with_base(new_trainable, params)
    return (
        new_params,
        opt_state,
        step_metrics(
            batch,
            opt_state,
            loss,
            grads,
            update_norm,
            metrics,
            logp_before,
            lambda: logprobs(view(new_params), batch),
            True,
        ),
    )

  def totals(value, grad_sum):
    """The loss, gradients, metric sums and log-probs of the micro-batches
    (their ``(numerator, denominator)`` pairs summed first)."""
    nums, (dens, metrics, logp_before) = value
    den = dens.sum()
    grads = jax.tree.map(lambda g: g / jnp.maximum(den, 1.0), grad_sum)
    return (
        algo.finalize(nums.sum(), den),
        grads,
        jax.tree.map(lambda x: x.sum(axis=0), metrics),
        logp_before,
    )

  def step_metrics(
      batch,
      opt_state,
      loss,
      grads,
      update_norm,
      metrics,
      logp_before,
      logp_after,
      low_rank,
  ):
    """The step's metrics; ``logp_after()``, a forward pass of the updated
    weights, runs only on the steps that measure the realized KL."""
    mask_BxT = batch.completion_mask_BxT.astype(jnp.float32)
    logp_before_BxT = logp_before.reshape(mask_BxT.shape)
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
    out = algo.finalize_metrics(metrics)
    out.update(
        {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),
            "update_norm": update_norm,
            "kl/realized": log_ratio_BxT.sum() / tokens,
            "kl/realized_k3": jnp.sum(
                (jnp.expm1(-log_ratio_BxT) + log_ratio_BxT) * mask_BxT
            )
            / tokens,
        }
    )
    if low_rank:
      out["projector/non_finite"] = sketch_grad.project_state(
          opt_state
      ).non_finite
    if kl_control:
      kl_state = logra.predicted_kl_state(opt_state)
      applied = jnp.square(kl_state.scale) * kl_state.predicted_kl
      out.update(
          {
              "kl/predicted": jnp.where(kl_state.scale > 0, applied, 0.0),
              "kl/scale": kl_state.scale,
              "kl/skipped": kl_state.skipped_steps,
          }
      )
    return out

  if shardings is None:
    return jax.jit(train_step, donate_argnums=(0, 1))
  params_sharding, state_sharding, batch_sharding = shardings
  mesh = jax.tree.leaves(params_sharding)[0].mesh
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def sharded_train_step(params, opt_state, batch):
    with parallel.activation_sharding(mesh, activation_rules):
      return train_step(params, opt_state, batch)

  return jax.jit(
      sharded_train_step,
      donate_argnums=(0, 1),
      in_shardings=(params_sharding, state_sharding, batch_sharding),
      out_shardings=(params_sharding, state_sharding, replicated),
  )
