"""A rollout engine in a separate process, reached over a local socket.

:class:`ProcessEngine` starts ``python -m logra_jax.rollout.transport`` on
one end of a socket pair. The child builds its own :class:`RolloutEngine`
from the run's config and policy folder (its layout and sync signature are
its own, so a learner of another model, rank or projector kind is refused)
and serves requests until it is closed or the socket closes.

Every request and reply is one frame: a header (magic ``LGRT``, kind,
request id, payload length, CRC-32 of the payload, CRC-32 of the header) and
a msgpack payload (``flax.serialization``; never pickle); a reply carries
its request's id. A sync request carries the bytes of
:func:`logra_jax.sync.encode`, which have their own header and checksum.
A frame cut short (the other side died or closed mid-message), damaged or
late is a :class:`TransportError`; a sync message the child refuses comes
back as a refusal, and :meth:`ProcessEngine.sync` then sends a full message,
as the colocated engine does.

Liveness: while the child works on a request it sends a heartbeat frame
every ``heartbeat_s`` seconds (a quarter of ``rollout.engine_timeout_s``),
so the learner notices a frozen (stopped, deadlocked) or dead child within
``timeout`` seconds of silence, however long the request itself takes.
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
import threading
import traceback
import zlib
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from logra_jax import models
from logra_jax import sync
from logra_jax.configs import TrainConfig, from_dict, to_dict
from logra_jax.rollout import engine as engine_lib
from logra_jax import policy_state

# magic, kind, request id, payload length, CRC-32 of the payload, CRC-32 of
# the header's other fields (checked before the payload is read, so that a
# damaged length is not waited for).
_FIELDS = struct.Struct("<4sBQQI")
_FRAME = struct.Struct(_FIELDS.format + "I")
_MAGIC = b"LGRT"
# Requests.
_INIT, _SYNC, _SAMPLE, _CLOSE = 1, 2, 3, 4
# Replies, and the heartbeat the child sends while it works on a request.
_OK, _REFUSED, _ERROR, _ALIVE = 16, 17, 18, 19
_REPLIES = (_OK, _REFUSED, _ERROR)
_KINDS = {
    _INIT: "init",
    _SYNC: "sync",
    _SAMPLE: "sample",
    _CLOSE: "close",
    _OK: "ok",
    _REFUSED: "refused",
    _ERROR: "error",
    _ALIVE: "heartbeat",
}
# The longest a new child may take to start (import JAX and this package)
# before it reads its first request and its heartbeats begin.
STARTUP_S = 120.0
# jax.config settings the engine process takes from the learner's, so that
# both compute alike (e.g. the tests' matmul precision).
_JAX_SETTINGS = (
    "jax_default_matmul_precision",
    "jax_enable_x64",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
)


class TransportError(RuntimeError):
  """The connection to a rollout engine process failed: it closed, a frame
  was cut short or damaged, no reply came in time, or the engine failed on
  a request."""


class _Closed(TransportError):
  """The connection closed between frames."""


def _header(kind: int, request: int, length: int, crc: int) -> bytes:
  fields = _FIELDS.pack(_MAGIC, kind, request, length, crc)
  return fields + struct.pack("<I", zlib.crc32(fields))


def send_frame(
    sock: socket.socket,
    kind: int,
    payload: bytes | Sequence[bytes],
    request: int = 0,
) -> None:
  """Sends one frame: its header, then ``payload`` (bytes, or parts sent one
  after the other: nothing is joined)."""
  parts = (payload,) if isinstance(payload, (bytes, bytearray)) else payload
  crc = 0
  for part in parts:
    crc = zlib.crc32(part, crc)
  sock.sendall(_header(kind, request, sum(map(len, parts)), crc))
  for part in parts:
    sock.sendall(part)


_HEADER_WHAT = "a frame header"


def _read_exactly(sock: socket.socket, size: int, what: str) -> bytearray:
  buffer = bytearray(size)
  view, got = memoryview(buffer), 0
  while got < size:
    try:
      count = sock.recv_into(view[got:], min(size - got, 1 << 26))
    except socket.timeout:
      raise TransportError(
          f"no reply within {sock.gettimeout():.0f} s "
          f"({got} of the {size} bytes of {what})"
      ) from None
    if not count:
      raise (_Closed if got == 0 and what == _HEADER_WHAT else TransportError)(
          f"the connection closed after {got} of the " f"{size} bytes of {what}"
      )
    got += count
  return buffer


def recv_frame(sock: socket.socket) -> tuple[int, int, bytearray]:
  """Receives one frame: ``(kind, request id, payload)``.

  Raises:
    TransportError: the connection closed before or within the frame, no
      frame came within the socket's timeout, or the header or the
      payload's CRC-32 is wrong.
  """
  header = _read_exactly(sock, _FRAME.size, _HEADER_WHAT)
  magic, kind, request, length, crc, header_crc = _FRAME.unpack(header)
  if magic != _MAGIC:
    raise TransportError("not a rollout engine frame (bad magic bytes)")
  if zlib.crc32(header[:-4]) != header_crc or kind not in _KINDS:
    raise TransportError(
        "frame header corrupted (its CRC-32 differs or " "its kind is unknown)"
    )
  payload = _read_exactly(sock, length, f"a {_KINDS[kind]} frame's payload")
  if zlib.crc32(payload) != crc:
    raise TransportError(
        f"{_KINDS[kind]} frame corrupted: CRC-32 of its " "payload differs"
    )
  return kind, request, payload


def _pack(value: dict[str, Any]) -> bytes:
  return serialization.msgpack_serialize(value)


def _unpack(payload: bytes) -> dict[str, Any]:
  return serialization.msgpack_restore(payload)


class _Server:
  """The child's side: one :class:`RolloutEngine` and its requests."""

  def __init__(self):
    self.engine: Optional[engine_lib.RolloutEngine] = None

  def handle(self, kind: int, payload: bytearray) -> tuple[int, bytes]:
    if kind == _INIT:
      request = _unpack(payload)
      for name, value in request["jax"].items():
        jax.config.update(name, value)
      config = from_dict(json.loads(request["config"]))
      folder = pathlib.Path(request["folder"])
      policy = engine_lib.Policy.load(
          folder,
          dtype=jnp.dtype(config.policy.dtype),
          attention=config.policy.attention,
          remat=config.policy.remat,
          batch_invariant=config.policy.batch_invariant,
      )
      # The learner's layout and projector source, from the config alone.
      template, projectors = policy_state.abstract_receiver(
          config.optimizer, policy.params
      )
      policy.params = None
      self.engine = engine_lib.RolloutEngine(
          policy,
          template,
          seed=config.seed,
          dtype=engine_lib.sampling_dtype(config.rollout.dtype),
          projectors=projectors,
          merge_ahead_every=engine_lib.merge_ahead_every(config),
          **engine_lib.sync_fields(config, folder),
      )
      return _OK, _pack({"signature": self.engine.receiver.signature})
    if self.engine is None:
      raise TransportError(f"a {_KINDS[kind]} request before init")
    if kind == _SYNC:
      try:
        stats = self.engine.sync(sync.decode(payload))  # no copy
      except sync.SyncError as e:
        return _REFUSED, str(e).encode()
      return _OK, _pack(dataclasses.asdict(stats))
    if kind == _SAMPLE:
      request = _unpack(payload)
      ends = np.cumsum(request["prompt_lengths"])
      key = jax.random.wrap_key_data(
          np.asarray(request["key"]), impl=request["key_impl"]
      )
      out = self.engine.sample(
          [p.tolist() for p in np.split(request["prompt_ids"], ends[:-1])],
          key,
          **request["settings"],
      )
      return _OK, _pack({k: np.asarray(v) for k, v in out._asdict().items()})
    raise TransportError(f"unexpected {_KINDS[kind]} frame")


