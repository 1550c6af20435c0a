"""The rollout engine in a separate process follows the learner bit for bit
and refuses what does not fit."""

import functools
import os
import socket
import subprocess
import zlib

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import sync
from logra_jax import configs
from logra_jax.rl import learner, scoring, setup
from logra_jax.rollout import engine as engine_lib
from logra_jax.rollout import transport
from logra_jax import policy_state

SMOKE = configs.get_preset("smoke")
STEPS = 144
REFRESH = 12  # 12 windows: 11 merges after the first
QUIET = lambda message: None


def _config(policy_folder, *overrides):
  return configs.apply_overrides(
      SMOKE,
      [
          f"policy.path={policy_folder}",
          f"optimizer.refresh_every={REFRESH}",
          "rollout.dtype=float32",
          *overrides,
      ],
  )


def _prompts(policy, count=6):
  task = setup.load_task(SMOKE)
  return policy.encode([e["prompt"] for e in task.examples[:count]])


def _greedy(sample, prompts):
  return sample(prompts, jax.random.key(0), max_new_tokens=4, temperature=0.0)


def _same_bits(a, b):
  return all(
      x.dtype == y.dtype
      and np.array_equal(
          np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)
      )
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def _learn(config, policy, engines, steps, messages=None, synced=None):
  """Runs ``steps`` learner steps on one rollout batch (its advantages
  redrawn each step), syncing ``engines`` after each of the first
  ``synced`` (default all) and then merging ahead of a refresh, as a run's
  learner does (``Learner.merge_ahead``); returns the learner's
  ``(weights, opt_state, sender)``."""
  params = jax.tree.map(jnp.copy, policy.params)  # the step donates them
  tx = policy_state.make_optimizer(config.optimizer, params)
  weights, opt_state = policy_state.init_train_state(
      config.optimizer, tx, params
  )
  fields = engine_lib.sync_fields(config, policy.folder)
  sender = sync.PolicySender(weights, opt_state, seed=config.seed, **fields)
  full = sender.message(weights, opt_state, full=True)
  for engine in engines:
    engine.sync(full)
  task = setup.load_task(config)
  batch, _ = scoring.rollout(
      policy,
      policy.params,
      list(task.examples[:4]),
      config,
      [(setup.task_verifier(task), 1.0)],
      jax.random.key(1),
  )
  train_step = learner.make_train_step(policy.graphdef, tx, config)
  merge_ahead = learner.make_merge_ahead(config)
  for i in range(steps):
    advantages = jax.random.normal(jax.random.key(i), (batch.batch_size,))
    weights, opt_state, _ = train_step(
        weights, opt_state, batch.replace(advantages_B=advantages)
    )
    message = sender.message(weights, opt_state)
    if messages is not None:  # a copy: the next step donates the arrays
      messages.append(sync.decode(sync.encode(message)))
    for engine in engines[
        : len(engines) if synced is None or i < synced else 0
    ]:
      stats = engine.sync(message)
      assert not stats.resynced
    if merge_ahead is not None:
      weights = merge_ahead(weights, opt_state)
  return weights, opt_state, sender


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,base_dtype,step_bits",
    [
        ("range", "float32", "null"),
        ("random", "bfloat16", "null"),
        ("svd", "bfloat16", "4"),
    ],
)
def test_engines_in_and_out_of_process_follow_the_learner(
    policy_folder, tmp_path, kind, base_dtype, step_bits
):
  """144 steps, 12 windows; with 4-bit steps the messages carry each step's
  codes, which both engines add to their coordinates."""
  config = _config(
      policy_folder,
      f"optimizer.kind={kind}",
      f"optimizer.base_dtype={base_dtype}",
      f"optimizer.step_bits={step_bits}",
  )
  policy = engine_lib.Policy.load(policy_folder)
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  weights, opt_state = policy_state.init_train_state(
      config.optimizer, tx, policy.params
  )
  fields = engine_lib.sync_fields(config, policy_folder)
  colocated = engine_lib.RolloutEngine(
      policy,
      policy_state.synced_state(weights, opt_state),
      seed=config.seed,
      projectors=policy_state.projector_source(opt_state),
      merge_ahead_every=engine_lib.merge_ahead_every(config),
      **fields,
  )
  messages = []
  with transport.ProcessEngine(
      policy, config, policy_folder, log_path=tmp_path / "engine.log"
  ) as remote:
    weights, opt_state, _ = _learn(
        config, policy, [colocated, remote], STEPS, messages
    )
    prompts = _prompts(policy)
    learner_params = policy_state.model_view(weights, opt_state)
    expected = _greedy(
        functools.partial(policy.sampler.sample, learner_params), prompts
    )
    remote_out = _greedy(remote.sample, prompts)
  assert colocated.receiver.version == STEPS
  assert _same_bits(
      colocated.receiver.state, policy_state.synced_state(weights, opt_state)
  )
  assert _same_bits(colocated.params, learner_params)
  # Every message's checksums matched in the child (no resync), and its
  # greedy completions and their log-probabilities are the learner's.
  assert remote.resyncs == 0 and colocated.resyncs == 0
  # Random projectors are regenerated by both engines, never sent.
  refreshes = [m for m in messages if m.merge_step > 0]
  assert refreshes and all(
      any(n.startswith("projector:") for n in m.arrays) == (kind != "random")
      for m in refreshes
  )
  for name in ("tokens", "mask", "logprobs"):
    assert _same_bits(getattr(remote_out, name), getattr(expected, name))
  coded = [any(n.endswith(".codes") for n in m.arrays) for m in messages]
  assert all(coded) if step_bits == "4" else not any(coded)
  assert _same_bits(_greedy(colocated.sample, prompts), expected)


