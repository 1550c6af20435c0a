"""Checkpoints and faults: exact resume, crashes during saves, signals,
mismatched or damaged checkpoints, non-finite steps, export to HF."""

import dataclasses
import doctest
import gc
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from logra_jax import checkpoint
from logra_jax import checksums
from logra_jax import configs
from logra_jax import memory
from logra_jax import models
from logra_jax import parallel
from logra_jax.cli import main as cli_main
from logra_jax.data.tokenizer import char_tokenizer
from logra_jax.optim import factored
from logra_jax.rl import learner, trainer
from logra_jax.rollout import engine
from logra_jax import policy_state
from logra_jax.optim import non_finite
from tolerances import decoder_reduction_length
from tolerances import float_tolerance

SMOKE = configs.get_preset("smoke")
WORKER = pathlib.Path(__file__).with_name("checkpoint_worker.py")
QUIET = lambda s: None
META = {"format": checkpoint.FORMAT_VERSION}


def _policy(folder, **overrides):
  tokenizer = char_tokenizer()
  config = models.DecoderConfig.tiny(
      vocab_size=len(tokenizer),
      max_position_embeddings=64,
      eos_token_ids=(tokenizer.eos_token_id,),
      bos_token_id=tokenizer.bos_token_id,
      pad_token_id=tokenizer.pad_token_id,
      **overrides,
  )
  models.save_pretrained(models.init_model(config, rngs=0), folder)
  tokenizer.save_pretrained(folder)
  return folder


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  """The runs here compile the same programs again and again (each run, in
  this process or a child): a persistent cache, shared with the children,
  compiles each once. XLA's compilation is deterministic, so no number
  changes."""
  from jax._src import compilation_cache as cache

  folder = tmp_path_factory.mktemp("jax_cache")
  names = (
      "jax_compilation_cache_dir",
      "jax_persistent_cache_min_compile_time_secs",
  )
  old = {name: getattr(jax.config, name) for name in names}
  jax.config.update(names[0], str(folder))
  jax.config.update(names[1], 0.0)
  yield folder
  for name, value in old.items():
    jax.config.update(name, value)
  cache.reset_cache()


@pytest.fixture(scope="module")
def policy_folder(tmp_path_factory):
  return _policy(tmp_path_factory.mktemp("policy") / "tiny")


def _overrides(policy_folder, steps=6, every=2):
  return [
      f"policy.path={policy_folder}",
      f"steps={steps}",
      f"checkpoint.every_steps={every}",
  ]


@pytest.fixture(scope="module")
def config(policy_folder):
  return configs.apply_overrides(SMOKE, _overrides(policy_folder))


@pytest.fixture(scope="module")
def straight(config, tmp_path_factory):
  """6 steps in one go."""
  out = tmp_path_factory.mktemp("straight")
  trainer.train(config, out, progress=False, log=QUIET)
  return out


@pytest.fixture(scope="module")
def resumed(config, tmp_path_factory):
  """3 steps; then the same run resumed up to 6 steps."""
  out = tmp_path_factory.mktemp("resumed")
  first = trainer.train(
      dataclasses.replace(config, steps=3), out, progress=False, log=QUIET
  )
  second = trainer.train(config, out, progress=False, log=QUIET, resume=True)
  return out, first, second


def _final_state(run, config, step=None):
  """Params, optimizer state and loop of a run's checkpoint (the latest)."""
  policy = engine.Policy.load(config.policy.path)
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  one = jax.tree.leaves(policy.params)[0].sharding
  opt_state = checkpoint.abstract_state(
      policy_state.abstract_opt_state(config.optimizer, tx, policy.params), one
  )
  params = checkpoint.abstract_state(
      policy_state.abstract_weights(config.optimizer, tx, policy.params), one
  )
  with checkpoint.Checkpointer(run / "checkpoints", read_only=True) as ckpt:
    return ckpt.restore(step, params=params, opt_state=opt_state)


def _metrics(run):
  """metrics.jsonl without the timings and compilation counts."""
  lines = (run / "metrics.jsonl").read_text().splitlines()
  return [
      {
          k: v
          for k, v in json.loads(line).items()
          if not k.startswith(("time/", "compile/"))
      }
      for line in lines
  ]


