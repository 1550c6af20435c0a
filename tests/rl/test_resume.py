"""Resuming a run: exact resume, crashes during saves, signals, refused
config, model or mesh changes, damaged newest checkpoints."""

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import checkpoint
from logra_jax import configs
from logra_jax import models
from logra_jax import parallel
from logra_jax import policy_state
from logra_jax.cli import main as cli_main
from logra_jax.optim import factored
from logra_jax.optim import step_codes
from logra_jax.rl import trainer
from logra_jax.rollout import engine
from run_fixtures import assert_same_state
from run_fixtures import copy_run
from run_fixtures import final_state
from run_fixtures import largest_file
from run_fixtures import make_policy
from run_fixtures import run_metrics
from run_fixtures import run_overrides
from run_fixtures import set_aside

SMOKE = configs.get_preset("smoke")
WORKER = pathlib.Path(__file__).parents[1] / "checkpoint_worker.py"
QUIET = lambda s: None


@pytest.fixture(scope="module")
def resumed(config, tmp_path_factory):
  """3 steps; then the same run resumed up to 6 steps."""
  out = tmp_path_factory.mktemp("resumed")
  first = trainer.train(
      dataclasses.replace(config, steps=3), out, progress=False, log=QUIET
  )
  second = trainer.train(config, out, progress=False, log=QUIET, resume=True)
  return out, first, second


def test_resumed_run_equals_the_uninterrupted_run(config, straight, resumed):
  run, first, second = resumed
  assert first["checkpoint_steps"] == [2, 3]
  assert second["resumed_from_step"] == 3 and second["steps"] == 6
  a, b = final_state(straight, config), final_state(run, config)
  assert a.step == b.step == 6
  assert_same_state(a, b)  # bit for bit
  assert run_metrics(run) == run_metrics(straight)
  assert [h["step"] for h in b.loop.history] == [1, 2, 3, 4, 5, 6]
  # The logged metrics move: this is not a run of no-ops.
  assert len({m["loss"] for m in run_metrics(run)}) > 1


def _worker(args, *worker_flags):
  env = dict(
      os.environ,
      JAX_DEFAULT_MATMUL_PRECISION="highest",
  )
  return subprocess.Popen(
      [sys.executable, str(WORKER), *worker_flags, "--", *args],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=env,
  )


def test_sigkill_during_a_save_then_sigterm_then_resume(
    config, policy_folder, straight, tmp_path
):
  out = tmp_path / "run"
  sets = [f"--set={s}" for s in run_overrides(policy_folder, every=1)]
  args = ["train", "--preset=smoke", f"--out={out}", "--no-progress", *sets]
  # 1. Killed while checkpoint 2 is being finalized (all its files written).
  proc = _worker(args, "--block-save", "2")
  try:
    for line in proc.stdout:
      if "BLOCKED IN SAVE 2" in line:
        break
    else:
      pytest.fail(f"the worker ended without saving: rc {proc.wait()}")
    proc.send_signal(signal.SIGKILL)
  finally:
    proc.kill()
    proc.wait()
  assert proc.returncode == -signal.SIGKILL
  with checkpoint.Checkpointer(out / "checkpoints", read_only=True) as ckpt:
    assert ckpt.all_steps() == [1]  # the half-saved step 2 is not listed
    assert [p.name.split(".")[0] for p in ckpt.unfinished()] == ["2"]
  # 2. Resumed from step 1 in a new process, stopped by SIGTERM mid-run.
  proc = _worker(["train", "--resume", *args[1:]], "--step-delay", "0.5")
  try:
    lines = []
    for line in proc.stdout:  # the rollouts of steps 2 and 3 have begun
      lines.append(line)
      if sum(x.startswith("ROLLOUT") for x in lines) == 2:
        break
    proc.send_signal(signal.SIGTERM)
    output = "".join(lines) + proc.communicate(timeout=120)[0]
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, output
  summary = json.loads((out / "summary.json").read_text())
  assert summary["interrupted"] and summary["resumed_from_step"] == 1
  stopped_at = summary["steps"]
  assert stopped_at == 3, summary  # step 3 finished, then the run stopped
  assert "resuming from step 1" in output and "SIGTERM" in output
  with checkpoint.Checkpointer(out / "checkpoints", read_only=True) as ckpt:
    assert ckpt.latest_step() == stopped_at and not ckpt.unfinished()
  # 3. Resumed again here, to the end: the same as the run never stopped.
  resumed = configs.apply_overrides(
      SMOKE, run_overrides(policy_folder, every=1)
  )
  trainer.train(resumed, out, progress=False, log=QUIET, resume=True)
  assert_same_state(final_state(out, config), final_state(straight, config))
  assert run_metrics(out) == run_metrics(straight)


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.rank=2", "optimizer.rank is 4 in the checkpoint but 2 now"),
        ("optimizer.learning_rate=0.1", "optimizer.learning_rate is 0.0003"),
        ("seed=1", "seed is 0 in the checkpoint but 1 now"),
        ("steps=4", "is at step 6, beyond steps=4"),
        (
            "optimizer.base_dtype=bfloat16",
            "optimizer.base_dtype is 'float32' in the checkpoint but 'bfloat16'",
        ),
    ],
)
def test_resume_with_a_refused_config_change(
    config, straight, tmp_path, override, message
):
  run = copy_run(straight, tmp_path)
  changed = configs.apply_overrides(config, [override])
  with pytest.raises(checkpoint.CheckpointError, match=message):
    trainer.train(changed, run, progress=False, log=QUIET, resume=True)
  # Nothing was written: the original config still describes the run.
  assert configs.load_config("tiny", [run / "config.yaml"]) == config


