"""A character-level tokenizer for the tiny CPU default, as a Hugging Face fast tokenizer.

One token per character of a fixed alphabet (digits, letters, space, newline, ASCII
punctuation) after four special tokens. Built with the ``tokenizers`` library and wrapped as a
``transformers`` fast tokenizer, so ``save_pretrained(folder)`` writes ``tokenizer.json`` and
``AutoTokenizer.from_pretrained(folder)`` loads it back like any model's tokenizer.
"""

from __future__ import annotations

import string

import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, processors

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

DEFAULT_ALPHABET: str = (
    string.digits
    + string.ascii_lowercase
    + string.ascii_uppercase
    + " \n"
    + string.punctuation
)


def char_tokenizer(
    alphabet: str = DEFAULT_ALPHABET,
) -> transformers.PreTrainedTokenizerFast:
  """Builds the character-level tokenizer over ``alphabet``.

  Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then the alphabet in order (so
  the default vocabulary has 100 entries). Encoding prepends ``<bos>`` (pass
  ``add_special_tokens=False`` to omit it); characters outside the alphabet become ``<unk>``;
  decoding concatenates characters. Padding is on the left (prompts for generation).

  Args:
    alphabet: the characters, each at most once, none of them a special token.

  Returns:
    A ``transformers.PreTrainedTokenizerFast`` with ``pad_token_id``, ``bos_token_id``,
    ``eos_token_id`` and ``unk_token_id`` set.

  Example:
    >>> tok = char_tokenizer()
    >>> tok("12+7=")["input_ids"]
    [1, 5, 6, 78, 11, 86]
    >>> tok.decode([5, 6, 2], skip_special_tokens=True)
    '12'
    >>> paths = tok.save_pretrained("/tmp/tiny_tok")  # AutoTokenizer.from_pretrained loads it
  """
  if len(set(alphabet)) != len(alphabet):
    duplicates = sorted({c for c in alphabet if alphabet.count(c) > 1})
    raise ValueError(f"alphabet has repeated characters: {duplicates}.")
  if not alphabet:
    raise ValueError(
        "alphabet is empty; pass the characters the tokenizer must cover."
    )
  vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(alphabet))}
  backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
  backend.pre_tokenizer = pre_tokenizers.Split(
      tokenizers.Regex(r"[\s\S]"), behavior="isolated"
  )
  backend.decoder = decoders.Fuse()
  backend.post_processor = processors.TemplateProcessing(
      single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
  )
  backend.add_special_tokens(list(SPECIAL_TOKENS))
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend,
      bos_token=BOS,
      eos_token=EOS,
      pad_token=PAD,
      unk_token=UNK,
      padding_side="left",
      clean_up_tokenization_spaces=False,
  )