def _assert_same_state(a, b):
  for x, y in zip(
      jax.tree.leaves((a.params, a.opt_state)),
      jax.tree.leaves((b.params, b.opt_state)),
      strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert a.loop.data_position == b.loop.data_position
  np.testing.assert_array_equal(
      jax.random.key_data(a.loop.key), jax.random.key_data(b.loop.key)
  )


def test_resumed_run_equals_the_uninterrupted_run(config, straight, resumed):
  run, first, second = resumed
  assert first["checkpoint_steps"] == [2, 3]
  assert second["resumed_from_step"] == 3 and second["steps"] == 6
  a, b = _final_state(straight, config), _final_state(run, config)
  assert a.step == b.step == 6
  _assert_same_state(a, b)  # bit for bit
  assert _metrics(run) == _metrics(straight)
  assert [h["step"] for h in b.loop.history] == [1, 2, 3, 4, 5, 6]
  # The logged metrics move: this is not a run of no-ops.
  assert len({m["loss"] for m in _metrics(run)}) > 1


def _worker(args, *worker_flags):
  env = dict(
      os.environ,
      JAX_DEFAULT_MATMUL_PRECISION="highest",
      JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
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
  sets = [f"--set={s}" for s in _overrides(policy_folder, every=1)]
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
  resumed = configs.apply_overrides(SMOKE, _overrides(policy_folder, every=1))
  trainer.train(resumed, out, progress=False, log=QUIET, resume=True)
  _assert_same_state(_final_state(out, config), _final_state(straight, config))
  assert _metrics(out) == _metrics(straight)


@pytest.fixture(scope="module")
def rollout_batch(policy_folder):
  policy = engine.Policy.load(policy_folder)
  task = trainer.load_task(SMOKE)
  batch, _ = engine.rollout(
      policy,
      policy.params,
      list(task.examples[:4]),
      SMOKE,
      trainer.run_rewards(SMOKE, task),
      jax.random.key(1),
  )
  return policy, batch.replace(
      advantages_B=jnp.linspace(-1.0, 1.0, batch.batch_size)
  )


def test_nan_gradients_are_skipped_and_the_weights_unchanged(rollout_batch):
  policy, batch = rollout_batch
  tx = policy_state.make_optimizer(SMOKE.optimizer, policy.params)
  step = learner.make_train_step(policy.graphdef, tx, SMOKE)
  device = jax.devices()[0]  # all committed, as in the trainer
  params, state = jax.device_put(
      policy_state.init_train_state(
          SMOKE.optimizer, tx, jax.tree.map(jnp.copy, policy.params)
      ),
      device,
  )
  batch = jax.device_put(batch, device)
  before = jax.tree.map(np.asarray, (params, state))
  nan_batch = batch.replace(advantages_B=batch.advantages_B.at[0].set(jnp.nan))
  params, state, metrics = step(params, state, nan_batch)
  assert not np.isfinite(float(metrics["loss"]))
  guard = non_finite.non_finite_state(state)
  assert int(guard.skipped_steps) == int(guard.consecutive_skips) == 1
  assert "gradients" in non_finite.non_finite_reasons(guard.reason)
  old_params, old_state = before
  for x, y in zip(
      jax.tree.leaves(old_params), jax.tree.leaves(params), strict=True
  ):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(
      jax.tree.leaves(old_state.inner_state),
      jax.tree.leaves(state.inner_state),
      strict=True,
  ):
    np.testing.assert_array_equal(x, y)
  # A finite batch afterwards is applied and ends the run of skips.
  params, state, metrics = step(params, state, batch)
  guard = non_finite.non_finite_state(state)
  assert int(guard.consecutive_skips) == 0 and int(guard.reason) == 0
  assert int(guard.skipped_steps) == 1 and float(metrics["update_norm"]) > 0
  assert not all(
      np.array_equal(x, y)
      for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(old_params))
  )


def test_guard_names_each_non_finite_quantity():
  import logra_jax as logra

  params = {"w": jnp.ones(2)}
  grads = {"w": jnp.ones(2)}
  tx = non_finite.skip_non_finite(optax.sgd(1.0))
  _, state = tx.update(grads, tx.init(params), params, loss=jnp.inf)
  assert non_finite.non_finite_reasons(state.reason) == ["loss"]
  tx = non_finite.skip_non_finite(optax.sgd(1.0))
  _, state = tx.update(
      {"w": jnp.array([1.0, -jnp.inf])}, tx.init(params), params
  )
  assert non_finite.non_finite_reasons(state.reason) == ["gradients"]
  # With apply_fn, the update is applied inside the guard (zeros if skipped).
  apply = lambda u: optax.apply_updates(params, u)
  new_params, _ = tx.update(grads, tx.init(params), params, apply_fn=apply)
  assert new_params["w"].tolist() == [0.0, 0.0]
  new_params, state = tx.update(
      grads, tx.init(params), params, loss=jnp.nan, apply_fn=apply
  )
  assert new_params["w"].tolist() == [1.0, 1.0] and int(state.reason) == 1
  # A NaN predicted KL: the KL stage already zeroes the step (and counts
  # it); the guard says why.
  tx = non_finite.skip_non_finite(logra.scale_by_predicted_kl(1e-3))
  state = tx.init(params)
  updates, new = tx.update(grads, state, params, kl_predictor=lambda u: jnp.nan)
  assert non_finite.non_finite_reasons(new.reason) == ["predicted KL"]
  assert updates["w"].tolist() == [0.0, 0.0]
  assert int(logra.predicted_kl_state(new).skipped_steps) == 1
  _, new = tx.update(grads, state, params, kl_predictor=lambda u: 0.5)
  assert int(new.reason) == 0 and int(new.consecutive_skips) == 0


def test_consecutive_skips_stop_the_run_naming_step_and_quantity(
    config, tmp_path, monkeypatch
):
  def nan_advantages(rewards_N, *args, **kwargs):
    return jnp.full(rewards_N.shape, jnp.nan, jnp.float32)

  monkeypatch.setattr(trainer.algo, "compute_advantages", nan_advantages)
  config = dataclasses.replace(config, max_consecutive_skips=2)
  lines = []
  with pytest.raises(
      FloatingPointError,
      match=r"step 2: 2 consecutive steps skipped for "
      r"non-finite .*gradients",
  ):
    trainer.train(config, tmp_path, progress=False, log=lines.append)
  assert any("step 1: skipped, non-finite" in line for line in lines)
  assert [m["skipped"] for m in _metrics(tmp_path)] == [1.0, 1.0]


def test_out_of_memory_points_to_logra_memory(config, tmp_path, monkeypatch):
  def out_of_memory(*args, **kwargs):
    def step(*args):
      raise jax.errors.JaxRuntimeError(
          "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.0GiB"
      )

    return step

  monkeypatch.setattr(trainer.learner_lib, "make_train_step", out_of_memory)
  with pytest.raises(trainer.OutOfMemoryError) as error:
    trainer.train(config, tmp_path, progress=False, log=QUIET)
  message = str(error.value)
  assert "step 1: out of memory" in message and "9.0GiB" in message
  command = message.split("with: ")[1].split(" ;")[0]
  assert command.startswith(
      f"logra memory --model " f"{config.policy.path}/config.json"
  )
  # The suggested command is one `logra memory` accepts.
  from logra_jax.cli import build_parser

  args = build_parser().parse_args(command.split()[1:])
  assert (args.optimizer, args.rank, args.micro_batch) == ("logra", 4, 16)


def _copy_run(run, tmp_path):
  return pathlib.Path(shutil.copytree(run, tmp_path / "copy"))


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
  run = _copy_run(straight, tmp_path)
  changed = configs.apply_overrides(config, [override])
  with pytest.raises(checkpoint.CheckpointError, match=message):
    trainer.train(changed, run, progress=False, log=QUIET, resume=True)
  # Nothing was written: the original config still describes the run.
  assert configs.load_config("tiny", [run / "config.yaml"]) == config


def test_resume_with_another_model_or_mesh(config, straight, tmp_path):
  run = _copy_run(straight, tmp_path)
  other = _policy(tmp_path / "wide", hidden_size=32, head_dim=8)
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


def test_allowed_and_refused_changes_are_the_documented_ones():
  base = configs.to_dict(SMOKE)
  allowed = configs.apply_overrides(
      SMOKE,
      [
          "steps=100",
          "eval_every=5",
          "checkpoint.every_steps=7",
          "checkpoint.keep=5",
          "checkpoint.async_save=false",
          "max_consecutive_skips=9",
          "policy.path=/elsewhere",
          "policy.remat=none",
          "rollout.engine=process",
          "sync.resync_every=3",
      ],
  )
  meta = lambda config: checkpoint.run_meta(config, {"hidden_size": 64})
  checkpoint.check_resumable(meta(SMOKE), meta(allowed))
  changes = checkpoint.config_changes(base, configs.to_dict(allowed))
  assert {c[0].split(".")[0] for c in changes} == {
      "steps",
      "eval_every",
      "checkpoint",
      "max_consecutive_skips",
      "policy",
      "rollout",
      "sync",
  }
  for override in [
      "optimizer.rank=8",
      "optimizer.name=adam",
      "rollout.prompts_per_step=8",
      "task.seed=3",
      "policy.warm_start_steps=5",
      "loss.eps_low=0.3",
      "rollout.dtype=bfloat16",
  ]:
    refused = configs.apply_overrides(SMOKE, [override])
    with pytest.raises(
        checkpoint.CheckpointError, match=override.split("=")[0]
    ):
      checkpoint.check_resumable(meta(SMOKE), meta(refused))
  # A field the checkpoint predates is fine while it keeps its default.
  old = meta(SMOKE)
  del old["config"]["max_consecutive_skips"]
  checkpoint.check_resumable(old, meta(SMOKE))
  # One saved before policy.remat existed resumes under any setting of it.
  del old["config"]["policy"]["remat"]
  no_remat = configs.apply_overrides(SMOKE, ["policy.remat=none"])
  checkpoint.check_resumable(old, meta(no_remat))
  old["format"] = 99
  with pytest.raises(checkpoint.CheckpointError, match="format 99"):
    checkpoint.check_resumable(old, meta(SMOKE))


def test_no_resume_into_a_folder_with_checkpoints_and_nothing_to_resume(
    config, straight, tmp_path
):
  with pytest.raises(
      checkpoint.CheckpointError, match="holds checkpoints of an earlier run"
  ):
    trainer.train(
        config, _copy_run(straight, tmp_path), progress=False, log=QUIET
    )
  with pytest.raises(checkpoint.CheckpointError, match="nothing to resume"):
    trainer.train(
        config, tmp_path / "new", progress=False, log=QUIET, resume=True
    )
  assert cli_main(["train", "--resume", "--preset=smoke"]) == 2


def test_train_or_reuse_resumes_an_unfinished_run(config, straight, tmp_path):
  run = _copy_run(straight, tmp_path)
  (run / "summary.json").unlink()  # as if it had stopped after step 4
  shutil.rmtree(run / "checkpoints" / "6")
  summary = trainer.train_or_reuse(config, run)
  assert summary["resumed_from_step"] == 4 and summary["steps"] == 6
  _assert_same_state(_final_state(run, config), _final_state(straight, config))
  assert trainer.train_or_reuse(config, run) == summary  # finished: reused


def test_restore_reshards_into_the_current_mesh(config, straight):
  policy = engine.Policy.load(config.policy.path)
  mesh = parallel.make_mesh(parallel.MeshConfig(fsdp=4, tp=2))
  params = parallel.param_shardings(policy.params, mesh)
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  state = parallel.optimizer_state_shardings(tx, policy.params, params, mesh)
  abstract = policy_state.abstract_weights(config.optimizer, tx, policy.params)
  weights = parallel.weight_shardings(abstract, params, mesh)
  targets = dict(
      params=checkpoint.abstract_state(abstract, weights),
      opt_state=checkpoint.abstract_state(
          jax.eval_shape(tx.init, policy.params), state
      ),
  )
  with checkpoint.Checkpointer(
      straight / "checkpoints", read_only=True
  ) as ckpt:
    here = dict(ckpt.read_meta(), mesh="dp=1,fsdp=4,tp=2")
    with pytest.raises(checkpoint.CheckpointError, match="mesh"):
      ckpt.restore(expected_meta=here, **targets)
    sharded = ckpt.restore(expected_meta=here, allow_reshard=True, **targets)
  single = _final_state(straight, config)
  trees = [
      (sharded.params, single.params, weights),
      (sharded.opt_state, single.opt_state, state),
  ]
  for got, want, shardings in trees:
    for x, y, s in zip(
        jax.tree.leaves(got),
        jax.tree.leaves(want),
        jax.tree.leaves(shardings),
        strict=True,
    ):
      assert x.sharding == s
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert any(
      len(s.device_set) == 8 and not s.is_fully_replicated
      for s in jax.tree.leaves(state)
  )  # really laid out on the mesh


# A failed read leaves Orbax coroutines behind; they are collected here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_and_empty_checkpoint_folders(config, straight, tmp_path):
  run = _copy_run(straight, tmp_path)
  folder = run / "checkpoints"
  target = _final_state(straight, config)
  with checkpoint.Checkpointer(folder, read_only=True) as ckpt:
    assert ckpt.all_steps() == [4, 6]
  # Truncate the largest array file of the latest checkpoint.
  data = max(
      (p for p in (folder / "6" / "opt_state").rglob("*") if p.is_file()),
      key=lambda p: p.stat().st_size,
  )
  data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
  kwargs = dict(params=target.params, opt_state=target.opt_state)
  with checkpoint.Checkpointer(folder, read_only=True) as ckpt:
    with pytest.raises(
        checkpoint.CorruptCheckpointError, match=r"checkpoints/6 cannot be read"
    ):
      ckpt.restore(6, **kwargs)
    skipped = []
    restored = ckpt.restore_latest(log=skipped.append, **kwargs)
  assert restored.step == 4 and "skipping checkpoint 6" in skipped[0]
  # Without its description a checkpoint is refused too.
  shutil.rmtree(folder / "4" / "meta")
  with checkpoint.Checkpointer(folder, read_only=True) as ckpt:
    with pytest.raises(checkpoint.CorruptCheckpointError, match="meta"):
      ckpt.read_meta(4)
    with pytest.raises(
        checkpoint.CorruptCheckpointError, match="no readable checkpoint"
    ):
      ckpt.restore_latest(log=QUIET, **kwargs)
    with pytest.raises(
        checkpoint.CheckpointError, match=r"no checkpoint of step 5 .* 4, 6"
    ):
      ckpt.restore(5, **kwargs)
  # Another run's arrays: named leaf, both shapes.
  with checkpoint.Checkpointer(run / "checkpoints", read_only=True) as ckpt:
    other = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(
            (3, 3)
            if jax.tree_util.keystr(path).startswith("['embed']")
            else x.shape,
            x.dtype,
            sharding=x.sharding,
        ),
        target.params,
    )
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"match this run's params: embed.value is "
        r"float32\[\d+, 64\] in the checkpoint but "
        r"float32\[3, 3\] in this run",
    ):
      ckpt.restore(6, params=other)
  (tmp_path / "empty").mkdir()
  for path, message in [
      (tmp_path / "empty", "no finished checkpoint"),
      (tmp_path / "absent", "no such checkpoint folder"),
  ]:
    with pytest.raises(checkpoint.CheckpointError, match=message):
      checkpoint.export_policy(path, tmp_path / "hf")
    assert (
        cli_main(["export", f"--checkpoint={path}", f"--out={tmp_path / 'hf'}"])
        == 2
    )
  gc.collect()


