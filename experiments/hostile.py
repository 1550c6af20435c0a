"""The hostile list of the reliability review, re-run as a new user would.

Each case is a command line (``logra train | export | memory``, a study
script) or a short Python snippet, run in a subprocess with a timeout in a
temporary folder, and classified by what a user sees:

- ``clear error``: one line naming the problem, exit status 2, no traceback,
  nothing created (``--out`` absent, or the folder given left as it was);
- ``recovered``: a bounded wait with a message (a frozen or dead engine
  restarted, a slow reward stopped at its deadline with a warning, a failed
  save ended in one line), a damaged checkpoint set aside and the run
  resumed, a signal ending the run with its status;
- ``refused write``: a write that would delete or change what it does not
  own refused, the owner's files intact;
- ``still open``: anything else (a traceback, a hang past the timeout, a
  wrong exit status, silent acceptance), with the reason.

The cases follow the numbered classes of the review (1: deleting other
runs' files, 2: hangs and unbounded memory, 3: values finite in float64
but not in float32, 4: raw tracebacks, 5: refused late, 6: accepted
silently, 7: shared mutable inputs, 8: errors that do not name the field
or file). Writes ``cases.csv`` (case, class, outcome, exit code, seconds,
first line of the error, note) and ``summary.json`` (counts per outcome,
commit, date, machine, command) to ``experiments/results/hostile/``
(``--results``), and prints the counts. ``--quick`` runs a handful of fast
cases (the test suite's check of the script). Some cases need ``chattr``
(immutable folders, which stop even root); without it they are skipped and
listed as such.

Run: nice -n 5 python experiments/hostile.py [--quick] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Callable, Optional

import provenance
import study
from logra_jax.checkpoint import folders

RESULTS = study.RESULTS / "hostile"
OUTCOMES = ("clear error", "recovered", "refused write", "still open")
SMOKE = ["train", "--preset=smoke", "--no-progress"]
# A smoke run long enough to be acted on while it runs.
LONG = ["--set=steps=200", "--set=checkpoint.every_steps=1"]


@dataclasses.dataclass
class Done:
  """A finished (or timed-out: ``rc`` None) subprocess."""

  rc: Optional[int]
  out: str
  err: str
  seconds: float


@dataclasses.dataclass
class Result:
  """A case's outcome."""

  outcome: str
  done: Done
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Case:
  """One hostile case: its name, the review's class and how it runs."""

  name: str
  kind: int
  run: Callable[["Lab"], Result]
  quick: bool = False


CASES: list[Case] = []


def case(kind: int, quick: bool = False):
  """Registers a case function under its name."""

  def register(fn: Callable[["Lab"], Result]) -> Callable[["Lab"], Result]:
    CASES.append(Case(fn.__name__, kind, fn, quick))
    return fn

  return register


def _text(data) -> str:
  return (
      (data or b"").decode(errors="replace")
      if isinstance(data, bytes)
      else (data or "")
  )


def error_line(err: str) -> str:
  """The line a user reads first of an error: the last line of stderr
  naming an error (else its last line), progress bars left out."""
  lines = [
      line.strip()
      for chunk in err.splitlines()
      for line in chunk.split("\r")[-1:]
      if line.strip()
  ]
  errors = [line for line in lines if "error" in line.lower()]
  return (errors or lines or [""])[-1][:300]


class Lab:
  """A temporary folder, the timeout, and the shared inputs made once (a
  finished smoke run with a checkpoint per step, its exported policy)."""

  def __init__(self, root: pathlib.Path, timeout: float):
    self.root = root
    self.timeout = timeout
    self._made: dict[str, pathlib.Path] = {}
    self._count = 0

    self.chattr = shutil.which("chattr") is not None and _chattr_works(root)

  def folder(self, name: str) -> pathlib.Path:
    """A new empty folder for one case."""
    self._count += 1
    path = self.root / f"{self._count:02d}-{name}"
    path.mkdir()
    return path

  def cli(self, *args: str, cwd=None, timeout=None, env=None) -> Done:
    """``logra <args>`` as a user types it."""
    command = [sys.executable, "-m", "logra_jax.cli", *args]
    return self.command(command, cwd=cwd, timeout=timeout, env=env)

  def python(self, code: str, cwd=None, timeout=None) -> Done:
    return self.command(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, timeout=timeout
    )

  def command(self, command, cwd=None, timeout=None, env=None) -> Done:
    start = time.monotonic()
    try:
      done = subprocess.run(
          command,
          cwd=cwd or self.root,
          capture_output=True,
          text=True,
          timeout=timeout or self.timeout,
          env=env,
      )
    except subprocess.TimeoutExpired as hung:
      return Done(
          None, _text(hung.stdout), _text(hung.stderr), time.monotonic() - start
      )
    return Done(
        done.returncode, done.stdout, done.stderr, time.monotonic() - start
    )

  def base_run(self) -> pathlib.Path:
    """A finished 3-step smoke run keeping a checkpoint of every step."""
    if "base" not in self._made:
      run = self.root / "base-run"
      done = self.cli(
          *SMOKE,
          f"--out={run}",
          "--set=checkpoint.every_steps=1",
          "--set=checkpoint.keep=3",
      )
      if done.rc != 0:
        raise RuntimeError(f"the base smoke run failed: {done.err[-2000:]}")
      self._made["base"] = run
    return self._made["base"]

  def copy_of_base(self, name: str) -> pathlib.Path:
    folder = self.folder(name) / "run"
    shutil.copytree(self.base_run(), folder)
    return folder

  def policy(self) -> pathlib.Path:
    """The base run's policy as a Hugging Face folder."""
    if "policy" not in self._made:
      out = self.root / "base-policy"
      done = self.cli(
          "export", f"--checkpoint={self.base_run()}", f"--out={out}"
      )
      if done.rc != 0:
        raise RuntimeError(f"the export failed: {done.err[-2000:]}")
      self._made["policy"] = out
    return self._made["policy"]


