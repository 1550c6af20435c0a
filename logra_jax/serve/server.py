"""The run's sampler behind a localhost HTTP endpoint.

Two endpoints, both batched into one sampler call per window
(:class:`~logra_jax.serve.batching.Batcher`):

- ``POST /inference/v1/generate``, vLLM's token endpoint as ``verifiers``'
  train client calls it (``renderers.client.generate``): ``{"model",
  "token_ids": [...], "sampling_params": {"max_tokens", "temperature",
  "top_p", "top_k", "stop_token_ids", "logprobs", ...}}`` in; ``{"request_id",
  "prompt_token_ids", "choices": [{"token_ids": [...], "logprobs":
  {"content": [{"token": "token_id:ID", "logprob": x}, ...]},
  "finish_reason"}]}`` out.
- ``POST /v1/chat/completions``, OpenAI's chat endpoint: ``messages`` in,
  rendered with the tokenizer's chat template as transformers does
  (``apply_chat_template(..., add_generation_prompt=True)``); an OpenAI
  ``chat.completion`` out, whose choice also carries the sampled
  ``token_ids`` and their ``logprobs`` and the response the
  ``prompt_token_ids``.

``GET /v1/models`` lists the model with ``max_model_len``: the longest prompt
the server accepts (the client's pre-flight check).

No re-tokenization drift: the ids a response carries are the sampler's own
(a prefix of what it drew, cut at ``max_tokens`` or the first stop token),
with the sampler's log-probabilities of exactly those ids; the prompt ids are
the request's ``token_ids`` unchanged (or the chat template's rendering,
returned as ``prompt_token_ids``). A trainer that builds its rows from these
ids (``on_completion`` sees every request's prompt ids and completion)
trains on what was sampled and never on text tokenized again.

Bounds: the server binds 127.0.0.1 only; a body over ``max_body_bytes``, a
prompt over the sampler's room, ``max_tokens`` over the server's
``max_new_tokens``, ids outside the vocabulary or malformed JSON are refused
with a 4xx and a one-line reason; past ``max_queue`` held requests a 503; a
sampler failure is a 500 for the requests of that call; the server goes on.
"""

from __future__ import annotations

import dataclasses
import http.server
import itertools
import json
import threading
from typing import Any, Callable, Optional

from logra_jax import envs
from logra_jax.serve import requests as requests_lib
from logra_jax.serve.batching import Batcher
from logra_jax.serve.batching import Completion
from logra_jax.serve.batching import engine_sampler
from logra_jax.serve.batching import QueueFull

GENERATE = "/inference/v1/generate"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"

