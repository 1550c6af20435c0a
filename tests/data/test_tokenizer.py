"""Tests for the character tokenizer and the prompt/completion batching helpers."""

import numpy as np
import pytest
import transformers

from logra_jax.data import batching, tasks, tokenizer


@pytest.fixture(scope="module")
def tok():
  return tokenizer.char_tokenizer()


def test_special_ids_and_vocab(tok):
  assert (
      (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id)
      == (
          tokenizer.PAD_ID,
          tokenizer.BOS_ID,
          tokenizer.EOS_ID,
          tokenizer.UNK_ID,
      )
      == (0, 1, 2, 3)
  )
  assert len(tok) == 4 + len(tokenizer.DEFAULT_ALPHABET) == 100
  assert tok.convert_ids_to_tokens([4, 13, 14]) == ["0", "9", "a"]


@pytest.mark.parametrize(
    "text",
    [
        "12+7-3=16",
        " a , b .\n x ",
        "Question: What's 6*7?\nAnswer: 42",
        "(x^2)/{y} != [z]",
    ],
)
def test_round_trip(tok, text):
  ids = tok(text)["input_ids"]
  assert ids[0] == tokenizer.BOS_ID and len(ids) == len(text) + 1
  assert tok.decode(ids, skip_special_tokens=True) == text


def test_unknown_characters(tok):
  assert tok("1é")["input_ids"] == [tokenizer.BOS_ID, 5, tokenizer.UNK_ID]


def test_save_and_autotokenizer_reload(tok, tmp_path):
  tok.save_pretrained(tmp_path)
  assert (tmp_path / "tokenizer.json").exists()
  loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
  text = "98+93-77=114"
  assert loaded(text)["input_ids"] == tok(text)["input_ids"]
  assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (
      0,
      1,
      2,
  )
  assert loaded.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
  assert loaded.padding_side == "left"


def test_alphabet_errors():
  with pytest.raises(ValueError, match=r"repeated characters: \['a'\]"):
    tokenizer.char_tokenizer("abca")


def test_encode_prompts_left_pads(tok):
  batch = batching.encode_prompts(tok, ["1+2=", "13+5="], max_len=8)
  np.testing.assert_array_equal(
      batch.tokens_BxP, [[0, 0, 0, 1, 5, 78, 6, 86], [0, 0, 1, 5, 7, 78, 9, 86]]
  )
  np.testing.assert_array_equal(
      batch.mask_BxP, [[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]]
  )
  assert batch.tokens_BxP.dtype == batch.mask_BxP.dtype == np.int32
  assert batching.encode_prompts(tok, ["1+2=", "13+5="]).tokens_BxP.shape == (
      2,
      6,
  )
  with pytest.raises(
      ValueError, match="prompt 1 has 6 tokens, more than max_len=5"
  ):
    batching.encode_prompts(tok, ["1+2=", "13+5="], max_len=5)
  with pytest.raises(ValueError, match="empty list"):
    batching.encode_prompts(tok, [])


def test_decode_completions_stops_at_eos(tok):
  eos, pad = tokenizer.EOS_ID, tokenizer.PAD_ID
  tokens = np.array(
      [[5, 6, eos, 7, pad], [7, pad, pad, pad, pad], [4, 5, 6, 7, 8]]
  )
  assert batching.decode_completions(tok, tokens) == ["12", "3", "01234"]
  assert batching.decode_completions(tok, tokens, stop_ids=[6]) == [
      "1",
      "3",
      "01",
  ]
  with pytest.raises(ValueError, match="2-D"):
    batching.decode_completions(tok, tokens[0])


def test_encode_sft_worked_answers(tok):
  examples = tasks.tiny_arithmetic_task(size=4).examples
  prompts = [e["prompt"] for e in examples]
  answers = [e["answer"] for e in examples]
  batch = batching.encode_sft(tok, prompts, answers, max_len=16)
  for row, (p, a) in enumerate(zip(prompts, answers)):
    n = 1 + len(p) + len(a) + 1
    assert batch.tokens_BxT[row, 0] == tokenizer.BOS_ID
    assert batch.tokens_BxT[row, n - 1] == tokenizer.EOS_ID
    assert batch.mask_BxT[row].sum() == n
    targets = batch.tokens_BxT[row][batch.loss_mask_BxT[row] == 1]
    assert tok.decode(targets[:-1]) == a and targets[-1] == tokenizer.EOS_ID
    text = tok.decode(batch.tokens_BxT[row], skip_special_tokens=True)
    assert text == tasks.worked_answers([examples[row]])[0]
  with pytest.raises(ValueError, match="2 prompts but 1 answers"):
    batching.encode_sft(tok, prompts[:2], answers[:1])
