"""Memory planner: per-device memory of the real train step, before renting.

The planner builds the learner's actual train step for a model, mesh and
optimizer on abstract inputs (``jax.ShapeDtypeStruct``: no weight is ever
allocated), compiles it with the run's shardings, and reads XLA's compiled
memory analysis, which is exact for that program on the compiling backend.
On a machine without the accelerators it compiles for as many CPU devices as
the mesh has (``jax_num_cpu_devices``), so a node can be planned from a
laptop; the figures are those of the CPU compilation of the same program.

Weights are stored in float32 (master weights, as RL frameworks keep them)
and computed in bfloat16, for every optimizer, so that optimizers are
compared on equal terms.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Optional

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import models
from logra_jax import parallel
from logra_jax.optim import sketch_grad
from logra_jax import configs
from logra_jax.rl import algo
from logra_jax.rl import learner
from logra_jax import policy_state

GIB = 2**30
OPTIMIZERS = ("adam", "logra", "lora")

# Published configs (config.json fields that set the parameter shapes).
_QWEN = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=32768,
)
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        _QWEN,
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        _QWEN,
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        _QWEN,
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "qwen2.5-14b": dict(
        _QWEN,
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen2.5-32b": dict(
        _QWEN,
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen3-8b": dict(
        _QWEN,
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
    "qwen3-32b": dict(
        _QWEN,
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
    # A 27B-parameter model of the Qwen3 architecture (GQA, q/k RMSNorm,
    # SwiGLU, untied head) at the width and depth of Gemma-3-27B: hidden 5376,
    # MLP 21504, 62 layers, 32 query / 16 kv heads of 128: 27.2B parameters.
    "qwen3-style-27b": dict(
        _QWEN,
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
}

# XLA:CPU computes bfloat16 dots in float32: it upcasts bfloat16 weights and
# hoists the converts out of the layer loop (loop-invariant code motion), so a
# CPU compile holds a float32 copy of every bfloat16 weight stack that an
# accelerator, whose dots take bfloat16 operands, never makes (Qwen2.5-7B
# shapes with 2 layers, embeddings projected, bfloat16 base: 7.8 GB of
# temporaries against 5.1 GB with a float32 base). Plans compiled on CPU skip
# that pass; plans of float32 weights (Adam, LoGRA with a float32 base) are
# the same with and without it.
_CPU_PLAN_COMPILER_OPTIONS = {
    "xla_disable_hlo_passes": "while-loop-invariant-code-motion"
}


def compiled_memory(
    lowered: jax.stages.Lowered, platform: Optional[str] = None
) -> Any:
  """XLA's memory analysis of ``lowered`` compiled as an accelerator would
  lay it out: on CPU without hoisting loop-invariant work (see above), so
  that a bfloat16 stack is not widened to a float32 copy before its loop.
  ``platform``: where it compiles (default: JAX's default backend).

  Example:
    >>> x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    >>> compiled_memory(jax.jit(jnp.sin).lower(x)).output_size_in_bytes
    128
  """
  on_cpu = (platform or jax.default_backend()) == "cpu"
  return lowered.compile(
      compiler_options=_CPU_PLAN_COMPILER_OPTIONS if on_cpu else None
  ).memory_analysis()


def load_model_config(model: str) -> models.DecoderConfig:
  """A decoder config from a preset name or a local HF ``config.json``.

  Raises:
    ValueError: unknown preset (listing the valid ones), a missing file, or
      an unsupported architecture.
  """
  import transformers

  if model in MODEL_PRESETS:
    fields = dict(MODEL_PRESETS[model])
  else:
    path = pathlib.Path(model)
    if path.is_dir():
      path = path / "config.json"
    if not path.suffix == ".json":
      raise ValueError(
          f"unknown model {model!r}: not one of "
          f"{sorted(MODEL_PRESETS)} nor a config.json path"
      )
    if not path.is_file():
      raise ValueError(f"model config file {str(path)!r} does not exist")
    fields = json.loads(path.read_text())
  model_type = fields.pop("model_type", None)
  if model_type not in models.config.HF_ARCHITECTURES:
    raise ValueError(
        f"unsupported model_type {model_type!r} in {model!r}; supported: "
        f"{sorted(models.config.HF_ARCHITECTURES)}"
    )
  hf_config = transformers.AutoConfig.for_model(model_type, **fields)
  return models.DecoderConfig.from_hf(hf_config)


def ensure_devices(count: int) -> list[jax.Device]:
  """``count`` devices to compile for: the accelerators if there are enough,
  else ``count`` CPU devices (configured before JAX's backend starts)."""
  try:
    backend_started = bool(jax._src.xla_bridge._backends)  # noqa: SLF001
  except AttributeError:
    backend_started = True
  if not backend_started and jax.config.jax_num_cpu_devices < count:
    jax.config.update("jax_num_cpu_devices", count)
  devices = jax.devices()
  if len(devices) < count:
    devices = jax.devices("cpu")
  if len(devices) < count:
    raise ValueError(
        f"the mesh needs {count} devices but only {len(devices)} exist; plan "
        f"in a fresh process (`logra memory` does this), or set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={count}"
    )
  return devices[:count]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Per-device bytes of one train step (and an optional rollout reservation).

  ``params`` and ``optimizer_state`` are the step's resident inputs;
  ``grads`` the gradient it materializes (full, or the sketches in
  sketch-direct mode); ``temporaries`` everything
  else XLA allocates during the step (activations, workspace);
  ``reference`` the frozen reference policy's weights of a KL penalty, so
  that ``total = params + optimizer_state + batch + grads + temporaries +
  outputs not aliased to inputs + reference + rollout``.
  """

  params: int
  grads: int
  optimizer_state: int
  batch: int
  temporaries: int
  outputs: int
  reference: int
  rollout: int
  total: int
  device_memory: Optional[int]
  num_params: int
  description: str

  @property
  def fits(self) -> Optional[bool]:
    return (
        None
        if self.device_memory is None
        else (self.total <= self.device_memory)
    )

  def to_dict(self) -> dict[str, Any]:
    return {
        "params": self.params,
        "grads": self.grads,
        "optimizer_state": self.optimizer_state,
        "temporaries": self.temporaries,
        "reference": self.reference,
        "rollout": self.rollout,
        "total": self.total,
        "fits": self.fits,
        "batch": self.batch,
        "outputs": self.outputs,
        "device_memory": self.device_memory,
        "num_params": self.num_params,
        "description": self.description,
    }

  def summary(self) -> str:
    rows = [
        ("parameters", self.params),
        ("gradients", self.grads),
        ("optimizer state", self.optimizer_state),
        ("batch", self.batch),
        ("temporaries", self.temporaries),
        ("outputs (not aliased)", self.outputs),
        ("reference policy", self.reference),
        ("rollout reservation", self.rollout),
        ("total", self.total),
    ]
    lines = [self.description, "per device:"]
    lines += [f"  {name:<22} {value / GIB:9.2f} GiB" for name, value in rows]
    if self.device_memory is not None:
      margin = (self.device_memory - self.total) / GIB
      lines.append(
          f"fits in {self.device_memory / GIB:.0f} GiB: "
          + (
              f"yes ({margin:.2f} GiB free)"
              if self.fits
              else f"NO, over by {-margin:.2f} GiB"
          )
      )
    return "\n".join(lines)


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


def _sketched_gradient_bytes(
    state: Any, params: Any, params_sharding: Any
) -> int:
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


def plan_memory(
    model: str | models.DecoderConfig,
    mesh: parallel.MeshConfig = parallel.MeshConfig(),
    optimizer: str = "logra",
    rank: int = 64,
    seq_len: int = 4096,
    micro_batch: int = 1,
    remat: str = "block",
    prompt_len: Optional[int] = None,
    rollout_seqs: int = 0,
    rollout_tokens: int = 0,
    device_memory_gib: Optional[float] = None,
    gradient_mode: str = "sketch",
    project_embeddings: bool = False,
    reference_dtype: Optional[str] = None,
    base_dtype: str = "float32",
) -> MemoryReport:
  r"""Compiles the train step on abstract inputs and reports memory per device.

  Args:
    model: a preset name (:data:`MODEL_PRESETS`), a local ``config.json``,
      or a ``DecoderConfig``.
    mesh: the mesh; its size is the number of devices.
    optimizer: ``"adam"`` (dense AdamW: float32 moments), ``"logra"`` or
      ``"lora"`` (AdamW on adapters of every projection matrix, the rest
      frozen: ``params`` counts the frozen weights and the adapters,
      ``grads`` and the state the adapters' alone).
    rank: LoGRA's projection rank; LoRA's adapter rank.
    seq_len: tokens per sequence (prompt and completion).
    micro_batch: sequences per data-parallel device per step.
    remat: ``policy.remat`` (``DecoderConfig.remat``): ``"block"``
      (recompute each block), ``"dots_saveable"`` (keep the weight
      projections' outputs) or ``"none"``.
    prompt_len: prompt part of ``seq_len``; default ``seq_len // 4``.
    rollout_seqs: sequences of a colocated rollout engine's KV cache.
    rollout_tokens: tokens per rollout sequence.
    device_memory_gib: the device memory to check the total against.
    gradient_mode: LoGRA's gradients: ``"sketch"`` (sketch-direct, the
      default: ``grads`` counts the float32 sketches ``[L, r, short]``, which
      are not sharded, and the dense leaves' gradients) or ``"dense"`` (a full
      float32 gradient laid out like the params, then projected). Adam always
      takes dense gradients.
    project_embeddings: LoGRA also projects the embedding table and LM head
      (their gradients and moments become low-rank too).
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

  Returns:
    A :class:`MemoryReport`; the rollout reservation is
    :func:`rollout_reservation`: bfloat16 inference weights laid out like
    the params plus the KV cache as the sampler lays it out.

  Example:
    >>> report = plan_memory(models.DecoderConfig.tiny(), seq_len=64)
    >>> report.total > report.params > 0
    True
  """
  if optimizer not in OPTIMIZERS:
    raise ValueError(
        f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}"
    )
  sketch = optimizer == "logra" and gradient_mode == "sketch"
  if remat not in models.REMAT:
    raise ValueError(f"remat must be one of {models.REMAT}, got {remat!r}")
  for name, value in (
      ("rank", rank),
      ("seq_len", seq_len),
      ("micro_batch", micro_batch),
  ):
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
  if rollout_seqs < 0 or rollout_tokens < 0:
    raise ValueError("rollout_seqs and rollout_tokens must be >= 0")
  if reference_dtype not in (None, "bfloat16", "float32"):
    raise ValueError(
        f"reference_dtype must be 'bfloat16' or 'float32', got "
        f"{reference_dtype!r}"
    )
  prompt_len = seq_len // 4 if prompt_len is None else prompt_len
  if not 1 <= prompt_len < seq_len:
    raise ValueError(f"prompt_len must be in [1, seq_len), got {prompt_len}")
  opt_config = configs.OptimizerConfig(
      name=optimizer,
      rank=rank,
      warmup_steps=0,
      gradient_mode=gradient_mode,
      project_embeddings=project_embeddings,
      base_dtype=base_dtype,
  )
  config = (
      model
      if isinstance(model, models.DecoderConfig)
      else (load_model_config(model))
  )
  name = model if isinstance(model, str) else "custom"
  config = dataclasses.replace(
      config,
      remat=remat,
      dtype="bfloat16",
      param_dtype="float32",
      max_position_embeddings=max(config.max_position_embeddings, seq_len),
  )
  device_mesh = parallel.make_mesh(mesh, ensure_devices(mesh.size))
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
      policy_state.optimized(weights, params),
      policy_state.optimized(weights_sharding, params_sharding),
      device_mesh,
  )

  rows = micro_batch * mesh.dp * mesh.fsdp
  completion_len = seq_len - prompt_len
  sds = jax.ShapeDtypeStruct
  batch = algo.RolloutBatch(
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
  batch_sharding = parallel.data_shardings(batch, device_mesh)
  run_config = dataclasses.replace(
      configs.TrainConfig(),
      optimizer=opt_config,
      micro_batches=1,
      loss=dataclasses.replace(
          configs.TrainConfig().loss,
          beta=0.0 if reference_dtype is None else 0.04,
      ),
  )
  step = learner.make_train_step(
      graphdef,
      tx,
      run_config,
      shardings=(weights_sharding, state_sharding, batch_sharding),
      activation_rules=parallel.PARTITION_RULES,
  )
  stats = compiled_memory(
      step.lower(weights, state, batch), device_mesh.devices.flat[0].platform
  )

  params_bytes = _sharded_bytes(weights, weights_sharding)
  if sketch:
    grads_bytes = _sketched_gradient_bytes(state, params, params_sharding)
  elif optimizer == "lora":  # float32 adapters' gradients
    grads_bytes = _sharded_bytes(
        policy_state.optimized(weights, params),
        policy_state.optimized(weights_sharding, params_sharding),
    )
  else:
    grads_bytes = params_bytes
  state_bytes = _sharded_bytes(state, state_sharding)
  batch_bytes = _sharded_bytes(batch, batch_sharding)
  outputs = stats.output_size_in_bytes - stats.alias_size_in_bytes
  temporaries = stats.temp_size_in_bytes - grads_bytes
  num_params = int(sum(math.prod(p.shape) for p in jax.tree.leaves(params)))
  reference = (
      0
      if reference_dtype is None
      else _sharded_bytes(
          jax.tree.map(lambda p: sds(p.shape, reference_dtype), params),
          params_sharding,
      )
  )
  rollout = (
      rollout_reservation(config, mesh, rollout_seqs, rollout_tokens)
      if rollout_seqs
      else 0
  )
  total = (
      stats.argument_size_in_bytes
      + outputs
      + stats.temp_size_in_bytes
      + reference
      + rollout
  )
  description = (
      f"{name} ({num_params / 1e9:.2f}B params), mesh {mesh}, {optimizer}"
      + (
          f" rank {rank}, {gradient_mode} gradients"
          if optimizer == "logra"
          else f" rank {rank}"
          if optimizer == "lora"
          else ""
      )
      + (", embeddings projected" if project_embeddings else "")
      + (f", {base_dtype} base" if base_dtype != "float32" else "")
      + (f", {reference_dtype} reference policy" if reference_dtype else "")
      + f", seq {seq_len}, micro-batch {micro_batch}/device, remat {remat}"
      + (
          f", rollout {rollout_seqs}x{rollout_tokens} tokens"
          if rollout_seqs
          else ""
      )
  )
  return MemoryReport(
      params=params_bytes,
      grads=grads_bytes,
      optimizer_state=state_bytes,
      batch=batch_bytes,
      temporaries=temporaries,
      outputs=outputs,
      reference=reference,
      rollout=rollout,
      total=total,
      device_memory=(
          None if device_memory_gib is None else int(device_memory_gib * GIB)
      ),
      num_params=num_params,
      description=description,
  )
