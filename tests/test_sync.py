"""Policy sync: a receiver follows the learner bit for bit, and refuses what
does not fit."""

import dataclasses
import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import logra_jax as logra
from logra_jax.optim import factored
from logra_jax.optim import non_finite
from logra_jax.optim import sketch_grad
from logra_jax import checksums
from logra_jax import sync
from logra_jax.sync import endpoints as sync_endpoints
from logra_jax.lowrank import matmul
from logra_jax import policy_state
from sync_learners import REFRESH
from sync_learners import batch
from sync_learners import factored_learner
from sync_learners import same_bits
from sync_learners import small_params

STEPS = 300  # REFRESH = 25: 12 windows, 11 merges after the first


@pytest.mark.parametrize(
    "kind,base_dtype,weight_decay,coords_dtype,step_bits",
    [
        ("range", "float32", 0.0, "float32", None),
        ("random", "bfloat16", 0.1, "float32", None),
        ("svd", "bfloat16", 0.0, "float32", None),
        ("range", "bfloat16", 0.1, "bfloat16", None),
        ("range", "bfloat16", 0.0, "float32", 4),
        ("random", "float32", 0.0, "float32", 8),
    ],
)
def test_receiver_is_bit_identical_over_many_windows(
    kind, base_dtype, weight_decay, coords_dtype, step_bits
):
  """300 steps, 12 windows; with bfloat16 coordinates the messages carry
  the rounded coordinates the learner itself holds, with quantized steps
  each step's codes, which the receiver adds to its coordinates."""
  weights, state, step = factored_learner(
      kind,
      base_dtype,
      weight_decay,
      donate=True,
      coords_dtype=coords_dtype,
      step_bits=step_bits,
  )
  sender = sync.PolicySender(weights, state, seed=7, kind=kind)
  receiver = sync.PolicyReceiver(
      policy_state.synced_state(weights, state),
      seed=7,
      projectors=policy_state.projector_source(state),
      kind=kind,
  )
  receiver.apply(
      sync.decode(sync.encode(sender.message(weights, state, full=True)))
  )
  merges = 0
  dense = jax.jit(policy_state.dense_weights)
  for i in range(STEPS):
    weights, state = step(weights, state, batch(i))
    message = sender.message(weights, state)
    merges += message.merge_step >= 0
    carries_codes = "['w'].codes" in message.arrays
    assert carries_codes == (step_bits is not None)
    assert ("['w'].coords" in message.arrays) != carries_codes
    if i % 2:  # every other message through bytes, as to another process
      message = sync.decode(sync.encode(message))
    receiver.apply(message)  # raises on any checksum mismatch
  assert merges == STEPS // REFRESH and receiver.version == STEPS
  assert same_bits(receiver.state, policy_state.synced_state(weights, state))
  assert same_bits(receiver.effective_weights(), dense(weights, state))
  assert receiver.state["weights"]["w"].coords.dtype == coords_dtype


def test_a_step_message_carries_only_the_window():
  weights, state, step = factored_learner("range", "bfloat16", 0.0)
  sender = sync.PolicySender(weights, state, seed=7)
  full = sender.message(weights, state, full=True)
  weights, state = step(weights, state, batch(0))  # merges (step 0)
  first = sender.message(weights, state)
  weights, state = step(weights, state, batch(1))
  second = sender.message(weights, state)
  assert first.merge_step == 0 and second.merge_step == -1
  kinds = {
      n: k
      for n, (k, _) in sync.named_arrays(
          policy_state.synced_state(weights, state)
      ).items()
  }
  assert {kinds[n] for n in full.arrays} == {
      "base",
      "coords",
      "projector",
      "dense",
  }
  assert {kinds[n] for n in first.arrays} == {"coords", "projector", "dense"}
  assert {kinds[n] for n in second.arrays} == {"coords", "dense"}
  # coords [1, 2, 6] and [1, 2, 8] float32, dense bias [20] float32
  assert second.nbytes == 4 * (12 + 16 + 20)


