"""Event loops that let their pending tasks finish before they close.

Orbax runs each save and restore in an event loop of its own
(``asyncio.new_event_loop()``, then ``run_until_complete``, then
``close()``), and its writes and reads are tensorstore futures awaited under
``asyncio.gather``. When one of them fails (an unwritable folder, a damaged
file), ``gather`` raises at once and the loop is closed while its sibling
operations are still running; each of those, on finishing, calls
``loop.call_soon_threadsafe`` on the closed loop from a tensorstore thread,
which prints a ``RuntimeError: Event loop is closed`` traceback. While a
:class:`~logra_jax.checkpoint.Checkpointer` is open (:func:`hold` /
:func:`release`), new event loops first wait up to :data:`DRAIN_S` seconds
for their pending tasks (then cancel what is left) and close after: the
operations report to a loop that is still open, and the failure itself is
reported once, by the checkpointer.

Only the standard event loop policy is replaced; another one (e.g.
uvloop's) is left as it is.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

# The longest a closing loop waits for its pending tasks (the sibling
# writes or reads of a failed one, each a few files) before it cancels them.
DRAIN_S = 10.0


class _DrainingLoop(asyncio.SelectorEventLoop):
  """A selector event loop whose :meth:`close` first runs its pending
  tasks to the end (at most :data:`DRAIN_S` seconds, then cancelled) and
  collects the outcome of every task it ran."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._tasks: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()

  def create_task(self, coro, **kwargs) -> asyncio.Task:
    task = super().create_task(coro, **kwargs)
    self._tasks.add(task)
    return task

  def close(self) -> None:
    if not self.is_closed() and not self.is_running():
      deadline = self.time() + DRAIN_S
      # A task finishing may start others (a write's siblings): until none
      # is left or the time is up, then wait_for cancels the rest.
      while pending := [task for task in self._tasks if not task.done()]:
        left = deadline - self.time()
        try:
          self.run_until_complete(
              asyncio.wait_for(asyncio.gather(*pending), max(left, 0.0))
          )
        except (Exception, asyncio.CancelledError):
          pass  # a task's own error (collected below), or the time is up
        if left <= 0:
          break
      # Each task's error is the one its owner already got, or a sibling
      # of it: collected here, not reported as "never retrieved" later.
      for task in list(self._tasks):
        if task.done() and not task.cancelled():
          task.exception()
    super().close()


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
  """The default policy, making :class:`_DrainingLoop` loops."""

  _loop_factory = _DrainingLoop


_lock = threading.Lock()
_holders = 0
_replaced: asyncio.AbstractEventLoopPolicy | None = None


def hold() -> None:
  """Makes new event loops drain before they close, until as many
  :func:`release` calls as :func:`hold` calls (a no-op under a policy other
  than the standard one).

  Example:
    >>> hold()
    >>> loop = asyncio.new_event_loop()
    >>> type(loop).__name__
    '_DrainingLoop'
    >>> loop.close()
    >>> release()
  """
  global _holders, _replaced
  with _lock:
    _holders += 1
    policy = asyncio.get_event_loop_policy()
    if _holders == 1 and type(policy) is asyncio.DefaultEventLoopPolicy:
      _replaced = policy
      asyncio.set_event_loop_policy(_DrainingPolicy())


def release() -> None:
  """Undoes one :func:`hold`; the last one puts the replaced policy back."""
  global _holders, _replaced
  with _lock:
    _holders -= 1
    if _holders == 0 and _replaced is not None:
      asyncio.set_event_loop_policy(_replaced)
      _replaced = None
