"""A run's checkpoint folder on Orbax: save, restore, keep, set aside.

Orbax writes each step into a temporary folder and renames it once every
item is written: a crash or ``SIGKILL`` during a (possibly asynchronous)
save leaves the earlier checkpoints as they were and no step that
:meth:`Checkpointer.all_steps` would list. Restoring checks the format, the
config (:func:`~logra_jax.checkpoint.check_resumable`) and every array's
shape and dtype before reading any array, reads arrays straight into the
shardings of the run's current mesh, and checks them against their
checksums (:mod:`logra_jax.checkpoint.integrity`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pathlib
import shutil
import time
from typing import Any, Callable, Optional, Sequence

import jax
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from logra_jax.checkpoint import integrity
from logra_jax.checkpoint import loops
from logra_jax.checkpoint.errors import CheckpointError, CorruptCheckpointError
from logra_jax.checkpoint.items import (
    ARRAY_ITEMS,
    LoopState,
    Restored,
    abstract_state,
    with_empty,
    without_empty,
)
from logra_jax.checkpoint.resume import check_resumable
from logra_jax.configs import CheckpointConfig

# The metric "keep the best" ranks checkpoints by.
BEST_METRIC = "accuracy/eval"
# Orbax's own reports of a failed background save (with tracebacks): the
# failure is raised as one CheckpointSaveError instead.
_SAVE_FAILURES = (
    "background save thread",
    "Save Finalize thread",
    "_SignalingThread.run() raised",
    "Failed to write metadata",
)


class CheckpointSaveError(OSError):
  """A checkpoint could not be written (the folder and the OS error in one
  line; ``errno`` the OS error's, None if there was none). Orbax's threads
  of a failed asynchronous save wait for it for good, so a process that
  gets this must end (``logra train`` exits 1)."""


def _drop_save_failures(record: logging.LogRecord) -> bool:
  return not any(text in record.getMessage() for text in _SAVE_FAILURES)


@contextlib.contextmanager
def _quiet_absl(text: str):
  """Drops absl log records containing ``text`` inside the block."""
  drop = lambda record: text not in record.getMessage()
  logger = logging.getLogger("absl")
  logger.addFilter(drop)
  try:
    yield
  finally:
    logger.removeFilter(drop)


def _first_line(error: BaseException) -> str:
  """``Type: first line of the message`` (tensorstore's run to pages)."""
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _os_error(error: BaseException) -> BaseException:
  """The first OSError among ``error`` and its causes (what the disk
  said), else ``error`` itself."""
  seen = error
  while seen is not None:
    if isinstance(seen, OSError):
      return seen
    seen = seen.__cause__ or seen.__context__
  return error


def _describe_steps(steps: Sequence[int]) -> str:
  """The steps as a list in words (``"none"`` for none)."""
  return ", ".join(map(str, steps)) if steps else "none"


class Checkpointer:
  """Saves and restores a run's checkpoints in one folder.

  Wraps ``orbax.checkpoint.CheckpointManager``: each save is atomic
  (temporary folder, then rename) and, with ``config.async_save``, written
  in a background thread once the arrays are on the host; the last
  ``config.keep`` checkpoints are kept, plus the ``config.keep_best`` with
  the highest :data:`BEST_METRIC`. Opening a folder for writing deletes the
  temporary folders of saves that never finished. Use as a context manager,
  or call :meth:`close` (on every path: it waits for a pending save, and no
  background work outlives it).

  Args:
    directory: the checkpoint folder (``<run>/checkpoints``).
    config: when to save and what to keep.
    read_only: open existing checkpoints only (export, inspection).
    clock: seconds, for ``config.every_seconds``.

  Example:
    >>> import tempfile, optax, jax.numpy as jnp
    >>> from logra_jax.checkpoint import resume
    >>> params = {"w": jnp.arange(3.0)}
    >>> opt_state = optax.adam(0.1).init(params)
    >>> with Checkpointer(tempfile.mkdtemp() + "/checkpoints") as ckpt:
    ...   ckpt.save(1, params=params, opt_state=opt_state,
    ...             meta={"format": resume.FORMAT_VERSION},
    ...             loop=LoopState(1, jax.random.key(0), 1))
    ...   restored = ckpt.restore(params=params, opt_state=opt_state)
    >>> restored.step, restored.params["w"].tolist()
    (1, [0.0, 1.0, 2.0])
  """

  def __init__(
      self,
      directory: str | os.PathLike,
      config: CheckpointConfig = CheckpointConfig(),
      *,
      read_only: bool = False,
      clock: Callable[[], float] = time.monotonic,
  ):
    self.directory = pathlib.Path(directory).absolute()
    self.config = config
    self.read_only = read_only
    if read_only and not self.directory.is_dir():
      raise CheckpointError(f"no checkpoint folder {self.directory}")
    # Not left to Orbax: it deletes them in a thread that its close() does
    # not join, and a process ending soon after printed that thread's
    # traceback at exit.
    if not read_only and jax.process_index() == 0:
      for path in self.unfinished():
        shutil.rmtree(path)
    keep = [policies.LatestN(n=config.keep)]
    if config.keep_best:
      keep.append(
          policies.BestN(
              get_metric_fn=lambda metrics: metrics[BEST_METRIC],
              n=config.keep_best,
              keep_checkpoints_without_metrics=False,
          )
      )
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=config.async_save,
        preservation_policy=policies.AnyPreservationPolicy(keep),
        cleanup_tmp_directories=False,
        read_only=read_only,
        create=not read_only,
        save_interval_steps=0 if read_only else 1,
    )
    handlers = {name: ocp.StandardCheckpointHandler() for name in ARRAY_ITEMS}
    handlers.update(
        loop=ocp.JsonCheckpointHandler(), meta=ocp.JsonCheckpointHandler()
    )
    # Orbax's loops must outlive the operations of a failed save or restore
    # (loops.py); held until close().
    loops.hold()
    try:
      with _quiet_absl("read only"):  # read_only is what was asked for
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )
    except BaseException:
      loops.release()
      raise
    self._closed = False
    self._clock = clock
    self._last_save = clock()
    logging.getLogger("absl").addFilter(_drop_save_failures)

  @contextlib.contextmanager
  def _saving(self):
    """Raises a failure of Orbax to write inside the block (this save's or
    an earlier one's in the background) as a :class:`CheckpointSaveError`."""
    try:
      yield
    except CheckpointError:
      raise
    except Exception as error:  # Orbax and tensorstore raise many kinds.
      cause = _os_error(error)
      failure = CheckpointSaveError(
          f"saving a checkpoint in {self.directory} failed: "
          f"{_first_line(cause)}"
      )
      # What the disk said (e.g. ENOSPC: the disk is full), for callers.
      failure.errno = getattr(cause, "errno", None)
      raise failure from error

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Waits for a pending asynchronous save and releases the manager; once
    it returns, nothing runs in the background. Later calls do nothing."""
    if not self._closed:
      self._closed = True
      try:
        with self._saving():
          self._manager.close()
      finally:
        logging.getLogger("absl").removeFilter(_drop_save_failures)
        loops.release()

  def wait(self) -> None:
    """Blocks until a pending asynchronous save is finished on disk.

    Raises:
      CheckpointSaveError: the save failed.
    """
    with self._saving():
      self._manager.wait_until_finished()

  def all_steps(self) -> list[int]:
    """Steps of the finished checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    """The newest finished checkpoint's step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def unfinished(self) -> list[pathlib.Path]:
    """Temporary folders of saves that never finished (e.g. killed)."""
    return sorted(p for p in self.directory.glob("*.orbax-checkpoint-tmp*"))

  def due(self, step: int, evaluated: bool = False) -> bool:
    """Whether the run should save after ``step``: every ``every_steps``
    steps, once ``every_seconds`` have passed since the last save, and
    after an evaluation when the best checkpoints are kept."""
    config = self.config
    if config.every_steps and step % config.every_steps == 0:
      return True
    if config.every_seconds and (
        self._clock() - self._last_save >= config.every_seconds
    ):
      return True
    return evaluated and config.keep_best > 0

  def save(
      self,
      step: int,
      *,
      params: Any,
      opt_state: Any,
      loop: LoopState,
      meta: dict[str, Any],
      ref_params: Any = None,
      eval_accuracy: Optional[float] = None,
      wait: bool = False,
  ) -> None:
    """Saves the state after ``step`` steps.

    Returns once the arrays' checksums are computed (on their devices) and
    the arrays are copied to the host (the device buffers may then be
    donated to the next step); the files are written in the background
    unless ``wait`` or ``config.async_save=False``. ``meta`` is stored with
    the checksums of the arrays and of ``loop``, and one of itself
    (:func:`~logra_jax.checkpoint.integrity.sealed_meta`).

    Args:
      step: learner steps done (the checkpoint's name).
      params: policy parameters.
      opt_state: optimizer state.
      loop: host-side loop state.
      meta: :func:`~logra_jax.checkpoint.run_meta` of the run.
      ref_params: reference parameters, if the run holds them.
      eval_accuracy: held-out accuracy measured at this step, for keeping
        the best checkpoints.
      wait: block until the checkpoint is on disk.

    Raises:
      CheckpointError: if a checkpoint of ``step`` already exists.
      CheckpointSaveError: this save, or an earlier asynchronous one,
        failed to write (naming the folder and the OS error).
    """
    if step in self.all_steps():
      raise CheckpointError(
          f"a checkpoint of step {step} already exists in " f"{self.directory}"
      )
    trees = {"params": params, "opt_state": opt_state, "ref_params": ref_params}
    trees = {k: without_empty(v) for k, v in trees.items() if v is not None}
    loop_json = loop.to_json()
    meta = integrity.sealed_meta(meta, trees, loop_json)
    items = {k: ocp.args.StandardSave(v) for k, v in trees.items()}
    items.update(
        loop=ocp.args.JsonSave(loop_json), meta=ocp.args.JsonSave(meta)
    )
    metrics = (
        None if eval_accuracy is None else {BEST_METRIC: float(eval_accuracy)}
    )
    with self._saving():
      self._manager.save(
          step, args=ocp.args.Composite(**items), metrics=metrics, force=True
      )
    self._last_save = self._clock()
    if wait:
      self.wait()

  def resolve_step(self, step: Optional[int] = None) -> int:
    """``step`` if a finished checkpoint of it exists, else the latest one's
    when ``step`` is None.

    Raises:
      CheckpointError: naming the folder, the finished steps and any
        unfinished saves.
    """
    steps = self.all_steps()
    if step is None:
      if not steps:
        extra = ""
        if self.unfinished():
          extra = (
              " (only unfinished saves: "
              f"{', '.join(p.name for p in self.unfinished())})"
          )
        raise CheckpointError(
            f"no finished checkpoint in {self.directory}{extra}"
        )
      return steps[-1]
    if step not in steps:
      raise CheckpointError(
          f"no checkpoint of step {step} in "
          f"{self.directory}; finished checkpoints: "
          f"{_describe_steps(steps)}"
      )
    return step

  def read_meta(self, step: Optional[int] = None) -> dict[str, Any]:
    """The :func:`~logra_jax.checkpoint.run_meta` stored with checkpoint ``step`` (default: the
    latest), with the checksums of the checkpoint's items.

    Raises:
      CorruptCheckpointError: unreadable, or not matching its checksum.
      CheckpointError: written in another format (by another version).
    """
    step = self.resolve_step(step)
    path = self.directory / str(step)
    try:
      meta = self._manager.restore(
          step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
      ).meta
    except Exception as error:  # Orbax and tensorstore raise many kinds.
      raise CorruptCheckpointError(
          f"checkpoint {path} has no readable description (meta): "
          f"{_first_line(error)}"
      ) from error
    integrity.check_meta(meta, path)
    return meta

  def _check_arrays(self, step: int, name: str, target: Any) -> None:
    """Compares the saved arrays of item ``name`` with ``target`` by name,
    shape and dtype, before any of them is read."""
    path = self.directory / str(step) / name
    try:
      saved_tree = self._manager.item_metadata(step)[name].tree
    except Exception as error:
      raise CorruptCheckpointError(
          f"checkpoint {path}: cannot read the array metadata: "
          f"{_first_line(error)}"
      ) from error
    integrity.check_shapes(path, name, saved_tree, target)

  def restore(
      self,
      step: Optional[int] = None,
      *,
      params: Any,
      opt_state: Any = None,
      ref_params: Any = None,
      expected_meta: Optional[dict[str, Any]] = None,
      allow_reshard: bool = False,
  ) -> Restored:
    """Restores checkpoint ``step`` (default: the latest).

    Arrays are read straight into the shardings of the targets, so a run on
    a mesh gets its state already laid out for that mesh, and checked
    against the checksums written with them.

    Args:
      step: which checkpoint.
      params: the target of the parameters: arrays or
        ``jax.ShapeDtypeStruct`` with ``sharding`` (:func:`abstract_state`).
      opt_state: the target of the optimizer state, likewise; None: not
        restored (e.g. for export).
      ref_params: the target of the reference parameters, if wanted.
      expected_meta: this run's :func:`~logra_jax.checkpoint.run_meta`; if given, checked with
        :func:`check_resumable` first.
      allow_reshard: accept another mesh or process count.

    Returns:
      The :class:`Restored` state.

    Raises:
      CheckpointError: no such checkpoint, or one from another run (naming
        the field and both values) or with other array shapes.
      CorruptCheckpointError: files missing or unreadable, or an array or
        item that does not match its checksum (named, with the step).
    """
    step = self.resolve_step(step)
    meta = self.read_meta(step)
    if expected_meta is not None:
      check_resumable(meta, expected_meta, allow_reshard)
    targets = {
        "params": params,
        "opt_state": opt_state,
        "ref_params": ref_params,
    }
    targets = {
        k: abstract_state(v) for k, v in targets.items() if v is not None
    }
    stored = {k: without_empty(v) for k, v in targets.items()}
    for name, target in stored.items():
      self._check_arrays(step, name, target)
    args = {
        name: ocp.args.StandardRestore(target)
        for name, target in stored.items()
    }
    try:
      restored = self._manager.restore(
          step, args=ocp.args.Composite(loop=ocp.args.JsonRestore(), **args)
      )
      loop = LoopState.from_json(restored.loop)
    except Exception as error:
      raise CorruptCheckpointError(
          f"checkpoint {self.directory / str(step)} cannot be read (truncated "
          f"or damaged?): {_first_line(error)}"
      ) from error
    where = f"checkpoint {self.directory / str(step)} (step {step})"
    integrity.verify(where, meta["checksums"], restored)
    trees = {k: with_empty(restored[k], v) for k, v in targets.items()}
    return Restored(
        step=step,
        params=trees["params"],
        opt_state=trees.get("opt_state"),
        ref_params=trees.get("ref_params"),
        loop=loop,
        meta=meta,
    )

  def set_aside(self, step: int) -> pathlib.Path:
    """Moves checkpoint ``step`` out of the steps Orbax lists, to
    ``<step>.corrupt-<time>`` beside it: kept for inspection (the keep
    policies never delete it), and the run can save that step again.

    On several processes, process 0 renames and the others wait for it.

    Returns:
      The new path.

    Raises:
      CheckpointError: the folder is open read-only.
    """
    if self.read_only:
      raise CheckpointError(
          f"cannot set checkpoint {step} aside: "
          f"{self.directory} is open read-only"
      )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    names = (
        f"{step}.corrupt-{stamp}" + (f"-{n}" if n else "")
        for n in itertools.count()
    )
    aside = next(
        self.directory / name
        for name in names
        if not (self.directory / name).exists()
    )
    if jax.process_index() == 0:
      os.rename(self.directory / str(step), aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"logra set aside {step}")
    self._manager.reload()
    return aside

  def restore_latest(
      self, *, log: Callable[[str], None] = print, **kwargs: Any
  ) -> Restored:
    """:meth:`restore` of the newest checkpoint that can be read.

    A checkpoint whose files are damaged (:class:`CorruptCheckpointError`)
    is reported through ``log``, set aside (:meth:`set_aside`) unless the
    folder is open read-only, and the next older one is tried; any other
    error (e.g. a config mismatch) is raised at once. A resumed run then
    saves the steps it trains again in place of the damaged ones.

    On several processes, every process sees a checksum mismatch (the
    checksums are of the global arrays), but a read error of a file only
    one process reads is seen by that process alone: the others restore
    the step and the processes disagree. Such damage needs the folder set
    right by hand (rename the damaged step).

    Raises:
      CheckpointError: no checkpoint, or none that can be read.
    """
    steps = self.all_steps()
    if not steps:
      self.resolve_step(None)  # raises, naming unfinished saves if any
    errors = []
    for step in reversed(steps):
      try:
        return self.restore(step, **kwargs)
      except CorruptCheckpointError as error:
        aside = (
            "" if self.read_only else f", set aside as {self.set_aside(step)}"
        )
        log(f"skipping checkpoint {step}{aside}: {error}")
        errors.append(str(error))
    raise CorruptCheckpointError(
        f"no readable checkpoint in {self.directory}: " + " | ".join(errors)
    )


def locate(path: str | os.PathLike) -> tuple[pathlib.Path, Optional[int]]:
  """The checkpoint folder and step a user path names.

  ``path`` may be a run folder (holding ``checkpoints/``), a checkpoint
  folder, or one step inside it (``.../checkpoints/40``).

  Returns:
    ``(checkpoint folder, step or None for the latest)``.

  Raises:
    CheckpointError: the path does not exist.
  """
  path = pathlib.Path(path).absolute()
  if not path.is_dir():
    raise CheckpointError(f"no such checkpoint folder: {path}")
  if (path / "checkpoints").is_dir():
    return path / "checkpoints", None
  if path.name.isdigit() and (path / "meta").is_dir():
    return path.parent, int(path.name)
  return path, None
