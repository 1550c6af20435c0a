"""Test configuration: 8 fake CPU devices, float32 matmuls, shared fixtures."""

import os
import shutil
import tempfile

SUITE_CACHE = "LOGRA_TEST_COMPILATION_CACHE"

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# XLA's CPU backend at optimization level 0: the suite compiles hundreds of
# tiny programs, whose run time is small beside their compile time, and
# this level takes about a third less CPU time (344 -> 235 CPU-seconds on the
# mesh and quick-study tests). The tests check invariants between programs
# compiled alike (bit identity, resume, sync) and tolerances against
# references, which hold at every level; the default level is what `logra`
# runs with outside the suite.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole suite, its workers and the
# runs they start (`logra train` keeps a folder the environment names): the
# tests compile the same tiny programs again and again, in many processes.
# XLA's compilation is deterministic, so no number changes. The folder is
# the suite's own (never ~/.cache), made by the first process and inherited
# by the pytest-xdist workers; the first process removes it at the end.
_OWN_CACHE = SUITE_CACHE not in os.environ
if _OWN_CACHE:
  os.environ[SUITE_CACHE] = tempfile.mkdtemp(prefix="logra-test-xla-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[SUITE_CACHE]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests: a fixed set of examples, so that every run (and CI) tries
# the same ones; compiling each example dominates, so keep them few.
# HYPOTHESIS_PROFILE=explore searches new random examples by hand.
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
)
settings.register_profile("explore", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(items):
  """Tests marked ``slow`` (half a minute or more on 2 cores) run first, in
  their collection order, so that pytest-xdist spreads them over its workers
  instead of leaving one worker with a long test at the end."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_terminal_summary(terminalreporter, config):
  """The shuffled order's seed (pytest-random-order), also under ``-q``,
  which hides the header that names it: a failing order is replayed with
  ``--random-order-seed``."""
  seed = str(config.getoption("random_order_seed", default="default:"))
  given = not seed.startswith("default:")
  if given or config.getoption("random_order_enabled", default=False):
    seed = seed.removeprefix("default:")
    terminalreporter.write_line(f"test order: --random-order-seed={seed}")


def pytest_sessionfinish(session):
  """The process that made the suite's cache (not an xdist worker, not a
  pytest started by a test) removes it."""
  del session
  if _OWN_CACHE:
    shutil.rmtree(os.environ[SUITE_CACHE], ignore_errors=True)


@pytest.fixture
def without_compilation_cache():
  """Every program compiled here, none read back from the suite's cache (for
  tests that count XLA compilations)."""
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  yield
  jax.config.update("jax_enable_compilation_cache", enabled)
