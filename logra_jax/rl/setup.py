"""Setting up a run: its inputs checked, its task, rewards and policy
folder (warm-started when none is given), its policy loaded and its
checkpoints checked against the run."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from logra_jax import checkpoint
from logra_jax import envs
from logra_jax import models
from logra_jax import parallel
from logra_jax.configs import RewardConfig, TrainConfig, check_kl_subsample
from logra_jax.data import tasks as tasks_lib
from logra_jax.rl import preflight
from logra_jax.rl import rewards as rewards_lib
from logra_jax.rl import tracking
from logra_jax.rl.warm_start import warm_start
from logra_jax.rollout import engine as engine_lib

Log = Callable[[str], None]


def load_task(config: TrainConfig) -> tasks_lib.Task:
  """The task of a run, from its name and options."""
  task = config.task
  if task.name == "tiny" or task.name == tasks_lib.TINY_TASK:
    return tasks_lib.tiny_arithmetic_task(
        size=task.size,
        seed=task.seed,
        template=task.template,
        **{
            "min_terms": task.terms,
            "max_terms": task.terms,
            "max_digits": task.max_digits,
            **task.options,
        },
    )
  if task.name.lower().endswith(tuple(tasks_lib.FILE_BUILDERS)):
    if task.options:
      raise ValueError(
          f"task.options={dict(task.options)} configure a reasoning-gym "
          f"generator; {task.name} is a data file (see task.prompt_column, "
          "task.answer_column, task.template, task.answer_after)"
      )
    return tasks_lib.file_task(
        task.name,
        prompt_column=task.prompt_column,
        answer_column=task.answer_column,
        template=task.template,
        answer_after=task.answer_after,
    )
  return tasks_lib.reasoning_gym_task(
      task.name,
      size=task.size,
      seed=task.seed,
      config=task.options,
      template=task.template,
  )


def task_verifier(task: tasks_lib.Task) -> Callable:
  """The task's own verifier: reasoning-gym's ``score_answer`` when the task
  has one, else math-verify equivalence to the ``answer`` column."""
  if task.score_answer is not None:
    return rewards_lib.reasoning_gym_reward(task.score_answer)
  return rewards_lib.math_verify_equivalence


def run_rewards(
    config: TrainConfig, task: tasks_lib.Task
) -> list[tuple[Callable, float]]:
  """The run's ``(reward_fn, weight)`` pairs (``config.rewards``; none: the
  task's verifier), each tried on a few of the task's reference answers
  (:func:`rewards_lib.check_reward_functions`), so that a bad one fails
  before anything compiles."""
  specs = config.rewards or [RewardConfig()]
  rewards = [
      (
          rewards_lib.TimedReward(
              task_verifier(task)
              if spec.function == "task"
              else rewards_lib.load_reward_function(spec.function),
              spec.batch_timeout_s,
          ),
          spec.weight,
      )
      for spec in specs
  ]
  for spec, reward in zip(specs, rewards):  # errors name the config entry
    try:
      rewards_lib.check_reward_functions([reward], task.examples[:4])
    except ValueError as error:
      raise ValueError(f"rewards.function={spec.function!r}: {error}") from None
  return rewards


def episode_config(config: TrainConfig) -> envs.EpisodeConfig | None:
  """How the run plays episodes (``task.environment``, loaded and tried
  once), or None for single-turn rollouts; refuses the rollout features
  episodes do not support yet."""
  if not config.task.environment:
    if config.rollout.max_turns > 1:
      raise ValueError(
          f"rollout.max_turns={config.rollout.max_turns} needs an "
          "environment to answer the model's turns (task.environment)"
      )
    return None
  unsupported = {
      "rollout.dynamic_sampling": config.rollout.dynamic_sampling,
      "loss.overlong_buffer": config.loss.overlong_buffer,
      "loss.mask_truncated": config.loss.mask_truncated,
  }
  for name, value in unsupported.items():
    if value:
      raise ValueError(
          f"{name}={value} is not supported with task.environment yet"
      )
  return envs.EpisodeConfig(
      envs.load_environment(config.task.environment),
      config.rollout.max_turns,
      config.rollout.max_episode_tokens,
      config.rollout.env_timeout_s,
  )


def policy_folder(
    config: TrainConfig, train_examples: Sequence[dict], log: Log = print
) -> pathlib.Path:
  """The HF folder RL starts from: ``policy.path``, or the (cached)
  warm-started policy trained on ``train_examples``' worked answers."""
  if config.policy.path:
    return pathlib.Path(config.policy.path).expanduser()
  warm = lambda: warm_start(
      config.policy,
      train_examples[: config.policy.warm_start_examples],
      seed=config.task.seed,
      environment=config.task.environment,
      log=log,
  )
  # Several processes: the first trains (or finds) the cached policy while
  # the others wait, then they find it too.
  folder = warm() if parallel.is_leader() else None
  parallel.barrier("warm start")
  return folder or warm()