def test_keeps_the_latest_and_the_best(tmp_path):
  now = [0.0]
  config = configs.CheckpointConfig(
      every_steps=0, every_seconds=60, keep=2, keep_best=1
  )
  params = {"w": jnp.arange(4.0)}
  state = optax.adam(0.1).init(params)
  accuracy = {2: 0.9, 4: 0.5, 5: 0.7}
  with checkpoint.Checkpointer(tmp_path, config, clock=lambda: now[0]) as ck:
    assert not ck.due(1)
    now[0] = 61.0
    assert ck.due(1) and ck.due(1, evaluated=True)
    for step in range(1, 7):
      ck.save(
          step,
          params=jax.tree.map(lambda x: x + step, params),
          opt_state=state,
          loop=checkpoint.LoopState(
              step,
              jax.random.key(step),
              step,
              history=[{"loss": float("nan"), "step": step}],
          ),
          meta=META,
          eval_accuracy=accuracy.get(step),
      )
    assert not ck.due(7) and ck.due(7, evaluated=True)
    ck.wait()
    assert ck.all_steps() == [2, 5, 6]  # best (0.9), then the last two
    with pytest.raises(checkpoint.CheckpointError, match="already exists"):
      ck.save(
          6,
          params=params,
          opt_state=state,
          meta=META,
          loop=checkpoint.LoopState(6, jax.random.key(0), 6),
      )
    restored = ck.restore(2, params=params, opt_state=state)
  assert restored.params["w"].tolist() == [2.0, 3.0, 4.0, 5.0]
  assert restored.loop.data_position == 2
  assert np.isnan(restored.loop.history[0]["loss"])  # a skipped step's
  np.testing.assert_array_equal(
      jax.random.key_data(restored.loop.key),
      jax.random.key_data(jax.random.key(2)),
  )


