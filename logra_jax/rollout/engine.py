"""The rollout engine: its own copy of the policy and its sampler, kept in
step with the learner by policy sync.

The trainer reaches the engine only through :class:`logra_jax.sync.SyncMessage`
and sample requests; the RL side scores what it samples.
:class:`RolloutEngine` runs colocated with the learner (same process and
devices); its copy of the policy is a :class:`logra_jax.sync.PolicyReceiver`,
bit-identical to the learner's weights after every message, and the sampler
uses the weights it materializes, ``W = c B + P A``, once per message.
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
  ) -> "Policy":
    """Loads an HF folder; under ``mesh``, the weights are placed by the
    partition rules and the sampler is compiled for the mesh.

    ``chat_template`` (``task.chat_template``): ``"auto"`` applies the
    tokenizer's chat template when it has one, ``"none"`` never does.
    ``attention``, ``remat``: ``policy.attention``, ``policy.remat``
    (``DecoderConfig.attention``, ``DecoderConfig.remat``)."""
    folder = check_policy_folder(folder)
    model = models.load_pretrained(
        folder, dtype=dtype, attention=attention, remat=remat
    )
    tokenizer = models.load_tokenizer(folder)
    graphdef, params = models.split_model(model)
    if mesh is not None:
      params = jax.device_put(params, parallel.param_shardings(params, mesh))
    chat = chat_template == "auto" and bool(tokenizer.chat_template)
    if system_prompt is not None and not chat:
      raise ValueError(
          "task.system_prompt needs a chat template, but "
          + (
              "task.chat_template is 'none'"
              if chat_template == "none"
              else f"the tokenizer of {folder} has none"
          )
      )
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
    """The text the policy is shown for ``prompt``: the prompt itself, or
    with :attr:`chat`, the chat template's rendering of the conversation
    (an optional system message, then the prompt as the user's) with the
    assistant's turn opened."""
    if not self.chat:
      return prompt
    messages = [{"role": "user", "content": prompt}]
    if self.system_prompt is not None:
      messages.insert(0, {"role": "system", "content": self.system_prompt})
    return self.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )

  def encode(self, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt's :meth:`prompt_text` (a chat template
    writes its own special tokens, so none are added to it)."""
    return [
        self.tokenizer(self.prompt_text(p), add_special_tokens=not self.chat)[
            "input_ids"
        ]
        for p in prompts
    ]

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
def changed_bfloat16_values(old: Any, new: Any) -> jax.Array:
  """How many values of ``new`` differ from ``old`` once both are rounded
  to bfloat16: what a sparse delta of bfloat16 weights would send."""
  bf16 = lambda x: x.astype(jnp.bfloat16)
  return sum(
      jnp.sum(bf16(a) != bf16(b), dtype=jnp.int32)
      for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new))
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
  ...). Engines and learners built from different configs refuse each
  other's messages."""
  model = json.loads((pathlib.Path(folder) / "config.json").read_text())
  return {"model": model, "optimizer": to_dict(config)["optimizer"]}


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


class RolloutEngine(Engine):
  """A colocated rollout engine: the learner's process and devices.

  Args:
    policy: the tokenizer, sampler and model graph (its ``params`` unused).
    template: the learner's :func:`sync.policy_state`, giving the layout
      (and, for arrays, the device placement) of the engine's copy.
    seed: the run's seed (the merge's rounding key).
    shardings: a tree like the params of the shardings the sampler's
      weights take (None: where XLA places them).
    dtype: the dtype of the weights the sampler uses (``rollout.dtype``;
      :func:`sampling_dtype`).
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
      **fields: Any,
  ):
    self.policy = policy
    self.receiver = sync.PolicyReceiver(template, seed=seed, **fields)
    self.signature = self.receiver.signature
    self._materialize = jax.jit(
        functools.partial(_sampling_weights, dtype=jnp.dtype(dtype)),
        out_shardings=shardings,
    )
    self._params = None

  @property
  def params(self) -> Any:
    """The weights the sampler uses, ``c B + P A`` in the engine's dtype
    (materialized once per message)."""
    if self._params is None:
      raise RuntimeError(
          "the rollout engine has no policy yet: sync a full " "message first"
      )
    return self._params

  def _apply(self, message: sync.SyncMessage) -> SyncStats:
    self.receiver.apply(message)
    old, self._params = self._params, None  # none until these are made
    self._params = jax.block_until_ready(self._materialize(self.receiver.state))
    num_params = sum(x.size for x in jax.tree.leaves(self._params))
    changed = (
        num_params
        if old is None
        else int(changed_bfloat16_values(old, self._params))
    )
    return SyncStats(
        message_bytes=message.nbytes,
        seconds=0.0,
        resynced=False,
        full_bfloat16_bytes=2 * num_params,
        sparse_delta_bytes=SPARSE_DELTA_BYTES_PER_VALUE * changed,
    )

  def sample(
      self, prompt_ids: Sequence[Sequence[int]], key: jax.Array, **settings: Any
  ) -> models.SampleOutput:
    return self.policy.sampler.sample(self.params, prompt_ids, key, **settings)
