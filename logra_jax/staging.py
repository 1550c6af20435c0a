"""Folders written beside their destination and renamed into place.

A leaf module (standard library only): whatever writes a folder a reader
may open (an exported policy, a converted checkpoint, a cache entry) stages
it with :func:`staged_folder`, so that an interrupted write never leaves a
half-written folder under the final name.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike) -> Iterator[pathlib.Path]:
  """Yields a path beside ``out`` to write a folder at; renames it to ``out``
  when the block ends without an error.

  The path lies in a hidden staging folder (``.<name>.partial-*``) in
  ``out``'s parent, on the same file system, so the final rename is atomic;
  the caller creates the folder (``mkdir`` or a writer that makes it). An
  existing ``out`` is moved into the staging folder first and deleted with
  it: readers see the old folder or the new one, never a mix. On an error
  the staging folder is deleted and ``out`` is left as it was.

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
  out.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(
      tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent)
  )
  try:
    folder = staging / out.name
    yield folder
    if out.exists():
      os.replace(out, staging / f"{out.name}.replaced")
    os.replace(folder, out)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
