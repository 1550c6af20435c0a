"""The RL run: policy, data, rollouts, learner steps, evaluation and reports."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import filelock
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

import logra_jax as logra
from logra_jax import checkpoint
from logra_jax import models
from logra_jax import parallel
from logra_jax import sync
from logra_jax.configs import (
    RewardConfig,
    TrainConfig,
    load_config,
    to_dict,
    to_yaml,
)
from logra_jax.data import tasks as tasks_lib
from logra_jax.rl import algo
from logra_jax.rl import learner as learner_lib
from logra_jax.rl import reference as reference_lib
from logra_jax.rl import rewards as rewards_lib
from logra_jax.rl import tracking
from logra_jax.rl.warm_start import warm_start
from logra_jax.rollout import engine as engine_lib
from logra_jax.rollout import transport
from logra_jax import policy_state
from logra_jax.optim import non_finite

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
          task_verifier(task)
          if spec.function == "task"
          else rewards_lib.load_reward_function(spec.function),
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
      log=log,
  )
  # Several processes: the first trains (or finds) the cached policy while
  # the others wait, then they find it too.
  folder = warm() if parallel.is_leader() else None
  parallel.barrier("warm start")
  return folder or warm()


class PromptStream:
  """The run's prompt batches (``tasks.prompt_batches``), counting how many
  it has given so that a resumed run draws exactly the same ones.

  Example:
    >>> examples = [{"prompt": str(i), "answer": ""} for i in range(5)]
    >>> stream = PromptStream(examples, 2, seed=0)
    >>> _ = next(stream), next(stream)
    >>> resumed = PromptStream(examples, 2, seed=0, position=stream.position)
    >>> next(resumed) == next(stream)
    True
  """

  def __init__(
      self,
      examples: Sequence[dict],
      batch_size: int,
      seed: int,
      position: int = 0,
  ):
    self._batches = tasks_lib.prompt_batches(examples, batch_size, seed=seed)
    for _ in range(position):
      next(self._batches)
    self.position = position

  def __iter__(self) -> Iterator[list[dict]]:
    return self

  def __next__(self) -> list[dict]:
    self.position += 1
    return next(self._batches)


class RunFolderInUseError(ValueError):
  """Another run holds the output folder (its lock, ``<out>/.lock``)."""


@contextlib.contextmanager
def _locked_run_folder(out: pathlib.Path) -> Iterator[None]:
  """Creates ``out`` and holds an exclusive lock on it for the block, so
  that two runs never write the same folder; the second is refused at once.
  The lock dies with its process: a killed run leaves no stale lock."""
  out.mkdir(parents=True, exist_ok=True)
  lock = filelock.FileLock(out / ".lock")
  try:
    lock.acquire(timeout=0)
  except filelock.Timeout:
    raise RunFolderInUseError(
        f"{out} is in use by another run (it holds {out / '.lock'}); wait "
        "for it to end or choose another output folder"
    ) from None
  try:
    yield
  finally:
    lock.release()


def _check_inputs(
    config: TrainConfig,
    out: pathlib.Path,
    mesh: parallel.MeshConfig | None,
    resume: bool,
) -> tuple[
    tasks_lib.Task, list[tuple[Callable, float]], jax.sharding.Mesh | None
]:
  """Checks what a run needs before anything is written to ``out``: the
  policy folder, the checkpoint folder of a resumed run, the mesh, the task
  and the rewards. Returns the task, the rewards and the device mesh."""
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
  task = load_task(config)
  return task, run_rewards(config, task), device_mesh


class OutOfMemoryError(MemoryError):
  """The rollout or the train step does not fit in device memory."""


def memory_command(
    config: TrainConfig,
    mesh: parallel.MeshConfig | None,
    folder: pathlib.Path,
    seq_len: int,
) -> str:
  """The ``logra memory`` command that plans a run's train step per device.

  Example:
    >>> from logra_jax.configs import get_preset
    >>> print(memory_command(get_preset("smoke"), None, pathlib.Path("p"), 20)
    ...       .replace(" --", "\\n--"))
    logra memory
    --model p/config.json
    --mesh dp=1,fsdp=1,tp=1
    --optimizer logra
    --rank 4
    --seq 20
    --micro-batch 16
    --rollout-seqs 16
    --rollout-tokens 20
  """
  mesh = mesh or parallel.MeshConfig()
  rows = config.rollout.prompts_per_step * config.rollout.num_generations
  per_device = max(1, rows // config.micro_batches // (mesh.dp * mesh.fsdp))
  optimizer = "adam" if config.optimizer.name == "adam" else "logra"
  flags = (
      f" --reference-dtype {config.policy.reference_dtype}"
      if config.loss.beta > 0
      else ""
  )
  if config.optimizer.base_dtype != "float32":
    flags += f" --base-dtype {config.optimizer.base_dtype}"
  return (
      f"logra memory --model {folder / 'config.json'} --mesh {mesh} "
      f"--optimizer {optimizer} --rank {config.optimizer.rank} "
      f"--seq {seq_len} --micro-batch {per_device} --rollout-seqs {rows} "
      f"--rollout-tokens {seq_len}{flags}"
  )


def out_of_memory_error(
    error: BaseException, step: int, command: str
) -> Optional[OutOfMemoryError]:
  """An :class:`OutOfMemoryError` explaining ``error`` if it is XLA's
  out-of-memory (``RESOURCE_EXHAUSTED``), else None.

  Example:
    >>> error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")
    >>> "logra memory" in str(out_of_memory_error(error, 1, "logra memory"))
    True
  """
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
    return None
  first = text.strip().splitlines()[0][:300] if text.strip() else ""
  return OutOfMemoryError(
      f"step {step}: out of memory compiling or running the sampler or the "
      f"train step ({first}). See what this config needs per device with: "
      f"{command} ; then raise micro_batches, lower "
      f"rollout.prompts_per_step or optimizer.rank, or shard over more "
      f"devices (--mesh)"
  )


@contextlib.contextmanager
def _explain_out_of_memory(step: int, command: Callable[[], str]):
  """Turns XLA's out-of-memory inside the block into an
  :class:`OutOfMemoryError` that gives ``command()``."""
  try:
    yield
  except jax.errors.JaxRuntimeError as error:
    explained = out_of_memory_error(error, step, command())
    if explained is None:
      raise
    raise explained from error


class _StopSignals:
  """SIGTERM and SIGINT ask the run to stop after the current step (it then
  saves a checkpoint); a second signal stops it at once (KeyboardInterrupt).
  Handlers are only installed on the main thread, and restored on exit."""

  def __init__(self, log: Log):
    self.received: Optional[str] = None
    self._log = log
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "_StopSignals":
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame) -> None:
    del frame
    if self.received is not None:
      raise KeyboardInterrupt
    self.received = signal.Signals(signum).name
    self._log(
        f"{self.received}: stopping after the current step and saving "
        "a checkpoint (send it again to stop at once, without saving)"
    )

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


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
    RunFolderInUseError: another run holds ``out_dir``.
    FileNotFoundError: ``config.policy.path`` is not a model folder.
    FloatingPointError: ``config.max_consecutive_skips`` steps in a row were
      not finite (the message names the step and the quantity).
    OutOfMemoryError: the step does not fit; the message gives the
      ``logra memory`` command for this config.
  """
  start_time = time.perf_counter()
  out = pathlib.Path(out_dir)
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
  task, rewards, device_mesh = _check_inputs(config, out, mesh, resume)
  locked = (
      _locked_run_folder(out)
      if parallel.is_leader()
      else contextlib.nullcontext()
  )
  with locked, contextlib.ExitStack() as closing:
    checkpointer = checkpoint.Checkpointer(
        out / "checkpoints", config.checkpoint
    )
    closing.callback(checkpointer.close)
    return _train(
        config,
        out,
        checkpointer,
        task,
        rewards,
        progress,
        log,
        mesh,
        device_mesh,
        resume,
        allow_reshard,
        start_time,
        closing,
    )


