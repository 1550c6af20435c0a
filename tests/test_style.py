"""The formatter and the linter pass on the whole tree, with the settings in
pyproject.toml ([tool.pyink]) and setup.cfg ([flake8]): CI runs them here."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
PATHS = ["logra_jax", "tests", "experiments"]


def _run(module, *args):
  pytest.importorskip(module)
  return subprocess.run(
      [sys.executable, "-m", module, *args, *PATHS],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=False,
  )


def test_code_is_formatted():
  result = _run("pyink", "--check", "--quiet")
  assert (
      result.returncode == 0
  ), f"run `pyink {' '.join(PATHS)}`:\n{result.stderr}"


def test_code_passes_the_linter():
  result = _run("flake8")
  assert result.returncode == 0, result.stdout