def _chattr_works(root: pathlib.Path) -> bool:
  probe = root / "chattr-probe"
  probe.mkdir()
  ok = subprocess.run(["chattr", "+i", str(probe)]).returncode == 0
  subprocess.run(["chattr", "-i", str(probe)])
  probe.rmdir()
  return ok


def _unfreeze(path: pathlib.Path) -> None:
  subprocess.run(["chattr", "-R", "-i", str(path)], stderr=subprocess.DEVNULL)


def _hygiene(done: Done) -> str:
  """Why the output is not a clean ending ('' if it is)."""
  if done.rc is None:
    return f"no exit within {done.seconds:.0f} s (hang)"
  if "Traceback" in done.err or "Traceback" in done.out:
    return "a traceback is printed"
  if "Event loop is closed" in done.err:
    return "'Event loop is closed' printed"
  return ""


def bad_input(done: Done, needle: str, out: Optional[pathlib.Path]) -> Result:
  """Clear error: exit 2, one error line naming ``needle``, no traceback,
  ``out`` (when given) not created."""
  line = error_line(done.err)
  why = _hygiene(done)
  if not why and done.rc != 2:
    why = f"exit status {done.rc}, not 2"
  if not why and needle.lower() not in line.lower():
    why = f"the error does not name {needle!r}"
  if not why and out is not None and out.exists():
    why = f"{out.name} was created"
  return Result("still open" if why else "clear error", done, why)


def ends(done: Done, outcome: str, rc: int, *needles: str) -> Result:
  """``outcome`` when the run exits ``rc`` cleanly and its output holds
  each of ``needles``."""
  why = _hygiene(done)
  if not why and done.rc != rc:
    why = f"exit status {done.rc}, not {rc}"
  text = done.out + done.err
  for needle in needles:
    if not why and needle not in text:
      why = f"no {needle!r} in the output"
  return Result("still open" if why else outcome, done, why)


def _train_bad(lab: Lab, name: str, needle: str, *args: str) -> Result:
  out = lab.folder(name) / "out"
  return bad_input(lab.cli(*SMOKE, f"--out={out}", *args), needle, out)


def _memory_bad(lab: Lab, needle: str, *args: str) -> Result:
  return bad_input(lab.cli("memory", *args, timeout=60), needle, None)


def _write(folder: pathlib.Path, name: str, text: str) -> pathlib.Path:
  path = folder / name
  path.write_text(textwrap.dedent(text))
  return path


def _reward_file(folder: pathlib.Path, body: str) -> str:
  path = _write(
      folder,
      "hostile_rewards.py",
      "import time\n\n\ndef score(prompts, completions, **columns):\n"
      + textwrap.indent(textwrap.dedent(body), "  "),
  )
  return f"{path}:score"


def _start(lab: Lab, *args: str) -> subprocess.Popen:
  """``logra <args>`` in the background, its output going to files of a
  folder of its own (``proc.logs``), readable while it runs."""
  logs = lab.folder("logs")
  with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
    proc = subprocess.Popen(
        [sys.executable, "-m", "logra_jax.cli", *args],
        cwd=lab.root,
        stdout=out,
        stderr=err,
    )
  proc.logs = logs
  return proc


def _printed(proc: subprocess.Popen, text: str) -> Callable[[], bool]:
  """Whether ``proc`` has printed ``text`` to its stdout."""
  return lambda: text in (proc.logs / "stdout").read_text(errors="replace")


def _wait_for(test: Callable[[], bool], seconds: float) -> bool:
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    if test():
      return True
    time.sleep(0.02)
  return False


def _finish(proc: subprocess.Popen, start: float, timeout: float) -> Done:
  """Waits for ``proc`` (killed after ``timeout``: a hang, ``rc`` None)."""
  try:
    rc = proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    rc = None
  read = lambda name: (proc.logs / name).read_text(errors="replace")
  return Done(rc, read("stdout"), read("stderr"), time.monotonic() - start)


def _children(pid: int) -> list[int]:
  path = pathlib.Path(f"/proc/{pid}/task/{pid}/children")
  return [int(p) for p in path.read_text().split()] if path.exists() else []


