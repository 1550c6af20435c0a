"""Trackers and sample tables: each tracker's own library records the
metrics; a missing one is refused before a run; sample rows and their log
survive a resume without repeated steps."""

import json
import re
import struct
import subprocess
import sys

import pytest
from tensorboardX.proto import event_pb2

from logra_jax.rl import rewards
from logra_jax.rl import tracking
from logra_jax.rl import scoring


def _samples():
  prompts = ["1+1=", "1+1=", "2+3=", "2+3="]
  completions = ["2", "3", "5", "a very long completion that wraps " * 3]
  columns = {"answer": ["2", "2", "5", "5"]}
  report = rewards.evaluate_rewards(
      [(rewards.exact_match, 1.0), (rewards.format_reward(r"\d+"), 0.5)],
      prompts,
      completions,
      columns,
  )
  return scoring.RolloutSamples(prompts, completions, columns, report)


def test_sample_rows_are_the_first_completion_of_each_prompt():
  rows = tracking.sample_rows(_samples(), num_generations=2, shown=5)
  assert rows == [
      {
          "prompt": "1+1=",
          "completion": "2",
          "answer": "2",
          "reward": 1.5,
          "reward/exact_match": 1.0,
          "reward/format": 1.0,
      },
      {
          "prompt": "2+3=",
          "completion": "5",
          "answer": "5",
          "reward": 1.5,
          "reward/exact_match": 1.0,
          "reward/format": 1.0,
      },
  ]
  assert len(tracking.sample_rows(_samples(), 2, shown=1)) == 1
  # One row per completion when each prompt has one.
  assert len(tracking.sample_rows(_samples(), 1, shown=9)) == 4


def test_sample_table_shows_every_row_within_its_width():
  rows = tracking.sample_rows(_samples(), num_generations=1, shown=4)
  text = tracking.sample_table(rows, step=7, width=60)
  assert "samples at step 7" in text
  assert all(len(line) <= 60 for line in text.splitlines())
  for row in rows:
    assert f"{row['reward']:.3f}" in text
  # A long completion is folded over lines, not cut (the other cells of its
  # row hold no letters).
  assert re.sub("[^a-z]", "", text).count("averylongcompletionthatwraps") == 3


def test_sample_log_drops_the_rows_a_resumed_run_samples_again(tmp_path):
  path = tmp_path / "samples.jsonl"
  with tracking.SampleLog(path) as log:
    for step in (1, 5, 10):
      log.write(step, [{"prompt": "p", "completion": str(step)}])
  with tracking.SampleLog(path, resumed_step=5) as log:
    log.write(10, [{"prompt": "p", "completion": "again"}])
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  assert [(r["step"], r["completion"]) for r in rows] == [
      (1, "1"),
      (5, "5"),
      (10, "again"),
  ]
  # A new run starts the file afresh.
  with tracking.SampleLog(path):
    pass
  assert path.read_text() == ""


def _tfrecords(path):
  """The records of a TFRecord file: each is its length (8 bytes), the
  length's CRC (4), the data and the data's CRC (4)."""
  data, records = path.read_bytes(), []
  while data:
    (length,) = struct.unpack("<Q", data[:8])
    records.append(data[12 : 12 + length])
    data = data[16 + length :]
  return records


def test_tensorboard_events_hold_the_logged_scalars(tmp_path):
  with tracking.Trackers(["tensorboard"], tmp_path, {}) as trackers:
    trackers.log({"reward/total": 0.25}, step=1)
    trackers.log({"reward/total": 0.75}, step=2)
  [path] = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
  scalars = []
  for record in _tfrecords(path):
    event = event_pb2.Event.FromString(record)
    scalars += [
        (event.step, v.tag, v.simple_value) for v in event.summary.value
    ]
  assert scalars == [(1, "reward/total", 0.25), (2, "reward/total", 0.75)]


# Logs steps into a file-size limit of 4 KiB (writes past it fail with
# EFBIG, as they would with ENOSPC on a full disk).
_LOG_PAST_A_SIZE_LIMIT = """
import pathlib, resource, signal, sys
from logra_jax.rl import tracking

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
with tracking.Trackers(["tensorboard"], pathlib.Path(sys.argv[1]), {}) as t:
  for step in range(1, 1001):
    try:
      t.log({f"metric/{i}": 0.5 for i in range(20)}, step=step)
    except OSError as error:
      print(f"step {step}: {error.strerror}")
      break
"""


def test_a_failed_tensorboard_write_raises_at_its_step(tmp_path):
  """The failing step raises (no writer thread dies silently, leaving
  the run blocked on a full queue)."""
  done = subprocess.run(
      [sys.executable, "-c", _LOG_PAST_A_SIZE_LIMIT, str(tmp_path)],
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert re.fullmatch(r"step \d+: File too large\n", done.stdout), done
  failed_at = int(done.stdout.split()[1][:-1])
  assert 1 < failed_at < 1000


def test_wandb_offline_run_records_the_metrics(tmp_path, monkeypatch):
  wandb = pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  with tracking.Trackers(["wandb"], tmp_path, {"steps": 3}) as trackers:
    trackers.log({"reward/total": 0.625}, step=1)
  # run.finish() can return before W&B's service process has written the
  # run's records out; shutting the service down waits for it (as the
  # exit of a `logra train` process does).
  wandb.teardown()
  run_id = (tmp_path / "wandb-run-id").read_text()
  [record] = (tmp_path / "wandb").glob(
      f"offline-run-*-{run_id}/run-{run_id}.wandb"
  )
  data = record.read_bytes()
  assert b"reward/total" in data and b"0.625" in data


def test_a_tracker_whose_library_is_missing_is_refused(monkeypatch):
  real_find_spec = tracking.importlib.util.find_spec
  monkeypatch.setattr(
      tracking.importlib.util,
      "find_spec",
      lambda name: None if name == "wandb" else real_find_spec(name),
  )
  with pytest.raises(
      ValueError,
      match=r"logging.trackers includes 'wandb', but wandb "
      r"is not installed: pip install 'logra-jax\[wandb\]'",
  ):
    tracking.check_trackers(["tensorboard", "wandb"])


def test_a_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
  path = tmp_path / "samples.jsonl"
  path.write_text('{"step": 1, "prompt": "p"}\n{"step": 2, "pro')
  with tracking.SampleLog(path, resumed_step=2):
    pass
  assert path.read_text() == '{"step": 1, "prompt": "p"}\n'