@pytest.fixture(scope="module")
def remote_run(policy_folder, tmp_path_factory):
  """A process engine that applied the first 3 of 4 learner steps (two
  merges among them: a refresh every 2 steps), the 4 messages, the
  learner."""
  config = _config(policy_folder, "optimizer.refresh_every=2")
  policy = engine_lib.Policy.load(policy_folder)
  log_path = tmp_path_factory.mktemp("engine") / "engine.log"
  with transport.ProcessEngine(
      policy, config, policy_folder, log_path=log_path
  ) as remote:
    messages = []
    learned = _learn(config, policy, [remote], 4, messages, synced=3)
    assert sum(m.merge_step >= 0 for m in messages) == 2
    yield config, policy, remote, messages, learned


def test_an_old_or_repeated_message_is_refused_and_a_resync_heals(remote_run):
  config, policy, remote, messages, (weights, opt_state, sender) = remote_run
  prompts = _prompts(policy)
  before = _greedy(remote.sample, prompts)
  for stale in (messages[2], messages[0]):  # duplicated, out of order
    with pytest.raises(sync.SyncError, match="out of order"):
      remote.sync(stale)
    assert _same_bits(_greedy(remote.sample, prompts), before)
  resyncs = remote.resyncs
  stats = remote.sync(
      messages[0], resync=lambda: sender.message(weights, opt_state, full=True)
  )
  assert stats.resynced and remote.resyncs == resyncs + 1
  # Now at the learner's newest weights (one step past the engine's).
  learner_params = policy_state.model_view(weights, opt_state)
  expected = _greedy(
      functools.partial(policy.sampler.sample, learner_params), prompts
  )
  assert _same_bits(_greedy(remote.sample, prompts), expected)
  assert not _same_bits(expected.logprobs, before.logprobs)


@pytest.mark.parametrize(
    "override", ["optimizer.rank=2", "optimizer.learning_rate=0.5", "seed=3"]
)
def test_a_message_of_another_config_is_refused(
    remote_run, policy_folder, tmp_path, override
):
  config, policy, _, _, _ = remote_run
  other = configs.apply_overrides(config, [override])
  params = jax.tree.map(jnp.copy, policy.params)
  tx = policy_state.make_optimizer(other.optimizer, params)
  weights, opt_state = policy_state.init_train_state(
      other.optimizer, tx, params
  )
  sender = sync.PolicySender(
      weights,
      opt_state,
      seed=other.seed,
      **engine_lib.sync_fields(other, policy_folder),
  )
  with transport.ProcessEngine(
      policy, config, policy_folder, log_path=tmp_path / "engine.log"
  ) as remote:
    assert remote.signature != sender.signature
    with pytest.raises(sync.SyncError, match="another policy"):
      remote.sync(sender.message(weights, opt_state, full=True))
    with pytest.raises(transport.TransportError, match="no policy yet"):
      _greedy(remote.sample, _prompts(policy))


