"""Episodes: the model's turns and the environment's answers, as tokens.

An episode's token sequence is ``prompt + turn 1 + environment 1 + turn 2 +
...``. The model's turns are what the sampler drew (its ids and
log-probabilities, never re-tokenized); the environment's messages are
rendered to tokens between them and are context only: the loss mask is 1 on
the model's tokens and 0 on the environment's (:func:`episode_sequence`).

The learner's batch holds the episode as one row (:func:`episode_rows`):
the prompt, then the episode's sequence as the completion, with an
attention mask that is 1 on all of it and a loss mask that is 1 on the
model's tokens only, so the environment's tokens are attended to but never
scored, and the model's tokens carry the log-probabilities they were
sampled with. The shared history is computed once, and an episode pads only
to the batch's longest (``tests/envs/test_mask.py`` checks the loss and the
gradients against one row per turn).

A model turn ends at the sampler's stop token, or at the first of the
environment's ``stop_strings`` (the closing tag of a tool call), keeping
the tokens up to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from logra_jax.deadlines import call_bounded
from logra_jax.envs.base import Environment
from logra_jax.envs.base import Message
from logra_jax.envs.base import StepResult
from logra_jax.envs.verifiers_source import VerifiersTaskset

Factory = Callable[[], Environment]
# sample_turn(histories, turn) -> (tokens_NxT, logprobs_NxT, lengths_N) on
# the host: one model turn of every episode (finished ones are ignored).
SampleTurn = Callable[
    [list[list[int]], int], tuple[np.ndarray, np.ndarray, np.ndarray]
]
# An environment's tools: JSON schemas of functions, as transformers'
# apply_chat_template(tools=...) takes them; None: no tools.
Tools = Optional[list[dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
  """How a run plays episodes.

  Attributes:
    factory: makes one environment per episode (``task.environment``), or
      the ``verifiers`` taskset whose episodes are played instead.
    max_turns: model turns per episode at most (``rollout.max_turns``).
    max_tokens: tokens after the prompt per episode at most, the model's
      and the environment's (``rollout.max_episode_tokens``); ``None``:
      bounded by the context only.
    timeout_s: seconds each environment call (the factory and ``reset``
      together, or one ``step``) may take (``rollout.env_timeout_s``); past
      it the episode ends as a failure and a timeout. ``None``: calls run
      in the caller's thread, unbounded.
  """

  factory: Factory | VerifiersTaskset
  max_turns: int = 1
  max_tokens: Optional[int] = None
  timeout_s: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Renderer:
  """Chat messages as the policy's tokens.

  Without ``chat`` the messages' contents are shown as plain text, one per
  line, and an environment's messages after a model turn as their contents
  on lines of their own. With ``chat`` the tokenizer's chat template renders
  the conversation as transformers does, turn by turn: the environment's
  tokens are the template's text between the model's turn (as sampled) and
  the next assistant turn. An environment's ``tools`` (JSON schemas) are
  the template's ``tools=`` argument, which a template with tool support
  renders (its tool format and the schemas, usually in the system turn)
  and one without ignores.

  Attributes:
    tokenizer: a ``transformers`` tokenizer.
    chat: render with the tokenizer's chat template.
    system_prompt: with ``chat``, a system message before the opening ones.

  Example:
    >>> from logra_jax.data.tokenizer import char_tokenizer
    >>> renderer = Renderer(char_tokenizer())
    >>> renderer.tokenizer.decode(renderer.environment_ids(
    ...     [], "", False, [{"role": "tool", "content": "42"}]))
    '\\n42\\n'
  """

  tokenizer: Any
  chat: bool = False
  system_prompt: Optional[str] = None

  def _template(
      self, messages: list[Message], generation: bool, tools: Tools
  ) -> str:
    return self.tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=generation,
    )

  def opening(self, messages: list[Message]) -> list[Message]:
    """The messages the template sees first (the system prompt added)."""
    if self.chat and self.system_prompt is not None:
      return [{"role": "system", "content": self.system_prompt}, *messages]
    return list(messages)

  def prompt_ids(
      self, messages: list[Message], tools: Tools = None
  ) -> list[int]:
    """The opening messages' tokens, the assistant's turn opened (with the
    chat template's rendering of ``tools``)."""
    if not self.chat:
      text = "\n".join(m["content"] for m in messages)
      return self.tokenizer(text)["input_ids"]
    text = self._template(messages, generation=True, tools=tools)
    return self.tokenizer(text, add_special_tokens=False)["input_ids"]

  def environment_ids(
      self,
      conversation: list[Message],
      turn_text: str,
      stopped: bool,
      messages: list[Message],
      tools: Tools = None,
  ) -> list[int]:
    """The tokens of the environment's ``messages`` after the model's turn.

    Args:
      conversation: the messages before the model's turn.
      turn_text: the model's turn, decoded without its stop token.
      stopped: the turn's tokens end with the sampler's stop token.
      messages: the environment's messages.
      tools: the environment's tools, as the episode's prompt rendered them.

    Returns:
      The token ids shown between the turn and the model's next turn.

    Raises:
      ValueError: a chat template whose rendering with ``messages`` does not
        extend its rendering without them.
    """
    if not self.chat:
      text = "\n" + "\n".join(m["content"] for m in messages) + "\n"
      return self.tokenizer(text, add_special_tokens=False)["input_ids"]
    turn = [*conversation, {"role": "assistant", "content": turn_text}]
    before = self._template(turn, generation=False, tools=tools)
    after = self._template([*turn, *messages], generation=True, tools=tools)
    end = before.rfind(turn_text) + len(turn_text)
    if not after.startswith(before) or end < len(turn_text):
      raise ValueError(
          "the chat template does not render the conversation turn by turn"
      )
    closing = before[end:]  # what the template writes after the turn
    if stopped:  # the sampled stop token wrote the first of it
      stop_text = self.tokenizer.eos_token or ""
      closing = (
          closing[len(stop_text) :]
          if closing.startswith(stop_text)
          else closing
      )
    text = closing + after[len(before) :]
    return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclasses.dataclass
class Episode:
  """One episode as it is played.

  Attributes:
    environment: the episode's environment (``None`` once it failed).
    conversation: the chat messages so far.
    prompt_ids: the opening messages' tokens.
    tools: the environment's tools, rendered by the chat template.
    turns: the model's tokens of each turn.
    logprobs: the sampler's log-probabilities of each turn's tokens.
    contexts: the environment's tokens after each turn but the last.
    answer: what the run's rewards score (set when the episode ends).
    reward: the environment's rewards, summed.
    tool_calls: tool calls run.
    failures: failed steps (environment errors included).
    timeouts: environment calls that ran past the time limit (counted in
      ``failures`` too).
    truncated: ended by the turn, token or context bound, not by the
      environment.
    done: over.
  """

  environment: Optional[Environment]
  conversation: list[Message]
  prompt_ids: list[int]
  tools: Tools = None
  turns: list[list[int]] = dataclasses.field(default_factory=list)
  logprobs: list[list[float]] = dataclasses.field(default_factory=list)
  contexts: list[list[int]] = dataclasses.field(default_factory=list)
  answer: str = ""
  reward: float = 0.0
  tool_calls: int = 0
  failures: int = 0
  timeouts: int = 0
  truncated: bool = False
  done: bool = False

  def history(self) -> list[int]:
    """The tokens the model's next turn follows."""
    ids = list(self.prompt_ids)
    for turn, context in zip(self.turns, self.contexts):
      ids += turn + context
    return ids

  def used(self) -> int:
    """Tokens after the prompt so far."""
    return sum(map(len, self.turns)) + sum(map(len, self.contexts))


def _opening(factory: Factory, example: Mapping[str, Any]):
  """A new environment, its opening messages (checked) on a copy of
  ``example``, so that a call abandoned past its time limit cannot change
  the example the episode's group shares, and its tools (copied)."""
  environment = factory()
  messages = environment.reset(dict(example))
  tools = getattr(environment, "tools", None)
  if tools is not None:
    if not isinstance(tools, (list, tuple)) or not all(
        isinstance(tool, dict) for tool in tools
    ):
      raise TypeError(f"tools is {type(tools).__name__}, not a list of dicts")
    tools = [dict(tool) for tool in tools] or None
  return environment, _checked_messages(messages, "reset"), tools


def start(
    factory: Factory,
    example: Mapping[str, Any],
    renderer: Renderer,
    timeout_s: Optional[float] = None,
) -> Episode:
  """A new episode on ``example``; an environment that fails to start (or
  to start within ``timeout_s`` seconds) gives a failed episode of the
  bare prompt (no turns)."""
  try:
    environment, messages, tools = call_bounded(
        lambda: _opening(factory, example), timeout_s, "environment call"
    )
  except Exception as error:  # noqa: BLE001 -- user code: a failed episode.
    messages = [{"role": "user", "content": str(example["prompt"])}]
    episode = Episode(None, messages, renderer.prompt_ids(messages))
    episode.failures, episode.done = 1, True
    episode.timeouts = int(isinstance(error, TimeoutError))
    return episode
  messages = renderer.opening(messages)
  return Episode(
      environment, messages, renderer.prompt_ids(messages, tools), tools
  )


def _checked_messages(messages: Any, method: str) -> list[Message]:
  """Copies of ``messages`` if it is a list of role/content string dicts."""
  if not isinstance(messages, list) or not all(
      isinstance(m, dict)
      and isinstance(m.get("role"), str)
      and isinstance(m.get("content"), str)
      for m in messages
  ):
    raise TypeError(
        f"{method} returned {type(messages).__name__}, not a list of "
        "role/content messages"
    )
  return [dict(m) for m in messages]


def cut_at(tokens: list[int], stop_strings: Sequence[str], decode) -> int:
  """How many of ``tokens`` a turn keeps: up to the end of the first stop
  string in their text, or all of them.

  Example:
    >>> cut_at([1, 2, 3, 4], ["c"], lambda ids: "abcd"[: len(ids)])
    3
  """
  text = decode(tokens)
  if not any(s in text for s in stop_strings):
    return len(tokens)
  low, high = 1, len(tokens)  # the shortest prefix whose text holds one
  while low < high:
    middle = (low + high) // 2
    if any(s in decode(tokens[:middle]) for s in stop_strings):
      high = middle
    else:
      low = middle + 1
  return low


def _checked_step(environment: Environment, text: str) -> StepResult:
  """``environment.step(text)`` if it is a :class:`StepResult` of messages
  with a numeric reward, its messages copied."""
  result = environment.step(text)
  if not isinstance(result, StepResult):
    raise TypeError(f"step returned {type(result).__name__}")
  messages = _checked_messages(result.messages, "step")
  if result.reward is not None:
    float(result.reward)
  return dataclasses.replace(result, messages=messages)


def _step(
    episode: Episode, text: str, timeout_s: Optional[float] = None
) -> StepResult:
  """The environment's answer to a turn; an error, a malformed answer or
  a call past ``timeout_s`` seconds is a failed step that ends the episode
  with an empty answer and no reward of its own (the environment is
  dropped: an abandoned call cannot reach the episode)."""
  environment = episode.environment
  try:
    return call_bounded(
        lambda: _checked_step(environment, text), timeout_s, "environment call"
    )
  except Exception as error:  # noqa: BLE001 -- user code: a failed episode.
    episode.environment = None
    episode.timeouts += int(isinstance(error, TimeoutError))
    return StepResult(done=True, answer="", failed=True)


def play_turn(
    episode: Episode,
    tokens: list[int],
    logprobs: list[float],
    renderer: Renderer,
    stop_ids: Sequence[int],
    last: bool,
    room: int,
    timeout_s: Optional[float] = None,
) -> None:
  """Adds a model turn (already cut) to ``episode`` and the environment's
  answer (within ``timeout_s`` seconds); ends the episode when the
  environment, ``last`` or ``room`` (the tokens the next turn's history may
  hold) says so."""
  stopped = bool(tokens) and tokens[-1] in stop_ids
  text = renderer.tokenizer.decode(
      tokens[:-1] if stopped else tokens, skip_special_tokens=True
  )
  episode.turns.append(list(tokens))
  episode.logprobs.append(list(logprobs))
  result = _step(episode, text, timeout_s)
  episode.reward += float(result.reward or 0.0)
  episode.tool_calls += int(result.tool_calls)
  episode.failures += int(result.failed)
  episode.answer = text if result.answer is None else result.answer
  if result.done:
    episode.done = True
    return
  try:
    context = renderer.environment_ids(
        episode.conversation, text, stopped, result.messages, episode.tools
    )
  except Exception:  # noqa: BLE001 -- a template that cannot render it.
    episode.failures += 1
    episode.done = True
    return
  episode.conversation += [{"role": "assistant", "content": text}]
  episode.conversation += result.messages
  if last or len(episode.history()) + len(tokens) + len(context) > room:
    episode.truncated = episode.done = True
    return
  episode.contexts.append(context)


def run_episodes(
    config: EpisodeConfig,
    examples: Sequence[Mapping[str, Any]],
    renderer: Renderer,
    sample_turn: SampleTurn,
    *,
    stop_ids: Sequence[int],
    context: int,
) -> list[Episode]:
  """Plays one episode per example, all turns of a round sampled at once.

  Args:
    config: the environment and the bounds.
    examples: one per episode (a GRPO group repeats its example).
    renderer: messages to tokens.
    sample_turn: samples one turn of every episode's history.
    stop_ids: the sampler's stop tokens.
    context: the longest history a turn may follow (the sampler's context
      less the turn's tokens).

  Returns:
    The episodes, in the order of ``examples``.
  """
  episodes = [
      start(config.factory, e, renderer, config.timeout_s) for e in examples
  ]
  budget = config.max_tokens or np.iinfo(np.int64).max
  decode = lambda ids: renderer.tokenizer.decode(ids)  # noqa: E731
  for turn in range(config.max_turns):
    if all(e.done for e in episodes):
      break
    tokens_NxT, logprobs_NxT, lengths_N = sample_turn(
        [e.history() for e in episodes], turn
    )
    for i, episode in enumerate(episodes):
      if episode.done:
        continue
      tokens = [int(t) for t in tokens_NxT[i, : lengths_N[i]]]
      stops = getattr(episode.environment, "stop_strings", ())
      keep = min(cut_at(tokens, stops, decode), budget - episode.used())
      play_turn(
          episode,
          tokens[:keep],
          [float(x) for x in logprobs_NxT[i, :keep]],
          renderer,
          stop_ids,
          last=turn == config.max_turns - 1,
          room=min(context, len(episode.prompt_ids) + budget - 1),
          timeout_s=config.timeout_s,
      )
  return episodes


def episode_sequence(episode: Episode) -> tuple[list[int], list[int]]:
  """The episode's tokens after the prompt and their loss mask (1 on the
  model's tokens, 0 on the environment's).

  Example:
    >>> episode = Episode(None, [], [1], turns=[[5, 6], [7]], contexts=[[9]])
    >>> episode_sequence(episode)
    ([5, 6, 9, 7], [1, 1, 0, 1])
  """
  ids, mask = [], []
  for j, turn in enumerate(episode.turns):
    ids += turn
    mask += [1] * len(turn)
    if j < len(episode.contexts):
      ids += episode.contexts[j]
      mask += [0] * len(episode.contexts[j])
  return ids, mask


class EpisodeRows(NamedTuple):
  """Episodes as the learner's rows, one per episode (module docstring):
  prompts left-padded, sequences right-padded, numpy arrays; ``mask_ExT``
  is 1 on the model's tokens, ``context_mask_ExT`` on the environment's
  too, and ``lengths_E`` counts both."""

  prompt_ids_ExP: np.ndarray
  prompt_mask_ExP: np.ndarray
  tokens_ExT: np.ndarray
  mask_ExT: np.ndarray
  context_mask_ExT: np.ndarray
  logprobs_ExT: np.ndarray
  lengths_E: np.ndarray


def episode_rows(
    episodes: Sequence[Episode],
    width: int,
    pad_id: int = 0,
    bucket: int = 1,
) -> EpisodeRows:
  """The rows of ``episodes``: row ``e`` is episode ``e``'s prompt and its
  :func:`episode_sequence` as the completion, with the log-probabilities its
  turns were sampled with (0 on the environment's tokens).

  Args:
    episodes: played episodes.
    width: completion columns (at least the longest sequence).
    pad_id: the filler id.
    bucket: the prompts' width is a multiple of it (the sampler's bucket
      size, so that the learner compiles for a few widths only).

  Returns:
    The :class:`EpisodeRows`.

  Example:
    >>> episode = Episode(None, [], [1], turns=[[5, 6], [7]],
    ...                   logprobs=[[-1., -2.], [-3.]], contexts=[[9]])
    >>> rows = episode_rows([episode], 5)
    >>> rows.tokens_ExT.tolist(), rows.mask_ExT.tolist()
    ([[5, 6, 9, 7, 0]], [[1, 1, 0, 1, 0]])
    >>> rows.context_mask_ExT.tolist(), rows.logprobs_ExT.tolist()
    ([[1, 1, 1, 1, 0]], [[-1.0, -2.0, 0.0, -3.0, 0.0]])
  """
  rows = len(episodes)
  longest = max(len(e.prompt_ids) for e in episodes)
  longest = -(-longest // bucket) * bucket
  prompt_ids = np.full((rows, longest), pad_id, np.int32)
  prompt_mask = np.zeros((rows, longest), np.int32)
  tokens = np.full((rows, width), pad_id, np.int32)
  mask = np.zeros((rows, width), np.int32)
  context = np.zeros((rows, width), np.int32)
  logp = np.zeros((rows, width), np.float32)
  for r, episode in enumerate(episodes):
    prompt = episode.prompt_ids
    prompt_ids[r, longest - len(prompt) :] = prompt
    prompt_mask[r, longest - len(prompt) :] = 1
    ids, model = episode_sequence(episode)
    if len(ids) > width:
      raise ValueError(f"an episode of {len(ids)} tokens exceeds {width=}")
    tokens[r, : len(ids)] = ids
    mask[r, : len(ids)] = model
    context[r, : len(ids)] = 1
    logp[r, np.flatnonzero(model)] = [x for lp in episode.logprobs for x in lp]
  return EpisodeRows(
      prompt_ids, prompt_mask, tokens, mask, context, logp, context.sum(axis=1)
  )
