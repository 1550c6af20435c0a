"""Host-side batching: prompts to left-padded int32 arrays, completions back to strings.

Works with any Hugging Face tokenizer (the tiny character tokenizer or a model's own).
Arrays are NumPy (host memory); the rollout moves them to devices.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import numpy as np
import transformers

Tokenizer = transformers.PreTrainedTokenizerBase


@flax.struct.dataclass
class PromptBatch:
  """Left-padded prompts: real tokens end at the last column, ready for generation.

  Attributes:
    tokens_BxP: int32 token ids, ``pad_token_id`` on the left.
    mask_BxP: int32, 1 on prompt tokens and 0 on padding.
  """

  tokens_BxP: np.ndarray
  mask_BxP: np.ndarray


@flax.struct.dataclass
class SFTBatch:
  """Right-padded ``prompt + answer + eos`` sequences for supervised warm start.

  Attributes:
    tokens_BxT: int32 token ids, ``pad_token_id`` on the right.
    mask_BxT: int32, 1 on real tokens.
    loss_mask_BxT: int32, 1 on the answer and ``eos`` tokens: the targets to predict (the
      logits at position ``t - 1`` predict token ``t``).
  """

  tokens_BxT: np.ndarray
  mask_BxT: np.ndarray
  loss_mask_BxT: np.ndarray


def _pad_id(tokenizer: Tokenizer) -> int:
  """The tokenizer's pad id, or a clear error when it has none."""
  if tokenizer.pad_token_id is None:
    raise ValueError(
        f"tokenizer {type(tokenizer).__name__} has no pad token; set one, e.g. "
        "tokenizer.pad_token = tokenizer.eos_token."
    )
  return tokenizer.pad_token_id


def _check_lengths(
    ids: Sequence[Sequence[int]], max_len: int | None, what: str
) -> int:
  """Returns the padded length: ``max_len``, or the longest sequence when it is None."""
  longest = max(len(x) for x in ids)
  if max_len is None:
    return longest
  if longest > max_len:
    i = max(range(len(ids)), key=lambda j: len(ids[j]))
    raise ValueError(
        f"{what} {i} has {longest} tokens, more than max_len={max_len}; raise max_len or "
        "shorten the text."
    )
  return max_len


def encode_prompts(
    tokenizer: Tokenizer, prompts: Sequence[str], *, max_len: int | None = None
) -> PromptBatch:
  """Tokenizes prompts (with the tokenizer's own special tokens) and left-pads them.

  Args:
    tokenizer: a Hugging Face tokenizer with a pad token.
    prompts: ``B`` prompt strings.
    max_len: pad every row to this length (fixed shapes: no recompiles); ``None`` pads to
      the longest prompt. A longer prompt is an error, never silently truncated.

  Returns:
    A :class:`PromptBatch` of int32 arrays ``[B, P]``.

  Example:
    >>> from logra_jax.data.tokenizer import char_tokenizer
    >>> batch = encode_prompts(char_tokenizer(), ["1+2=", "13+5="], max_len=8)
    >>> batch.tokens_BxP[0]
    array([ 0,  0,  0,  1,  5, 78,  6, 86], dtype=int32)
    >>> batch.mask_BxP[0]
    array([0, 0, 0, 1, 1, 1, 1, 1], dtype=int32)
  """
  if not prompts:
    raise ValueError("no prompts to encode: got an empty list.")
  ids = tokenizer(list(prompts))["input_ids"]
  length = _check_lengths(ids, max_len, "prompt")
  tokens_BxP = np.full((len(ids), length), _pad_id(tokenizer), np.int32)
  mask_BxP = np.zeros((len(ids), length), np.int32)
  for row, seq in enumerate(ids):
    if seq:
      tokens_BxP[row, length - len(seq) :] = seq
      mask_BxP[row, length - len(seq) :] = 1
  return PromptBatch(tokens_BxP=tokens_BxP, mask_BxP=mask_BxP)