def test_exported_policy_loads_in_transformers_with_equal_logits(
    config, straight, tmp_path
):
  import torch
  import transformers

  out = tmp_path / "hf"
  assert cli_main(["export", f"--checkpoint={straight}", f"--out={out}"]) == 0
  policy = engine.Policy.load(config.policy.path)
  final = _final_state(straight, config)
  params = policy_state.dense_weights(final.params, final.opt_state)
  ids = policy.encode(["12+3-4=", "7-1+9="])[0]
  ids = jnp.asarray([ids], jnp.int32)
  ours = np.asarray(models.logits_fn(policy.graphdef, params, ids))
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    theirs = model(torch.tensor(np.asarray(ids))).logits.numpy()
  # PyTorch and XLA sum in other orders: 2 gamma_n of the logits' scale.
  model_config = models.load_pretrained(config.policy.path).config
  n = decoder_reduction_length(model_config, ids.shape[1])
  atol = 2 * float_tolerance(np.float32, n) * float(np.abs(ours).max())
  np.testing.assert_allclose(theirs, ours, atol=atol, rtol=0)
  # It is the trained policy, not the starting one.
  start = np.asarray(models.logits_fn(policy.graphdef, policy.params, ids))
  assert np.abs(start - ours).max() > 1e-4
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert tokenizer("12+3-4=")["input_ids"] == policy.encode(["12+3-4="])[0]
  with pytest.raises(FileExistsError):
    checkpoint.export_policy(straight, out)
  assert (
      cli_main(
          [
              "export",
              f"--checkpoint={straight / 'checkpoints' / '4'}",
              f"--out={out}",
              "--overwrite",
          ]
      )
      == 0
  )