def test_a_refused_config_change_is_refused_before_the_policy_loads(
    config, straight, tmp_path, monkeypatch
):
  """From the checkpoint's config alone: no policy is loaded (or
  warm-started) and nothing compiles before the refusal."""

  def load(*args, **kwargs):
    raise AssertionError("the policy was loaded")

  monkeypatch.setattr(engine.Policy, "load", load)
  run = copy_run(straight, tmp_path)
  before = sorted(p.relative_to(run) for p in run.rglob("*"))
  changed = configs.apply_overrides(config, ["optimizer.rank=2"])
  with pytest.raises(
      checkpoint.CheckpointError,
      match="optimizer.rank is 4 in the checkpoint but 2 now",
  ):
    trainer.train(changed, run, progress=False, log=QUIET, resume=True)
  assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_resume_with_another_model_or_mesh(config, straight, tmp_path):
  run = copy_run(straight, tmp_path)
  other = make_policy(tmp_path / "wide", hidden_size=32, head_dim=8)
  changed = dataclasses.replace(
      config, policy=dataclasses.replace(config.policy, path=str(other))
  )  # a moved policy is fine, not another
  with pytest.raises(
      checkpoint.CheckpointError,
      match="another model: head_dim is 16 in the checkpoint "
      "but 8 in this run; hidden_size is 64 in the "
      "checkpoint but 32 in this run",
  ):
    trainer.train(changed, run, progress=False, log=QUIET, resume=True)
  with pytest.raises(
      checkpoint.CheckpointError,
      match=r"mesh none \(one device\) but this run has "
      r"dp=1,fsdp=4,tp=2.*--allow-reshard",
  ):
    trainer.train(
        config,
        run,
        progress=False,
        log=QUIET,
        resume=True,
        mesh=parallel.MeshConfig(fsdp=4, tp=2),
    )


def test_no_resume_into_a_folder_with_checkpoints_and_nothing_to_resume(
    config, straight, tmp_path
):
  with pytest.raises(
      checkpoint.CheckpointError, match="holds checkpoints of an earlier run"
  ):
    trainer.train(
        config, copy_run(straight, tmp_path), progress=False, log=QUIET
    )
  with pytest.raises(checkpoint.CheckpointError, match="nothing to resume"):
    trainer.train(
        config, tmp_path / "new", progress=False, log=QUIET, resume=True
    )
  assert cli_main(["train", "--resume", "--preset=smoke"]) == 2


