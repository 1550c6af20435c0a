"""Whose a folder is: a run's lock, and the folders ``--overwrite`` may
replace.

A run holds ``<run>/.lock`` (:func:`run_lock`) while it writes its folder;
an export marks its folder with :data:`EXPORT_MARKER`, which lists the files
it wrote. Whatever replaces a folder asks :func:`check_replaceable` first, so
that it replaces only a folder of its own kind and never a live run's.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable

import filelock

EXPORT_MARKER = "logra_export.json"

# What a run folder holds besides its checkpoints (rl/trainer.py and
# rl/run_log.py write them).
_RUN_FILES = ("checkpoints", "config.yaml", "metrics.jsonl", "summary.json")
# The files of an export written before exports were marked: the model's
# config and weights and the tokenizer's files, nothing else.
_POLICY_NAMES = (
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def run_lock(folder: str | os.PathLike) -> filelock.FileLock:
  """The lock a run holds on its folder (``<folder>/.lock``).

  The lock dies with its process: a killed run leaves no stale lock.

  Example:
    >>> run_lock("runs/tiny").lock_file.endswith("runs/tiny/.lock")
    True
  """
  return filelock.FileLock(pathlib.Path(folder) / ".lock")


def in_use(folder: str | os.PathLike) -> bool:
  """Whether a live run (of any process) holds ``folder``'s lock.

  Example:
    >>> in_use("/nonexistent")
    False
  """
  if not (pathlib.Path(folder) / ".lock").is_file():
    return False
  lock = run_lock(folder)
  try:
    lock.acquire(timeout=0)
  except filelock.Timeout:
    return True
  lock.release()
  return False


def write_marker(folder: pathlib.Path, source: pathlib.Path) -> None:
  """Marks ``folder`` as an export of the checkpoints in ``source``,
  listing the files in it (and the marker)."""
  files = sorted({p.name for p in folder.iterdir()} | {EXPORT_MARKER})
  record = {"checkpoints": str(source), "files": files}
  (folder / EXPORT_MARKER).write_text(json.dumps(record, indent=1) + "\n")


def _policy_file(path: pathlib.Path) -> bool:
  """Whether ``path`` is a file an export writes (an unmarked, older one)."""
  name = path.name
  return path.is_file() and (
      name in _POLICY_NAMES
      or name.startswith("tokenizer")
      or name.endswith((".safetensors", ".safetensors.index.json"))
  )


def _listed_files(out: pathlib.Path) -> set[str]:
  """The files ``out``'s export wrote: its marker's list; for an unmarked
  folder holding only a policy's files (an export older than the marker),
  those."""
  marker = out / EXPORT_MARKER
  fix = "; choose another --out"
  if not marker.is_file():
    entries = list(out.iterdir())
    if (out / "config.json").is_file() and all(map(_policy_file, entries)):
      return {p.name for p in entries}
    raise FileExistsError(
        f"{out} was not written by logra export (no {EXPORT_MARKER}): it is "
        f"not replaced{fix}, or remove it first"
    )
  try:
    return set(json.loads(marker.read_text())["files"])
  except (ValueError, KeyError, TypeError):
    raise FileExistsError(f"{marker} is not an export's record{fix}") from None


def _contains(folder: pathlib.Path, paths: Iterable[pathlib.Path]) -> bool:
  """Whether ``folder`` is one of ``paths`` or an ancestor of one."""
  return any(folder == p or folder in p.parents for p in paths)


def check_replaceable(out: pathlib.Path, source: pathlib.Path) -> None:
  """Raises FileExistsError unless ``out`` is an export's folder (marked by
  :data:`EXPORT_MARKER`, holding only the files it lists; or, written before
  the marker, holding only a policy's config, weights and tokenizer files)
  that neither holds nor lies in the checkpoint folder ``source`` and is no
  live run's.

  Example:
    >>> import tempfile
    >>> run = pathlib.Path(tempfile.mkdtemp())
    >>> check_replaceable(run, run / "checkpoints")
    Traceback (most recent call last):
    ...
    FileExistsError: ... holds the checkpoints being exported ...
  """
  resolved, source = out.resolve(), source.resolve()
  fix = "; choose another --out"
  if _contains(resolved, [source]) or source in resolved.parents:
    raise FileExistsError(
        f"{out} holds the checkpoints being exported ({source}) or lies in "
        f"them: it is never replaced{fix}"
    )
  if in_use(out):
    raise FileExistsError(
        f"{out} is in use by a run (it holds {out / '.lock'}): it is not "
        f"replaced{fix}"
    )
  if any((out / name).exists() for name in _RUN_FILES):
    raise FileExistsError(
        f"{out} is a run folder, not an export: it is not replaced{fix}"
    )
  listed = _listed_files(out)
  extra = sorted(p.name for p in out.iterdir() if p.name not in listed)
  if extra:
    raise FileExistsError(
        f"{out} holds files logra export did not write ({', '.join(extra)}):"
        f" it is not replaced{fix}, or remove them first"
    )
