"""`logra train --mesh M` on the default task, for every kind of mesh, on 8
CPU devices; on ``fsdp=8`` it equals the unsharded run and the memory
planner lays out the same mesh. On ``dp=8`` the rollout engine runs in its
own process, one batch ahead of the learner."""

import json
import math
import pathlib

import pytest

from logra_jax import memory
from logra_jax import parallel
from logra_jax.cli import main as cli_main


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh", ["dp=8", "fsdp=8", "fsdp=4,tp=2", "dp=2,fsdp=2,tp=2"]
)
def test_logra_train_runs_on_every_mesh(mesh, tmp_path):
  out = tmp_path / "run"
  argv = ["train", "--preset=smoke", f"--mesh={mesh}", "--no-progress"]
  argv += [f"--out={out}", "steps=2", "task.eval_size=8"]
  if mesh == "dp=8":
    argv += ["rollout.engine=process", "rollout.max_staleness=1"]
  assert cli_main(argv) == 0
  rows = [
      json.loads(line)
      for line in (out / "metrics.jsonl").read_text().splitlines()
  ]
  assert [row["step"] for row in rows] == [1, 2]
  assert all(math.isfinite(row["loss"]) for row in rows)
  # Every sync message arrived whole (its checksums matched the sharded
  # learner's arrays), none was replaced by a full one.
  assert all(row["sync/resyncs"] == 0 for row in rows)
  if mesh == "dp=8":
    assert [row["rollout/version_lag"] for row in rows] == [0.0, 1.0]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["checkpoint_steps"] == [2]
  if mesh != "fsdp=8":
    return
  # The same run on one device: the same samples (the sampler's logits
  # split the vocabulary, not a reduction), losses up to summation order.
  one = tmp_path / "one"
  argv = ["train", "--preset=smoke", "--no-progress", f"--out={one}"]
  assert cli_main(argv + ["steps=2", "task.eval_size=8"]) == 0
  for row, reference in zip(
      rows, map(json.loads, (one / "metrics.jsonl").read_text().splitlines())
  ):
    assert row["reward/total"] == reference["reward/total"]
    assert row["loss"] == pytest.approx(reference["loss"], rel=1e-4, abs=1e-6)
  # The planner compiles the same step on the same layout (it once planned
  # this one, which the run then failed to lay out: the vocabulary of 100
  # does not divide 8).
  config = pathlib.Path(summary["policy_folder"]) / "config.json"
  report = memory.plan_memory(
      str(config), mesh=parallel.MeshConfig.parse(mesh), rank=4, seq_len=16
  )
  assert report.total > 0