def test_receiver_programs_compile_once_from_an_abstract_template():
  """A receiver made from shapes alone (as the process engine's is) places
  every array it takes alike, so its checksum and merge programs compile
  once, not again as the placements of its arrays change from message to
  message (a 7B receiver spent seconds on each such compile)."""
  weights, state, step = factored_learner("random", "bfloat16", 0.0)
  sender = sync.PolicySender(weights, state, seed=7)
  template = jax.eval_shape(lambda: policy_state.synced_state(weights, state))
  receiver = sync.PolicyReceiver(
      template, seed=7, projectors=policy_state.projector_source(state)
  )
  programs = (checksums.leaf_checksums, sync_endpoints._merge)
  sizes = None
  for i in range(3 * REFRESH + 1):  # merges at the counts 25, 50 and 75
    message = sender.message(weights, state)
    receiver.apply(sync.decode(sync.encode(message)))
    if message.merge_step == REFRESH:  # every program has run once
      sizes = [p._cache_size() for p in programs]
    weights, state = step(weights, state, batch(i))
  receiver.apply(sender.message(weights, state))
  assert sizes == [p._cache_size() for p in programs]
  # Placed on no device in particular: free to join a computation over a
  # mesh (an engine materializing its copy with the run's shardings).
  mesh = jax.make_mesh((len(jax.devices()),), ("data",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  jax.jit(sync.materialize, out_shardings=replicated)(receiver.state)
  for a, b in zip(
      jax.tree.leaves(receiver.state),
      jax.tree.leaves(policy_state.synced_state(weights, state)),
  ):
    np.testing.assert_array_equal(a, b)


def test_random_projectors_are_regenerated_by_the_receiver():
  """``kind="random"``: a refresh's message names the new window instead of
  carrying its projectors, so it is as small as any step's; the receiver
  regenerates them from the seed (its checksums prove them the learner's
  bits). A receiver given no projector source refuses such a message and a
  full one, which carries them, heals it."""
  weights, state, step = factored_learner("random", "bfloat16", 0.0)
  sender = sync.PolicySender(weights, state, seed=7)
  template = policy_state.synced_state(weights, state)
  receiver = sync.PolicyReceiver(
      template, seed=7, projectors=policy_state.projector_source(state)
  )
  blind = sync.PolicyReceiver(template, seed=7)
  full = sender.message(weights, state, full=True)
  assert any(n.startswith("projector:") for n in full.arrays)
  for r in (receiver, blind):
    r.apply(full)
  sizes, windows = set(), []
  for i in range(2 * REFRESH + 1):  # merges before the counts 0, 25, 50
    weights, state = step(weights, state, batch(i))
    message = sender.message(weights, state)
    assert not any(n.startswith("projector:") for n in message.arrays)
    sizes.add(message.nbytes)
    if message.merge_step >= 0:
      windows.append(message.window)
    if message.merge_step == 2 * REFRESH:  # another window's projectors
      wrong = dataclasses.replace(message, window=message.window + 1)
      _refused(receiver, wrong, "names projector window 3 after window 1")
      wrong = dataclasses.replace(message, window=message.window - 1)
      _refused(receiver, wrong, "checksum mismatch")
    elif message.merge_step < 0 and i == REFRESH + 3:
      wrong = dataclasses.replace(message, window=message.window + 1)
      _refused(receiver, wrong, "window 2 after window 1 without a merge")
    receiver.apply(sync.decode(sync.encode(message)))
    if message.merge_step == REFRESH:
      _refused(blind, message, "no projector source")
    elif i < REFRESH:  # window 0's projectors came in the full message
      blind.apply(message)
  assert windows == [0, 1, 2] and len(sizes) == 1
  assert same_bits(receiver.state, policy_state.synced_state(weights, state))
  blind.apply(sender.message(weights, state, full=True))
  assert same_bits(blind.state, receiver.state)


def test_a_message_of_the_previous_format_is_refused(synced):
  data = bytearray(sync.encode(synced[2][0]))
  data[8:12] = (sync.FORMAT_VERSION - 1).to_bytes(4, "little")
  old = sync.FORMAT_VERSION - 1
  with pytest.raises(sync.SyncError, match=f"format {old}; this version reads"):
    sync.decode(bytes(data))


@pytest.mark.parametrize(
    "settings,step_bytes",
    [
        # coords [1, 2, 6] and [1, 2, 8] in bfloat16
        ({"coords_dtype": "bfloat16"}, 2 * (12 + 16)),
        # codes [1, 2, 3] and [1, 2, 4] uint8, exponents [1, 2] int8 twice
        ({"step_bits": 4}, (6 + 8) + (2 + 2)),
    ],
)
def test_small_coordinates_shrink_a_step_message(settings, step_bytes):
  """bfloat16 coordinates travel as the learner keeps them, 2 bytes each;
  4-bit steps as two codes a byte and an exponent a row."""
  weights, state, step = factored_learner("range", "bfloat16", 0.0, **settings)
  sender = sync.PolicySender(weights, state, seed=7)
  sender.message(weights, state, full=True)
  for i in range(2):
    weights, state = step(weights, state, batch(i))
    message = sender.message(weights, state)
  assert message.merge_step == -1
  assert message.nbytes == step_bytes + 4 * 20  # and the dense bias [20]


@functools.cache
def _guarded_learner(step_bits, refresh_every=REFRESH):
  """A factored LoGRA loop under ``skip_non_finite`` (a batch holding a NaN
  is a skipped update): ``(weights, state, step)``; the step donates
  nothing, so the first two can start several runs."""
  params = small_params()
  tx = non_finite.skip_non_finite(
      logra.logra(
          1e-2,
          rank=2,
          refresh_every=refresh_every,
          factored=True,
          step_bits=step_bits,
      )
  )
  state = tx.init(params)

  @jax.jit
  def step(weights, state, x):
    weights = factored.merge_at_refresh(weights, state, seed=7)
    loss = lambda p, x: jnp.mean(
        jnp.square(matmul(matmul(x, p["v"])[:, :6], p["w"]) + p["b"])
    )
    _, sketches, projectors = logra.value_and_sketch_grad(loss)(
        weights, state, x
    )
    count = sketch_grad.project_state(state).count
    updates, state = tx.update(sketches, state, weights, projectors=projectors)
    return factored.apply_updates(weights, updates, seed=7, step=count), state

  return factored.factor(params, state), state, step


def _synced_pair(weights, state):
  sender = sync.PolicySender(weights, state, seed=7)
  receiver = sync.PolicyReceiver(
      policy_state.synced_state(weights, state), seed=7
  )
  receiver.apply(sender.message(weights, state, full=True))
  return sender, receiver


@pytest.mark.parametrize("step_bits", [None, 4])
def test_a_skipped_update_is_followed_exactly(step_bits):
  """A non-finite batch makes ``skip_non_finite`` skip the update; the
  message after it carries the coordinates (the quantize stage's codes are
  not what was applied), the next ones codes again."""
  weights, state, step = _guarded_learner(step_bits)
  sender, receiver = _synced_pair(weights, state)
  carried = []
  for i in range(6):
    x = batch(i).at[0, 0].set(jnp.nan if i == 3 else 0.0)
    weights, state = step(weights, state, x)
    message = sender.message(weights, state)
    carried.append("['v'].codes" in message.arrays)
    receiver.apply(message)  # raises on any checksum mismatch
  assert non_finite.non_finite_state(state).skipped_steps == 1
  quantized = step_bits is not None
  assert carried == [quantized] * 3 + [False] + [quantized] * 2
  assert same_bits(receiver.state, policy_state.synced_state(weights, state))


@settings(deadline=None, max_examples=8, derandomize=True)
@given(
    plan=st.lists(
        st.sampled_from(("step", "skipped", "two", "full")),
        min_size=3,
        max_size=9,
    )
)
def test_any_run_of_steps_skips_and_resyncs_is_followed_exactly(plan):
  """4-bit steps, a refresh every 3 updates: each message follows an
  update, a skipped update, two updates or a full resync, in any order; the
  receiver applies every one (no checksum mismatch) and ends with the
  learner's bits."""
  weights, state, step = _guarded_learner(4, refresh_every=3)
  sender, receiver = _synced_pair(weights, state)
  batches = iter(range(10**6))
  for action in plan:
    for _ in range(2 if action == "two" else 1):
      x = batch(next(batches))
      weights, state = step(
          weights, state, x.at[0, 0].set(jnp.nan if action == "skipped" else 0)
      )
    receiver.apply(sender.message(weights, state, full=action == "full"))
  assert same_bits(receiver.state, policy_state.synced_state(weights, state))


@pytest.mark.parametrize(
    "kind,step_bits", [("range", None), ("random", None), ("range", 4)]
)
def test_several_updates_per_message_stay_exact(kind, step_bits):
  """Two updates per message (``num_iterations=2``): a merge before the
  first of them is sent as a merge, one before the second (whose window the
  receiver never held) as a full message; quantized steps send the
  coordinates (the codes are the last update's only)."""
  weights, state, step = factored_learner(
      kind, "bfloat16", 0.0, step_bits=step_bits
  )
  sender = sync.PolicySender(weights, state, seed=7)
  receiver = sync.PolicyReceiver(
      policy_state.synced_state(weights, state),
      seed=7,
      projectors=policy_state.projector_source(state),
  )
  receiver.apply(sender.message(weights, state))  # the first is full
  fulls, merges = [], []
  for i in range(0, 60, 2):  # merges before the updates at counts 0, 25, 50
    for j in (i, i + 1):
      weights, state = step(weights, state, batch(j))
    message = sender.message(weights, state)
    fulls.append(message.full)
    merges.append(message.merge_step)
    assert not any(n.endswith(".codes") for n in message.arrays)
    receiver.apply(message)  # raises on any checksum mismatch
  assert same_bits(receiver.state, policy_state.synced_state(weights, state))
  assert [i for i, f in enumerate(fulls) if f] == [12]  # counts 24-26
  assert [m for m in merges if m >= 0] == [0, 25, 50]


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.pop("['w'].exponents"), "does not fit the layout"),
        (
            lambda a: a.update(
                {"['w'].codes": a["['w'].codes"].astype("int16")}
            ),
            "step codes of \\['w'\\]",
        ),
        (
            lambda a: a.update({"['w'].codes": a["['w'].codes"][..., :2]}),
            "do not fit float32 coordinates",
        ),
        (
            lambda a: a.update({"['w'].codes": a["['w'].codes"] ^ 1}),
            "checksum mismatch",
        ),
    ],
)
def test_bad_step_codes_are_refused_and_the_weights_kept(change, match):
  weights, state, step = factored_learner("range", "float32", 0.0, step_bits=4)
  sender = sync.PolicySender(weights, state, seed=7)
  receiver = sync.PolicyReceiver(
      policy_state.synced_state(weights, state), seed=7
  )
  receiver.apply(sender.message(weights, state, full=True))
  weights, state = step(weights, state, batch(0))
  message = sender.message(weights, state)
  arrays = {n: np.asarray(x) for n, x in message.arrays.items()}
  change(arrays)
  before = receiver.state
  with pytest.raises(sync.SyncError, match=match):
    receiver.apply(dataclasses.replace(message, arrays=arrays))
  assert receiver.state is before and receiver.sequence == 0
  receiver.apply(message)  # the intact message still applies
  assert same_bits(receiver.state, policy_state.synced_state(weights, state))


