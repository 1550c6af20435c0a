"""Fixtures shared by the RL tests."""

import pytest

from run_fixtures import config, straight  # noqa: F401
from run_fixtures import make_policy


@pytest.fixture(scope="module")
def policy_folder(tmp_path_factory):
  """A tiny random decoder with the character tokenizer, as an HF folder."""
  return make_policy(tmp_path_factory.mktemp("policy") / "tiny")