def _first_step(run: pathlib.Path) -> Callable[[], bool]:
  """Whether the run has logged its first step (the engine has then been
  synced once, so it can be restarted)."""
  metrics = run / "metrics.jsonl"
  return lambda: metrics.exists() and metrics.stat().st_size > 0


def _checkpoint(run: pathlib.Path, step: int) -> Callable[[], bool]:
  return lambda: (run / "checkpoints" / str(step)).is_dir()


# 1. Deleting other runs' files.


@case(1)
def export_over_a_live_run(lab: Lab) -> Result:
  live = lab.folder("live") / "run"
  proc = _start(lab, *SMOKE, f"--out={live}", *LONG)
  try:
    if not _wait_for(_checkpoint(live, 1), lab.timeout):
      return Result("still open", _finish(proc, time.monotonic(), 1), "no run")
    done = lab.cli(
        "export",
        f"--checkpoint={lab.base_run()}",
        f"--out={live}",
        "--overwrite",
    )
    intact = (live / "metrics.jsonl").exists() and (live / ".lock").exists()
    alive = proc.poll() is None
  finally:
    proc.send_signal(signal.SIGTERM)
    _finish(proc, time.monotonic(), 60)
  result = bad_input(done, "lock", None)
  if result.outcome == "clear error" and intact and alive:
    return Result("refused write", done)
  return Result("still open", done, result.note or "the live run was touched")


def _export_into(lab: Lab, name: str, where: Callable) -> Result:
  run = lab.copy_of_base(name)
  steps = sorted(p.name for p in (run / "checkpoints").iterdir())
  done = lab.cli(
      "export", f"--checkpoint={run}", f"--out={where(run)}", "--overwrite"
  )
  result = bad_input(done, str(run), None)
  kept = sorted(p.name for p in (run / "checkpoints").iterdir()) == steps
  if result.outcome == "clear error" and kept:
    return Result("refused write", done)
  return Result("still open", done, result.note or "checkpoints deleted")


@case(1)
def export_onto_its_own_source(lab: Lab) -> Result:
  return _export_into(lab, "own-source", lambda run: run)


@case(1)
def export_into_its_checkpoints(lab: Lab) -> Result:
  return _export_into(lab, "own-checkpoints", lambda run: run / "checkpoints")


@case(1)
def export_over_a_folder_of_user_files(lab: Lab) -> Result:
  target = lab.folder("user-files")
  _write(target, "notes.txt", "mine\n")
  done = lab.cli(
      "export",
      f"--checkpoint={lab.base_run()}",
      f"--out={target}",
      "--overwrite",
  )
  result = bad_input(done, str(target), None)
  if result.outcome == "clear error" and (target / "notes.txt").exists():
    return Result("refused write", done)
  return Result("still open", done, result.note or "notes.txt deleted")


@case(1)
def second_study_on_one_out(lab: Lab) -> Result:
  folder = lab.folder("studies")
  script = str(study.RESULTS.parent / "recipes.py")
  common = ["--quick", f"--out={folder / 'runs'}"]
  cache = f"--fingerprint-cache={folder / 'fp'}"
  first = subprocess.Popen(
      [sys.executable, script, *common, f"--results={folder / 'r1'}", cache],
      cwd=lab.root,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
  )
  try:
    if not _wait_for(lambda: folders.in_use(folder / "runs"), lab.timeout):
      return Result("still open", Done(None, "", "", 0), "first study silent")
    done = lab.command(
        [sys.executable, script, *common, f"--results={folder / 'r2'}", cache]
    )
    # The first goes on, still holding its folder.
    intact = first.poll() is None and folders.in_use(folder / "runs")
  finally:
    first.send_signal(signal.SIGTERM)
    first.wait(120)
  result = bad_input(done, "in use", folder / "r2")
  if result.outcome == "clear error" and intact:
    return Result("refused write", done)
  return Result("still open", done, result.note or "the first study stopped")


# 2. Hangs and unbounded memory.


def _engine_fault(lab: Lab, name: str, sig: int, restarts: int) -> Done:
  run = lab.folder(name) / "run"
  proc = _start(
      lab,
      *SMOKE,
      f"--out={run}",
      "--set=steps=6",
      "--set=rollout.engine=process",
      "--set=rollout.engine_timeout_s=4",
      f"--set=rollout.engine_restarts={restarts}",
  )
  start = time.monotonic()
  if _wait_for(_first_step(run), lab.timeout):
    for child in _children(proc.pid):
      os.kill(child, sig)
  return _finish(proc, start, lab.timeout)


@case(2)
def frozen_engine_restarted(lab: Lab) -> Result:
  done = _engine_fault(lab, "frozen", signal.SIGSTOP, 1)
  return ends(done, "recovered", 0, "restarting it")


@case(2)
def frozen_engine_without_restarts_stops(lab: Lab) -> Result:
  done = _engine_fault(lab, "frozen-stop", signal.SIGSTOP, 0)
  return ends(done, "recovered", 1, "rollout_engine.log")


