"""The sampler behind the endpoints: concurrent requests batched into one
sampler call, responses carrying exactly the sampled ids and log-probs, and
bad requests refused with a 4xx while the server keeps serving."""

import http.client
import json
import threading

import jax
import numpy as np
import pytest

from logra_jax import serve
from logra_jax.data.tokenizer import char_tokenizer
from logra_jax.rollout.engine import Policy
from run_fixtures import make_policy

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
EOS, WIDTH = 2, 6


class FakeSampler:
  """Draws ids and log-probs that depend on the prompt and the call; a
  prompt starting with id 9 stops after two tokens."""

  def __init__(self):
    self.calls, self.drawn = [], []

  def __call__(self, prompts, settings):
    call = len(self.calls)
    self.calls.append((list(map(list, prompts)), settings))
    tokens = np.array(
        [
            [4 + (sum(p) + 7 * j + call) % 90 for j in range(WIDTH)]
            for p in prompts
        ]
    )
    logprobs = -np.arange(1, WIDTH + 1) / 8.0 - np.array(
        [[len(p)] for p in prompts]
    )
    lengths = np.full(len(prompts), WIDTH)
    for i, prompt in enumerate(prompts):
      if prompt[0] == 9:
        tokens[i, 1], lengths[i] = EOS, 2
    self.drawn.append((tokens, logprobs, lengths))
    return tokens, logprobs, lengths


def post(url, path, body, method="POST", raw=None, headers=None):
  host, port = url.removeprefix("http://").split(":")
  connection = http.client.HTTPConnection(host, int(port), timeout=30)
  data = raw if raw is not None else json.dumps(body).encode()
  connection.request(method, path, body=data, headers=headers or {})
  response = connection.getresponse()
  out = json.loads(response.read())
  connection.close()
  return response.status, out


@pytest.fixture
def server():
  tokenizer = char_tokenizer()
  tokenizer.chat_template = TEMPLATE
  sampler = FakeSampler()
  batcher = serve.Batcher(
      sampler, stop_ids=(EOS,), window_s=0.5, max_batch=16, max_queue=16
  )
  limits = serve.Limits(
      max_new_tokens=WIDTH,
      max_prompt_tokens=60,
      vocab_size=len(tokenizer),
      max_body_bytes=4096,
  )
  with serve.Server(batcher, tokenizer, limits) as running:
    running.sampler = sampler
    yield running


def test_concurrent_requests_are_one_sampler_call(server):
  prompts = [[5 + i, 6, 7 + i] for i in range(6)] + [[9, 5]]
  results = [None] * len(prompts)
  start = threading.Barrier(len(prompts))

  def client(i):
    start.wait()
    results[i] = post(
        server.url,
        "/inference/v1/generate",
        {
            "model": "m",
            "token_ids": prompts[i],
            "sampling_params": {
                "max_tokens": 4,
                "temperature": 1.0,
                "top_k": -1,
                "logprobs": 1,
                "stop_token_ids": [EOS],
                "skip_special_tokens": False,
            },
        },
    )

  threads = [threading.Thread(target=client, args=(i,)) for i in range(7)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert len(server.sampler.calls) == 1
  assert server.batcher.calls == 1
  batch, _ = server.sampler.calls[0]
  assert sorted(map(tuple, batch)) == sorted(map(tuple, prompts))
  tokens, logprobs, lengths = server.sampler.drawn[0]
  for prompt, (status, out) in zip(prompts, results):
    assert status == 200, out
    row = batch.index(prompt)
    keep = min(4, int(lengths[row]))
    choice = out["choices"][0]
    assert choice["token_ids"] == tokens[row, :keep].tolist()
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == (
        logprobs[row, :keep].tolist()
    )
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        f"token_id:{t}" for t in choice["token_ids"]
    ]
    assert out["prompt_token_ids"] == prompt
    stopped = prompt[0] == 9
    assert choice["finish_reason"] == ("stop" if stopped else "length")


def test_a_batch_of_clients_connecting_at_once_is_served():
  """64 clients at once: none is reset (the listen backlog holds them) and
  they share few sampler calls."""
  sampler = FakeSampler()
  batcher = serve.Batcher(sampler, window_s=1.0, max_batch=64, max_queue=64)
  limits = serve.Limits(
      max_new_tokens=WIDTH, max_prompt_tokens=8, vocab_size=99
  )
  statuses = []
  start = threading.Barrier(64)

  def client(i):
    start.wait()
    body = {"token_ids": [5, i % 90]}
    statuses.append(post(server.url, "/inference/v1/generate", body)[0])

  with serve.Server(batcher, char_tokenizer(), limits) as server:
    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
  assert statuses == [200] * 64
  assert sum(len(prompts) for prompts, _ in sampler.calls) == 64
  assert len(sampler.calls) < 64


def test_chat_completions_render_the_template_and_return_the_ids(server):
  tokenizer = server.tokenizer
  messages = [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "2+2="},
  ]
  status, out = post(
      server.url,
      "/v1/chat/completions",
      {"model": "m", "messages": messages, "max_tokens": 5, "temperature": 0},
  )
  assert status == 200, out
  expected = tokenizer.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True
  )
  prompt = tokenizer(expected, add_special_tokens=False)["input_ids"]
  assert out["prompt_token_ids"] == prompt
  assert server.sampler.calls[0][0] == [prompt]
  assert server.sampler.calls[0][1] == serve.Settings(temperature=0.0)
  tokens, logprobs, _ = server.sampler.drawn[0]
  choice = out["choices"][0]
  assert choice["token_ids"] == tokens[0, :5].tolist()
  assert [e["logprob"] for e in choice["logprobs"]["content"]] == (
      logprobs[0, :5].tolist()
  )
  assert choice["message"] == {
      "role": "assistant",
      "content": tokenizer.decode(tokens[0, :5], skip_special_tokens=True),
  }