class _Learner(NamedTuple):
  """What :func:`_learner_step` builds for a run."""

  params: Any  # the policy's params, placed for the train step
  tx: Any  # the optimizer
  state_sharding: Any  # of the optimizer state
  weights_sharding: (
      Any  # of the learner's weights (policy_state.init_train_state)
  )
  place_batch: Callable  # places a rollout batch
  train_step: Callable
  fill_reference: Optional[Callable]  # reference log-probs (loss.beta > 0)
  params_sharding: Any  # of the dense params


def _learner_step(
    config: TrainConfig,
    policy: engine_lib.Policy,
    mesh: jax.sharding.Mesh | None,
):
  """The optimizer and the jitted train step of a run, with the policy's
  params placed for it, the shardings of the optimizer state and of the
  learner's weights (:func:`policy_state.init_train_state`), a function that
  places a rollout batch and, when ``config.loss.beta > 0``, the function
  that fills in its reference log-probabilities (else None)."""
  params = policy.params
  tx = policy_state.make_optimizer(config.optimizer, params)
  with_reference = config.loss.beta > 0
  if mesh is None:
    # Every input committed to the one device, like restored state and the
    # step's outputs: the first step compiles the program all others run.
    state_sharding = jax.sharding.SingleDeviceSharding(
        jax.tree.leaves(params)[0].sharding.device_set.pop()
    )
    params = jax.device_put(params, state_sharding)
    place_batch = lambda batch: jax.device_put(batch, state_sharding)
    train_step = learner_lib.make_train_step(policy.graphdef, tx, config)
    fill_reference = (
        reference_lib.make_reference_logprobs(
            policy.graphdef, config.rollout.temperature
        )
        if with_reference
        else None
    )
    return _Learner(
        params,
        tx,
        state_sharding,
        state_sharding,
        place_batch,
        train_step,
        fill_reference,
        state_sharding,
    )
  params_sharding = parallel.param_shardings(params, mesh)
  weights = policy_state.abstract_weights(config.optimizer, tx, params)
  weights_sharding = parallel.weight_shardings(weights, params_sharding, mesh)
  # The state follows what the optimizer moves: the params or the adapters.
  state_sharding = parallel.optimizer_state_shardings(
      tx,
      policy_state.optimized(weights, params),
      policy_state.optimized(weights_sharding, params_sharding),
      mesh,
  )
  row = lambda ndim: parallel.batch_sharding(mesh, ndim)
  rollout_sharding = algo.RolloutBatch(
      prompt_tokens_BxP=row(2),
      prompt_mask_BxP=row(2),
      completion_tokens_BxT=row(2),
      completion_mask_BxT=row(2),
      old_logp_BxT=row(2),
      advantages_B=row(1),
      num_generations=config.rollout.num_generations,
  )
  place_batch = lambda batch: jax.device_put(batch, rollout_sharding)
  batch_sharding = (
      rollout_sharding.replace(ref_logp_BxT=row(2))
      if with_reference
      else rollout_sharding
  )
  train_step = learner_lib.make_train_step(
      policy.graphdef,
      tx,
      config,
      shardings=(weights_sharding, state_sharding, batch_sharding),
      activation_rules=parallel.PARTITION_RULES,
  )
  fill_reference = (
      reference_lib.make_reference_logprobs(
          policy.graphdef,
          config.rollout.temperature,
          shardings=(params_sharding, rollout_sharding),
          activation_rules=parallel.PARTITION_RULES,
      )
      if with_reference
      else None
  )
  return _Learner(
      params,
      tx,
      state_sharding,
      weights_sharding,
      place_batch,
      train_step,
      fill_reference,
      params_sharding,
  )


