"""Every docstring example of the package runs and prints what it shows.

Each module's ``>>>`` examples run as doctests, in a fresh folder (examples
that write files write them there), with ``ELLIPSIS`` and
``NORMALIZE_WHITESPACE``. An example that cannot run on a CPU in seconds
says so with ``# doctest: +SKIP`` on its line.
"""

import doctest
import importlib
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "logra_jax"


def _module_names() -> list[str]:
  names = []
  for path in sorted(PACKAGE.rglob("*.py")):
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    names.append(".".join(parts))
  return names


@pytest.mark.parametrize("name", _module_names())
def test_docstring_examples_run(name, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  module = importlib.import_module(name)
  result = doctest.testmod(
      module,
      optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
      raise_on_error=False,
  )
  assert result.failed == 0, f"{result.failed} docstring example(s) failed"
