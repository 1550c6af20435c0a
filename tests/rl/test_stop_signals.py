"""How a run ends: a second signal at once with the signal's status, a
stopping run's stuck wait given up after the grace, a failed checkpoint
save in one line with status 1 (each in a child process)."""

import signal
import subprocess
import sys
import textwrap
import time

# Python, JAX and the package start in a few seconds; what is measured
# after READY is the guard's own time plus the interpreter's exit, with slack
# for a loaded machine (7.6 s was seen against a grace of 1 s beside 3 busy
# processes): far below the 600 s the stuck calls would take.
PROMPT_S = 15.0


def _start(code: str) -> subprocess.Popen:
  proc = subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent(code)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  assert proc.stdout.readline() == "READY\n", proc.communicate()
  return proc


def _finish(proc: subprocess.Popen, start: float) -> tuple[str, str, float]:
  out, err = proc.communicate(timeout=60)
  return out, err, time.monotonic() - start


def test_a_second_signal_exits_at_once_with_the_signals_status():
  proc = _start("""
      import time
      from logra_jax.rl import guards
      with guards.StopSignals(print, grace_s=600) as stop:
        print("READY", flush=True)
        time.sleep(600)
      """)
  start = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  out, err, seconds = _finish(proc, start)
  assert proc.returncode == 128 + signal.SIGTERM == 143, err
  assert seconds < 0.5 + PROMPT_S
  assert "SIGTERM: stopping after the current step" in out
  assert err.strip() == "SIGTERM again: exiting at once, without saving"


def test_a_first_signal_lets_the_step_end_and_gives_up_a_stuck_wait():
  proc = _start("""
      import queue, sys, time
      from logra_jax.rl import guards
      # One write per line: on_stuck runs on the watchdog's thread, and two
      # threads' print calls (text, then newline) may interleave.
      def say(line):
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()
      stuck = lambda: say("STUCK")
      with guards.StopSignals(say, on_stuck=stuck, grace_s=1.0) as stop:
        say("READY")
        while not stop.received:  # a step that ends on its own
          time.sleep(0.01)
        say("STEP DONE")
        try:
          with stop.abandonable():
            queue.Queue().get()  # a rollout that never comes
        except guards.StepAbandoned as error:
          say(f"ABANDONED {error.signum}")
          raise
      """)
  start = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  out, err, seconds = _finish(proc, start)
  assert proc.returncode == 143, err
  assert seconds < 1.0 + PROMPT_S
  lines = out.splitlines()
  assert lines.index("STEP DONE") < lines.index("ABANDONED 15"), out
  assert "STUCK" in lines


def test_a_failed_checkpoint_save_ends_the_process_in_one_line(tmp_path):
  folder = tmp_path / "checkpoints"
  proc = _start(f"""
      import pathlib, shutil
      import jax, jax.numpy as jnp, optax
      from logra_jax.checkpoint import Checkpointer, LoopState, resume
      from logra_jax.rl import guards
      folder = pathlib.Path({str(folder)!r})
      params = {{"w": jnp.arange(3.0)}}
      state = dict(params=params, opt_state=optax.adam(0.1).init(params),
                   meta={{"format": resume.FORMAT_VERSION}})
      with guards.StopSignals(print):
        ckpt = Checkpointer(folder)
        ckpt.save(1, loop=LoopState(1, jax.random.key(0), 1), **state)
        ckpt.wait()
        shutil.rmtree(folder)
        folder.write_text("a file where the folder was")
        print("READY", flush=True)
        ckpt.save(2, loop=LoopState(2, jax.random.key(0), 2), **state)
        ckpt.save(3, loop=LoopState(3, jax.random.key(0), 3), **state)
        ckpt.wait()
      print("NOT REACHED")
      """)
  out, err, _ = _finish(proc, time.monotonic())
  assert proc.returncode == 1, err
  assert "NOT REACHED" not in out and "Traceback" not in err, err
  assert (
      err.strip()
      .splitlines()[-1]
      .startswith(
          f"error: saving a checkpoint in {folder} failed: NotADirectoryError"
      )
  ), err
