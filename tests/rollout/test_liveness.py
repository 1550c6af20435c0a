"""A rollout engine that freezes or dies is noticed within its timeout,
restarted from the learner's weights or given up with one line, and a
request in progress can be interrupted at once."""

import dataclasses
import os
import signal
import socket
import threading
import time

import jax
import numpy as np
import pytest

from logra_jax import configs
from logra_jax import policy_state
from logra_jax import sync
from logra_jax.rl import setup
from logra_jax.rollout import engine as engine_lib
from logra_jax.rollout import pipeline as pipeline_lib
from logra_jax.rollout import transport

SMOKE = configs.get_preset("smoke")
TIMEOUT_S = 2.0
# Noticing a frozen child: its silence, then the 5 s the learner gives a
# child to exit before killing it, and the machine's slack.
NOTICED_WITHIN_S = TIMEOUT_S + 5.0 + 5.0


def test_heartbeats_keep_a_long_request_alive_and_silence_ends_it(
    monkeypatch,
):
  """A request taking 6 timeouts is answered (heartbeats every quarter);
  a child silent for one timeout is an error."""
  slow = lambda self, kind, payload: time.sleep(0.6) or (transport._OK, b"x")
  monkeypatch.setattr(transport._Server, "handle", slow)
  ours, theirs = socket.socketpair()
  server = threading.Thread(target=transport.serve, args=(theirs, 0.025))
  server.start()
  with ours:
    ours.settimeout(0.1)
    transport.send_frame(ours, transport._SAMPLE, b"", request=1)
    kinds = []
    while not kinds or kinds[-1] == transport._ALIVE:
      kind, request, payload = transport.recv_frame(ours)
      assert request == 1
      kinds.append(kind)
    assert kinds[-1] == transport._OK and len(kinds) > 5, kinds
    transport.send_frame(ours, transport._CLOSE, b"", request=2)
    transport.recv_frame(ours)
  server.join()
  # No heartbeat (a frozen child): one timeout of silence is an error.
  ours, theirs = socket.socketpair()
  with ours, theirs:
    ours.settimeout(0.1)
    with pytest.raises(transport.TransportError, match="no reply within"):
      transport.recv_frame(ours)


def test_an_engine_whose_learner_went_away_ends_quietly():
  """A learner that asks to close (or gives up on a request) and closes its
  end at once: the engine's reply finds no one, and serving ends without
  an error (it raised BrokenPipeError from the engine's thread)."""
  for kind in (transport._CLOSE, transport._SAMPLE):
    ours, theirs = socket.socketpair()
    with theirs:
      transport.send_frame(ours, kind, b"", request=1)
      ours.close()
      transport.serve(theirs, heartbeat_s=60.0)


def _full_message(config, policy):
  """The learner's initial state as a full sync message (and the state)."""
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  state = policy_state.init_train_state(config.optimizer, tx, policy.params)
  fields = engine_lib.sync_fields(config, policy.folder)
  sender = sync.PolicySender(*state, seed=config.seed, **fields)
  return sender.message(*state, full=True)


def _greedy(engine, policy):
  task = setup.load_task(SMOKE)
  prompts = policy.encode([e["prompt"] for e in task.examples[:4]])
  return engine.sample(
      prompts, jax.random.key(0), max_new_tokens=4, temperature=0.0
  )


def test_a_frozen_engine_is_noticed_within_its_timeout_and_restarts(
    policy_folder, tmp_path
):
  config = configs.apply_overrides(
      SMOKE, [f"policy.path={policy_folder}", "rollout.dtype=float32"]
  )
  policy = engine_lib.Policy.load(policy_folder)
  log_path = tmp_path / "engine.log"
  message = _full_message(config, policy)
  with transport.ProcessEngine(
      policy, config, policy_folder, log_path=log_path, timeout=TIMEOUT_S
  ) as engine:
    engine.sync(message)
    before = _greedy(engine, policy)
    os.kill(engine._process.pid, signal.SIGSTOP)  # frozen, not dead
    start = time.monotonic()
    with pytest.raises(transport.TransportError) as error:
      _greedy(engine, policy)
    assert time.monotonic() - start < NOTICED_WITHIN_S
    text = str(error.value)
    assert f"no reply within {TIMEOUT_S:.0f} s" in text
    assert "exit code -9" in text and str(log_path) in text
    assert "\n" not in text
    engine.restart()
    engine.sync(message)
    after = _greedy(engine, policy)
  for name in ("tokens", "logprobs"):
    np.testing.assert_array_equal(getattr(after, name), getattr(before, name))


def test_interrupt_ends_a_request_in_progress_at_once(monkeypatch):
  """interrupt() from another thread ends a request waiting on a child
  that is silent, and the engine is not waited for on close."""
  engine = transport.ProcessEngine.__new__(transport.ProcessEngine)
  ours, theirs = socket.socketpair()
  engine._sock, engine._process, engine._log = ours, None, None
  engine._log_path, engine._requests = None, 0
  engine._interrupted, engine._timeout, engine._failure = False, 60.0, None
  ours.settimeout(60.0)
  threading.Timer(0.2, engine.interrupt).start()
  start = time.monotonic()
  with theirs, pytest.raises(transport.TransportError, match="interrupted"):
    engine._request(transport._SAMPLE, b"")
  assert time.monotonic() - start < 5.0
  with pytest.raises(transport.TransportError, match="closed after: .*interr"):
    engine._request(transport._SAMPLE, b"")
  engine.close()


