"""A save that fails while its writes are in flight ends the process in one
line, with no traceback of the operations still running (each in a child
process), and new event loops drain only while a checkpointer is open."""

import asyncio
import errno
import subprocess
import sys
import textwrap

import pytest

from logra_jax.checkpoint import CheckpointSaveError
from logra_jax.checkpoint import Checkpointer
from logra_jax.checkpoint import loops

# Several children: before its loops drained, a child printed "Event loop
# is closed" tracebacks in about 2 of 3 such saves.
CHILDREN = 3


def _immutable(path) -> bool:
  return subprocess.run(["chattr", "+i", str(path)]).returncode == 0


def _mutable(path) -> None:
  subprocess.run(["chattr", "-R", "-i", str(path)], stderr=subprocess.DEVNULL)


@pytest.fixture
def freezable(tmp_path):
  """``tmp_path``, where folders can be made immutable (``chattr +i``,
  which stops even root); made mutable again afterwards."""
  probe = tmp_path / "probe"
  probe.mkdir()
  try:
    if not _immutable(probe):
      pytest.skip("chattr +i is not available here")
  except FileNotFoundError:
    pytest.skip("chattr is not installed")
  _mutable(probe)
  yield tmp_path
  _mutable(tmp_path)


def _save_into_a_folder_frozen_mid_save(folder) -> subprocess.CompletedProcess:
  code = f"""
      import pathlib, subprocess, threading, time
      import jax, jax.numpy as jnp, optax
      from logra_jax.checkpoint import Checkpointer, LoopState, resume
      from logra_jax.rl import guards
      folder = pathlib.Path({str(folder)!r})
      # Many arrays: many writes in flight when the first one fails.
      params = {{f"w{{i}}": jnp.full((256, 256), 1.0 * i) for i in range(40)}}
      state = dict(params=params, opt_state=optax.adam(0.1).init(params),
                   meta={{"format": resume.FORMAT_VERSION}})
      def freeze():  # the save's temporary folder, as soon as it exists
        while not (found := list(folder.glob("*.orbax-checkpoint-tmp*"))):
          time.sleep(0.001)
        subprocess.run(["chattr", "+i", str(found[0])], check=True)
      with guards.StopSignals(print):
        ckpt = Checkpointer(folder)
        threading.Thread(target=freeze, daemon=True).start()
        ckpt.save(1, loop=LoopState(1, jax.random.key(0), 1), **state)
        time.sleep(2)  # the background save fails meanwhile
        ckpt.save(2, loop=LoopState(2, jax.random.key(0), 2), **state)
        ckpt.wait()
      print("NOT REACHED")
      """
  return subprocess.run(
      [sys.executable, "-c", textwrap.dedent(code)],
      capture_output=True,
      text=True,
      timeout=120,
  )


def test_a_save_failing_mid_write_ends_in_one_line(freezable):
  for child in range(CHILDREN):
    folder = freezable / f"run{child}" / "checkpoints"
    done = _save_into_a_folder_frozen_mid_save(folder)
    assert done.returncode == 1, done.stderr
    assert "NOT REACHED" not in done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert "Event loop is closed" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        f"error: saving a checkpoint in {folder} failed: "
    ), done.stderr


def test_loops_drain_only_while_held():
  async def later():
    await asyncio.sleep(0.05)
    return "done"

  loops.hold()
  try:
    loop = asyncio.new_event_loop()
    task = loop.create_task(later())
    loop.close()  # runs the pending task to its end first
    assert task.result() == "done"
  finally:
    loops.release()
  plain = asyncio.new_event_loop()
  assert type(plain) is not type(loop)
  plain.close()


def test_a_failed_save_keeps_what_the_disk_said(tmp_path, monkeypatch):
  """The error of a failed save carries the OS error's number (a caller
  tells a full disk by it) and its message."""

  def full_disk():
    raise ValueError("a write failed") from OSError(
        errno.ENOSPC, "No space left on device"
    )

  checkpointer = Checkpointer(tmp_path / "checkpoints")
  monkeypatch.setattr(checkpointer._manager, "wait_until_finished", full_disk)
  with pytest.raises(CheckpointSaveError) as caught:
    checkpointer.wait()
  assert caught.value.errno == errno.ENOSPC
  assert "No space left on device" in str(caught.value)
  monkeypatch.undo()
  checkpointer.close()