def test_an_engine_that_dies_or_fails_to_start_is_a_clear_error(
    policy_folder, tmp_path, monkeypatch
):
  config = _config(policy_folder)
  policy = engine_lib.Policy.load(policy_folder)
  remote = transport.ProcessEngine(
      policy, config, policy_folder, log_path=tmp_path / "engine.log"
  )
  # Its own session: a SIGTERM to the learner's process group (a scheduler's
  # preemption) does not kill it mid-step; the learner closes it.
  assert os.getsid(remote._process.pid) != os.getsid(0)
  remote._process.kill()
  with pytest.raises(transport.TransportError, match="exited with code -9"):
    _greedy(remote.sample, _prompts(policy))
  with pytest.raises(transport.TransportError, match="closed"):
    _greedy(remote.sample, _prompts(policy))
  remote.close()
  # A child whose init fails is stopped, its socket and log closed.
  started = []
  popen = subprocess.Popen
  monkeypatch.setattr(
      subprocess,
      "Popen",
      lambda *a, **k: started.append(popen(*a, **k)) or started[-1],
  )
  with pytest.raises(transport.TransportError, match="does not exist"):
    transport.ProcessEngine(
        policy,
        config,
        tmp_path / "no-such-policy",
        log_path=tmp_path / "engine.log",
    )
  assert started and started[0].poll() is not None


def test_frames_cut_short_damaged_or_late_are_refused():
  payload = b"x" * 1000
  frame = (
      transport._header(transport._SYNC, 1, len(payload), zlib.crc32(payload))
      + payload
  )
  for cut in (5, transport._FRAME.size + 400):
    ours, theirs = socket.socketpair()
    with ours, theirs:
      ours.sendall(frame[:cut])
      ours.close()
      with pytest.raises(transport.TransportError, match="closed after"):
        transport.recv_frame(theirs)
  ours, theirs = socket.socketpair()
  with ours, theirs:
    theirs.settimeout(5.0)
    transport.send_frame(ours, transport._SYNC, payload, request=7)
    kind, request, got = transport.recv_frame(theirs)  # intact
    assert (kind, request, bytes(got)) == (transport._SYNC, 7, payload)
    transport.send_frame(ours, transport._SYNC, [payload[:300], payload[300:]])
    assert bytes(transport.recv_frame(theirs)[2]) == payload  # sent in parts
    bad_payload = transport._header(transport._SYNC, 1, len(payload), 7)
    ours.sendall(bad_payload + payload)
    with pytest.raises(transport.TransportError, match="payload differs"):
      transport.recv_frame(theirs)
    # A flipped bit of the length is seen before its bytes are waited for.
    bad_length = bytearray(frame[: transport._FRAME.size])
    bad_length[14] ^= 0x40
    ours.sendall(bytes(bad_length))
    with pytest.raises(transport.TransportError, match="header corrupted"):
      transport.recv_frame(theirs)
    ours.sendall(b"NOPE" + bytes(transport._FRAME.size - 4))
    with pytest.raises(transport.TransportError, match="magic"):
      transport.recv_frame(theirs)
    theirs.settimeout(0.2)  # nothing comes
    with pytest.raises(transport.TransportError, match="no reply within"):
      transport.recv_frame(theirs)


def test_the_engine_samples_in_its_own_dtype(policy_folder):
  config = _config(policy_folder, "optimizer.base_dtype=bfloat16")
  policy = engine_lib.Policy.load(policy_folder)
  tx = policy_state.make_optimizer(config.optimizer, policy.params)
  weights, opt_state = policy_state.init_train_state(
      config.optimizer, tx, policy.params
  )
  fields = engine_lib.sync_fields(config, policy_folder)
  sender = sync.PolicySender(weights, opt_state, seed=config.seed, **fields)
  engine = engine_lib.RolloutEngine(
      policy,
      policy_state.synced_state(weights, opt_state),
      seed=config.seed,
      dtype=jnp.bfloat16,
      **fields,
  )
  engine.sync(sender.message(weights, opt_state, full=True))
  expected = jax.tree.map(
      lambda x: x.astype(jnp.bfloat16),
      policy_state.dense_weights(weights, opt_state),
  )
  assert _same_bits(engine.params, expected)
  # The synced copy keeps the learner's dtypes (its checksums are theirs).
  assert _same_bits(
      engine.receiver.state, policy_state.synced_state(weights, opt_state)
  )
  out = _greedy(engine.sample, _prompts(policy))
  assert out.tokens.shape == (6, 4)


def test_policy_loads_with_the_configured_remat(policy_folder):
  """`policy.remat` reaches the model whose graphdef the learner
  differentiates; `Policy.load`'s default is the config's."""
  remat = lambda policy: nnx.merge(policy.graphdef, policy.params).config.remat
  assert remat(engine_lib.Policy.load(policy_folder)) == (
      configs.PolicyConfig().remat
  )
  for setting in ("none", "dots_saveable"):
    assert remat(engine_lib.Policy.load(policy_folder, remat=setting)) == (
        setting
    )
