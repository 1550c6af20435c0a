"""Tests for logra_jax.rl.warm_start: the cache is written atomically, an
invalid entry is rebuilt and a concurrent writer's entry is kept."""

import dataclasses
import json
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import transformers

from logra_jax import models
from logra_jax.configs import get_preset
from logra_jax.rl import warm_start as warm_start_lib

EXAMPLES = [
    {"prompt": f"{a}+{b}=", "answer": str(a + b)}
    for a in range(4)
    for b in range(4)
]


@pytest.fixture
def policy(tmp_path):
  """The smoke preset's decoder, untrained (the cache is under test), cached
  in tmp_path/cache."""
  return dataclasses.replace(
      get_preset("smoke").policy,
      warm_start_steps=0,
      cache_dir=str(tmp_path / "cache"),
  )


def _build(policy, lines=None):
  log = print if lines is None else lines.append
  return warm_start_lib.warm_start(
      policy, EXAMPLES, seed=0, max_length=16, log=log
  )


def _entries(policy):
  """Everything in the cache folder, temporary folders included."""
  return sorted(p.name for p in pathlib.Path(policy.cache_dir).iterdir())


def _loads(folder):
  models.load_pretrained(folder)
  assert len(models.load_tokenizer(folder)) == 100


def test_build_then_reuse(policy):
  folder = _build(policy)  # warm_start_steps=0 is valid: the initial model
  assert _entries(policy) == [folder.name]
  _loads(folder)
  lines = []
  assert _build(policy, lines) == folder
  assert lines == [f"warm start: reusing {folder}"]


def truncate_weights(folder):
  file = folder / "model.safetensors"
  file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage, reason",
    [
        (
            lambda f: (f / "tokenizer.json").unlink(),
            r"missing \['tokenizer.json'\]",
        ),
        (truncate_weights, "model.safetensors: .*incomplete metadata"),
        (
            lambda f: (f / "config.json").write_text("{"),
            "config.json is not readable JSON",
        ),
    ],
)
def test_invalid_entry_is_rebuilt(policy, damage, reason):
  folder = _build(policy)
  damage(folder)
  lines = []
  assert _build(policy, lines) == folder
  assert lines[0].startswith(f"warm start: rebuilding the invalid {folder}")
  assert re.search(reason, lines[0]), lines[0]
  assert _entries(policy) == [folder.name]
  _loads(folder)


def test_a_run_killed_replacing_an_invalid_entry_leaves_nothing_behind(
    policy,
):
  """Killed (SIGKILL) between moving the invalid entry away and renaming
  its own in: the next build clears what it left and publishes."""
  folder = _build(policy)
  (folder / "tokenizer.json").unlink()
  script = textwrap.dedent(f"""
      import dataclasses, json, os, signal
      from logra_jax.configs import get_preset
      from logra_jax.rl import warm_start
      real = os.rename
      def rename(a, b):
        real(a, b)
        os.kill(os.getpid(), signal.SIGKILL)
      os.rename = rename
      policy = dataclasses.replace(
          get_preset("smoke").policy, warm_start_steps=0,
          cache_dir={policy.cache_dir!r})
      warm_start.warm_start(
          policy, json.loads({json.dumps(EXAMPLES)!r}), seed=0,
          max_length=16)
      """)
  child = subprocess.run([sys.executable, "-c", script], timeout=300)
  assert child.returncode == -signal.SIGKILL
  assert len(_entries(policy)) == 1 and not folder.exists()
  assert _build(policy) == folder
  assert _entries(policy) == [folder.name]
  _loads(folder)


def test_interrupted_build_leaves_nothing_that_looks_complete(
    policy, monkeypatch
):
  def fail(*args, **kwargs):
    raise OSError("disk full")

  with monkeypatch.context() as patch:
    patch.setattr(transformers.PreTrainedTokenizerFast, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
      _build(policy)
  assert _entries(policy) == []
  _loads(_build(policy))


@pytest.mark.parametrize("valid", [True, False])
def test_an_entry_published_first_by_another_run(
    policy, tmp_path, monkeypatch, valid
):
  """A valid one is kept; an invalid one is replaced by this run's."""
  theirs = tmp_path / "theirs"
  shutil.move(_build(policy), theirs)
  (theirs / "marker").touch()
  if not valid:
    (theirs / "tokenizer.json").unlink()
  folder = warm_start_lib.cache_folder(policy, EXAMPLES, seed=0)
  save = models.save_pretrained

  def save_after_another_run(model, path, **kwargs):
    shutil.copytree(theirs, folder)  # it finished while this run trained
    save(model, path, **kwargs)

  monkeypatch.setattr(models, "save_pretrained", save_after_another_run)
  lines = []
  assert _build(policy, lines) == folder
  if valid:
    assert lines[-1] == (
        f"warm start: another run published {folder} first;" " using it"
    )
  else:
    assert lines[-1] == (
        f"warm start: replacing the invalid {folder} "
        "(missing ['tokenizer.json'])"
    )
  assert (folder / "marker").exists() == valid
  assert warm_start_lib.entry_problem(folder) is None
  assert _entries(policy) == [folder.name]


def test_cache_key_ignores_the_fields_that_only_shape_training(policy):
  """A warm start is reused across attention, remat and reference dtype
  settings (they do not touch its weights); its shape and recipe key it."""
  folder = lambda **change: warm_start_lib.cache_folder(
      dataclasses.replace(policy, **change), EXAMPLES, seed=0
  )
  assert folder(attention="xla", remat="none", reference_dtype="float32") == (
      folder()
  )
  assert folder(cache_dir=policy.cache_dir + "/elsewhere").name == folder().name
  for change in (
      dict(hidden_size=2 * policy.hidden_size),
      dict(warm_start_steps=1),
      dict(dtype="bfloat16"),
  ):
    assert folder(**change) != folder()
  assert warm_start_lib.cache_folder(policy, EXAMPLES[:-1], 0) != folder()
  assert warm_start_lib.cache_folder(policy, EXAMPLES, 1) != folder()
