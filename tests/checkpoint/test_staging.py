"""Tests of logra_jax.staging: a folder appears whole or not at all."""

import os

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
