"""A rollout engine in a separate process, reached over a local socket.

:class:`ProcessEngine` starts ``python -m logra_jax.rollout.transport`` on
one end of a socket pair. The child builds its own :class:`RolloutEngine`
from the run's config and policy folder (its layout and sync signature are
its own, so a learner of another model, rank or projector kind is refused)
and serves requests until it is closed or the socket closes.

Every request and reply is one frame: a header (magic ``LGRT``, kind,
payload length, CRC-32 of the payload) and a msgpack payload
(``flax.serialization``; never pickle). A sync request carries the bytes of
:func:`logra_jax.sync.encode`, which have their own header and checksum.
A frame cut short (the other side died or closed mid-message) or damaged is
a :class:`TransportError`; a sync message the child refuses comes back as a
refusal, and :meth:`ProcessEngine.sync` then sends a full message, as the
colocated engine does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import socket
import struct
import subprocess
import sys
import time
import traceback
import zlib
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from logra_jax import models
from logra_jax import sync
from logra_jax.configs.train import TrainConfig, from_dict, to_dict
from logra_jax.rollout import engine as engine_lib

_FRAME = struct.Struct("<4sBQI")   # magic, kind, payload length, CRC-32
_MAGIC = b"LGRT"
# Requests.
_INIT, _SYNC, _SAMPLE, _CLOSE = 1, 2, 3, 4
# Replies.
_OK, _REFUSED, _ERROR = 16, 17, 18
_KINDS = {_INIT: "init", _SYNC: "sync", _SAMPLE: "sample", _CLOSE: "close",
          _OK: "ok", _REFUSED: "refused", _ERROR: "error"}


class TransportError(RuntimeError):
  """The connection to a rollout engine process failed: it closed, a frame
  was cut short or damaged, or the engine failed on a request."""


def send_frame(sock: socket.socket, kind: int, payload: bytes) -> None:
  """Sends one frame: header and ``payload``."""
  sock.sendall(_FRAME.pack(_MAGIC, kind, len(payload), zlib.crc32(payload))
               + payload)


def _read_exactly(sock: socket.socket, size: int, what: str) -> bytes:
  chunks, got = [], 0
  while got < size:
    chunk = sock.recv(min(size - got, 1 << 24))
    if not chunk:
      raise TransportError(f"the connection closed after {got} of the "
                           f"{size} bytes of {what}")
    chunks.append(chunk)
    got += len(chunk)
  return b"".join(chunks)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
  """Receives one frame: ``(kind, payload)``.

  Raises:
    TransportError: the connection closed before or within the frame, or
      its header or CRC-32 is wrong.
  """
  header = _read_exactly(sock, _FRAME.size, "a frame header")
  magic, kind, length, crc = _FRAME.unpack(header)
  if magic != _MAGIC or kind not in _KINDS:
    raise TransportError("not a rollout engine frame (bad magic bytes or "
                         "kind)")
  payload = _read_exactly(sock, length,
                          f"a {_KINDS[kind]} frame's payload")
  if zlib.crc32(payload) != crc:
    raise TransportError(f"{_KINDS[kind]} frame corrupted: CRC-32 of its "
                         "payload differs")
  return kind, payload


def _pack(value: dict[str, Any]) -> bytes:
  return serialization.msgpack_serialize(value)


def _unpack(payload: bytes) -> dict[str, Any]:
  return serialization.msgpack_restore(payload)


class _Server:
  """The child's side: one :class:`RolloutEngine` and its requests."""

  def __init__(self):
    self.engine: Optional[engine_lib.RolloutEngine] = None

  def handle(self, kind: int, payload: bytes) -> tuple[int, bytes]:
    if kind == _INIT:
      request = _unpack(payload)
      config = from_dict(json.loads(request["config"]))
      folder = pathlib.Path(request["folder"])
      policy = engine_lib.Policy.load(folder,
                                      dtype=jnp.dtype(config.policy.dtype))
      # The learner's layout, from the config alone (lazily: rl/ builds on
      # rollout/, not the other way; only this child needs the learner).
      from logra_jax.rl import learner   # noqa: PLC0415
      template = learner.abstract_policy_state(config.optimizer,
                                               policy.params)
      policy.params = None
      self.engine = engine_lib.RolloutEngine(
          policy, template, seed=config.seed,
          dtype=engine_lib.sampling_dtype(config.rollout.dtype),
          **engine_lib.sync_fields(config, folder))
      return _OK, _pack({"signature": self.engine.receiver.signature})
    if self.engine is None:
      raise TransportError(f"a {_KINDS[kind]} request before init")
    if kind == _SYNC:
      try:
        stats = self.engine.sync(sync.decode(payload))
      except sync.SyncError as e:
        return _REFUSED, str(e).encode()
      return _OK, _pack(dataclasses.asdict(stats))
    if kind == _SAMPLE:
      request = _unpack(payload)
      ends = np.cumsum(request["prompt_lengths"])
      out = self.engine.sample(
          [p.tolist() for p in np.split(request["prompt_ids"], ends[:-1])],
          jax.random.wrap_key_data(np.asarray(request["key"])),
          **request["settings"])
      return _OK, _pack({k: np.asarray(v) for k, v in out._asdict().items()})
    raise TransportError(f"unexpected {_KINDS[kind]} frame")


