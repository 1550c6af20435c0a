"""JAX's persistent compilation cache: on by default in a documented folder,
a folder the user chose kept, off with LOGRA_COMPILATION_CACHE=0, small
programs cached too."""

import os
import subprocess
import sys

import jax
import pytest

from logra_jax.rl import compilation_cache

NAMES = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
)


@pytest.fixture
def restore_config():
  old = {name: getattr(jax.config, name) for name in NAMES}
  jax.config.update(NAMES[0], None)
  yield
  for name, value in old.items():
    jax.config.update(name, value)


def test_default_folder_and_every_program_cached(tmp_path, restore_config):
  folder = compilation_cache.enable_compilation_cache(
      {"XDG_CACHE_HOME": str(tmp_path)}
  )
  assert folder == tmp_path / "logra_jax" / "xla"
  assert jax.config.jax_compilation_cache_dir == str(folder)
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0


def test_a_folder_the_user_chose_is_kept(tmp_path, restore_config):
  jax.config.update(NAMES[0], str(tmp_path / "mine"))
  folder = compilation_cache.enable_compilation_cache({"XDG_CACHE_HOME": "/x"})
  assert folder == tmp_path / "mine"
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_turned_off_it_changes_nothing(value, restore_config):
  before = {name: getattr(jax.config, name) for name in NAMES}
  environ = {"LOGRA_COMPILATION_CACHE": value, "XDG_CACHE_HOME": "/x"}
  assert compilation_cache.enable_compilation_cache(environ) is None
  assert {name: getattr(jax.config, name) for name in NAMES} == before


def test_a_small_program_is_written_to_the_folder(tmp_path):
  environ = {
      k: v
      for k, v in os.environ.items()
      if k not in ("LOGRA_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR")
  }
  code = (
      "import jax\n"
      "from logra_jax.rl import compilation_cache\n"
      "compilation_cache.enable_compilation_cache()\n"
      "print(jax.jit(lambda x: x + 1)(1.0))\n"
  )
  done = subprocess.run(
      [sys.executable, "-c", code],
      env={**environ, "XDG_CACHE_HOME": str(tmp_path)},
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  written = list((tmp_path / "logra_jax" / "xla").glob("jit__lambda*"))
  assert written, sorted((tmp_path / "logra_jax" / "xla").rglob("*"))
