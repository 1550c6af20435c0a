"""Which sync messages a receiver takes: the sender it follows, replays,
restarted senders, messages built again after a failure, fields of the
wrong type."""

import dataclasses
import re
import struct
import zlib

import jax
import numpy as np
import pytest

from logra_jax import policy_state
from logra_jax import sync
from logra_jax.sync import endpoints as sync_endpoints
from logra_jax.sync import messages as sync_messages
from sync_learners import batch
from sync_learners import factored_learner
from sync_learners import same_bits


@pytest.fixture(scope="module")
def learner():
  """A learner's weights, state and step, and a receiver's template."""
  weights, state, step = factored_learner("range", "float32", 0.0)
  return weights, state, step, policy_state.synced_state(weights, state)


def _following(learner):
  """A sender and a receiver that applied its full message."""
  weights, state, _, template = learner
  sender = sync.PolicySender(weights, state, seed=7)
  receiver = sync.PolicyReceiver(template, seed=7)
  receiver.apply(sender.message(weights, state, full=True))
  return sender, receiver


def _refused(receiver, message, match):
  before = jax.tree.map(np.asarray, receiver.state)
  held = (receiver.sequence, receiver.version, receiver.sender)
  with pytest.raises(sync.SyncError, match=match):
    receiver.apply(message)
  assert same_bits(receiver.state, before)
  assert (receiver.sequence, receiver.version, receiver.sender) == held


def test_a_replayed_full_message_is_refused(learner):
  """A full message of the sender followed that is not newer than the one
  held is refused, though its version is not older (a resync, then an
  update that changed no version)."""
  weights, state, _, _ = learner
  sender, receiver = _following(learner)
  first = sender.message(weights, state, full=True)
  receiver.apply(first)
  receiver.apply(sender.message(weights, state, full=True))
  _refused(receiver, first, "full message 1 is a duplicate or an old")


def test_a_restarted_sender_is_followed_from_its_full_message(learner):
  """A new sender (a restarted learner) starts again at sequence 0: its
  step messages are refused until its full message, which is taken."""
  weights, state, step, _ = learner
  _, receiver = _following(learner)
  restarted = sync.PolicySender(weights, state, seed=7)
  assert restarted.sender != receiver.sender
  full = restarted.message(weights, state, full=True)
  weights, state = step(weights, state, batch(0))
  stepped = restarted.message(weights, state)
  _refused(receiver, stepped, "from another sender")
  receiver.apply(full)
  receiver.apply(stepped)
  assert same_bits(receiver.state, policy_state.synced_state(weights, state))


def test_a_message_built_again_after_a_failure_follows(learner, monkeypatch):
  """A message whose building failed (its checksums, here) counts for
  nothing: the one built again is the next the receiver takes."""
  weights, state, step, _ = learner
  sender, receiver = _following(learner)
  weights, state = step(weights, state, batch(0))

  def out_of_memory(arrays):
    raise MemoryError("checksums")

  with monkeypatch.context() as patch:
    patch.setattr(sync_endpoints, "_checksums", out_of_memory)
    with pytest.raises(MemoryError):
      sender.message(weights, state)
  receiver.apply(sender.message(weights, state))
  assert same_bits(receiver.state, policy_state.synced_state(weights, state))


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("sequence", "1", "field 'sequence' is not int"),
        ("sender", True, "field 'sender' is not int"),
        ("arrays", None, "field 'arrays' is not dict"),
        ("checksums", {"w.coords": 1.5}, "'checksums' holds values"),
    ],
)
def test_a_message_of_wrong_field_types_is_refused(
    learner, field, value, match
):
  weights, state, step, _ = learner
  sender, receiver = _following(learner)
  weights, state = step(weights, state, batch(0))
  message = sender.message(weights, state)
  _refused(receiver, dataclasses.replace(message, **{field: value}), match)
  name = next(iter(message.arrays))
  listed = dict(message.arrays, **{name: [[0.5]]})
  _refused(
      receiver,
      dataclasses.replace(message, arrays=listed),
      r"holds values that are not arrays: \['list'\]",
  )
  receiver.apply(message)


def test_checksums_of_other_arrays_are_named(learner):
  weights, state, step, _ = learner
  sender, receiver = _following(learner)
  weights, state = step(weights, state, batch(0))
  message = sender.message(weights, state)
  name = sorted(message.checksums)[0]
  checksums = {
      "elsewhere" if n == name else n: v for n, v in message.checksums.items()
  }
  _refused(
      receiver,
      dataclasses.replace(message, checksums=checksums),
      re.escape(f"missing [{name!r}], unexpected ['elsewhere']"),
  )


def test_an_unreadable_payload_names_its_error():
  payload = b"\xc1"  # msgpack's reserved byte
  header = struct.pack(
      "<8sIQI",
      b"LOGRASYN",
      sync.FORMAT_VERSION,
      len(payload),
      zlib.crc32(payload),
  )
  with pytest.raises(sync.SyncError, match=r"unreadable: \w+"):
    sync_messages.decode(header + payload)
