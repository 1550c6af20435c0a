"""A run's description and whether a run may resume a checkpoint.

Each checkpoint stores the :func:`run_meta` of its run; a run resumes it only
if :func:`check_resumable` finds the same format, the same model, the same
config outside :data:`RESUMABLE_FIELDS` and (unless resharding is allowed)
the same mesh and process count.
"""

from __future__ import annotations

import base64
import pathlib
import tempfile
from typing import Any

import jax

from logra_jax.checkpoint.errors import CheckpointError
from logra_jax.configs import TrainConfig, to_dict

# 2: checksums in ``meta``, arrays without elements not written.
# 3: projected weights of LoGRA's sketch mode saved factored (B, A, c).
FORMAT_VERSION = 3
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
    "policy.batch_invariant",
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
      :func:`~logra_jax.checkpoint.export_policy` needs nothing but the
      checkpoint; None: none.
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
  """Nested dicts as one dict of dotted paths."""
  out = {}
  for name, value in tree.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f"{prefix}{name}."))
    else:
      out[f"{prefix}{name}"] = value
  return out


def _resumable(path: str) -> bool:
  """Whether the config field ``path`` may change when resuming."""
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


def _check_config(saved: dict[str, Any], current: dict[str, Any]) -> None:
  """Refuses a config change outside :data:`RESUMABLE_FIELDS`."""
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


def check_resumable_config(saved: dict[str, Any], config: TrainConfig) -> None:
  """Raises if ``config`` may not resume the run ``saved`` (a
  :func:`run_meta` dict) because a field outside :data:`RESUMABLE_FIELDS`
  differs: the part of :func:`check_resumable` that needs no model, so that
  a run can refuse before it loads one.

  Raises:
    CheckpointError: naming every offending field with both values.

  Example:
    >>> saved = run_meta(TrainConfig(), {"hidden_size": 64})
    >>> check_resumable_config(saved, TrainConfig(steps=500))  # allowed
    >>> check_resumable_config(saved, TrainConfig(seed=1))
    Traceback (most recent call last):
    ...
    logra_jax.checkpoint.errors.CheckpointError: ... seed is 0 in the checkpoint but 1 now...
  """
  _check_config(saved, {"config": to_dict(config)})


def _check_model(saved: dict[str, Any], current: dict[str, Any]) -> None:
  """Refuses another model (the HF config, less its volatile keys)."""
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


def _check_layout(saved: dict[str, Any], current: dict[str, Any]) -> None:
  """Refuses another mesh or process count."""
  for field, what in (("mesh", "mesh"), ("process_count", "process count")):
    if saved.get(field) != current.get(field):
      raise CheckpointError(
          f"cannot resume: the checkpoint was written with {what} "
          f"{saved.get(field) or 'none (one device)'} but this run has "
          f"{current.get(field) or 'none (one device)'}; pass "
          f"allow_reshard=True (logra train --allow-reshard) to restore it "
          f"into this layout (results then differ by float rounding)"
      )


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
    logra_jax.checkpoint.errors.CheckpointError: ... hidden_size is 64 ... but 128 in this run
  """
  if saved.get("format") != FORMAT_VERSION:
    raise CheckpointError(
        f"cannot resume: the checkpoint has format {saved.get('format')!r}, "
        f"this version of logra-jax reads format {FORMAT_VERSION}"
    )
  _check_config(saved, current)
  _check_model(saved, current)
  if not allow_reshard:
    _check_layout(saved, current)