def decode_completions(
    tokenizer: Tokenizer,
    tokens_BxT: np.ndarray,
    *,
    stop_ids: Sequence[int] | None = None,
) -> list[str]:
  """Decodes completion tokens to strings, cutting each row at its first stop token.

  Args:
    tokenizer: the tokenizer that produced the ids.
    tokens_BxT: integer array of sampled ids (right-padded completions).
    stop_ids: ids that end a completion (excluded from the text); ``None`` means the
      tokenizer's ``eos_token_id``. Remaining special tokens (padding) are skipped.

  Returns:
    ``B`` strings.

  Example:
    >>> from logra_jax.data.tokenizer import char_tokenizer
    >>> decode_completions(char_tokenizer(), np.array([[5, 6, 2, 7, 0], [7, 0, 0, 0, 0]]))
    ['12', '3']
  """
  if stop_ids is None:
    stop_ids = (
        [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    )
  tokens_BxT = np.asarray(tokens_BxT)
  if tokens_BxT.ndim != 2:
    raise ValueError(
        f"tokens_BxT must be 2-D [B, T], got shape {tokens_BxT.shape}."
    )
  is_stop_BxT = np.isin(
      tokens_BxT, np.asarray(list(stop_ids), dtype=tokens_BxT.dtype)
  )
  has_stop_B = is_stop_BxT.any(axis=1)
  ends_B = np.where(has_stop_B, is_stop_BxT.argmax(axis=1), tokens_BxT.shape[1])
  return tokenizer.batch_decode(
      [row[:end].tolist() for row, end in zip(tokens_BxT, ends_B)],
      skip_special_tokens=True,
  )


def encode_sft(
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    answers: Sequence[str],
    *,
    max_len: int | None = None,
) -> SFTBatch:
  """Encodes ``prompt + answer + eos`` for supervised warm start, loss on answer and eos.

  The prompt is tokenized with the tokenizer's special tokens (e.g. ``<bos>``), the answer
  without, so the sequence is what generation sees: the prompt, then the completion.

  Args:
    tokenizer: a Hugging Face tokenizer with pad and eos tokens.
    prompts: ``B`` prompts.
    answers: ``B`` answers (the text to learn to complete).
    max_len: pad to this length; ``None`` pads to the longest. Longer sequences are errors.

  Returns:
    An :class:`SFTBatch` of int32 arrays ``[B, T]``.

  Example:
    >>> from logra_jax.data.tokenizer import char_tokenizer
    >>> b = encode_sft(char_tokenizer(), ["1+2="], ["3"])
    >>> b.tokens_BxT
    array([[ 1,  5, 78,  6, 86,  7,  2]], dtype=int32)
    >>> b.loss_mask_BxT
    array([[0, 0, 0, 0, 0, 1, 1]], dtype=int32)
  """
  if len(prompts) != len(answers):
    raise ValueError(f"got {len(prompts)} prompts but {len(answers)} answers.")
  if not prompts:
    raise ValueError("no prompts to encode: got an empty list.")
  if tokenizer.eos_token_id is None:
    raise ValueError(f"tokenizer {type(tokenizer).__name__} has no eos token.")
  prompt_ids = tokenizer(list(prompts))["input_ids"]
  answer_ids = tokenizer(list(answers), add_special_tokens=False)["input_ids"]
  ids = [
      p + a + [tokenizer.eos_token_id] for p, a in zip(prompt_ids, answer_ids)
  ]
  length = _check_lengths(ids, max_len, "prompt + answer")
  tokens_BxT = np.full((len(ids), length), _pad_id(tokenizer), np.int32)
  mask_BxT = np.zeros((len(ids), length), np.int32)
  loss_mask_BxT = np.zeros((len(ids), length), np.int32)
  for row, (seq, p) in enumerate(zip(ids, prompt_ids)):
    tokens_BxT[row, : len(seq)] = seq
    mask_BxT[row, : len(seq)] = 1
    loss_mask_BxT[row, len(p) : len(seq)] = 1
  return SFTBatch(
      tokens_BxT=tokens_BxT, mask_BxT=mask_BxT, loss_mask_BxT=loss_mask_BxT
  )
