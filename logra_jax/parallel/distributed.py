"""Multi-host runs through JAX's own distributed runtime."""

from __future__ import annotations

import hashlib
import os
import socket
import time
from typing import Any, Optional, Sequence

import jax
from jax.experimental import multihost_utils
import numpy as np


def initialize(
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    local_device_ids: Optional[Sequence[int]] = None,
    initialization_timeout: int = 300,
    heartbeat_timeout_seconds: int = 100,
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

  ``initialization_timeout`` (seconds) bounds the wait for the coordinator
  and the other processes; a process silent for ``heartbeat_timeout_seconds``
  is taken as dead, and JAX then stops every other process with an error
  naming it ("Task 1 heartbeat timeout").

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
      initialization_timeout=initialization_timeout,
      heartbeat_timeout_seconds=heartbeat_timeout_seconds,
  )


# A cluster launcher that starts one process per task sets these (SLURM's
# srun, Open MPI's mpirun); jax.distributed reads the rest from them.
_CLUSTER_SIZE_VARIABLES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def join_from_environment(timeout_s: Optional[int] = None) -> bool:
  """Joins a multi-process run if the environment describes one.

  What ``logra train``, ``eval`` and ``export`` call first. In order:

  * ``LOGRA_COORDINATOR_ADDRESS``, ``LOGRA_NUM_PROCESSES`` and
    ``LOGRA_PROCESS_ID`` (all three): join that run (any machine);
  * ``LOGRA_DISTRIBUTED=1``, or a launcher that started several tasks
    (``SLURM_NTASKS`` or ``OMPI_COMM_WORLD_SIZE`` above 1): let
    ``jax.distributed`` detect the cluster (SLURM, Open MPI, Cloud TPU);
  * otherwise one process: nothing to join.

  ``LOGRA_HEARTBEAT_TIMEOUT`` (seconds, default 100) is how long a silent
  process is waited for before the others stop with an error naming it.

  Args:
    timeout_s: how long to wait for the coordinator and the other
      processes; default ``LOGRA_INIT_TIMEOUT`` or 120 seconds.

  Returns:
    Whether a multi-process run was joined.

  Raises:
    ValueError: a partial or malformed ``LOGRA_*`` setting, or a coordinator
      that did not answer within the timeout (the message names it).
  """
  env = os.environ
  explicit = any(
      name in env
      for name in (
          "LOGRA_COORDINATOR_ADDRESS",
          "LOGRA_NUM_PROCESSES",
          "LOGRA_PROCESS_ID",
      )
  )
  detected = env.get("LOGRA_DISTRIBUTED", "") not in ("", "0") or any(
      _positive_int(env.get(name)) > 1 for name in _CLUSTER_SIZE_VARIABLES
  )
  if not explicit and not detected:
    return False
  if jax.distributed.is_initialized():
    return True
  if timeout_s is None:
    timeout_s = _positive_int(env.get("LOGRA_INIT_TIMEOUT")) or 120
  where = env.get("LOGRA_COORDINATOR_ADDRESS", "the detected coordinator")
  if explicit and env.get("LOGRA_PROCESS_ID", "0").strip() != "0":
    # JAX aborts the process when the coordinator does not answer in time;
    # find out first, and say so.
    _wait_for_coordinator(where, timeout_s)
  try:
    initialize(
        initialization_timeout=timeout_s,
        heartbeat_timeout_seconds=_positive_int(
            env.get("LOGRA_HEARTBEAT_TIMEOUT")
        )
        or 100,
    )
  except (RuntimeError, jax.errors.JaxRuntimeError) as error:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    raise ValueError(
        f"could not join the distributed run at {where} within {timeout_s} s "
        f"(LOGRA_INIT_TIMEOUT): {type(error).__name__}: {first[:300]}"
    ) from None
  return True


# Where launchers put a process's id: logra's own, SLURM's srun, Open MPI's
# mpirun, Cloud TPU VMs.
_PROCESS_ID_VARIABLES = (
    "LOGRA_PROCESS_ID",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "TPU_WORKER_ID",
)


