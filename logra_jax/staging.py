"""Folders written beside their destination and renamed into place.

A leaf module (standard library only): whatever writes a folder a reader
may open (an exported policy, a converted checkpoint, a cache entry) stages
it with :func:`staged_folder` (or, to publish it its own way, in a
:func:`staging_area`), so that an interrupted write never leaves a
half-written folder under the final name.

A staging area is a hidden folder ``.<name>.partial-*`` beside the
destination that names its owner (process id and host). A process killed
outright (``SIGKILL``, a lost machine) cannot remove its area; the next
write of the same destination on that host clears every area whose owner
is gone, and finishes a publication the kill cut between its two renames
(the old folder moved aside, the complete new one not yet in place), so the
destination is never left missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator

_OWNER = ".owner"  # {"pid": ..., "host": ...}
_READY = ".ready"  # the new folder is complete: publishing has begun
# An area without an owner file (its writer died before writing one, or an
# older version made it) is cleared once it is this old.
UNOWNED_STALE_S = 600.0


def _owner_gone(area: pathlib.Path) -> bool:
  """Whether the process that made ``area`` has ended (on this host)."""
  try:
    owner = json.loads((area / _OWNER).read_text())
    pid, host = int(owner["pid"]), str(owner["host"])
  except FileNotFoundError:
    try:
      return time.time() - area.stat().st_mtime > UNOWNED_STALE_S
    except FileNotFoundError:
      return False  # removed meanwhile
  except (OSError, ValueError, KeyError, TypeError):
    return False  # unreadable: leave it to a person
  if host != socket.gethostname():
    return False  # another machine's process: nothing to ask about
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except PermissionError:
    return False  # alive, another user's
  return False


def _finish_or_discard(area: pathlib.Path, out: pathlib.Path) -> None:
  """Completes a publication cut between its renames, then removes ``area``."""
  new, old = area / out.name, area / f"{out.name}.replaced"
  if not out.exists():
    if (area / _READY).exists() and new.is_dir():
      os.replace(new, out)
    elif old.is_dir():
      os.replace(old, out)
  shutil.rmtree(area, ignore_errors=True)


def clear_stale(out: str | os.PathLike) -> None:
  """Clears the staging areas of ``out`` whose writers are gone (see the
  module's docstring); an area of a live writer is left alone.

  Example:
    >>> import tempfile
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "policy"
    >>> clear_stale(out)  # nothing to clear
  """
  out = pathlib.Path(out)
  if not out.parent.is_dir():
    return
  for area in out.parent.glob(f".{out.name}.partial-*"):
    if area.is_dir() and _owner_gone(area):
      _finish_or_discard(area, out)


@contextlib.contextmanager
def staging_area(out: str | os.PathLike) -> Iterator[pathlib.Path]:
  """Yields a new private folder beside ``out`` (on its file system, so a
  rename from it to ``out`` is atomic), marked with this process as its
  owner, and removes it when the block ends; the stale areas of ``out``
  are cleared first (:func:`clear_stale`).

  Args:
    out: the destination; its parent is created if needed.

  Yields:
    The staging area; write at ``area / out.name``.

  Example:
    >>> import tempfile
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "policy"
    >>> with staging_area(out) as area:
    ...   area.name.startswith(".policy.partial-")
    True
    >>> area.exists()
    False
  """
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  clear_stale(out)
  area = pathlib.Path(
      tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent)
  )
  try:
    (area / _OWNER).write_text(
        json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
    )
    yield area
  finally:
    shutil.rmtree(area, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike) -> Iterator[pathlib.Path]:
  """Yields a path beside ``out`` to write a folder at; renames it to ``out``
  when the block ends without an error.

  The path lies in a :func:`staging_area` of ``out``; the caller creates
  the folder (``mkdir`` or a writer that makes it). An existing ``out`` is
  moved into the area first and deleted with it: readers see the old
  folder or the new one, never a mix. On an error the area is deleted and
  ``out`` is left as it was; after a kill, the next write of ``out``
  clears the area (and puts a folder back at ``out`` if the kill came
  between the two renames).

  Args:
    out: the folder to write; its parent is created if needed.

  Yields:
    The path to create the new folder at.

  Example:
    >>> import tempfile
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "policy"
    >>> with staged_folder(out) as folder:
    ...   folder.mkdir()
    ...   _ = (folder / "config.json").write_text("{}")
    ...   out.exists()
    False
    >>> sorted(p.name for p in out.parent.iterdir())
    ['policy']
  """
  out = pathlib.Path(out)
  with staging_area(out) as area:
    folder = area / out.name
    yield folder
    (area / _READY).touch()
    if out.exists():
      os.replace(out, area / f"{out.name}.replaced")
    os.replace(folder, out)