@pytest.mark.parametrize("how", ["killed", "stopped by a signal"])
def test_train_or_reuse_resumes_an_unfinished_run(
    config, straight, tmp_path, how
):
  """A run killed after step 4 left no summary; one stopped by SIGTERM
  left a summary naming the signal: neither is reused as finished."""
  run = copy_run(straight, tmp_path)
  summary_file = run / "summary.json"
  if how == "killed":
    summary_file.unlink()
  else:
    stopped = json.loads(summary_file.read_text())
    stopped.update(steps=4, stopped_by="SIGTERM", interrupted=True)
    summary_file.write_text(json.dumps(stopped))
  shutil.rmtree(run / "checkpoints" / "6")
  summary = trainer.train_or_reuse(config, run)
  assert summary["resumed_from_step"] == 4 and summary["steps"] == 6
  assert_same_state(final_state(run, config), final_state(straight, config))
  assert trainer.train_or_reuse(config, run) == summary  # finished: reused


def _resumed_from_step_2(config, straight_run, tmp_path, steps):
  """A copy of ``straight_run`` (``steps`` steps) without its last
  checkpoint, resumed: it equals the uninterrupted run, state and metrics.
  Returns the resumed run's folder."""
  run = copy_run(straight_run, tmp_path)
  shutil.rmtree(run / "checkpoints" / str(steps))
  (run / "summary.json").unlink()
  summary = trainer.train(config, run, progress=False, log=QUIET, resume=True)
  assert summary["resumed_from_step"] == 2 and summary["steps"] == steps
  assert_same_state(final_state(run, config), final_state(straight_run, config))
  assert run_metrics(run) == run_metrics(straight_run)
  return run


def test_galore_state_with_empty_arrays_saves_and_resumes_bit_exactly(
    config, tmp_path
):
  galore = configs.apply_overrides(config, ["optimizer.name=galore", "steps=3"])
  straight_run = tmp_path / "straight"
  trainer.train(galore, straight_run, progress=False, log=QUIET)
  final = final_state(straight_run, galore)
  # optax's GaLore holds a (0, 0) projector for every leaf it leaves dense.
  empty = [x for x in jax.tree.leaves(final.opt_state) if x.size == 0]
  assert empty and {(x.shape, x.dtype) for x in empty} == {
      ((0, 0), np.dtype("float32"))
  }
  _resumed_from_step_2(galore, straight_run, tmp_path, steps=3)


