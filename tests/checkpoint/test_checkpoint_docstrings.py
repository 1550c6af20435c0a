"""The docstring examples of every module of logra_jax.checkpoint run."""

import doctest
import importlib

import pytest

from logra_jax import checkpoint
from logra_jax import staging


@pytest.mark.parametrize(
    "module",
    [checkpoint, staging]
    + [
        importlib.import_module(f"logra_jax.checkpoint.{name}")
        for name in ("resume", "items", "integrity", "store")
    ],
    ids=lambda module: module.__name__,
)
def test_docstring_examples_run(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.failed == 0 and result.attempted > 0, module.__name__
