"""``verifiers.v1`` tasksets as a run's environment, checked before a run.

``task.environment=verifiers:<module or path/to/file.py>`` names a module
that exports (in ``__all__``) a ``verifiers.v1.Taskset`` subclass. Each of
the run's examples becomes one task of the taskset's task type: its data
(the taskset's ``TaskData`` type) is built from the example's ``prompt`` and
the columns the data type declares (e.g. ``answer``), so the task's own
``@reward`` functions score it. The taskset's ``load()`` is read once before
the run, to check that it loads and to find its task and data types.

``verifiers`` is an optional dependency (``pip install
'logra-jax[verifiers]'``), imported here only when such a spec is loaded.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
import sys
from typing import Any, Mapping, Optional

PREFIX = "verifiers:"


@dataclasses.dataclass(frozen=True)
class VerifiersTaskset:
  """A loaded ``verifiers.v1`` taskset.

  Attributes:
    spec: the ``task.environment`` that named it.
    taskset_id: the module name ``verifiers`` imports it by.
    taskset: the taskset (its config, toolsets and task type).
    task_type: the taskset's ``Task`` class.
    data_type: the tasks' ``TaskData`` class.
  """

  spec: str
  taskset_id: str
  taskset: Any
  task_type: type
  data_type: type

  def task(self, example: Mapping[str, Any], system_prompt: Optional[str]):
    """The task of ``example``: its ``prompt`` and the columns the data type
    declares, and ``system_prompt`` unless the example has its own.

    Raises:
      ValueError: the example lacks a field the data type requires.
    """
    fields = self.data_type.model_fields
    values = {k: v for k, v in example.items() if k in fields}
    values["prompt"] = str(example["prompt"])
    if system_prompt is not None and values.get("system_prompt") is None:
      values["system_prompt"] = system_prompt
    return self.task_type(self.data_type(**values))


def _module(spec: str, where: str) -> str:
  """Imports ``where`` (a dotted name or a ``.py`` file) and registers it
  under the top-level, lower-case name ``verifiers`` imports tasksets by
  (its loader takes a plugin id for one module name); returns that name."""
  stem = os.path.splitext(os.path.basename(where))[0]
  base = stem if where.endswith(".py") else where
  name = "logra_verifiers_" + re.sub(r"\W", "_", base).lower()
  if where.endswith(".py"):
    if not os.path.isfile(where):
      raise ValueError(f"task.environment={spec!r}: file {where} not found")
    module_spec = importlib.util.spec_from_file_location(name, where)
    module = importlib.util.module_from_spec(module_spec)

    def load():
      sys.modules[name] = module  # its own imports may name it
      module_spec.loader.exec_module(module)
      return module

  else:
    load = lambda: importlib.import_module(where)  # noqa: E731
  try:
    sys.modules[name] = load()
  except (Exception, SystemExit) as e:  # noqa: BLE001 -- user code's import.
    sys.modules.pop(name, None)
    raise ValueError(
        f"task.environment={spec!r}: {where} does not import: "
        f"{type(e).__name__}: {e}"
    ) from None
  return name


def load_verifiers(spec: str) -> VerifiersTaskset:
  """The ``verifiers.v1`` taskset ``spec`` names, loaded and checked once.

  Args:
    spec: ``"verifiers:package.module"`` or ``"verifiers:path/to/file.py"``.

  Returns:
    The :class:`VerifiersTaskset`.

  Raises:
    ValueError: ``verifiers`` is not installed, the module does not import
      or exports no ``Taskset``, the taskset fails to load or has no task,
      or its tasks need what the run cannot give them (a container, tool
      servers); one line naming ``spec``.
  """
  where = spec[len(PREFIX) :]
  if not where:
    raise ValueError(
        f"task.environment={spec!r} must name a module or a .py file after "
        "'verifiers:'"
    )
  try:
    from verifiers.v1.utils import loaders  # optional dependency
  except ImportError:
    raise ValueError(
        f"task.environment={spec!r}: verifiers is not installed "
        "(pip install 'logra-jax[verifiers]')"
    ) from None
  name = _module(spec, where)
  try:
    taskset_cls = loaders.taskset_class(name)
    taskset = taskset_cls(loaders.taskset_config_type(name)(id=name))
    first = next(iter(taskset), None)
  except Exception as e:  # noqa: BLE001 -- user code, reported in one line.
    raise ValueError(
        f"task.environment={spec!r}: the taskset does not load: "
        f"{type(e).__name__}: {e}"
    ) from None
  if first is None:
    raise ValueError(f"task.environment={spec!r}: the taskset has no task")
  task_type = type(first)
  if task_type.NEEDS_CONTAINER or task_type.toolsets(taskset.config.task):
    raise ValueError(
        f"task.environment={spec!r}: its tasks need a container or tool "
        "servers, which this trainer's in-process harness does not provide"
    )
  return VerifiersTaskset(spec, name, taskset, task_type, type(first.data))
