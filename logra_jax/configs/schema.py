"""The schema of an RL run: typed, frozen config sections checked when built.

A run is a :class:`TrainConfig` made of small frozen sections, each checked
when it is built (an out-of-range value is refused naming its dotted path).
:mod:`logra_jax.configs.loading` composes them from presets, YAML files and
overrides.

This module imports only the checks and the name tuples of the parts its
fields select from (optimizer kinds, attention kinds), never the code that
reads a config.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any, Optional


from logra_jax.checks import check_choice, check_range
from logra_jax.configs.loss import LossConfig
from logra_jax.configs.rollout import RolloutConfig
from logra_jax.envs.loading import check_spec as check_environment
from logra_jax.models.config import ATTENTION
from logra_jax.models.config import REMAT
from logra_jax.optim.factored import BASE_DTYPES
from logra_jax.optim.factored import COORDS_DTYPES
from logra_jax.optim.kl_control import KL_MODES
from logra_jax.optim.lora import DEFAULT_TARGETS as LORA_TARGETS
from logra_jax.optim.projectors import KINDS
from logra_jax.optim.types import MOMENT_POLICIES

OPTIMIZERS = ("logra", "adam", "galore", "lora")
GRADIENT_MODES = ("sketch", "dense")
CHAT_TEMPLATES = ("auto", "none")
TRACKERS = ("tensorboard", "wandb")
# Group advantage estimators (``rl.algo.ADVANTAGE_ESTIMATORS`` implements
# each).
ADVANTAGES = ("grpo", "dr_grpo", "rloo")
# Seeds become int64 PRNG keys (``jax.random.key``).
_MAX_SEED = 2**63 - 1


def _check(section: str, config: Any, names: str, **bounds: float) -> None:
  """:func:`check_range` on the fields ``names`` (space-separated) of
  ``config`` that are not None, each named ``section.field`` (as ``--set``
  spells it; the top-level fields have no section)."""
  for name in names.split():
    value = getattr(config, name)
    if value is not None:
      check_range(f"{section}.{name}" if section else name, value, **bounds)


def check_kl_subsample(
    optimizer: OptimizerConfig, rows: int, data_axes: int = 1
) -> None:
  """Raises a ValueError unless ``optimizer.kl_subsample`` sequences fit in
  a rollout batch of ``rows`` and, under KL control
  (``optimizer.target_kl``), split evenly over ``data_axes`` devices (the
  mesh's ``dp x fsdp``): the KL predictor's sequences are sharded like the
  batch.

  Example:
    >>> kl_control = OptimizerConfig(target_kl=0.01, kl_subsample=4)
    >>> check_kl_subsample(kl_control, 8, 8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: optimizer.kl_subsample=4 is not divisible by the mesh's data ...
  """
  subsample = optimizer.kl_subsample
  if (subsample or 0) > rows:
    raise ValueError(
        f"optimizer.kl_subsample={subsample} exceeds the rollout batch of "
        f"{rows} completions"
    )
  if optimizer.target_kl is not None and subsample and subsample % data_axes:
    raise ValueError(
        f"optimizer.kl_subsample={subsample} is not divisible by the mesh's "
        f"data axes ({data_axes} devices): the KL predictor's sequences are "
        "split over them"
    )


# The most examples a task generates: they are held in memory (about 1 KB
# each with their reasoning-gym items), so a size in the billions would fill
# it before the first step.
MAX_TASK_SIZE = 1_000_000


def _check_template(template: str) -> None:
  """Raises ValueError unless ``task.template`` formats named fields only
  (``{prompt}``, ``{question}``: no positions, attributes or indices)."""
  formatter = string.Formatter()
  try:
    parts = list(formatter.parse(template))
    parts += [
        p for _, _, spec, _ in parts if spec for p in formatter.parse(spec)
    ]
  except ValueError as error:
    raise ValueError(
        f"task.template={template!r} is not a format string ({error}); "
        "write a literal brace as {{ or }}"
    ) from None
  for _, field, _, _ in parts:
    if field is not None and not field.isidentifier():
      raise ValueError(
          f"task.template={template!r}: field {{{field}}} must be the name "
          "of a field, such as {prompt} (no positions, attributes or indices)"
      )


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """Where prompts, answers and the verifier come from, and how prompts are
  shown to the policy.

  Attributes:
    name: ``"tiny"`` (short arithmetic from reasoning-gym's ``chain_sum``), a
      reasoning-gym dataset name, or a local ``.jsonl``/``.json``/``.parquet``
      path.
    size: examples generated (reasoning-gym tasks), at most
      :data:`MAX_TASK_SIZE`.
    eval_size: held-out examples; disjoint from training prompts.
    seed: generation and split seed.
    options: the reasoning-gym generator's config fields, e.g.
      ``{min_terms: 2, max_terms: 4}`` for ``chain_sum`` (the tiny task's
      generator too, after ``terms`` and ``max_digits``); unknown fields are
      refused naming the valid ones.
    prompt_column: prompt column of a data file.
    answer_column: answer column of a data file.
    template: the prompt, a format string over the example's fields:
      ``{prompt}`` is the data file's prompt column, the reasoning-gym item's
      question or the tiny task's expression; any other ``{field}`` is a
      column of the file or a field of the item or its metadata.
    answer_after: marker before the final answer in a data file (``"#### "``).
    chat_template: ``"auto"``: a policy whose tokenizer has a chat template
      (an instruct checkpoint) is shown each prompt as a user message in it,
      with the assistant's turn opened; ``"none"``: the prompt text as is.
    system_prompt: a system message before the prompt when a chat template
      is applied.
    terms: terms per expression of the tiny task.
    max_digits: digits per term of the tiny task (each term has 1 to
      ``max_digits``).
    environment: of multi-turn episodes (:mod:`logra_jax.envs`): empty,
      ``"calculator"``, ``"module:factory"`` or ``"file.py:factory"``.
  """

  name: str = "tiny"
  size: int = 20000
  eval_size: int = 200
  seed: int = 0
  options: dict[str, Any] = dataclasses.field(default_factory=dict)
  prompt_column: str = "question"
  answer_column: str = "answer"
  template: str = "{prompt}"
  answer_after: Optional[str] = None
  chat_template: str = "auto"
  system_prompt: Optional[str] = None
  terms: int = 3
  max_digits: int = 1
  environment: str = ""

  def __post_init__(self):
    _check("task", self, "size eval_size max_digits", ge=1)
    _check("task", self, "size", le=MAX_TASK_SIZE)
    _check_template(self.template)
    _check("task", self, "seed", ge=0, le=_MAX_SEED)
    _check("task", self, "terms", ge=2)
    check_choice("task.chat_template", self.chat_template, CHAT_TEMPLATES)
    if self.environment:
      check_environment(self.environment)
    if self.eval_size >= self.size:
      raise ValueError(
          f"task.eval_size={self.eval_size} must be smaller than "
          f"task.size={self.size}"
      )


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """One weighted reward function of a run.

  Attributes:
    function: ``"task"`` (the task's own verifier: reasoning-gym's
      ``score_answer``, or math-verify equivalence for a data file), an
      import path ``"package.module:function"`` or a file path
      ``"path/to/rewards.py:function"``. The function has the TRL signature
      ``fn(prompts, completions, **columns) -> list[float]``, called with
      keywords; the columns are the example's fields (``answer``, ``entry``,
      a data file's columns).
    weight: its weight in the total reward (negative: a penalty).
    batch_timeout_s: the most seconds the function may spend scoring one
      rollout batch; once they have passed, the samples it has not scored
      get 0 (counted as timeouts), the step goes on and a warning names the
      reward and this deadline. Each sample also has its own deadline of
      10 s.
  """

  function: str = "task"
  weight: float = 1.0
  batch_timeout_s: float = 60.0

  def __post_init__(self):
    check_range("rewards.weight", self.weight)
    check_range("rewards.batch_timeout_s", self.batch_timeout_s, gt=0)
    if self.function != "task" and ":" not in self.function:
      raise ValueError(
          f"rewards.function={self.function!r} must be 'task', "
          "'package.module:function' or 'path/to/file.py:function'"
      )


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
    attention: how the policy computes attention in training and prefill:
      ``"auto"`` (cuDNN's fused kernel on GPUs with a bfloat16 policy, else
      the chunked einsums, with a one-line notice on an accelerator),
      ``"chunked"``, ``"xla"`` or ``"cudnn"``
      (``jax.nn.dot_product_attention``); see
      ``models.attention_implementation``.
    remat: activation checkpointing of each decoder block in the train
      step (``DecoderConfig.remat``): ``"block"`` keeps each block's input
      and recomputes the block in the backward pass (activation memory of
      one block per layer; on CPU also the faster step for the tiny model,
      whose backward pass then skips the per-layer residual buffers),
      ``"dots_saveable"`` also keeps the weight projections' outputs
      (attention is recomputed), ``"none"`` keeps everything. It may change
      on resume (the saved state means the same under each).
    batch_invariant: compute the policy with every sum in an order fixed by
      one row's shapes (``DecoderConfig.batch_invariant``), so that the
      colocated sampler's token log-probs are bitwise the learner's
      (``rollout/logprob_gap_max`` 0) in matching dtypes; on CPU the run
      sets ``logra_jax.reduction.CPU_FLAGS`` (XLA:CPU's kernels without
      XNNPACK) before JAX starts. Forces the chunked attention.
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
  attention: str = "auto"
  remat: str = "block"
  batch_invariant: bool = False

  def __post_init__(self):
    check_choice("policy.dtype", self.dtype, ("float32", "bfloat16"))
    if self.batch_invariant and self.attention not in ("auto", "chunked"):
      raise ValueError(
          "policy.batch_invariant computes attention with the chunked "
          f"einsums; policy.attention={self.attention!r} asks for a fused "
          "kernel"
      )
    check_choice("policy.attention", self.attention, ATTENTION)
    check_choice("policy.remat", self.remat, REMAT)
    check_choice(
        "policy.reference_dtype", self.reference_dtype, ("float32", "bfloat16")
    )
    _check(
        "policy",
        self,
        "hidden_size num_layers num_heads num_kv_heads "
        "intermediate_size warm_start_batch warm_start_examples",
        ge=1,
    )
    _check("policy", self, "warm_start_steps", ge=0)
    _check("policy", self, "warm_start_lr", gt=0)
    if self.hidden_size % self.num_heads:
      raise ValueError(
          f"policy.num_heads={self.num_heads} must divide "
          f"policy.hidden_size={self.hidden_size}"
      )
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"policy.num_kv_heads={self.num_kv_heads} must divide "
          f"policy.num_heads={self.num_heads}"
      )
    if (self.hidden_size // self.num_heads) % 2:
      raise ValueError(
          f"policy.hidden_size={self.hidden_size} / policy.num_heads="
          f"{self.num_heads} = {self.hidden_size // self.num_heads} must be "
          "even (the head size, for rotary embeddings)"
      )


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer of the policy.

  Attributes:
    name: ``"logra"`` (default), ``"adam"`` (dense baseline), ``"galore"``
      (``optax.contrib.galore``) or ``"lora"`` (AdamW on low-rank adapters
      of the frozen policy, :mod:`logra_jax.optim.lora`).
    learning_rate: peak learning rate (constant after warmup).
    warmup_steps: linear warmup.
    rank: projection rank (logra, galore); the adapters' rank (lora).
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
      gradient is ever held, see :mod:`logra_jax.optim.sketch_grad`) or
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
      weight exists). Dense leaves keep the policy's dtype. Under lora: the
      dtype of the frozen weights the adapters sit on.
    coords_dtype: dtype of the coordinates ``A`` of the factored policy
      (logra with sketch-direct gradients): ``"float32"`` (default) or
      ``"bfloat16"``, every step's new ``A`` stochastically rounded with
      bits that are a pure function of (seed, step, leaf), so that a sync
      message carries the coordinates in half the bytes and the learner
      holds exactly what it sends (:func:`logra_jax.optim.factored.
      apply_updates`).
    lora_alpha: the adapters' scale numerator, ``s = lora_alpha / rank``
      (lora; a fixed alpha keeps the best learning rate about the same
      across ranks).
    lora_targets: names of the matrices that get adapters (lora); the
      default is every attention and MLP projection.
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
  coords_dtype: str = "float32"
  lora_alpha: float = 32.0
  lora_targets: list[str] = dataclasses.field(
      default_factory=lambda: list(LORA_TARGETS)
  )

  def __post_init__(self):
    check_choice("optimizer.name", self.name, OPTIMIZERS)
    check_choice("optimizer.kind", self.kind, KINDS)
    check_choice("optimizer.moment_policy", self.moment_policy, MOMENT_POLICIES)
    check_choice("optimizer.kl_mode", self.kl_mode, KL_MODES)
    check_choice("optimizer.gradient_mode", self.gradient_mode, GRADIENT_MODES)
    _check("optimizer", self, "learning_rate target_kl lora_alpha", gt=0)
    if not self.lora_targets or len(set(self.lora_targets)) != len(
        self.lora_targets
    ):
      raise ValueError(
          "optimizer.lora_targets must name at least one matrix, each once; "
          f"got {list(self.lora_targets)}"
      )
    _check("optimizer", self, "rank refresh_every kl_subsample", ge=1)
    _check("optimizer", self, "warmup_steps weight_decay max_grad_norm", ge=0)
    _check("optimizer", self, "b1 b2", ge=0, lt=1)
    if self.project_embeddings and self.name in ("adam", "lora"):
      raise ValueError(
          "optimizer.project_embeddings applies to logra and galore; "
          f"{self.name} "
          + (
              "keeps dense moments of every parameter"
              if self.name == "adam"
              else "adapts the matrices of optimizer.lora_targets"
          )
      )
    check_choice("optimizer.base_dtype", self.base_dtype, BASE_DTYPES)
    if self.base_dtype != "float32" and not (
        self.name == "lora"
        or (self.name == "logra" and self.gradient_mode == "sketch")
    ):
      raise ValueError(
          f"optimizer.base_dtype={self.base_dtype!r} needs the frozen base "
          "of optimizer.name='lora' or the factored policy of "
          "optimizer.name='logra' with optimizer.gradient_mode='sketch'; "
          f"got name={self.name!r}, gradient_mode={self.gradient_mode!r}"
      )
    check_choice("optimizer.coords_dtype", self.coords_dtype, COORDS_DTYPES)
    if self.coords_dtype != "float32" and not (
        self.name == "logra" and self.gradient_mode == "sketch"
    ):
      raise ValueError(
          f"optimizer.coords_dtype={self.coords_dtype!r} needs the factored "
          "policy of optimizer.name='logra' with "
          f"optimizer.gradient_mode='sketch'; got name={self.name!r}, "
          f"gradient_mode={self.gradient_mode!r}"
      )


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
class LoggingConfig:
  """What a run shows and records besides ``metrics.jsonl`` and its plots.

  None of these fields changes the results; all may change on resume.

  Attributes:
    samples_every: every this many steps, a table of sampled completions
      with their prompts, answers and rewards is printed and appended to
      ``samples.jsonl`` (0: never).
    samples_shown: rows of that table (the first completion of as many
      prompts of the batch).
    trackers: where the metrics also go: ``"tensorboard"`` (event files
      under ``<out>/tensorboard``) and ``"wandb"`` (Weights & Biases, the
      ``wandb`` extra; its project, entity and offline mode are read from
      ``WANDB_PROJECT``, ``WANDB_ENTITY`` and ``WANDB_MODE``).
    realized_kl_every: the KL between the policy before and after a step's
      last update (``kl/realized``, ``kl/realized_k3``) is measured on step 1
      and every this many steps, by one more forward pass over the batch (1:
      every step, as KL-control studies want; the predicted KL of
      ``optimizer.target_kl`` needs none).
  """

  samples_every: int = 25
  samples_shown: int = 4
  trackers: list[str] = dataclasses.field(
      default_factory=lambda: ["tensorboard"]
  )
  realized_kl_every: int = 10

  def __post_init__(self):
    _check("logging", self, "samples_every", ge=0)
    _check("logging", self, "realized_kl_every", ge=1)
    _check("logging", self, "samples_shown", ge=1)
    for tracker in self.trackers:
      check_choice("logging.trackers", tracker, TRACKERS)
    if len(set(self.trackers)) != len(self.trackers):
      raise ValueError(
          f"logging.trackers lists a tracker twice: " f"{list(self.trackers)}"
      )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """A whole RL run.

  Attributes:
    task: data and verifier.
    policy: model and warm start.
    rollout: sampling.
    optimizer: optimizer.
    rewards: the weighted reward functions; empty: the task's own verifier
      (``[{function: task, weight: 1.0}]``).
    loss: the policy-gradient loss and overlong shaping.
    advantage: one of :data:`ADVANTAGES`.
    steps: learner steps (one rollout batch each).
    num_iterations: optimizer updates per rollout batch (inner epochs).
    micro_batches: gradient accumulation chunks per update.
    eval_every: steps between held-out evaluations (0: only before/after).
    seed: seed of sampling and batching.
    checkpoint: when the run's state is saved and what is kept.
    sync: policy sync to the rollout engine.
    max_consecutive_skips: consecutive steps skipped for a non-finite loss,
      gradient or predicted KL after which the run stops with an error.
    logging: sample tables and trackers.
  """

  task: TaskConfig = TaskConfig()
  policy: PolicyConfig = PolicyConfig()
  rollout: RolloutConfig = RolloutConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  rewards: list[RewardConfig] = dataclasses.field(default_factory=list)
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
  logging: LoggingConfig = LoggingConfig()

  def __post_init__(self):
    check_choice("advantage", self.advantage, ADVANTAGES)
    _check(
        "",
        self,
        "steps num_iterations micro_batches " "max_consecutive_skips",
        ge=1,
    )
    _check("", self, "eval_every", ge=0)
    _check("", self, "seed", ge=0, le=_MAX_SEED)
    batch = self.rollout.prompts_per_step * self.rollout.num_generations
    if batch % self.micro_batches:
      raise ValueError(
          f"micro_batches={self.micro_batches} must divide the rollout batch "
          f"of prompts_per_step * num_generations = {batch} completions"
      )
    if self.loss.overlong_buffer >= self.rollout.max_new_tokens:
      raise ValueError(
          f"loss.overlong_buffer={self.loss.overlong_buffer} must be smaller "
          f"than rollout.max_new_tokens={self.rollout.max_new_tokens} (the "
          "penalty starts overlong_buffer tokens before the budget)"
      )
    check_kl_subsample(self.optimizer, batch)