@case(2)
def sigterm_while_the_engine_is_frozen(lab: Lab) -> Result:
  run = lab.folder("frozen-term") / "run"
  proc = _start(
      lab,
      *SMOKE,
      f"--out={run}",
      *LONG,
      "--set=rollout.engine=process",
      "--set=rollout.engine_timeout_s=600",
  )
  if _wait_for(_first_step(run), lab.timeout):
    for child in _children(proc.pid):
      os.kill(child, signal.SIGSTOP)
    time.sleep(1)
  start = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  done = _finish(proc, start, lab.timeout)
  for child in _children(proc.pid):
    os.kill(child, signal.SIGKILL)
  result = ends(done, "recovered", 143)
  if result.outcome == "recovered" and done.seconds > 30:
    return Result("still open", done, f"took {done.seconds:.0f} s")
  return result


def _failed_save(lab: Lab, name: str, after_step: int) -> Result:
  """A run whose checkpoints/ (or the save in progress) becomes immutable
  once checkpoint ``after_step`` exists (0: the first save's temporary
  folder, as soon as it appears); then resumed once made writable."""
  if not lab.chattr:
    return Result("skipped", Done(None, "", "", 0), "chattr is not available")
  run = lab.folder(name) / "run"
  checkpoints = run / "checkpoints"
  proc = _start(lab, *SMOKE, f"--out={run}", "--set=steps=8", *LONG[1:])
  start = time.monotonic()
  try:
    if after_step:
      _wait_for(_checkpoint(run, after_step), lab.timeout)
      target = checkpoints
    else:
      tmp = lambda: list(checkpoints.glob("*.orbax-checkpoint-tmp*"))
      _wait_for(lambda: bool(tmp()), lab.timeout)
      target = (tmp() or [checkpoints])[0]
    subprocess.run(["chattr", "+i", str(target)], check=True)
    done = _finish(proc, start, lab.timeout)
  finally:
    _unfreeze(run)
  result = ends(done, "recovered", 1, "error: saving a checkpoint in")
  if result.outcome != "recovered" or len(done.err.strip().splitlines()) != 1:
    return Result("still open", done, result.note or "more than one line")
  if after_step:
    resumed = lab.cli(
        *SMOKE, f"--out={run}", "--set=steps=8", *LONG[1:], "--resume"
    )
    if resumed.rc != 0 or _hygiene(resumed):
      return Result("still open", resumed, "the resume failed")
  return result


@case(2)
def save_fails_mid_write(lab: Lab) -> Result:
  return _failed_save(lab, "save-mid-write", 0)


@case(2)
def save_fails_then_resume(lab: Lab) -> Result:
  return _failed_save(lab, "save-then-resume", 2)


@case(2)
def reward_import_blocks(lab: Lab) -> Result:
  folder = lab.folder("import-blocks")
  path = _write(
      folder,
      "blocking.py",
      "import time\ntime.sleep(3600)\n\n\ndef score(completions, **c):\n"
      "  return [0.0] * len(completions)\n",
  )
  done = lab.cli(
      *SMOKE,
      f"--out={folder / 'out'}",
      f"--set=rewards=[{{function: '{path}:score'}}]",
      timeout=120,
  )
  return bad_input(done, "importing within", folder / "out")


@case(2)
def reward_slower_than_its_batch_deadline(lab: Lab) -> Result:
  folder = lab.folder("slow-reward")
  spec = _reward_file(
      folder, "time.sleep(0.5)\nreturn [0.0] * len(completions)\n"
  )
  done = lab.cli(
      *SMOKE,
      f"--out={folder / 'out'}",
      "--set=steps=2",
      f"--set=rewards=[{{function: task}}, "
      f"{{function: '{spec}', batch_timeout_s: 1}}]",
  )
  return ends(
      done, "recovered", 0, "warning: reward score took", "deadline of 1 s"
  )


@case(2)
def sigterm_during_a_slow_reward(lab: Lab) -> Result:
  folder = lab.folder("slow-reward-term")
  spec = _reward_file(
      folder, "time.sleep(3)\nreturn [0.0] * len(completions)\n"
  )
  run = folder / "run"
  proc = _start(
      lab,
      *SMOKE,
      f"--out={run}",
      "--set=steps=3",
      "--set=task.eval_size=2",
      f"--set=rewards=[{{function: '{spec}', weight: 1.0}}]",
  )
  # After the check calls and the first evaluation (3 s per sample each),
  # while step 1 scores its batch.
  _wait_for(_printed(proc, "held-out accuracy before RL"), 2 * lab.timeout)
  time.sleep(2)
  start = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  done = _finish(proc, start, lab.timeout)
  result = ends(done, "recovered", 143)
  if result.outcome == "recovered" and done.seconds > 30:
    return Result("still open", done, f"took {done.seconds:.0f} s")
  return result


@case(2, quick=True)
def yaml_alias_bomb(lab: Lab) -> Result:
  folder = lab.folder("alias-bomb")
  rows = ["a: &a [x, x, x, x, x, x, x, x, x]"]
  for i in range(1, 12):
    rows.append(
        f"{chr(97 + i)}: &{chr(97 + i)} " + str([f"*{chr(96 + i)}"] * 9)
    )
  path = _write(folder, "bomb.yaml", "\n".join(rows).replace("'", "") + "\n")
  return _train_bad(lab, "alias-bomb-run", "alias", f"--config={path}")


