"""Fixtures of the checkpoint tests: a tiny policy and the smoke run on it."""

from run_fixtures import (  # noqa: F401 (fixtures)
    config,
    policy_folder,
    straight,
)
