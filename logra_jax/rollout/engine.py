"""The rollout engines: samplers of the learner's policy, and how they
follow its updates.

:class:`SharedEngine` runs colocated with the learner (same process and
devices) and samples with the learner's own arrays: factored weights are
applied as ``c (x B) + (x P) A`` in the model's compute dtype; there is no
second copy of the policy and no message. The engines that sample while the
learner trains (``rollout.max_staleness > 0``, or a separate process) hold
their own copy instead, a :class:`logra_jax.sync.PolicyReceiver` kept
bit-identical to the learner's weights by :class:`logra_jax.sync.SyncMessage`:
:class:`RolloutEngine` (colocated, sampling with the weights it materializes,
``W = c B + P A``, once per message) and the process engine of
:mod:`logra_jax.rollout.transport`. The RL side scores what they sample.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import models
from logra_jax import parallel
from logra_jax import policy_state
from logra_jax import sync
from logra_jax.configs import PolicyConfig, TrainConfig, to_dict
from logra_jax.data.batching import decode_completions


def check_policy_folder(folder: str | pathlib.Path) -> pathlib.Path:
  """``folder`` as a path if it is a Hugging Face model folder (it holds
  ``config.json``), else a one-line error naming it: FileNotFoundError or
  NotADirectoryError, or a ValueError that points a training run's folder
  to ``logra export``."""
  folder = pathlib.Path(folder).expanduser()
  if not folder.exists():
    raise FileNotFoundError(f"policy folder {folder} does not exist")
  if not folder.is_dir():
    raise NotADirectoryError(
        f"policy folder {folder} is a file, not a " "folder"
    )
  if (folder / "checkpoints").is_dir():
    raise ValueError(
        f"{folder} is the folder of a training run, not a policy: write its "
        f"policy as a Hugging Face folder with `logra export --checkpoint "
        f"{folder} --out <folder>` and use that"
    )
  if not (folder / "config.json").is_file():
    raise FileNotFoundError(
        f"policy folder {folder} holds no config.json: "
        "it is not a Hugging Face model folder"
    )
  return folder


def uses_chat_template(
    tokenizer: Any,
    chat_template: str,
    system_prompt: Optional[str],
    where: Any,
) -> bool:
  """Whether prompts are rendered by ``tokenizer``'s chat template
  (``task.chat_template`` ``"auto"`` and the tokenizer has one); refuses a
  ``system_prompt`` without one, naming ``where`` the tokenizer is from."""
  chat = chat_template == "auto" and bool(
      getattr(tokenizer, "chat_template", None)
  )
  if system_prompt is not None and not chat:
    raise ValueError(
        "task.system_prompt needs a chat template, but "
        + (
            "task.chat_template is 'none'"
            if chat_template == "none"
            else f"the tokenizer of {where} has none"
        )
    )
  return chat


def prompt_text(
    tokenizer: Any, prompt: str, chat: bool, system_prompt: Optional[str]
) -> str:
  """The text a policy is shown for ``prompt``: the prompt itself, or with
  ``chat``, the tokenizer's chat template's rendering of the conversation
  (an optional system message, then the prompt as the user's) with the
  assistant's turn opened."""
  if not chat:
    return prompt
  messages = [{"role": "user", "content": prompt}]
  if system_prompt is not None:
    messages.insert(0, {"role": "system", "content": system_prompt})
  return tokenizer.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True
  )


def encode_prompts(
    tokenizer: Any,
    prompts: Sequence[str],
    chat: bool,
    system_prompt: Optional[str],
) -> list[list[int]]:
  """Token ids of each prompt's :func:`prompt_text` (a chat template writes
  its own special tokens, so none are added to it)."""
  return [
      tokenizer(
          prompt_text(tokenizer, p, chat, system_prompt),
          add_special_tokens=not chat,
      )["input_ids"]
      for p in prompts
  ]


