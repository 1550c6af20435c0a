"""The endpoints' request and response bodies, checked field by field.

A request that breaks a rule is refused with :class:`BadRequest` (a 4xx and
a one-line reason naming the field) before it reaches the sampler.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping, Optional

from logra_jax import envs
from logra_jax.serve.batching import Completion
from logra_jax.serve.batching import Settings

# Sampling fields that change nothing here: the server always returns
# log-probabilities and ids, and decodes text without special tokens.
_NEUTRAL = frozenset(
    {
        "logprobs",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "detokenize",
        "routed_experts_prompt_start",
    }
)
_SAMPLING = frozenset({"max_tokens", "temperature", "top_p", "top_k", "n"})
_GENERATE = frozenset(
    {"model", "token_ids", "sampling_params", "cache_salt", "priority"}
)
_CHAT = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stream",
        "logprobs",
        "top_logprobs",
        "tools",
        "chat_template_kwargs",
    }
)
_ROLES = frozenset({"system", "user", "assistant", "tool"})


class BadRequest(Exception):
  """A refused request: its HTTP status and a one-line reason."""

  def __init__(self, status: int, reason: str):
    super().__init__(reason)
    self.status, self.reason = status, reason


@dataclasses.dataclass(frozen=True)
class Request:
  """A checked request, ready for the batcher.

  Attributes:
    prompt_ids: the prompt's ids (the request's, or the chat template's).
    max_tokens: completion tokens at most.
    settings: the sampling settings.
    stop_ids: the request's own stop tokens (the sampler's apply too).
    model: the model the request named.
  """

  prompt_ids: list[int]
  max_tokens: int
  settings: Settings
  stop_ids: tuple[int, ...] = ()
  model: str = ""


def read_body(headers: Mapping[str, str], stream, max_bytes: int) -> Any:
  """The JSON body of a request, at most ``max_bytes`` long.

  Raises:
    BadRequest: 411 without a length, 413 over ``max_bytes``, 400 when the
      body is not JSON.
  """
  length = headers.get("Content-Length")
  if length is None or not length.isdigit():
    raise BadRequest(411, "a Content-Length header is required")
  if int(length) > max_bytes:
    raise BadRequest(413, f"body of {length} bytes over {max_bytes}")
  try:
    return json.loads(stream.read(int(length)))
  except ValueError as e:
    raise BadRequest(400, f"body is not JSON: {e}") from None


def _object(value: Any, field: str) -> dict:
  if not isinstance(value, dict):
    raise BadRequest(400, f"{field} must be a JSON object")
  return value


def _unknown(body: dict, allowed: frozenset, field: str) -> None:
  extra = sorted(set(body) - allowed)
  if extra:
    raise BadRequest(400, f"{field}: unsupported field(s) {extra}")


def _number(body: dict, name: str, default: float, low: float, high: float):
  value = body.get(name, default)
  value = default if value is None else value
  if (
      isinstance(value, bool)
      or not isinstance(value, (int, float))
      or not math.isfinite(value)
      or not low <= value <= high
  ):
    raise BadRequest(400, f"{name}={value!r} must be in [{low}, {high}]")
  return value


def _ids(value: Any, field: str, vocab_size: int) -> list[int]:
  if not isinstance(value, list) or not all(
      isinstance(i, int) and not isinstance(i, bool) for i in value
  ):
    raise BadRequest(400, f"{field} must be a list of integers")
  bad = [i for i in value if not 0 <= i < vocab_size]
  if bad:
    raise BadRequest(400, f"{field}: id {bad[0]} outside [0, {vocab_size})")
  return value


def _sampling(body: dict, limits) -> tuple[int, Settings]:
  """``max_tokens`` and the settings of a request's sampling fields."""
  if body.get("n", 1) not in (1, None):
    raise BadRequest(400, f"n={body['n']!r}: one completion per request")
  max_tokens = _number(
      body, "max_tokens", limits.max_new_tokens, 1, limits.max_new_tokens
  )
  if not isinstance(max_tokens, int):
    raise BadRequest(400, f"max_tokens={max_tokens!r} must be an integer")
  top_k = _number(body, "top_k", 0, -1, limits.vocab_size)
  if not isinstance(top_k, int):
    raise BadRequest(400, f"top_k={top_k!r} must be an integer")
  settings = Settings(
      temperature=float(_number(body, "temperature", 1.0, 0.0, 100.0)),
      top_p=float(_number(body, "top_p", 1.0, 1e-9, 1.0)),
      top_k=max(top_k, 0),  # vLLM's -1 and our 0 both disable it
  )
  return max_tokens, settings


def _prompt_fits(prompt_ids: list[int], limits) -> list[int]:
  if not prompt_ids:
    raise BadRequest(400, "the prompt is empty")
  if len(prompt_ids) > limits.max_prompt_tokens:
    raise BadRequest(
        400,
        f"prompt of {len(prompt_ids)} tokens over the "
        f"{limits.max_prompt_tokens} the sampler has room for",
    )
  return prompt_ids