def test_bfloat16_base_merges_stochastically_and_resumes_bit_exactly(
    config, tmp_path
):
  """A factored run with a bfloat16 base and bfloat16 coordinates, a merge
  every other step (stochastic rounding of both included), resumes bit for
  bit, and exports its merged weights."""
  bf16 = configs.apply_overrides(
      config,
      [
          "optimizer.base_dtype=bfloat16",
          "optimizer.coords_dtype=bfloat16",
          "optimizer.refresh_every=2",
          "steps=4",
      ],
  )
  straight_run = tmp_path / "straight"
  trainer.train(bf16, straight_run, progress=False, log=QUIET)
  final = final_state(straight_run, bf16)
  factored_leaves = [
      w
      for w in jax.tree.leaves(final.params, is_leaf=factored.is_factored)
      if factored.is_factored(w)
  ]
  assert factored_leaves and {
      (w.base.dtype, w.coords.dtype) for w in factored_leaves
  } == {(jnp.dtype(jnp.bfloat16),) * 2}
  run = _resumed_from_step_2(bf16, straight_run, tmp_path, steps=4)  # merged
  out = tmp_path / "hf"
  assert cli_main(["export", f"--checkpoint={run}", f"--out={out}"]) == 0
  exported = models.split_model(models.load_pretrained(out))[1]
  for x, y in zip(
      jax.tree.leaves(exported),
      jax.tree.leaves(
          policy_state.dense_weights(final.params, final.opt_state)
      ),
      strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_quantized_steps_resume_bit_exactly(config, tmp_path):
  """4-bit steps with error feedback (the residual and last codes in the
  optimizer state), a refresh dropping the residual at step 3: the resumed
  run equals the uninterrupted one."""
  coded = configs.apply_overrides(
      config, ["optimizer.step_bits=4", "optimizer.refresh_every=3", "steps=4"]
  )
  straight_run = tmp_path / "straight"
  trainer.train(coded, straight_run, progress=False, log=QUIET)
  final = final_state(straight_run, coded)
  residuals = step_codes.quantize_state(final.opt_state).residual
  assert any(r is not None and np.any(np.asarray(r)) for r in residuals)
  _resumed_from_step_2(coded, straight_run, tmp_path, steps=4)


def test_lora_resumes_bit_exactly_and_exports_its_merged_weights(
    config, tmp_path
):
  """LoRA on a bfloat16 base: the resumed run equals the uninterrupted one
  bit for bit; the exported policy is W_0 + s D U, and every leaf without
  adapters is the starting policy's."""
  adapted = configs.apply_overrides(
      config,
      [
          "optimizer.name=lora",
          "optimizer.rank=4",
          "optimizer.base_dtype=bfloat16",
          "steps=3",
      ],
  )
  straight_run = tmp_path / "straight"
  trainer.train(adapted, straight_run, progress=False, log=QUIET)
  final = final_state(straight_run, adapted)
  run = copy_run(straight_run, tmp_path)
  shutil.rmtree(run / "checkpoints" / "3")
  (run / "summary.json").unlink()
  summary = trainer.train(adapted, run, progress=False, log=QUIET, resume=True)
  assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
  assert_same_state(final_state(run, adapted), final)
  assert run_metrics(run) == run_metrics(straight_run)
  out = tmp_path / "hf"
  assert cli_main(["export", f"--checkpoint={run}", f"--out={out}"]) == 0
  exported = models.split_model(models.load_pretrained(out))[1]
  start = engine.Policy.load(config.policy.path).params
  merged = policy_state.dense_weights(final.params, final.opt_state)
  flat = jax.tree_util.tree_flatten_with_path(exported)[0]
  for (path, x), y, x0 in zip(
      flat, jax.tree.leaves(merged), jax.tree.leaves(start), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    if not any(
        f"['{t}']" in jax.tree_util.keystr(path)
        for t in adapted.optimizer.lora_targets
    ):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(x0))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_newest_checkpoint_is_set_aside_and_trained_again(
    config, straight, tmp_path
):
  run = copy_run(straight, tmp_path)
  folder = run / "checkpoints"
  data = largest_file(folder / "6" / "params")
  size = data.stat().st_size // 2
  data.write_bytes(data.read_bytes()[:size])
  lines = []
  summary = trainer.train(
      config, run, progress=False, log=lines.append, resume=True
  )
  assert summary["resumed_from_step"] == 4 and summary["steps"] == 6
  skipped = [line for line in lines if line.startswith("skipping")]
  assert len(skipped) == 1, lines
  assert "skipping checkpoint 6" in skipped[0] and "6.corrupt-" in skipped[0]
  assert set_aside(folder) == ["6.corrupt"]  # kept for inspection
  (aside,) = folder.glob("6.corrupt-*")
  assert (aside / data.relative_to(folder / "6")).stat().st_size == size
  # Step 6 trained again and saved in its place: the run never stopped.
  assert_same_state(final_state(run, config), final_state(straight, config))
  assert run_metrics(run) == run_metrics(straight)
  # A checkpoint without its description is set aside the same way, and
  # its step can be saved again.
  shutil.rmtree(folder / "6" / "meta")
  target = final_state(straight, config)
  with checkpoint.Checkpointer(folder) as ckpt:
    restored = ckpt.restore_latest(
        log=lines.append, params=target.params, opt_state=target.opt_state
    )
    assert restored.step == 4 and ckpt.all_steps() == [4]
    ckpt.save(
        6,
        params=target.params,
        opt_state=target.opt_state,
        loop=target.loop,
        meta=target.meta,
        wait=True,
    )
    assert ckpt.all_steps() == [4, 6]
  assert set_aside(folder) == ["6.corrupt", "6.corrupt"]
  assert_same_state(final_state(run, config), target)