def _start_engine(
    config: TrainConfig,
    policy: engine_lib.Policy,
    folder: pathlib.Path,
    out: pathlib.Path,
    params: Any,
    opt_state: Any,
    params_sharding: Any,
    closing: contextlib.ExitStack,
) -> tuple[sync.PolicySender, engine_lib.Engine]:
  """The learner's sync sender and the rollout engine of
  ``config.rollout.engine`` (closed by ``closing``), synced to the learner's
  weights by a full message."""
  sync_fields = engine_lib.sync_fields(config, folder)
  sender = sync.PolicySender(params, opt_state, seed=config.seed, **sync_fields)
  if config.rollout.engine == "process":
    engine = transport.ProcessEngine(
        policy, config, folder, log_path=out / "rollout_engine.log"
    )
  else:
    engine = engine_lib.RolloutEngine(
        policy,
        policy_state.synced_state(params, opt_state),
        seed=config.seed,
        shardings=params_sharding,
        dtype=engine_lib.sampling_dtype(config.rollout.dtype),
        **sync_fields,
    )
  closing.callback(engine.close)
  if engine.signature != sender.signature:
    raise ValueError(
        "the rollout engine was built for another policy than the learner's "
        "(model, shapes, dtypes, seed or optimizer settings differ)"
    )
  engine.sync(sender.message(params, opt_state, full=True))
  return sender, engine


