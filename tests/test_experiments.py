"""The studies in experiments/ run in their --quick modes and write
well-formed reports (files present, columns and rows complete, values
finite, provenance recorded); their conclusions are the full runs'
business. Bad input (unknown names, a non-positive learning rate, a bad
override, a results folder of other settings) is refused in one line with
exit status 2 before anything runs or is written. A finished run is reused
only when its config and numerics fingerprint both match."""

import argparse
import csv
import doctest
import importlib
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import filelock
import pytest

from logra_jax import configs
from logra_jax import memory
from logra_jax import sync
from logra_jax.checkpoint import folders
from logra_jax.rl import guards

EXPERIMENTS = pathlib.Path(__file__).parent.parent / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import parity  # noqa: E402
import parity_design  # noqa: E402
import parity_report  # noqa: E402
import provenance  # noqa: E402
import stats  # noqa: E402
import study  # noqa: E402
import sync_bytes  # noqa: E402
import sync_compression  # noqa: E402

PROVENANCE = ("commit", "dirty", "fingerprint", "date", "machine")


@pytest.fixture(scope="session")
def fingerprints(tmp_path_factory):
  """One fingerprint cache for the suite's studies, its workers' too: the
  first worker to need it computes this tree's fingerprint (its smoke runs)
  while the others wait on the lock, then read it."""
  shared = tmp_path_factory.getbasetemp()
  if "PYTEST_XDIST_WORKER" in os.environ:
    shared = shared.parent  # this session's, above each worker's
  folder = shared / "fingerprints"
  with filelock.FileLock(str(shared / "fingerprints.lock")):
    provenance.fingerprint(folder)
  return folder


def _study(name, *args, tmp_path, cache=None):
  return subprocess.run(
      [
          sys.executable,
          str(EXPERIMENTS / f"{name}.py"),
          "--quick",
          f"--out={tmp_path / 'runs'}",
          f"--results={tmp_path / 'results'}",
          *(
              [f"--fingerprint-cache={cache or tmp_path / 'fingerprints'}"]
              if name
              in (
                  "parity",
                  "kl_control",
                  "ablations",
                  "recipes",
                  "start_accuracy",
                  "gradient_spectrum",
                  "sync_compression",
              )
              else []
          ),
          *args,
      ],
      capture_output=True,
      text=True,
      timeout=1200,
  )


