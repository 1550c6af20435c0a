"""The environment interface: small and synchronous.

An environment plays one episode with the policy. :meth:`Environment.reset`
turns a task example into the opening chat messages (``{"role": ...,
"content": ...}`` dicts); each model turn goes to :meth:`Environment.step`,
which answers with more messages (tool results, feedback), an optional
reward and whether the episode is over. The rollout renders the messages to
tokens, samples the model's turns and trains on them; the environment's
tokens are context only (see :mod:`logra_jax.envs.episodes`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Protocol, runtime_checkable

Message = dict[str, str]


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What an environment answers to one model turn.

  Attributes:
    messages: the environment's messages shown to the model before its next
      turn (e.g. ``{"role": "tool", "content": "8369910"}``); ignored when
      ``done``.
    reward: a reward of this step, added to the episode's; ``None`` adds
      nothing.
    done: the episode is over.
    answer: with ``done``, the text the run's reward functions score (e.g.
      what the model wrote between answer tags); ``None``: the model's last
      message as written.
    tool_calls: tool calls the environment ran in this step.
    failed: the step failed (a malformed or unknown tool call, an error the
      environment caught); counted in the metrics.

  Example:
    >>> StepResult([{"role": "tool", "content": "42"}], tool_calls=1).done
    False
  """

  messages: list[Message] = dataclasses.field(default_factory=list)
  reward: Optional[float] = None
  done: bool = False
  answer: Optional[str] = None
  tool_calls: int = 0
  failed: bool = False


@runtime_checkable
class Environment(Protocol):
  """One episode's environment, made by a factory (one call per episode).

  ``stop_strings`` (optional attribute): texts that end a model turn, e.g.
  the closing tag of a tool call; the turn keeps its tokens up to the first
  one and the rest of what was sampled is dropped.

  ``tools`` (optional attribute): the environment's tools as JSON schemas
  (OpenAI's function format), rendered by a chat template with tool
  support as transformers' ``apply_chat_template(..., tools=tools)`` does;
  a template without it ignores them.
  """

  def reset(self, example: Mapping[str, Any]) -> list[Message]:
    """The opening messages of an episode on ``example`` (a task example:
    ``prompt``, ``answer`` and the task's other columns)."""

  def step(self, model_message: str) -> StepResult:
    """The environment's answer to the model's turn ``model_message``."""
