"""experiments/hostile.py in its --quick mode: a few hostile cases run as a
user would, each classified, written to cases.csv and summary.json with
the run's provenance; an unknown case name is refused in one line."""

import csv
import json
import pathlib
import subprocess
import sys

EXPERIMENTS = pathlib.Path(__file__).parent.parent / "experiments"
OUTCOMES = ("clear error", "recovered", "refused write", "still open")
COLUMNS = ["case", "class", "outcome", "exit_code", "seconds", "error", "note"]


def _hostile(*args):
  return subprocess.run(
      [sys.executable, str(EXPERIMENTS / "hostile.py"), *args],
      capture_output=True,
      text=True,
      timeout=600,
  )


def test_quick_hostile_cases_are_classified_and_recorded(tmp_path):
  done = _hostile("--quick", f"--results={tmp_path}")
  assert done.returncode == 0, done.stderr
  with open(tmp_path / "cases.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  assert rows and list(rows[0]) == COLUMNS
  for row in rows:
    assert row["outcome"] in OUTCOMES and 1 <= int(row["class"]) <= 8, row
    assert float(row["seconds"]) > 0
  # The quick cases are all settled: each either a one-line error or a
  # refused write, none still open.
  assert [r["case"] for r in rows if r["outcome"] == "still open"] == []
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["tried"] == len(rows) == sum(summary["counts"].values())
  assert summary["still_open"] == []
  for key in ("commit", "date", "machine", "command"):
    assert summary[key], key
  assert "--quick" in summary["command"]
  counts = json.loads(done.stdout.strip().splitlines()[-1])
  assert counts["tried"] == len(rows)


def test_an_unknown_case_is_refused_in_one_line(tmp_path):
  done = _hostile("--only", "no_such_case", f"--results={tmp_path}")
  assert done.returncode == 2
  assert done.stderr.strip().splitlines() == [
      "hostile.py: error: no such case: no_such_case"
  ]
  assert not (tmp_path / "cases.csv").exists()