@pytest.mark.parametrize(
    "path, body, status, reason",
    [
        ("/inference/v1/generate", {"token_ids": "12"}, 400, "token_ids"),
        ("/inference/v1/generate", {"token_ids": []}, 400, "empty"),
        ("/inference/v1/generate", {"token_ids": [4] * 61}, 400, "61 tokens"),
        ("/inference/v1/generate", {"token_ids": [4, 1000]}, 400, "id 1000"),
        (
            "/inference/v1/generate",
            {"token_ids": [4], "sampling_params": {"max_tokens": 7}},
            400,
            "max_tokens=7",
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [4], "sampling_params": {"min_p": 0.1}},
            400,
            "min_p",
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [4], "sampling_params": {"n": 2}},
            400,
            "n=2",
        ),
        ("/inference/v1/generate", [1, 2], 400, "JSON object"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "hi"}]},
            400,
            "messages[0]",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 60}]},
            400,
            "tokens over",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream": True},
            400,
            "stream",
        ),
        ("/v1/completions", {}, 404, "no endpoint"),
    ],
)
def test_bad_requests_are_refused_and_the_server_goes_on(
    server, path, body, status, reason
):
  got, out = post(server.url, path, body)
  assert got == status and reason in out["error"]["message"], out
  assert "\n" not in out["error"]["message"]
  assert not server.sampler.calls
  ok, _ = post(server.url, "/inference/v1/generate", {"token_ids": [5, 6]})
  assert ok == 200 and len(server.sampler.calls) == 1


@pytest.mark.parametrize(
    "method, raw, status",
    [
        ("POST", b"{not json", 400),
        ("POST", b"x" * 5000, 413),
        ("GET", b"", 405),
        ("PUT", b"{}", 405),
        ("DELETE", b"", 405),
    ],
)
def test_bodies_and_methods_are_bounded(server, method, raw, status):
  got, out = post(server.url, "/inference/v1/generate", None, method, raw)
  assert got == status and out["error"]["message"], out
  ok, _ = post(server.url, "/inference/v1/generate", {"token_ids": [5, 6]})
  assert ok == 200


def test_models_lists_the_prompt_room(server):
  status, out = post(server.url, "/v1/models", None, "GET", b"")
  assert status == 200 and out["data"][0]["max_model_len"] == 60


def test_a_full_queue_is_refused_and_a_failing_sampler_is_a_500():
  release = threading.Event()

  def slow(prompts, settings):
    release.wait(30)
    if prompts[0][0] == 13:
      raise FloatingPointError("nan in the logits")
    return (
        np.ones((len(prompts), 2), int) * 5,
        np.zeros((len(prompts), 2)),
        [2] * len(prompts),
    )

  limits = serve.Limits(max_new_tokens=2, max_prompt_tokens=8, vocab_size=50)
  batcher = serve.Batcher(slow, window_s=0.0, max_batch=1, max_queue=1)
  with serve.Server(batcher, char_tokenizer(), limits) as server:
    first = threading.Thread(
        target=post,
        args=(server.url, "/inference/v1/generate", {"token_ids": [13]}),
    )
    first.start()
    while batcher.calls == 0:
      threading.Event().wait(0.01)
    status, out = post(server.url, "/inference/v1/generate", {"token_ids": [5]})
    assert status == 503 and "queued" in out["error"]["message"]
    release.set()
    first.join()
    status, out = post(
        server.url, "/inference/v1/generate", {"token_ids": [13]}
    )
    assert status == 500 and "FloatingPointError" in out["error"]["message"]
    status, out = post(server.url, "/inference/v1/generate", {"token_ids": [5]})
    assert status == 200 and out["choices"][0]["token_ids"] == [5, 5]


def test_the_server_binds_localhost_only(server):
  assert server.url.startswith("http://127.0.0.1:")


def test_a_policy_sampler_answers_with_its_own_ids_and_logprobs(tmp_path):
  """Through the real sampler: the ids and log-probs of two concurrent
  requests equal one direct sampler call on the batch the server made."""
  policy = Policy.load(make_policy(tmp_path / "tiny"))
  key, batches = jax.random.key(3), []

  def sample(prompts, key, **settings):
    batches.append([list(p) for p in prompts])
    return policy.sampler.sample(policy.params, prompts, key, **settings)

  prompts = [[1, 20, 21, 22], [1, 30, 31]]
  results = [None, None]
  with serve.serve_policy(
      policy, sample, key, max_new_tokens=8, window_s=1.0
  ) as server:
    start = threading.Barrier(2)

    def client(i):
      start.wait()
      results[i] = post(
          server.url,
          "/inference/v1/generate",
          {"token_ids": prompts[i], "sampling_params": {"temperature": 1.0}},
      )

    threads = [threading.Thread(target=client, args=(i,)) for i in (0, 1)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
  assert len(batches) == 1
  direct = policy.sampler.sample(
      policy.params, batches[0], jax.random.fold_in(key, 0), max_new_tokens=8
  )
  for prompt, (status, out) in zip(prompts, results):
    assert status == 200, out
    row = batches[0].index(prompt)
    n = int(direct.lengths[row])
    choice = out["choices"][0]
    assert choice["token_ids"] == np.asarray(direct.tokens[row, :n]).tolist()
    np.testing.assert_array_equal(
        [e["logprob"] for e in choice["logprobs"]["content"]],
        np.asarray(direct.logprobs[row, :n]),
    )
