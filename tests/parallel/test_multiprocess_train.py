"""`logra train` as a run of several processes (jax.distributed over
localhost, 4 CPU devices each): the same numbers as one process with 8
devices, resume across process counts, and clear errors on bad launches."""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy

from logra_jax.cli import main as cli_main

SMOKE = ["--preset=smoke", "--no-progress", "--mesh=fsdp=8"]


def _port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(args, processes=2, only=None, extra=None, env=None):
  """Starts ``logra ARGS`` as the processes of one run (``only``: just
  those ids), ``extra[i]`` more arguments and ``env`` more variables for
  all; returns the Popen objects."""
  port = _port()
  base = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4")
  # Each process has its own 4 devices; the suite's other XLA flags stay.
  base["XLA_FLAGS"] = re.sub(
      r"--xla_force_host_platform_device_count=\d+", "", base["XLA_FLAGS"]
  )
  base.update(env or {})
  return [
      subprocess.Popen(
          [
              sys.executable,
              "-m",
              "logra_jax.cli",
              *args,
              *(extra or {}).get(i, []),
          ],
          env=dict(
              base,
              LOGRA_COORDINATOR_ADDRESS=f"localhost:{port}",
              LOGRA_NUM_PROCESSES=str(processes),
              LOGRA_PROCESS_ID=str(i),
          ),
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
      )
      for i in (range(processes) if only is None else only)
  ]


def _finish(procs, timeout=600):
  logs = [p.communicate(timeout=timeout)[0] for p in procs]
  return [p.returncode for p in procs], logs


def _metrics(out: pathlib.Path) -> list[dict]:
  return [
      json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
  ]


def _exported(run: pathlib.Path, out: pathlib.Path) -> dict[str, np.ndarray]:
  assert cli_main(["export", f"--checkpoint={run}", f"--out={out}"]) == 0
  return safetensors.numpy.load_file(out / "model.safetensors")


@pytest.mark.slow
def test_two_processes_match_one_and_resume_across_layouts(tmp_path):
  """2 processes x 4 devices run 2 steps; one process x 8 devices resumes
  them to step 3: metrics and weights equal those of one process x 8
  devices running all 3 steps, float rounding aside."""
  one, two = tmp_path / "one", tmp_path / "two"
  assert cli_main(["train", *SMOKE, f"--out={one}", "steps=3"]) == 0
  codes, logs = _finish(_launch(["train", *SMOKE, f"--out={two}", "steps=2"]))
  assert codes == [0, 0], "\n".join(logs)[-4000:]
  # Process 0 logs and writes the files; process 1 says nothing of them.
  assert "held-out accuracy" in logs[0] and "held-out" not in logs[1]
  assert (two / "summary.json").exists()
  resumed = ["--resume", "--allow-reshard", "steps=3"]
  assert cli_main(["train", *SMOKE, f"--out={two}", *resumed]) == 0
  expected, got = _metrics(one), _metrics(two)
  assert [m["step"] for m in got] == [1, 2, 3]
  for want, have in zip(expected, got):
    assert have["reward/total"] == want["reward/total"]
    assert have["completion_length"] == want["completion_length"]
    for key in ("loss", "grad_norm", "update_norm", "entropy"):
      np.testing.assert_allclose(have[key], want[key], rtol=1e-4, atol=1e-6)
  ref = _exported(one, tmp_path / "one_policy")
  # logra export launched as two processes: process 0 writes the folder.
  exported = tmp_path / "two_policy"
  codes, logs = _finish(
      _launch(["export", f"--checkpoint={two}", f"--out={exported}"])
  )
  assert codes == [0, 0], "\n".join(logs)[-4000:]
  new = safetensors.numpy.load_file(exported / "model.safetensors")
  assert ref.keys() == new.keys()
  for name in ref:
    diff = np.linalg.norm(new[name] - ref[name])
    assert diff <= 1e-5 * np.linalg.norm(ref[name]), name
  # logra eval as two processes (each scores half the examples) prints what
  # one process prints.
  evaluate = ["eval", "--preset=smoke", f"--policy={exported}"]
  codes, logs = _finish(_launch(evaluate))
  assert codes == [0, 0], "\n".join(logs)[-4000:]
  result = [json.loads(x) for x in logs[0].splitlines() if x.startswith("{")]
  assert not any(x.startswith("{") for x in logs[1].splitlines())
  single = subprocess.run(
      [sys.executable, "-m", "logra_jax.cli", *evaluate],
      capture_output=True,
      text=True,
      check=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert result == [json.loads(single.stdout.splitlines()[-1])]


def test_processes_given_different_configs_are_refused(tmp_path):
  run = tmp_path / "run"
  procs = _launch(["train", *SMOKE, f"--out={run}"], extra={1: ["steps=5"]})
  codes, logs = _finish(procs, timeout=300)
  assert codes == [2, 2], "\n".join(logs)[-3000:]
  for log in logs:
    assert "processes of this run disagree on the config" in log, log
  assert not (run / "checkpoints").exists()


def test_an_unreachable_coordinator_is_a_clear_error(tmp_path):
  """Process 1 of 2 alone: process 0, which hosts the coordinator, never
  started."""
  run = tmp_path / "run"
  procs = _launch(
      ["train", *SMOKE, f"--out={run}"],
      only=[1],
      env={"LOGRA_INIT_TIMEOUT": "2"},
  )
  codes, logs = _finish(procs, timeout=120)
  assert codes == [2], logs[0][-2000:]
  assert "coordinator localhost:" in logs[0]
  assert "did not answer within 2 s" in logs[0]
  assert not run.exists()