@pytest.fixture(scope="module")
def synced():
  """A learner two steps in, its messages, and a receiver after the first."""
  weights, state, step = factored_learner("range", "float32", 0.1)
  sender = sync.PolicySender(weights, state, seed=7)
  template = policy_state.synced_state(weights, state)
  full = sender.message(weights, state, full=True)
  messages = []
  for i in range(2):
    weights, state = step(weights, state, batch(i))
    messages.append(sender.message(weights, state))
  return template, full, messages, sender, (weights, state)


def _receiver(synced):
  template, full, messages, _, _ = synced
  receiver = sync.PolicyReceiver(template, seed=7)
  receiver.apply(full)
  receiver.apply(messages[0])
  return receiver


def _refused(receiver, message, match):
  before = jax.tree.map(np.asarray, receiver.state)
  sequence = receiver.sequence
  with pytest.raises(sync.SyncError, match=match):
    receiver.apply(message)
  assert same_bits(receiver.state, before) and receiver.sequence == sequence


def test_bad_messages_are_refused_and_the_weights_kept(synced):
  template, full, messages, _, (weights, state) = synced
  receiver = _receiver(synced)
  _refused(receiver, messages[0], "out of order.*duplicate")
  ahead = dataclasses.replace(messages[1], sequence=5)
  _refused(receiver, ahead, "out of order.*lost")
  other = dataclasses.replace(messages[1], signature="0" * 32)
  _refused(receiver, other, "another policy")
  for field, value in [
      ("window", -7),
      ("window", 2**40),
      ("merge_step", 2**40),
  ]:
    nowhere = dataclasses.replace(messages[1], **{field: value})
    _refused(receiver, nowhere, f"{field} {value} is neither -1 nor")
  name = next(n for n in messages[1].arrays if n.endswith(".coords"))
  tampered = dict(messages[1].arrays)
  tampered[name] = np.asarray(tampered[name]) + 1e-6
  _refused(
      receiver,
      dataclasses.replace(messages[1], arrays=tampered),
      "checksum mismatch",
  )
  short = {n: x for n, x in messages[1].arrays.items() if n != name}
  _refused(receiver, dataclasses.replace(messages[1], arrays=short), "missing")
  wrong_shape = dict(messages[1].arrays, **{name: np.zeros((3,), np.float32)})
  _refused(
      receiver,
      dataclasses.replace(messages[1], arrays=wrong_shape),
      "does not fit",
  )
  receiver.apply(messages[1])  # the right message still applies
  assert same_bits(receiver.state, policy_state.synced_state(weights, state))