def _largest_file(folder):
  return max(
      (p for p in folder.rglob("*") if p.is_file()),
      key=lambda p: p.stat().st_size,
  )


def _flip_bytes(path, count=64):
  """XORs ``count`` bytes in the middle of a file: damage that keeps its
  size and, for an array's data, its format."""
  data = bytearray(path.read_bytes())
  middle = len(data) // 2
  data[middle : middle + count] = bytes(
      b ^ 0xFF for b in data[middle : middle + count]
  )
  path.write_bytes(bytes(data))


def _set_aside(folder):
  return sorted(p.name.split("-")[0] for p in folder.glob("*.corrupt-*"))


def test_galore_state_with_empty_arrays_saves_and_resumes_bit_exactly(
    config, tmp_path
):
  galore = configs.apply_overrides(config, ["optimizer.name=galore", "steps=3"])
  straight_run = tmp_path / "straight"
  trainer.train(galore, straight_run, progress=False, log=QUIET)
  final = _final_state(straight_run, galore)
  # optax's GaLore holds a (0, 0) projector for every leaf it leaves dense.
  empty = [x for x in jax.tree.leaves(final.opt_state) if x.size == 0]
  assert empty and {(x.shape, x.dtype) for x in empty} == {
      ((0, 0), np.dtype("float32"))
  }
  run = _copy_run(straight_run, tmp_path)
  shutil.rmtree(run / "checkpoints" / "3")
  (run / "summary.json").unlink()
  summary = trainer.train(galore, run, progress=False, log=QUIET, resume=True)
  assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
  _assert_same_state(_final_state(run, galore), final)
  assert _metrics(run) == _metrics(straight_run)


