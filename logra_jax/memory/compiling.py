"""Compiling a program for a mesh, and XLA's account of its memory.

On a machine without the accelerators the planner compiles for as many CPU
devices as the mesh has (``jax_num_cpu_devices``), so a node can be planned
from a laptop; the figures are those of the CPU compilation of the same
program. Or it compiles for a described GPU (:mod:`~logra_jax.memory.targets`),
whose figures are XLA:GPU's.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import jax

from logra_jax.memory import targets
from logra_jax.reduction import backend_started

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
    >>> import jax.numpy as jnp
    >>> x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    >>> compiled_memory(jax.jit(jnp.sin).lower(x)).output_size_in_bytes
    128
  """
  on_cpu = (platform or jax.default_backend()) == "cpu"
  return lowered.compile(
      compiler_options=_CPU_PLAN_COMPILER_OPTIONS if on_cpu else None
  ).memory_analysis()


# Simulated CPU devices cost memory each: 100,000 of them took 4 GB.
MAX_DEVICES = 4096


def ensure_devices(
    count: int, compile_for: Optional[str] = None
) -> list[jax.Device]:
  """``count`` devices to compile for: compile-only devices of the GPU
  ``compile_for`` names (:data:`~logra_jax.memory.targets.GPU_TARGETS`:
  :func:`~logra_jax.memory.targets.gpu_devices`), else the accelerators if
  there are enough, else ``count`` CPU devices (configured before JAX's
  backend starts). With ``compile_for``, a process that has not started JAX
  yet starts it on the CPU alone (with ``count`` CPU devices, for a CPU
  plan of the same mesh): the plugin needs that without a GPU runtime, and
  such a process sees no GPU afterwards, so plan in a process of its own.

  Raises:
    ValueError: ``count`` CPU devices exceed :data:`MAX_DEVICES`, fewer
      devices exist and JAX's backend has already started, or the GPU cannot
      be compiled for.
  """
  started = backend_started()
  if compile_for:
    if not started:
      jax.config.update("jax_platforms", "cpu")
      _ensure_cpu_devices(min(count, MAX_DEVICES))
    return targets.gpu_devices(compile_for, count)
  if count > MAX_DEVICES:
    raise ValueError(
        f"the mesh has {count} devices; the planner compiles for at most "
        f"{MAX_DEVICES} (one simulated CPU device each)"
    )
  if not started:
    _ensure_cpu_devices(count)
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


def _ensure_cpu_devices(count: int) -> None:
  """At least ``count`` CPU devices once JAX starts (never fewer than
  ``XLA_FLAGS=--xla_force_host_platform_device_count`` asks for)."""
  current = jax.config.jax_num_cpu_devices
  if current < 0:
    flag = re.search(
        r"xla_force_host_platform_device_count=(\d+)",
        os.environ.get("XLA_FLAGS", ""),
    )
    current = int(flag.group(1)) if flag else 1
  if current < count:
    jax.config.update("jax_num_cpu_devices", count)