@case(2)
def task_size_two_billion(lab: Lab) -> Result:
  return _train_bad(lab, "task-size", "task.size", "--set=task.size=2000000000")


@case(2)
def memory_mesh_of_100000(lab: Lab) -> Result:
  return _memory_bad(lab, "mesh", "--mesh=fsdp=100000")


@case(2)
def memory_seq_and_batch_of_a_billion(lab: Lab) -> Result:
  return _memory_bad(lab, "seq", "--seq=1000000000", "--micro-batch=1000000000")


# 3. Values finite in float64 but infinite in float32.


@case(3)
def reward_of_1e300(lab: Lab) -> Result:
  folder = lab.folder("reward-1e300")
  spec = _reward_file(folder, "return [1e300] * len(completions)\n")
  return _train_bad(
      lab,
      "reward-1e300-run",
      "float32",
      f"--set=rewards=[{{function: '{spec}'}}]",
  )


@case(3)
def weight_of_1e39(lab: Lab) -> Result:
  return _train_bad(
      lab,
      "weight-1e39",
      "weight must be",
      "--set=rewards=[{function: task, weight: 1e39}]",
  )


# 4. Raw tracebacks.


@case(4)
def dead_engine_restarted(lab: Lab) -> Result:
  done = _engine_fault(lab, "dead", signal.SIGKILL, 1)
  return ends(done, "recovered", 0, "restarting it")


@case(4)
def dead_engine_one_step_off_policy(lab: Lab) -> Result:
  run = lab.folder("dead-stale") / "run"
  proc = _start(
      lab,
      *SMOKE,
      f"--out={run}",
      "--set=steps=6",
      "--set=rollout.engine=process",
      "--set=rollout.max_staleness=1",
      "--set=rollout.engine_timeout_s=4",
      "--set=rollout.engine_restarts=0",
  )
  start = time.monotonic()
  if _wait_for(_first_step(run), lab.timeout):
    for child in _children(proc.pid):
      os.kill(child, signal.SIGKILL)
  done = _finish(proc, start, lab.timeout)
  return ends(done, "recovered", 1, "rollout_engine.log")


@case(4)
def template_positional_field(lab: Lab) -> Result:
  return _train_bad(lab, "template-0", "{0}", "--set=task.template={0}")


@case(4)
def template_attribute_field(lab: Lab) -> Result:
  return _train_bad(
      lab, "template-attr", "{prompt.nope}", "--set=task.template={prompt.nope}"
  )


@case(4)
def template_index_field(lab: Lab) -> Result:
  return _train_bad(
      lab, "template-index", "{prompt[99]}", "--set=task.template={prompt[99]}"
  )


@case(4)
def task_option_of_the_wrong_type(lab: Lab) -> Result:
  return _train_bad(
      lab, "option-type", "max_terms", "--set=task.options={max_terms: abc}"
  )


@case(4)
def yaml_of_5000_nested_brackets(lab: Lab) -> Result:
  folder = lab.folder("nested")
  path = _write(folder, "deep.yaml", "steps: " + "[" * 5000 + "]" * 5000 + "\n")
  return _train_bad(lab, "nested-run", "deep.yaml", f"--config={path}")


@case(4)
def yaml_with_a_complex_key(lab: Lab) -> Result:
  folder = lab.folder("complex-key")
  path = _write(folder, "key.yaml", "? [a, b]\n: 1\n")
  return _train_bad(lab, "complex-key-run", "key.yaml", f"--config={path}")


def _model_config(lab: Lab, name: str, text: str) -> pathlib.Path:
  return _write(lab.folder(name), "config.json", text)


@case(4)
def memory_config_that_is_a_list(lab: Lab) -> Result:
  path = _model_config(lab, "config-list", "[1, 2]\n")
  return _memory_bad(lab, "config.json", f"--model={path}")


@case(4)
def memory_config_with_a_string_width(lab: Lab) -> Result:
  config = json.loads((lab.policy() / "config.json").read_text())
  config["hidden_size"] = "wide"
  path = _model_config(lab, "config-string", json.dumps(config))
  return _memory_bad(lab, "hidden_size", f"--model={path}")


@case(4)
def memory_config_with_a_huge_vocabulary(lab: Lab) -> Result:
  config = json.loads((lab.policy() / "config.json").read_text())
  config["vocab_size"] = 10**15
  path = _model_config(lab, "config-vocab", json.dumps(config))
  return _memory_bad(lab, "vocab_size", f"--model={path}")


def _mount_small_disk(folder: pathlib.Path, size: str) -> bool:
  """Mounts a RAM disk of ``size`` on ``folder`` (False where not allowed)."""
  command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs"]
  return subprocess.run([*command, str(folder)]).returncode == 0


