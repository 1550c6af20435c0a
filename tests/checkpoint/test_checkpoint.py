"""The checkpoint store: resume compatibility, restoring into another mesh,
damaged, empty and flipped-bit checkpoints, what is kept, export to HF."""

import gc
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from logra_jax import checkpoint
from logra_jax import configs
from logra_jax import models
from logra_jax import parallel
from logra_jax.cli import main as cli_main
from logra_jax.rl import guards
from logra_jax.rollout import engine
from logra_jax import policy_state
from tolerances import decoder_reduction_length
from tolerances import float_tolerance
from run_fixtures import copy_run
from run_fixtures import final_state
from run_fixtures import flip_bytes
from run_fixtures import largest_file
from run_fixtures import set_aside

SMOKE = configs.get_preset("smoke")
QUIET = lambda s: None
META = {"format": checkpoint.FORMAT_VERSION}


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
  single = final_state(straight, config)
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
  run = copy_run(straight, tmp_path)
  folder = run / "checkpoints"
  target = final_state(straight, config)
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
  final = final_state(straight, config)
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


def test_flipped_bits_are_found_by_the_checksums(
    config, straight, tmp_path, capsys
):
  run = copy_run(straight, tmp_path)
  folder = run / "checkpoints"
  flip_bytes(largest_file(folder / "6" / "params"))
  target = final_state(straight, config)
  kwargs = dict(params=target.params, opt_state=target.opt_state)
  damaged = r"checkpoints/6 \(step 6\): array params\.\S+ does not match"
  with checkpoint.Checkpointer(folder, read_only=True) as ckpt:
    with pytest.raises(checkpoint.CorruptCheckpointError, match=damaged):
      ckpt.restore(6, **kwargs)
    # Read-only: reported and skipped, but left where it is.
    assert ckpt.restore_latest(log=QUIET, **kwargs).step == 4
  assert set_aside(folder) == []
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
  assert set_aside(folder) == ["6.corrupt"]


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


def _export(checkpoint_path, out, capsys, *flags):
  """``logra export`` and its stderr."""
  capsys.readouterr()
  code = cli_main(
      ["export", f"--checkpoint={checkpoint_path}", f"--out={out}", *flags]
  )
  return code, capsys.readouterr().err


def _tree(folder):
  return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_export_overwrite_replaces_only_an_export(straight, tmp_path, capsys):
  run = copy_run(straight, tmp_path)
  before = _tree(run)
  other = tmp_path / "other-run"
  shutil.copytree(straight, other)
  live = tmp_path / "live"
  plain = tmp_path / "plain"
  plain.mkdir()
  (plain / "notes.txt").write_text("keep")
  refused = [
      (run, "holds the checkpoints being exported"),
      (run / "checkpoints", "holds the checkpoints being exported"),
      (run / "checkpoints" / "6" / "hf", "lies in the checkpoints"),
      (other, "is a run folder"),
      (live, "is in use by a run"),
      (plain, "was not written by logra export"),
  ]
  with guards.locked_run_folder(live):
    (live / "samples.jsonl").write_text("{}\n")
    for out, message in refused:
      code, error = _export(run, out, capsys, "--overwrite")
      assert code == 2 and error.count("\n") == 1, error
      assert message in error, error
    assert sorted(p.name for p in live.iterdir()) == [".lock", "samples.jsonl"]
  assert _tree(run) == before
  assert (plain / "notes.txt").read_text() == "keep"
  assert _tree(other) == _tree(straight)
  # An export's own folder is replaced; one holding a file it did not
  # write is not.
  out = tmp_path / "hf"
  assert _export(run, out, capsys)[0] == 0
  assert (out / checkpoint.folders.EXPORT_MARKER).is_file()
  assert _export(run, out, capsys, "--overwrite")[0] == 0
  (out / "mine.txt").write_text("keep")
  code, error = _export(run, out, capsys, "--overwrite")
  assert code == 2 and "did not write (mine.txt)" in error, error
  assert (out / "mine.txt").read_text() == "keep"
  # An export older than the marker: a policy's files and nothing else.
  (out / "mine.txt").unlink()
  (out / checkpoint.folders.EXPORT_MARKER).unlink()
  assert _export(run, out, capsys, "--overwrite")[0] == 0
  (out / checkpoint.folders.EXPORT_MARKER).unlink()
  (out / "notes.txt").write_text("keep")
  code, error = _export(run, out, capsys, "--overwrite")
  assert code == 2 and "was not written by logra export" in error, error
