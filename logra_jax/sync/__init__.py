"""Policy sync: messages that move a copy of the factored policy to the
learner's, bit for bit.

The learner's policy is factored (:mod:`logra_jax.optim.factored`): each
projected weight is ``W = c B + P A`` and only ``A`` (``[batch, rank,
short]``), ``c`` and the dense leaves change within a projector window; ``B``
changes only when a window is merged, ``B <- round(c B + P A)``, which a
receiver holding the same ``B``, ``P`` and ``A`` computes itself with the
same program and the same rounding bits (:func:`factored.merge`). A
:class:`SyncMessage` therefore carries, per step:

* every leaf's coordinates ``A`` and scale ``c`` (the window's sum of step
  factors, not the step's own factor: the same size, and a message applies
  exactly, with no float arithmetic on the receiver); with quantized steps
  (:func:`~logra_jax.optim.step_codes.quantize_steps`), after one applied
  update, that update's codes and exponents instead of ``A``, which the
  receiver adds (the decoded step is exact, and so is the sum);
* the dense leaves' new values;
* with LoRA adapters (:mod:`logra_jax.optim.lora`) instead of a factored
  policy: every adapter's ``D`` and ``U``; the frozen weights travel only in
  full messages, as do the embedding table and LM head that
  ``optimizer.freeze_embeddings`` leaves as they are (the sender's and
  receiver's ``frozen``);
* at a refresh, the step of the merge and the new window's projectors ``P``
  (``kind="random"`` ones are not sent: the message names the window and
  the receiver regenerates them from the seed,
  :func:`~logra_jax.policy_state.projector_source`; a full message carries
  them all the same);
* a checksum of every array the receiver must end with
  (:func:`logra_jax.checksums.leaf_checksums`, computed on the device), a
  sequence number, the sender's id, the policy version and a signature of
  the layout.

A full message (``full=True``, a *resync*) carries every array, bases
included. :class:`PolicyReceiver` verifies a message, applies it to a new
copy and commits it only when every checksum matches: a message that does
not fit (another model or layout, a sequence number out of order, a missing
or misshapen array, a checksum mismatch) raises :class:`SyncError` and the
receiver keeps its weights. :func:`encode` / :func:`decode` turn messages into
bytes (msgpack arrays behind a checked header, never pickle) for a receiver
in another process.

Example:
  >>> import jax, jax.numpy as jnp, logra_jax as logra
  >>> from logra_jax import policy_state
  >>> from logra_jax.optim import factored
  >>> params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
  >>> tx = logra.logra(1e-2, rank=2, refresh_every=2, factored=True)
  >>> state = tx.init(params)
  >>> weights = factored.factor(params, state)
  >>> sender = PolicySender(weights, state, seed=0)
  >>> receiver = PolicyReceiver(policy_state.synced_state(weights, state), seed=0)
  >>> receiver.apply(decode(encode(sender.message(weights, state, full=True))))
  >>> receiver.version, sorted(receiver.state)
  (0, ['projectors', 'weights'])
"""

from logra_jax.sync.endpoints import PolicyReceiver
from logra_jax.sync.endpoints import PolicySender
from logra_jax.sync.endpoints import materialize
from logra_jax.sync.layout import named_arrays
from logra_jax.sync.layout import signature
from logra_jax.sync.messages import ADAPTER
from logra_jax.sync.messages import BASE
from logra_jax.sync.messages import COORDS
from logra_jax.sync.messages import DENSE
from logra_jax.sync.messages import FORMAT_VERSION
from logra_jax.sync.messages import FROZEN
from logra_jax.sync.messages import PROJECTOR
from logra_jax.sync.messages import SCALE
from logra_jax.sync.messages import SyncError
from logra_jax.sync.messages import SyncMessage
from logra_jax.sync.messages import decode
from logra_jax.sync.messages import encode
from logra_jax.sync.messages import encode_parts
