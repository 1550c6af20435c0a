"""Episodes of a ``verifiers.v1`` taskset, played against the run's sampler
through the endpoint, as the learner's episodes.

For one batch of examples the run's sampler is served on localhost
(:func:`~logra_jax.serve.server.serve_policy`); each example becomes a task
of the taskset (:class:`~logra_jax.envs.VerifiersTaskset`) and one
``verifiers`` episode: ``SingleAgentEnv`` with the in-process chat harness
(:mod:`logra_jax.serve.verifiers_harness`) in the subprocess runtime, its
model calls going through ``verifiers``' interception server and train
client (which renders the prompt to token ids with the policy's tokenizer)
to ``/inference/v1/generate``. All episodes run at once, so their calls are
batched. The task's ``@reward`` functions score each episode.

No re-tokenization drift: the learner's episode is built from the server's
own record of each call (the prompt ids the client sent and the ids and
log-probabilities the sampler drew), never from the episode's text. Turn
``j``'s environment tokens are the part of call ``j + 1``'s prompt after
call ``j``'s prompt and completion; a prompt that does not extend them (the
client re-rendered earlier turns) ends the episode there as a failure.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import importlib
import sys
import threading
from typing import Any, Sequence

from logra_jax import envs
from logra_jax.serve import server as server_lib
from logra_jax.serve.batching import Completion

# verifiers imports a harness by a top-level module name (its plugin id).
HARNESS_ID = "logra_chat_harness"
HARNESS_MODULE = "logra_jax.serve.verifiers_harness"
EPISODE = "episode-{}"  # the model name an episode's calls carry


def episode_from_calls(
    calls: Sequence[tuple[list[int], Completion]],
    max_turns: int,
    prompt_ids: list[int],
) -> envs.Episode:
  """The learner's episode of one conversation's model calls, in order.

  Args:
    calls: ``(prompt ids, completion)`` of each call.
    max_turns: turns kept at most (more is truncation).
    prompt_ids: the prompt of an episode without calls (a failure).

  Returns:
    An ended :class:`~logra_jax.envs.Episode` (no environment object).

  Example:
    >>> a = Completion([5, 6], [-1.0, -2.0], "stop")
    >>> b = Completion([7], [-3.0], "stop")
    >>> e = episode_from_calls([([1], a), ([1, 5, 6, 9], b)], 2, [1])
    >>> e.turns, e.contexts, e.failures
    ([[5, 6], [7]], [[9]], 0)
  """
  if not calls:
    return envs.Episode(None, [], list(prompt_ids), failures=1, done=True)
  episode = envs.Episode(None, [], list(calls[0][0]), done=True)
  history = list(calls[0][0])
  for j, (ids, done) in enumerate(calls[:max_turns]):
    if j > 0:
      if list(ids[: len(history)]) != history:
        episode.failures += 1
        return episode
      episode.contexts.append(list(ids[len(history) :]))
    episode.turns.append(list(done.token_ids))
    episode.logprobs.append(list(done.logprobs))
    history = list(ids) + list(done.token_ids)
  episode.truncated = (
      len(calls) > max_turns or calls[-1][1].finish_reason == "length"
  )
  return episode


@functools.cache
def _event_loop() -> asyncio.AbstractEventLoop:
  """The process's one event loop for ``verifiers``, on its own thread:
  ``verifiers`` and ``renderers`` keep asyncio locks across calls, bound to
  the loop that first used them, so every batch runs on the same loop."""
  loop = asyncio.new_event_loop()
  threading.Thread(
      target=loop.run_forever, name="verifiers", daemon=True
  ).start()
  return loop


def register_harness() -> str:
  """Registers the in-process chat harness under the plugin id ``verifiers``
  loads it by, and returns the id. The harness module imports
  ``verifiers``, so it is imported here, when ``verifiers`` is used."""
  sys.modules.setdefault(HARNESS_ID, importlib.import_module(HARNESS_MODULE))
  return HARNESS_ID


async def _run(source, tasks, url: str, folder: str, sampling: dict) -> list:
  """The ``verifiers`` episodes of ``tasks`` (None: no task), run at once;
  an episode that raises is returned as its exception."""
  from verifiers import v1 as vf  # optional dependency
  from verifiers.v1.envs import single_agent

  register_harness()
  config = single_agent.SingleAgentEnvConfig(
      taskset=source.taskset.config,
      agent=vf.AgentConfig(
          harness=vf.HarnessConfig(id=HARNESS_ID),
          runtime=vf.SubprocessConfig(),
      ),
  )
  env = single_agent.SingleAgentEnv(config)
  client = vf.TrainClientConfig(
      base_url=url + "/v1",
      renderer_model_name=folder,
      api_key_var="LOGRA_ENDPOINT_KEY",  # unset: the local server needs none
  )

  async def one(i, task):
    if task is None:
      return None
    context = vf.ModelContext(
        model=EPISODE.format(i),
        client=client,
        sampling=vf.SamplingConfig(**sampling),
    )
    return await env.run_episode(task, context)

  async with env.serving():
    return await asyncio.gather(
        *(one(i, task) for i, task in enumerate(tasks)), return_exceptions=True
    )


def _task(source, example, system_prompt):
  try:
    return source.task(example, system_prompt)
  except Exception:  # noqa: BLE001 -- an example the data type refuses.
    return None


def play_verifiers(
    source: envs.VerifiersTaskset,
    policy: Any,
    sample: Any,
    examples: Sequence[dict],
    key: Any,
    *,
    max_turns: int,
    max_new_tokens: int,
    window_s: float = 0.5,
    **settings,
) -> list[envs.Episode]:
  """One ``verifiers`` episode per example against ``sample``.

  Args:
    source: the taskset.
    policy: the :class:`~logra_jax.rollout.engine.Policy` (tokenizer,
      folder, sampler bounds, system prompt).
    sample: the engine's ``sample(prompts, key, **settings)``.
    examples: one per episode.
    key: the PRNG key of the batch (call ``i`` uses ``fold_in(key, i)``).
    max_turns: turns per episode at most.
    max_new_tokens: tokens per turn at most.
    window_s: how long a call waits for the other episodes' (a sampler call
      starts at once when every episode's call has come).
    **settings: ``temperature``, ``top_p``, ``top_k``.

  Returns:
    The episodes, in the order of ``examples``, each with the environment's
    reward (the task's rewards, summed), its last reply as the answer, and
    a failure counted when ``verifiers`` did not finish it.

  Raises:
    ValueError: the policy shows no chat template (``verifiers``' train
      client renders every prompt with it).
  """
  if not policy.chat:
    raise ValueError(
        f"task.environment={source.spec!r}: verifiers renders prompts with "
        "the tokenizer's chat template, and the policy shows none (an "
        "instruct checkpoint with task.chat_template=auto)"
    )
  calls = collections.defaultdict(list)
  lock = threading.Lock()

  def record(request, completion):
    with lock:
      calls[request.model].append((request.prompt_ids, completion))

  tasks = [_task(source, e, policy.system_prompt) for e in examples]
  sampling = {"max_tokens": max_new_tokens, **settings}
  with server_lib.serve_policy(
      policy,
      sample,
      key,
      max_new_tokens=max_new_tokens,
      window_s=window_s,
      max_batch=max(len(examples), 1),
      max_queue=max(256, 2 * len(examples)),
      on_completion=record,
  ) as server:
    played = asyncio.run_coroutine_threadsafe(
        _run(source, tasks, server.url, str(policy.folder), sampling),
        _event_loop(),
    ).result()
  renderer = envs.Renderer(policy.tokenizer, policy.chat, policy.system_prompt)
  episodes = []
  for i, (example, result) in enumerate(zip(examples, played)):
    opening = renderer.opening([{"role": "user", "content": example["prompt"]}])
    episode = episode_from_calls(
        calls[EPISODE.format(i)], max_turns, renderer.prompt_ids(opening)
    )
    ok = getattr(result, "ok", False)
    traces = getattr(result, "traces", None) or []
    episode.failures = max(episode.failures, int(not ok))
    episode.reward = float(sum(t.reward for t in traces)) if ok else 0.0
    episode.answer = str(traces[-1].last_reply or "") if traces else ""
    episodes.append(episode)
  return episodes
