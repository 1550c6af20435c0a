"""The studies in experiments/ run in their --quick modes and write
well-formed reports (files present, columns and rows complete, values
finite); their conclusions are the full runs' business. Bad names and a
results folder of other settings are refused before anything runs."""

import argparse
import csv
import json
import math
import pathlib
import subprocess
import sys

import pytest

EXPERIMENTS = pathlib.Path(__file__).parent.parent / "experiments"


def _study(name, *args, tmp_path):
  return subprocess.run(
      [
          sys.executable,
          str(EXPERIMENTS / f"{name}.py"),
          "--quick",
          f"--out={tmp_path / 'runs'}",
          f"--results={tmp_path / 'results'}",
          *args,
      ],
      capture_output=True,
      text=True,
      timeout=1200,
  )


def _rows(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def _assert_finite(rows, columns):
  for row in rows:
    for column in columns:
      assert math.isfinite(float(row[column])), (column, row)


# Each study's --quick mode on a few of its arms and tasks (every arm is a
# config the optimizer tests cover; here the reports are what is checked).
@pytest.mark.parametrize(
    "name, arms, tasks",
    [
        ("parity", ["lora", "logra"], ["tiny", "count_bits"]),
        ("ablations", ["default", "rank=8", "kind=random"], ["tiny"]),
        ("kl_control", ["logra+kl", "lora"], ["tiny"]),
    ],
)
def test_quick_study_writes_its_reports(name, arms, tasks, tmp_path):
  done = _study(name, "--arms", *arms, "--tasks", *tasks, tmp_path=tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  results = tmp_path / "results"
  rows = _rows(results / f"{name}.csv")
  assert {(r["task"], r["arm"]) for r in rows} == {
      (t, a) for t in tasks for a in arms
  }
  _assert_finite(
      rows,
      ["eval_accuracy_before", "eval_accuracy_after", "optimizer_state_bytes"],
  )
  table = (results / f"{name}.md").read_text()
  assert all(f"| {arm} |" in table for arm in arms)
  assert "Command: `python experiments/" in table and "--quick" in table
  assert (results / f"{name}.png").stat().st_size > 0
  if name == "parity":
    assert all(f"{task}: LoGRA " in table for task in tasks)
    _assert_finite(rows, ["weights_bytes", "wall_seconds"])
  if name == "kl_control":
    _assert_finite(rows, ["kl_k3_median", "k3_within_2x"])
    controlled = [r for r in rows if r["arm"].endswith("+kl")]
    _assert_finite(controlled, ["predicted_over_k3_median", "scale_median"])
    assert "| train step + predictor" in table


def test_async_study_quick(tmp_path):
  done = _study("async_rollouts", tmp_path=tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = _rows(tmp_path / "results" / "async_rollouts.csv")
  assert [r["arm"] for r in rows] == ["max_staleness=0", "max_staleness=1"]
  _assert_finite(rows, ["accuracy_after", "step_s_median"])
  assert (
      "max_staleness=1"
      in (tmp_path / "results" / "async_rollouts.md").read_text()
  )


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("parity", ["--arms", "logra", "sgd"], "unknown arms ['sgd']"),
        ("parity", ["--tasks", "gsm9k"], "unknown tasks ['gsm9k']"),
        ("parity", ["--arms", "adam"], "must include logra"),
        ("ablations", ["--arms", "rank=7"], "unknown arms ['rank=7']"),
        ("kl_control", ["--arms", "sgd+kl"], "unknown arms ['sgd+kl']"),
        ("parity", ["--seeds", "0"], "--seeds must be >= 1"),
    ],
)
def test_bad_names_are_refused_before_running(name, args, message, tmp_path):
  done = _study(name, *args, tmp_path=tmp_path)
  assert done.returncode == 2 and message in done.stderr
  assert not (tmp_path / "runs").exists()


def test_results_of_other_settings_are_not_overwritten(tmp_path):
  results = tmp_path / "results"
  results.mkdir()
  (results / "study.json").write_text(
      '{"arms": ["logra"], "quick": true, "seeds": 1, "set": [], '
      '"tasks": ["tiny"]}\n'
  )
  (results / "parity.md").write_text("earlier\n")
  done = _study(
      "parity", "--arms", "logra", "adam", "--tasks", "tiny", tmp_path=tmp_path
  )
  assert done.returncode == 1
  assert "holds the results of other settings (arms differ" in done.stderr
  assert "--overwrite" in done.stderr
  assert (results / "parity.md").read_text() == "earlier\n"
  assert not (tmp_path / "runs").exists()


def test_a_study_option_is_part_of_its_results_settings(tmp_path, monkeypatch):
  """kl_control's own options (here --target-kl) claim the results folder
  too, and the reported command repeats them."""
  results = tmp_path / "results"
  results.mkdir()
  settings = {
      "arms": ["logra+kl"],
      "quick": True,
      "seeds": 1,
      "set": [],
      "tasks": ["tiny"],
      "kl_subsample": 128,
      "lr_multiplier": 10.0,
      "overhead_repeats": 10,
      "target_kl": 0.005,
  }
  (results / "study.json").write_text(json.dumps(settings))
  done = _study(
      "kl_control",
      "--arms",
      "logra+kl",
      "--tasks",
      "tiny",
      "--target-kl",
      "0.01",
      tmp_path=tmp_path,
  )
  assert done.returncode == 1
  assert "(target_kl differ: there [0.005], now [0.01])" in done.stderr
  assert not (tmp_path / "runs").exists()
  monkeypatch.syspath_prepend(str(EXPERIMENTS))
  import study  # noqa: PLC0415

  args = argparse.Namespace(
      **settings, out="o", results="r", rerun=False, overwrite=False
  )
  assert study.command("kl_control", args).endswith(
      "--kl-subsample 128 --lr-multiplier 10.0 --overhead-repeats 10 "
      "--target-kl 0.005"
  )


def test_quick_gpu_bench_writes_its_tables(tmp_path):
  """The accelerator benchmark's programs at tiny shapes, on this machine:
  every figure finite (MFU, peak memory and the bandwidth bound need a
  known accelerator, so they may be absent here)."""
  done = subprocess.run(
      [
          sys.executable,
          str(EXPERIMENTS / "gpu_bench.py"),
          "--quick",
          f"--results={tmp_path}",
      ],
      capture_output=True,
      text=True,
      timeout=1200,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((tmp_path / "gpu_bench.json").read_text())
  assert [r["arm"] for r in results["train"]] == ["adam", "logra-bf16"]
  for row in results["train"]:
    assert row["loss_finite"]
    for key in ("compile_s", "step_s", "tflops_per_s"):
      assert math.isfinite(row[key]) and row[key] > 0, (key, row)
  for row in results["decode"]:
    for key in ("seconds", "tokens_per_s", "step_bytes"):
      assert math.isfinite(row[key]) and row[key] > 0, (key, row)
  table = (tmp_path / "gpu_bench.md").read_text()
  assert "| tiny | adam | 128 |" in table and "Command:" in table