def test_a_full_resync_heals_a_diverged_receiver(synced):
  template, full, messages, sender, (weights, state) = synced
  receiver = _receiver(synced)
  # Damage the receiver's own base (which step messages do not carry): the
  # next message's checksums catch it.
  w = receiver.state["weights"]["w"]
  receiver.state = {
      **receiver.state,
      "weights": {
          **receiver.state["weights"],
          "w": dataclasses.replace(w, base=w.base.at[0, 0].add(1.0)),
      },
  }
  with pytest.raises(sync.SyncError, match="checksum mismatch"):
    receiver.apply(messages[1])
  resync = sender.message(weights, state, full=True)
  receiver.apply(resync)
  assert same_bits(receiver.state, policy_state.synced_state(weights, state))


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda b: b[:10], "truncated"),
        (lambda b: b[:-3], "truncated"),
        (lambda b: b + b"\0", "truncated or padded"),
        (lambda b: b"X" + b[1:], "bad magic"),
        (lambda b: b[:40] + bytes([b[40] ^ 0xFF]) + b[41:], "corrupted"),
    ],
)
def test_damaged_bytes_are_refused(synced, damage, match):
  data = sync.encode(synced[2][0])
  with pytest.raises(sync.SyncError, match=match):
    sync.decode(damage(data))


