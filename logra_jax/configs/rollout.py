"""The rollout section of a run config: sampling, the rollout engine and
its liveness, asynchronous rollouts and multi-turn episodes
(``rollout.*``).

Like every section of :mod:`logra_jax.configs.schema`, it is checked when
built, refusing an out-of-range value naming its dotted path.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from logra_jax.checks import check_choice, check_range

ROLLOUT_ENGINES = ("colocated", "process")
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16")
# The longest an engine may stay silent: a day (the socket's timeout).
MAX_ENGINE_TIMEOUT_S = 86_400.0


def _check(config: "RolloutConfig", names: str, **bounds: float) -> None:
  """:func:`check_range` on the fields ``names`` (space-separated) of
  ``config`` that are not None, each named ``rollout.<field>``."""
  for name in names.split():
    value = getattr(config, name)
    if value is not None:
      check_range(f"rollout.{name}", value, **bounds)


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
      devices, sent each sync message as bytes over a local socket; one
      learner process, sharded or not). Its weights are bit-identical
      either way, so the run's results are too.
    dtype: the dtype of the weights the engine samples with, cast from the
      synced policy once per message: ``"float32"``, ``"bfloat16"`` or
      ``"auto"`` (bfloat16 on GPU and TPU, float32 on CPU, whose bfloat16
      matmuls are slow). The engine's synced copy, which its checksums
      verify, keeps the learner's dtypes.
    max_staleness: how many policy versions a batch may lag behind the
      weights it trains: 0 samples each batch with the latest weights (the
      synchronous loop); s > 0 lets the engine sample the next s batches
      while the learner trains on this one (asynchronous rollouts, one step
      off-policy for s = 1), the importance ratios taken against the
      sampler's own log-probabilities. Metrics record each batch's lag
      (``rollout/version_lag``). With a mesh it needs
      ``engine="process"``: a colocated engine would launch sharded programs
      onto the learner's devices from a second thread.
    dynamic_sampling: DAPO's dynamic sampling: groups whose rewards are all
      equal (no advantage) are dropped and the batch is filled with groups
      of more prompts, drawn from the training split by the rollout's key,
      in up to ``max_resample_rounds`` more samplings of
      ``prompts_per_step`` prompts; groups still missing after that are
      equal-reward groups masked from the loss (metrics
      ``rollout/resample_rounds``, ``rollout/dropped_groups``,
      ``rollout/masked_groups``).
    max_resample_rounds: the bound of ``dynamic_sampling``.
    max_turns: model turns per episode, each up to ``max_new_tokens``.
    max_episode_tokens: model and environment tokens per episode at most;
      ``None``: the policy's context.
    env_timeout_s: seconds each environment call may take (making the
      environment and its ``reset`` together, or one ``step``): past it the
      episode ends as a failure with reward 0, counted in ``env/failures``
      and ``env/timeouts``, and the run goes on. ``None``: unbounded, the
      calls run in the rollout's own thread.
    engine_timeout_s: the longest the process engine may stay silent, in
      seconds: while it works on a request it sends a heartbeat every
      quarter of this, so a frozen (e.g. stopped) or dead engine is noticed
      within this time however long a request takes (loading and
      compiling included). The colocated engine runs in the learner's
      process and has none.
    engine_restarts: how many times a run restarts a process engine that
      froze or died: the new engine is sent the learner's weights (those
      of the last completed step) in full and samples the lost requests
      again, with their prompts and keys; once they are spent, the run
      saves a checkpoint of its last completed step and stops with one
      line naming the engine's exit code and its log.
  """

  prompts_per_step: int = 64
  num_generations: int = 8
  max_new_tokens: int = 6
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  engine: str = "colocated"
  dtype: str = "auto"
  max_staleness: int = 0
  dynamic_sampling: bool = False
  max_resample_rounds: int = 3
  max_turns: int = 1
  max_episode_tokens: Optional[int] = None
  env_timeout_s: Optional[float] = None
  engine_timeout_s: float = 60.0
  engine_restarts: int = 1

  def __post_init__(self):
    check_choice("rollout.engine", self.engine, ROLLOUT_ENGINES)
    _check(self, "max_turns max_episode_tokens", ge=1)
    _check(self, "max_staleness max_resample_rounds", ge=0)
    check_choice("rollout.dtype", self.dtype, ROLLOUT_DTYPES)
    _check(self, "prompts_per_step max_new_tokens", ge=1)
    _check(self, "num_generations", ge=2)  # a group baseline
    _check(self, "temperature", gt=0)
    _check(self, "top_p", gt=0, le=1)
    _check(self, "top_k", ge=0)
    _check(self, "engine_timeout_s", gt=0, le=MAX_ENGINE_TIMEOUT_S)
    _check(self, "env_timeout_s", gt=0)
    _check(self, "engine_restarts", ge=0)
