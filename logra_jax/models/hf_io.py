"""Load and save Hugging Face checkpoints (config.json + safetensors).

Tensors are read one at a time with `safetensors.safe_open`, stacked per
layer on the host and placed directly on devices, so the host never holds more
than one stacked parameter at once. Saving writes into a temporary folder next
to the target and renames it at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from typing import Any
import warnings

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
import transformers

from logra_jax.models.config import DecoderConfig
from logra_jax.models.decoder import Decoder, param_shapes
from logra_jax.parallel.sharding import logical_to_mesh
from logra_jax.staging import staged_folder

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"

# Our parameter path -> (HF tensor name, "{}" is the layer; transposed?).
# HF linear weights are `[out, in]`; ours are `[in, out]`.
HF_NAMES: dict[tuple[str, ...], tuple[str, bool]] = {
    ("embed",): ("model.embed_tokens.weight", False),
    ("final_norm",): ("model.norm.weight", False),
    ("lm_head",): ("lm_head.weight", True),
    ("layers", "attn_norm"): ("model.layers.{}.input_layernorm.weight", False),
    ("layers", "q_proj"): ("model.layers.{}.self_attn.q_proj.weight", True),
    ("layers", "k_proj"): ("model.layers.{}.self_attn.k_proj.weight", True),
    ("layers", "v_proj"): ("model.layers.{}.self_attn.v_proj.weight", True),
    ("layers", "o_proj"): ("model.layers.{}.self_attn.o_proj.weight", True),
    ("layers", "q_bias"): ("model.layers.{}.self_attn.q_proj.bias", False),
    ("layers", "k_bias"): ("model.layers.{}.self_attn.k_proj.bias", False),
    ("layers", "v_bias"): ("model.layers.{}.self_attn.v_proj.bias", False),
    ("layers", "o_bias"): ("model.layers.{}.self_attn.o_proj.bias", False),
    ("layers", "q_norm"): ("model.layers.{}.self_attn.q_norm.weight", False),
    ("layers", "k_norm"): ("model.layers.{}.self_attn.k_norm.weight", False),
    ("layers", "mlp_norm"): (
        "model.layers.{}.post_attention_layernorm.weight",
        False,
    ),
    ("layers", "gate_proj"): ("model.layers.{}.mlp.gate_proj.weight", True),
    ("layers", "up_proj"): ("model.layers.{}.mlp.up_proj.weight", True),
    ("layers", "down_proj"): ("model.layers.{}.mlp.down_proj.weight", True),
}


def _hf_tensors(
    config: DecoderConfig, path: tuple[str, ...]
) -> list[tuple[str, tuple[int, ...]]]:
  """HF names and HF-orientation shapes of the tensors behind one parameter."""
  template, transpose = HF_NAMES[path]
  shape = param_shapes(config)[path]
  if path[0] == "layers":
    shape = shape[1:]
    names = [template.format(i) for i in range(config.num_layers)]
  else:
    names = [template]
  hf_shape = tuple(reversed(shape)) if transpose else shape
  return [(name, hf_shape) for name in names]


def _tensor_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
  """Maps every tensor name of a checkpoint folder to its safetensors file."""
  index = path / _INDEX_FILE
  if index.exists():
    weight_map = json.loads(index.read_text())["weight_map"]
    files = {name: path / file for name, file in weight_map.items()}
    for file, name in {f: n for n, f in files.items()}.items():
      if not file.exists():
        raise FileNotFoundError(
            f"Shard {file.name} listed in {index} (holding tensor {name!r}) "
            "does not exist: the checkpoint is partial."
        )
    return files
  single = path / _SINGLE_FILE
  if not single.exists():
    raise FileNotFoundError(f"No {_SINGLE_FILE} or {_INDEX_FILE} in {path}.")
  with _open(single) as f:
    return {name: single for name in f.keys()}


def _folder(path: str | os.PathLike) -> pathlib.Path:
  """`path` as a folder, or an error naming it (not a hub repo id error)."""
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"Model folder {path} does not exist.")
  if not path.is_dir():
    raise ValueError(f"{path} is a file, not a model folder.")
  return path


def _read_config(path: pathlib.Path) -> None:
  """Checks that `path/config.json` is an HF model config, naming it if not."""
  file = path / "config.json"
  if not file.is_file():
    raise FileNotFoundError(
        f"There is no config.json in {path}: not a Hugging Face model folder."
    )
  try:
    config = json.loads(file.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{file} is not valid JSON: {e}") from None
  if not isinstance(config, dict) or "model_type" not in config:
    raise ValueError(
        f"{file} has no 'model_type': not a Hugging Face model config."
    )


def _warn_unknown(path: pathlib.Path, names: set[str]) -> None:
  """Warns about checkpoint tensors the model does not use (a few, a count)."""
  # Older Llama exports carry the rotary frequencies, which we recompute.
  unknown = sorted(n for n in names if not n.endswith("rotary_emb.inv_freq"))
  if unknown:
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    warnings.warn(
        f"{len(unknown)} tensors in {path} are not used by the model and were "
        f"ignored: {unknown[:5]}{more}.",
        stacklevel=3,
    )


def _check_finite(name: str, file: pathlib.Path, value: np.ndarray) -> None:
  """Raises a ValueError naming a tensor with NaN or infinite values."""
  bad = value.size - int(np.count_nonzero(np.isfinite(value)))
  if bad:
    raise ValueError(
        f"Tensor {name!r} in {file} has {bad} non-finite value"
        f"{'s' if bad > 1 else ''} (NaN or inf) in {value.dtype}; pass "
        "allow_non_finite=True to load it anyway."
    )


def _open(file: pathlib.Path):
  """`safe_open` with an error that names a corrupt or truncated file."""
  try:
    return safetensors.safe_open(str(file), framework="np")
  except Exception as e:  # safetensors raises its own SafetensorError.
    raise ValueError(f"Cannot read safetensors file {file}: {e}") from e


def read_decoder_config(
    path: str | os.PathLike, **overrides: Any
) -> DecoderConfig:
  """The `DecoderConfig` of a local HF folder, from its config.json alone
  (no tensor is read).

  Args:
    path: folder with `config.json`.
    **overrides: `DecoderConfig` fields to set (e.g. `param_dtype`).

  Raises:
    ValueError, FileNotFoundError: as `load_pretrained` for the folder and
      its config.json.

  Example:
    >>> import pathlib, tempfile
    >>> from logra_jax.models import DecoderConfig, init_model
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "tiny"
    >>> save_pretrained(init_model(DecoderConfig.tiny(vocab_size=32)), path)
    >>> read_decoder_config(path).vocab_size
    32
  """
  path = _folder(path)
  _read_config(path)
  hf_config = transformers.AutoConfig.from_pretrained(path)
  return DecoderConfig.from_hf(hf_config, **overrides)


def load_pretrained(
    path: str | os.PathLike,
    dtype: Any = jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    *,
    compute_dtype: Any = None,
    sharding_rules: dict[str, Any] | None = None,
    allow_non_finite: bool = False,
    **config_overrides: Any,
) -> Decoder:
  """Loads a local HF Llama/Qwen2/Qwen3 folder into a `Decoder`.

  Args:
    path: folder with `config.json` and `model.safetensors` (or a sharded
      `model.safetensors.index.json`).
    dtype: parameter dtype (also the compute dtype unless `compute_dtype`).
    mesh: optional mesh; each parameter is placed with
      `parallel.logical_to_mesh(metadata, mesh, sharding_rules)`. None:
      default device.
    compute_dtype: activation dtype; defaults to `dtype`.
    sharding_rules: logical-to-mesh table passed to `logical_to_mesh`;
      default `parallel.PARTITION_RULES`.
    allow_non_finite: load tensors holding NaN or inf (in `dtype`) instead
      of refusing them.
    **config_overrides: extra `DecoderConfig` fields (e.g. `remat`).

  Returns:
    The model.

  Raises:
    ValueError: `path` is a file, config.json is not an HF model config,
      unsupported architecture, unreadable file, missing tensor, a tensor
      whose shape disagrees with the config, or a non-finite tensor (unless
      `allow_non_finite`).
    FileNotFoundError: no folder `path`, no config.json, no safetensors, or a
      shard listed in the index is missing.

  Tensors of the checkpoint that the model does not use are named in a
  `UserWarning`.

  Example:
    >>> import pathlib, tempfile
    >>> from logra_jax.models import DecoderConfig, init_model
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "tiny"
    >>> save_pretrained(init_model(DecoderConfig.tiny(vocab_size=32)), path)
    >>> load_pretrained(path, dtype=jnp.bfloat16).embed.dtype
    dtype(bfloat16)
  """
  path = _folder(path)
  config = read_decoder_config(
      path,
      param_dtype=dtype,
      dtype=compute_dtype if compute_dtype is not None else dtype,
      **config_overrides,
  )
  abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(abstract, nnx.Param)
  files = _tensor_files(path)
  wanted = {p: _hf_tensors(config, p) for p in param_shapes(config)}
  for tensors in wanted.values():
    for name, _ in tensors:
      if name not in files:
        raise ValueError(
            f"Tensor {name!r} is missing from the checkpoint in " f"{path}."
        )
  _warn_unknown(
      path,
      set(files) - {name for tensors in wanted.values() for name, _ in tensors},
  )

  np_dtype = np.dtype(jnp.dtype(config.param_dtype))
  with contextlib.ExitStack() as stack:
    handles = {f: stack.enter_context(_open(f)) for f in set(files.values())}
    for tensors in wanted.values():
      for name, shape in tensors:
        found = tuple(handles[files[name]].get_slice(name).get_shape())
        if found != shape:
          raise ValueError(
              f"Tensor {name!r} has shape {found} in the checkpoint but the "
              f"config expects {shape}."
          )

    def load(key_path, variable):
      p = tuple(k.key for k in key_path)
      _, transpose = HF_NAMES[p]
      parts = []
      for name, _ in wanted[p]:
        with np.errstate(over="ignore"):  # overflow gives inf: refused below
          t = handles[files[name]].get_tensor(name).astype(np_dtype, copy=False)
        if not allow_non_finite:
          _check_finite(name, files[name], t)
        parts.append(t.T if transpose else t)
      host = np.stack(parts) if p[0] == "layers" else parts[0]
      del parts
      if mesh is None:
        value = jax.device_put(host)
      else:
        value = jax.device_put(
            host,
            logical_to_mesh(
                variable.get_metadata()["out_sharding"],
                mesh,
                sharding_rules,
                shape=host.shape,
                name="/".join(p),
            ),
        )
      return variable.replace(value)

    params = jax.tree_util.tree_map_with_path(
        load, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
  return nnx.merge(graphdef, params)


def save_pretrained(
    model: Decoder,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int = 4 * 2**30,
    overwrite: bool = False,
) -> None:
  """Writes `config.json` and safetensors that `transformers` loads back.

  The files go to a temporary folder next to `path`, renamed to `path` only
  once complete (`logra_jax.staging.staged_folder`), so an interrupted save
  never leaves a complete-looking folder.
  Above `max_shard_bytes` the weights are split into
  `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`.

  Args:
    model: the decoder.
    path: target folder.
    max_shard_bytes: the largest shard (a single bigger tensor gets its own).
    overwrite: replace an existing `path`.

  Raises:
    FileExistsError: `path` exists and `overwrite` is False.
    ValueError: `max_shard_bytes < 1` or a config HF cannot express.

  Example:
    >>> import pathlib, tempfile
    >>> from logra_jax.models import DecoderConfig, init_model
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "tiny"
    >>> save_pretrained(init_model(DecoderConfig.tiny()), path)
    >>> sorted(p.name for p in path.iterdir())
    ['config.json', 'model.safetensors']
  """
  if max_shard_bytes < 1:
    raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}.")
  path = pathlib.Path(path)
  if path.exists() and not overwrite:
    raise FileExistsError(f"{path} exists; pass overwrite=True to replace it.")
  config = model.config
  hf_config = config.to_hf()
  weights = model.weights()
  itemsize = jnp.dtype(config.param_dtype).itemsize

  # Plan: (hf name, our path, layer or None, transpose, bytes), in HF order.
  plan = []
  for p in sorted(param_shapes(config), key=lambda p: HF_NAMES[p][0]):
    _, transpose = HF_NAMES[p]
    for layer, (name, shape) in enumerate(_hf_tensors(config, p)):
      plan.append(
          (
              name,
              p,
              layer if p[0] == "layers" else None,
              transpose,
              int(np.prod(shape)) * itemsize,
          )
      )
  shards, size = [[]], 0
  for item in plan:
    if shards[-1] and size + item[-1] > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(item)
    size += item[-1]

  with staged_folder(path) as tmp:
    tmp.mkdir()
    hf_config.save_pretrained(tmp)
    weight_map = {}
    for i, shard in enumerate(shards):
      file = (
          _SINGLE_FILE
          if len(shards) == 1
          else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      )
      tensors = {}
      for name, p, layer, transpose, _ in shard:
        value = weights[p[0]] if len(p) == 1 else weights[p[0]][p[1]]
        host = np.asarray(
            jax.device_get(value if layer is None else value[layer])
        )
        tensors[name] = np.ascontiguousarray(host.T if transpose else host)
        weight_map[name] = file
      safetensors.numpy.save_file(
          tensors, str(tmp / file), metadata={"format": "pt"}
      )
    if len(shards) > 1:
      total = sum(item[-1] for item in plan)
      (tmp / _INDEX_FILE).write_text(
          json.dumps(
              {"metadata": {"total_size": total}, "weight_map": weight_map},
              indent=2,
          )
      )


def load_tokenizer(path: str | os.PathLike) -> Any:
  """Loads the tokenizer of a local HF folder with `AutoTokenizer`.

  Args:
    path: folder with `tokenizer.json` or `tokenizer_config.json`.

  Returns:
    A `transformers` tokenizer.

  Raises:
    FileNotFoundError: no folder `path`, or no tokenizer files in it.
    ValueError: `path` is a file, or its tokenizer files cannot be loaded
      (naming the folder and the files).

  Example:
    >>> tok = load_tokenizer("/path/to/Qwen2.5-0.5B")  # doctest: +SKIP
  """
  path = _folder(path)
  if not any(
      (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
  ):
    raise FileNotFoundError(
        f"There is no tokenizer.json or tokenizer_config.json in {path}."
    )
  try:
    return transformers.AutoTokenizer.from_pretrained(path)
  except Exception as error:  # transformers and tokenizers raise many kinds.
    files = ", ".join(sorted(p.name for p in path.glob("tokenizer*")))
    if not (path / "tokenizer.json").is_file():
      files += "; no tokenizer.json"
    detail = (str(error).strip().splitlines() or [""])[0]
    raise ValueError(
        f"the tokenizer in {path} cannot be loaded from its files ({files}): "
        f"{type(error).__name__}: {detail}"
    ) from error
