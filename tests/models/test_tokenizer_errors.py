"""A policy folder whose tokenizer files are missing or damaged is refused
in one line naming the folder and its tokenizer files (transformers' own
errors name neither)."""

import pytest

from logra_jax.models import hf_io


@pytest.mark.parametrize(
    "tokenizer_json, named",
    [
        (None, "(tokenizer_config.json; no tokenizer.json): "),
        (
            "{garbage",
            "(tokenizer.json, tokenizer_config.json): JSONDecodeError: ",
        ),
    ],
    ids=["missing", "damaged"],
)
def test_unloadable_tokenizer_files_are_named(tmp_path, tokenizer_json, named):
  (tmp_path / "tokenizer_config.json").write_text("{}")
  if tokenizer_json is not None:
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
  with pytest.raises(ValueError) as error:
    hf_io.load_tokenizer(tmp_path)
  message = str(error.value)
  assert message.startswith(
      f"the tokenizer in {tmp_path} cannot be loaded from its files {named}"
  ), message
  assert "\n" not in message