@dataclasses.dataclass
class Policy:
  """A policy on the host side: weights, tokenizer and a compiled sampler.

  Attributes:
    chat: prompts are shown as a user message in the tokenizer's chat
      template, with the assistant's turn opened (an instruct checkpoint).
    system_prompt: with ``chat``, a system message before each prompt.
  """

  graphdef: Any
  params: Any
  tokenizer: Any
  sampler: models.Sampler
  folder: pathlib.Path
  chat: bool = False
  system_prompt: Optional[str] = None

  @classmethod
  def load(
      cls,
      folder: pathlib.Path | str,
      dtype=jnp.float32,
      mesh: jax.sharding.Mesh | None = None,
      *,
      chat_template: str = "auto",
      system_prompt: Optional[str] = None,
      attention: str = PolicyConfig.attention,
      remat: str = PolicyConfig.remat,
      batch_invariant: bool = PolicyConfig.batch_invariant,
  ) -> "Policy":
    """Loads an HF folder; under ``mesh``, the weights are placed by the
    partition rules and the sampler is compiled for the mesh.

    ``chat_template`` (``task.chat_template``): ``"auto"`` applies the
    tokenizer's chat template when it has one, ``"none"`` never does.
    ``attention``, ``remat``, ``batch_invariant``: ``policy.attention``,
    ``policy.remat``, ``policy.batch_invariant`` (the
    ``DecoderConfig`` fields of these names)."""
    folder = check_policy_folder(folder)
    model = models.load_pretrained(
        folder,
        dtype=dtype,
        attention=attention,
        remat=remat,
        batch_invariant=batch_invariant,
    )
    tokenizer = models.load_tokenizer(folder)
    graphdef, params = models.split_model(model)
    if mesh is not None:
      params = jax.device_put(params, parallel.param_shardings(params, mesh))
    chat = uses_chat_template(tokenizer, chat_template, system_prompt, folder)
    policy = cls(
        graphdef,
        params,
        tokenizer,
        models.Sampler(model, pad_id=tokenizer.pad_token_id or 0, mesh=mesh),
        folder,
        chat=chat,
        system_prompt=system_prompt,
    )
    if chat:  # a template that cannot render a prompt fails here, not later
      try:
        policy.prompt_text("1 + 1 =")
      except Exception as error:  # noqa: BLE001 -- jinja2 and template errors.
        raise ValueError(
            f"the chat template of {folder} cannot render a prompt"
            + (" with task.system_prompt" if system_prompt is not None else "")
            + f": {type(error).__name__}: {error}"
        ) from None
    return policy

  def prompt_text(self, prompt: str) -> str:
    """The text the policy is shown for ``prompt`` (:func:`prompt_text`)."""
    return prompt_text(self.tokenizer, prompt, self.chat, self.system_prompt)

  def encode(self, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt (:func:`encode_prompts`)."""
    return encode_prompts(
        self.tokenizer, prompts, self.chat, self.system_prompt
    )

  def decode(self, tokens) -> list[str]:
    return decode_completions(
        self.tokenizer,
        np.asarray(tokens),
        stop_ids=[self.tokenizer.eos_token_id],
    )


# sample(prompt_ids, key, **settings) -> models.SampleOutput: the sampler
# with some weights (``Sampler.sample``'s arguments after ``params``).
SampleFn = Callable[..., models.SampleOutput]


# Bytes of one changed value in a sparse delta of bfloat16 weights (the
# scheme of verl-style delta sync): an int32 flat index and the value.
SPARSE_DELTA_BYTES_PER_VALUE = 4 + 2


@jax.jit
def changed_bfloat16_values(
    old: dict[str, Any], new: dict[str, Any]
) -> jax.Array:
  """How many weights of the synced state ``new`` differ from ``old`` once
  both are materialized (``c B + P A``) and rounded to bfloat16: what a
  sparse delta of bfloat16 weights would send."""
  bf16 = lambda state: jax.tree.map(
      lambda x: x.astype(jnp.bfloat16), sync.materialize(state)
  )
  return sum(
      jnp.sum(a != b, dtype=jnp.int32)
      for a, b in zip(jax.tree.leaves(bf16(old)), jax.tree.leaves(bf16(new)))
  )


@dataclasses.dataclass(frozen=True)
class SyncStats:
  """What one sync cost and what the alternatives would have.

  Attributes:
    message_bytes: the arrays of the message applied.
    seconds: applying it (verifying, merging, materializing the weights).
    resynced: the message did not fit and a full one was applied instead.
    full_bfloat16_bytes: a broadcast of every weight in bfloat16.
    sparse_delta_bytes: a sparse delta of the bfloat16 values that changed
      (measured by comparing the weights before and after).
  """

  message_bytes: int
  seconds: float
  resynced: bool
  full_bfloat16_bytes: int
  sparse_delta_bytes: int


def sync_fields(
    config: TrainConfig, folder: pathlib.Path | str
) -> dict[str, Any]:
  """What the learner's :class:`sync.PolicySender` and an engine put in the
  sync signature besides the layout and the seed: the policy's HF config
  (the model) and the optimizer section (rank, projector kind, base dtype,
  ...), and the weights it leaves frozen (``frozen``, sent only in full
  messages). Engines and learners built from different configs refuse each
  other's messages."""
  model = json.loads((pathlib.Path(folder) / "config.json").read_text())
  return {
      "model": model,
      "optimizer": to_dict(config)["optimizer"],
      "frozen": policy_state.frozen_keys(config.optimizer),
  }


def merge_ahead_every(config: TrainConfig) -> Optional[int]:
  """A run's engines' ``merge_ahead_every``: its learner merges a factored
  policy's window ahead of each refresh (``Learner.merge_ahead``), every
  ``optimizer.refresh_every`` updates; None for other weights."""
  if policy_state.factored_policy(config.optimizer):
    return config.optimizer.refresh_every
  return None


class Engine:
  """What every rollout engine offers: ``sync`` a message and ``sample``
  with the synced weights. Prompts are encoded and completions decoded on
  the caller's side (``policy``'s tokenizer) and scored by the RL side: the
  engine only samples.

  Attributes:
    policy: the caller's :class:`Policy` (its tokenizer).
    resyncs: full messages applied because a message was refused.
    signature: the sync signature of the messages it accepts
      (:func:`sync.signature`).
  """

  policy: Policy
  resyncs: int = 0
  signature: str

  def sync(
      self,
      message: sync.SyncMessage,
      resync: Optional[Callable[[], sync.SyncMessage]] = None,
  ) -> SyncStats:
    """Applies ``message``; when it is refused (:class:`sync.SyncError`),
    applies ``resync()`` (a full message) instead and counts a resync, or
    raises without ``resync``. The engine's weights change only to a
    verified state."""
    start = time.perf_counter()
    resynced = False
    try:
      stats = self._apply(message)
    except sync.SyncError:
      if resync is None:
        raise
      stats = self._apply(resync())
      self.resyncs += 1
      resynced = True
    return dataclasses.replace(
        stats, resynced=resynced, seconds=time.perf_counter() - start
    )

  def _apply(self, message: sync.SyncMessage) -> SyncStats:
    """Applies one message (raises :class:`sync.SyncError` if refused)."""
    raise NotImplementedError

  def sample(
      self, prompt_ids: Sequence[Sequence[int]], key: jax.Array, **settings: Any
  ) -> models.SampleOutput:
    """``Sampler.sample`` with the engine's weights."""
    raise NotImplementedError

  def close(self) -> None:
    """Releases the engine's resources (a process engine's process)."""

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()


def sampling_dtype(name: str) -> jnp.dtype:
  """The dtype ``rollout.dtype`` names; ``"auto"``: bfloat16 on GPU and TPU,
  float32 on CPU."""
  if name == "auto":
    name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
  return jnp.dtype(name)


def _sampling_weights(state: dict[str, Any], dtype: Any) -> Any:
  """The dense weights of ``state`` (``c B + P A``), floating ones in
  ``dtype``."""
  cast = lambda x: (
      x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  )
  return jax.tree.map(cast, sync.materialize(state, dtype))


class SharedEngine(Engine):
  """A colocated engine that samples with the learner's own arrays.

  It holds no weights of its own: :meth:`follow` points it at the learner's
  state after each update (``policy_state.model_view``: factored weights as
  ``c B + P A`` views, applied as ``c (x B) + (x P) A`` in the model's
  compute dtype; LoRA weights as ``W_0 + (s D) U``), and :meth:`sample`
  uses them as they are. The learner donates its arrays to its next update,
  so the engine samples only between updates (``rollout.max_staleness=0``).

  Args:
    policy: the tokenizer, sampler and model graph (its ``params`` unused).
  """

  signature = "shared"

  def __init__(self, policy: Policy):
    self.policy = policy
    self._params = None
    self._num_params = 0

  def follow(self, state: tuple[Any, Any]) -> SyncStats:
    """Samples from now on with the learner's ``state`` (weights, optimizer
    state); nothing is copied or sent."""
    weights, opt_state = state
    self._params = policy_state.model_view(weights, opt_state)
    if not self._num_params:
      dense = jax.eval_shape(
          lambda w, o: policy_state.dense_weights(w, o), weights, opt_state
      )
      self._num_params = sum(x.size for x in jax.tree.leaves(dense))
    return SyncStats(
        message_bytes=0,
        seconds=0.0,
        resynced=False,
        full_bfloat16_bytes=2 * self._num_params,
        sparse_delta_bytes=0,
    )

  def _apply(self, message: sync.SyncMessage) -> SyncStats:
    raise sync.SyncError(
        "a shared engine samples with the learner's own arrays: follow() "
        "its state instead of sending messages"
    )

  def sample(
      self, prompt_ids: Sequence[Sequence[int]], key: jax.Array, **settings: Any
  ) -> models.SampleOutput:
    if self._params is None:
      raise RuntimeError(
          "the shared engine follows no learner state yet: call follow()"
      )
    return self.policy.sampler.sample(self._params, prompt_ids, key, **settings)


class RolloutEngine(Engine):
  """A colocated rollout engine with its own copy of the policy, for
  sampling while the learner trains (``rollout.max_staleness > 0``).

  Its copy is a :class:`sync.PolicyReceiver` kept bit-identical to the
  learner's weights by messages. Its sampler uses that copy as the model
  consumes it (``policy_state.synced_view``: ``c (x B) + (x P) A``, the
  learner's own numerics) when ``dtype`` is the weights' own dtype;
  otherwise the dense weights ``c B + P A`` materialized in ``dtype`` once
  per message.

  Args:
    policy: the tokenizer, sampler and model graph (its ``params`` unused).
    template: the learner's :func:`policy_state.synced_state`, giving the layout
      (and, for arrays, the device placement) of the engine's copy.
    seed: the run's seed (the merge's rounding key).
    shardings: a tree like the params of the shardings materialized
      weights take (None: where XLA places them).
    dtype: the dtype the sampler's weights are in (``rollout.dtype``;
      :func:`sampling_dtype`).
    projectors: regenerates ``kind="random"`` projectors by window
      (``policy_state.projector_source``), so that refresh messages need
      not carry them; None for other kinds.
    merge_ahead_every: as :class:`sync.PolicyReceiver`'s (a run's learner
      merges ahead: ``optimizer.refresh_every``).
    **fields: the signature fields the learner's :class:`sync.PolicySender`
      uses (:func:`sync_fields`).
  """

  def __init__(
      self,
      policy: Policy,
      template: dict[str, Any],
      *,
      seed: int,
      shardings: Any = None,
      dtype: Any = jnp.float32,
      projectors: Optional[Callable[[int], Any]] = None,
      merge_ahead_every: Optional[int] = None,
      **fields: Any,
  ):
    self.policy = policy
    self.receiver = sync.PolicyReceiver(
        template,
        seed=seed,
        projectors=projectors,
        merge_ahead_every=merge_ahead_every,
        **fields,
    )
    self.signature = self.receiver.signature
    dense = jax.eval_shape(sync.materialize, template)
    own = {x.dtype for x in jax.tree.leaves(dense) if _floating(x)}
    self._materialize = (
        None
        if own == {jnp.dtype(dtype)}
        else jax.jit(
            functools.partial(_sampling_weights, dtype=jnp.dtype(dtype)),
            out_shardings=shardings,
        )
    )
    self._num_params = sum(x.size for x in jax.tree.leaves(dense))
    self._params = None

  @property
  def params(self) -> Any:
    """The weights the sampler uses: the synced copy's view, or ``c B + P
    A`` materialized in the engine's dtype."""
    if self._params is None:
      raise RuntimeError(
          "the rollout engine has no policy yet: sync a full message first"
      )
    return self._params

  def _apply(self, message: sync.SyncMessage) -> SyncStats:
    old = None if self._params is None else self.receiver.state
    self.receiver.apply(message)
    self._params = None  # none until these are made
    if self._materialize is None:
      self._params = policy_state.synced_view(self.receiver.state)
    else:
      self._params = jax.block_until_ready(
          self._materialize(self.receiver.state)
      )
    changed = (
        self._num_params
        if old is None
        else int(changed_bfloat16_values(old, self.receiver.state))
    )
    return SyncStats(
        message_bytes=message.nbytes,
        seconds=0.0,
        resynced=False,
        full_bfloat16_bytes=2 * self._num_params,
        sparse_delta_bytes=SPARSE_DELTA_BYTES_PER_VALUE * changed,
    )

  def sample(
      self, prompt_ids: Sequence[Sequence[int]], key: jax.Array, **settings: Any
  ) -> models.SampleOutput:
    return self.policy.sampler.sample(self.params, prompt_ids, key, **settings)


def _floating(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)
