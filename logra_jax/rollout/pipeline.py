"""The rollout pipeline: the prompt stream, rollout requests to the engine
(up to ``rollout.max_staleness`` ahead of the learner), the policy version
each was sampled with, the sync messages that keep the engine's weights in
step, and the point a resumed run samples again from.

What a request computes is the caller's (``rollout_fn``: the RL side samples
with the engine and scores); the pipeline only orders requests and syncs.

A process engine that froze or died (:class:`~transport.TransportError`) is
restarted up to ``rollout.engine_restarts`` times: the new engine is sent
the learner's latest weights in full and samples the lost requests again,
with their prompts and keys.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import pathlib
import queue
import threading
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import jax
import numpy as np

from logra_jax import policy_state
from logra_jax import sync
from logra_jax.configs import TrainConfig
from logra_jax.data import tasks as tasks_lib
from logra_jax.rollout import engine as engine_lib
from logra_jax.rollout import transport

# rollout_fn(examples, key) -> what a rollout of one prompt batch gives.
RolloutFn = Callable[[list[dict], jax.Array], Any]


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


def start_engine(
    config: TrainConfig,
    policy: engine_lib.Policy,
    folder: pathlib.Path,
    out: pathlib.Path,
    state: tuple[Any, Any],
    params_sharding: Any,
    closing: contextlib.ExitStack,
) -> tuple[Optional[sync.PolicySender], engine_lib.Engine]:
  """The rollout engine of ``config.rollout`` (closed by ``closing``) and,
  for an engine with its own copy of the policy, the learner's sync sender.

  ``rollout.engine=colocated`` with ``rollout.max_staleness=0``: a
  :class:`~engine_lib.SharedEngine` following the learner's ``state`` (its
  weights and optimizer state), no sender. Otherwise the engine is synced
  to ``state`` by a full message: the process engine, or a colocated
  :class:`~engine_lib.RolloutEngine` (sampling while the learner trains)
  whose sampling weights take ``params_sharding``."""
  weights, opt_state = state
  if config.rollout.engine == "colocated" and not config.rollout.max_staleness:
    engine = engine_lib.SharedEngine(policy)
    engine.follow(state)
    return None, engine
  sync_fields = engine_lib.sync_fields(config, folder)
  sender = sync.PolicySender(
      weights, opt_state, seed=config.seed, **sync_fields
  )
  if config.rollout.engine == "process":
    engine = transport.ProcessEngine(
        policy,
        config,
        folder,
        log_path=out / "rollout_engine.log",
        timeout=config.rollout.engine_timeout_s,
    )
  else:
    engine = engine_lib.RolloutEngine(
        policy,
        policy_state.synced_state(weights, opt_state),
        seed=config.seed,
        shardings=params_sharding,
        dtype=engine_lib.sampling_dtype(config.rollout.dtype),
        projectors=policy_state.projector_source(opt_state),
        merge_ahead_every=engine_lib.merge_ahead_every(config),
        **sync_fields,
    )
  closing.callback(engine.close)
  if engine.signature != sender.signature:
    raise ValueError(
        "the rollout engine was built for another policy than the learner's "
        "(model, shapes, dtypes, seed or optimizer settings differ)"
    )
  engine.sync(sender.message(weights, opt_state, full=True))
  return sender, engine


NO_SYNC_YET = engine_lib.SyncStats(
    message_bytes=0,
    seconds=0.0,
    resynced=False,
    full_bfloat16_bytes=0,
    sparse_delta_bytes=0,
)


def sync_metrics(stats: engine_lib.SyncStats, resyncs: int) -> dict[str, float]:
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


class _Request(NamedTuple):
  """A rollout requested and not yet trained on: its job, the policy
  version the engine samples it with, the data position and key before it,
  and its prompts and key (to sample it again on a restarted engine)."""

  job: concurrent.futures.Future
  version: int
  position: int
  key: jax.Array
  examples: list[dict]
  rollout_key: jax.Array


class _Worker:
  """One daemon thread running jobs in order (a process that ends, e.g.
  stopped by a signal, never waits for a job stuck on a frozen engine or a
  hung reward, as it would for a ``ThreadPoolExecutor``'s thread)."""

  def __init__(self):
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=self._run, name="rollout", daemon=True).start()

  def _run(self) -> None:
    while (item := self._jobs.get()) is not None:
      future, fn, args = item
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 (the caller's to raise)
          future.set_exception(e)

  def submit(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    self._jobs.put((future, fn, args))
    return future

  def shutdown(self) -> None:
    """Ends the thread after the jobs submitted so far (without waiting)."""
    self._jobs.put(None)


def _run_now(fn: Callable, *args: Any) -> concurrent.futures.Future:
  """``fn(*args)`` run on this thread, as a done future (its exception
  kept for :meth:`~concurrent.futures.Future.result`)."""
  future = concurrent.futures.Future()
  try:
    future.set_result(fn(*args))
  except Exception as e:  # noqa: BLE001 (raised by result())
    future.set_exception(e)
  return future


class RolloutPipeline:
  """Rollout requests to the engine and the sync messages that follow the
  learner, in order.

  With ``rollout.max_staleness = 0`` every request and message is served
  at once, on this thread. Otherwise (asynchronous rollouts) one worker
  thread talks to the engine, in order (rollout requests, sync messages,
  evaluations), while the caller trains: the engine samples up to
  ``max_staleness`` batches ahead, each with the newest weights synced
  before its request.

  Args:
    engine: the rollout engine, synced to (or following) the learner's
      initial weights.
    sender: the learner's sync sender (None for a
      :class:`~engine_lib.SharedEngine`).
    config: the run's config (``rollout.max_staleness``,
      ``sync.resync_every``).
    prompts: the run's prompt stream, at the run's data position.
    key: the run's PRNG key at that position.
    version: the policy version the engine holds (the step it follows).
    rollout_fn: ``rollout_fn(examples, key)``, a rollout of one prompt
      batch with the engine (run in order with the syncs).
    evaluate_fn: ``evaluate_fn()``, an evaluation with the engine.
    log: where a restart of the engine is told.

  Attributes:
    engine: the rollout engine.
  """

  def __init__(
      self,
      engine: engine_lib.Engine,
      sender: Optional[sync.PolicySender],
      config: TrainConfig,
      prompts: PromptStream,
      key: jax.Array,
      version: int,
      rollout_fn: RolloutFn,
      evaluate_fn: Callable[[], dict[str, float]],
      log: Callable[[str], None] = print,
  ):
    self.engine = engine
    self._sender = sender
    self._resync_every = config.sync.resync_every
    self._prompts = prompts
    self._key = key
    self._rollout_fn = rollout_fn
    self._evaluate_fn = evaluate_fn
    self._staleness = config.rollout.max_staleness
    self._worker = _Worker() if self._staleness else None
    self._restarts = config.rollout.engine_restarts
    self._log = log
    # The learner's state last sent (a restarted engine's weights) and an
    # engine lost during a sync, raised at the next request.
    self._state: Optional[tuple[Any, Any]] = None
    self._lost: Optional[transport.TransportError] = None
    self._stopping = False
    self._pending: collections.deque[_Request] = collections.deque()
    self._syncs: collections.deque[concurrent.futures.Future] = (
        collections.deque()
    )
    self._engine_version = version
    self._synced: Optional[engine_lib.SyncStats] = None

  @property
  def shares_weights(self) -> bool:
    """Whether the engine samples with the learner's own arrays (a
    :class:`~engine_lib.SharedEngine`)."""
    return isinstance(self.engine, engine_lib.SharedEngine)

  def follow(self, state: tuple[Any, Any]) -> None:
    """The learner's ``state`` replaced the one last synced, in place (its
    merge ahead donated those arrays): a shared engine samples with it
    from now on, and a restarted engine starts from it (an engine with its
    own copy merged that copy itself)."""
    if self.shares_weights:
      self.engine.follow(state)
    elif self._state is not None:
      self._state = state

  @property
  def asynchronous(self) -> bool:
    """Whether a worker thread serves the engine (``max_staleness > 0``)."""
    return self._worker is not None

  def close(self) -> None:
    """Ends the worker thread after its jobs (without waiting for them);
    a job still in progress (a run stopped while it waited) is
    interrupted."""
    if self._worker is not None:
      jobs = [r.job for r in self._pending] + list(self._syncs)
      if not all(job.done() for job in jobs):
        self.interrupt()
      self._worker.shutdown()

  def interrupt(self) -> None:
    """Ends the engine's request in progress, from any thread (a process
    engine's; the colocated engine's requests are not interrupted); the run
    is stopping, so the engine is not restarted."""
    self._stopping = True
    interrupt = getattr(self.engine, "interrupt", None)
    if interrupt is not None:
      interrupt()

  def _submit(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
    """``fn(*args)`` in order with the engine's other jobs: on the worker
    thread, or now."""
    if self._worker is None:
      return _run_now(fn, *args)
    return self._worker.submit(fn, *args)

  def _request(self) -> None:
    """Requests the rollout of the next prompt batch."""
    position, key_before = self._prompts.position, self._key
    examples = next(self._prompts)
    self._key, rollout_key = jax.random.split(self._key)
    # Pending before it runs: a stop while it runs resumes before it.
    self._pending.append(
        _Request(
            concurrent.futures.Future(),
            self._engine_version,
            position,
            key_before,
            examples,
            rollout_key,
        )
    )
    job = self._submit(self._rollout_fn, examples, rollout_key)
    self._pending[-1] = self._pending[-1]._replace(job=job)

  def next_rollout(self, step: int) -> tuple[Any, int]:
    """The rollout the learner trains on at ``step`` (0-based) and how many
    policy versions behind it was sampled, requesting the ones ahead of it
    that ``max_staleness`` allows. It stays pending (the resume point)
    until it is done.

    Raises:
      transport.TransportError: the engine froze or died and no restart is
        left (or it failed on the request).
    """
    if self._lost is not None:
      raise self._lost
    while len(self._pending) <= self._staleness:
      self._request()
    while True:
      try:
        rollout = self._pending[0].job.result()
        break
      except transport.TransportError as error:
        self._restart(error)
    return rollout, step - self._pending.popleft().version

  def _restart(self, error: transport.TransportError) -> None:
    """Restarts an engine that froze or died, sends it the latest state in
    full and requests the pending rollouts again; raises ``error`` when no
    restart is left (or the engine cannot restart)."""
    restart = getattr(self.engine, "restart", None)
    if restart is None or not self._restarts or self._state is None:
      raise error
    if self._stopping:
      raise error
    self._restarts -= 1
    self._log(
        f"{error}; restarting it from the learner's weights of step "
        f"{self._engine_version} ({self._restarts} restart(s) left)"
    )
    for job in [r.job for r in self._pending] + list(self._syncs):
      job.exception()  # done soon: the engine is stopped
    self._syncs.clear()
    restart()
    self.engine.sync(self._sender.message(*self._state, full=True))
    for i, request in enumerate(self._pending):
      self._pending[i] = request._replace(
          job=self._submit(
              self._rollout_fn, request.examples, request.rollout_key
          ),
          version=self._engine_version,
      )

  def sync(self, state: tuple[Any, Any], step: int) -> engine_lib.SyncStats:
    """Sends the learner's ``state`` (weights, optimizer state) after
    ``step`` (1-based) to the engine (a full message every
    ``sync.resync_every`` steps); the figures of the latest sync that
    finished."""
    if self.shares_weights:
      self._engine_version = step
      return self.engine.follow(state)
    weights, opt_state = state
    self._state = state
    full = bool(self._resync_every and step % self._resync_every == 0)
    message = self._sender.message(weights, opt_state, full=full)
    if self._worker is None:
      try:
        synced = self.engine.sync(
            message,
            resync=lambda: self._sender.message(weights, opt_state, full=True),
        )
      except transport.TransportError as error:
        synced = self._sync_lost(error, step)
    else:
      # On the host now: the next step donates the arrays it was made of.
      message = dataclasses.replace(
          message,
          arrays={n: np.asarray(x) for n, x in message.arrays.items()},
      )
      self._syncs.append(self._worker.submit(self.engine.sync, message))
      try:
        self.collect_syncs(state, wait=False)
      except transport.TransportError as error:
        self._sync_lost(error, step)
      # The figures of the latest sync that finished (none at first).
      synced = self._synced or NO_SYNC_YET
    self._engine_version = step
    return synced

  def _sync_lost(
      self, error: transport.TransportError, step: int
  ) -> engine_lib.SyncStats:
    """A sync of ``step`` that found the engine frozen or dead: restarted
    with the step's state, or kept to raise at the next request (the step
    itself is done)."""
    self._engine_version = step
    try:
      self._restart(error)
    except transport.TransportError as lost:
      self._lost = lost
    return NO_SYNC_YET

  def collect_syncs(self, state: tuple[Any, Any], wait: bool) -> None:
    """Records the asynchronous syncs that finished (all, with ``wait``); a
    refused one is followed by a full message of the learner's ``state``,
    once every request before it is done."""
    refused = False
    while self._syncs and (wait or self._syncs[0].done()):
      try:
        self._synced = self._syncs.popleft().result()
      except sync.SyncError:
        refused = True
    if refused:
      for request in self._pending:
        request.job.result()
      for job in self._syncs:
        job.exception()
      self._syncs.clear()
      self._synced = self.engine.sync(self._sender.message(*state, full=True))
      self.engine.resyncs += 1

  def evaluate(self) -> dict[str, float]:
    """``evaluate_fn()`` with the engine's latest weights (after every
    request before it)."""
    if self._lost is not None:
      raise self._lost
    while True:
      try:
        return self._submit(self._evaluate_fn).result()
      except transport.TransportError as error:
        self._restart(error)

  def sync_metrics(self, stats: engine_lib.SyncStats) -> dict[str, float]:
    """A step's sync figures (:func:`sync_metrics`) and the resyncs so
    far."""
    return sync_metrics(stats, self.engine.resyncs)

  def resume_point(self) -> tuple[int, jax.Array]:
    """Data position and key before the first batch not yet trained on (a
    resumed run samples the prefetched batches again)."""
    if self._pending:
      return self._pending[0].position, self._pending[0].key
    return self._prompts.position, self._key