def test_bfloat16_base_merges_stochastically_and_resumes_bit_exactly(
    config, tmp_path
):
  """A factored run with a bfloat16 base and a merge every other step
  (stochastic rounding included) resumes bit for bit, and exports its
  merged weights."""
  bf16 = configs.apply_overrides(
      config,
      ["optimizer.base_dtype=bfloat16", "optimizer.refresh_every=2", "steps=4"],
  )
  straight_run = tmp_path / "straight"
  trainer.train(bf16, straight_run, progress=False, log=QUIET)
  final = _final_state(straight_run, bf16)
  bases = [
      w.base
      for w in jax.tree.leaves(final.params, is_leaf=factored.is_factored)
      if factored.is_factored(w)
  ]
  assert bases and {b.dtype for b in bases} == {jnp.dtype(jnp.bfloat16)}
  run = _copy_run(straight_run, tmp_path)
  shutil.rmtree(run / "checkpoints" / "4")
  (run / "summary.json").unlink()
  summary = trainer.train(bf16, run, progress=False, log=QUIET, resume=True)
  assert summary["resumed_from_step"] == 2 and summary["steps"] == 4
  _assert_same_state(_final_state(run, bf16), final)  # merge at step 2
  assert _metrics(run) == _metrics(straight_run)
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
  final = _final_state(straight_run, adapted)
  run = _copy_run(straight_run, tmp_path)
  shutil.rmtree(run / "checkpoints" / "3")
  (run / "summary.json").unlink()
  summary = trainer.train(adapted, run, progress=False, log=QUIET, resume=True)
  assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
  _assert_same_state(_final_state(run, adapted), final)
  assert _metrics(run) == _metrics(straight_run)
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
  run = _copy_run(straight, tmp_path)
  folder = run / "checkpoints"
  data = _largest_file(folder / "6" / "params")
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
  assert _set_aside(folder) == ["6.corrupt"]  # kept for inspection
  (aside,) = folder.glob("6.corrupt-*")
  assert (aside / data.relative_to(folder / "6")).stat().st_size == size
  # Step 6 trained again and saved in its place: the run never stopped.
  _assert_same_state(_final_state(run, config), _final_state(straight, config))
  assert _metrics(run) == _metrics(straight)
  # A checkpoint without its description is set aside the same way, and
  # its step can be saved again.
  shutil.rmtree(folder / "6" / "meta")
  target = _final_state(straight, config)
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
  assert _set_aside(folder) == ["6.corrupt", "6.corrupt"]
  _assert_same_state(_final_state(run, config), target)


