"""The RL run, orchestrated: a short loop over the learner
(:mod:`~logra_jax.rl.learner_state`), the rollout pipeline
(:mod:`~logra_jax.rollout.pipeline`), the run log (:mod:`~logra_jax.rl.run_log`)
and checkpoints. Its inputs are checked and its parts set up by
:mod:`~logra_jax.rl.setup`, it is guarded by :mod:`~logra_jax.rl.guards`
(folder lock, stop signals, out-of-memory hint, non-finite steps) and
reported by :mod:`~logra_jax.rl.reporting`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
import shutil
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax

from logra_jax import checkpoint
from logra_jax import envs
from logra_jax import parallel
from logra_jax import reduction
from logra_jax import sync
from logra_jax.configs import TrainConfig, load_config, to_yaml
from logra_jax.data import tasks as tasks_lib
from logra_jax.rl import episode_scoring
from logra_jax.rl import guards
from logra_jax.rl import reporting
from logra_jax.rl import scoring
from logra_jax.rl import setup
from logra_jax.rl import tracking
from logra_jax.rl.learner_state import Learner, build_learner
from logra_jax.rl.run_log import RunLog, step_times
from logra_jax.rollout import engine as engine_lib
from logra_jax.rollout import transport
from logra_jax.rollout.pipeline import PromptStream, RolloutPipeline
from logra_jax.rollout.pipeline import start_engine

Log = Callable[[str], None]


def train(
    config: TrainConfig,
    out_dir: str | pathlib.Path,
    progress: bool = True,
    log: Log = print,
    mesh: parallel.MeshConfig | None = None,
    resume: bool = False,
    allow_reshard: bool = False,
) -> dict[str, Any]:
  """Runs RL as configured; writes metrics, checkpoints, a plot and
  ``summary.json``.

  The whole state (weights, optimizer state, PRNG key, data position,
  metrics history) is saved under ``out_dir/checkpoints`` as
  ``config.checkpoint`` says and after the last step; ``resume`` continues
  from the newest readable checkpoint there and gives the same numbers as a
  run that was never stopped. SIGTERM or SIGINT stop the run after the
  current step, with a checkpoint saved and the summary's ``stopped_by``
  naming the signal. Bad input (policy folder, mesh, task, nothing to
  resume) is refused before ``out_dir`` is created; while the run lasts it
  holds a lock on ``out_dir``. A step whose loss, gradients or
  predicted KL is not finite is skipped (weights unchanged, and the optimizer
  state too for a non-finite loss or gradient) and logged;
  ``config.max_consecutive_skips`` in a row stop the run.

  Args:
    config: the run.
    out_dir: output folder (created): ``config.yaml`` (the resolved config,
      which ``logra train --config`` reads back), ``metrics.jsonl``,
      ``samples.jsonl`` (``config.logging``), ``checkpoints/``,
      ``curves.png``, ``summary.json`` and the files of
      ``config.logging.trackers`` (e.g. TensorBoard events under
      ``tensorboard/``).
    progress: show a progress bar.
    log: where text lines go.
    mesh: optional device mesh (its size must equal the number of devices):
      weights, optimizer state, rollouts and activations are sharded by
      ``parallel.PARTITION_RULES``. The layout does not change the results
      beyond float rounding, so it is not part of ``config``.
    resume: continue the run in ``out_dir`` from its latest checkpoint. Only
      the fields in ``checkpoint.RESUMABLE_FIELDS`` (e.g. ``steps``) may
      differ from the checkpoint's config.
    allow_reshard: with ``resume``, accept a checkpoint written on another
      mesh or process count (restored into this run's layout).

  Returns:
    The summary: held-out accuracy before and after, optimizer-state bytes
    of the run's optimizer and of dense Adam, wall time and more.

  Raises:
    checkpoint.CheckpointError: ``resume`` without a checkpoint, a
      checkpoint from another config, model or mesh, or checkpoints in
      ``out_dir`` without ``resume``.
    guards.RunFolderInUseError: another run holds ``out_dir``.
    FileNotFoundError: ``config.policy.path`` is not a model folder.
    FloatingPointError: ``config.max_consecutive_skips`` steps in a row were
      not finite (the message names the step and the quantity).
    guards.OutOfMemoryError: the step does not fit; the message gives the
      ``logra memory`` command for this config.
  """
  start_time = time.perf_counter()
  out = pathlib.Path(out_dir)
  if config.policy.batch_invariant:  # XLA reads its flags as JAX starts
    reduction.use_invariant_kernels()
  if jax.process_count() > 1:
    mesh = mesh or parallel.MeshConfig(fsdp=jax.device_count())
    # Every process runs the same command; a different config, mesh or
    # resume flag would desynchronize the collectives.
    parallel.check_same_everywhere(
        f"{to_yaml(config)}\nmesh: {mesh}\nresume: {resume}\n"
        f"allow_reshard: {allow_reshard}\nout: {out.resolve()}",
        "the config, --mesh, --resume, --allow-reshard and --out",
    )
    if not parallel.is_leader():  # process 0 logs and writes the files
      progress, log = False, lambda text: None
  task, rewards, episodes, device_mesh = setup.check_inputs(
      config, out, mesh, resume
  )
  inputs = _Inputs(
      config,
      out,
      task,
      rewards,
      episodes,
      progress,
      log,
      mesh,
      device_mesh,
      resume,
      allow_reshard,
      start_time,
  )
  locked = (
      guards.locked_run_folder(out)
      if parallel.is_leader()
      else contextlib.nullcontext()
  )
  with locked, contextlib.ExitStack() as closing:
    checkpointer = checkpoint.Checkpointer(
        out / "checkpoints", config.checkpoint
    )
    closing.callback(checkpointer.close)
    run = _start(inputs, checkpointer, closing)
    with run.stop, run.run_log:
      _run_steps(run)
      after = _finish_steps(run)
    summary = _summary(run, inputs, after)
    reporting.write_report(
        summary, run.run_log.history, out, parallel.is_leader(), log
    )
    return summary


class _Inputs(NamedTuple):
  """What :func:`train` was given, checked."""

  config: TrainConfig
  out: pathlib.Path
  task: tasks_lib.Task
  rewards: list[tuple[Callable, float]]
  episodes: envs.EpisodeConfig | None
  progress: bool
  log: Log
  mesh: parallel.MeshConfig | None
  device_mesh: jax.sharding.Mesh | None
  resume: bool
  allow_reshard: bool
  start_time: float


@dataclasses.dataclass(frozen=True)
class _Run:
  """The parts of a run: each keeps its own state."""

  config: TrainConfig
  log: Log
  checkpointer: checkpoint.Checkpointer
  meta: dict[str, Any]
  learner: Learner
  pipeline: RolloutPipeline
  run_log: RunLog
  stop: guards.StopSignals
  projectors: guards.NonFiniteProjectors
  memory_hint: Callable[[], str]
  sizes: dict[str, Any]  # of the learner's state (Learner.sizes)
  first_step: int
  policy_folder: pathlib.Path
  eval_before: dict[str, float]
  wall_before: float  # seconds of the run before a resume
  start_time: float

  def wall_seconds(self) -> float:
    """Seconds the run has taken, resumes included."""
    return self.wall_before + time.perf_counter() - self.start_time


def _start(
    inputs: _Inputs,
    checkpointer: checkpoint.Checkpointer,
    closing: contextlib.ExitStack,
) -> _Run:
  """The run's parts, its state initial or restored, and its held-out
  accuracy before RL; what it opens (the rollout engine) is closed by
  ``closing``."""
  config, out, log = inputs.config, inputs.out, inputs.log
  compilations = closing.enter_context(tracking.Compilations())
  setup.check_checkpoints(checkpointer, out, inputs.resume)
  train_examples, eval_examples = inputs.task.split(
      config.task.eval_size, seed=config.task.seed
  )
  folder = setup.policy_folder(config, train_examples, log)
  policy = setup.load_policy(config, folder, inputs.device_mesh, log)
  meta = setup.run_meta(
      config,
      policy,
      inputs.mesh,
      checkpointer,
      inputs.resume,
      inputs.allow_reshard,
  )
  learner = build_learner(config, policy, inputs.device_mesh)
  if inputs.resume:
    loop = learner.restore(checkpointer, meta, inputs.allow_reshard, log)
  else:
    loop = learner.init()
  # From here on the learner's weights are the policy (a bfloat16 base would
  # otherwise sit next to the float32 weights it was made from), and the
  # rollout engine's copy follows them through sync messages.
  policy.params = None
  sender, engine = start_engine(
      config,
      policy,
      folder,
      out,
      learner.state,
      learner.params_sharding,
      closing,
  )
  if parallel.is_leader():
    (out / "config.yaml").write_text(to_yaml(config))
  pipeline = _start_pipeline(
      inputs, engine, sender, loop, train_examples, eval_examples
  )
  closing.callback(pipeline.close)
  memory_hint = guards.memory_hint(config, inputs.mesh, policy, eval_examples)
  eval_before = _eval_before(loop, pipeline, memory_hint)
  log(
      f"held-out accuracy before RL: {eval_before['accuracy']:.3f} "
      f"({len(eval_examples)} prompts)"
  )
  return _Run(
      config=config,
      log=log,
      checkpointer=checkpointer,
      meta=meta,
      learner=learner,
      pipeline=pipeline,
      run_log=RunLog(
          config,
          out,
          loop.history,
          loop.step,
          compilations,
          leader=parallel.is_leader(),
          resume=inputs.resume,
          progress=inputs.progress,
          log=log,
      ),
      stop=guards.StopSignals(log, on_stuck=pipeline.interrupt),
      projectors=guards.NonFiniteProjectors(log),
      memory_hint=memory_hint,
      sizes=learner.sizes(),
      first_step=loop.step,
      policy_folder=folder,
      eval_before=eval_before,
      wall_before=loop.extras.get("wall_seconds", 0.0),
      start_time=inputs.start_time,
  )


def _start_pipeline(
    inputs: _Inputs,
    engine: engine_lib.Engine,
    sender: sync.PolicySender,
    loop: checkpoint.LoopState,
    train_examples: Sequence[dict],
    eval_examples: Sequence[dict],
) -> RolloutPipeline:
  """The rollout pipeline of a run at ``loop``'s step, data position and
  key: the engine samples and :mod:`~logra_jax.rl.scoring` scores."""
  config = inputs.config
  prompts = PromptStream(
      train_examples,
      config.rollout.prompts_per_step,
      seed=config.seed,
      position=loop.data_position,
  )
  sampling = (engine.policy, engine.sample)
  if inputs.episodes is None:
    rollout_fn = functools.partial(
        scoring.scored_rollout,
        *sampling,
        config,
        inputs.rewards,
        pool=train_examples,
    )
    evaluate_fn = functools.partial(
        scoring.evaluate_with,
        *sampling,
        eval_examples,
        inputs.rewards,
        config.rollout.max_new_tokens,
    )
  else:
    rollout_fn = functools.partial(
        episode_scoring.scored_episodes,
        *sampling,
        config,
        inputs.rewards,
        inputs.episodes,
    )
    evaluate_fn = functools.partial(
        episode_scoring.evaluate_episodes,
        *sampling,
        eval_examples,
        inputs.rewards,
        config.rollout.max_new_tokens,
        inputs.episodes,
    )
  return RolloutPipeline(
      engine,
      sender,
      config,
      prompts,
      loop.key,
      loop.step,
      rollout_fn=rollout_fn,
      evaluate_fn=evaluate_fn,
      log=inputs.log,
  )


def _eval_before(
    loop: checkpoint.LoopState,
    pipeline: RolloutPipeline,
    memory_hint: Callable[[], str],
) -> dict[str, float]:
  """The held-out accuracy before RL (a resumed run's, from its
  checkpoint)."""
  before = loop.extras.get("eval_before")
  if before is None:
    with guards.explain_out_of_memory(0, memory_hint):
      before = pipeline.evaluate()
  return before


def _run_steps(run: _Run) -> None:
  """The step loop: a rollout, the learner's update, the engine's sync,
  the step's record, then a checkpoint when one is due or a signal came."""
  config, learner, pipeline, run_log = (
      run.config,
      run.learner,
      run.pipeline,
      run.run_log,
  )
  for step in run_log.steps():
    done = step + 1
    step_start = time.perf_counter()
    with guards.explain_out_of_memory(done, run.memory_hint):
      rollout, version_lag = _next_rollout(run, step)
      rollout.metrics["rollout/version_lag"] = float(version_lag)
      run_log.observe(rollout.samples)
      batch = learner.prepare(rollout.batch)
      rollout_seconds = time.perf_counter() - step_start
      update = learner.update(batch)
      synced = pipeline.sync(learner.state, done)
      # Engines sample the next rollout from the weights the next update
      # differentiates: a window due to be merged is merged now, by the
      # learner and by each engine's copy (after the message just sent).
      if learner.merge_ahead():
        pipeline.follow(learner.state)
    metrics = run_log.step_metrics(
        rollout.metrics, update, done, pipeline.sync_metrics(synced)
    )
    sync_seconds = 0.0 if pipeline.asynchronous else synced.seconds
    metrics.update(step_times(step_start, rollout_seconds, sync_seconds))
    evaluated = bool(
        config.eval_every
        and done % config.eval_every == 0
        and done < config.steps
    )
    if evaluated:
      metrics["accuracy/eval"] = pipeline.evaluate()["accuracy"]
    run_log.record(metrics, done)
    run.projectors.check(done, metrics)
    guards.check_finite(
        done,
        update.skipped,
        update.guard,
        config.max_consecutive_skips,
        run.checkpointer.latest_step(),
        run.log,
    )
    if run.stop.received:
      _save(run, done, wait=True)
      run.log(
          f"stopped by {run.stop.received} after step {done}; checkpoint "
          f"{run.checkpointer.directory / str(done)}"
      )
      break
    if done < config.steps and run.checkpointer.due(done, evaluated):
      _save(run, done, metrics.get("accuracy/eval"))
    run_log.show(metrics)


def _next_rollout(run: _Run, step: int) -> tuple[Any, int]:
  """The rollout of step ``step + 1``. A stop signal while it is awaited,
  or an engine lost for good, first saves the last completed step."""
  try:
    with run.stop.abandonable():
      return run.pipeline.next_rollout(step)
  except (guards.StepAbandoned, transport.TransportError):
    if step and run.checkpointer.latest_step() != step:
      _save(run, step, wait=True)
    saved = run.checkpointer.latest_step()
    what = (
        f"stopped by {run.stop.received}"
        if run.stop.received
        else "rollout engine lost"
    )
    run.log(
        f"{what} during the rollout of step {step + 1}; latest checkpoint: "
        + (
            "none"
            if saved is None
            else str(run.checkpointer.directory / str(saved))
        )
    )
    raise


def _finish_steps(run: _Run) -> dict[str, float]:
  """Waits for the engine's last syncs, evaluates the final policy and
  saves it unless the last step was saved; the held-out accuracy after."""
  run.pipeline.collect_syncs(run.learner.state, wait=True)
  after = run.pipeline.evaluate()
  steps = len(run.run_log.history)
  if run.checkpointer.latest_step() != steps:
    _save(run, steps, after["accuracy"], wait=True)
  return after


def _save(
    run: _Run,
    step: int,
    eval_accuracy: Optional[float] = None,
    wait: bool = False,
) -> None:
  """Saves checkpoint ``step``: the learner's state, and the loop's from
  the first batch not yet trained on."""
  position, resume_key = run.pipeline.resume_point()
  loop = checkpoint.LoopState(
      step=step,
      key=resume_key,
      data_position=position,
      history=run.run_log.history,
      extras={
          "eval_before": run.eval_before,
          "wall_seconds": run.wall_seconds(),
      },
  )
  run.learner.save(run.checkpointer, loop, run.meta, eval_accuracy, wait)


def _summary(
    run: _Run, inputs: _Inputs, after: dict[str, float]
) -> dict[str, Any]:
  """The run's summary (``summary.json``)."""
  history = run.run_log.history
  return {
      **run.sizes,
      "eval_accuracy_before": run.eval_before["accuracy"],
      "eval_accuracy_after": after["accuracy"],
      "eval_score_before": run.eval_before["score"],
      "eval_score_after": after["score"],
      "steps": len(history),
      "interrupted": len(history) < inputs.config.steps,
      "stopped_by": run.stop.received,
      "resumed_from_step": run.first_step if inputs.resume else None,
      "skipped_steps": int(sum(h.get("skipped", 0.0) for h in history)),
      "checkpoint_steps": run.checkpointer.all_steps(),
      "wall_seconds": run.wall_seconds(),
      "policy_folder": str(run.policy_folder),
  }


def _saved_config(out: pathlib.Path) -> Optional[TrainConfig]:
  """The config a run folder's ``config.yaml`` holds (None if it no longer
  reads as one)."""
  try:
    return load_config("tiny", [out / "config.yaml"])
  except ValueError:
    return None


def train_or_reuse(
    config: TrainConfig, out_dir: str | pathlib.Path, rerun: bool = False
) -> dict[str, Any]:
  """:func:`train` quietly, unless ``out_dir`` already holds a finished run
  of the same config; returns its summary. An unfinished run of the same
  config (killed, or stopped by a signal: its summary names it) resumes
  from its checkpoint; checkpoints, summary, samples and tracker files of
  another config (or all of them, with ``rerun``) are deleted first. For
  studies that resume."""
  out = pathlib.Path(out_dir)
  same = (out / "config.yaml").exists() and _saved_config(out) == config
  if same and not rerun and (out / "summary.json").exists():
    summary = json.loads((out / "summary.json").read_text())
    if not summary.get("stopped_by"):  # a stopped run resumes below
      return summary
  resume = False
  if (out / "checkpoints").exists():
    if same and not rerun:
      with checkpoint.Checkpointer(
          out / "checkpoints", config.checkpoint
      ) as ckpt:
        resume = ckpt.latest_step() is not None
    if not resume:
      shutil.rmtree(out / "checkpoints")
  if not resume:  # what an earlier run of another config left
    for name in ("summary.json", "samples.jsonl", "wandb-run-id"):
      (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "tensorboard", ignore_errors=True)
  return train(config, out, progress=False, log=lambda s: None, resume=resume)
