"""A policy folder whose tokenizer files are missing or damaged is refused
in one line naming the folder and its tokenizer files (transformers' own
errors name neither)."""

import pytest

from logra_jax.models import hf_io


def test_a_missing_tokenizer_json_is_named(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text("{}")
  with pytest.raises(ValueError) as error:
    hf_io.load_tokenizer(tmp_path)
  message = str(error.value)
  assert message.startswith(
      f"the tokenizer in {tmp_path} cannot be loaded from its files "
      "(tokenizer_config.json; no tokenizer.json): "
  ), message
  assert "\n" not in message


def test_a_damaged_tokenizer_json_is_named(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text("{}")
  (tmp_path / "tokenizer.json").write_text("{garbage")
  with pytest.raises(ValueError) as error:
    hf_io.load_tokenizer(tmp_path)
  message = str(error.value)
  assert message.startswith(
      f"the tokenizer in {tmp_path} cannot be loaded from its files "
      "(tokenizer.json, tokenizer_config.json): JSONDecodeError: "
  ), message
  assert "\n" not in message
