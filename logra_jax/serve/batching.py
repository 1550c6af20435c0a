"""Concurrent requests as one sampler call.

Requests arrive on the server's threads; one batching thread collects them
for a short window (or until ``max_batch`` wait), groups those with the same
sampling settings and samples each group with one call. Every call samples
the server's ``max_new_tokens``; a request keeps its first ``max_tokens``
tokens, cut after its first stop token, which is exactly a sample of that
length (the tokens are drawn left to right). The ids and log-probabilities a
request gets back are the sampler's own, sliced, never re-tokenized.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from logra_jax import parallel
from logra_jax.rollout.engine import SampleFn


@dataclasses.dataclass(frozen=True)
class Settings:
  """Sampling settings shared by the requests of one sampler call.

  Attributes:
    temperature: 0 for greedy.
    top_p: 1 disables.
    top_k: 0 disables.
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0


# sample_batch(prompts, settings) -> (tokens_NxT, logprobs_NxT, lengths_N) on
# the host, T the server's max_new_tokens.
SampleBatch = Callable[
    [list[list[int]], Settings], tuple[np.ndarray, np.ndarray, np.ndarray]
]


@dataclasses.dataclass(frozen=True)
class Completion:
  """What was sampled for one request.

  Attributes:
    token_ids: the sampled ids, the stop token included when it ended the
      completion.
    logprobs: the sampler's log-probability of each of ``token_ids``.
    finish_reason: ``"stop"`` (a stop token) or ``"length"``.
  """

  token_ids: list[int]
  logprobs: list[float]
  finish_reason: str


class QueueFull(RuntimeError):
  """The server holds ``max_queue`` requests already."""


@dataclasses.dataclass(eq=False)
class _Pending:
  prompt: list[int]
  max_tokens: int
  settings: Settings
  stop_ids: frozenset
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  result: Optional[Completion] = None
  error: Optional[str] = None


def completion(
    tokens: Sequence[int],
    logprobs: Sequence[float],
    max_tokens: int,
    stop_ids: frozenset,
) -> Completion:
  """A request's completion from what was sampled for it: the first
  ``max_tokens`` tokens, cut after the first stop token.

  Example:
    >>> completion([5, 2, 7], [-1.0, -0.5, -2.0], 8, frozenset({2}))
    Completion(token_ids=[5, 2], logprobs=[-1.0, -0.5], finish_reason='stop')
  """
  keep = min(len(tokens), max_tokens)
  stops = [i for i in range(keep) if int(tokens[i]) in stop_ids]
  if stops:
    keep = stops[0] + 1
  ids = [int(t) for t in tokens[:keep]]
  reason = "stop" if stops else "length"
  return Completion(ids, [float(x) for x in logprobs[:keep]], reason)


