"""The planner: the real train step compiled on abstract inputs.

:func:`plan_memory` builds the learner's actual train step for a model, mesh
and optimizer on abstract inputs (``jax.ShapeDtypeStruct``: no weight is
ever allocated), compiles it with the run's shardings, and reads XLA's
compiled memory analysis, which is exact for that program on the compiling
backend (:mod:`logra_jax.memory.compiling`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import configs
from logra_jax import models
from logra_jax import parallel
from logra_jax import policy_state
from logra_jax.memory.compiling import compiled_memory, ensure_devices
from logra_jax.memory.presets import load_model_config
from logra_jax.memory import arguments
from logra_jax.memory import report
from logra_jax.memory.report import GIB, MemoryReport
from logra_jax.optim import sketch_grad
from logra_jax.rl import algo
from logra_jax.rl import learner


def _sharded_bytes(tree: Any, shardings: Any) -> int:
  """Bytes one device holds of ``tree`` laid out as ``shardings``."""
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    shape = sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def rollout_reservation(
    config: models.DecoderConfig,
    mesh: parallel.MeshConfig,
    seqs: int,
    tokens: int,
) -> int:
  r"""Per-device bytes of a colocated rollout engine.

  Its bfloat16 weights laid out like the params (split over ``fsdp`` and
  ``tp``, whole on each ``dp`` replica) and its bfloat16 KV cache,
  :math:`2 \cdot L \cdot K \cdot h \cdot 2\,\mathrm{B}` per token, as the
  sampler lays it out (``models.init_cache``): sequences over the data axes
  (padded up to a multiple of them), key/value heads over ``tp`` where
  ``tp`` divides them.

  Args:
    config: the decoder.
    mesh: the mesh.
    seqs: sequences in the cache (0: the weights alone).
    tokens: slots per sequence.

  Example:
    >>> config = models.DecoderConfig.tiny()
    >>> one = parallel.MeshConfig()
    >>> rollout_reservation(config, one, 1, 8) - rollout_reservation(
    ...     config, one, 0, 8)  # 2 (k, v) x 2 layers x 2 heads x 8 x 16 x 2 B
    2048
  """
  device_mesh = parallel.make_mesh(mesh, ensure_devices(mesh.size))
  _, params = models.split_model(
      nnx.eval_shape(lambda: models.init_model(config, rngs=0))
  )
  weights = jax.tree.map(
      lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16), params
  )
  data = mesh.dp * mesh.fsdp
  shape = (
      config.num_layers,
      -(-seqs // data) * data,
      config.num_kv_heads,
      tokens,
      config.head_dim,
  )
  layout = parallel.logical_to_mesh(
      (None, "batch", "cache_kv_heads", None, None), device_mesh, shape=shape
  )
  cache = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  return _sharded_bytes(
      weights, parallel.param_shardings(params, device_mesh)
  ) + 2 * _sharded_bytes(cache, layout)


def shared_rollout_bytes(
    layout: "_Layout",
    config: models.DecoderConfig,
    device_mesh: jax.sharding.Mesh,
    seqs: int,
    tokens: int,
    prompt: Optional[int] = None,
) -> int:
  """Per-device bytes of a colocated engine that samples with the learner's
  own arrays (``rollout.max_staleness=0``): the sampling program's
  temporaries (the KV cache among them) and outputs, compiled on abstract
  inputs from the learner's weights and optimizer state as they are laid
  out, with a prompt of ``prompt`` (default ``tokens // 4``) and the rest of
  ``tokens`` new tokens per sequence. The weights themselves are the
  learner's (counted once, in ``params``)."""
  sampler = models.Sampler(
      nnx.eval_shape(lambda: models.init_model(config, rngs=0)),
      max_length=tokens,
      mesh=device_mesh,
  )
  prompt = max(tokens // 4, 1) if prompt is None else prompt
  settings = models.SamplingParams(max_new_tokens=tokens - prompt)
  data = parallel.logical_to_mesh(("batch", None), device_mesh)
  replicated = parallel.logical_to_mesh((), device_mesh)
  rows = -(-seqs // device_mesh.size) * device_mesh.size

  def program(weights, state, ids, mask, stop_ids, key):
    with parallel.activation_sharding(device_mesh, parallel.PARTITION_RULES):
      view = policy_state.model_view(weights, state)
      return sampler.generate(view, ids, mask, stop_ids, key, settings)

  lowered = jax.jit(
      program,
      in_shardings=(
          layout.weights_sharding,
          layout.state_sharding,
          data,
          data,
          replicated,
          replicated,
      ),
  ).lower(
      layout.weights,
      layout.state,
      jax.ShapeDtypeStruct((rows, prompt), jnp.int32),
      jax.ShapeDtypeStruct((rows, prompt), jnp.bool_),
      jax.ShapeDtypeStruct((8,), jnp.int32),
      jax.eval_shape(lambda: jax.random.key(0)),
  )
  stats = compiled_memory(lowered, device_mesh.devices.flat[0].platform)
  return stats.temp_size_in_bytes + stats.output_size_in_bytes


def _sketched_gradient_bytes(state: Any, params_sharding: Any) -> int:
  """Per-device bytes of a sketch-direct gradient: float32 sketches of the
  projected leaves (counted whole: they are small and not sharded) plus the
  dense leaves' gradients laid out like their params."""
  spec = sketch_grad.project_state(state).spec
  total = 0
  for plan, sharding in zip(
      spec.plans, spec.treedef.flatten_up_to(params_sharding)
  ):
    shape = (
        plan.sketch_shape
        if plan.projected
        else sharding.shard_shape(plan.shape)
    )
    total += math.prod(shape) * 4
  return total


class _Layout(NamedTuple):
  """A plan's abstract train state and its shardings."""

  graphdef: Any
  params: Any
  params_sharding: Any
  tx: Any
  weights: Any
  weights_sharding: Any
  state: Any
  state_sharding: Any


def _layout(
    config: models.DecoderConfig,
    opt_config: configs.OptimizerConfig,
    device_mesh: jax.sharding.Mesh,
) -> _Layout:
  """The abstract weights and optimizer state of ``config`` under
  ``opt_config``, laid out on ``device_mesh`` as a run lays them out."""
  graphdef, params = models.split_model(
      nnx.eval_shape(lambda: models.init_model(config, rngs=0))
  )
  params_sharding = parallel.param_shardings(params, device_mesh)
  tx = policy_state.make_optimizer(opt_config, params)
  state = policy_state.abstract_opt_state(opt_config, tx, params)
  weights = policy_state.abstract_weights(opt_config, tx, params)
  weights_sharding = parallel.weight_shardings(
      weights, params_sharding, device_mesh
  )
  state_sharding = parallel.optimizer_state_shardings(
      tx,
      policy_state.optimized(opt_config, weights, params),
      policy_state.optimized(opt_config, weights_sharding, params_sharding),
      device_mesh,
  )
  return _Layout(
      graphdef,
      params,
      params_sharding,
      tx,
      weights,
      weights_sharding,
      state,
      state_sharding,
  )


def _abstract_batch(
    rows: int,
    prompt_len: int,
    completion_len: int,
    reference_dtype: Optional[str],
) -> algo.RolloutBatch:
  """A rollout batch of ``rows`` sequences, as shapes and dtypes."""
  sds = jax.ShapeDtypeStruct
  return algo.RolloutBatch(
      prompt_tokens_BxP=sds((rows, prompt_len), jnp.int32),
      prompt_mask_BxP=sds((rows, prompt_len), jnp.int32),
      completion_tokens_BxT=sds((rows, completion_len), jnp.int32),
      completion_mask_BxT=sds((rows, completion_len), jnp.int32),
      old_logp_BxT=sds((rows, completion_len), jnp.float32),
      advantages_B=sds((rows,), jnp.float32),
      num_generations=rows,
      ref_logp_BxT=(
          None
          if reference_dtype is None
          else sds((rows, completion_len), jnp.float32)
      ),
  )


def _step_memory(
    layout: _Layout,
    run_config: configs.TrainConfig,
    batch: algo.RolloutBatch,
    batch_sharding: Any,
    reference_dtype: Optional[str],
    device_mesh: jax.sharding.Mesh,
) -> Any:
  """XLA's memory analysis of the learner's train step on ``batch`` (the
  optimizer and micro-batches of ``run_config``)."""
  run_config = dataclasses.replace(
      run_config,
      loss=dataclasses.replace(
          run_config.loss, beta=0.0 if reference_dtype is None else 0.04
      ),
  )
  step = learner.make_train_step(
      layout.graphdef,
      layout.tx,
      run_config,
      shardings=(
          layout.weights_sharding,
          layout.state_sharding,
          batch_sharding,
      ),
      activation_rules=parallel.PARTITION_RULES,
  )
  return compiled_memory(
      step.lower(layout.weights, layout.state, batch),
      device_mesh.devices.flat[0].platform,
  )


def _gradient_bytes(
    layout: _Layout, opt_config: configs.OptimizerConfig
) -> int:
  """Per-device bytes of the gradient the step materializes."""
  if opt_config.name == "logra" and opt_config.gradient_mode == "sketch":
    return _sketched_gradient_bytes(
        layout.state,
        policy_state.trainable(layout.params_sharding, opt_config),
    )
  # What the optimizer moves: the params but frozen ones, or the adapters.
  return _sharded_bytes(
      policy_state.optimized(opt_config, layout.weights, layout.params),
      policy_state.optimized(
          opt_config, layout.weights_sharding, layout.params_sharding
      ),
  )


def _reference_bytes(layout: _Layout, reference_dtype: Optional[str]) -> int:
  """Per-device bytes of a frozen reference policy laid out like the
  params (0: none)."""
  if reference_dtype is None:
    return 0
  return _sharded_bytes(
      jax.tree.map(
          lambda p: jax.ShapeDtypeStruct(p.shape, reference_dtype),
          layout.params,
      ),
      layout.params_sharding,
  )


def _plan_config(
    model: str | models.DecoderConfig, remat: str, seq_len: int
) -> models.DecoderConfig:
  """The decoder planned: float32 weights computed in bfloat16, positions
  for ``seq_len`` tokens."""
  config = (
      model
      if isinstance(model, models.DecoderConfig)
      else load_model_config(model)
  )
  return dataclasses.replace(
      config,
      remat=remat,
      dtype="bfloat16",
      param_dtype="float32",
      max_position_embeddings=max(config.max_position_embeddings, seq_len),
  )


def _rollout_bytes(
    layout: _Layout,
    config: models.DecoderConfig,
    mesh: parallel.MeshConfig,
    device_mesh: jax.sharding.Mesh,
    rollout: tuple[int, int, int],
    copy: bool,
) -> int:
  """The rollout reservation of :func:`plan_memory` (its arguments
  ``rollout_seqs``, ``rollout_tokens``, ``rollout_turn_tokens`` and
  ``rollout_copy``)."""
  seqs, tokens, turn = rollout
  if not seqs:
    return 0
  if copy:
    return rollout_reservation(config, mesh, seqs, tokens)
  single = shared_rollout_bytes(layout, config, device_mesh, seqs, tokens)
  if not turn:
    return single
  # The last turn of an episode, after the longest history.
  history = tokens - turn
  return max(
      single,
      shared_rollout_bytes(layout, config, device_mesh, seqs, tokens, history),
  )


def _total(
    stats: Any,
    batch: int,
    outputs: int,
    reference: int,
    rollout: int,
    between: bool,
) -> int:
  """The plan's peak bytes (:class:`MemoryReport`): the resident state and
  the reference, plus the step's phase (its batch, temporaries and outputs)
  and the rollout's reservation: the larger of the two with a rollout
  ``between`` steps, else their sum."""
  step = batch + stats.temp_size_in_bytes + outputs
  resident = stats.argument_size_in_bytes - batch
  return resident + reference + report.peak_of_phases(step, rollout, between)


def plan_memory(
    model: str | models.DecoderConfig,
    mesh: parallel.MeshConfig = parallel.MeshConfig(),
    optimizer: str = "logra",
    rank: int = 64,
    seq_len: int = 4096,
    micro_batch: int = 1,
    micro_batches: int = 1,
    remat: str = "block",
    prompt_len: Optional[int] = None,
    rollout_seqs: int = 0,
    rollout_tokens: int = 0,
    device_memory_gib: Optional[float] = None,
    gradient_mode: str = "sketch",
    project_embeddings: bool = False,
    freeze_embeddings: bool = False,
    reference_dtype: Optional[str] = None,
    base_dtype: str = "float32",
    coords_dtype: str = "float32",
    step_bits: Optional[int] = None,
    rollout_copy: bool = False,
    rollout_turn_tokens: int = 0,
    compile_for: Optional[str] = None,
    target_kl: Optional[float] = None,
    kl_subsample: Optional[int] = None,
) -> MemoryReport:
  r"""Compiles the train step on abstract inputs and reports memory per device.

  Args:
    model: a preset name (:data:`~logra_jax.memory.MODEL_PRESETS`), a local ``config.json``,
      or a ``DecoderConfig``.
    mesh: the mesh; its size is the number of devices.
    optimizer: ``"adam"`` (dense AdamW: float32 moments), ``"logra"`` or
      ``"lora"`` (AdamW on adapters of every projection matrix, the rest
      frozen: ``params`` counts the frozen weights and the adapters,
      ``grads`` and the state the adapters' alone).
    rank: LoGRA's projection rank; LoRA's adapter rank.
    seq_len: tokens per sequence (prompt and completion).
    micro_batch: sequences per data-parallel device in a micro-batch.
    micro_batches: gradient-accumulation chunks per update (``micro_batches``
      of a run): the step takes ``micro_batch x micro_batches`` sequences
      per data-parallel device, one micro-batch at a time.
    remat: ``policy.remat`` (``DecoderConfig.remat``): ``"block"``
      (recompute each block), ``"dots_saveable"`` (keep the weight
      projections' outputs) or ``"none"``.
    prompt_len: prompt part of ``seq_len``; default ``seq_len // 4``.
    rollout_seqs: sequences of a colocated rollout engine's KV cache.
    rollout_tokens: tokens per rollout sequence.
    rollout_copy: the colocated engine holds its own copy of the weights
      (``rollout.max_staleness > 0``): :func:`rollout_reservation`.
      Otherwise (the default engine) it samples with the learner's arrays:
      :func:`shared_rollout_bytes`.
    rollout_turn_tokens: multi-turn episodes: the tokens of one model turn
      (``rollout.max_new_tokens``), ``rollout_tokens`` being the prompt and
      the episode's tokens (``rollout.max_episode_tokens``). A later turn's
      sampling program prefills the episode's history, up to
      ``rollout_tokens - rollout_turn_tokens`` tokens, so the shared
      engine's reservation is the larger of that program's and the
      single-turn one's; 0: single-turn rollouts.
    device_memory_gib: the device memory to check the total against.
    gradient_mode: LoGRA's gradients: ``"sketch"`` (sketch-direct, the
      default: ``grads`` counts the float32 sketches ``[L, r, short]``, which
      are not sharded, and the dense leaves' gradients) or ``"dense"`` (a full
      float32 gradient laid out like the params, then projected). Adam always
      takes dense gradients.
    project_embeddings: LoGRA also projects the embedding table and LM head
      (their gradients and moments become low-rank too).
    freeze_embeddings: the embedding table and LM head stay as they are
      (``optimizer.freeze_embeddings``): no gradient and no optimizer state
      of theirs (logra, galore, adam).
    reference_dtype: hold a frozen reference policy in this dtype
      (``"bfloat16"`` or ``"float32"``), as a run with ``loss.beta > 0``
      does: its weights, laid out like the params, stay resident, and the
      batch carries its log-probabilities. Its forward pass runs in a
      program of its own, before the step, with fewer temporaries than the
      step. None: no reference (``loss.beta = 0``).
    base_dtype: LoGRA with sketch-direct gradients keeps each projected
      weight factored, ``W = c B + P A``: the dtype of ``B`` (``"float32"``
      or ``"bfloat16"``); ``params`` counts ``B``, ``A`` and ``c``. LoRA:
      the dtype of the frozen weights under the adapters.
    coords_dtype: the dtype of the factored weights' window coordinates
      ``A`` (``"float32"`` or ``"bfloat16"``: ``optimizer.coords_dtype``,
      which needs the factored policy).
    step_bits: ``optimizer.step_bits`` (4 or 8; None: steps in float32):
      the optimizer state then holds each projected weight's rounding
      residual (float32, ``A``'s shape) and last step's codes.
    compile_for: compile for this GPU without it (``"h200"``:
      :data:`~logra_jax.memory.targets.GPU_TARGETS`); default: the devices
      here (:func:`~logra_jax.memory.compiling.ensure_devices`).
    target_kl: predicted-KL step control (``optimizer.target_kl``): the
      step also runs the KL predictor, a forward pass and its JVP over the
      batch, whose temporaries (the unembedding formed once, chunks of
      logits and their tangents) count in the plan; None: no KL control.
    kl_subsample: the sequences of the batch the KL is predicted on
      (``optimizer.kl_subsample``, with ``target_kl`` only: at most the
      batch's ``micro_batch x micro_batches x dp x fsdp``, a multiple of
      ``dp x fsdp``); None: all of them (the whole batch, every
      micro-batch, as a run predicts it).

  Returns:
    A :class:`MemoryReport`; the rollout reservation is
    :func:`shared_rollout_bytes` (the sampling program's temporaries and
    outputs, the KV cache among them) or, with ``rollout_copy``,
    :func:`rollout_reservation` (bfloat16 inference weights laid out like the
    params plus the KV cache as the sampler lays it out).

  Example:
    >>> report = plan_memory(models.DecoderConfig.tiny(), seq_len=64)
    >>> report.total > report.params > 0
    True
  """
  rollout_sizes = (rollout_seqs, rollout_tokens, rollout_turn_tokens)
  prompt_len = seq_len // 4 if prompt_len is None else prompt_len
  arguments.check(
      optimizer,
      remat,
      {
          "rank": rank,
          "seq_len": seq_len,
          "prompt_len": prompt_len,
          "micro_batch": micro_batch,
          "micro_batches": micro_batches,
      },
      rollout_sizes,
      reference_dtype,
  )
  opt_config = configs.OptimizerConfig(
      name=optimizer,
      rank=rank,
      warmup_steps=0,
      gradient_mode=gradient_mode,
      project_embeddings=project_embeddings,
      freeze_embeddings=freeze_embeddings,
      base_dtype=base_dtype,
      coords_dtype=coords_dtype,
      step_bits=step_bits,
      target_kl=target_kl,
      kl_subsample=kl_subsample,
  )
  rows = micro_batch * micro_batches * mesh.dp * mesh.fsdp
  run_config = arguments.run_config(opt_config, micro_batches, rows, mesh)
  config = _plan_config(model, remat, seq_len)
  device_mesh = parallel.make_mesh(mesh, ensure_devices(mesh.size, compile_for))
  layout = _layout(config, opt_config, device_mesh)
  batch = _abstract_batch(
      rows, prompt_len, seq_len - prompt_len, reference_dtype
  )
  batch_sharding = parallel.data_shardings(batch, device_mesh)
  stats = _step_memory(
      layout, run_config, batch, batch_sharding, reference_dtype, device_mesh
  )
  grads = _gradient_bytes(layout, opt_config)
  outputs = stats.output_size_in_bytes - stats.alias_size_in_bytes
  reference = _reference_bytes(layout, reference_dtype)
  rollout = _rollout_bytes(
      layout, config, mesh, device_mesh, rollout_sizes, rollout_copy
  )
  between = bool(rollout_seqs) and not rollout_copy
  batch_bytes = _sharded_bytes(batch, batch_sharding)
  num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(layout.params))
  return MemoryReport(
      params=_sharded_bytes(layout.weights, layout.weights_sharding),
      grads=grads,
      optimizer_state=_sharded_bytes(layout.state, layout.state_sharding),
      batch=batch_bytes,
      temporaries=stats.temp_size_in_bytes - grads,
      outputs=outputs,
      reference=reference,
      rollout=rollout,
      total=_total(stats, batch_bytes, outputs, reference, rollout, between),
      device_memory=(
          None if device_memory_gib is None else int(device_memory_gib * GIB)
      ),
      num_params=int(num_params),
      description=report.describe(
          model if isinstance(model, str) else "custom",
          num_params,
          mesh,
          opt_config,
          reference_dtype,
          report.workload(
              seq_len,
              (micro_batch, micro_batches),
              remat,
              rollout_sizes,
              rollout_copy,
          ),
      ),
      rollout_between_steps=between,
      compiled_for=device_mesh.devices.flat[0].platform,
  )