def parse_generate(body: Any, limits) -> Request:
  """A checked ``/inference/v1/generate`` request (``limits``: the
  server's :class:`~logra_jax.serve.server.Limits`)."""
  body = _object(body, "the body")
  _unknown(body, _GENERATE, "the body")
  params = _object(body.get("sampling_params") or {}, "sampling_params")
  _unknown(params, _SAMPLING | _NEUTRAL | {"stop_token_ids"}, "sampling_params")
  prompt = _ids(body.get("token_ids"), "token_ids", limits.vocab_size)
  max_tokens, settings = _sampling(params, limits)
  stop_ids = _ids(
      params.get("stop_token_ids") or [], "stop_token_ids", limits.vocab_size
  )
  return Request(
      _prompt_fits(prompt, limits),
      max_tokens,
      settings,
      tuple(stop_ids),
      str(body.get("model", "")),
  )


def _messages(value: Any) -> list[dict]:
  if not isinstance(value, list) or not value:
    raise BadRequest(400, "messages must be a non-empty list")
  for i, message in enumerate(value):
    if (
        not isinstance(message, dict)
        or message.get("role") not in _ROLES
        or not isinstance(message.get("content"), str)
    ):
      raise BadRequest(
          400,
          f"messages[{i}] must have a role in {sorted(_ROLES)} and a string "
          "content",
      )
  return value


def parse_chat(body: Any, limits, renderer: envs.Renderer) -> Request:
  """A checked ``/v1/chat/completions`` request, its messages rendered to
  ids by ``renderer`` (a chat :class:`~logra_jax.envs.Renderer`)."""
  body = _object(body, "the body")
  _unknown(body, _CHAT, "the body")
  if body.get("stream"):
    raise BadRequest(400, "stream=true is not supported")
  if body.get("tools"):
    raise BadRequest(400, "tools are not supported; describe them in a message")
  if body.get("chat_template_kwargs"):
    raise BadRequest(400, "chat_template_kwargs are not supported")
  messages = _messages(body.get("messages"))
  sampling = dict(body)
  if sampling.get("max_tokens") is None:
    sampling["max_tokens"] = body.get("max_completion_tokens")
  max_tokens, settings = _sampling(sampling, limits)
  try:
    prompt = renderer.prompt_ids(messages)
  except Exception as e:  # noqa: BLE001 -- the template refuses them.
    raise BadRequest(400, f"the chat template refused messages: {e}") from None
  return Request(
      _prompt_fits(list(prompt), limits),
      max_tokens,
      settings,
      (),
      str(body.get("model", "")),
  )


def _logprobs(done: Completion) -> dict:
  return {
      "content": [
          {"token": f"token_id:{i}", "logprob": lp}
          for i, lp in zip(done.token_ids, done.logprobs)
      ]
  }


def generate_response(
    request_id: str, request: Request, done: Completion
) -> dict:
  """The ``/inference/v1/generate`` response (vLLM's shape).

  Example:
    >>> done = Completion([7, 2], [-0.5, -0.25], "stop")
    >>> out = generate_response("r", Request([1], 4, Settings()), done)
    >>> out["choices"][0]["token_ids"], out["choices"][0]["logprobs"]
    ([7, 2], {'content': [{'token': 'token_id:7', 'logprob': -0.5}, \
{'token': 'token_id:2', 'logprob': -0.25}]})
  """
  return {
      "request_id": request_id,
      "prompt_token_ids": list(request.prompt_ids),
      "choices": [
          {
              "index": 0,
              "token_ids": list(done.token_ids),
              "logprobs": _logprobs(done),
              "finish_reason": done.finish_reason,
          }
      ],
      "usage": _usage(request, done),
  }


def _usage(request: Request, done: Completion) -> dict:
  prompt, completion = len(request.prompt_ids), len(done.token_ids)
  return {
      "prompt_tokens": prompt,
      "completion_tokens": completion,
      "total_tokens": prompt + completion,
  }


def chat_response(
    request_id: str,
    request: Request,
    done: Completion,
    text: str,
    created: Optional[int] = 0,
) -> dict:
  """The ``/v1/chat/completions`` response: OpenAI's ``chat.completion``
  with the sampled ``token_ids`` and ``logprobs`` on its choice and the
  ``prompt_token_ids`` it followed.

  Example:
    >>> done = Completion([7], [-0.5], "length")
    >>> out = chat_response("r", Request([1], 1, Settings()), done, "hi")
    >>> out["choices"][0]["message"], out["choices"][0]["token_ids"]
    ({'role': 'assistant', 'content': 'hi'}, [7])
  """
  return {
      "id": request_id,
      "object": "chat.completion",
      "created": created,
      "model": request.model,
      "prompt_token_ids": list(request.prompt_ids),
      "choices": [
          {
              "index": 0,
              "message": {"role": "assistant", "content": text},
              "token_ids": list(done.token_ids),
              "logprobs": _logprobs(done),
              "finish_reason": done.finish_reason,
          }
      ],
      "usage": _usage(request, done),
  }
