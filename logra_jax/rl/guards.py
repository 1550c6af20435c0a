"""What guards a run: the lock on its folder, stop signals, a failed
checkpoint save, the out-of-memory hint and the stop after too many
non-finite steps."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import sys
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import filelock
import jax

from logra_jax import parallel
from logra_jax.checkpoint import CheckpointSaveError
from logra_jax.checkpoint import folders
from logra_jax.configs import TrainConfig
from logra_jax.optim import non_finite
from logra_jax.rollout import engine as engine_lib
from logra_jax.rollout import transport

# Seconds a stopping run may take to finish its step before what it waits
# for is given up (StopSignals).
STOP_GRACE_S = 10.0

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
  """The ``logra memory`` command that plans a run's train step per device:
  its mesh, optimizer (GaLore as LoGRA with dense gradients, which the
  planner has instead), micro-batches, KL control and reference policy.

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
  opt = config.optimizer
  rows = config.rollout.prompts_per_step * config.rollout.num_generations
  per_device = max(1, rows // config.micro_batches // (mesh.dp * mesh.fsdp))
  # The planner has no GaLore: LoGRA with dense gradients lays out the same
  # dense weights and gradients beside projected moments.
  optimizer = "logra" if opt.name == "galore" else opt.name
  flags = [
      f"--model {folder / 'config.json'}",
      f"--mesh {mesh}",
      f"--optimizer {optimizer}",
      f"--rank {opt.rank}",
      f"--seq {seq_len}",
      f"--micro-batch {per_device}",
      f"--rollout-seqs {rows}",
      f"--rollout-tokens {seq_len}",
  ]
  if config.micro_batches > 1:
    flags.append(f"--micro-batches {config.micro_batches}")
  if opt.name == "galore" or (
      opt.name == "logra" and opt.gradient_mode != "sketch"
  ):
    flags.append("--gradient-mode dense")
  if opt.project_embeddings:
    flags.append("--project-embeddings")
  if opt.freeze_embeddings:
    flags.append("--freeze-embeddings")
  for name, value in (("base", opt.base_dtype), ("coords", opt.coords_dtype)):
    if value != "float32":
      flags.append(f"--{name}-dtype {value}")
  if opt.step_bits is not None:
    flags.append(f"--step-bits {opt.step_bits}")
  if opt.target_kl is not None:
    flags.append(f"--target-kl {opt.target_kl}")
  if opt.target_kl is not None and opt.kl_subsample:
    flags.append(f"--kl-subsample {opt.kl_subsample}")
  if config.loss.beta > 0:
    flags.append(f"--reference-dtype {config.policy.reference_dtype}")
  return "logra memory " + " ".join(flags)


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


class StepAbandoned(BaseException):
  """A stopping run's rollout (the engine, the rewards) was not done within
  the grace: the step is given up (a BaseException, so that no ``except
  Exception`` on the way holds it)."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


class StopSignals:
  """How a run ends on SIGTERM or SIGINT, and on a failed checkpoint save.

  A first signal asks the run to stop after the current step (it then saves
  a checkpoint, evaluates and exits with the shell's status for the signal,
  ``128 + signum``: 143 for SIGTERM, 130 for SIGINT). If the run is still
  going ``grace_s`` seconds later, what it waits for is given up:
  ``on_stuck()`` interrupts the engine's request (a sync, the final
  evaluation) and a wait for a rollout inside :meth:`abandonable` (a
  frozen engine, a slow reward) raises :class:`StepAbandoned`, the caller
  then saving the last completed step; leaving the block with either (a
  :class:`~transport.TransportError` once a signal came) exits with the
  signal's status. A second signal ends the process at once, without
  saving, with that same status. A
  :class:`~logra_jax.checkpoint.CheckpointSaveError` leaving the block
  ends the process with one line and status 1 (Orbax's threads of a failed
  save would keep it alive). Handlers are only installed on the main
  thread, and restored on exit.

  Args:
    log: where the lines go.
    on_stuck: called (on a thread of its own) once the grace has passed.
    grace_s: seconds a stopping run may take to finish its step.

  Example:
    >>> with StopSignals(print) as stop:
    ...   with stop.abandonable():
    ...     pass
    >>> stop.received is None
    True
  """

  def __init__(
      self,
      log: Log,
      on_stuck: Optional[Callable[[], None]] = None,
      grace_s: float = STOP_GRACE_S,
  ):
    self.received: Optional[str] = None
    self._log = log
    self._on_stuck = on_stuck
    self._previous: dict[int, Any] = {}
    self._abandonable = False
    self._grace_over = False
    self._waking = False  # _expire's own signal is on its way
    self._signum = 0
    self._watchdog = threading.Timer(grace_s, self._expire)
    self._watchdog.daemon = True

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  @contextlib.contextmanager
  def abandonable(self) -> Iterator[None]:
    """A wait given up once the grace has passed (:class:`StepAbandoned`)."""
    self._abandonable = True
    try:
      if self._grace_over:
        raise StepAbandoned(self._signum)
      yield
    finally:
      self._abandonable = False

  def _expire(self) -> None:
    """The grace has passed: wake the main thread (its handler gives up an
    abandonable wait) and interrupt what it waits for."""
    self._grace_over = self._waking = True
    signal.pthread_kill(threading.main_thread().ident, self._signum)
    if self._on_stuck is not None:
      self._on_stuck()

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self._waking:  # _expire's signal: give up an abandonable wait
      self._waking = False
      if self._abandonable:
        self._abandonable = False
        raise StepAbandoned(self._signum)
      return
    if self.received is not None:
      exit_now(f"{name} again: exiting at once, without saving", 128 + signum)
    self.received, self._signum = name, signum
    self._log(
        f"{name}: stopping after the current step and saving a checkpoint "
        "(send it again to exit at once, without saving)"
    )
    if self._previous:
      self._watchdog.start()

  def __exit__(self, kind, error, traceback) -> None:
    del traceback
    self._watchdog.cancel()
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    if isinstance(error, CheckpointSaveError):
      exit_now(f"error: {error}", 1)
    if isinstance(error, StepAbandoned):
      raise SystemExit(128 + error.signum) from None
    if self.received and isinstance(error, transport.TransportError):
      self._log(
          f"{self.received}: stopped without a final evaluation ({error})"
      )
      raise SystemExit(128 + self._signum) from None


def exit_now(line: str, status: int) -> None:
  """Writes ``line`` to stderr and ends the process with ``status`` at once
  (no cleanup: what a run leaves is safe to kill, its lock dies with it;
  libraries' exit hooks and writer threads, which would retry failed writes
  under tracebacks or wait for a failed save for good, are skipped)."""
  sys.stdout.flush()
  print(line, file=sys.stderr, flush=True)
  os._exit(status)


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