class _FlakyEngine(engine_lib.Engine):
  """An engine whose requests fail (as a frozen child's would) until it is
  restarted; it samples ``key``'s data and counts what it was sent."""

  signature = "flaky"

  def __init__(self, failures, failing_call=None):
    self.policy = None
    self.failures, self.restarts, self.synced = failures, 0, []
    # The request (counted from 0) that fails once: with rollouts sampled
    # ahead, which step a request serves depends only on the call order.
    self.failing_call, self.calls = failing_call, 0

  def sample(self, examples, key):
    call, self.calls = self.calls, self.calls + 1
    if self.failures or call == self.failing_call:
      self.failures = max(0, self.failures - 1)
      raise transport.TransportError("no reply within 2 s (it was killed)")
    return (tuple(e["prompt"] for e in examples), jax.random.key_data(key))

  def _apply(self, message):
    self.synced.append(message)
    return pipeline_lib.NO_SYNC_YET

  def restart(self):
    self.restarts += 1


@dataclasses.dataclass(frozen=True)
class _Message:
  kind: str
  weights: str
  arrays: dict = dataclasses.field(default_factory=dict)


class _Sender:

  def message(self, weights, opt_state, full=False):
    return _Message("full" if full else "delta", weights)


def _pipeline(engine, restarts, staleness, lines):
  config = configs.apply_overrides(
      SMOKE,
      [
          f"rollout.engine_restarts={restarts}",
          f"rollout.max_staleness={staleness}",
      ],
  )
  examples = [{"prompt": str(i), "answer": ""} for i in range(8)]
  return pipeline_lib.RolloutPipeline(
      engine,
      _Sender(),
      config,
      pipeline_lib.PromptStream(examples, 2, seed=0),
      jax.random.key(0),
      0,
      rollout_fn=engine.sample,
      evaluate_fn=lambda: {"accuracy": 0.0},
      log=lines.append,
  )


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_lost_engine_is_restarted_and_samples_the_same_batches(staleness):
  """A restarted engine is sent the latest state in full and samples the
  lost requests again with their prompts and keys: the batches are those
  of an engine never lost."""
  runs = {}
  for failures in (0, 1):
    # Step 2's request fails once (the second call): set before anything
    # is sampled, as a thread sampling ahead would make it race otherwise.
    engine, lines = _FlakyEngine(0, failing_call=1 if failures else None), []
    pipeline = _pipeline(engine, 1, staleness, lines)
    batches = []
    for step in range(3):
      batches.append(pipeline.next_rollout(step)[0])
      pipeline.sync(("weights", step + 1), step + 1)
    pipeline.collect_syncs(("weights", 3), wait=True)
    pipeline.close()
    runs[failures] = batches, engine, lines
  (clean, _, _), (batches, engine, lines) = runs[0], runs[1]
  assert [b[0] for b in batches] == [b[0] for b in clean]
  assert all(np.array_equal(a[1], b[1]) for a, b in zip(batches, clean))
  assert engine.restarts == 1 and len(lines) == 1
  assert "restarting it" in lines[0] and "0 restart(s) left" in lines[0]
  assert _Message("full", "weights") in engine.synced


def test_a_restarted_engine_starts_from_the_state_merged_ahead():
  """The learner merges ahead after a sync, donating the synced arrays:
  ``follow`` hands the pipeline the merged state, and a restart sends that
  one in full (the synced one no longer exists)."""
  engine, lines = _FlakyEngine(0, failing_call=1), []
  pipeline = _pipeline(engine, 1, 0, lines)
  pipeline.next_rollout(0)
  pipeline.sync(("synced", None), 1)
  pipeline.follow(("merged ahead", None))
  pipeline.next_rollout(1)  # fails once: the engine is restarted
  pipeline.close()
  assert engine.restarts == 1
  assert engine.synced[-1] == _Message("full", "merged ahead")


def test_a_lost_engine_without_restarts_left_is_raised_and_resumes_before():
  engine, lines = _FlakyEngine(0), []
  pipeline = _pipeline(engine, 0, 0, lines)
  pipeline.next_rollout(0)
  pipeline.sync(("weights", 1), 1)
  position = pipeline.resume_point()[0]
  engine.failures = 1
  with pytest.raises(transport.TransportError, match="no reply within"):
    pipeline.next_rollout(1)
  # The lost batch is still the first not trained on.
  assert pipeline.resume_point()[0] == position and engine.restarts == 0
  assert not lines


def test_an_interrupted_pipeline_does_not_restart():
  engine, lines = _FlakyEngine(1), []
  pipeline = _pipeline(engine, 3, 0, lines)
  pipeline.sync(("weights", 1), 1)
  pipeline.interrupt()
  with pytest.raises(transport.TransportError):
    pipeline.next_rollout(1)
  assert engine.restarts == 0


def test_engine_liveness_settings_are_checked():
  for field, value in [("engine_timeout_s", 0), ("engine_restarts", -1)]:
    with pytest.raises(ValueError, match=f"rollout.{field}"):
      configs.apply_overrides(SMOKE, [f"rollout.{field}={value}"])
