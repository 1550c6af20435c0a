"""The package's layers, checked from its source (nothing is imported).

The parts of ``logra_jax`` (a subpackage or a top-level module) stand in the
order of :data:`LAYERS`, bottom up; a part may import only itself and parts
below it, so no import cycle between parts can exist. A few parts are
stricter than their place: ``reduction``, ``random_bits`` and ``data`` import
nothing of the package, ``lowrank`` only ``reduction``, ``optim/`` only
``lowrank`` and ``random_bits`` (it is usable alone as an optax extension),
``models/`` only ``lowrank``, ``reduction``, ``parallel`` and ``staging``
(never the optimizer). No import hides inside a function, except of the optional
dependencies in :data:`OPTIONAL`.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "logra_jax"

LAYERS = (
    "checks",
    "deadlines",
    "staging",
    "reduction",
    "lowrank",
    "random_bits",
    "data",
    "optim",
    "checksums",
    "parallel",
    "models",
    "envs",
    "configs",
    "policy_state",
    "sync",
    "checkpoint",
    "rollout",
    "serve",
    "rl",
    "memory",
    "cli",
)

# Parts that import fewer parts than their place in LAYERS allows.
ONLY = {
    "checks": set(),
    "deadlines": set(),
    "staging": set(),
    "reduction": set(),
    "lowrank": {"reduction"},
    "random_bits": set(),
    "data": set(),
    "optim": {"lowrank", "random_bits"},
    "models": {"lowrank", "reduction", "parallel", "staging"},
}

# Third-party packages that are extras, imported where they are used.
OPTIONAL = {"wandb", "gguf", "trl", "torch", "accelerate", "verifiers"}


def _modules() -> list[pathlib.Path]:
  return sorted(PACKAGE.rglob("*.py"))


def _part(module: str) -> str | None:
  """The part of a dotted module name, or None outside the package."""
  names = module.split(".")
  if names[0] != "logra_jax":
    return None
  return names[1] if len(names) > 1 else ""


def _imports(path: pathlib.Path) -> list[tuple[ast.AST, str, bool]]:
  """``(node, absolute module, inside a function)`` of each import."""
  tree = ast.parse(path.read_text())
  rel = path.relative_to(PACKAGE.parent).with_suffix("")
  package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts)
  out = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      inner = in_function or isinstance(
          child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
      )
      if isinstance(child, ast.Import):
        out.extend((child, a.name, in_function) for a in child.names)
      elif isinstance(child, ast.ImportFrom):
        if child.level:
          base = package[: len(package) - child.level + 1]
          module = ".".join(base + ([child.module] if child.module else []))
        else:
          module = child.module
        if module == "logra_jax":  # from logra_jax import models, ...
          out.extend(
              (child, f"{module}.{a.name}", in_function) for a in child.names
          )
        else:
          out.append((child, module, in_function))
      visit(child, inner)

  visit(tree, False)
  return out


def _own_part(path: pathlib.Path) -> str:
  rel = path.relative_to(PACKAGE)
  return (
      rel.parts[0].removesuffix(".py") if rel.parts[0] != "__init__.py" else ""
  )


def test_every_part_has_a_layer():
  parts = {_own_part(p) for p in _modules()} - {""}
  assert parts <= set(LAYERS), sorted(parts - set(LAYERS))


@pytest.mark.parametrize(
    "path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_imports_point_down(path):
  own = _own_part(path)
  if not own:  # The package's __init__: the public face, above every part.
    return
  allowed = ONLY.get(own, set(LAYERS[: LAYERS.index(own)])) | {own}
  wrong = [
      f"line {node.lineno}: {module}"
      for node, module, _ in _imports(path)
      if _part(module) not in (None, *allowed)
  ]
  assert not wrong, f"{own} may import only {sorted(allowed)}: {wrong}"


@pytest.mark.parametrize(
    "path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_no_import_hides_in_a_function(path):
  hidden = [
      f"line {node.lineno}: {module}"
      for node, module, in_function in _imports(path)
      if in_function and module.split(".")[0] not in OPTIONAL
  ]
  assert not hidden, hidden