def _quick_report(name, tmp_path):
  """A study that takes no runs folder, in its --quick mode, its reports
  written to ``tmp_path``."""
  return subprocess.run(
      [
          sys.executable,
          str(EXPERIMENTS / f"{name}.py"),
          "--quick",
          f"--results={tmp_path}",
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


def _refuse_constant(name):
  raise ValueError(f"{name} is not JSON")


def _assert_provenance(results, rows):
  record = json.loads((results / "provenance.json").read_text())
  assert set(PROVENANCE + ("versions", "command")) <= set(record)
  assert {"jax", "jaxlib", "flax", "optax", "numpy", "python"} <= set(
      record["versions"]
  )
  assert (
      record["command"].startswith("python ") and "--quick" in record["command"]
  )
  assert all(
      (r["commit"], r["fingerprint"])
      == (record["commit"], record["fingerprint"])
      for r in rows
  )
  return record


# Each study's --quick mode on a few of its arms and tasks (every arm is a
# config the optimizer tests cover; here the reports are what is checked).
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, arms, tasks",
    [
        ("ablations", ["default", "rank=8"], ["tiny"]),
        ("kl_control", ["logra+kl", "lora"], ["tiny"]),
    ],
)
def test_quick_study_writes_its_reports(
    name, arms, tasks, tmp_path, fingerprints
):
  done = _study(
      name,
      "--arms",
      *arms,
      "--tasks",
      *tasks,
      tmp_path=tmp_path,
      cache=fingerprints,
  )
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
  record = _assert_provenance(results, rows)
  table = (results / f"{name}.md").read_text()
  assert all(f"| {arm} |" in table for arm in arms)
  assert f"Command: `{record['command']}`" in table
  assert record["fingerprint"] in table
  assert (results / f"{name}.png").stat().st_size > 0
  if name == "kl_control":
    _assert_finite(rows, ["kl_k3_median", "k3_within_2x"])
    controlled = [r for r in rows if r["arm"].endswith("+kl")]
    _assert_finite(controlled, ["predicted_over_k3_median", "scale_median"])
    assert "| train step + predictor" in table


@pytest.mark.slow
def test_quick_recipes_study_compares_with_the_default(tmp_path, fingerprints):
  """The recipes study's --quick mode: the default and one recipe, one
  seed each, with their held-out accuracy and step time ratio."""
  done = _study(
      "recipes",
      "--arms",
      "default",
      "dapo",
      tmp_path=tmp_path,
      cache=fingerprints,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  results = tmp_path / "results"
  rows = _rows(results / "recipes.csv")
  assert [r["arm"] for r in rows] == ["default", "dapo"]
  _assert_finite(rows, ["held_out_before", "held_out_after", "step_s_median"])
  # The recipe is the file `logra train --config dapo` reads.
  config = tmp_path / "runs" / "quick" / "dapo-seed0" / "config.yaml"
  assert "dynamic_sampling: true" in config.read_text()
  record = _assert_provenance(results, rows)
  table = (results / "recipes.md").read_text()
  assert "| default | 1 |" in table and "(1.00x)" in table
  assert record["fingerprint"] in table
  assert (results / "recipes.png").stat().st_size > 0


@pytest.mark.parametrize(
    "section,name,other",
    [("policy", "batch_invariant", "true"), ("optimizer", "step_bits", "4")],
)
def test_a_later_config_field_at_its_default_keeps_the_rows_hashes(
    section, name, other
):
  """Rows made before a field existed (``policy.batch_invariant``,
  ``optimizer.step_bits``) keep their config hashes at its default; another
  value is another config."""
  config = configs.get_preset("smoke")
  described = configs.to_dict(config)
  for later_section, later_name in parity.LATER_FIELDS:
    del described[later_section][later_name]
  text = json.dumps(described, sort_keys=True)
  before = parity.hashlib.sha256(text.encode()).hexdigest()[:16]
  assert parity.config_hash(config) == before
  on = configs.apply_overrides(config, [f"{section}.{name}={other}"])
  assert parity.config_hash(on) != before


def test_rows_of_one_code_are_joined_through_a_chain(monkeypatch):
  """Rows of one package under an older definition of the fingerprint join
  the package's rows through the package, and rows of a changed tree (no
  package) join them through the fingerprint: one code, though the two
  ends share neither; a row of another code is refused."""
  ledger = [
      {"commit": "c", "package": "p", "backend": "cpu", "definition": 2,
       "fingerprint": fingerprint}
      for fingerprint in ("a", "b")
  ]  # fmt: skip
  monkeypatch.setattr(parity.provenance, "read_ledger", lambda: ledger)
  versions = {"jax": "1"}
  older = {"fingerprint": "z", "package": "p", "versions": versions}
  packaged = {"fingerprint": "a", "package": "p", "versions": versions}
  changed = {"fingerprint": "b", "package": "", "versions": versions}
  assert not parity.same_code(older, changed)
  assert not parity.same_code(changed, older)
  assert parity.one_code([older, packaged, changed])
  assert parity.one_code([changed, older, packaged])
  other = {"fingerprint": "c", "package": "q", "versions": versions}
  assert not parity.one_code([older, packaged, changed, other])


def test_a_config_without_a_later_field_hashes_as_at_its_default(
    monkeypatch,
):
  """An older package's config, which lacks a later field (the study run
  on package 0d54457 with the levers backported), hashes as the field at
  its default does."""
  config = configs.get_preset("smoke")
  at_default = parity.config_hash(config)
  to_dict = configs.to_dict

  def older(c):
    described = to_dict(c)
    del described["policy"]["batch_invariant"]
    return described

  monkeypatch.setattr(parity.configs, "to_dict", older)
  assert parity.config_hash(config) == at_default


def test_parity_code_levers_are_the_default_with_their_settings():
  """``logra-4bit`` and ``logra-frozen`` are the default logra with 4-bit
  steps and with frozen embeddings, each tested against it on the levers'
  grid, and resolve to them on tiny."""
  settings = lambda arm: dict(o.split("=") for o in parity_design.ARMS[arm])
  for arm, more in parity_design.CODE_LEVERS.items():
    new = {
        k: v for k, v in settings(arm).items() if settings("logra").get(k) != v
    }
    assert new == {f"optimizer.{k}": v for k, v in more.items()}
    assert (arm, "logra") in parity_design.COMPARISONS
    assert parity_design.GRIDS[arm] == parity_design.GRIDS["logra-rank8"]
    tiny = parity_design.SETTINGS["tiny"]
    resolved = configs.load_config(
        tiny.preset, overrides=[*tiny.overrides, *parity_design.ARMS[arm]]
    ).optimizer
    for name, value in more.items():
      assert str(getattr(resolved, name)).lower() == value
  assert set(parity_design.CODE_LEVERS) == {"logra-4bit", "logra-frozen"}


def test_parity_candidates_pull_levers_together_and_meet_every_baseline():
  """A candidate for the default is the default logra with its settings,
  tested against the tuned baselines and the default on the levers' grid;
  logra-10mb (rank 16, 4-bit steps and projected embeddings) sends at most
  10 MB a step at Qwen2.5-7B shapes, its projectors' refreshes included."""
  settings = lambda arm: dict(o.split("=") for o in parity_design.ARMS[arm])
  for arm, more in parity_design.CANDIDATES.items():
    new = {
        k: v for k, v in settings(arm).items() if settings("logra").get(k) != v
    }
    assert new == {f"optimizer.{k}": v for k, v in more.items()}
    assert {(arm, base) for base in ("adam", "lora", "logra")} <= set(
        parity_design.COMPARISONS
    )
    assert parity_design.GRIDS[arm] == parity_design.GRIDS["logra"]
    assert arm not in parity_design.MAIN_ARMS
  candidate = parity_design.CANDIDATE_SETTINGS["logra-10mb"]
  message = sync_bytes.message_bytes(
      "qwen2.5-7b",
      int(candidate["rank"]),
      "projected",
      step_bits=int(candidate["step_bits"]),
  )
  refresh_every = configs.OptimizerConfig().refresh_every
  _, _, mean = sync_bytes.per_step(message, "logra", refresh_every)
  assert mean <= 10e6


def test_parity_levers_split_the_small_sync_configuration():
  """Each lever arm is the default logra with one of logra-small-sync's
  settings, the levers together change every setting the two differ in,
  and they run only when asked for."""
  settings = lambda arm: dict(o.split("=") for o in parity_design.ARMS[arm])
  default, small = settings("logra"), settings("logra-small-sync")
  changed = set()
  for lever in parity_design.LEVERS:
    differs = {k for k, v in settings(lever).items() if v != default[k]}
    assert differs and all(settings(lever)[k] == small[k] for k in differs)
    assert not differs & changed
    changed |= differs
  assert changed == {k for k in default if default[k] != small[k]}
  assert not set(parity_design.LEVERS) & set(parity_design.MAIN_ARMS)
  assert {(lever, "logra") for lever in parity_design.LEVERS} <= set(
      parity_design.COMPARISONS
  )


def test_parity_follow_ups_add_one_setting_to_their_lever():
  """A follow-up arm is its lever's settings with one more changed, tested
  against the lever (a gain?) and the default (a recovery?), on the levers'
  grid, and runs only when asked for. Resolved on a setting that keeps the
  library's default of that setting, it changes it."""
  settings = lambda arm: dict(o.split("=") for o in parity_design.ARMS[arm])
  for arm, (lever, changes) in parity_design.FOLLOW_UPS.items():
    assert lever in parity_design.LEVERS and arm not in parity_design.MAIN_ARMS
    new = {
        k: v for k, v in settings(arm).items() if settings(lever).get(k) != v
    }
    assert new == {f"optimizer.{k}": v for k, v in changes.items()}
    assert {(arm, lever), (arm, "logra")} <= set(parity_design.COMPARISONS)
    assert parity_design.GRIDS[arm] == parity_design.GRIDS[lever]
    tiny = parity_design.SETTINGS["tiny"]
    resolved = {
        name: configs.load_config(
            tiny.preset, overrides=[*tiny.overrides, *parity_design.ARMS[name]]
        ).optimizer
        for name in (arm, lever)
    }
    for key, value in changes.items():
      assert str(getattr(resolved[arm], key)) == value
      assert getattr(resolved[lever], key) == getattr(
          configs.OptimizerConfig(), key
      )


def test_parity_report_tests_the_small_sync_arm_against_the_default():
  """The report tests each LoGRA arm against the tuned baselines and the
  smallest-sync configuration against the default LoGRA, from the rows
  alone; a pair with an arm not run is left out."""
  arms = ["adam", "logra", "logra-small-sync"]
  accuracy = {"adam": 0.60, "logra": 0.58, "logra-small-sync": 0.50}
  rows = [
      dict(
          setting="tiny",
          arm=arm,
          learning_rate=1e-3,
          test_before=0.4,
          test_after=accuracy[arm] + 0.01 * seed,
          validation_after=0.5,
          memory_bytes=2**20,
          train_prompts=10,
          validation_prompts=4,
          test_prompts=4,
      )
      for arm in arms
      for seed in range(5)
  ]
  args = argparse.Namespace(
      settings=["tiny"], arms=arms, quick=False, kl_seeds=0, target_kl=5e-3
  )
  record = provenance.collect("python experiments/parity.py", "ab12")
  table = parity_report.report(args, rows, {("tiny", "adam"): 1e-4}, record)
  compared = [
      line.split(" | ")[0][2:]
      for line in table.splitlines()
      if line.startswith("| ") and " vs " in line and "+kl" not in line
  ]
  assert compared == [
      "logra vs adam",
      "logra-small-sync vs adam",
      "logra-small-sync vs logra",
  ]
  small_vs_default = stats.compare(
      [r["test_after"] for r in rows if r["arm"] == "logra-small-sync"],
      [r["test_after"] for r in rows if r["arm"] == "logra"],
      parity_design.SETTINGS["tiny"].margin,
  )
  assert f"| {small_vs_default.difference:+.3f} [" in table
  assert f"| {stats.verdict(small_vs_default)} |" in table
  # The last column: each test's non-inferiority p adjusted (Holm) over the
  # table's three tests.
  assert "Holm over the 3 tests with a p-value |" in table
  by_arm = {
      arm: [r["test_after"] for r in rows if r["arm"] == arm] for arm in arms
  }
  margin = parity_design.SETTINGS["tiny"].margin
  tests = [
      stats.compare(by_arm[a], by_arm[b], margin).non_inferiority_p
      for a, b in [
          ("logra", "adam"),
          ("logra-small-sync", "adam"),
          ("logra-small-sync", "logra"),
      ]
  ]
  last_column = [
      line.rsplit(" | ", 1)[1].rstrip(" |")
      for line in table.splitlines()
      if line.startswith("| ") and " vs " in line
  ]
  assert last_column == [f"{p:.3g}" for p in stats.holm(tests)]
  # The primary tests run here, the first two, adjusted over themselves.
  primary = stats.holm(tests[:2])
  assert (
      "over them alone: logra vs adam "
      f"{primary[0]:.3g}; logra-small-sync vs adam {primary[1]:.3g}." in table
  )


def test_holm_counts_only_the_tests_with_a_p_value():
  """A pair with an arm of one seed has no test: the adjustment and the
  counts shown leave it out; the primary tests are adjusted over
  themselves, KL-matched ones never among them."""
  seeds = {"adam": 5, "lora": 5, "logra": 5, "logra-small-sync": 1}
  spread = [0.0, 0.01, -0.01, 0.02, -0.02]
  accuracy = {"adam": 0.50, "lora": 0.58, "logra": 0.58}
  rows = [
      dict(setting="tiny", arm=arm, test_after=accuracy.get(arm, 0.5) + d)
      for arm, n in seeds.items()
      for d in spread[:n]
  ] + [
      dict(setting="tiny", arm=arm + "+kl", test_after=0.6 + d)
      for arm in ("logra", "adam")
      for d in spread
  ]
  table = parity_report.comparison_table(rows, "tiny", 0.03)
  values = {
      arm: [r["test_after"] for r in rows if r["arm"] == arm]
      for arm in ("adam", "lora", "logra", "logra+kl", "adam+kl")
  }
  raw = [
      stats.compare(values[a], values[b], 0.03).non_inferiority_p
      for a, b in [
          ("logra", "adam"),
          ("logra", "lora"),
          ("logra+kl", "adam+kl"),
      ]
  ]
  assert "Holm over the 3 tests with a p-value |" in table[0]
  cells = {
      line.split(" | ")[0][2:]: line.rsplit(" | ", 1)[1].rstrip(" |")
      for line in table
      if line.startswith("| ") and " vs " in line
  }
  # Holm, not Bonferroni: the second smallest p is multiplied by 2, not 3.
  assert [cells["logra vs adam"], cells["logra vs lora"]] == [
      f"{p:.3g}" for p in stats.holm(raw)[:2]
  ]
  assert cells["logra+kl vs adam+kl"] == f"{stats.holm(raw)[2]:.3g}"
  assert cells["logra-small-sync vs adam"] == "nan"
  primary = stats.holm(raw[:2])
  assert table[-1] == (
      "The primary tests (each of logra, logra-small-sync against each "
      "tuned baseline of adam, lora; 2 with a p-value), non-inferiority p "
      f"adjusted (Holm) over them alone: logra vs adam {primary[0]:.3g}; "
      f"logra vs lora {primary[1]:.3g}; logra-small-sync vs adam nan; "
      "logra-small-sync vs lora nan."
  )


@pytest.mark.slow
def test_quick_parity_sweeps_chooses_and_tests(tmp_path, fingerprints):
  """The parity study's --quick mode: a 2-rate sweep (1 seed), 2 seeds at
  the chosen rate, a KL-matched seed; rows written one file per run; CSVs,
  tables with CIs and verdicts, plots and provenance."""
  done = _study(
      "parity",
      "--settings",
      "tiny",
      "--arms",
      "logra",
      "adam",
      tmp_path=tmp_path,
      cache=fingerprints,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  results = tmp_path / "results"
  rows = _rows(results / "parity.csv")
  assert sorted((r["arm"], r["seed"]) for r in rows) == sorted(
      [(a, s) for a in ("logra", "adam") for s in ("0", "1")]
      + [("logra+kl", "0"), ("adam+kl", "0")]
  )
  for row in rows:
    assert (row["validation_prompts"], row["test_prompts"]) == ("8", "8")
  _assert_finite(
      rows,
      [
          "learning_rate",
          "train_prompts",
          "validation_before",
          "validation_after",
          "test_before",
          "test_after",
          "memory_bytes",
      ],
  )
  sweep = _rows(results / "sweep.csv")
  # --quick sweeps the middle two rates of each arm's grid.
  assert sorted((r["arm"], r["learning_rate"]) for r in sweep) == [
      ("adam", "0.0001"),
      ("adam", "3e-05"),
      ("logra", "0.0003"),
      ("logra", "0.001"),
  ]
  _assert_provenance(results, rows + sweep)
  row_files = list((results / "rows").rglob("*.json"))
  assert len(row_files) == 8
  for path in row_files:  # strict JSON: no NaN or Infinity; the host
    row = json.loads(path.read_text(), parse_constant=_refuse_constant)
    assert row["machine"]["cpu_isa"] and row["machine"]["cpu_count"] > 0
  table = (results / "parity.md").read_text()
  assert "| logra vs adam |" in table and "| logra+kl vs adam+kl |" in table
  assert "Chosen learning rates" in table and "Command: `python " in table
  for png in ("parity.png", "sweep.png"):
    assert (results / png).stat().st_size > 0
  # --report-only rewrites the same reports from the rows, running nothing
  # (an empty --out stays empty) ...
  report_only = lambda: _study(
      "parity",
      "--settings",
      "tiny",
      "--arms",
      "logra",
      "adam",
      "--report-only",
      f"--out={tmp_path / 'nothing'}",
      tmp_path=tmp_path,
      cache=fingerprints,
  )
  again = report_only()
  assert again.returncode == 0, again.stderr[-3000:]
  assert _rows(results / "parity.csv") == rows
  assert not list((tmp_path / "nothing").rglob("*.json"))
  # ... names every commit of rows that share the numerics, and its own,
  # and counts the rows made with uncommitted changes (no package) ...
  changed = row_files[0]
  row = json.loads(changed.read_text())
  changed.write_text(json.dumps(dict(row, commit="f" * 40, package="")))
  spanning = report_only()
  assert spanning.returncode == 0, spanning.stderr[-3000:]
  record = json.loads((results / "provenance.json").read_text())
  assert sorted(record["rows_commits"].split()) == sorted(
      {row["commit"], "f" * 40}
  )
  assert record["commit"] == provenance.commit()[0]
  uncommitted = sum(
      json.loads(path.read_text())["package"] == "" for path in row_files
  )
  assert record["rows_uncommitted"] == uncommitted >= 1
  table = (results / "parity.md").read_text()
  assert "rows made at commit " in table
  assert f", {uncommitted} rows made with uncommitted changes" in table
  # ... and refuses rows of two numerics fingerprints.
  changed.write_text(
      json.dumps(dict(row, fingerprint="0" * 16, package="f" * 40))
  )
  mixed = report_only()
  assert mixed.returncode == 2
  assert "several code versions" in mixed.stderr
  # --kl-seeds 0: the tuned comparison alone, no KL-matched arm or panel.
  changed.write_text(json.dumps(row))
  tuned = _study(
      "parity",
      "--settings",
      "tiny",
      "--arms",
      "logra",
      "adam",
      "--report-only",
      "--kl-seeds",
      "0",
      "--overwrite",
      f"--out={tmp_path / 'nothing'}",
      tmp_path=tmp_path,
      cache=fingerprints,
  )
  assert tuned.returncode == 0, tuned.stderr[-3000:]
  table = (results / "parity.md").read_text()
  assert "| logra vs adam |" in table and "+kl" not in table
  assert {r["arm"] for r in _rows(results / "parity.csv")} == {"logra", "adam"}
  assert (results / "parity.png").stat().st_size > 0


@pytest.mark.parametrize("module", [provenance, study])
def test_docstring_examples_run(module):
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0 and result.attempted > 0


def test_the_fingerprint_run_is_compiled_for_a_pinned_cpu_isa(
    tmp_path, monkeypatch
):
  """The smoke run behind the fingerprint gets XLA_FLAGS capping XLA:CPU
  at AVX2, so hosts with wider vector units share fingerprints, and none of
  the caller's flags (batch-invariant studies set numerics-changing ones in
  their own process), and a warm-start cache of its own."""
  seen, run = {}, subprocess.run

  def smoke_run(command, env=None, **kwargs):
    if "train" not in command:  # git and the like
      return run(command, env=env, **kwargs)
    seen.update(env=env, command=command)
    out = pathlib.Path(command[command.index("--out") + 1])
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    return subprocess.CompletedProcess(command, 0, "", "")

  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_xnnpack=false")
  monkeypatch.setattr(provenance.subprocess, "run", smoke_run)
  provenance.fingerprint.cache_clear()
  try:
    value = provenance.fingerprint(tmp_path / "cache")
  finally:
    provenance.fingerprint.cache_clear()
  assert value == provenance.metrics_hash(['{"step": 1, "loss": 0.5}'] * 2)
  assert "--set=optimizer.project_embeddings=true" in seen["command"]
  # Its warm start is trained afresh, in the run's own temporary folder.
  (cache_dir,) = [c for c in seen["command"] if "policy.cache_dir=" in c]
  out = pathlib.Path(seen["command"][seen["command"].index("--out") + 1])
  assert pathlib.Path(cache_dir.split("=", 2)[2]).parent == out.parent
  assert seen["env"]["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2"
  assert provenance.machine()["cpu_isa"]


def test_metrics_hash_keeps_only_the_numerics():
  line = lambda **kv: json.dumps({"step": 1, "loss": 0.5, **kv})
  assert provenance.metrics_hash(
      [line(**{"time/step_s": 1.0, "compile/count": 3.0})]
  ) == provenance.metrics_hash([line(**{"time/step_s": 2.0, "new/metric": 1})])
  assert provenance.metrics_hash([line()]) != provenance.metrics_hash(
      [line(loss=0.25)]
  )


def _config():
  return configs.apply_overrides(configs.get_preset("smoke"), ["steps=1"])


def test_a_run_stopped_by_a_signal_stops_the_study(tmp_path, monkeypatch):
  """A run that SIGTERM stopped is not a finished run: the study exits with
  the signal's status (143) instead of reporting it and going on."""
  monkeypatch.setattr(
      study.trainer,
      "train_or_reuse",
      lambda config, folder, rerun: {"stopped_by": "SIGTERM", "steps": 3},
  )
  monkeypatch.setattr(study.provenance, "fingerprint", lambda cache: "aaaa")
  args = argparse.Namespace(rerun=False, fingerprint_cache="unused")
  with pytest.raises(SystemExit) as stopped:
    study.train(args, _config(), tmp_path / "run")
  assert stopped.value.code == 143


def test_a_run_of_another_fingerprint_is_not_reused(tmp_path, monkeypatch):
  """study.train asks the trainer to rerun a folder whose fingerprint is
  another (or unknown), and to reuse it when it matches."""
  reruns = []

  def fake_train_or_reuse(config, folder, rerun):
    reruns.append(rerun)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    return {"eval_accuracy_before": 0.0}

  monkeypatch.setattr(study.trainer, "train_or_reuse", fake_train_or_reuse)
  value = {"fingerprint": "aaaa"}
  monkeypatch.setattr(
      study.provenance, "fingerprint", lambda cache: value["fingerprint"]
  )
  args = argparse.Namespace(rerun=False, fingerprint_cache="unused")
  folder = tmp_path / "run"
  study.train(args, _config(), folder)  # a new folder: no fingerprint yet
  study.train(args, _config(), folder)  # the same code: reused
  value["fingerprint"] = "bbbb"
  study.train(args, _config(), folder)  # other code: run again
  assert reruns == [True, False, True]
  assert json.loads((folder / "fingerprint.json").read_text()) == {
      "fingerprint": "bbbb"
  }


def test_a_parity_row_is_reused_only_with_its_config_and_fingerprint(
    tmp_path, monkeypatch
):
  args = argparse.Namespace(
      quick=True,
      set=[],
      rerun=False,
      report_only=False,
      out=str(tmp_path),
      results=str(tmp_path),
      target_kl=5e-3,
  )
  policy = parity.start_policy(args, "tiny")
  policy.mkdir(parents=True)
  (policy / "model.safetensors").write_bytes(b"weights")
  key = parity.key_of(args, "tiny", "logra", 1e-3, 0, False)
  path = parity.row_path(tmp_path, key)
  path.parent.mkdir(parents=True)
  row = {"config_hash": parity.config_hash(key["config"]), "fingerprint": "a"}
  path.write_text(json.dumps(row))

  def train(*_):
    raise RuntimeError("trained")

  monkeypatch.setattr(study, "train", train)
  ctx = lambda fingerprint: parity.Context(
      args, tmp_path, parity.Evaluator(), {"fingerprint": fingerprint}
  )
  assert parity.run_row(ctx("a"), key) == row
  with pytest.raises(RuntimeError, match="trained"):
    parity.run_row(ctx("b"), key)
  # ... or with a fingerprint the ledger shows to be the same commit's on
  # another host ...
  ledger = [
      {"commit": "c1", "backend": "cpu", "host": "x", "fingerprint": "a"},
      {"commit": "c1", "backend": "cpu", "host": "y", "fingerprint": "b"},
  ]
  monkeypatch.setattr(parity.provenance, "read_ledger", lambda: ledger)
  assert parity.run_row(ctx("b"), key) == row
  path.write_text(json.dumps({**row, "config_hash": "another config's"}))
  with pytest.raises(RuntimeError, match="trained"):
    parity.run_row(ctx("a"), key)
  # ... or of the very package tree at the same versions (another host,
  # another definition of the fingerprint), not at other versions ...
  made = {"fingerprint": "z", "package": "tree", "versions": {"jax": "1"}}
  row.update(package="tree", versions={"jax": "1"})
  path.write_text(json.dumps(row))
  assert parity.run_row(parity.Context(args, tmp_path, None, made), key) == row
  made["versions"] = {"jax": "2"}
  with pytest.raises(RuntimeError, match="trained"):
    parity.run_row(parity.Context(args, tmp_path, None, made), key)
  # ... and a config names its starting policy by its weights, not its path.
  moved = tmp_path / "moved-policy"
  shutil.copytree(policy, moved)
  elsewhere = configs.apply_overrides(key["config"], [f"policy.path={moved}"])
  assert parity.config_hash(elsewhere) == row["config_hash"]
  (moved / "model.safetensors").write_bytes(b"other weights")
  assert parity.config_hash(elsewhere) != row["config_hash"]


def test_tuned_rates_are_those_the_committed_study_chose(tmp_path, monkeypatch):
  """:func:`parity.tuned_rate` reads the committed sweep rows with the
  seeds and grids the study recorded: each arm's rate is the one its final
  rows ran at; an arm without its sweep has none; a row of another config
  exits (status 2)."""
  monkeypatch.setattr(sys, "argv", ["parity.py", f"--out={tmp_path}"])
  args = parity.helper_args(parity.parse_args())
  finals = {
      (r["setting"], r["arm"]): float(r["learning_rate"])
      for r in _rows(study.RESULTS / "parity" / "parity.csv")
      if r["target_kl"] == "nan"
  }
  assert finals
  for (name, arm), rate in finals.items():
    assert parity.tuned_rate(args, name, arm) == rate
  assert parity.tuned_rate(args, "smollm2", "logra") is None
  elsewhere = tmp_path / "results"
  shutil.copytree(study.RESULTS / "parity" / "rows", elsewhere / "rows")
  shutil.copytree(study.RESULTS / "parity" / "policies", elsewhere / "policies")
  (elsewhere / "policies" / "tiny" / "model.safetensors").write_bytes(b"x")
  args.results = str(elsewhere)
  with pytest.raises(SystemExit) as exit_:
    parity.tuned_rate(args, "tiny", "adam")
  assert exit_.value.code == 2


def test_tuned_rates_follow_the_seeds_grids_and_set_the_study_recorded(
    tmp_path, monkeypatch
):
  """A study run with one sweep seed, its own grid and a ``--set``: its
  rows are found and chosen from as it made them."""
  monkeypatch.setattr(
      sys, "argv", ["parity.py", "--quick", f"--out={tmp_path}"]
  )
  args = parity.helper_args(parity.parse_args())
  results = study.results_path(args, "parity")
  grid = [1e-4, 2e-4, 4e-4, 8e-4]
  recorded = {"sweep_seeds": 1, "lr_grid": {"logra": grid}, "set": ["seed=3"]}
  results.mkdir(parents=True)
  (results / "study.json").write_text(json.dumps(recorded))
  policy = parity.start_policy(args, "tiny")
  policy.mkdir(parents=True)
  (policy / "model.safetensors").write_bytes(b"weights")
  args = parity.helper_args(args)
  assert args.set == ["seed=3"]
  for rate, accuracy in zip(grid, [0.1, 0.4, 0.3, 0.2]):
    key = parity.key_of(args, "tiny", "logra", rate, 0, False)
    path = parity.row_path(results, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    row = {
        "config_hash": parity.config_hash(key["config"]),
        "learning_rate": rate,
        "validation_after": accuracy,
    }
    path.write_text(json.dumps(row))
  assert parity.tuned_rate(args, "tiny", "logra") == 2e-4


def test_parity_runs_every_tuned_arm_before_any_kl_matched_run(
    tmp_path, monkeypatch
):
  """Sweeps and final seeds of every arm come first, chosen on validation;
  then the KL-matched runs at the multiplier times each chosen rate, of
  every arm or of --kl-arms."""
  monkeypatch.setattr(sys, "argv", ["parity.py", "--quick"])
  args = parity.parse_args()
  args.arms = ["adam", "logra"]
  order = []

  def run_row(ctx, key):
    order.append((key["arm"], key["kl"], key["rate"]))
    best = key["rate"] == max(
        parity_design.grid(args, key["arm"], parity_design.SETTINGS["tiny"])
    )
    return {"learning_rate": key["rate"], "validation_after": float(best)}

  monkeypatch.setattr(parity, "run_row", run_row)
  _, _, chosen = parity.run_all(parity.Context(args, tmp_path, None, {}))
  kl = [i for i, (_, is_kl, _) in enumerate(order) if is_kl]
  assert kl and min(kl) == len(order) - len(kl)  # all KL-matched runs last
  assert {a for a, is_kl, _ in order if is_kl} == {"adam", "logra"}
  for arm, is_kl, rate in order:
    if is_kl:
      assert rate == pytest.approx(chosen["tiny", arm] * args.kl_lr_multiplier)
  # --kl-arms: KL-matched runs of those arms alone, after the same tuning.
  tuned = [step for step in order if not step[1]]
  order.clear()
  args.kl_arms = ["logra"]
  parity.run_all(parity.Context(args, tmp_path, None, {}))
  assert [step for step in order if not step[1]] == tuned
  assert {a for a, is_kl, _ in order if is_kl} == {"logra"}


@pytest.mark.parametrize(
    "given, recorded",
    [
        (None, None),
        (["lora", "adam"], ["adam", "lora"]),
        (["lora", "logra", "adam"], None),
    ],
)
def test_parity_kl_arms_are_recorded_in_arms_order_or_as_the_default(
    given, recorded, monkeypatch
):
  """One study, one record: --kl-arms in --arms' order, and naming every
  arm the same as leaving it out."""
  argv = ["parity.py", "--quick", "--arms", "adam", "logra", "lora"]
  monkeypatch.setattr(
      sys, "argv", argv + (["--kl-arms", *given] if given else [])
  )
  args = parity.parse_args()
  assert args.kl_arms == recorded
  assert parity_design.kl_arms(args) == (recorded or args.arms)


def test_parity_curves_are_drawn_as_main_arms_levers_and_kl_matched():
  """One panel of the main arms, one of logra with the levers and
  follow-ups, one of the KL-matched arms; a panel with an arm not run is
  left out."""
  args = argparse.Namespace(
      settings=["tiny"],
      arms=["adam", "logra", "logra-rank8", "logra-rank8-refresh10"],
      kl_arms=["adam", "logra"],
  )
  rows = [
      {"setting": "tiny", "arm": arm, "curve": [(0, 0.4), (10, 0.5)]}
      for arm in args.arms + ["adam+kl", "logra+kl"]
  ]
  panels = parity_report.curve_panels(args, rows)
  assert [(title, list(arms)) for title, arms in panels] == [
      ("tiny", ["adam", "logra"]),
      ("tiny: levers", ["logra", "logra-rank8", "logra-rank8-refresh10"]),
      ("tiny+kl", ["adam+kl", "logra+kl"]),
  ]
  without_kl = [r for r in rows if not r["arm"].endswith("+kl")]
  assert [t for t, _ in parity_report.curve_panels(args, without_kl)] == [
      "tiny",
      "tiny: levers",
  ]


def test_hosts_of_one_model_name_are_told_apart(monkeypatch):
  """Two CPUs with the same model name but other model numbers or feature
  flags (whose kernels may differ) are other hosts, and so other
  fingerprint caches; the same CPU is the same host."""
  cpu = {
      "model name": ["Intel(R) Xeon(R) Processor"] * 2,
      "flags": ["fpu avx2 avx512f"] * 2,
      "cpu family": ["6"] * 2,
      "model": ["143"] * 2,
  }
  monkeypatch.setattr(provenance, "_cpuinfo", lambda field: cpu.get(field, []))
  monkeypatch.setattr(provenance.jax, "default_backend", lambda: "cpu")
  first = provenance.host()
  assert first.startswith("Intel(R) Xeon(R) Processor (avx512f; family 6")
  assert provenance.host() == first
  cpu["model"] = ["167"] * 2
  other_model = provenance.host()
  cpu["flags"] = ["fpu avx2 avx512f amx_tile"] * 2
  assert len({first, other_model, provenance.host()}) == 3


def test_only_results_under_experiments_results_are_noted(monkeypatch):
  """A full study writing its reports elsewhere (``--results`` outside
  experiments/results, as the suite's do) leaves the committed ledger
  alone; one writing there notes its fingerprint."""
  noted = []
  monkeypatch.setattr(study, "fingerprint", lambda args: "aaaa")
  monkeypatch.setattr(provenance, "note_fingerprint", noted.append)
  for results in ("/tmp/elsewhere", None, str(study.RESULTS / "parity")):
    args = argparse.Namespace(quick=False, results=results)
    assert study.provenance_record(args)["fingerprint"] == "aaaa"
  assert noted == ["aaaa", "aaaa"]
  study.provenance_record(argparse.Namespace(quick=True, results=None))
  assert noted == ["aaaa", "aaaa"]


def test_the_fingerprint_ledger_notes_clean_commits_once(tmp_path, monkeypatch):
  """A commit's fingerprint on this host is noted once; a tree whose
  package has uncommitted changes notes nothing (its fingerprint names no
  commit), whatever else changed (results)."""
  ledger = tmp_path / "fingerprints.json"
  monkeypatch.setattr(provenance, "commit", lambda: ("c" * 40, True))
  git, changed = provenance._git, {"logra_jax": " M logra_jax/cli.py\n"}
  monkeypatch.setattr(
      provenance,
      "_git",
      lambda *a: changed.get(a[-1], "") if a[0] == "status" else git(*a),
  )
  provenance.note_fingerprint("aaaa", ledger)
  assert provenance.read_ledger(ledger) == []
  changed.clear()  # the package as committed (results changed elsewhere)
  provenance.note_fingerprint("aaaa", ledger)
  provenance.note_fingerprint("aaaa", ledger)
  (entry,) = provenance.read_ledger(ledger)
  assert entry["commit"] == "c" * 40 and entry["fingerprint"] == "aaaa"
  assert entry["host"] == provenance.host()
  assert entry["backend"] == provenance.jax.default_backend()
  provenance.note_fingerprint("bbbb", ledger)
  assert provenance.same_numerics("aaaa", provenance.read_ledger(ledger)) == {
      "aaaa",
      "bbbb",
  }
  ledger.write_text('{"measured": [')  # cut short
  with pytest.raises(provenance.LedgerError, match="not a fingerprint ledger"):
    provenance.read_ledger(ledger)


@pytest.mark.slow
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


@pytest.mark.slow
def test_start_accuracy_quick_writes_well_formed_reports(tmp_path):
  """``start_accuracy --quick``: a tiny random policy on two candidates'
  8 held-out prompts; a row per candidate with its accuracy, score and
  first completions, and the table with its provenance."""
  done = _study("start_accuracy", tmp_path=tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  results = tmp_path / "results"
  written = json.loads((results / "start_accuracy.json").read_text())
  rows = written["rows"]
  assert [r["candidate"] for r in rows] == ["chain_sum-2x1", "letter_counting"]
  for row in rows:
    assert row["held_out"] == 8 and 0 <= row["accuracy"] <= row["score"] <= 1
    assert len(row["examples"]) == 3
    assert all(e["answer"] and e["prompt"] for e in row["examples"])
  table = (results / "start_accuracy.md").read_text()
  assert "| chain_sum-2x1 | 8 |" in table and "Command: `python " in table
  assert written["provenance"]["fingerprint"]


@pytest.mark.slow
def test_gradient_spectrum_quick_writes_well_formed_reports(
    tmp_path, fingerprints
):
  """``gradient_spectrum --quick``: 3 smoke steps; per group, the steps with
  a gradient and kept fractions in [0, 1] (fresh at least random, the most
  a rank-r projector keeps), and the table with its provenance."""
  done = _study("gradient_spectrum", tmp_path=tmp_path, cache=fingerprints)
  assert done.returncode == 0, done.stderr[-3000:]
  results = tmp_path / "results"
  written = json.loads((results / "gradient_spectrum.json").read_text())
  assert len(written["steps"]) == 3 and written["learning_rate"] > 0
  assert set(written["summary"]) <= {"embedding", "attention", "mlp"}
  for values in written["summary"].values():
    assert 1 <= values["steps"] <= 3
    for r in (8, 16, 32):
      assert 0 <= values[f"random@{r}"] <= values[f"fresh@{r}"] <= 1 + 1e-9
  table = (results / "gradient_spectrum.md").read_text()
  assert "| group | rank | steps | fresh | stale, " in table
  assert "Command: `python " in table
  assert written["provenance"]["fingerprint"]


@pytest.mark.slow
def test_sync_compression_quick_writes_well_formed_reports(
    tmp_path, fingerprints
):
  """``sync_compression --quick``: 3 smoke steps of two arms after their
  warm-up; every scheme restored every array bit for bit (the script
  checks), ratios positive and ordered per step, the 7B projection's raw
  bytes those of sync_bytes' model of the arm's config."""
  done = _study(
      "sync_compression",
      "--arms",
      "logra",
      "logra-10mb",
      "--set",
      "optimizer.warmup_steps=2",
      tmp_path=tmp_path,
      cache=fingerprints,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  results = tmp_path / "results"
  written = json.loads((results / "sync_compression.json").read_text())
  assert set(written["arms"]) == {"logra", "logra-10mb"}
  assert "codes" in written["arms"]["logra-10mb"]["summary"]
  assert "codes" not in written["arms"]["logra"]["summary"]
  for arm in written["arms"].values():
    assert arm["messages"] == 3  # the steps after the warm-up's 2
    for kind in arm["summary"].values():
      assert kind["raw_bytes_per_step"] > 0
      assert all(kind[s]["ratio"] > 0 for s in sync_compression.SCHEMES)
    for low, median, high in arm["spread"].values():
      assert 0 < low <= median <= high
  # The 7B projection's raw bytes, a step of logra-10mb (4-bit step codes,
  # embeddings projected, no scales without weight decay) at rank 2 (--quick
  # shrinks its rank 16 8x) and Qwen2.5-7B's shapes, by hand: per layer
  # seven projected matrices of short side 3584 (q, o, gate, up, down) or
  # 512 (k, v), each rank x short / 2 bytes of codes and rank int8 exponents,
  # and float32 dense leaves (the q, k, v biases 3584 + 512 + 512 and two
  # norms); the embedding table and LM head projected (short side 3584); the
  # final norm.
  rank = 2
  layer = rank * (5 * 3584 + 2 * 512) // 2 + 7 * rank + 4 * (4608 + 2 * 3584)
  expected = 28 * layer + 2 * (rank * 3584 // 2 + rank) + 4 * 3584
  for scheme in sync_compression.SCHEMES:
    assert (
        written["arms"]["logra-10mb"]["qwen2.5-7b"][scheme]["raw"] == expected
    )
  table = (results / "sync_compression.md").read_text()
  assert "| arm | kind | raw KB/step |" in table
  assert "Command: `python " in table


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("parity", ["--arms", "logra", "sgd"], "unknown arms ['sgd']"),
        ("parity", ["--settings", "gsm9k"], "unknown settings ['gsm9k']"),
        (
            "parity",
            ["--lr-grid", "adam=1e-3,0"],
            "learning rates must be > 0, got [0.0]",
        ),
        ("parity", ["--lr-grid", "sgd=1e-3"], "unknown arms ['sgd']"),
        ("parity", ["--set", "optimizer.rank=-1"], "optimizer.rank"),
        ("parity", ["--kl-seeds", "-1"], "--kl-seeds must be >= 0"),
        (
            "parity",
            ["--arms", "adam", "logra", "--kl-arms", "lora"],
            "unknown kl-arms (of --arms) ['lora']",
        ),
        (
            "parity",
            ["--kl-arms", "logra", "--kl-seeds", "0"],
            "--kl-arms needs KL-matched runs",
        ),
        (
            "parity",
            ["--settings", "smollm2", "--arms", "logra-rank8-refresh10"],
            "which setting smollm2 sets itself (8)",
        ),
        ("ablations", ["--arms", "rank=7"], "unknown arms ['rank=7']"),
        ("ablations", ["--arms", "rank=8"], "must include 'default'"),
        ("kl_control", ["--arms", "sgd+kl"], "unknown arms ['sgd+kl']"),
        ("kl_control", ["--tasks", "gsm9k"], "unknown tasks ['gsm9k']"),
        ("kl_control", ["--set", "steps=0"], "steps"),
        ("ablations", ["--seeds", "0"], "--seeds must be >= 1"),
        ("kl_control", ["--target-kl", "inf"], "--target-kl must be a finite"),
        ("parity", ["--target-kl", "nan"], "--target-kl must be a finite"),
        (
            "start_accuracy",
            ["--candidates", "gsm9k"],
            "unknown candidates ['gsm9k']",
        ),
        ("start_accuracy", ["--eval-size", "0"], "--eval-size must be >= 1"),
        (
            "start_accuracy",
            ["--policy", "/nowhere"],
            "neither smollm2 nor a folder",
        ),
        ("sync_compression", ["--arms", "adam"], "unknown arms ['adam']"),
        ("sync_compression", ["--steps", "1"], "--steps must be >= 2"),
        (
            "sync_compression",
            ["--learning-rate", "inf"],
            "--learning-rate must be a finite number > 0",
        ),
        (
            "sync_compression",
            ["--set", "optimizer.rank=0"],
            "optimizer.rank must be",
        ),
        ("gradient_spectrum", ["--setting", "gsm9k"], "unknown setting"),
        ("gradient_spectrum", ["--steps", "0"], "--steps must be >= 1"),
        ("gradient_spectrum", ["--ranks", "8", "0"], "--ranks must all be"),
        (
            "gradient_spectrum",
            ["--learning-rate", "nan"],
            "--learning-rate must be a finite number > 0",
        ),
    ],
)
def test_bad_input_is_refused_before_running(name, args, message, tmp_path):
  done = _study(name, *args, tmp_path=tmp_path)
  assert done.returncode == 2, done.stderr[-2000:]
  assert message in done.stderr and len(done.stderr.splitlines()) == 1
  assert not list(tmp_path.iterdir())  # nothing run, nothing written


def test_results_of_other_settings_are_not_overwritten(tmp_path):
  results = tmp_path / "results"
  results.mkdir()
  (results / "study.json").write_text('{"arms": ["logra"], "quick": true}\n')
  (results / "parity.md").write_text("earlier\n")
  done = _study(
      "parity",
      "--arms",
      "logra",
      "adam",
      "--settings",
      "tiny",
      tmp_path=tmp_path,
  )
  assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
  assert "holds the results of other settings (" in done.stderr
  assert "--overwrite" in done.stderr
  assert (results / "parity.md").read_text() == "earlier\n"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


def test_a_study_option_is_part_of_its_results_settings(tmp_path):
  """kl_control's own options (here --target-kl) claim the results folder
  too."""
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
  assert done.returncode == 2
  assert "(target_kl differ: there [0.005], now [0.01])" in done.stderr
  assert not (tmp_path / "runs").exists()


def test_a_second_study_on_one_out_is_refused(tmp_path):
  """A study holds its --out's lock: a second one there deletes nothing."""
  runs = tmp_path / "runs"
  live = runs / "quick" / "tiny" / "logra+kl-seed0"
  (live / "checkpoints" / "2").mkdir(parents=True)
  (live / "samples.jsonl").write_text("{}\n")
  lock = folders.run_lock(runs)
  with lock:
    done = _study(
        "kl_control", "--arms", "logra+kl", "--tasks", "tiny", tmp_path=tmp_path
    )
  assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
  assert "is in use by another study" in done.stderr, done.stderr
  assert sorted(p.name for p in live.iterdir()) == [
      "checkpoints",
      "samples.jsonl",
  ]
  assert not (tmp_path / "results").exists()


def _claiming_args(tmp_path, monkeypatch):
  """A study's flags, with this test's own claims and a fixed fingerprint."""
  monkeypatch.setattr(study, "_CLAIMS", study._Claims())
  monkeypatch.setattr(study.provenance, "fingerprint", lambda cache: "aaaa")
  return argparse.Namespace(
      quick=True,
      seeds=1,
      set=[],
      out=str(tmp_path / "runs"),
      results=str(tmp_path / "results"),
      overwrite=False,
      rerun=False,
      fingerprint_cache="unused",
  )


def test_a_live_run_folder_is_left_alone(tmp_path, monkeypatch, capsys):
  args = _claiming_args(tmp_path, monkeypatch)
  folder = tmp_path / "run"
  with guards.locked_run_folder(folder):
    (folder / "samples.jsonl").write_text("{}\n")
    (folder / "tensorboard").mkdir()
    with pytest.raises(SystemExit) as stopped:
      study.train(args, _config(), folder)
    names = sorted(p.name for p in folder.iterdir())
  assert stopped.value.code == 2
  assert names == [".lock", "samples.jsonl", "tensorboard"]
  error = capsys.readouterr().err
  assert error.count("\n") == 1 and "is in use by a run" in error, error


def test_bad_input_found_by_the_trainer_gives_the_folder_back(
    tmp_path, monkeypatch, capsys
):
  """The trainer's one-line refusal, exit 2, and the results folder as it
  was: absent, or holding its earlier settings."""
  args = _claiming_args(tmp_path, monkeypatch)
  bad = configs.apply_overrides(_config(), ["policy.path=/nonexistent"])
  study.results_folder(args, "study")
  with pytest.raises(SystemExit) as stopped:
    study.train(args, bad, tmp_path / "runs" / "run")
  assert stopped.value.code == 2
  error = capsys.readouterr().err
  assert error.count("\n") == 1 and "/nonexistent does not exist" in error
  assert not (tmp_path / "results").exists()
  results = tmp_path / "results"
  results.mkdir()
  (results / "study.json").write_text('{"seeds": 3}\n')
  args = _claiming_args(tmp_path, monkeypatch)
  args.overwrite = True
  study.results_folder(args, "study")
  with pytest.raises(SystemExit):
    study.train(args, bad, tmp_path / "runs" / "run")
  assert (results / "study.json").read_text() == '{"seeds": 3}\n'


@pytest.mark.slow
def test_quick_gpu_bench_writes_its_tables(tmp_path):
  """The accelerator benchmark's programs at tiny shapes, on this machine:
  every figure finite (MFU, peak memory and the bandwidth bound need a
  known accelerator, so they may be absent here)."""
  done = _quick_report("gpu_bench", tmp_path)
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


@pytest.mark.slow
def test_quick_gpu_system_measures_every_part(tmp_path):
  """The whole-system script at tiny shapes with 4-bit steps (the command an
  accelerator runs next: ``--rank 32 --step-bits 4``), on this machine: the
  learner's state is the sum of its arrays, the receiver follows the learner
  bit for bit through a refresh, step messages are smaller than the full
  one, the log-prob gaps are finite, and ``--report`` renders the record
  again; a rank below 1 is refused."""
  script = str(EXPERIMENTS / "gpu_system.py")
  run = lambda *args: subprocess.run(
      [sys.executable, script, *args],
      capture_output=True,
      text=True,
      timeout=1200,
  )
  bad = run("--quick", "--rank", "0", f"--results={tmp_path / 'bad'}")
  assert bad.returncode == 2 and "--rank must be >= 1" in bad.stderr
  done = run("--quick", "--step-bits", "4", f"--results={tmp_path}")
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads((tmp_path / "gpu_system.json").read_text())
  assert "--quick" in record["provenance"]["command"]
  assert record["setting"]["step_bits"] == 4
  assert record["resident_bytes"] > 0
  assert record["memory"]["planned_gib"] > record["memory"]["resident_gib"]
  assert record["receiver_equal"] is True
  full, *steps = record["messages"]
  assert full["full"] and not any(m["full"] for m in steps)
  assert any(m["merge"] for m in steps), "no refresh was sent"
  assert all(m["bytes"] < full["bytes"] for m in steps)
  for dtype in ("bfloat16", "float32", "bfloat16_batch_invariant"):
    gaps = record["logprobs"][dtype]
    assert gaps["tokens"] == 4 * 48
    assert 0 <= gaps["mean_gap"] <= gaps["max_gap"] < math.inf
  assert set(record["logprobs"]["float32_loss"]) == {"none", "tis", "mis"}
  table = (tmp_path / "gpu_system.md").read_text()
  assert "4-bit steps" in table and "--step-bits 4" in table
  (tmp_path / "gpu_system.md").unlink()
  assert run("--report", str(tmp_path)).returncode == 0
  assert (tmp_path / "gpu_system.md").read_text() == table


def test_system_memory_plans_the_issue_command_and_skips_dominated_points():
  """Question (a)'s first row is planned with the 7B command word for word
  (one device, 64 x 1024 colocated rollout), its second with KL control
  added, and every 27B grid point is
  either planned or skipped with its own command."""
  system_memory = importlib.import_module("system_memory")
  assert system_memory.command(*system_memory.QUESTION_A[0]) == (
      "logra memory --model qwen2.5-7b --mesh fsdp=1 --seq 2048 "
      "--micro-batch 1 --optimizer logra --rank 32 --project-embeddings "
      "--base-dtype bfloat16 --rollout-seqs 64 --rollout-tokens 1024 "
      "--device-memory-gib 24.0"
  )
  kl_controlled = system_memory.command(*system_memory.QUESTION_A[1])
  assert kl_controlled == (
      system_memory.command(*system_memory.QUESTION_A[0]) + " --target-kl 0.01"
  )
  skipped = {
      "question": "b",
      "seq": 4096,
      "micro_batch": 4,
      "skipped": "a point with no larger seq and micro-batch did not fit",
      "command": "logra memory --model qwen3-style-27b --seq 4096",
  }
  table = system_memory.markdown([skipped])
  assert (
      "| b | qwen3-style-27b | 131.32 | 32 | 4096 | 4 | 64x1024 | - |" in table
  )
  header, row = table.splitlines()[2], table.splitlines()[-1]
  assert row.endswith("`" + skipped["command"] + "` |")
  assert row.count("|") == header.count("|")


def test_sync_bytes_bfloat16_coordinates_halve_only_the_coordinates():
  """At Qwen2.5-0.5B shapes (abstract: nothing is allocated), the rows of
  bfloat16 coordinates carry A in 2 bytes a value and every other kind of
  array as before; the default row is the default configuration's."""
  f32 = sync_bytes.message_bytes("qwen2.5-0.5b", 8, "projected")
  bf16 = sync_bytes.message_bytes(
      "qwen2.5-0.5b", 8, "projected", "logra", "bfloat16"
  )
  assert f32["coords"] > 0 and bf16["coords"] * 2 == f32["coords"]
  assert {k: v for k, v in bf16.items() if k != "coords"} == {
      k: v for k, v in f32.items() if k != "coords"
  }
  rows = sync_bytes.model_rows("qwen2.5-0.5b", [8, 32], 50)
  assert [r["embeddings"] for r in rows].count("projected, bfloat16 A") == 2
  assert [r["rank"] for r in rows if r["default"]] == [32]
  # Random projectors: the same step, no projectors at a refresh.
  by = lambda label: {r["rank"]: r for r in rows if r["embeddings"] == label}
  ranged = by("projected, bfloat16 A")
  regenerated = by("projected, bfloat16 A, random P")
  for rank in (8, 32):
    assert ranged[rank]["projector_bytes"] > 0
    assert regenerated[rank]["projector_bytes"] == 0
    assert regenerated[rank]["step_bytes"] == ranged[rank]["step_bytes"]
    assert regenerated[rank]["mean_bytes"] == ranged[rank]["step_bytes"]


def test_sync_bytes_four_bit_steps_send_half_a_byte_a_coordinate():
  """4-bit steps: two codes a byte (every short side of Qwen2.5-0.5B is
  even) and one int8 exponent a row of each coordinates array in place of
  4 bytes a coordinate; every other kind of array as before."""
  f32 = sync_bytes.message_bytes("qwen2.5-0.5b", 8, "projected")
  four = sync_bytes.message_bytes(
      "qwen2.5-0.5b", 8, "projected", "logra", "float32", "range", 4
  )
  state, _, _, _ = sync_bytes.model_policy_state("qwen2.5-0.5b", 8, "projected")
  rows = sum(
      x.shape[0] * x.shape[1]
      for kind, x in sync.named_arrays(state).values()
      if kind == sync.COORDS
  )
  assert four["coords"] == f32["coords"] // 8 + rows
  assert {k: v for k, v in four.items() if k != "coords"} == {
      k: v for k, v in f32.items() if k != "coords"
  }


def test_sync_bytes_frozen_embeddings_leave_the_step_message():
  """Frozen embeddings: the embedding table and LM head of Qwen2.5-0.5B
  (tied: one ``[V, D]`` table, float32) are counted as frozen, in no
  step's message; the dense rows' step carries them every step."""
  dense = sync_bytes.message_bytes("qwen2.5-0.5b", 8, "dense")
  frozen = sync_bytes.message_bytes("qwen2.5-0.5b", 8, "frozen")
  config = memory.load_model_config("qwen2.5-0.5b")
  table = config.vocab_size * config.hidden_size * 4
  assert frozen[sync.FROZEN] == table
  assert dense[sync.DENSE] == frozen[sync.DENSE] + table
  assert dense[sync.FROZEN] == 0
  rows = sync_bytes.model_rows("qwen2.5-0.5b", [8], 50)
  ranged, regenerated = [r for r in rows if r["embeddings"].startswith("fro")]
  assert ranged["embeddings"] == "frozen, 4-bit steps"
  assert regenerated["embeddings"] == "frozen, 4-bit steps, random P"
  assert ranged["step_bytes"] == regenerated["step_bytes"]
  assert ranged["projector_bytes"] > 0
  assert regenerated["projector_bytes"] == 0
  assert not ranged["default"] and not regenerated["default"]


@pytest.mark.slow
def test_quick_logprob_agreement_writes_its_table(tmp_path, fingerprints):
  """The sampler-vs-forward log-prob study at one tiny row: fractions in
  [0, 1], gaps finite and ordered, the provenance recorded; an unknown
  shape is a one-line error with exit status 2, nothing written."""
  script = str(EXPERIMENTS / "logprob_agreement.py")
  run = lambda *args: subprocess.run(
      [sys.executable, script, *args, f"--fingerprint-cache={fingerprints}"],
      capture_output=True,
      text=True,
      timeout=1200,
  )
  bad = run("--shapes", "huge", f"--results={tmp_path / 'bad'}")
  assert bad.returncode == 2 and "unknown shape 'huge'" in bad.stderr
  assert not (tmp_path / "bad").exists()
  done = run("--quick", f"--results={tmp_path}")
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads((tmp_path / "logprob_agreement.json").read_text())
  (row,) = record["rows"]
  assert (row["shape"], row["dtype"], row["rows"]) == ("tiny", "float32", 8)
  assert row["tokens"] == 8 * 4
  for key in ("bitwise", "forward_batch_invariant", "sampler_batch_invariant"):
    assert 0 <= row[key] <= 1, key
  assert 0 <= row["mean_gap"] <= row["max_gap"] < math.inf
  assert "--quick" in record["provenance"]["command"]
  table = (tmp_path / "logprob_agreement.md").read_text()
  assert "| tiny | float32 | 8 | 32 |" in table and "Command:" in table


@pytest.mark.slow
def test_batch_invariant_sampler_log_probs_are_the_forwards_bit_for_bit(
    tmp_path, fingerprints
):
  """With `DecoderConfig.batch_invariant` under its XLA flags, the sampler's
  token log-probs (decoding over a KV cache) equal the learner's forward
  pass bitwise, in float32 and bfloat16, at D = 256 (whose 1024-long
  down_proj reduction XLA:CPU splits by the row count; D = 64 runs end to
  end in tests/rl/test_trainer.py), with grouped and with multi-head
  attention (a decoded token's one query row per kv head), and the
  first 8 rows give the same bits alone as inside the batch. At XLA's
  default optimization level, as users run it (the suite compiles at level
  0, whose sampler for 8 rows is not the one for 16), from no XLA_FLAGS:
  the study sets the ones it needs."""
  done = subprocess.run(
      [
          sys.executable,
          str(EXPERIMENTS / "logprob_agreement.py"),
          "--batch-invariant",
          "--shapes",
          "mid",
          "mid-mha",
          "--rows",
          "16",
          f"--results={tmp_path}",
          f"--fingerprint-cache={fingerprints}",
      ],
      capture_output=True,
      text=True,
      timeout=1200,
      env=dict(os.environ, XLA_FLAGS=""),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads(
      (tmp_path / "logprob_agreement-batch-invariant.json").read_text()
  )
  assert len(record["rows"]) == 4
  for row in record["rows"]:
    where = (row["shape"], row["dtype"])
    assert row["tokens"] == 16 * 24, where
    assert row["bitwise"] == 1.0 and row["max_gap"] == 0.0, where
    assert row["forward_batch_invariant"] == 1.0, where
    assert row["sampler_batch_invariant"] == 1.0, where


@pytest.mark.slow
def test_quick_batch_invariance_cost_times_both_numerics(
    tmp_path, fingerprints
):
  """The cost study on the smoke preset: one run per numerics, times
  positive, and every batch-invariant step's rollout log-probs the
  learner's (the smoke preset merges a window every 2 steps)."""
  done = subprocess.run(
      [
          sys.executable,
          str(EXPERIMENTS / "batch_invariance_cost.py"),
          "--quick",
          f"--results={tmp_path}",
          f"--fingerprint-cache={fingerprints}",
      ],
      capture_output=True,
      text=True,
      timeout=1200,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads((tmp_path / "batch_invariance_cost.json").read_text())
  rows = {r["mode"]: r for r in record["rows"]}
  assert set(rows) == {"default", "default, XNNPACK off", "batch-invariant"}
  for row in rows.values():
    assert row["steps"] == 3
    assert all(row[key] > 0 for key in ("time/step_s", "time/train_s"))
  assert rows["batch-invariant"]["bitwise_steps"] == 1.0
  assert rows["batch-invariant"]["max_gap"] == 0.0
  assert (
      "| batch-invariant | 1 |"
      in (tmp_path / "batch_invariance_cost.md").read_text()
  )


@pytest.mark.slow
def test_quick_kernel_invariance_measures_both_xla_settings(tmp_path):
  """The kernel row-invariance study at the tiny width: every operation
  under both XLA settings, with the flags and the provenance recorded. The
  pairwise tree sum is the same elementwise additions in the same order
  whatever the number of rows, so it comes out row-invariant under either
  setting."""
  done = _quick_report("kernel_invariance", tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads((tmp_path / "kernel_invariance.json").read_text())
  rows = record["rows"]
  assert {r["setting"] for r in rows} == {"default", "no-xnnpack"}
  assert {r["width"] for r in rows} == {"tiny"}
  # 6 matmuls, a rank-4 factor as is and padded, 2 RMSNorms, the softmax
  # and 3 ways of decoding attention scores, under each setting.
  assert len(rows) == 2 * 14 and set(record["xla_flags"]) == {
      "default",
      "no-xnnpack",
  }
  ops = {r["op"] for r in rows}
  assert sum("rank-4 factor" in op for op in ops) == 2
  assert sum("attention scores" in op for op in ops) == 3
  (tree,) = {r["op"] for r in rows if "tree sum" in r["op"]}
  for row in rows:
    if row["op"] == tree:
      assert row["part"] == row["one"] == 1.0, row
  assert "--quick" in record["provenance"]["command"]
  table = (tmp_path / "kernel_invariance.md").read_text()
  assert "| tiny | RMSNorm mean of squares (tree sum), D = 64 |" in table


def test_parity_prepare_keeps_a_starting_policy_or_copies_the_committed_one(
    tmp_path, monkeypatch
):
  """A setting whose starting policy is in place is left alone (nothing is
  trained); a missing one is copied from the committed policy, with a
  ``made.json`` saying so, never half written."""
  args = argparse.Namespace(quick=False, results=str(tmp_path / "results"))
  folder = parity.start_policy(args, "tiny")
  committed = study.RESULTS / "parity" / "policies" / "tiny"
  prepare = lambda: parity.prepare(args, ["tiny"], {})
  prepare()
  weights = (folder / "model.safetensors").read_bytes()
  assert weights == (committed / "model.safetensors").read_bytes()
  assert json.loads((folder / "made.json").read_text()) == {
      "copied_from": str(committed)
  }
  assert sorted(p.name for p in folder.parent.iterdir()) == ["tiny"]

  def starting_policy(*_):
    raise AssertionError("a policy in place was made again")

  monkeypatch.setattr(parity, "_starting_policy", starting_policy)
  (folder / "model.safetensors").write_bytes(b"kept")
  prepare()
  assert (folder / "model.safetensors").read_bytes() == b"kept"


def test_a_tree_is_dirty_by_its_code_not_by_its_results(tmp_path, monkeypatch):
  """What studies write under experiments/results/ (rows, the fingerprint
  ledger) does not make the tree dirty; a change to code does."""
  git = lambda *args: subprocess.run(
      ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
      cwd=tmp_path,
      check=True,
      capture_output=True,
  )
  results = tmp_path / "experiments" / "results"
  policy = results / "parity" / "policies" / "tiny"
  policy.mkdir(parents=True)
  (results / "fingerprints.json").write_text("{}\n")
  (policy / "config.json").write_text("{}\n")
  (tmp_path / "code.py").write_text("x = 1\n")
  git("init", "-q")
  git("add", ".")
  git("commit", "-qm", "start")
  monkeypatch.setattr(provenance, "ROOT", tmp_path)
  assert provenance.commit()[1] is False
  (results / "fingerprints.json").write_text('{"measured": []}\n')
  assert provenance.commit()[1] is False
  # A starting policy kept with the results is an input of the runs.
  (policy / "config.json").write_text('{"changed": 1}\n')
  assert provenance.commit()[1] is True
  git("checkout", "--", str(policy / "config.json"))
  (tmp_path / "code.py").write_text("x = 2\n")
  assert provenance.commit()[1] is True
  # Where git cannot tell, the tree is not called clean.
  monkeypatch.setattr(provenance, "ROOT", tmp_path / "experiments" / "nogit")
  (tmp_path / "experiments" / "nogit").mkdir()
  monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path / "experiments"))
  assert provenance.commit() == ("unknown", True)