class _Heartbeat:
  """While the block runs, a thread sends a heartbeat frame for ``request``
  every ``seconds``; ``send`` sends a frame whole (under the lock the
  heartbeats take), so the two never interleave."""

  def __init__(self, sock: socket.socket, seconds: float):
    self._sock, self._seconds = sock, seconds
    self._lock = threading.Lock()
    self._done = threading.Event()
    self._request = 0

  def send(self, kind: int, payload: bytes, request: int) -> None:
    with self._lock:
      send_frame(self._sock, kind, payload, request)

  def _beat(self) -> None:
    while not self._done.wait(self._seconds):
      try:
        self.send(_ALIVE, b"", self._request)
      except OSError:
        return  # the learner went away; the main loop will see it

  def __call__(self, request: int) -> "_Heartbeat":
    self._request = request
    return self

  def __enter__(self) -> None:
    self._done.clear()
    self._thread = threading.Thread(target=self._beat, daemon=True)
    self._thread.start()

  def __exit__(self, *exc) -> None:
    self._done.set()
    self._thread.join()


def serve(sock: socket.socket, heartbeat_s: float = 15.0) -> None:
  """Answers requests on ``sock`` until a close request or the connection
  closes, sending a heartbeat every ``heartbeat_s`` seconds while it works
  on one. A failed request is answered with its traceback; the engine's
  weights are only ever changed by a verified message. A damaged frame ends
  the connection (the stream cannot be trusted after it), said on stderr."""
  server = _Server()
  heartbeat = _Heartbeat(sock, heartbeat_s)
  while True:
    try:
      kind, request, payload = recv_frame(sock)
    except _Closed:
      return  # the learner went away
    except TransportError as e:
      print(f"rollout engine: {e}; exiting", file=sys.stderr, flush=True)
      return
    if kind == _CLOSE:
      _reply(heartbeat, _OK, b"", request)
      return
    with heartbeat(request):
      try:
        reply = server.handle(kind, payload)
      except Exception:  # noqa: BLE001 (reported to the learner)
        reply = _ERROR, traceback.format_exc().encode()
    if not _reply(heartbeat, *reply, request):
      return