class Batcher:
  """Collects requests and samples them in batches on its own thread.

  Args:
    sample: samples a batch of prompts with one call.
    stop_ids: the sampler's stop tokens (a request may add its own).
    window_s: how long the first request of a batch waits for others.
    max_batch: requests per sampler call at most.
    max_queue: requests waiting or being sampled at most; more are refused
      with :class:`QueueFull`.

  Example:
    >>> def sample(prompts, settings):
    ...   tokens = np.array([[len(p), 1] for p in prompts])
    ...   return tokens, -np.ones(tokens.shape), np.full(len(prompts), 2)
    >>> with Batcher(sample, stop_ids=(1,), window_s=0.0) as batcher:
    ...   batcher.submit([4, 4, 4], max_tokens=2).token_ids
    [3, 1]
  """

  def __init__(
      self,
      sample: SampleBatch,
      *,
      stop_ids: Sequence[int] = (),
      window_s: float = 0.01,
      max_batch: int = 64,
      max_queue: int = 256,
  ):
    if window_s < 0 or max_batch < 1 or max_queue < 1:
      raise ValueError(
          f"window_s={window_s} must be >= 0, max_batch={max_batch} and "
          f"max_queue={max_queue} >= 1"
      )
    self._sample = sample
    self._stop_ids = frozenset(int(i) for i in stop_ids)
    self._window_s, self._max_batch = window_s, max_batch
    self._max_queue = max_queue
    self._queue: collections.deque[_Pending] = collections.deque()
    self._held = 0  # waiting or being sampled
    self._condition = threading.Condition()
    self._closed = False
    self.calls = 0  # sampler calls made
    self._thread = threading.Thread(target=self._loop, daemon=True)
    self._thread.start()

  def submit(
      self,
      prompt: Sequence[int],
      *,
      max_tokens: int,
      settings: Settings = Settings(),
      stop_ids: Sequence[int] = (),
  ) -> Completion:
    """Samples a completion of ``prompt``, batched with concurrent ones;
    blocks until it is done.

    Raises:
      QueueFull: ``max_queue`` requests are held already.
      RuntimeError: the sampler failed (its error in one line) or the
        batcher is closed.
    """
    pending = _Pending(
        list(prompt),
        max_tokens,
        settings,
        self._stop_ids | frozenset(int(i) for i in stop_ids),
    )
    with self._condition:
      if self._closed:
        raise RuntimeError("the server is shutting down")
      if self._held >= self._max_queue:
        raise QueueFull(f"{self._held} requests queued (max {self._max_queue})")
      self._held += 1
      self._queue.append(pending)
      self._condition.notify()
    pending.done.wait()
    if pending.error is not None:
      raise RuntimeError(pending.error)
    return pending.result

  def _next_batch(self) -> list[_Pending]:
    """The requests of the next sampler call (empty once closed)."""
    with self._condition:
      while not self._queue and not self._closed:
        self._condition.wait()
      deadline = time.monotonic() + self._window_s
      while len(self._queue) < self._max_batch and not self._closed:
        left = deadline - time.monotonic()
        if left <= 0:
          break
        self._condition.wait(left)
      batch = []
      while self._queue and len(batch) < self._max_batch:
        batch.append(self._queue.popleft())
      return batch

  def _loop(self) -> None:
    while True:
      batch = self._next_batch()
      if not batch:
        return
      groups = collections.defaultdict(list)
      for pending in batch:
        groups[pending.settings].append(pending)
      for settings, group in groups.items():
        self._run(settings, group)

  def _run(self, settings: Settings, group: list[_Pending]) -> None:
    """One sampler call for ``group``; a failure fails its requests only."""
    try:
      self.calls += 1
      tokens_NxT, logprobs_NxT, lengths_N = self._sample(
          [p.prompt for p in group], settings
      )
      for i, pending in enumerate(group):
        n = int(lengths_N[i])
        pending.result = completion(
            tokens_NxT[i, :n],
            logprobs_NxT[i, :n],
            pending.max_tokens,
            pending.stop_ids,
        )
    except Exception as e:  # noqa: BLE001 -- reported to the requests.
      for pending in group:
        pending.error = f"sampling failed: {type(e).__name__}: {e}"
    with self._condition:
      self._held -= len(group)
    for pending in group:
      pending.done.set()

  def close(self) -> None:
    """Stops the batching thread once the requests it holds are sampled."""
    with self._condition:
      self._closed = True
      self._condition.notify_all()
    self._thread.join()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()


def engine_sampler(
    sample: SampleFn, max_new_tokens: int, key: jax.Array
) -> SampleBatch:
  """A :data:`SampleBatch` from an engine's ``sample`` (e.g.
  ``policy.sampler.sample`` with its weights bound): call ``i`` draws with
  ``fold_in(key, i)`` and ``max_new_tokens`` tokens.

  Example:
    >>> import types
    >>> def sample(prompts, key, **settings):
    ...   shape = (len(prompts), settings["max_new_tokens"])
    ...   return types.SimpleNamespace(tokens=np.ones(shape, int),
    ...       logprobs=np.zeros(shape), lengths=np.full(shape[0], shape[1]))
    >>> batch = engine_sampler(sample, 3, jax.random.key(0))
    >>> batch([[1, 2]], Settings())[0].tolist()
    [[1, 1, 1]]
  """
  calls = itertools.count()

  def sample_batch(prompts, settings):
    out = sample(
        prompts,
        jax.random.fold_in(key, next(calls)),
        max_new_tokens=max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
    )
    return tuple(
        np.asarray(parallel.host_value(x))
        for x in (out.tokens, out.logprobs, out.lengths)
    )

  return sample_batch
