"""The learner's weights and optimizer state as data.

How they are built from a config (:func:`make_optimizer`,
:func:`init_train_state`), their abstract shapes (for checkpoints and the
planner), the dense view of factored or LoRA weights (for export and
evaluation) and what a rollout engine holds (:func:`synced_state`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from flax import nnx
import jax
import jax.numpy as jnp
import optax
import optax.contrib

from logra_jax import optim
from logra_jax.configs import OptimizerConfig
from logra_jax.optim import factored as factored_lib
from logra_jax.optim import lora as lora_lib
from logra_jax.optim import sketch_grad
from logra_jax.optim import state_queries
from logra_jax.optim.dimension_numbers import DimensionNumbers
from logra_jax.optim.non_finite import skip_non_finite


def matrix_dimension_numbers(
    params: nnx.State, include_embeddings: bool = False
) -> nnx.State:
  """Which axes of each parameter form the matrix, for LoGRA projection.

  Args:
    params: from ``models.split_model``.
    include_embeddings: also treat `embed [V, D]` and `lm_head [D, V]` as
      matrices (reduction axis 0, output axis 1).

  Returns:
    A tree shaped like `params` with, at each `Param`, either None (vectors,
    norms, biases; embeddings and LM head unless asked) or
    `DimensionNumbers(reduction_axes=(1,), output_axes=(2,), batch_axes=(0,))`
    for the stacked layer matrices `[L, in, out]`.

  Example:
    >>> from logra_jax import models
    >>> _, params = models.split_model(
    ...     models.init_model(models.DecoderConfig.tiny(), 0))
    >>> matrix_dimension_numbers(params)["layers"]["q_proj"].batch_axes
    (0,)
  """

  def spec(path, variable):
    names = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
    if names[0] == "layers" and variable.ndim == 3:
      return DimensionNumbers(
          reduction_axes=(1,), output_axes=(2,), batch_axes=(0,)
      )
    if include_embeddings and names[0] in ("embed", "lm_head"):
      return DimensionNumbers(reduction_axes=(0,), output_axes=(1,))
    return None

  return jax.tree_util.tree_map_with_path(
      spec, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )


FROZEN_EMBEDDINGS = ("embed", "lm_head")


def frozen_keys(config: OptimizerConfig) -> tuple[str, ...]:
  """The top-level weights ``config`` leaves as they are:
  :data:`FROZEN_EMBEDDINGS` under ``config.freeze_embeddings``, else
  none."""
  return FROZEN_EMBEDDINGS if config.freeze_embeddings else ()


def trainable(tree: Any, config: OptimizerConfig) -> Any:
  """``tree`` (weights, params, or a tree shaped like them) without the
  top-level entries of :func:`frozen_keys`: what the optimizer moves. The
  same ``tree`` when nothing is frozen.

  Example:
    >>> from logra_jax import models
    >>> _, params = models.split_model(
    ...     models.init_model(models.DecoderConfig.tiny(), 0))
    >>> list(trainable(params, OptimizerConfig(freeze_embeddings=True)))
    ['final_norm', 'layers']
  """
  return without_frozen(tree, frozen_keys(config))


def without_frozen(tree: Any, frozen: tuple[str, ...]) -> Any:
  """``tree`` without its top-level entries named in ``frozen``."""
  if not frozen:
    return tree
  entries = _entries(tree)
  return type(tree)({k: v for k, v in entries.items() if k not in frozen})


def with_frozen(part: Any, tree: Any) -> Any:
  """``part`` (from :func:`trainable`) completed with the entries of
  ``tree`` it lacks, in ``tree``'s order (so the result has ``tree``'s
  structure)."""
  moved, entries = _entries(part), _entries(tree)
  if len(moved) == len(entries):
    return part
  return type(tree)(
      {k: moved[k] if k in moved else v for k, v in entries.items()}
  )


def _entries(tree: Any) -> Any:
  """The top-level mapping of ``tree``, nested mappings as they are stored
  (``nnx.State`` wraps them in states when read item by item)."""
  return tree.raw_mapping if isinstance(tree, nnx.State) else tree


def make_optimizer(
    config: OptimizerConfig, params: nnx.State
) -> optax.GradientTransformation:
  """The policy optimizer named by ``config``, with global-norm clipping.

  The optimizer moves :func:`trainable` ``(params, config)`` (all of them,
  unless ``config.freeze_embeddings``).
  Layer-stacked matrices ``[L, m, n]`` get one projector per layer under
  LoGRA. ``optax.contrib.galore`` has no batch axes, so under ``"galore"`` a
  stacked weight is projected as one ``[L*m, n]`` matrix. Vectors stay dense
  (AdamW) in both, and so do embeddings and the LM head unless
  ``config.project_embeddings``. With ``config.target_kl``,
  every optimizer ends with :func:`optim.scale_by_predicted_kl` (so dense
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
  params = trainable(params, config)
  dims = matrix_dimension_numbers(
      params, include_embeddings=config.project_embeddings
  )
  if config.name == "logra":
    core = optim.logra(
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
        step_bits=config.step_bits,
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
        is_leaf=lambda x: x is None or isinstance(x, optim.DimensionNumbers),
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
        core, optim.scale_by_predicted_kl(config.target_kl, mode=config.kl_mode)
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
  ``config.base_dtype``, as are the frozen weights of
  ``config.freeze_embeddings`` where it is narrower than their own) under
  :func:`factored_policy`, or with adapters
  under ``"lora"`` (:func:`logra_jax.optim.lora.add_adapters`, drawn from
  ``seed``); the state is ``tx.init`` of what the optimizer moves (the
  params, or the adapters).

  Example:
    >>> from logra_jax import models
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
  moved = trainable(params, config)
  opt_state = tx.init(moved)
  if not factored_policy(config):
    return params, opt_state
  weights = factored_lib.factor(
      moved,
      opt_state,
      config.base_dtype,
      decay=config.weight_decay > 0,
      coords_dtype=config.coords_dtype,
  )
  # Frozen weights are held like the bases, in config.base_dtype where it
  # is narrower than their own.
  base, keys = jnp.dtype(config.base_dtype), frozen_keys(config)
  narrows = lambda x: jnp.issubdtype(x.dtype, jnp.floating) and (
      jnp.finfo(base).bits < jnp.finfo(x.dtype).bits
  )
  cast = lambda x: x.astype(base) if narrows(x) else x
  held = type(params)(
      {
          k: jax.tree.map(cast, v) if k in keys else v
          for k, v in _entries(params).items()
      }
  )
  return with_frozen(weights, held), opt_state


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


def optimized(config: OptimizerConfig, weights: Any, params: Any) -> Any:
  """What the optimizer moves (``tx.init``'s argument in
  :func:`init_train_state`), given the weights it made from ``params``: the
  adapters of LoRA weights (:func:`logra_jax.optim.lora.trainable`), else
  :func:`trainable` ``(params)``. Works on trees of shapes or of shardings
  too."""
  if lora_lib.has_adapters(weights):
    return lora_lib.trainable(weights)
  return trainable(params, config)


def abstract_policy_state(
    config: OptimizerConfig, params: Any
) -> dict[str, Any]:
  """The shapes and dtypes of :func:`synced_state` of the learner's
  state for dense ``params`` (what a rollout engine of this config holds),
  without computing anything."""
  return abstract_receiver(config, params)[0]


def abstract_receiver(
    config: OptimizerConfig, params: Any
) -> tuple[dict[str, Any], Optional[Callable]]:
  """What a sync receiver of this config needs, from the config and dense
  ``params`` alone, computing nothing: :func:`abstract_policy_state` and
  the :func:`projector_source` (None unless ``kind="random"``)."""
  tx = make_optimizer(config, params)

  def state(p):
    weights, opt_state = init_train_state(config, tx, p)
    return synced_state(weights, opt_state), opt_state

  template, opt_state = jax.eval_shape(state, params)
  return template, projector_source(opt_state)


def dense_weights(
    weights: Any, opt_state: optax.OptState, dtype: Any = None
) -> Any:
  """The learner's weights materialized as dense arrays (``W = c B + P A``
  for factored ones, ``W_0 + s D U`` for adapted ones, in the parameter's
  dtype or ``dtype``; frozen ones, :func:`frozen_keys`, in the dtype they
  are held in or ``dtype``)."""
  if lora_lib.has_adapters(weights):
    return jax.tree.map(
        lambda w: w if dtype is None else w.astype(dtype),
        lora_lib.merge(weights),
    )
  if not has_factored(weights):
    return (
        weights
        if dtype is None
        else jax.tree.map(lambda p: p.astype(dtype), weights)
    )
  return factored_lib.effective_weights(
      weights,
      all_projectors(state_queries.window_projectors(opt_state), weights),
      dtype,
  )


def model_view(weights: Any, opt_state: optax.OptState) -> Any:
  r"""The learner's weights as the model consumes them, without a copy.

  Factored weights become :class:`~logra_jax.LowRankDelta` views
  :math:`c B + P A` with the window's projectors (applied as
  :math:`c (x B) + (x P) A`), LoRA weights :math:`W_0 + (s D) U`; dense
  weights are returned as they are. Every array of the view is one of
  ``weights`` or ``opt_state`` but the window's coordinates and scales, laid
  out for the model: a sampler given it holds no second copy.
  """
  return synced_view(synced_state(weights, opt_state))


def synced_view(state: dict[str, Any]) -> Any:
  """:func:`model_view` of a :func:`synced_state` (what a rollout engine with
  its own copy holds)."""
  weights = state["weights"]
  if lora_lib.has_adapters(weights):
    return lora_lib.view(weights)
  if not has_factored(weights):
    return weights
  return sketch_grad.factored_view(weights, state["projectors"])


def has_factored(weights: Any) -> bool:
  return any(
      map(
          factored_lib.is_factored,
          jax.tree.leaves(weights, is_leaf=factored_lib.is_factored),
      )
  )


def dense_adam_state_bytes(params: Any) -> int:
  """Bytes dense Adam would hold for ``params``: float32 first and second
  moments of every parameter (plus its step count)."""
  f32 = jax.tree.map(
      lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params
  )
  return optim.optimizer_state_bytes(jax.eval_shape(optax.adam(1.0).init, f32))


def synced_state(weights: Any, opt_state: optax.OptState) -> dict[str, Any]:
  """What a receiver holds: the weights and, when they are factored, the
  window's projectors (``state_queries.window_projectors``; None elsewhere).
  Weights of another optimizer are dense leaves, sent whole every step;
  LoRA weights send their adapters every step, the frozen rest in full
  messages, and so do weights the optimizer leaves as they are
  (:func:`frozen_keys`, None projectors here)."""
  if sketch_grad.project_state(opt_state) is None:
    projectors = jax.tree.map(lambda _: None, weights, is_leaf=is_structured)
  else:
    projectors = all_projectors(
        state_queries.window_projectors(opt_state), weights
    )
  return {"weights": weights, "projectors": projectors}


def all_projectors(projectors: Any, weights: Any) -> Any:
  """``projectors`` of what the optimizer moves (:func:`trainable`)
  completed with None for the weights it leaves as they are: a tree shaped
  like ``weights``."""
  none = jax.tree.map(lambda _: None, weights, is_leaf=is_structured)
  return with_frozen(projectors, none)


def projector_source(opt_state: optax.OptState) -> Optional[Callable]:
  """For ``kind="random"`` projectors: a jitted ``window -> projectors``
  (``state_queries.random_projectors``) that regenerates any window's
  projectors from the seed, given to a :class:`~logra_jax.sync.PolicyReceiver`
  so that refresh messages need not carry them; None for other optimizers
  and projector kinds. Reads only the state's static spec: an abstract
  state (``jax.eval_shape`` of ``tx.init``, :func:`abstract_opt_state`)
  serves."""
  project = sketch_grad.project_state(opt_state)
  if project is None or project.spec.config.kind != "random":
    return None
  return jax.jit(
      functools.partial(state_queries.random_projectors, project.spec)
  )


def is_structured(x) -> bool:
  return factored_lib.is_factored(x) or lora_lib.is_lora(x)