def test_a_receiver_starts_from_a_full_message_of_its_own_config(synced):
  template, full, messages, _, _ = synced
  receiver = sync.PolicyReceiver(template, seed=7)
  with pytest.raises(sync.SyncError, match="not a full message"):
    receiver.apply(messages[0])
  for other in (
      sync.PolicyReceiver(template, seed=8),
      sync.PolicyReceiver(template, seed=7, rank=3),
  ):
    with pytest.raises(sync.SyncError, match="another policy"):
      other.apply(full)
  receiver.apply(full)
  receiver.apply(messages[0])
  receiver.apply(messages[1])
  # A stale resync does not roll it back: of its sender, nor of another.
  with pytest.raises(sync.SyncError, match="duplicate or an old message"):
    receiver.apply(full)
  with pytest.raises(sync.SyncError, match="older"):
    receiver.apply(dataclasses.replace(full, sender=full.sender + 1))


def test_weights_that_are_not_factored_are_sent_whole():
  """Another optimizer (dense Adam): every leaf is a dense leaf, sent each
  step, as a full broadcast would."""
  params = small_params()
  tx = optax.adam(1e-2)
  state = tx.init(params)
  sender = sync.PolicySender(params, state, seed=0)
  receiver = sync.PolicyReceiver(
      policy_state.synced_state(params, state), seed=0
  )
  receiver.apply(sender.message(params, state, full=True))
  params = optax.apply_updates(params, tx.update(params, state)[0])
  message = sender.message(params, state)
  assert message.merge_step == -1 and set(message.arrays) == {
      "['b']",
      "['v']",
      "['w']",
  }
  receiver.apply(sync.decode(sync.encode(message)))
  assert same_bits(receiver.effective_weights(), params)


def test_docstring_examples_run():
  result = doctest.testmod(sync, optionflags=doctest.ELLIPSIS)
  assert result.failed == 0 and result.attempted > 0
