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


from logra_jax.checks import check_choice, check_fields, check_range
from logra_jax.configs.loss import LossConfig
from logra_jax.configs.optimizer import OptimizerConfig
from logra_jax.configs.rollout import RolloutConfig
from logra_jax.envs.loading import check_spec as check_environment
from logra_jax.models.config import ATTENTION
from logra_jax.models.config import REMAT

CHAT_TEMPLATES = ("auto", "none")
TRACKERS = ("tensorboard", "wandb")
# Group advantage estimators (``rl.algo.ADVANTAGE_ESTIMATORS`` implements
# each).
ADVANTAGES = ("grpo", "dr_grpo", "rloo")
# Seeds become int64 PRNG keys (``jax.random.key``).
_MAX_SEED = 2**63 - 1


def check_kl_subsample(
    optimizer: OptimizerConfig,
    rows: int,
    data_axes: int = 1,
    batch: str = "the rollout batch of {rows} completions",
) -> None:
  """Raises a ValueError unless ``optimizer.kl_subsample`` sequences fit in
  a batch of ``rows`` (named in the message by ``batch``, formatted with
  ``rows``) and, under KL control (``optimizer.target_kl``), split evenly
  over ``data_axes`` devices (the mesh's ``dp x fsdp``): the KL predictor's
  sequences are sharded like the batch.

  Example:
    >>> kl_control = OptimizerConfig(target_kl=0.01, kl_subsample=4)
    >>> check_kl_subsample(kl_control, 8, 8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: optimizer.kl_subsample=4 is not divisible by the mesh's data ...
  """
  subsample = optimizer.kl_subsample
  if (subsample or 0) > rows:
    raise ValueError(
        f"optimizer.kl_subsample={subsample} exceeds " + batch.format(rows=rows)
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
    check_fields("task", self, "size eval_size max_digits", ge=1)
    check_fields("task", self, "size", le=MAX_TASK_SIZE)
    _check_template(self.template)
    check_fields("task", self, "seed", ge=0, le=_MAX_SEED)
    check_fields("task", self, "terms", ge=2)
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
      XNNPACK, at XLA's default optimization level) before JAX starts.
      Forces the chunked attention.
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
    check_fields(
        "policy",
        self,
        "hidden_size num_layers num_heads num_kv_heads "
        "intermediate_size warm_start_batch warm_start_examples",
        ge=1,
    )
    check_fields("policy", self, "warm_start_steps", ge=0)
    check_fields("policy", self, "warm_start_lr", gt=0)
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
    check_fields(
        "checkpoint", self, "every_steps every_seconds keep_best", ge=0
    )
    check_fields("checkpoint", self, "keep", ge=1)


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
    check_fields("sync", self, "resync_every", ge=0)


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
    check_fields("logging", self, "samples_every", ge=0)
    check_fields("logging", self, "realized_kl_every", ge=1)
    check_fields("logging", self, "samples_shown", ge=1)
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
    check_fields(
        "",
        self,
        "steps num_iterations micro_batches " "max_consecutive_skips",
        ge=1,
    )
    check_fields("", self, "eval_every", ge=0)
    check_fields("", self, "seed", ge=0, le=_MAX_SEED)
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