def serve(sock: socket.socket) -> None:
  """Answers requests on ``sock`` until a close request or the connection
  closes. A failed request is answered with its traceback; the engine's
  weights are only ever changed by a verified message."""
  server = _Server()
  while True:
    try:
      kind, payload = recv_frame(sock)
    except TransportError:
      return   # the learner went away
    if kind == _CLOSE:
      send_frame(sock, _OK, b"")
      return
    try:
      reply = server.handle(kind, payload)
    except Exception:   # noqa: BLE001 (reported to the learner)
      reply = _ERROR, traceback.format_exc().encode()
    send_frame(sock, *reply)


class ProcessEngine(engine_lib.Engine):
  """A rollout engine in a separate process, on its own devices.

  Args:
    policy: the learner's :class:`engine_lib.Policy` (its tokenizer encodes
      prompts and decodes completions here; its weights are not sent).
    config: the run's config; the child builds its engine from it.
    folder: the policy's HF folder, which the child loads the model from.
    log_path: where the child's output goes (None: this process's stderr).

  Example (``logra train --set rollout.engine=process`` does this)::

    with ProcessEngine(policy, config, folder) as engine:
      engine.sync(sender.message(weights, opt_state, full=True))
      batch, metrics = engine.rollout(examples, config, rewards, key)
  """

  def __init__(self, policy: engine_lib.Policy, config: TrainConfig,
               folder: pathlib.Path | str, *,
               log_path: Optional[pathlib.Path | str] = None):
    self.policy = policy
    self.resyncs = 0
    self._log_path = None if log_path is None else pathlib.Path(log_path)
    self._log = None if log_path is None else open(log_path, "ab")
    ours, theirs = socket.socketpair()
    self._sock = ours
    try:
      self._process = subprocess.Popen(
          [sys.executable, "-m", "logra_jax.rollout.transport",
           "--fd", str(theirs.fileno())],
          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
          stdout=self._log, stderr=self._log)
    finally:
      theirs.close()
    reply = self._request(_INIT, _pack({
        "config": json.dumps(to_dict(config)), "folder": str(folder)}))
    self.signature = _unpack(reply)["signature"]

  def _request(self, kind: int, payload: bytes) -> bytes:
    """Sends a request; its reply's payload (raises on an error reply)."""
    reply_kind, reply = self._exchange(kind, payload)
    if reply_kind == _REFUSED:
      raise sync.SyncError(reply.decode())
    return reply

  def _exchange(self, kind: int, payload: bytes) -> tuple[int, bytes]:
    if self._sock is None:
      raise TransportError("the rollout engine process is closed")
    try:
      send_frame(self._sock, kind, payload)
      reply_kind, reply = recv_frame(self._sock)
    except (TransportError, OSError) as e:
      raise TransportError(f"rollout engine process: {e}{self._exit_note()}"
                           ) from e
    if reply_kind == _ERROR:
      raise TransportError(f"the rollout engine process failed on a "
                           f"{_KINDS[kind]} request:\n{reply.decode()}")
    return reply_kind, reply

  def _exit_note(self) -> str:
    try:
      code = self._process.wait(timeout=5)
    except subprocess.TimeoutExpired:
      return ""
    where = "" if self._log_path is None else f"; its log: {self._log_path}"
    return f" (it exited with code {code}{where})"

  def sync(self, message: sync.SyncMessage,
           resync: Optional[Callable[[], sync.SyncMessage]] = None
           ) -> engine_lib.SyncStats:
    start = time.perf_counter()
    resynced = False
    try:
      reply = self._request(_SYNC, sync.encode(message))
    except sync.SyncError:
      if resync is None:
        raise
      reply = self._request(_SYNC, sync.encode(resync()))
      self.resyncs += 1
      resynced = True
    stats = engine_lib.SyncStats(**_unpack(reply))
    return dataclasses.replace(stats, resynced=resynced,
                               seconds=time.perf_counter() - start)

  def sample(self, prompt_ids: Sequence[Sequence[int]], key: jax.Array,
             **settings: Any) -> models.SampleOutput:
    reply = self._request(_SAMPLE, _pack({
        "prompt_ids": np.concatenate(
            [np.asarray(p, np.int32) for p in prompt_ids]),
        "prompt_lengths": np.array([len(p) for p in prompt_ids], np.int64),
        "key": np.asarray(jax.random.key_data(key)),
        "settings": settings}))
    arrays = _unpack(reply)
    return models.SampleOutput(**{name: jnp.asarray(arrays[name])
                                  for name in models.SampleOutput._fields})

  def close(self) -> None:
    """Asks the process to exit and waits for it (killing it after 30 s)."""
    if self._sock is None:
      return
    try:
      send_frame(self._sock, _CLOSE, b"")
      recv_frame(self._sock)
    except (TransportError, OSError):
      pass   # already gone
    self._sock.close()
    self._sock = None
    try:
      self._process.wait(timeout=30)
    except subprocess.TimeoutExpired:
      self._process.kill()
      self._process.wait()
    if self._log is not None:
      self._log.close()


def _main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--fd", type=int, required=True,
                      help="the file descriptor of this end of the socket")
  args = parser.parse_args()
  import signal   # noqa: PLC0415
  signal.signal(signal.SIGINT, signal.SIG_IGN)   # the learner stops us
  with socket.socket(fileno=args.fd) as sock:
    serve(sock)


if __name__ == "__main__":
  _main()
