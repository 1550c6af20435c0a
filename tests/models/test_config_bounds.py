"""A decoder's sizes are positive ints JAX's int32 can hold: a vocabulary
of 1e15 in a config.json is refused naming the field (it ended in an
OverflowError traceback inside a jitted computation)."""

import pytest

from logra_jax.models.config import DecoderConfig

SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
)


@pytest.mark.parametrize("value", [0, 2**31, 10**15, "64"])
def test_a_size_out_of_int32_or_not_an_int_is_refused(value):
  with pytest.raises(
      ValueError,
      match=r"^DecoderConfig\.vocab_size must be a positive int below 2\*\*31",
  ):
    DecoderConfig(**{**SIZES, "vocab_size": value})


def test_the_largest_int32_size_is_accepted():
  assert DecoderConfig(**{**SIZES, "vocab_size": 2**31 - 1}).vocab_size