def test_flipped_bits_are_found_by_the_checksums(
    config, straight, tmp_path, capsys
):
  run = _copy_run(straight, tmp_path)
  folder = run / "checkpoints"
  _flip_bytes(_largest_file(folder / "6" / "params"))
  target = _final_state(straight, config)
  kwargs = dict(params=target.params, opt_state=target.opt_state)
  damaged = r"checkpoints/6 \(step 6\): array params\.\S+ does not match"
  with checkpoint.Checkpointer(folder, read_only=True) as ckpt:
    with pytest.raises(checkpoint.CorruptCheckpointError, match=damaged):
      ckpt.restore(6, **kwargs)
    # Read-only: reported and skipped, but left where it is.
    assert ckpt.restore_latest(log=QUIET, **kwargs).step == 4
  assert _set_aside(folder) == []
  # Export refuses it with one line, and writes nothing.
  out = tmp_path / "hf"
  capsys.readouterr()
  assert cli_main(["export", f"--checkpoint={run}", f"--out={out}"]) == 2
  error = capsys.readouterr().err
  assert error.count("\n") == 1 and re.search(damaged, error), error
  assert not out.exists() and not list(tmp_path.glob(".hf.partial-*"))
  # The JSON items are checked too: the loop state and the description.
  for item, old, new in [
      ("loop", '"data_position": 4', '"data_position": 5'),
      ("meta", '"rank": 4', '"rank": 5'),
  ]:
    path = folder / "4" / item / "metadata"
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))
    with checkpoint.Checkpointer(folder, read_only=True) as ckpt:
      with pytest.raises(
          checkpoint.CorruptCheckpointError,
          match=f"checkpoints/4.*{item}.* checksum",
      ):
        ckpt.restore(4, **kwargs)
    path.write_text(text)
  # A writable checkpointer (a resumed run) sets the damaged one aside.
  with checkpoint.Checkpointer(folder) as ckpt:
    assert ckpt.restore_latest(log=QUIET, **kwargs).step == 4
    assert ckpt.all_steps() == [4]
  assert _set_aside(folder) == ["6.corrupt"]