@case(4)
def full_disk_during_a_run(lab: Lab) -> Result:
  """The run folder on a 900 KiB disk that fills after two checkpoints:
  one line naming the full disk, exit 1; with the disk grown, the run
  resumes from its last completed checkpoint."""
  disk = lab.folder("full-disk")
  if not _mount_small_disk(disk, "900k"):
    return Result("skipped", Done(None, "", "", 0), "mount is not allowed")
  run = disk / "run"
  args = [*SMOKE, f"--out={run}", "--set=steps=30", "--set=checkpoint.keep=5"]
  try:
    done = lab.cli(*args, "--set=checkpoint.every_steps=2")
    result = ends(done, "recovered", 1, "No space left on device")
    if result.outcome == "recovered" and len(done.err.strip().splitlines()) > 1:
      result = Result("still open", done, "more than one line")
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    resumed = lab.cli(*args, "--resume")
    if result.outcome == "recovered" and (resumed.rc != 0 or _hygiene(resumed)):
      result = Result("still open", resumed, "the resume failed")
  finally:
    subprocess.run(["umount", str(disk)])
  return result


@case(4)
def memory_device_memory_of_inf(lab: Lab) -> Result:
  return _memory_bad(lab, "--device-memory-gib", "--device-memory-gib=inf")


@case(4)
def bad_set_given_to_a_study(lab: Lab) -> Result:
  folder = lab.folder("study-set")
  done = lab.command(
      [
          sys.executable,
          str(study.RESULTS.parent / "recipes.py"),
          "--quick",
          f"--out={folder / 'runs'}",
          f"--results={folder / 'results'}",
          "--set=optimizer.rank=-3",
      ]
  )
  return bad_input(done, "optimizer.rank", folder / "results")


def _damaged_resume(lab: Lab, name: str, damage: Callable) -> Result:
  run = lab.copy_of_base(name)
  # The largest data file holds arrays a restore reads (a small one may be
  # a superseded tree node that nothing reads).
  data = (run / "checkpoints" / "3" / "params").glob("ocdbt.*/d/*")
  damage(max(data, key=lambda path: path.stat().st_size))
  done = lab.cli(
      *SMOKE,
      f"--out={run}",
      "--set=steps=5",
      "--set=checkpoint.every_steps=1",
      "--set=checkpoint.keep=3",
      "--resume",
  )
  return ends(
      done, "recovered", 0, "skipping checkpoint 3", "resuming from step 2"
  )


@case(4)
def resume_past_a_deleted_data_file(lab: Lab) -> Result:
  return _damaged_resume(lab, "resume-rm", lambda path: path.unlink())


@case(4)
def resume_past_a_truncated_data_file(lab: Lab) -> Result:
  return _damaged_resume(
      lab, "resume-trunc", lambda path: os.truncate(path, 10)
  )


def _flip(path: pathlib.Path) -> None:
  data = bytearray(path.read_bytes())
  for i in range(20, min(len(data), 24)):
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))


@case(4)
def resume_past_flipped_bytes(lab: Lab) -> Result:
  return _damaged_resume(lab, "resume-flip", _flip)


# 5. Refused late (after --out was created, or after the warm start).


@case(5)
def policy_folder_with_a_garbage_config(lab: Lab) -> Result:
  folder = lab.folder("garbage-config") / "policy"
  shutil.copytree(lab.policy(), folder)
  (folder / "config.json").write_text("{not json\n")
  return _train_bad(
      lab, "garbage-config-run", "config.json", f"--set=policy.path={folder}"
  )


@case(5)
def rank_larger_than_every_matrix(lab: Lab) -> Result:
  return _train_bad(
      lab, "rank", "optimizer.rank", "--set=optimizer.rank=100000"
  )


@case(5)
def lora_targets_naming_nothing(lab: Lab) -> Result:
  return _train_bad(
      lab,
      "lora-targets",
      "optimizer.lora_targets=['nope']",
      "--set=optimizer.name=lora",
      "--set=optimizer.lora_targets=[nope]",
  )


@case(5)
def unwritable_policy_cache(lab: Lab) -> Result:
  if not lab.chattr:
    return Result("skipped", Done(None, "", "", 0), "chattr is not available")
  cache = lab.folder("cache")
  subprocess.run(["chattr", "+i", str(cache)], check=True)
  try:
    return _train_bad(
        lab, "cache-run", "policy.cache_dir", f"--set=policy.cache_dir={cache}"
    )
  finally:
    _unfreeze(cache)


@case(5)
def prompts_longer_than_the_context(lab: Lab) -> Result:
  return _train_bad(
      lab, "context", "max_new_tokens", "--set=rollout.max_new_tokens=100000"
  )


@case(5)
def too_few_distinct_prompts(lab: Lab) -> Result:
  return _train_bad(
      lab,
      "few-prompts",
      "prompt",
      "--set=task.options={min_terms: 2, max_terms: 2, min_digits: 1, "
      "max_digits: 1}",
      "--set=task.name=chain_sum",
      "--set=task.size=400",
      "--set=rollout.prompts_per_step=400",
  )


