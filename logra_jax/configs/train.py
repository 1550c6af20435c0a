"""Typed, frozen configuration of an RL run, with named presets.

A run is a :class:`TrainConfig` made of small sections. Presets are plain
values in :data:`PRESETS`; command-line overrides are ``section.field=value``
strings applied by :func:`apply_overrides`, which parses each value with the
type of the field it replaces.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Optional

from logra_jax.checks import check_choice, check_range
from logra_jax.optim.factored import BASE_DTYPES
from logra_jax.optim.kl_control import KL_MODES
from logra_jax.optim.projectors import KINDS
from logra_jax.optim.transforms import MOMENT_POLICIES
from logra_jax.rl.algo import ADVANTAGE_ESTIMATORS, LossConfig

OPTIMIZERS = ("logra", "adam", "galore")
GRADIENT_MODES = ("sketch", "dense")
ROLLOUT_ENGINES = ("colocated", "process")
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16")


def _check(section: str, config: Any, names: str, **bounds: float) -> None:
  """:func:`check_range` on the fields ``names`` (space-separated) of
  ``config`` that are not None, each named ``section.field`` (as ``--set``
  spells it; the top-level fields have no section)."""
  for name in names.split():
    value = getattr(config, name)
    if value is not None:
      check_range(f"{section}.{name}" if section else name, value, **bounds)


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """Where prompts, answers and the verifier come from.

  Attributes:
    name: ``"tiny"`` (short arithmetic from reasoning-gym's ``chain_sum``), a
      reasoning-gym dataset name, or a local ``.jsonl``/``.parquet`` path.
    size: examples generated (reasoning-gym tasks).
    eval_size: held-out examples; disjoint from training prompts.
    seed: generation and split seed.
    prompt_column: prompt column of a data file.
    answer_column: answer column of a data file.
    template: prompt template of a data file (``{prompt}`` and other columns).
    answer_after: marker before the final answer in a data file (``"#### "``).
    terms: terms per expression of the tiny task.
    max_digits: digits per term of the tiny task (each term has 1 to
      ``max_digits``).
  """

  name: str = "tiny"
  size: int = 20000
  eval_size: int = 200
  seed: int = 0
  prompt_column: str = "question"
  answer_column: str = "answer"
  template: str = "{prompt}"
  answer_after: Optional[str] = None
  terms: int = 3
  max_digits: int = 1

  def __post_init__(self):
    _check("task", self, "size eval_size max_digits", ge=1)
    _check("task", self, "seed", ge=0)
    _check("task", self, "terms", ge=2)
    if self.eval_size >= self.size:
      raise ValueError(f"task.eval_size={self.eval_size} must be smaller than "
                       f"task.size={self.size}")


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """The policy: an HF folder, or a tiny decoder warm-started on the task.

  Attributes:
    path: local Hugging Face folder (config.json, safetensors, tokenizer);
      empty for the tiny warm-started decoder described by the fields below.
    dtype: parameter dtype, ``"float32"`` or ``"bfloat16"``.
    hidden_size: tiny decoder width.
    num_layers: tiny decoder depth.
    num_heads: tiny decoder attention heads.
    num_kv_heads: tiny decoder key/value heads.
    intermediate_size: tiny decoder MLP width.
    warm_start_steps: supervised steps on the task's worked answers.
    warm_start_batch: supervised batch size.
    warm_start_lr: supervised learning rate (Adam).
    warm_start_examples: training examples the warm start sees (the first
      ones of the training split); RL draws from the whole split.
    cache_dir: where warm-started policies are kept and reused.
    reference_dtype: dtype of the frozen reference policy that a KL penalty
      (``loss.beta > 0``) compares against: ``"bfloat16"`` (2 bytes per
      parameter) or ``"float32"``.
  """

  path: str = ""
  dtype: str = "float32"
  hidden_size: int = 128
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  intermediate_size: int = 384
  warm_start_steps: int = 250
  warm_start_batch: int = 64
  warm_start_lr: float = 3e-3
  warm_start_examples: int = 1000
  cache_dir: str = "~/.cache/logra_jax/warm_start"
  reference_dtype: str = "bfloat16"

  def __post_init__(self):
    check_choice("policy.dtype", self.dtype, ("float32", "bfloat16"))
    check_choice("policy.reference_dtype", self.reference_dtype,
                 ("float32", "bfloat16"))
    _check("policy", self, "hidden_size num_layers num_heads num_kv_heads "
           "intermediate_size warm_start_batch warm_start_examples", ge=1)
    _check("policy", self, "warm_start_steps", ge=0)
    _check("policy", self, "warm_start_lr", gt=0)
    if self.hidden_size % self.num_heads:
      raise ValueError(f"policy.num_heads={self.num_heads} must divide "
                       f"policy.hidden_size={self.hidden_size}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"policy.num_kv_heads={self.num_kv_heads} must divide "
                       f"policy.num_heads={self.num_heads}")
    if (self.hidden_size // self.num_heads) % 2:
      raise ValueError(
          f"policy.hidden_size={self.hidden_size} / policy.num_heads="
          f"{self.num_heads} = {self.hidden_size // self.num_heads} must be "
          "even (the head size, for rotary embeddings)")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Sampling of completions.

  Attributes:
    prompts_per_step: prompts sampled per learner step.
    num_generations: completions per prompt (the GRPO group size, >= 2).
    max_new_tokens: generation budget per completion.
    temperature: sampling temperature (> 0 for RL rollouts).
    top_p: nucleus mass in (0, 1].
    top_k: 0 disables.
    engine: where the rollout engine runs: ``"colocated"`` (the learner's
      process and devices) or ``"process"`` (a separate process on its own
      devices, sent each sync message as bytes over a local socket). Its
      weights are bit-identical either way, so the run's results are too.
    dtype: the dtype of the weights the engine samples with, cast from the
      synced policy once per message: ``"float32"``, ``"bfloat16"`` or
      ``"auto"`` (bfloat16 on GPU and TPU, float32 on CPU, whose bfloat16
      matmuls are slow). The engine's synced copy, which its checksums
      verify, keeps the learner's dtypes.
  """

  prompts_per_step: int = 64
  num_generations: int = 8
  max_new_tokens: int = 6
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  engine: str = "colocated"
  dtype: str = "auto"

  def __post_init__(self):
    check_choice("rollout.engine", self.engine, ROLLOUT_ENGINES)
    check_choice("rollout.dtype", self.dtype, ROLLOUT_DTYPES)
    _check("rollout", self, "prompts_per_step max_new_tokens", ge=1)
    _check("rollout", self, "num_generations", ge=2)   # a group baseline
    _check("rollout", self, "temperature", gt=0)
    _check("rollout", self, "top_p", gt=0, le=1)
    _check("rollout", self, "top_k", ge=0)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer of the policy.

  Attributes:
    name: ``"logra"`` (default), ``"adam"`` (dense baseline) or ``"galore"``
      (``optax.contrib.galore``).
    learning_rate: peak learning rate (constant after warmup).
    warmup_steps: linear warmup.
    rank: projection rank (logra, galore).
    kind: projector kind of logra: ``"range"``, ``"random"`` or ``"svd"``.
    refresh_every: steps between projector refreshes (logra, galore).
    moment_policy: logra's moments on refresh.
    weight_decay: decoupled weight decay.
    max_grad_norm: global gradient-norm clip; 0 disables.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    target_kl: predicted-KL target per step (any optimizer); None disables
      KL step control.
    kl_mode: ``"clamp"`` (only shrink steps) or ``"target"``.
    kl_subsample: sequences of the batch the KL is predicted on; None uses
      all.
    gradient_mode: how logra gets its gradient sketches: ``"sketch"``
      (default: differentiated directly in the low-rank coordinates, no full
      gradient is ever held, see :mod:`logra_jax.sketch_grad`) or
      ``"dense"`` (full gradient, then projected). Other optimizers always
      take dense gradients.
    project_embeddings: also project the embedding table and LM head
      (logra, galore), whose dense Adam moments are otherwise the largest
      optimizer state of a large-vocabulary model.
    base_dtype: dtype of the base ``B`` of each projected weight, which
      logra with sketch-direct gradients keeps factored, ``W = c B + P A``
      (:mod:`logra_jax.optim.factored`): ``"float32"`` (default) or
      ``"bfloat16"`` (half the bytes; the window is merged into ``B`` with
      stochastic rounding at each refresh, and no float32 copy of the
      weight exists). Dense leaves keep the policy's dtype.
  """

  name: str = "logra"
  learning_rate: float = 3e-4
  warmup_steps: int = 10
  rank: int = 32
  kind: str = "range"
  refresh_every: int = 50
  moment_policy: str = "transfer"
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  b1: float = 0.9
  b2: float = 0.99
  target_kl: Optional[float] = None
  kl_mode: str = "clamp"
  kl_subsample: Optional[int] = None
  gradient_mode: str = "sketch"
  project_embeddings: bool = False
  base_dtype: str = "float32"

  def __post_init__(self):
    check_choice("optimizer.name", self.name, OPTIMIZERS)
    check_choice("optimizer.kind", self.kind, KINDS)
    check_choice("optimizer.moment_policy", self.moment_policy,
                 MOMENT_POLICIES)
    check_choice("optimizer.kl_mode", self.kl_mode, KL_MODES)
    check_choice("optimizer.gradient_mode", self.gradient_mode,
                 GRADIENT_MODES)
    _check("optimizer", self, "learning_rate target_kl", gt=0)
    _check("optimizer", self, "rank refresh_every kl_subsample", ge=1)
    _check("optimizer", self, "warmup_steps weight_decay max_grad_norm", ge=0)
    _check("optimizer", self, "b1 b2", ge=0, lt=1)
    if self.project_embeddings and self.name == "adam":
      raise ValueError("optimizer.project_embeddings applies to logra and "
                       "galore; adam keeps dense moments of every parameter")
    check_choice("optimizer.base_dtype", self.base_dtype, BASE_DTYPES)
    if self.base_dtype != "float32" and not (
        self.name == "logra" and self.gradient_mode == "sketch"):
      raise ValueError(
          f"optimizer.base_dtype={self.base_dtype!r} needs the factored "
          "policy of optimizer.name='logra' with optimizer.gradient_mode="
          f"'sketch'; got name={self.name!r}, gradient_mode="
          f"{self.gradient_mode!r}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When a run saves its whole state under ``<out>/checkpoints``, and what
  is kept.

  A checkpoint is also written after the last step and when the run is
  stopped by SIGTERM/SIGINT; with ``keep_best``, after every held-out
  evaluation too, so that the best one can be kept. None of these fields
  changes the results, so all of them may change when a run is resumed.

  Attributes:
    every_steps: save after every this many steps; 0 disables.
    every_seconds: save when this many seconds have passed since the last
      save; 0 disables.
    keep: the most recent checkpoints kept (>= 1).
    keep_best: checkpoints with the highest held-out accuracy also kept.
    async_save: write in a background thread while training continues.
  """

  every_steps: int = 25
  every_seconds: float = 0.0
  keep: int = 2
  keep_best: int = 1
  async_save: bool = True

  def __post_init__(self):
    _check("checkpoint", self, "every_steps every_seconds keep_best", ge=0)
    _check("checkpoint", self, "keep", ge=1)


@dataclasses.dataclass(frozen=True)
class SyncConfig:
  """Policy sync from the learner to the rollout engine.

  After every step the learner sends the step's low-rank message
  (:mod:`logra_jax.sync`); a message the engine refuses (checksums, order,
  layout) is followed by a full one, counted in ``sync/resyncs``.

  Attributes:
    resync_every: also send a full message every this many steps (0: only
      to heal a refused message).
  """

  resync_every: int = 0

  def __post_init__(self):
    _check("sync", self, "resync_every", ge=0)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """A whole RL run.

  Attributes:
    task: data and verifier.
    policy: model and warm start.
    rollout: sampling.
    optimizer: optimizer.
    loss: the clipped policy-gradient loss.
    advantage: ``"grpo"``, ``"dr_grpo"`` or ``"rloo"``.
    steps: learner steps (one rollout batch each).
    num_iterations: optimizer updates per rollout batch (inner epochs).
    micro_batches: gradient accumulation chunks per update.
    eval_every: steps between held-out evaluations (0: only before/after).
    seed: seed of sampling and batching.
    checkpoint: when the run's state is saved and what is kept.
    sync: policy sync to the rollout engine.
    max_consecutive_skips: consecutive steps skipped for a non-finite loss,
      gradient or predicted KL after which the run stops with an error.
  """

  task: TaskConfig = TaskConfig()
  policy: PolicyConfig = PolicyConfig()
  rollout: RolloutConfig = RolloutConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  loss: LossConfig = LossConfig()
  advantage: str = "grpo"
  steps: int = 260
  num_iterations: int = 1
  micro_batches: int = 1
  eval_every: int = 25
  seed: int = 0
  checkpoint: CheckpointConfig = CheckpointConfig()
  sync: SyncConfig = SyncConfig()
  max_consecutive_skips: int = 3

  def __post_init__(self):
    check_choice("advantage", self.advantage, tuple(ADVANTAGE_ESTIMATORS))
    _check("", self, "steps num_iterations micro_batches "
           "max_consecutive_skips", ge=1)
    _check("", self, "eval_every seed", ge=0)
    batch = self.rollout.prompts_per_step * self.rollout.num_generations
    if batch % self.micro_batches:
      raise ValueError(
          f"micro_batches={self.micro_batches} must divide the rollout batch "
          f"of prompts_per_step * num_generations = {batch} completions")
    if (self.optimizer.kl_subsample or 0) > batch:
      raise ValueError(
          f"optimizer.kl_subsample={self.optimizer.kl_subsample} exceeds the "
          f"rollout batch of {batch} completions")


PRESETS: dict[str, TrainConfig] = {
    # The embedded default: a ~1M-parameter decoder warm-started on short
    # arithmetic, then GRPO with LoGRA on CPU in a few minutes.
    "tiny": TrainConfig(),
    # The same loop in seconds, for tests and smoke runs.
    "smoke": TrainConfig(
        task=TaskConfig(size=200, eval_size=16),
        policy=PolicyConfig(hidden_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=64,
                            warm_start_steps=20, warm_start_batch=16),
        rollout=RolloutConfig(prompts_per_step=4, num_generations=4,
                              max_new_tokens=4),
        optimizer=OptimizerConfig(rank=4, refresh_every=2, warmup_steps=0),
        steps=3, eval_every=0),
}


def get_preset(name: str) -> TrainConfig:
  """The preset called ``name``; the error lists the valid names."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; valid presets: "
                     f"{sorted(PRESETS)}")
  return PRESETS[name]


def _parse(value: str, annotation: Any, key: str) -> Any:
  hint = annotation
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if value.lower() in ("none", "null", ""):
      return None
    hint = args[0]
  elif origin is typing.Literal:
    hint = str
  try:
    if hint is bool:
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(value)
      return value.lower() in ("true", "1")
    if hint in (int, float, str):
      return hint(value)
  except ValueError:
    raise ValueError(f"--set {key}={value}: expected a {hint.__name__}") from None
  raise ValueError(f"--set {key}: cannot parse a value of type {hint}")


def apply_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
  """Applies ``section.field=value`` (or ``field=value``) overrides.

  Example:
    >>> cfg = apply_overrides(get_preset("tiny"), ["optimizer.rank=8", "steps=5"])
    >>> cfg.optimizer.rank, cfg.steps
    (8, 5)
  """
  for item in overrides:
    if "=" not in item:
      raise ValueError(f"override {item!r} must look like section.field=value")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    config = _replace_path(config, parts, value.strip(), key)
  return config


def _replace_path(node: Any, parts: list[str], value: str, key: str) -> Any:
  fields = {f.name: f for f in dataclasses.fields(node)}
  name = parts[0]
  if name not in fields:
    raise ValueError(f"--set {key}: {type(node).__name__} has no field "
                     f"{name!r}; valid: {sorted(fields)}")
  current = getattr(node, name)
  if len(parts) == 1:
    if dataclasses.is_dataclass(current):
      raise ValueError(f"--set {key}: {name!r} is a section; set one of its "
                       f"fields, e.g. {name}.{dataclasses.fields(current)[0].name}")
    hints = typing.get_type_hints(type(node))
    return dataclasses.replace(node, **{name: _parse(value, hints[name], key)})
  if not dataclasses.is_dataclass(current):
    raise ValueError(f"--set {key}: {name!r} is not a section")
  return dataclasses.replace(
      node, **{name: _replace_path(current, parts[1:], value, key)})


def to_dict(config: TrainConfig) -> dict[str, Any]:
  """The config as nested plain dicts (for JSON)."""
  return dataclasses.asdict(config)


def from_dict(data: dict[str, Any], cls: type = TrainConfig) -> Any:
  """The config of :func:`to_dict`'s nested dicts (each section checked as
  it is built).

  Raises:
    ValueError: a key that is not a field or a section that is not a map,
      naming its dotted path; a value out of range, as when built.

  Example:
    >>> config = apply_overrides(TrainConfig(), ["optimizer.rank=8"])
    >>> from_dict(to_dict(config)) == config
    True
  """
  return _from_dict(data, cls, "")


def _from_dict(data: dict[str, Any], cls: type, prefix: str) -> Any:
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - fields)
  if unknown:
    raise ValueError(f"unknown config field {prefix}{unknown[0]}")
  values = {}
  for name, value in data.items():
    kind = hints[name]
    if dataclasses.is_dataclass(kind):
      if not isinstance(value, dict):
        raise ValueError(f"config section {prefix}{name} must be a map of "
                         f"fields, got {type(value).__name__}")
      value = _from_dict(value, kind, f"{prefix}{name}.")
    values[name] = value
  return cls(**values)