def check_inputs(
    config: TrainConfig,
    out: pathlib.Path,
    mesh: parallel.MeshConfig | None,
    resume: bool,
) -> tuple[
    tasks_lib.Task,
    list[tuple[Callable, float]],
    envs.EpisodeConfig | None,
    jax.sharding.Mesh | None,
]:
  """Checks what a run needs before anything is written to ``out``: the
  policy folder, the checkpoint folder of a resumed run, the mesh, the task,
  the rewards, the environment, and what needs the policy's shapes or
  tokenizer (:mod:`preflight`: the optimizer's plan, the warm start's
  cache folder, the prompts, a resumed run's config). Returns the task, the rewards, the
  episodes' settings (None without an environment) and the device mesh."""
  if config.policy.path:
    engine_lib.check_policy_folder(config.policy.path)
  models.attention_implementation(
      config.policy.attention, config.policy.dtype, setting="policy.attention"
  )
  if config.rollout.engine == "process" and jax.process_count() > 1:
    raise ValueError(
        "rollout.engine=process starts one engine beside one learner "
        "process; with several processes use rollout.engine=colocated"
    )
  if (
      config.rollout.max_staleness
      and config.rollout.engine == "colocated"
      and (mesh is not None or jax.process_count() > 1)
  ):
    # Two threads launching sharded programs onto the same devices may
    # enqueue them in different orders on different devices, and their
    # collectives then wait on each other.
    raise ValueError(
        "rollout.max_staleness > 0 (asynchronous rollouts) with a mesh needs "
        "the engine in its own process (rollout.engine=process): a colocated "
        "engine would launch sharded programs onto the learner's devices "
        "from a second thread"
    )
  tracking.check_trackers(config.logging.trackers)
  if resume and not (out / "checkpoints").is_dir():
    raise checkpoint.CheckpointError(
        f"nothing to resume in {out}: no folder {out / 'checkpoints'}"
    )
  device_mesh = None
  if mesh is not None:
    device_mesh = parallel.make_mesh(mesh)
    rows = config.rollout.prompts_per_step * config.rollout.num_generations
    if rows % (mesh.dp * mesh.fsdp):
      raise ValueError(
          f"the rollout batch of {rows} completions is not divisible by the "
          f"data axes of mesh {mesh} ({mesh.dp * mesh.fsdp})"
      )
    check_kl_subsample(config.optimizer, rows, mesh.dp * mesh.fsdp)
  task = load_task(config)
  rewards = run_rewards(config, task)
  episodes = episode_config(config)
  preflight.check_policy_inputs(config, task, out, resume)
  return task, rewards, episodes, device_mesh


def check_checkpoints(
    checkpointer: checkpoint.Checkpointer, out: pathlib.Path, resume: bool
) -> None:
  """Refuses a resumed run without a finished checkpoint, and a new run in
  a folder that holds checkpoints of an earlier one."""
  if resume and checkpointer.latest_step() is None:
    raise checkpoint.CheckpointError(
        f"nothing to resume in {out}: no finished checkpoint in "
        f"{checkpointer.directory}"
    )
  if not resume and checkpointer.latest_step() is not None:
    raise checkpoint.CheckpointError(
        f"{out} holds checkpoints of an earlier run (steps "
        f"{checkpointer.all_steps()}); resume it (logra train --resume) or "
        f"choose another output folder"
    )


def load_policy(
    config: TrainConfig,
    folder: pathlib.Path,
    device_mesh: jax.sharding.Mesh | None,
    log: Log,
) -> engine_lib.Policy:
  """The run's policy from ``folder`` as ``config.policy`` and
  ``config.task`` say (laid out on ``device_mesh``); logs the attention
  implementation's notice, if any."""
  policy = engine_lib.Policy.load(
      folder,
      dtype=jnp.dtype(config.policy.dtype),
      mesh=device_mesh,
      chat_template=config.task.chat_template,
      system_prompt=config.task.system_prompt,
      attention=config.policy.attention,
      remat=config.policy.remat,
      batch_invariant=config.policy.batch_invariant,
  )
  _, notice = models.attention_implementation(
      config.policy.attention, config.policy.dtype, setting="policy.attention"
  )
  if notice and not config.policy.batch_invariant:  # chunked, always
    log(notice)
  return policy


def run_meta(
    config: TrainConfig,
    policy: engine_lib.Policy,
    mesh: parallel.MeshConfig | None,
    checkpointer: checkpoint.Checkpointer,
    resume: bool,
    allow_reshard: bool,
) -> dict[str, Any]:
  """The run's checkpoint metadata (:func:`checkpoint.run_meta`); a resumed
  run's newest checkpoint is checked against it at once, before anything
  compiles (restoring checks it again)."""
  meta = checkpoint.run_meta(
      config,
      json.loads((policy.folder / "config.json").read_text()),
      policy.tokenizer,
      mesh,
  )
  if resume:
    try:
      saved = checkpointer.read_meta()
    except checkpoint.CorruptCheckpointError:
      saved = None  # restore_latest falls back to an older checkpoint
    if saved is not None:
      checkpoint.check_resumable(saved, meta, allow_reshard)
  return meta
