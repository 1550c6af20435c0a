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

import jax
from jax.experimental import topologies

import jaxlib

# name: (compute capability, SMs, memory bytes, memory bandwidth B/s, L2
# bytes, boost clock GHz, FP32 lanes per SM, shared memory per SM, shared
# memory per block opt-in).
_GPUS = {
    "a100-80gb": (
        (8, 0), 108, 80 * 2**30, 2.039e12, 40 * 2**20, 1.41, 64, 167936,
        166912,
    ),
    "h100": (
        (9, 0), 132, 80 * 2**30, 3.35e12, 50 * 2**20, 1.98, 128, 233472,
        232448,
    ),
    "h200": (
        (9, 0), 132, 141 * 10**9, 4.8e12, 50 * 2**20, 1.98, 128, 233472,
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
  """``count`` compile-only devices of GPU ``name`` on one host.

  Raises:
    ValueError: an unknown GPU, or JAX's CUDA plugin is missing (the error
      says how to install it) or started against a GPU runtime it could not
      load (plan in a fresh process: ``logra memory`` does).
  """
  config = target_config(name)
  try:
    started = bool(jax._src.xla_bridge._backends)  # noqa: SLF001
  except AttributeError:
    started = True
  if not started:
    # The plugin initializes without a GPU runtime only when JAX does not
    # try to start it as a backend.
    jax.config.update("jax_platforms", "cpu")
  try:
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=config, topology=f"1x1x{count}"
    )
  except (NotImplementedError, RuntimeError) as error:
    version = jaxlib.__version__
    raise ValueError(
        f"compiling for {name} without the GPU needs JAX's CUDA plugin, "
        "without its CUDA libraries: pip install --no-deps "
        f"jax-cuda12-plugin=={version} jax-cuda12-pjrt=={version}; then plan "
        f"in a fresh process ({error})"
    ) from error
  return list(topology.devices)[:count]