@case(5)
def system_prompt_without_a_chat_template(lab: Lab) -> Result:
  return _train_bad(
      lab,
      "system-prompt",
      "chat template",
      "--set=task.system_prompt=Be brief.",
  )


@case(5)
def resume_with_another_preset(lab: Lab) -> Result:
  run = lab.copy_of_base("other-preset")
  steps = sorted(p.name for p in (run / "checkpoints").iterdir())
  done = lab.cli(
      "train", "--preset=tiny", "--no-progress", f"--out={run}", "--resume"
  )
  result = bad_input(done, "resume", None)
  if sorted(p.name for p in (run / "checkpoints").iterdir()) != steps:
    return Result("still open", done, "the checkpoints changed")
  return result


@case(5)
def study_on_bad_input_keeps_no_results_folder(lab: Lab) -> Result:
  folder = lab.folder("study-bad")
  args = [
      sys.executable,
      str(study.RESULTS.parent / "recipes.py"),
      "--quick",
      f"--out={folder / 'runs'}",
      f"--results={folder / 'results'}",
  ]
  done = lab.command([*args, "--set=optimizer.learning_rate=-1"])
  return bad_input(done, "learning_rate", folder / "results")


@case(5)
def kl_control_study_with_a_nan_target(lab: Lab) -> Result:
  folder = lab.folder("kl-nan")
  done = lab.command(
      [
          sys.executable,
          str(study.RESULTS.parent / "kl_control.py"),
          "--quick",
          "--target-kl=nan",
          f"--out={folder / 'runs'}",
          f"--results={folder / 'results'}",
      ]
  )
  return bad_input(done, "--target-kl", folder / "results")


# 6. Accepted silently.


@case(6)
def reward_returning_strings(lab: Lab) -> Result:
  folder = lab.folder("reward-strings")
  spec = _reward_file(folder, "return ['good'] * len(completions)\n")
  return _train_bad(
      lab,
      "reward-strings-run",
      "score",
      f"--set=rewards=[{{function: '{spec}'}}]",
  )


@case(6)
def jsonl_answer_that_is_a_list(lab: Lab) -> Result:
  folder = lab.folder("jsonl-list")
  rows = [
      json.dumps({"question": f"{i}+1=", "answer": [i + 1]}) for i in range(300)
  ]
  path = _write(folder, "data.jsonl", "\n".join(rows) + "\n")
  return _train_bad(
      lab,
      "jsonl-list-run",
      "answer",
      f"--set=task.name={path}",
      "--set=task.prompt_column=question",
  )


@case(6)
def galore_rank_larger_than_every_matrix(lab: Lab) -> Result:
  return _train_bad(
      lab,
      "galore-rank",
      "optimizer.rank",
      "--set=optimizer.name=galore",
      "--set=optimizer.rank=100000",
  )


@case(6)
def memory_negative_device_memory(lab: Lab) -> Result:
  return _memory_bad(lab, "--device-memory-gib", "--device-memory-gib=-5")


@case(6)
def memory_nan_device_memory(lab: Lab) -> Result:
  return _memory_bad(lab, "--device-memory-gib", "--device-memory-gib=nan")


@case(6)
def memory_mesh_with_an_underscore(lab: Lab) -> Result:
  return _memory_bad(lab, "fsdp=1_0", "--mesh=fsdp=1_0")


@case(6)
def allow_reshard_without_resume(lab: Lab) -> Result:
  return _train_bad(lab, "reshard", "--allow-reshard", "--allow-reshard")


@case(6, quick=True)
def optax_api_nan_and_out_of_range(lab: Lab) -> Result:
  done = lab.python("""
      import sys
      import optax
      import logra_jax
      calls = {
          "learning_rate": lambda: logra_jax.logra(float("nan"), rank=4),
          "weight_decay": lambda: logra_jax.logra(
              1e-3, rank=4, weight_decay=float("nan")),
          "b1": lambda: logra_jax.logra(1e-3, rank=4, b1=1.5),
      }
      accepted = []
      for name, call in calls.items():
        try:
          call()
          accepted.append(name)
        except ValueError as error:
          if name not in str(error):
            accepted.append(f"{name} (error does not name it: {error})")
      if accepted:
        print("error: accepted " + ", ".join(accepted), file=sys.stderr)
        sys.exit(1)
      print("error: all three refused naming the parameter", file=sys.stderr)
      sys.exit(2)
      """)
  return bad_input(done, "refused", None)


@case(6)
def interpolation_in_a_set_value(lab: Lab) -> Result:
  return _train_bad(
      lab, "interpolation", "optimizer.rank", "--set=optimizer.rank=${steps}"
  )


# 7. Shared mutable inputs.