def _reply(heartbeat: _Heartbeat, kind: int, payload: bytes, request: int):
  """Sends a reply; False when the learner has gone away (it closed the
  connection after giving up on the request, or after asking to close)."""
  try:
    heartbeat.send(kind, payload, request)
  except (BrokenPipeError, ConnectionResetError):
    return False
  return True


class ProcessEngine(engine_lib.Engine):
  """A rollout engine in a separate process.

  The child runs in a session of its own (a SIGTERM or Ctrl-C to the
  learner's process group reaches only the learner, which stops after its
  step and closes the engine) and exits when its socket closes, e.g. when
  the learner dies. It takes the learner's ``jax.config`` numerics settings
  (matmul precision, x64, PRNG implementation) and the devices its
  environment gives it: on a GPU shared with the learner, bound each side's
  memory (``XLA_PYTHON_CLIENT_MEM_FRACTION``) or give the child devices of
  its own (``CUDA_VISIBLE_DEVICES``) in its environment, ``env``.

  The child sends a heartbeat every quarter of ``timeout`` while it works
  on a request, so a request fails once the child has been silent for
  ``timeout`` seconds (frozen or dead), however long it takes (a new child
  has :data:`STARTUP_S` to start, before its heartbeats begin). A request
  that fails half-way (silence, a closed or damaged connection, an
  interrupt) stops the child, and every later request raises
  :class:`TransportError` until :meth:`restart`: replies are matched to
  requests by id, never guessed. :meth:`interrupt` ends a request in
  progress at once, from any thread.

  Args:
    policy: the learner's :class:`engine_lib.Policy` (its tokenizer encodes
      prompts and decodes completions here; its weights are not sent).
    config: the run's config; the child builds its engine from it.
    folder: the policy's HF folder, which the child loads the model from.
    log_path: where the child's output goes (None: its stderr is this
      process's, its stdout discarded).
    timeout: the longest silence (seconds) before the child is taken for
      frozen or dead (``rollout.engine_timeout_s``).
    env: the child's environment (None: this process's).

  Example (``logra train --set rollout.engine=process`` does this)::

    with ProcessEngine(policy, config, folder) as engine:
      engine.sync(sender.message(weights, opt_state, full=True))
      out = engine.sample(policy.encode(prompts), key, max_new_tokens=8)
  """

  def __init__(
      self,
      policy: engine_lib.Policy,
      config: TrainConfig,
      folder: pathlib.Path | str,
      *,
      log_path: Optional[pathlib.Path | str] = None,
      timeout: float = 60.0,
      env: Optional[dict[str, str]] = None,
  ):
    self.policy = policy
    self._requests = 0
    self._sock = self._process = self._log = None
    self._interrupted = False
    self._failure: Optional[str] = None
    self._log_path = None if log_path is None else pathlib.Path(log_path)
    self._timeout, self._env = timeout, env
    self._init = _pack(
        {
            "config": json.dumps(to_dict(config)),
            "folder": str(folder),
            "jax": {name: getattr(jax.config, name) for name in _JAX_SETTINGS},
        }
    )
    self._start()

  def _start(self) -> None:
    """Starts the child and builds its engine (its INIT request)."""
    try:
      if self._log_path is not None:
        self._log = open(self._log_path, "ab")
      self._sock, theirs = socket.socketpair()
      with theirs:
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "logra_jax.rollout.transport",
                "--fd",
                str(theirs.fileno()),
                "--heartbeat-s",
                str(self._timeout / 4),
            ],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            # Without a log: its stderr is this process's (file descriptor
            # 2, which also works under notebooks' replaced sys.stderr).
            stdout=self._log or subprocess.DEVNULL,
            stderr=self._log,
            env=self._env,
            start_new_session=True,
        )
      self._sock.settimeout(max(self._timeout, STARTUP_S))
      self.signature = _unpack(self._request(_INIT, self._init))["signature"]
    except BaseException:
      self._stop()
      raise

  def restart(self) -> None:
    """Ends the child (if any is left) and starts a new one; it holds no
    weights until a full sync message."""
    self._stop()
    self._interrupted, self._failure = False, None
    self._start()

  def interrupt(self) -> None:
    """Ends the request in progress (in any thread) with a
    :class:`TransportError`; the child is then stopped."""
    self._interrupted = True
    sock = self._sock
    if sock is not None:
      try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv
      except OSError:
        pass  # already closed

  def _request(self, kind: int, payload: bytes | Sequence[bytes]) -> bytes:
    """Sends a request; its reply's payload (raises on an error reply)."""
    reply_kind, reply = self._exchange(kind, payload)
    if reply_kind == _REFUSED:
      raise sync.SyncError(bytes(reply).decode())
    return reply

  def _exchange(
      self, kind: int, payload: bytes | Sequence[bytes]
  ) -> tuple[int, bytearray]:
    if self._sock is None:
      # What closed it, if a failure did (a later request's error names
      # the cause, not only the closed socket).
      raise TransportError(
          "the rollout engine process is closed"
          + (f" after: {self._failure}" if self._failure else "")
      )
    self._requests += 1
    try:
      send_frame(self._sock, kind, payload, self._requests)
      reply_kind, request, reply = recv_frame(self._sock)
      self._sock.settimeout(self._timeout)  # once started: heartbeats
      while reply_kind == _ALIVE and request == self._requests:
        reply_kind, request, reply = recv_frame(self._sock)
      if request != self._requests or reply_kind not in _REPLIES:
        raise TransportError(
            f"reply {request} ({_KINDS[reply_kind]}) to request "
            f"{self._requests} ({_KINDS[kind]})"
        )
    except BaseException as e:
      # A dead child is reaped at once; an interrupted one not waited for.
      note = self._stop(grace=0.0 if self._interrupted else 5.0)
      if self._interrupted:
        self._failure = f"rollout engine process interrupted{note}"
        raise TransportError(self._failure) from None
      if isinstance(e, (TransportError, OSError)):
        self._failure = f"rollout engine process: {e}{note}"
        raise TransportError(self._failure) from e
      raise
    if reply_kind == _ERROR:
      raise TransportError(
          f"the rollout engine process failed on a "
          f"{_KINDS[kind]} request:\n"
          f"{bytes(reply).decode()}"
      )
    return reply_kind, reply

  def _stop(self, grace: float = 0.0) -> str:
    """Closes the socket and ends the child (killed after ``grace``
    seconds); what became of it, for an error message."""
    if self._sock is not None:
      self._sock.close()
      self._sock = None
    note = ""
    if self._process is not None:
      try:
        code = self._process.wait(timeout=grace)
      except subprocess.TimeoutExpired:
        self._process.kill()
        code = self._process.wait()
        note = f" (it was killed, exit code {code}"
      else:
        note = f" (it exited with code {code}"
      if self._log_path is not None:
        note += f"; its log: {self._log_path}"
      note += ")"
      self._process = None
    if self._log is not None:
      self._log.close()
    self._log = None
    return note

  def _apply(self, message: sync.SyncMessage) -> engine_lib.SyncStats:
    return engine_lib.SyncStats(
        **_unpack(self._request(_SYNC, sync.encode_parts(message)))
    )

  def sample(
      self, prompt_ids: Sequence[Sequence[int]], key: jax.Array, **settings: Any
  ) -> models.SampleOutput:
    if not prompt_ids:
      raise ValueError("sample needs at least one prompt")
    reply = self._request(
        _SAMPLE,
        _pack(
            {
                "prompt_ids": np.concatenate(
                    [np.asarray(p, np.int32) for p in prompt_ids]
                ),
                "prompt_lengths": np.array(
                    [len(p) for p in prompt_ids], np.int64
                ),
                "key": np.asarray(jax.random.key_data(key)),
                "key_impl": str(jax.random.key_impl(key)),
                "settings": settings,
            }
        ),
    )
    arrays = _unpack(reply)
    return models.SampleOutput(
        **{
            name: jnp.asarray(arrays[name])
            for name in models.SampleOutput._fields
        }
    )

  def close(self) -> None:
    """Asks the process to exit and waits for it (killing it after
    ``timeout`` seconds, or at once after :meth:`interrupt`)."""
    if self._sock is None or self._interrupted:
      self._stop()
      return
    try:
      send_frame(self._sock, _CLOSE, b"", self._requests + 1)
      recv_frame(self._sock)
    except (TransportError, OSError):
      pass  # already gone, or it will be stopped
    self._stop(grace=self._timeout)


def _main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--fd",
      type=int,
      required=True,
      help="the file descriptor of this end of the socket",
  )
  parser.add_argument(
      "--heartbeat-s",
      type=float,
      default=15.0,
      help="seconds between heartbeats while a request is worked on",
  )
  args = parser.parse_args()
  with socket.socket(fileno=args.fd) as sock:
    serve(sock, args.heartbeat_s)


if __name__ == "__main__":
  _main()
