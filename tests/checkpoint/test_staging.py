"""Tests of logra_jax.staging: a folder appears whole or not at all."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from logra_jax import staging


def _write(folder, text):
  folder.mkdir()
  (folder / "weights").write_text(text)


def test_a_new_folder_appears_only_when_complete(tmp_path):
  out = tmp_path / "deep" / "policy"
  with staging.staged_folder(out) as folder:
    _write(folder, "new")
    assert folder.parent.parent == out.parent and not out.exists()
  assert (out / "weights").read_text() == "new"
  assert os.listdir(out.parent) == ["policy"]


def test_an_existing_folder_is_replaced_whole(tmp_path):
  out = tmp_path / "policy"
  _write(out, "old")
  (out / "stale").write_text("from the old folder")
  with staging.staged_folder(out) as folder:
    _write(folder, "new")
    assert (out / "weights").read_text() == "old"
  assert sorted(os.listdir(out)) == ["weights"]
  assert (out / "weights").read_text() == "new"
  assert os.listdir(tmp_path) == ["policy"]


def test_an_error_leaves_the_old_folder_and_no_staging(tmp_path):
  out = tmp_path / "policy"
  _write(out, "old")
  with pytest.raises(RuntimeError, match="disk full"):
    with staging.staged_folder(out) as folder:
      _write(folder, "half")
      raise RuntimeError("disk full")
  assert (out / "weights").read_text() == "old"
  assert os.listdir(tmp_path) == ["policy"]


def test_the_new_folder_has_the_usual_permissions(tmp_path):
  # The staging folder is private (mkdtemp); the folder made in it is not.
  out = tmp_path / "policy"
  with staging.staged_folder(out) as folder:
    folder.mkdir()
  umask = os.umask(0)
  os.umask(umask)
  assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def _killed_while_staging(out, kill_after_renames):
  """Runs a writer of ``out`` in a child that is SIGKILLed inside the
  block (``kill_after_renames=None``) or after that many of its renames."""
  script = textwrap.dedent(f"""
      import os, pathlib, signal
      from logra_jax import staging
      out, after = pathlib.Path({str(out)!r}), {kill_after_renames!r}
      real, done = os.replace, []
      def replace(a, b):
        real(a, b)
        done.append(b)
        if len(done) == after:
          os.kill(os.getpid(), signal.SIGKILL)
      os.replace = replace
      with staging.staged_folder(out) as folder:
        folder.mkdir()
        (folder / "weights").write_text("new")
        if after is None:
          os.kill(os.getpid(), signal.SIGKILL)
      """)
  child = subprocess.run([sys.executable, "-c", script], timeout=120)
  assert child.returncode == -signal.SIGKILL


def _areas(out):
  return list(out.parent.glob(f".{out.name}.partial-*"))


def test_a_killed_writers_area_is_cleared_by_the_next_write(tmp_path):
  out = tmp_path / "policy"
  _write(out, "old")
  _killed_while_staging(out, kill_after_renames=None)
  assert len(_areas(out)) == 1
  assert (out / "weights").read_text() == "old"
  with staging.staged_folder(out) as folder:
    _write(folder, "newer")
  assert os.listdir(tmp_path) == ["policy"]
  assert (out / "weights").read_text() == "newer"


def test_a_kill_between_the_renames_is_finished_by_the_next_writer(tmp_path):
  # The old folder was moved aside, the complete new one not yet renamed:
  # the destination is missing until a writer of it comes.
  out = tmp_path / "policy"
  _write(out, "old")
  _killed_while_staging(out, kill_after_renames=1)
  assert not out.exists() and len(_areas(out)) == 1
  staging.clear_stale(out)
  assert os.listdir(tmp_path) == ["policy"]
  assert (out / "weights").read_text() == "new"


def test_a_live_writers_area_is_left_alone(tmp_path):
  out = tmp_path / "policy"
  with staging.staging_area(out) as area:
    staging.clear_stale(out)
    assert area.is_dir()
  assert not area.exists()


def test_an_unowned_area_is_cleared_only_once_old(tmp_path):
  out = tmp_path / "policy"
  fresh, old = (tmp_path / f".policy.partial-{s}" for s in ("a", "b"))
  fresh.mkdir()
  old.mkdir()
  then = time.time() - staging.UNOWNED_STALE_S - 1
  os.utime(old, (then, then))
  staging.clear_stale(out)
  assert _areas(out) == [fresh]


def test_a_failed_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
  out = tmp_path / "policy"
  _write(out, "old")
  real, calls = os.replace, []

  def replace(a, b):
    calls.append(b)
    if len(calls) == 2:  # the new folder into place
      raise OSError("rename failed")
    real(a, b)

  monkeypatch.setattr(staging.os, "replace", replace)
  with pytest.raises(OSError, match="rename failed"):
    with staging.staged_folder(out) as folder:
      _write(folder, "new")
  monkeypatch.undo()
  assert (out / "weights").read_text() == "old"
  assert os.listdir(tmp_path) == ["policy"]


def _area_of(destination, **owner):
  area = destination.parent / f".{destination.name}.partial-test"
  area.mkdir()
  record = {**staging._this_process(destination), **owner}
  (area / ".owner").write_text(json.dumps(record))
  return area


@pytest.mark.parametrize(
    "owner, gone",
    [
        ({}, False),  # this very process
        ({"start": "0"}, True),  # its process id, another process
        ({"boot": "another boot"}, True),
        ({"pid_namespace": 1}, False),  # another container: cannot tell
        ({"host": "elsewhere"}, False),
        ({"out": "other"}, False),  # another destination's area
    ],
)
def test_who_owns_an_area(tmp_path, owner, gone):
  out = tmp_path / "policy"
  area = _area_of(out, **owner)
  staging.clear_stale(out)
  assert area.exists() is not gone


def test_names_are_matched_literally(tmp_path):
  out = tmp_path / "run[1]"
  area = _area_of(out, start="0")
  staging.clear_stale(tmp_path / "run1")
  assert area.exists()
  staging.clear_stale(out)
  assert not area.exists()
