"""Environments by name, import path or file path, checked before a run.

``task.environment`` names a factory: ``"calculator"`` (shipped),
``"package.module:factory"`` or ``"path/to/file.py:factory"``. The factory
takes no arguments and returns a new :class:`~logra_jax.envs.base.Environment`
(one per episode): an object with ``reset`` and ``step`` methods.
``"verifiers:package.module"`` or ``"verifiers:path/to/file.py"`` names a
``verifiers.v1`` taskset instead (:mod:`logra_jax.envs.verifiers_source`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable

from logra_jax.deadlines import call_bounded
from logra_jax.envs.base import Environment
from logra_jax.envs.calculator import calculator
from logra_jax.envs.verifiers_source import load_verifiers
from logra_jax.envs.verifiers_source import PREFIX as VERIFIERS
from logra_jax.envs.verifiers_source import VerifiersTaskset

Factory = Callable[[], Environment]

SHIPPED: dict[str, Factory] = {"calculator": calculator}


def _import(spec: str, where: str):
  """The module at ``where`` (a dotted name or a ``.py`` file)."""
  if where.endswith(".py"):
    if not os.path.isfile(where):
      raise FileNotFoundError(
          f"task.environment={spec!r}: file {where} not found"
      )
    name = "logra_environment_" + os.path.splitext(os.path.basename(where))[0]
    module_spec = importlib.util.spec_from_file_location(name, where)
    module = importlib.util.module_from_spec(module_spec)
    load = lambda: module_spec.loader.exec_module(module)  # noqa: E731
  else:
    module = None
    load = lambda: importlib.import_module(where)  # noqa: E731
  try:
    loaded = load()
  except (Exception, SystemExit) as e:  # noqa: BLE001 -- user code's import.
    raise ValueError(
        f"task.environment={spec!r}: {where} does not import: "
        f"{type(e).__name__}: {e}"
    ) from None
  return module if module is not None else loaded


def check_spec(spec: str) -> None:
  """Raises ValueError unless ``spec`` is a shipped name or has the form
  ``where:factory`` or ``verifiers:where``.

  Example:
    >>> check_spec("calculator")
  """
  if spec.startswith(VERIFIERS):
    if not spec[len(VERIFIERS) :]:
      raise ValueError(
          f"task.environment={spec!r} must name a module or a .py file after "
          f"{VERIFIERS!r}"
      )
    return
  where, sep, name = spec.rpartition(":")
  if spec not in SHIPPED and not (sep and where and name):
    raise ValueError(
        f"task.environment={spec!r} must be one of {sorted(SHIPPED)}, "
        "package.module:factory or path/to/file.py:factory"
    )


def load_environment(
    spec: str, *, timeout_s: float = 30.0
) -> Factory | VerifiersTaskset:
  """The environment factory ``spec`` names, tried once (or the
  ``verifiers.v1`` taskset a ``verifiers:`` spec names, loaded).

  The factory is called once here and what it returns must have callable
  ``reset`` and ``step``, so that a bad environment fails before a run
  compiles anything. The module's import and that call each have
  ``timeout_s`` seconds (:func:`~logra_jax.deadlines.call_bounded`): one
  that hangs is refused, not waited for.

  Args:
    spec: a name of :data:`SHIPPED`, ``"package.module:factory"``,
      ``"path/to/file.py:factory"`` (relative to the working directory) or
      ``"verifiers:<module or file.py>"``.
    timeout_s: the time limit of the import and of the factory's call.

  Returns:
    The factory, or the :class:`VerifiersTaskset`.

  Raises:
    ValueError: an unknown name, a module that does not import (or not
      within ``timeout_s``), no such attribute, a factory that is not
      callable, raises, does not return within ``timeout_s``, or returns
      something without ``reset`` and ``step``; one line naming ``spec``.
    FileNotFoundError: a ``.py`` file that does not exist.

  Example:
    >>> load_environment("calculator")().reset({"prompt": "2*3="})
    [{'role': 'user', 'content': '2*3='}]
  """
  check_spec(spec)
  if spec.startswith(VERIFIERS):
    return load_verifiers(spec)
  if spec in SHIPPED:
    factory = SHIPPED[spec]
  else:
    where, _, name = spec.rpartition(":")
    try:
      module = call_bounded(lambda: _import(spec, where), timeout_s)
    except TimeoutError:
      raise ValueError(
          f"task.environment={spec!r}: importing {where} did not finish "
          f"within {timeout_s:g} s"
      ) from None
    factory = getattr(module, name, None)
    if factory is None:
      raise ValueError(
          f"task.environment={spec!r}: {where} has no attribute {name!r}"
      )
  if not callable(factory):
    raise ValueError(
        f"task.environment={spec!r}: {type(factory).__name__} is not "
        "callable; it must be a factory returning an environment"
    )
  try:
    environment = call_bounded(factory, timeout_s)
  except TimeoutError:
    raise ValueError(
        f"task.environment={spec!r}: the factory did not return within "
        f"{timeout_s:g} s"
    ) from None
  except Exception as e:  # noqa: BLE001 -- user code, reported in one line.
    raise ValueError(
        f"task.environment={spec!r}: the factory raised "
        f"{type(e).__name__}: {e}"
    ) from None
  missing = [
      method
      for method in ("reset", "step")
      if not callable(getattr(environment, method, None))
  ]
  if missing:
    raise ValueError(
        f"task.environment={spec!r}: the factory returned a "
        f"{type(environment).__name__} without {' and '.join(missing)}; an "
        "environment has reset(example) and step(model_message)"
    )
  return factory
