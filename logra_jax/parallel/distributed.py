"""Multi-host runs through JAX's own distributed runtime."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import jax
import numpy as np


def initialize(
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    local_device_ids: Optional[Sequence[int]] = None,
) -> None:
  """Connects this process to the others of a multi-host run.

  Wraps ``jax.distributed.initialize``. Arguments left as None are read from
  ``LOGRA_COORDINATOR_ADDRESS``, ``LOGRA_NUM_PROCESSES`` and
  ``LOGRA_PROCESS_ID`` when set, and otherwise detected by JAX from the
  cluster environment (SLURM, Open MPI, Cloud TPU, ...). On CPU, cross-process
  collectives go through gloo. Call it once, first thing, before any other
  JAX call; afterwards ``jax.devices()`` lists the devices of every process
  and one mesh (``parallel.make_mesh``) spans them all.

  Example (two processes on one machine, four CPU devices each)::

    # process i of 2:
    jax.config.update("jax_num_cpu_devices", 4)
    logra_jax.parallel.initialize("localhost:12355", num_processes=2,
                                  process_id=i)
    mesh = logra_jax.parallel.make_mesh(MeshConfig(fsdp=8))

  Raises:
    ValueError: if only some of the coordinator, process count and process
      id are given, or an environment value is not an integer.
  """
  env = os.environ
  coordinator_address = coordinator_address or env.get(
      "LOGRA_COORDINATOR_ADDRESS"
  )

  def from_env(value, name):
    if value is not None or name not in env:
      return value
    try:
      return int(env[name])
    except ValueError:
      raise ValueError(f"{name}={env[name]!r} is not an integer") from None

  num_processes = from_env(num_processes, "LOGRA_NUM_PROCESSES")
  process_id = from_env(process_id, "LOGRA_PROCESS_ID")
  given = [
      x is not None for x in (coordinator_address, num_processes, process_id)
  ]
  if any(given) and not all(given):
    raise ValueError(
        "give all of coordinator_address, num_processes and process_id (or "
        "none, to let JAX detect the cluster); got "
        f"coordinator_address={coordinator_address!r}, "
        f"num_processes={num_processes!r}, process_id={process_id!r}"
    )
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      local_device_ids=local_device_ids,
  )


def global_array(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array from a host value that every process holds in full.

  Each process contributes the shards its own devices hold, so the same call
  works on one host and on many.
  """
  value = np.asarray(value)
  return jax.make_array_from_callback(
      value.shape, sharding, lambda index: value[index]
  )