@case(7, quick=True)
def reward_rewriting_the_answers(lab: Lab) -> Result:
  done = lab.python("""
      import sys
      from logra_jax.rl import rewards
      def vandal(prompts, completions, entry, **columns):
        entry[0]["answer"] = "changed"
        columns["answer"][0] = "changed"
        return [0.0]
      seen = []
      def reader(prompts, completions, entry, answer, **columns):
        seen.append((entry[0]["answer"], answer[0]))
        return [1.0]
      columns = {"answer": ["4"], "entry": [{"answer": "4"}]}
      for _ in range(2):
        rewards.evaluate_rewards([(vandal, 1.0), (reader, 1.0)], ["2+2="],
                                 ["4"], columns)
      if seen != [("4", "4")] * 2 or columns["entry"][0]["answer"] != "4":
        print(f"error: the answers changed: {seen}, {columns}", file=sys.stderr)
        sys.exit(1)
      """)
  if done.rc == 0 and not _hygiene(done):
    return Result("refused write", done)
  return Result("still open", done, _hygiene(done) or error_line(done.err))


# 8. Errors that do not name the field or file.


@case(8)
def memory_seq_of_zero(lab: Lab) -> Result:
  return _memory_bad(lab, "--seq", "--seq=0")


def _policy_without(lab: Lab, name: str, damage: Callable) -> Result:
  folder = lab.folder(name) / "policy"
  shutil.copytree(lab.policy(), folder)
  damage(folder / "tokenizer.json")
  return _train_bad(
      lab, f"{name}-run", "tokenizer.json", f"--set=policy.path={folder}"
  )


@case(8)
def policy_without_a_tokenizer(lab: Lab) -> Result:
  return _policy_without(lab, "no-tokenizer", lambda path: path.unlink())


@case(8)
def policy_with_a_garbage_tokenizer(lab: Lab) -> Result:
  return _policy_without(
      lab, "garbage-tokenizer", lambda path: path.write_text("{garbage")
  )


@case(8)
def double_sigterm(lab: Lab) -> Result:
  run = lab.folder("double-term") / "run"
  proc = _start(lab, *SMOKE, f"--out={run}", *LONG)
  _wait_for(_first_step(run), lab.timeout)
  start = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  time.sleep(0.3)
  proc.send_signal(signal.SIGTERM)
  done = _finish(proc, start, lab.timeout)
  result = ends(done, "recovered", 143, "SIGTERM again")
  if result.outcome == "recovered" and done.seconds > 10:
    return Result("still open", done, f"took {done.seconds:.0f} s")
  return result


def run_cases(cases: list[Case], timeout: float) -> list[dict]:
  """Runs each case in a folder of its own; one row per case."""
  rows = []
  with tempfile.TemporaryDirectory(prefix="hostile-") as root:
    lab = Lab(pathlib.Path(root), timeout)
    try:
      for one in cases:
        start = time.monotonic()
        try:
          result = one.run(lab)
        except Exception as error:  # noqa: BLE001 -- the script's own failure
          result = Result(
              "still open", Done(None, "", "", 0), f"the case failed: {error}"
          )
        row = {
            "case": one.name,
            "class": one.kind,
            "outcome": result.outcome,
            "exit_code": "" if result.done.rc is None else result.done.rc,
            "seconds": round(time.monotonic() - start, 1),
            "error": error_line(result.done.err),
            "note": result.note,
        }
        print(
            f"{row['class']} {one.name}: {row['outcome']} "
            f"(exit {row['exit_code']}, {row['seconds']} s) {row['note']}",
            flush=True,
        )
        rows.append(row)
    finally:
      _unfreeze(pathlib.Path(root))
  return rows


def summary(rows: list[dict], command: str) -> dict:
  """Counts per outcome and class, with the provenance of the run."""
  counts = collections.Counter(row["outcome"] for row in rows)
  by_class = collections.defaultdict(collections.Counter)
  for row in rows:
    by_class[row["class"]][row["outcome"]] += 1
  return {
      "tried": sum(counts[o] for o in OUTCOMES),
      "counts": {o: counts[o] for o in (*OUTCOMES, "skipped") if counts[o]},
      "by_class": {str(k): dict(v) for k, v in sorted(by_class.items())},
      "still_open": [r["case"] for r in rows if r["outcome"] == "still open"],
      **provenance.collect(command, "not computed"),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few fast cases")
  parser.add_argument(
      "--only", nargs="+", default=[], help="run these cases only"
  )
  parser.add_argument("--timeout", type=float, default=300.0)
  parser.add_argument("--results", type=pathlib.Path)
  args = parser.parse_args()
  names = {c.name for c in CASES}
  unknown = sorted(set(args.only) - names)
  if unknown:
    parser.exit(
        2, f"{parser.prog}: error: no such case: {', '.join(unknown)}\n"
    )
  if not args.timeout > 0:
    parser.exit(2, f"{parser.prog}: error: --timeout must be > 0\n")
  cases = [
      c
      for c in CASES
      if (c.name in args.only if args.only else c.quick or not args.quick)
  ]
  results = args.results or (
      RESULTS.with_name("hostile-quick") if args.quick or args.only else RESULTS
  )
  rows = run_cases(cases, args.timeout)
  record = summary(rows, provenance.this_command())
  results.mkdir(parents=True, exist_ok=True)
  with open(results / "cases.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  (results / "summary.json").write_text(json.dumps(record, indent=1) + "\n")
  print(json.dumps({"tried": record["tried"], **record["counts"]}))


if __name__ == "__main__":
  main()
