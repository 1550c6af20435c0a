"""Compiling for a GPU without one: XLA:GPU's own memory layout from a laptop.

A plan compiled for CPU devices can fall short of what the same program
takes on a GPU (XLA:GPU lays out buffers, fuses and copies differently:
docs/planner.md). JAX compiles for a described GPU without the device
(``jax.experimental.topologies`` with a ``GpuTargetConfig``), given JAX's
CUDA plugin installed without its CUDA libraries::

  pip install --no-deps jax-cuda12-plugin==$V jax-cuda12-pjrt==$V

(``$V`` the installed jaxlib's version). The descriptions below are the
published figures of each part; memory layout depends on the compute
capability and the device memory, the rest steers only cost models.
"""

from __future__ import annotations

import importlib.util

import jax
from jax.experimental import topologies
import jaxlib

_MIB = 2**20
# name: (compute capability, SMs, memory bytes as the driver reports them,
# memory bandwidth B/s, L2 bytes, boost clock GHz, FP32 lanes per SM, shared
# memory per SM, shared memory per block opt-in).
_GPUS = {
    "a100-80gb": (
        (8, 0), 108, 81920 * _MIB, 2.039e12, 40 * _MIB, 1.41, 64, 167936,
        166912,
    ),
    "h100": (
        (9, 0), 132, 81559 * _MIB, 3.35e12, 50 * _MIB, 1.98, 128, 233472,
        232448,
    ),
    "h200": (
        (9, 0), 132, 143771 * _MIB, 4.8e12, 50 * _MIB, 1.98, 128, 233472,
        232448,
    ),
}  # fmt: skip
GPU_TARGETS = tuple(sorted(_GPUS))


def target_config(name: str) -> str:
  """The ``GpuTargetConfig`` text of GPU ``name`` (one of
  :data:`GPU_TARGETS`).

  Example:
    >>> 'device_description_str: "h200"' in target_config("h200")
    True
  """
  if name not in _GPUS:
    raise ValueError(
        f"unknown GPU {name!r} to compile for; known: {', '.join(GPU_TARGETS)}"
    )
  capability, sms, memory, bandwidth, l2, clock, lanes, shared, optin = _GPUS[
      name
  ]
  info = {
      "threads_per_block_limit": 1024,
      "threads_per_warp": 32,
      "shared_memory_per_block": 49152,
      "shared_memory_per_core": shared,
      "threads_per_core_limit": 2048,
      "core_count": sms,
      "fpus_per_core": lanes,
      "block_dim_limit_x": 2**31 - 1,
      "block_dim_limit_y": 65535,
      "block_dim_limit_z": 65535,
      "memory_bandwidth": int(bandwidth),
      "l2_cache_size": l2,
      "clock_rate_ghz": clock,
      "device_memory_size": memory,
      "shared_memory_per_block_optin": optin,
      "registers_per_core_limit": 65536,
      "registers_per_block_limit": 65536,
  }
  fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
  major, minor = capability
  return (
      f"gpu_device_info {{\n{fields}\n"
      f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
      'platform_name: "CUDA"\n'
      "dnn_version_info { major: 9 }\n"
      f'device_description_str: "{name}"\n'
  )


def gpu_devices(name: str, count: int) -> list[jax.Device]:
  """``count`` compile-only devices of GPU ``name`` on one host. JAX's CUDA
  plugin starts without a GPU runtime only where JAX started on the CPU
  alone (``compiling.ensure_devices`` sees to it in a process that has not
  started JAX yet).

  Raises:
    ValueError: an unknown GPU, JAX's CUDA plugin is missing (the error says
      how to install it), or it did not start (JAX started otherwise: plan
      in a process of its own, as ``logra memory`` does).
  """
  config = target_config(name)
  try:
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=config, topology=f"1x1x{count}"
    )
  except (NotImplementedError, RuntimeError) as error:
    version = jaxlib.__version__
    if _plugin_installed():
      raise ValueError(
          f"compiling for {name} without the GPU: JAX's CUDA plugin is "
          "installed but did not start (JAX had started on other platforms "
          f"first); plan in a process of its own ({error})"
      ) from error
    raise ValueError(
        f"compiling for {name} without the GPU needs JAX's CUDA plugin, "
        "without its CUDA libraries: pip install --no-deps "
        f"jax-cuda12-plugin=={version} jax-cuda12-pjrt=={version}"
    ) from error
  return list(topology.devices)[:count]


def _plugin_installed() -> bool:
  return bool(
      importlib.util.find_spec("jax_plugins")
      and importlib.util.find_spec("jax_plugins.xla_cuda12")
  )