def _update(
    train_step: Callable,
    params: Any,
    opt_state: Any,
    batch: algo.RolloutBatch,
    num_iterations: int,
):
  """``num_iterations`` learner updates on one rollout batch: the new
  ``(params, opt_state)``, the last update's metrics, the non-finite guard's
  state and the quantities it skipped an update for."""
  skipped = set()
  for _ in range(num_iterations):
    params, opt_state, metrics = train_step(params, opt_state, batch)
    guard = non_finite.non_finite_state(opt_state)
    skipped.update(non_finite.non_finite_reasons(guard.reason))
  return params, opt_state, metrics, guard, skipped


# The realized KL's metrics (kl/realized, kl/realized_k3), recorded on the
# steps that measure it (logging.realized_kl_every).
REALIZED = "kl/realized"

_NO_SYNC_YET = engine_lib.SyncStats(
    message_bytes=0,
    seconds=0.0,
    resynced=False,
    full_bfloat16_bytes=0,
    sparse_delta_bytes=0,
)


def _sync_metrics(
    stats: engine_lib.SyncStats, resyncs: int
) -> dict[str, float]:
  """A step's sync figures: bytes of the message, of a full bfloat16
  broadcast and of a sparse delta of the changed bfloat16 values, seconds,
  and the resyncs so far."""
  return {
      "sync/bytes": float(stats.message_bytes),
      "sync/full_bf16_bytes": float(stats.full_bfloat16_bytes),
      "sync/sparse_delta_bytes": float(stats.sparse_delta_bytes),
      "time/sync_s": stats.seconds,
      "sync/resyncs": float(resyncs),
  }


def _check_finite(
    step: int,
    skipped: set[str],
    guard: non_finite.SkipNonFiniteState,
    limit: int,
    latest: Optional[int],
    log: Log,
) -> None:
  """Logs a skipped step (the optimizer's guard sees the loss too, so a
  non-finite loss is always skipped); raises after ``limit`` in a row."""
  if skipped:
    run = int(guard.consecutive_skips)
    what = ", ".join(sorted(skipped))
    log(
        f"step {step}: skipped, non-finite {what} ({run} in a row, "
        f"{int(guard.skipped_steps)} in all)"
    )
    if run >= limit:
      raise FloatingPointError(
          f"step {step}: {run} consecutive steps skipped for non-finite "
          f"{what} (max_consecutive_skips={limit}); the weights are those "
          f"after step {step - run}; latest checkpoint: step {latest}"
      )


