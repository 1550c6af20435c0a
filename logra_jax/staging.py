"""Folders written beside their destination and renamed into place.

A leaf module (standard library only): whatever writes a folder a reader
may open (an exported policy, a converted checkpoint, a cache entry) stages
it with :func:`staged_folder` (or, to publish it its own way, in a
:func:`staging_area`, checking and renaming under :func:`locked` of the
parent), so that an interrupted write never leaves a
half-written folder under the final name.

A staging area is a hidden folder ``.<name>.partial-*`` beside the
destination that names its owner: destination, host, boot, process id
namespace, process id and the process's start time. A process killed
outright (``SIGKILL``, a lost machine) cannot remove its area; the next
write of the same destination on that host clears every area whose owner
is gone (not running since the owner's boot, or its process id now another
process's), and finishes a publication the kill cut between its two
renames (the old folder moved aside, the complete, synced new one not yet
in place), so the destination is never left missing. An area whose owner
cannot be told (another host, another process id namespace, an unreadable
owner file) is left alone. Clearing and publishing hold an exclusive lock
on the parent folder, so two writers never act on one area at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import pathlib
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from typing import Any

_OWNER = ".owner"  # who made the area (see `_this_process`)
_READY = ".ready"  # the new folder is complete and synced: publishing began
# An area without an owner file (its writer died before writing one, or an
# older version made it) is cleared once it is this old.
UNOWNED_STALE_S = 86400.0


def _read(path: str) -> str | None:
  try:
    with open(path) as file:
      return file.read()
  except OSError:
    return None


def _start_time(pid: int) -> str | None:
  """The process's start time in clock ticks since boot (Linux), or None."""
  stat = _read(f"/proc/{pid}/stat")
  return None if stat is None else stat.rsplit(")", 1)[1].split()[19]


def _pid_namespace() -> int | None:
  try:
    return os.stat("/proc/self/ns/pid").st_ino
  except OSError:
    return None


def _this_process(out: pathlib.Path) -> dict[str, Any]:
  """The owner record of an area made by this process for ``out``."""
  boot = _read("/proc/sys/kernel/random/boot_id")
  return {
      "out": out.name,
      "host": socket.gethostname(),
      "boot": None if boot is None else boot.strip(),
      "pid_namespace": _pid_namespace(),
      "pid": os.getpid(),
      "start": _start_time(os.getpid()),
  }


def _owner_gone(area: pathlib.Path, out: pathlib.Path) -> bool:
  """Whether the process that made ``area`` (an area of ``out``) has
  ended; False whenever that cannot be told."""
  try:
    owner = json.loads((area / _OWNER).read_text())
    pid = int(owner["pid"])
  except FileNotFoundError:
    try:
      return time.time() - area.stat().st_mtime > UNOWNED_STALE_S
    except FileNotFoundError:
      return False  # removed meanwhile
  except (OSError, ValueError, KeyError, TypeError):
    return False  # unreadable: leave it to a person
  here = _this_process(out)
  if owner.get("out") != out.name or owner.get("host") != here["host"]:
    return False  # another destination's, or another machine's
  if owner.get("boot") != here["boot"]:
    return True  # made before this host's last boot
  if owner.get("pid_namespace") != here["pid_namespace"]:
    return False  # another container's: its process ids mean nothing here
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except PermissionError:
    pass  # alive, another user's
  start = owner.get("start")
  return start is not None and _start_time(pid) not in (None, start)


@contextlib.contextmanager
def locked(folder: str | os.PathLike) -> Iterator[None]:
  """An exclusive lock on ``folder`` (``flock`` on the folder itself, so
  nothing is left beside it): the lock that clearing and publishing of the
  folders in it hold, for a writer that publishes its own way.

  Example:
    >>> import tempfile
    >>> with locked(tempfile.mkdtemp()):
    ...   pass
  """
  fd = os.open(folder, os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # releases the lock


def _finish_or_discard(area: pathlib.Path, out: pathlib.Path) -> None:
  """Puts a complete new folder in place when a kill came between moving
  the old one aside and renaming the new one in, then removes ``area``."""
  new = area / out.name
  if not os.path.lexists(out) and (area / _READY).exists() and new.is_dir():
    os.replace(new, out)
  shutil.rmtree(area, ignore_errors=True)


def clear_stale(out: str | os.PathLike) -> None:
  """Clears the staging areas of ``out`` whose writers are gone (see the
  module's docstring); an area of a live writer, or one whose writer
  cannot be told, is left alone.

  Example:
    >>> import tempfile
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "policy"
    >>> clear_stale(out)  # nothing to clear
  """
  out = pathlib.Path(out)
  if not out.parent.is_dir():
    return
  pattern = f".{glob.escape(out.name)}.partial-*"
  with locked(out.parent):
    for area in out.parent.glob(pattern):
      if area.is_dir() and _owner_gone(area, out):
        _finish_or_discard(area, out)


def _fsync(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _sync_tree(folder: pathlib.Path) -> None:
  """Flushes every file under ``folder``, and the folders, to the disk."""
  for root, _, files in os.walk(folder):
    for name in files:
      _fsync(os.path.join(root, name))
    _fsync(root)


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
    (area / _OWNER).write_text(json.dumps(_this_process(out)))
    yield area
  finally:
    shutil.rmtree(area, ignore_errors=True)


def _publish(area: pathlib.Path, out: pathlib.Path) -> None:
  """Moves ``out`` (if any) aside into ``area`` and the new folder in; if
  the second rename fails, the old folder goes back before the error
  rises."""
  folder, old = area / out.name, area / f"{out.name}.replaced"
  _sync_tree(folder)
  (area / _READY).touch()
  with locked(out.parent):
    moved = os.path.lexists(out)
    if moved:
      os.replace(out, old)
    try:
      os.replace(folder, out)
    except BaseException:
      if moved and not os.path.lexists(out):
        os.replace(old, out)
      raise


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike) -> Iterator[pathlib.Path]:
  """Yields a path beside ``out`` to write a folder at; renames it to ``out``
  when the block ends without an error.

  The path lies in a :func:`staging_area` of ``out``; the caller creates
  the folder (``mkdir`` or a writer that makes it). The new folder is
  synced to the disk, then an existing ``out`` is moved into the area and
  deleted with it: readers see the old folder or the new one, never a
  mix. On an error (in the block, or a failed rename) the area is deleted
  and ``out`` is left as it was; after a kill, the next write of ``out``
  clears the area (and puts the new folder at ``out`` if the kill came
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
    yield area / out.name
    _publish(area, out)
