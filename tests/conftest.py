"""Test configuration: 8 fake CPU devices, float32 matmuls, shared fixtures."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `logra train` caches compiled programs in ~/.cache/logra_jax/xla by
# default; the suite (and the runs it starts) writes nothing there: tests
# that want a cache use a folder of their own (run_fixtures.compilation_cache).
os.environ["LOGRA_COMPILATION_CACHE"] = "0"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

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
