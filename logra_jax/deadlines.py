"""Calls into user code (rewards, environments, their imports) given a time
limit: a call that hangs is abandoned, not waited for."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional


def call_bounded(
    function: Callable[[], Any],
    timeout_s: Optional[float],
    name: str = "call",
) -> Any:
  """``function()``, given at most ``timeout_s`` seconds.

  The call runs in a daemon thread (named ``name``) joined with the time
  limit. Python cannot stop a thread: a call past its limit is abandoned,
  its thread left to finish or hang without keeping the process alive, and
  whatever it returns or raises later lands in a cell no one reads.

  Args:
    function: the call, without arguments.
    timeout_s: its time limit; ``None``: called in this thread, unbounded.
    name: the thread's name and the call's in the timeout's message.

  Returns:
    What ``function`` returns.

  Raises:
    TimeoutError: the call still runs after ``timeout_s`` seconds.
    BaseException: what ``function`` raised, within the limit.

  Example:
    >>> call_bounded(lambda: 6 * 7, timeout_s=1.0)
    42
    >>> call_bounded(threading.Event().wait, 0.01, "environment call")
    Traceback (most recent call last):
    ...
    TimeoutError: environment call still runs after 0.01 s
  """
  if timeout_s is None:
    return function()
  cell = {}

  def work():
    try:
      cell["value"] = function()
    except BaseException as error:  # noqa: BLE001 -- re-raised below.
      cell["error"] = error

  worker = threading.Thread(target=work, name=name, daemon=True)
  worker.start()
  worker.join(timeout_s)
  if worker.is_alive():
    raise TimeoutError(f"{name} still runs after {timeout_s:g} s")
  if "error" in cell:
    raise cell["error"]
  return cell["value"]
