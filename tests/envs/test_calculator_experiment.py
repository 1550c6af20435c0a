"""experiments/calculator.py in its --quick mode writes a well-formed report:
the calculator arm's row (tool calls, failures, accuracy, times) with the
provenance of the other studies; its conclusions are the full run's."""

import csv
import json
import math
import pathlib
import subprocess
import sys

EXPERIMENTS = pathlib.Path(__file__).parents[2] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import provenance  # noqa: E402

COLUMNS = (
    "eval_accuracy_before",
    "eval_accuracy_after",
    "tool_calls_first",
    "tool_calls_last",
    "failures_first",
    "failures_last",
    "reward_first",
    "reward_last",
    "step_s",
    "rollout_s",
)


def test_quick_calculator_study_writes_its_report(tmp_path):
  # The fingerprint's own smoke run is tests/test_experiments.py's to check;
  # a cache entry for this code version spares it here.
  cache = tmp_path / "fingerprints"
  cache.mkdir()
  (cache / f"{provenance.code_version()}.json").write_text(
      json.dumps({"fingerprint": "quick-test"})
  )
  results = tmp_path / "results"
  done = subprocess.run(
      [
          sys.executable,
          str(EXPERIMENTS / "calculator.py"),
          "--quick",
          "--arms",
          "calculator",
          f"--out={tmp_path / 'runs'}",
          f"--results={results}",
          f"--fingerprint-cache={cache}",
      ],
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  with open(results / "calculator.csv", newline="") as f:
    (row,) = list(csv.DictReader(f))
  assert (row["arm"], row["seed"], row["steps"]) == ("calculator", "0", "1")
  assert all(math.isfinite(float(row[c])) for c in COLUMNS)
  record = json.loads((results / "provenance.json").read_text())
  assert (row["commit"], row["fingerprint"]) == (record["commit"], "quick-test")
  report = (results / "calculator.md").read_text()
  assert "| calculator | 0 | 1 |" in report
  assert f"Command: `{record['command']}`" in report
