"""What guards a run: the lock on its folder, stop signals, the
out-of-memory hint and the stop after too many non-finite steps."""

from __future__ import annotations

import contextlib
import pathlib
import signal
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import filelock
import jax

from logra_jax import parallel
from logra_jax.checkpoint import folders
from logra_jax.configs import TrainConfig
from logra_jax.optim import non_finite
from logra_jax.rollout import engine as engine_lib

Log = Callable[[str], None]


class RunFolderInUseError(ValueError):
  """Another run holds the output folder (its lock, ``<out>/.lock``)."""


@contextlib.contextmanager
def locked_run_folder(out: pathlib.Path) -> Iterator[None]:
  """Creates ``out`` and holds an exclusive lock on it for the block, so
  that two runs never write the same folder; the second is refused at once.
  The lock dies with its process: a killed run leaves no stale lock
  (:func:`logra_jax.checkpoint.folders.run_lock`)."""
  out.mkdir(parents=True, exist_ok=True)
  lock = folders.run_lock(out)
  try:
    lock.acquire(timeout=0)
  except filelock.Timeout:
    raise RunFolderInUseError(
        f"{out} is in use by another run (it holds {out / '.lock'}); wait "
        "for it to end or choose another output folder"
    ) from None
  try:
    yield
  finally:
    lock.release()


class OutOfMemoryError(MemoryError):
  """The rollout or the train step does not fit in device memory."""


def memory_command(
    config: TrainConfig,
    mesh: parallel.MeshConfig | None,
    folder: pathlib.Path,
    seq_len: int,
) -> str:
  """The ``logra memory`` command that plans a run's train step per device.

  Example:
    >>> from logra_jax.configs import get_preset
    >>> print(memory_command(get_preset("smoke"), None, pathlib.Path("p"), 20)
    ...       .replace(" --", "\\n--"))
    logra memory
    --model p/config.json
    --mesh dp=1,fsdp=1,tp=1
    --optimizer logra
    --rank 4
    --seq 20
    --micro-batch 16
    --rollout-seqs 16
    --rollout-tokens 20
  """
  mesh = mesh or parallel.MeshConfig()
  rows = config.rollout.prompts_per_step * config.rollout.num_generations
  per_device = max(1, rows // config.micro_batches // (mesh.dp * mesh.fsdp))
  optimizer = "adam" if config.optimizer.name == "adam" else "logra"
  flags = (
      f" --reference-dtype {config.policy.reference_dtype}"
      if config.loss.beta > 0
      else ""
  )
  if config.optimizer.base_dtype != "float32":
    flags += f" --base-dtype {config.optimizer.base_dtype}"
  return (
      f"logra memory --model {folder / 'config.json'} --mesh {mesh} "
      f"--optimizer {optimizer} --rank {config.optimizer.rank} "
      f"--seq {seq_len} --micro-batch {per_device} --rollout-seqs {rows} "
      f"--rollout-tokens {seq_len}{flags}"
  )


def out_of_memory_error(
    error: BaseException, step: int, command: str
) -> Optional[OutOfMemoryError]:
  """An :class:`OutOfMemoryError` explaining ``error`` if it is XLA's
  out-of-memory (``RESOURCE_EXHAUSTED``), else None.

  Example:
    >>> error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")
    >>> "logra memory" in str(out_of_memory_error(error, 1, "logra memory"))
    True
  """
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
    return None
  first = text.strip().splitlines()[0][:300] if text.strip() else ""
  return OutOfMemoryError(
      f"step {step}: out of memory compiling or running the sampler or the "
      f"train step ({first}). See what this config needs per device with: "
      f"{command} ; then raise micro_batches, lower "
      f"rollout.prompts_per_step or optimizer.rank, or shard over more "
      f"devices (--mesh)"
  )


@contextlib.contextmanager
def explain_out_of_memory(step: int, command: Callable[[], str]):
  """Turns XLA's out-of-memory inside the block into an
  :class:`OutOfMemoryError` that gives ``command()``."""
  try:
    yield
  except jax.errors.JaxRuntimeError as error:
    explained = out_of_memory_error(error, step, command())
    if explained is None:
      raise
    raise explained from error


class StopSignals:
  """SIGTERM and SIGINT ask the run to stop after the current step (it then
  saves a checkpoint); a second signal stops it at once (KeyboardInterrupt).
  Handlers are only installed on the main thread, and restored on exit."""

  def __init__(self, log: Log):
    self.received: Optional[str] = None
    self._log = log
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame) -> None:
    del frame
    if self.received is not None:
      raise KeyboardInterrupt
    self.received = signal.Signals(signum).name
    self._log(
        f"{self.received}: stopping after the current step and saving "
        "a checkpoint (send it again to stop at once, without saving)"
    )

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def check_finite(
    step: int,
    skipped: set[str],
    guard: non_finite.SkipNonFiniteState,
    limit: int,
    latest: Optional[int],
    log: Log,
) -> None:
  """Logs a skipped step (the optimizer's guard sees the loss too, so a
  non-finite loss is always skipped); raises after ``limit`` in a row."""
  if skipped:
    run = int(guard.consecutive_skips)
    what = ", ".join(sorted(skipped))
    log(
        f"step {step}: skipped, non-finite {what} ({run} in a row, "
        f"{int(guard.skipped_steps)} in all)"
    )
    if run >= limit:
      raise FloatingPointError(
          f"step {step}: {run} consecutive steps skipped for non-finite "
          f"{what} (max_consecutive_skips={limit}); the weights are those "
          f"after step {step - run}; latest checkpoint: step {latest}"
      )


class NonFiniteProjectors:
  """Logs the refreshed projectors the optimizer refused as non-finite
  (``projector/non_finite``, a count the optimizer state keeps)."""

  def __init__(self, log: Log):
    self._log = log
    self._seen: Optional[float] = None

  def check(self, step: int, metrics: dict[str, float]) -> None:
    """Logs the refusals counted since the last call (all of them, so far,
    at the first)."""
    count = metrics.get("projector/non_finite")
    if count is None:
      return
    new = count - (self._seen or 0.0)
    self._seen = count
    if new > 0:
      self._log(
          f"step {step}: {int(new)} refreshed projector(s) were not finite "
          "and were replaced (the previous one, or a random orthonormal one "
          f"on a first refresh); {int(count)} in all"
      )


def memory_hint(
    config: TrainConfig,
    mesh: parallel.MeshConfig | None,
    policy: engine_lib.Policy,
    examples: Sequence[dict],
) -> Callable[[], str]:
  """The :func:`memory_command` of a run whose longest sequence is the
  longest of ``examples``' prompts plus ``rollout.max_new_tokens`` (worked
  out only when asked for, after an out-of-memory error)."""

  def command() -> str:
    seq = max(map(len, policy.encode([e["prompt"] for e in examples])))
    return memory_command(
        config, mesh, policy.folder, seq + config.rollout.max_new_tokens
    )

  return command