# on_completion(request, completion): every answered request (its checked
# body: prompt ids, settings, the model it named) and what was sampled.
OnCompletion = Callable[[requests_lib.Request, Completion], None]


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the server accepts.

  Attributes:
    max_new_tokens: tokens each sampler call draws (a request's
      ``max_tokens`` at most).
    max_prompt_tokens: prompt tokens at most (the sampler's room).
    vocab_size: ids must be below it.
    max_body_bytes: request bodies at most.
    model: the name ``/v1/models`` lists (requests may name any).
  """

  max_new_tokens: int
  max_prompt_tokens: int
  vocab_size: int
  max_body_bytes: int = 1 << 20
  model: str = "logra"


class _HTTPServer(http.server.ThreadingHTTPServer):
  """A thread per connection; a listen backlog for a batch's worth of
  clients connecting at once (the default of 5 resets the rest)."""

  daemon_threads = True
  request_queue_size = 256


class Server:
  """The endpoints on ``127.0.0.1:port`` (0: a free port), served on
  their own threads until :meth:`close`.

  Args:
    batcher: samples the requests.
    tokenizer: a transformers tokenizer (its chat template for the chat
      endpoint, ``decode`` for the completion's text).
    limits: the bounds.
    port: the port; 0 picks a free one (see :attr:`url`).
    on_completion: called with each answered request and its completion,
      e.g. to record episodes.
  """

  def __init__(
      self,
      batcher: Batcher,
      tokenizer: Any,
      limits: Limits,
      *,
      port: int = 0,
      on_completion: Optional[OnCompletion] = None,
  ):
    self.batcher, self.tokenizer, self.limits = batcher, tokenizer, limits
    self.renderer = envs.Renderer(tokenizer, chat=True)
    self.on_completion = on_completion
    self._ids = itertools.count()
    self._http = _HTTPServer(("127.0.0.1", port), _handler(self))
    self._thread = threading.Thread(
        target=self._http.serve_forever, daemon=True
    )
    self._thread.start()

  @property
  def url(self) -> str:
    """``http://127.0.0.1:PORT``."""
    host, port = self._http.server_address[:2]
    return f"http://{host}:{port}"

  def answer(self, path: str, body: Any) -> dict:
    """The response to a POST of ``body`` (parsed JSON) to ``path``.

    Raises:
      requests_lib.BadRequest: refused (status and reason).
    """
    if path == GENERATE:
      request = requests_lib.parse_generate(body, self.limits)
    else:
      request = requests_lib.parse_chat(body, self.limits, self.renderer)
    try:
      done = self.batcher.submit(
          request.prompt_ids,
          max_tokens=request.max_tokens,
          settings=request.settings,
          stop_ids=request.stop_ids,
      )
    except QueueFull as e:
      raise requests_lib.BadRequest(503, str(e)) from None
    except RuntimeError as e:
      raise requests_lib.BadRequest(500, str(e)) from None
    if self.on_completion is not None:
      self.on_completion(request, done)
    request_id = f"logra-{next(self._ids)}"
    if path == GENERATE:
      return requests_lib.generate_response(request_id, request, done)
    text = self.tokenizer.decode(done.token_ids, skip_special_tokens=True)
    return requests_lib.chat_response(request_id, request, done, text)

  def models(self) -> dict:
    """The ``/v1/models`` listing."""
    return {
        "object": "list",
        "data": [
            {
                "id": self.limits.model,
                "object": "model",
                "owned_by": "logra",
                "max_model_len": self.limits.max_prompt_tokens,
            }
        ],
    }

  def close(self) -> None:
    """Stops serving and the batcher."""
    self._http.shutdown()
    self._http.server_close()
    self.batcher.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()


def _handler(server: Server) -> type:
  """The request handler class bound to ``server``."""

  class Handler(http.server.BaseHTTPRequestHandler):
    """One connection's requests (a slow client times out)."""

    timeout = 60
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet: a trainer's log is its own.
      del args

    def _send(self, status: int, payload: dict) -> None:
      data = json.dumps(payload).encode()
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      if status >= 400:
        self.send_header("Connection", "close")
        self.close_connection = True
      self.end_headers()
      self.wfile.write(data)

    def _refuse(self, status: int, reason: str) -> None:
      self._send(status, {"error": {"message": reason, "code": status}})

    def do_GET(self):  # noqa: N802 -- http.server's name.
      if self.path.rstrip("/") == MODELS:
        self._send(200, server.models())
      elif self.path in (GENERATE, CHAT):
        self._refuse(405, f"GET {self.path}: use POST")
      else:
        self._refuse(404, f"no endpoint {self.path}")

    def do_POST(self):  # noqa: N802 -- http.server's name.
      if self.path not in (GENERATE, CHAT):
        self._refuse(404, f"no endpoint {self.path}")
        return
      try:
        body = requests_lib.read_body(
            self.headers, self.rfile, server.limits.max_body_bytes
        )
        self._send(200, server.answer(self.path, body))
      except requests_lib.BadRequest as e:
        self._refuse(e.status, e.reason)
      except Exception as e:  # noqa: BLE001 -- never take the server down.
        self._refuse(500, f"{type(e).__name__}: {e}")

    def _wrong_method(self):
      self._refuse(405, f"{self.command} {self.path}: use POST or GET")

    do_PUT = do_DELETE = do_PATCH = _wrong_method  # noqa: N815

  return Handler


def serve_policy(
    policy: Any,
    sample: Any,
    key: Any,
    *,
    max_new_tokens: int,
    port: int = 0,
    window_s: float = 0.01,
    max_batch: int = 64,
    max_queue: int = 256,
    on_completion: Optional[OnCompletion] = None,
) -> Server:
  """A :class:`Server` in front of a policy's sampler.

  Args:
    policy: a :class:`~logra_jax.rollout.engine.Policy` (its tokenizer and
      its sampler's context, bucket, vocabulary and stop tokens).
    sample: the engine's ``sample(prompts, key, **settings)`` (weights
      bound), e.g. ``engine.sample``.
    key: the PRNG key; sampler call ``i`` uses ``fold_in(key, i)``.
    max_new_tokens: tokens each call draws.
    port, window_s, max_batch, max_queue, on_completion: as in
      :class:`Server` and :class:`~logra_jax.serve.batching.Batcher`.

  Returns:
    The running server; close it (or use it as a context manager).
  """
  sampler = policy.sampler
  room = sampler.max_length - max_new_tokens
  limits = Limits(
      max_new_tokens=max_new_tokens,
      max_prompt_tokens=room // sampler.bucket_size * sampler.bucket_size,
      vocab_size=sampler.config.vocab_size,
  )
  if limits.max_prompt_tokens < 1:
    raise ValueError(
        f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the "
        f"sampler's context of {sampler.max_length}"
    )
  batcher = Batcher(
      engine_sampler(sample, max_new_tokens, key),
      stop_ids=sampler.config.eos_token_ids,
      window_s=window_s,
      max_batch=max_batch,
      max_queue=max_queue,
  )
  return Server(
      batcher, policy.tokenizer, limits, port=port, on_completion=on_completion
  )