def test_array_checksums_see_every_bit_and_not_the_layout():
  x = jax.random.normal(jax.random.key(0), (4, 8))
  tree = {
      "w": x,
      "half": x.astype(jnp.bfloat16),
      "count": jnp.arange(5),
      "flags": jnp.array([True, False]),
      "scalar": jnp.float32(3.0),
      "empty": jnp.zeros((0, 3)),
  }
  sums = checksums.array_checksums(tree)
  assert sorted(sums) == sorted(tree)
  assert checksums.array_checksums(tree) == sums  # deterministic
  # Each of the 4 * 8 * 32 single-bit flips of w changes w's checksum (the
  # mixing is a bijection of each word, the sum a group operation).
  bits = np.asarray(x).view(np.uint32).reshape(-1)
  for i in range(bits.size):
    for b in range(32):
      flipped = bits.copy()
      flipped[i] ^= np.uint32(1 << b)
      w = jnp.asarray(flipped.view(np.float32).reshape(x.shape))
      assert checksums.array_checksums({"w": w})["w"] != sums["w"], (i, b)
  # Where a value sits counts: two swapped elements differ.
  swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])
  assert checksums.array_checksums({"w": swapped})["w"] != sums["w"]
  # The layout does not: the same array sharded over 8 devices.
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  sharded = jax.device_put(
      x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
  )
  assert checksums.array_checksums({"w": sharded}) == {"w": sums["w"]}


def _numpy_checksum(x: np.ndarray) -> int:
  """The checksum of :func:`checksums.array_checksums` by its definition:
  the sum mod 2**32 of MurmurHash3's finalizer of each 32-bit word XOR its
  flat position times 0x9E3779B9."""
  words = (
      x.reshape(-1)
      .view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)
      .astype(np.uint64)
  )
  h = words ^ ((np.arange(words.size, dtype=np.uint64) * 0x9E3779B9) % 2**32)
  h = ((h ^ (h >> 16)) * 0x85EBCA6B) % 2**32
  h = ((h ^ (h >> 13)) * 0xC2B2AE35) % 2**32
  return int(np.sum(h ^ (h >> 16)) % 2**32)


def test_checksums_of_a_layer_stack_are_summed_a_layer_at_a_time():
  x = jax.random.normal(jax.random.key(0), (6, 5, 7))
  for a in (x, x.astype(jnp.bfloat16), x[:1], x[0]):
    expected = _numpy_checksum(np.asarray(a))
    assert checksums.array_checksums({"a": a})["a"] == f"{expected:08x}"
  # Temporaries of one layer, not of the stack (compiled as the memory
  # planner compiles on CPU).
  stack = jax.ShapeDtypeStruct((16, 256, 512), jnp.float32)
  temp = memory.compiled_memory(
      checksums.leaf_checksums.lower([stack])
  ).temp_size_in_bytes
  layer = 256 * 512 * 4
  assert temp < 2 * layer + 2**12


def test_export_over_a_file_is_a_one_line_error(straight, tmp_path, capsys):
  target = tmp_path / "file"
  target.write_text("keep")
  capsys.readouterr()
  assert (
      cli_main(
          [
              "export",
              f"--checkpoint={straight}",
              f"--out={target}",
              "--overwrite",
          ]
      )
      == 2
  )
  error = capsys.readouterr().err
  assert error.count("\n") == 1 and f"{target} is a file" in error, error
  assert target.read_text() == "keep"


def test_no_background_work_is_left_at_exit(tmp_path):
  # Without JAX_PLATFORMS, JAX looks for every platform when first asked
  # for the process index: long enough for a process to end meanwhile.
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}

  def run(*args):
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )

  folder = tmp_path / "checkpoints"
  (folder / "3.orbax-checkpoint-tmp-1").mkdir(parents=True)
  # A process that opens a checkpoint folder and ends at once: the clean-up
  # of the unfinished save is done, not left to a thread at exit.
  opened = run(
      "-c",
      "import sys; from logra_jax import checkpoint; "
      f"c = checkpoint.Checkpointer({str(folder)!r}); c.close(); "
      "c.close(); sys.exit(2)",
  )
  assert opened.returncode == 2 and opened.stderr == "", opened.stderr
  assert not list(folder.iterdir())
  # A run that fails right after opening its checkpoint folder.
  failed = run(
      "-m",
      "logra_jax.cli",
      "train",
      "--resume",
      "--preset=smoke",
      "--no-progress",
      f"--out={tmp_path}",
  )
  assert failed.returncode == 2
  assert failed.stderr.startswith("logra train: error: nothing to resume")
  assert failed.stderr.count("\n") == 1, failed.stderr


def test_docstring_examples_run():
  for module in (checkpoint, trainer, learner):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, module.__name__
