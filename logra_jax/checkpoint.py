"""Save and restore the whole state of an RL run with Orbax.

A checkpoint of step ``s`` holds the state after ``s`` learner steps, in
``<run>/checkpoints/<s>/``, as five Orbax items:

=============  ===============================================================
``params``     the policy parameters (an ``nnx.State``)
``opt_state``  the optimizer state: projectors, moments, counts, predicted-KL
               and skipped-step counters
``ref_params`` the reference policy's parameters, when the run holds one
``loop``       JSON: the step, the PRNG key, the data position, the per-step
               metrics history and the summary values so far
``meta``       JSON: format version, run config, model config (HF
               ``config.json``), mesh, process count and the tokenizer files
=============  ===============================================================

so a checkpoint alone is enough to resume a run bit for bit and to export
its policy (:func:`export_policy`). Orbax writes each step into a temporary
folder and renames it once every item is written: a crash or ``SIGKILL``
during a (possibly asynchronous) save leaves the earlier checkpoints as they
were and no step that :meth:`Checkpointer.all_steps` would list. Restoring
checks the format, the config (:func:`check_resumable`) and every array's
shape and dtype before reading any array, and reads arrays straight into the
shardings of the run's current mesh.

``meta`` also holds the checksums of everything else: one per array
(:func:`array_checksums`, computed where the arrays live, so the same for
any mesh or number of processes) and one of ``loop``; and a checksum of
itself. Restoring (and so exporting) recomputes them and raises
:class:`CorruptCheckpointError` naming the damaged array or item. Arrays
with no elements (optax's GaLore keeps ``(0, 0)`` projectors) are not
written: they are rebuilt from the restore target.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
import zlib
from typing import Any, Callable, Optional, Sequence

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from logra_jax import checksums
from logra_jax import policy_state
from logra_jax.configs import (
    CheckpointConfig,
    OptimizerConfig,
    TrainConfig,
    to_dict,
)

# 2: checksums in ``meta``, arrays without elements not written.
# 3: projected weights of LoGRA's sketch mode saved factored (B, A, c).
FORMAT_VERSION = 3
# The metric "keep the best" ranks checkpoints by.
BEST_METRIC = "accuracy/eval"
# Config fields (dotted paths; a section name covers its fields) that may
# differ when a run is resumed. They do not change what the saved state
# means: how long the run goes on, how often it evaluates and saves, when it
# gives up on non-finite steps, and where the policy folder (whose model
# config is checked separately) lives. Every other change is refused.
RESUMABLE_FIELDS = (
    "steps",
    "eval_every",
    "checkpoint",
    "logging",
    "max_consecutive_skips",
    "policy.path",
    "policy.cache_dir",
    "policy.remat",
    "rollout.engine",
    "sync",
)
# HF config keys that name a file or a library version, not the model.
_VOLATILE_MODEL_KEYS = (
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "architectures",
)
_ARRAY_ITEMS = ("params", "opt_state", "ref_params")


class CheckpointError(ValueError):
  """A checkpoint that cannot be used: missing, from another run, or (see
  :class:`CorruptCheckpointError`) unreadable."""


class CorruptCheckpointError(CheckpointError):
  """A finished checkpoint whose files cannot be read back or do not match
  their checksums (truncated, deleted or damaged after the save)."""


@dataclasses.dataclass
class LoopState:
  """The host side of a run that a checkpoint restores.

  Attributes:
    step: learner steps done.
    key: the run's typed PRNG key (``jax.random.key``) after ``step`` steps.
    data_position: prompt batches drawn so far.
    history: per-step metrics, as written to ``metrics.jsonl``.
    extras: other JSON values the trainer carries over (e.g. the held-out
      accuracy before RL).

  Example:
    >>> loop = LoopState(step=3, key=jax.random.key(7), data_position=3)
    >>> back = LoopState.from_json(json.loads(json.dumps(loop.to_json())))
    >>> back.step, bool((jax.random.key_data(back.key)
    ...                  == jax.random.key_data(loop.key)).all())
    (3, True)
  """

  step: int
  key: jax.Array
  data_position: int
  history: list[dict[str, float]] = dataclasses.field(default_factory=list)
  extras: dict[str, Any] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict[str, Any]:
    """A JSON-serializable dict (the key as its implementation and words)."""
    return {
        "step": int(self.step),
        "data_position": int(self.data_position),
        "key": {
            "impl": str(jax.random.key_impl(self.key)),
            "data": np.asarray(jax.random.key_data(self.key)).tolist(),
        },
        "history": self.history,
        "extras": self.extras,
    }

  @classmethod
  def from_json(cls, value: dict[str, Any]) -> LoopState:
    """Inverse of :meth:`to_json`."""
    key = jax.random.wrap_key_data(
        np.asarray(value["key"]["data"], np.uint32), impl=value["key"]["impl"]
    )
    return cls(
        step=int(value["step"]),
        key=key,
        data_position=int(value["data_position"]),
        history=list(value["history"]),
        extras=dict(value["extras"]),
    )


@dataclasses.dataclass
class Restored:
  """What :meth:`Checkpointer.restore` returns.

  Attributes:
    step: the checkpoint's step.
    params: policy parameters, placed with the requested shardings.
    opt_state: optimizer state, placed likewise.
    ref_params: reference parameters, or None when none were asked for.
    loop: the host-side loop state.
    meta: the checkpoint's description (see :func:`run_meta`).
  """

  step: int
  params: Any
  opt_state: Any
  ref_params: Any
  loop: LoopState
  meta: dict[str, Any]


def run_meta(
    config: TrainConfig,
    model_config: dict[str, Any],
    tokenizer: Any = None,
    mesh: Any = None,
) -> dict[str, Any]:
  """The description of a run stored with each of its checkpoints.

  Args:
    config: the run's config.
    model_config: the policy's HF ``config.json`` as a dict.
    tokenizer: a ``transformers`` tokenizer, stored (its saved files) so that
      :func:`export_policy` needs nothing but the checkpoint; None: none.
    mesh: the run's ``parallel.MeshConfig``, or None for one device.

  Returns:
    A JSON-serializable dict.

  Example:
    >>> meta = run_meta(TrainConfig(), {"model_type": "llama"})
    >>> meta["format"], meta["mesh"], meta["config"]["optimizer"]["rank"]
    (3, None, 32)
  """
  files = {}
  if tokenizer is not None:
    with tempfile.TemporaryDirectory() as tmp:
      tokenizer.save_pretrained(tmp)
      for path in sorted(pathlib.Path(tmp).iterdir()):
        if path.is_file():
          files[path.name] = base64.b64encode(path.read_bytes()).decode()
  return {
      "format": FORMAT_VERSION,
      "config": to_dict(config),
      "model": model_config,
      "mesh": None if mesh is None else str(mesh),
      "process_count": jax.process_count(),
      "tokenizer": files,
  }


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for name, value in tree.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f"{prefix}{name}."))
    else:
      out[f"{prefix}{name}"] = value
  return out


def _resumable(path: str) -> bool:
  return any(path == f or path.startswith(f + ".") for f in RESUMABLE_FIELDS)


def config_changes(
    saved: dict[str, Any], current: dict[str, Any]
) -> list[tuple[str, Any, Any]]:
  """The config fields that differ, as ``(dotted path, saved, current)``.

  A field the saved config lacks (added to the code since) counts as
  unchanged when the current value is the field's default.

  Example:
    >>> from logra_jax.configs import apply_overrides
    >>> old = to_dict(TrainConfig())
    >>> new = to_dict(apply_overrides(TrainConfig(), ["optimizer.rank=8"]))
    >>> config_changes(old, new)
    [('optimizer.rank', 32, 8)]
  """
  missing = object()
  defaults = _flatten(to_dict(TrainConfig()))
  old, new = _flatten(saved), _flatten(current)
  changes = []
  for path in sorted(set(old) | set(new)):
    before, after = old.get(path, missing), new.get(path, missing)
    if before is missing and after == defaults.get(path, missing):
      continue
    if before != after:
      changes.append(
          (
              path,
              "<absent>" if before is missing else before,
              "<absent>" if after is missing else after,
          )
      )
  return changes


def check_resumable(
    saved: dict[str, Any], current: dict[str, Any], allow_reshard: bool = False
) -> None:
  """Raises if a run described by ``current`` may not resume ``saved``.

  Both are :func:`run_meta` dicts. Refused: another checkpoint format, any
  config change outside :data:`RESUMABLE_FIELDS` (e.g. the rank, the
  optimizer, the learning rate, the task, the seed), another model, and
  (unless ``allow_reshard``) another mesh or process count.

  Raises:
    CheckpointError: naming every offending field with both values.

  Example:
    >>> saved = run_meta(TrainConfig(), {"hidden_size": 64})
    >>> more_steps = run_meta(TrainConfig(steps=500), {"hidden_size": 64})
    >>> check_resumable(saved, more_steps)   # allowed: nothing raised
    >>> wider = run_meta(TrainConfig(), {"hidden_size": 128})
    >>> check_resumable(saved, wider)
    Traceback (most recent call last):
    ...
    logra_jax.checkpoint.CheckpointError: ... hidden_size is 64 ... but 128 in this run
  """
  if saved.get("format") != FORMAT_VERSION:
    raise CheckpointError(
        f"cannot resume: the checkpoint has format {saved.get('format')!r}, "
        f"this version of logra-jax reads format {FORMAT_VERSION}"
    )
  refused = [
      c
      for c in config_changes(saved["config"], current["config"])
      if not _resumable(c[0])
  ]
  if refused:
    listed = "; ".join(
        f"{path} is {old!r} in the checkpoint but {new!r} now"
        for path, old, new in refused
    )
    raise CheckpointError(
        f"cannot resume: the config differs from the checkpoint's in fields "
        f"that change what its state means: {listed}. Only "
        f"{', '.join(RESUMABLE_FIELDS)} may change when resuming; start a new "
        f"run (another --out) for the rest"
    )
  old_model, new_model = (
      {k: v for k, v in m.items() if k not in _VOLATILE_MODEL_KEYS}
      for m in (saved["model"], current["model"])
  )
  if old_model != new_model:
    keys = sorted(
        k
        for k in set(old_model) | set(new_model)
        if old_model.get(k) != new_model.get(k)
    )
    listed = "; ".join(
        f"{k} is {old_model.get(k)!r} in the checkpoint but "
        f"{new_model.get(k)!r} in this run"
        for k in keys
    )
    raise CheckpointError(
        f"cannot resume: the checkpoint is of another model: {listed}"
    )
  if not allow_reshard:
    for field, what in (("mesh", "mesh"), ("process_count", "process count")):
      if saved.get(field) != current.get(field):
        raise CheckpointError(
            f"cannot resume: the checkpoint was written with {what} "
            f"{saved.get(field) or 'none (one device)'} but this run has "
            f"{current.get(field) or 'none (one device)'}; pass "
            f"allow_reshard=True (logra train --allow-reshard) to restore it "
            f"into this layout (results then differ by float rounding)"
        )


def abstract_state(tree: Any, shardings: Any = None) -> Any:
  """``jax.ShapeDtypeStruct`` leaves with shardings: the restore target.

  Args:
    tree: arrays or ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape``).
    shardings: a tree of shardings like ``tree``, one sharding for all
      leaves, or None to keep each leaf's own ``.sharding``.

  Returns:
    A tree like ``tree`` of ``jax.ShapeDtypeStruct``.

  Example:
    >>> import jax.numpy as jnp
    >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> abstract_state({"w": jnp.zeros((2, 3))}, one)["w"].shape
    (2, 3)
  """

  def leaf(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  if shardings is None:
    return jax.tree.map(lambda x: leaf(x, x.sharding), tree)
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: leaf(x, shardings), tree)
  return jax.tree.map(leaf, tree, shardings)


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


def _json_checksum(value: Any) -> str:
  """CRC-32 of ``value`` as canonical JSON."""
  return f"{zlib.crc32(json.dumps(value, sort_keys=True).encode()):08x}"


def _without_digest(meta: dict[str, Any]) -> dict[str, Any]:
  return {k: v for k, v in meta.items() if k != "digest"}


def _without_empty(tree: Any) -> Any:
  """``tree`` with None for its arrays of no elements, which Orbax cannot
  write and which hold no data."""
  return jax.tree.map(lambda x: None if x.size == 0 else x, tree)


def _with_empty(restored: Any, target: Any) -> Any:
  """``restored`` (read for :func:`_without_empty` of ``target``) with the
  arrays of no elements rebuilt from the abstract ``target``."""

  def leaf(want, got):
    if want.size:
      return got
    return jnp.zeros(want.shape, want.dtype, device=want.sharding)

  return jax.tree.map(leaf, target, restored)


def _first_line(error: BaseException) -> str:
  """``Type: first line of the message`` (tensorstore's run to pages)."""
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _describe_steps(steps: Sequence[int]) -> str:
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
    >>> params = {"w": jnp.arange(3.0)}
    >>> opt_state = optax.adam(0.1).init(params)
    >>> with Checkpointer(tempfile.mkdtemp() + "/checkpoints") as ckpt:
    ...   ckpt.save(1, params=params, opt_state=opt_state,
    ...             meta={"format": FORMAT_VERSION},
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
    handlers = {name: ocp.StandardCheckpointHandler() for name in _ARRAY_ITEMS}
    handlers.update(
        loop=ocp.JsonCheckpointHandler(), meta=ocp.JsonCheckpointHandler()
    )
    with _quiet_absl("read only"):  # read_only is what was asked for
      self._manager = ocp.CheckpointManager(
          self.directory, options=options, item_handlers=handlers
      )
    self._closed = False
    self._clock = clock
    self._last_save = clock()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Waits for a pending asynchronous save and releases the manager; once
    it returns, nothing runs in the background. Later calls do nothing."""
    if not self._closed:
      self._closed = True
      self._manager.close()

  def wait(self) -> None:
    """Blocks until a pending asynchronous save is finished on disk."""
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
    the checksums (:func:`array_checksums`) of the arrays and of ``loop``,
    and one of itself.

    Args:
      step: learner steps done (the checkpoint's name).
      params: policy parameters.
      opt_state: optimizer state.
      loop: host-side loop state.
      meta: :func:`run_meta` of the run.
      ref_params: reference parameters, if the run holds them.
      eval_accuracy: held-out accuracy measured at this step, for keeping
        the best checkpoints.
      wait: block until the checkpoint is on disk.

    Raises:
      CheckpointError: if a checkpoint of ``step`` already exists.
    """
    if step in self.all_steps():
      raise CheckpointError(
          f"a checkpoint of step {step} already exists in " f"{self.directory}"
      )
    trees = {"params": params, "opt_state": opt_state, "ref_params": ref_params}
    trees = {k: _without_empty(v) for k, v in trees.items() if v is not None}
    loop_json = loop.to_json()
    checksums = {k: checksums.array_checksums(v) for k, v in trees.items()}
    checksums["loop"] = _json_checksum(loop_json)
    meta = dict(_without_digest(meta), checksums=checksums)
    meta["digest"] = _json_checksum(meta)
    items = {k: ocp.args.StandardSave(v) for k, v in trees.items()}
    items.update(
        loop=ocp.args.JsonSave(loop_json), meta=ocp.args.JsonSave(meta)
    )
    metrics = (
        None if eval_accuracy is None else {BEST_METRIC: float(eval_accuracy)}
    )
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
    """The :func:`run_meta` stored with checkpoint ``step`` (default: the
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
    if not isinstance(meta, dict) or "format" not in meta:
      raise CorruptCheckpointError(
          f"checkpoint {path}: meta is not a " "logra-jax run description"
      )
    digest = meta.get("digest")
    if digest is not None and digest != _json_checksum(_without_digest(meta)):
      raise CorruptCheckpointError(
          f"checkpoint {path}: its description (meta) does not match its "
          "checksum: damaged after the save"
      )
    if meta["format"] != FORMAT_VERSION:
      raise CheckpointError(
          f"checkpoint {path} has format {meta['format']!r}; this version of "
          f"logra-jax reads format {FORMAT_VERSION}"
      )
    if digest is None:
      raise CorruptCheckpointError(
          f"checkpoint {path}: its description " "(meta) has no checksum"
      )
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
    if saved_tree is None:
      raise CorruptCheckpointError(f"checkpoint {path} is missing")
    saved = {
        m.name: m for m in jax.tree.leaves(saved_tree) if hasattr(m, "shape")
    }
    wanted = {
        checksums.array_name(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]
    }
    problems = [
        f"{k} is missing from the checkpoint" for k in wanted if k not in saved
    ]
    problems += [
        f"{k} is in the checkpoint but not in this run"
        for k in saved
        if k not in wanted
    ]
    for k in wanted.keys() & saved.keys():
      a, b = saved[k], wanted[k]
      if tuple(a.shape) != tuple(b.shape) or np.dtype(a.dtype) != np.dtype(
          b.dtype
      ):
        problems.append(
            f"{k} is {np.dtype(a.dtype).name}{list(a.shape)} in "
            f"the checkpoint but {np.dtype(b.dtype).name}"
            f"{list(b.shape)} in this run"
        )
    if problems:
      more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
      raise CheckpointError(
          f"checkpoint {path} does not match this run's {name}: "
          + "; ".join(sorted(problems)[:5])
          + more
      )

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
      expected_meta: this run's :func:`run_meta`; if given, checked with
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
    stored = {k: _without_empty(v) for k, v in targets.items()}
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
    self._verify(step, meta["checksums"], restored)
    trees = {k: _with_empty(restored[k], v) for k, v in targets.items()}
    return Restored(
        step=step,
        params=trees["params"],
        opt_state=trees.get("opt_state"),
        ref_params=trees.get("ref_params"),
        loop=loop,
        meta=meta,
    )

  def _verify(
      self, step: int, checksums: dict[str, Any], restored: Any
  ) -> None:
    """Compares the items read from checkpoint ``step`` with the checksums
    written with them."""
    where = f"checkpoint {self.directory / str(step)} (step {step})"
    if _json_checksum(restored.loop) != checksums.get("loop"):
      raise CorruptCheckpointError(
          f"{where}: loop (step, PRNG key, data position, history) does not "
          "match its checksum: damaged after the save"
      )
    for item in _ARRAY_ITEMS:
      if item not in restored.keys():
        continue
      written = checksums.get(item, {})
      for name, value in checksums.array_checksums(restored[item]).items():
        if written.get(name) != value:
          raise CorruptCheckpointError(
              f"{where}: array {item}.{name} does not match its checksum "
              f"(written {written.get(name)}, read {value}): damaged after "
              "the save"
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


def export_policy(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: Optional[int] = None,
    overwrite: bool = False,
) -> pathlib.Path:
  """Writes a checkpoint's policy as a Hugging Face folder.

  ``config.json`` and safetensors (``models.save_pretrained``) plus the
  tokenizer files stored in the checkpoint; ``transformers`` loads the
  folder with ``AutoModelForCausalLM`` and ``AutoTokenizer``. The folder is
  assembled next to ``out`` and renamed into place when complete.

  Args:
    checkpoint: a run folder, its ``checkpoints`` folder or one step in it.
    out: the HF folder to write.
    step: which checkpoint (default: the one ``checkpoint`` names, else the
      latest).
    overwrite: replace an existing ``out``.

  Returns:
    ``out``.

  Raises:
    CheckpointError: no (readable) checkpoint.
    CorruptCheckpointError: the checkpoint's policy does not match its
      checksums (nothing is written).
    FileExistsError: ``out`` is a file, or exists and ``overwrite`` is
      False.

  Example:
    >>> export_policy("runs/tiny-20250101-000000", "exported")  # doctest: +SKIP
  """
  import transformers  # Heavy import, only needed here.
  from flax import nnx
  from logra_jax import models

  directory, named_step = locate(checkpoint)
  out = pathlib.Path(out).absolute()
  if out.exists() and not out.is_dir():
    raise FileExistsError(
        f"{out} is a file, not a folder: export writes a "
        "Hugging Face folder; choose another --out"
    )
  if out.exists() and not overwrite:
    raise FileExistsError(
        f"{out} exists; pass overwrite=True (--overwrite) " "to replace it"
    )
  with Checkpointer(directory, read_only=True) as ckpt:
    meta = ckpt.read_meta(step if step is not None else named_step)
    dtype = meta["config"]["policy"]["dtype"]
    with tempfile.TemporaryDirectory() as tmp:
      (pathlib.Path(tmp) / "config.json").write_text(json.dumps(meta["model"]))
      hf_config = transformers.AutoConfig.from_pretrained(tmp)
    config = models.DecoderConfig.from_hf(
        hf_config, param_dtype=dtype, dtype=dtype
    )
    abstract = nnx.eval_shape(lambda: models.Decoder(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract, nnx.Param)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    optimizer = OptimizerConfig(**meta["config"]["optimizer"])
    tx = policy_state.make_optimizer(optimizer, abstract_params)
    restored = ckpt.restore(
        step if step is not None else named_step,
        params=abstract_state(
            policy_state.abstract_weights(optimizer, tx, abstract_params), one
        ),
        opt_state=abstract_state(
            policy_state.abstract_opt_state(optimizer, tx, abstract_params), one
        ),
    )
    # A factored policy is written as its weights W = c B + P A, a LoRA one
    # as W_0 + s D U.
    params = policy_state.dense_weights(restored.params, restored.opt_state)
  out.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(
      tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent)
  )
  try:
    folder = staging / out.name
    models.save_pretrained(nnx.merge(graphdef, params), folder)
    for name, data in meta.get("tokenizer", {}).items():
      (folder / name).write_bytes(base64.b64decode(data))
    if out.exists():
      shutil.rmtree(out)
    os.replace(folder, out)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return out