def _train(
    config: TrainConfig,
    out: pathlib.Path,
    checkpointer: checkpoint.Checkpointer,
    task: tasks_lib.Task,
    rewards: list[tuple[Callable, float]],
    progress: bool,
    log: Log,
    mesh: parallel.MeshConfig | None,
    device_mesh: jax.sharding.Mesh | None,
    resume: bool,
    allow_reshard: bool,
    start_time: float,
    closing: contextlib.ExitStack,
) -> dict[str, Any]:
  """:func:`train` with its inputs checked and its folder locked; what it
  opens (the rollout engine) is closed by ``closing``."""
  compilations = closing.enter_context(tracking.Compilations())
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
  train_examples, eval_examples = task.split(
      config.task.eval_size, seed=config.task.seed
  )
  folder = policy_folder(config, train_examples, log)
  policy = engine_lib.Policy.load(
      folder,
      dtype=jnp.dtype(config.policy.dtype),
      mesh=device_mesh,
      chat_template=config.task.chat_template,
      system_prompt=config.task.system_prompt,
      attention=config.policy.attention,
      remat=config.policy.remat,
  )
  _, notice = models.attention_implementation(
      config.policy.attention, config.policy.dtype, setting="policy.attention"
  )
  if notice:
    log(notice)
  reward_warnings = rewards_lib.RewardFailureWarnings(log)
  max_new = config.rollout.max_new_tokens

  meta = checkpoint.run_meta(
      config,
      json.loads((folder / "config.json").read_text()),
      policy.tokenizer,
      mesh,
  )
  if resume:  # fail before compiling anything; restoring checks it again
    try:
      saved = checkpointer.read_meta()
    except checkpoint.CorruptCheckpointError:
      saved = None  # restore_latest falls back to an older checkpoint
    if saved is not None:
      checkpoint.check_resumable(saved, meta, allow_reshard)
  learner = _learner_step(config, policy, device_mesh)
  params, tx, fill_reference = (
      learner.params,
      learner.tx,
      learner.fill_reference,
  )
  # The frozen reference policy (loss.beta > 0): the initial weights, in
  # policy.reference_dtype, laid out like the params.
  ref_params = (
      None
      if fill_reference is None
      else reference_lib.reference_params(
          params, jnp.dtype(config.policy.reference_dtype)
      )
  )
  num_params = int(sum(x.size for x in jax.tree.leaves(params)))
  dense_adam_bytes = policy_state.dense_adam_state_bytes(params)
  if resume:
    restored = checkpointer.restore_latest(
        params=checkpoint.abstract_state(
            policy_state.abstract_weights(config.optimizer, tx, params),
            learner.weights_sharding,
        ),
        opt_state=checkpoint.abstract_state(
            policy_state.abstract_opt_state(config.optimizer, tx, params),
            learner.state_sharding,
        ),
        ref_params=(
            None
            if ref_params is None
            else checkpoint.abstract_state(ref_params)
        ),
        expected_meta=meta,
        allow_reshard=allow_reshard,
        log=log,
    )
    if restored.step > config.steps:
      raise checkpoint.CheckpointError(
          f"cannot resume: the latest checkpoint in {checkpointer.directory} "
          f"is at step {restored.step}, beyond steps={config.steps}"
      )
    params, opt_state, loop = (
        restored.params,
        restored.opt_state,
        restored.loop,
    )
    ref_params = restored.ref_params
    log(
        f"resuming from step {restored.step} "
        f"({checkpointer.directory / str(restored.step)})"
    )
  else:
    weights, opt_state = policy_state.init_train_state(
        config.optimizer, tx, params, seed=config.seed
    )
    opt_state = jax.device_put(opt_state, learner.state_sharding)
    params = jax.device_put(weights, learner.weights_sharding)
    loop = checkpoint.LoopState(
        step=0, key=jax.random.key(config.seed), data_position=0
    )
  # From here on the learner's weights are the policy (a bfloat16 base would
  # otherwise sit next to the float32 weights it was made from), and the
  # rollout engine's copy follows them through sync messages.
  policy.params = None
  sender, engine = _start_engine(
      config,
      policy,
      folder,
      out,
      params,
      opt_state,
      learner.params_sharding,
      closing,
  )
  leader = parallel.is_leader()
  if leader:
    (out / "config.yaml").write_text(to_yaml(config))
  summary: dict[str, Any] = {
      "optimizer": config.optimizer.name,
      "optimizer_state_bytes": logra.optimizer_state_bytes(opt_state),
      # The learner's weights as held: dense, factored (B, A, c) or frozen
      # with adapters.
      "weights_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
      "dense_adam_state_bytes": dense_adam_bytes,
      "num_params": num_params,
      "reference_bytes": sum(x.nbytes for x in jax.tree.leaves(ref_params)),
  }

  def memory_hint(examples):
    seq = max(map(len, policy.encode([e["prompt"] for e in examples])))
    return lambda: memory_command(config, mesh, folder, seq + max_new)

  before = loop.extras.get("eval_before")
  if before is None:
    with _explain_out_of_memory(0, memory_hint(eval_examples)):
      before = engine.evaluate(eval_examples, rewards, max_new)
  summary["eval_accuracy_before"] = before["accuracy"]
  log(
      f"held-out accuracy before RL: {before['accuracy']:.3f} "
      f"({len(eval_examples)} prompts)"
  )

  batches = PromptStream(
      train_examples,
      config.rollout.prompts_per_step,
      seed=config.seed,
      position=loop.data_position,
  )
  key, history, first_step = loop.key, loop.history, loop.step
  wall_before = loop.extras.get("wall_seconds", 0.0)
  staleness = config.rollout.max_staleness
  # Asynchronous rollouts: one worker thread talks to the engine, in order
  # (sample requests, sync messages, evaluations), while this thread trains.
  worker = None
  if staleness:
    worker = concurrent.futures.ThreadPoolExecutor(1, "rollout")
    closing.callback(worker.shutdown)
  # Rollouts requested and not yet trained on: (future, the policy version
  # the engine samples them with, the data position and key before them).
  pending: collections.deque = collections.deque()
  syncs: collections.deque = collections.deque()  # async sync futures
  version = {"engine": first_step, "synced": None}

  def rollout_job(examples, rollout_key):
    seen = []
    batch, metrics = engine.rollout(
        examples, config, rewards, rollout_key, observe=seen.append
    )
    return batch, metrics, seen[0]

  def request() -> None:
    nonlocal key
    position, key_before = batches.position, key
    examples = next(batches)
    key, rollout_key = jax.random.split(key)
    if worker is None:
      job = concurrent.futures.Future()
      job.set_result(rollout_job(examples, rollout_key))
    else:
      job = worker.submit(rollout_job, examples, rollout_key)
    pending.append((job, version["engine"], position, key_before))

  def resume_point() -> tuple[int, jax.Array]:
    """Data position and key before the first batch not yet trained on (a
    resumed run samples the prefetched batches again)."""
    if pending:
      return pending[0][2], pending[0][3]
    return batches.position, key

  def collect_syncs(wait: bool) -> None:
    """Records the asynchronous syncs that finished (all, with ``wait``); a
    refused one is followed by a full message, once every request before
    it is done."""
    refused = False
    while syncs and (wait or syncs[0].done()):
      try:
        version["synced"] = syncs.popleft().result()
      except sync.SyncError:
        refused = True
    if refused:
      for job, *_ in pending:
        job.result()
      for job in syncs:
        job.exception()
      syncs.clear()
      version["synced"] = engine.sync(
          sender.message(params, opt_state, full=True)
      )
      engine.resyncs += 1

  def save(
      step: int, eval_accuracy: Optional[float] = None, wait: bool = False
  ) -> None:
    position, resume_key = resume_point()
    state = checkpoint.LoopState(
        step=step,
        key=resume_key,
        data_position=position,
        history=history,
        extras={
            "eval_before": before,
            "wall_seconds": wall_before + time.perf_counter() - start_time,
        },
    )
    checkpointer.save(
        step,
        params=params,
        opt_state=opt_state,
        loop=state,
        meta=meta,
        ref_params=ref_params,
        eval_accuracy=eval_accuracy,
        wait=wait,
    )

  def evaluate_now() -> dict[str, float]:
    """Held-out accuracy with the engine's latest weights (after every
    request before it)."""
    if worker is None:
      return engine.evaluate(eval_examples, rewards, max_new)
    return worker.submit(
        engine.evaluate, eval_examples, rewards, max_new
    ).result()

  bar = tqdm.tqdm(
      range(first_step, config.steps),
      desc="RL",
      disable=not progress,
      dynamic_ncols=True,
      initial=first_step,
      total=config.steps,
  )
  trackers = tracking.Trackers(
      config.logging.trackers if leader else [],
      out,
      to_dict(config),
      resume=resume,
  )
  sample_log = tracking.SampleLog(
      out / "samples.jsonl" if leader else pathlib.Path(os.devnull),
      first_step if resume else None,
  )
  observed: dict[str, engine_lib.RolloutSamples] = {}

  stop = _StopSignals(log)
  with (
      stop,
      trackers,
      sample_log,
      open(
          out / "metrics.jsonl" if leader else os.devnull, "w"
      ) as metrics_file,
  ):
    for metrics in history:  # the steps before the checkpoint, if resumed
      metrics_file.write(json.dumps(metrics) + "\n")
    for step in bar:
      done = step + 1
      step_start = time.perf_counter()
      with _explain_out_of_memory(done, memory_hint(eval_examples)):
        # The engine samples up to ``staleness`` batches ahead, each with
        # the newest weights synced before its request.
        while len(pending) <= staleness:
          request()
        job, sampled_version, *_ = pending.popleft()
        batch, metrics, samples = job.result()
        reward_warnings(samples.report)
        observed["latest"] = samples
        metrics["rollout/version_lag"] = float(step - sampled_version)
        batch = learner.place_batch(batch)
        if fill_reference is not None:
          batch = fill_reference(ref_params, batch)
        rollout_seconds = time.perf_counter() - step_start
        params, opt_state, step_metrics, guard, skipped = _update(
            learner.train_step, params, opt_state, batch, config.num_iterations
        )
        full = bool(
            config.sync.resync_every and done % config.sync.resync_every == 0
        )
        message = sender.message(params, opt_state, full=full)
        if worker is None:
          synced = engine.sync(
              message,
              resync=lambda: sender.message(params, opt_state, full=True),
          )
        else:
          # On the host now: the next step donates the arrays it was made of.
          message = dataclasses.replace(
              message,
              arrays={n: np.asarray(x) for n, x in message.arrays.items()},
          )
          syncs.append(worker.submit(engine.sync, message))
          collect_syncs(wait=False)
          # The figures of the latest sync that finished (none at first).
          synced = version["synced"] or _NO_SYNC_YET
        version["engine"] = done
      metrics.update(
          {
              k: float(v)
              for k, v in step_metrics.items()
              if not (k.startswith(REALIZED) and np.isnan(v))
          }
      )
      metrics.update(compilations.metrics())
      metrics["step"] = done
      metrics["skipped"] = float(bool(skipped))
      metrics["skipped/total"] = float(guard.skipped_steps)
      metrics.update(_sync_metrics(synced, engine.resyncs))
      metrics["time/rollout_s"] = rollout_seconds
      metrics["time/step_s"] = time.perf_counter() - step_start
      metrics["time/train_s"] = (
          metrics["time/step_s"]
          - rollout_seconds
          - (synced.seconds if worker is None else 0.0)
      )
      evaluated = bool(
          config.eval_every
          and done % config.eval_every == 0
          and done < config.steps
      )
      if evaluated:
        metrics["accuracy/eval"] = evaluate_now()["accuracy"]
      history.append(metrics)
      metrics_file.write(json.dumps(metrics) + "\n")
      metrics_file.flush()
      trackers.log(metrics, done)
      if tracking.samples_due(done, config.logging.samples_every):
        rows = tracking.sample_rows(
            observed["latest"],
            config.rollout.num_generations,
            config.logging.samples_shown,
        )
        sample_log.write(done, rows)
        log(tracking.sample_table(rows, done))
      _check_finite(
          done,
          skipped,
          guard,
          config.max_consecutive_skips,
          checkpointer.latest_step(),
          log,
      )
      if stop.received:
        save(done, wait=True)
        log(
            f"stopped by {stop.received} after step {done}; checkpoint "
            f"{checkpointer.directory / str(done)}"
        )
        break
      if done < config.steps and checkpointer.due(done, evaluated):
        save(done, metrics.get("accuracy/eval"))
      postfix = {
          "reward": f"{metrics['reward/total']:.3f}",
          "acc": f"{metrics['accuracy/train']:.2f}",
      }
      if REALIZED in metrics:
        postfix["kl"] = f"{metrics[REALIZED]:.1e}"
      if "kl/predicted" in metrics:
        postfix["kl_pred"] = f"{metrics['kl/predicted']:.1e}"
      bar.set_postfix(postfix)
    collect_syncs(wait=True)
    after = evaluate_now()
    if checkpointer.latest_step() != len(history):
      save(len(history), after["accuracy"], wait=True)
  summary.update(
      {
          "eval_accuracy_after": after["accuracy"],
          "eval_score_before": before["score"],
          "eval_score_after": after["score"],
          "steps": len(history),
          "interrupted": len(history) < config.steps,
          "stopped_by": stop.received,
          "resumed_from_step": first_step if resume else None,
          "skipped_steps": int(sum(h.get("skipped", 0.0) for h in history)),
          "checkpoint_steps": checkpointer.all_steps(),
          "wall_seconds": wall_before + time.perf_counter() - start_time,
          "policy_folder": str(folder),
      }
  )
  if history and leader:
    final = dict(history[-1], **{"accuracy/eval": after["accuracy"]})
    plot_curves(history[:-1] + [final], out / "curves.png", before["accuracy"])
  if leader:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
  log(
      f"held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
      f"in {len(history)} steps, {summary['wall_seconds']:.0f}s; optimizer "
      f"state {summary['optimizer_state_bytes'] / 2**20:.2f} MiB "
      f"({config.optimizer.name}) vs dense Adam "
      f"{summary['dense_adam_state_bytes'] / 2**20:.2f} MiB"
  )
  return summary


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
  config resumes from its checkpoint; checkpoints, summary, samples and
  tracker files of another config (or all of them, with ``rerun``) are
  deleted first. For studies that resume."""
  out = pathlib.Path(out_dir)
  same = (out / "config.yaml").exists() and _saved_config(out) == config
  if same and not rerun and (out / "summary.json").exists():
    return json.loads((out / "summary.json").read_text())
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


def plot_curves(
    history: list[dict[str, float]], path: pathlib.Path, accuracy_before: float
) -> None:
  """Reward/accuracy, realized KL and step time against the step."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = [h["step"] for h in history]
  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  axes[0].plot(steps, [h["reward/total"] for h in history], label="reward")
  axes[0].plot(
      steps,
      [h["accuracy/train"] for h in history],
      label="train accuracy",
      alpha=0.7,
  )
  evals = [(0, accuracy_before)] + [
      (h["step"], h["accuracy/eval"]) for h in history if "accuracy/eval" in h
  ]
  axes[0].plot(*zip(*evals), "o-", label="held-out accuracy")
  axes[0].set_title("reward and accuracy")
  axes[0].legend()
  realized = [
      (h["step"], h["kl/realized_k3"]) for h in history if REALIZED in h
  ]
  if realized:
    axes[1].plot(*zip(*realized), "o-", label="realized (k3)")
  if "kl/predicted" in history[0]:
    axes[1].plot(
        steps,
        [h["kl/predicted"] for h in history],
        label="predicted",
        alpha=0.7,
    )
    axes[1].legend()
  axes[1].set_yscale("log")
  axes[1].set_title("KL per step")
  axes[2].plot(steps, [h["time/step_s"] for h in history])
  axes[2].set_title("step time (s)")
  for ax in axes:
    ax.set_xlabel("step")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
