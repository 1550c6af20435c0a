"""Loading run configs: presets, YAML files and overrides, with OmegaConf.

:func:`load_config` composes, in this order, a named preset (a YAML file in
``configs/presets/``), run config files (or the name of a recipe, a YAML
file in ``configs/recipes/``) and ``section.field=value`` overrides, with
OmegaConf structured configs (the dataclasses of
:mod:`logra_jax.configs.schema` are the schema: an unknown key or a value of
the wrong type is refused naming its dotted path); lists and maps are YAML
values, e.g. ``rewards=[{function: my_rewards.py:fmt, weight: 0.1}]`` or
``task.options.max_terms=4``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import types
import typing
from collections.abc import Sequence
from typing import Any

import omegaconf
import yaml
from omegaconf import OmegaConf

from logra_jax.configs.schema import RewardConfig
from logra_jax.configs.schema import TrainConfig

PRESET_DIR = pathlib.Path(__file__).parent / "presets"
RECIPE_DIR = pathlib.Path(__file__).parent / "recipes"


def preset_names() -> list[str]:
  """The named presets: the YAML files of :data:`PRESET_DIR`.

  Example:
    >>> preset_names()
    ['smoke', 'tiny']
  """
  return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def recipe_names() -> list[str]:
  """The shipped recipes, the YAML files of :data:`RECIPE_DIR`: the losses
  and hyperparameters of published algorithms, each naming its source.

  Example:
    >>> recipe_names()
    ['cispo', 'dapo', 'dr_grpo', 'grpo', 'gspo', 'rloo']
  """
  return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def get_preset(name: str) -> TrainConfig:
  """The preset called ``name``; the error lists the valid names.

  Example:
    >>> get_preset("smoke").steps
    3
  """
  return load_config(name)


def load_config(
    preset: str = "tiny",
    files: Sequence[str | os.PathLike] = (),
    overrides: Sequence[str] = (),
) -> TrainConfig:
  """A run config: a preset, then YAML files, then overrides, in that order.

  Each layer may set any field; maps merge key by key, lists are replaced.
  The result is built as the frozen dataclasses, whose checks run at once.

  Args:
    preset: a name of :func:`preset_names`.
    files: YAML run configs (e.g. a run folder's ``config.yaml``); a name
      of :func:`recipe_names` that is no file is the shipped recipe.
    overrides: ``section.field=value`` strings; a value is YAML, so lists
      and maps are written inline (``logging.trackers=[tensorboard,wandb]``)
      and ``null`` clears an optional field, except that a text field takes
      the text as written unless it is quoted (``task.answer_after=#### ``).
      ``${...}`` is text everywhere, never an interpolation.

  Returns:
    The :class:`TrainConfig`.

  Raises:
    ValueError: an unknown preset, a file that is not valid YAML or not a
      map, an unknown key or a value of the wrong type (naming the file or
      override and the key's dotted path, with the valid keys), or a value
      the config's own checks refuse.
    FileNotFoundError: a config file that does not exist.

  Example:
    >>> config = load_config("smoke", overrides=["optimizer.rank=8",
    ...                                          "task.options={max_terms: 4}"])
    >>> config.optimizer.rank, config.task.options
    (8, {'max_terms': 4})
  """
  if isinstance(files, (str, os.PathLike)):
    files = [files]
  if isinstance(overrides, str):
    overrides = [overrides]
  if preset not in preset_names():
    raise ValueError(
        f"unknown preset {preset!r}; valid presets: " f"{preset_names()}"
    )
  layers = [_yaml_layer(PRESET_DIR / f"{preset}.yaml", f"preset {preset!r}")]
  layers += [_file_layer(f) for f in files]
  layers += [_override_layer(item) for item in overrides]
  return _build(OmegaConf.structured(TrainConfig), layers)


def apply_overrides(
    config: TrainConfig, overrides: Sequence[str]
) -> TrainConfig:
  """``config`` with ``section.field=value`` overrides applied (see
  :func:`load_config`).

  Example:
    >>> cfg = apply_overrides(get_preset("tiny"), ["optimizer.rank=8", "steps=5"])
    >>> cfg.optimizer.rank, cfg.steps
    (8, 5)
  """
  if isinstance(overrides, str):
    overrides = [overrides]
  return _build(
      OmegaConf.structured(config),
      [_override_layer(item) for item in overrides],
  )


def to_dict(config: TrainConfig) -> dict[str, Any]:
  """The config as nested plain dicts and lists (for JSON and YAML)."""
  return dataclasses.asdict(config)


def to_yaml(config: TrainConfig) -> str:
  """The config as a YAML run config that :func:`load_config` reads back.

  Example:
    >>> import tempfile
    >>> config = get_preset("smoke")
    >>> with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
    ...   _ = f.write(to_yaml(config)); f.flush()
    ...   load_config("tiny", [f.name]) == config
    True
  """
  return yaml.safe_dump(to_dict(config), sort_keys=False)


def from_dict(data: dict[str, Any]) -> TrainConfig:
  """The config of :func:`to_dict`'s nested dicts, checked as
  :func:`load_config` checks a file.

  Example:
    >>> config = apply_overrides(TrainConfig(), ["optimizer.rank=8"])
    >>> from_dict(to_dict(config)) == config
    True
  """
  return _build(
      OmegaConf.structured(TrainConfig),
      [
          (
              "a config map",
              _as_layer(_escape_interpolations(data), "a config map"),
          )
      ],
  )


_Layer = tuple[str, Any]  # (where it came from, an OmegaConf node)


def _as_layer(data: Any, source: str) -> omegaconf.DictConfig:
  if not isinstance(data, dict):
    raise ValueError(
        f"{source} must be a map of config sections and "
        f"fields, got {type(data).__name__}"
    )
  return OmegaConf.create(data)


# Bounds of a config file: a run config is a few hundred bytes of a few
# levels; these leave room for long reward lists and task options while a
# hostile file (an alias bomb of a few KB expands to billions of nodes, deep
# nesting exhausts Python's stack) is refused before it is expanded.
MAX_FILE_BYTES = 4 * 2**20
MAX_DEPTH = 64
MAX_NODES = 100_000


class _Refused(yaml.YAMLError):
  """A config file beyond the bounds or with a key that cannot be a field."""


class _ConfigLoader(yaml.SafeLoader):
  """YAML's safe loader for config files: refuses a key given twice in one
  map (YAML keeps the last silently: a repeated section would drop the first
  one), a key that is a map or a list (a complex key), nesting deeper than
  :data:`MAX_DEPTH` and more than :data:`MAX_NODES` nodes with aliases
  expanded (an alias bomb), or an alias inside what it names."""

  def __init__(self, stream):
    super().__init__(stream)
    self._depth = 0

  def compose_node(self, parent, index):
    self._depth += 1
    try:
      if self._depth > MAX_DEPTH:
        where = _where(self.peek_event().start_mark)
        raise _Refused(f"nested deeper than {MAX_DEPTH} levels{where}")
      return super().compose_node(parent, index)
    finally:
      self._depth -= 1

  def get_single_node(self):
    node = super().get_single_node()
    if node is not None:
      _expanded_size(node, {})
    return node

  def construct_mapping(self, node, deep=False):
    keys = set()
    for key_node, _ in node.value:
      if not isinstance(key_node, yaml.ScalarNode):
        raise _Refused(
            f"a key must be text or a number, not a {key_node.id}"
            f"{_where(key_node.start_mark)}"
        )
      key = self.construct_object(key_node, deep=deep)
      if key in keys:
        raise yaml.constructor.ConstructorError(
            None, None, f"key {key!r} is given twice", key_node.start_mark
        )
      keys.add(key)
    return super().construct_mapping(node, deep=deep)


def _where(mark: yaml.Mark) -> str:
  """`` (line 3, column 5)``: where a YAML node starts."""
  return f" (line {mark.line + 1}, column {mark.column + 1})"


def _expanded_size(node: yaml.Node, sizes: dict[int, Any]) -> int:
  """Nodes under ``node`` (itself included) with every alias expanded;
  raises :class:`_Refused` past :data:`MAX_NODES` or for an alias inside the
  node it names (``sizes``: the sizes found so far, None while counting)."""
  if id(node) in sizes:
    if sizes[id(node)] is None:
      raise _Refused(
          f"an alias inside the value it names{_where(node.start_mark)}"
      )
    return sizes[id(node)]
  sizes[id(node)] = None
  children: list = []
  if isinstance(node, yaml.SequenceNode):
    children = node.value
  elif isinstance(node, yaml.MappingNode):
    children = [child for pair in node.value for child in pair]
  total = 1
  for child in children:
    total += _expanded_size(child, sizes)
    if total > MAX_NODES:
      raise _Refused(f"more than {MAX_NODES} values with its aliases expanded")
  sizes[id(node)] = total
  return total


def _file_layer(file: str | os.PathLike) -> _Layer:
  """A config file's layer; a recipe's name that is no file is the shipped
  recipe."""
  path = pathlib.Path(file)
  if path.exists():
    return _yaml_layer(path, f"config file {file}")
  if str(file) in recipe_names():
    return _yaml_layer(RECIPE_DIR / f"{file}.yaml", f"recipe {str(file)!r}")
  raise FileNotFoundError(
      f"config file {file}: no such file, nor a recipe name "
      f"({', '.join(recipe_names())})"
  )


def _yaml_layer(path: pathlib.Path, source: str) -> _Layer:
  if not path.is_file():
    raise FileNotFoundError(f"{source}: no such file")
  with open(path, "rb") as stream:
    raw = stream.read(MAX_FILE_BYTES + 1)
  if len(raw) > MAX_FILE_BYTES:
    raise ValueError(
        f"{source} is larger than {MAX_FILE_BYTES} bytes, the most a config "
        "file may hold"
    )
  try:
    stream = io.StringIO(raw.decode("utf-8"))
    stream.name = str(path)  # YAML's errors name the file
    data = yaml.load(stream, Loader=_ConfigLoader)
  except _Refused as error:
    problem = " ".join(str(error).split())
    raise ValueError(f"{source} is refused: {problem}") from None
  except (yaml.YAMLError, UnicodeDecodeError) as error:
    problem = " ".join(str(error).split())
    raise ValueError(f"{source} is not valid YAML: {problem}") from None
  data = {} if data is None else data
  return source, _as_layer(_escape_interpolations(data), source)


def _is_text_field(path: Sequence[str]) -> bool:
  """Whether the field at ``path`` of :class:`TrainConfig` holds text (``str``
  or ``Optional[str]``)."""
  kind: Any = TrainConfig
  for part in path:
    if not dataclasses.is_dataclass(kind):
      return False
    hints = typing.get_type_hints(kind)
    if part not in hints:
      return False
    kind = hints[part]
  return kind is str or (
      typing.get_origin(kind) in (typing.Union, types.UnionType)
      and str in typing.get_args(kind)
  )


def _override_layer(item: str) -> _Layer:
  """One ``key=value`` override as a config layer. The value is YAML, except
  for a text field, which takes the text as written (``task.answer_after=####
  `` keeps its marker and space) unless it is quoted or ``null``."""
  source = f"override {item!r}"
  key, sep, value = item.partition("=")
  key = key.strip()
  if not sep or not key:
    raise ValueError(f"{source} must look like section.field=value")
  path = key.split(".")
  if (
      _is_text_field(path)
      and value.strip() != "null"
      and not value.strip().startswith(("'", '"'))
  ):
    layer: Any = value
    for part in reversed(path):
      layer = {part: layer}
    return source, OmegaConf.create(_escape_interpolations(layer))
  try:
    parsed = OmegaConf.from_dotlist([f"{key}={value.strip()}"])
  except (omegaconf.errors.OmegaConfBaseException, yaml.YAMLError) as error:
    problem = " ".join(str(error).split())
    raise ValueError(f"{source}: {problem}") from None
  # The value as parsed, with "${" kept as text: never an interpolation.
  raw = OmegaConf.to_container(parsed, resolve=False)
  return source, OmegaConf.create(_escape_interpolations(raw))


def _escape_interpolations(data: Any) -> Any:
  """``data`` with OmegaConf's interpolation marker ``${`` escaped in every
  string, so that text such as a template holding ``${price}`` stays text."""
  if isinstance(data, str):
    return data.replace("${", "\\${")
  if isinstance(data, dict):
    return {k: _escape_interpolations(v) for k, v in data.items()}
  if isinstance(data, (list, tuple)):
    return [_escape_interpolations(v) for v in data]
  return data


def _section_names() -> dict[type, str]:
  """Each section's dataclass -> its dotted name (``RewardConfig`` ->
  ``"rewards"``, whose items it types)."""
  names = {
      type(f.default): f.name
      for f in dataclasses.fields(TrainConfig)
      if dataclasses.is_dataclass(f.default)
  }
  return {**names, RewardConfig: "rewards", TrainConfig: ""}


def _key_error(source: str, error: omegaconf.errors.ConfigKeyError) -> str:
  """The message of an unknown key: its dotted path and the valid keys of
  its section."""
  section = error.object_type
  key = error.full_key or str(error.key)
  if dataclasses.is_dataclass(section):
    prefix = _section_names().get(section, section.__name__)
    if prefix and not key.startswith(f"{prefix}."):
      key = f"{prefix}.{key.rsplit('.', 1)[-1]}"
    valid = sorted(f.name for f in dataclasses.fields(section))
    return f"{source}: unknown config key {key}; valid keys there: {valid}"
  return f"{source}: unknown config key {key}"


def _value_error(
    source: str, error: omegaconf.errors.OmegaConfBaseException
) -> str:
  """The message of a value OmegaConf cannot take (a wrong type, a scalar
  where a section belongs)."""
  message = str(error).splitlines()[0]
  key = getattr(error, "full_key", None)
  if "Value 'none'" in message or "Value 'None'" in message:
    message += " (write null to clear an optional field)"
  return f"{source}: {key + ': ' if key else ''}{message}"


def _build(
    schema: omegaconf.DictConfig, layers: Sequence[_Layer]
) -> TrainConfig:
  """Merges ``layers`` onto ``schema`` one at a time (so that an error names
  its layer), then builds the dataclasses."""
  merged = schema
  for source, layer in layers:
    try:
      merged = OmegaConf.merge(merged, layer)
    except omegaconf.errors.ConfigKeyError as error:
      raise ValueError(_key_error(source, error)) from None
    except omegaconf.errors.OmegaConfBaseException as error:
      raise ValueError(_value_error(source, error)) from None
    except TypeError as error:  # e.g. a list merged into a map
      raise ValueError(f"{source}: {error}") from None
  try:
    return OmegaConf.to_object(merged)
  except omegaconf.errors.OmegaConfBaseException as error:
    raise ValueError(_value_error("config", error)) from None