def launched_process_id() -> int:
  """This process's id as its launcher set it in the environment (0 when
  none did), read without joining a distributed run.

  Example:
    >>> launched_process_id()
    0
  """
  for name in _PROCESS_ID_VARIABLES:
    value = os.environ.get(name, "").strip()
    if value:
      try:
        return int(value)
      except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None
  return 0


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Returns once ``host:port`` accepts a connection; a ValueError naming it
  after ``timeout_s`` seconds of refusals."""
  host, _, port = address.rpartition(":")
  try:
    port = int(port)
  except ValueError:
    raise ValueError(
        f"LOGRA_COORDINATOR_ADDRESS={address!r} is not host:port"
    ) from None
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host.strip("[]"), port), timeout=2):
        return
    except OSError as error:
      if time.monotonic() > deadline:
        raise ValueError(
            f"could not join the distributed run: its coordinator "
            f"{address} did not answer within {timeout_s} s "
            f"(LOGRA_INIT_TIMEOUT): {error}"
        ) from None
      time.sleep(0.5)


def _positive_int(text: Optional[str]) -> int:
  try:
    return max(int(text), 0) if text else 0
  except ValueError:
    return 0


def is_leader() -> bool:
  """Whether this process writes the run's files and logs (process 0)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier ``name`` (nothing to wait
  for in a one-process run)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def check_same_everywhere(text: str, what: str) -> None:
  """Refuses a run whose processes were given different ``text`` (e.g. the
  config): a ValueError naming ``what`` and the processes that differ."""
  if jax.process_count() == 1:
    return
  digest = hashlib.sha256(text.encode()).digest()[:16]
  mine = np.frombuffer(digest, np.int32)
  every = np.asarray(multihost_utils.process_allgather(mine))
  differ = [
      i for i in range(len(every)) if not np.array_equal(every[i], every[0])
  ]
  if differ:
    raise ValueError(
        f"the processes of this run disagree on {what}: processes {differ} "
        "differ from process 0; run the same command on every process"
    )


def host_value(x: jax.Array) -> np.ndarray:
  """The whole of a global array, as numpy, on every process (an all-gather
  when other processes hold parts of it)."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def process_rows(n: int) -> slice:
  """This process's share of ``n`` rows of host work (e.g. scoring), in
  process order: contiguous, sizes differing by at most one."""
  bounds = _row_bounds(n)
  index = jax.process_index()
  return slice(int(bounds[index]), int(bounds[index + 1]))


def _row_bounds(n: int) -> np.ndarray:
  """Where each process's share of ``n`` rows starts, and the end."""
  return np.linspace(0, n, jax.process_count() + 1).round().astype(int)


def gather_rows(local: np.ndarray, n: int) -> np.ndarray:
  """The rows every process computed for its :func:`process_rows` share of
  ``n``, concatenated in order, on every process."""
  local = np.asarray(local)
  if jax.process_count() == 1:
    return local
  bounds = _row_bounds(n)
  width = int(np.max(np.diff(bounds)))
  padded = np.zeros((width,) + local.shape[1:], local.dtype)
  padded[: len(local)] = local
  every = np.asarray(multihost_utils.process_allgather(padded))
  return np.concatenate(
      [every[i, : bounds[i + 1] - bounds[i]] for i in range(len(every))]
  )


def sum_over_processes(value: np.ndarray) -> np.ndarray:
  """The sum over processes of each process's ``value`` (same shape on
  all), on every process."""
  value = np.asarray(value)
  if jax.process_count() == 1:
    return value
  return np.asarray(multihost_utils.process_allgather(value)).sum(axis=0)


def global_array(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array from a host value that every process holds in full.

  Each process contributes the shards its own devices hold, so the same call
  works on one host and on many.
  """
  value = np.asarray(value)
  return jax.make_array_from_callback(
      value.shape, sharding, lambda index: value[index]
  )
