"""Fixtures of the rollout tests: a tiny policy."""

from run_fixtures import policy_folder  # noqa: F401 (a fixture)
