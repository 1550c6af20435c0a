"""JAX's persistent compilation cache, on by default for runs.

A short run is dominated by compiling its programs (the sampler, the train
step, the scoring); XLA's compilation is deterministic, so a program
compiled once can be read back from disk by the next run on the same
machine with the same versions, and no number changes. ``logra train``,
``logra eval`` and the studies call :func:`enable_compilation_cache` before
anything compiles.

Where: ``$JAX_COMPILATION_CACHE_DIR`` (or ``jax_compilation_cache_dir``) if
the user set it, else :data:`DEFAULT_DIR` (``~/.cache/logra_jax/xla``, under
``$XDG_CACHE_HOME`` when that is set). Off: ``LOGRA_COMPILATION_CACHE=0``.
Every program is cached, however small or fast to compile (JAX by default
skips those that compile in under a second, most of a small run's).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Optional

import jax

SWITCH = "LOGRA_COMPILATION_CACHE"
OFF = ("0", "false", "off", "no")


def default_dir(environ: Mapping[str, str] = os.environ) -> pathlib.Path:
  """``$XDG_CACHE_HOME/logra_jax/xla``, by default ``~/.cache/logra_jax/xla``.

  Example:
    >>> default_dir({"XDG_CACHE_HOME": "/cache"})
    PosixPath('/cache/logra_jax/xla')
  """
  root = environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(root) / "logra_jax" / "xla"


def enable_compilation_cache(
    environ: Mapping[str, str] = os.environ,
) -> Optional[pathlib.Path]:
  """Turns on JAX's persistent compilation cache for this process.

  Keeps a folder the user chose (``JAX_COMPILATION_CACHE_DIR``, or
  ``jax_compilation_cache_dir`` set before), else uses :func:`default_dir`;
  caches every program (``jax_persistent_cache_min_compile_time_secs`` 0
  unless set in the environment). Does nothing when
  ``LOGRA_COMPILATION_CACHE`` is ``0`` (``false``, ``off``, ``no``).

  Args:
    environ: the environment to read.

  Returns:
    The cache folder, or None when turned off.

  Example:
    >>> enable_compilation_cache({"LOGRA_COMPILATION_CACHE": "0"}) is None
    True
  """
  if environ.get(SWITCH, "1").strip().lower() in OFF:
    return None
  folder = jax.config.jax_compilation_cache_dir
  if not folder:
    folder = str(default_dir(environ))
    jax.config.update("jax_compilation_cache_dir", folder)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return pathlib.Path(folder)
