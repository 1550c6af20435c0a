"""Memory planner: per-device memory of the real train step, before renting.

The planner (:func:`plan_memory`) builds the learner's actual train step for
a model, mesh and optimizer on abstract inputs (``jax.ShapeDtypeStruct``: no
weight is ever allocated), compiles it with the run's shardings, and reads
XLA's compiled memory analysis, which is exact for that program on the
compiling backend. On a machine without the accelerators it compiles for as
many CPU devices as the mesh has (``jax_num_cpu_devices``), so a node can be
planned from a laptop; the figures are those of the CPU compilation of the
same program.

Weights are stored in float32 (master weights, as RL frameworks keep them)
and computed in bfloat16, for every optimizer, so that optimizers are
compared on equal terms. Its parts:

- :mod:`~logra_jax.memory.planner`: :func:`plan_memory` and
  :func:`rollout_reservation`;
- :mod:`~logra_jax.memory.presets`: published model configs
  (:data:`MODEL_PRESETS`) and :func:`load_model_config`;
- :mod:`~logra_jax.memory.compiling`: :func:`ensure_devices` and
  :func:`compiled_memory`;
- :mod:`~logra_jax.memory.report`: the :class:`MemoryReport`;
- :mod:`~logra_jax.memory.targets`: GPUs to compile for without one
  (:data:`GPU_TARGETS`).

Example:
  >>> from logra_jax import memory
  >>> sorted(memory.MODEL_PRESETS)[:2]
  ['qwen2.5-0.5b', 'qwen2.5-1.5b']
  >>> memory.load_model_config("qwen3-8b").qk_norm
  True
"""

from logra_jax.memory.compiling import compiled_memory, ensure_devices
from logra_jax.memory.arguments import OPTIMIZERS
from logra_jax.memory.planner import plan_memory, rollout_reservation
from logra_jax.memory.presets import MODEL_PRESETS, load_model_config
from logra_jax.memory.report import GIB, MemoryReport
from logra_jax.memory.targets import GPU_TARGETS

__all__ = [
    "GIB",
    "GPU_TARGETS",
    "MODEL_PRESETS",
    "OPTIMIZERS",
    "MemoryReport",
    "compiled_memory",
    "ensure_devices",
    "load_model_config",
    "plan_memory",
    "rollout_reservation",
]
