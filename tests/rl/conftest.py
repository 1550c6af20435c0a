"""Fixtures shared by the RL tests."""

import pytest

from logra_jax import models
from logra_jax.data.tokenizer import char_tokenizer
from run_fixtures import compilation_cache, config, straight  # noqa: F401


@pytest.fixture(scope="module")
def policy_folder(tmp_path_factory):
  """A tiny random decoder with the character tokenizer, as an HF folder."""
  folder = tmp_path_factory.mktemp("policy") / "tiny"
  tokenizer = char_tokenizer()
  model_config = models.DecoderConfig.tiny(
      vocab_size=len(tokenizer),
      max_position_embeddings=64,
      eos_token_ids=(tokenizer.eos_token_id,),
      bos_token_id=tokenizer.bos_token_id,
      pad_token_id=tokenizer.pad_token_id,
  )
  models.save_pretrained(models.init_model(model_config, rngs=0), folder)
  tokenizer.save_pretrained(folder)
  return folder
