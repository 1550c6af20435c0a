"""Hugging Face load/save round trips and checkpoint error messages."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from logra_jax import models

_logits = jax.jit(models.logits_fn, static_argnums=0)
IDS = np.random.RandomState(0).randint(0, 101, (2, 10))


def _forward(model):
  graphdef, params = models.split_model(model)
  return np.asarray(_logits(graphdef, params, jnp.asarray(IDS, jnp.int32)))


def _hf_logits(path, dtype=torch.float32):
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
  with torch.no_grad():
    return model.eval()(torch.tensor(IDS)).logits.float().numpy()


@pytest.fixture
def copy_of(checkpoints, tmp_path):
  """A writable copy of a conftest checkpoint."""

  def make(name):
    return shutil.copytree(checkpoints[name].path, tmp_path / name)

  return make


def test_save_then_transformers_loads_identical_logits(
    family, checkpoints, loaded, tmp_path
):
  out = tmp_path / "export"
  models.save_pretrained(loaded[family], out)
  assert sorted(p.name for p in out.iterdir()) == [
      "config.json",
      "model.safetensors",
  ]
  # The exported weights are the checkpoint's, bit for bit, so transformers
  # runs the same computation on them.
  np.testing.assert_array_equal(
      _hf_logits(out), checkpoints[family].logits(IDS)
  )
  np.testing.assert_array_equal(
      _forward(models.load_pretrained(out)), _forward(loaded[family])
  )


def test_sharded_save_round_trips(checkpoints, loaded, tmp_path):
  name = "llama_linear_tied"
  out = tmp_path / "sharded"
  models.save_pretrained(loaded[name], out, max_shard_bytes=40_000)
  index = json.loads((out / "model.safetensors.index.json").read_text())
  shards = sorted(p.name for p in out.glob("model-*.safetensors"))
  assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
  assert "lm_head.weight" not in index["weight_map"]  # Tied.
  sizes = {f: 0 for f in shards}
  for file in shards:
    for value in safetensors.numpy.load_file(out / file).values():
      sizes[file] += value.nbytes
  assert sum(sizes.values()) == index["metadata"]["total_size"]
  embed_bytes = 101 * 64 * 4  # The only tensor allowed past the limit.
  assert all(s <= max(40_000, embed_bytes) for s in sizes.values())
  np.testing.assert_array_equal(_hf_logits(out), checkpoints[name].logits(IDS))
  np.testing.assert_array_equal(
      _forward(models.load_pretrained(out)), _forward(loaded[name])
  )


def test_bfloat16_round_trip(checkpoints, tmp_path):
  path = checkpoints["qwen3"].path
  model = models.load_pretrained(path, dtype=jnp.bfloat16)
  out = tmp_path / "bf16"
  models.save_pretrained(model, out)
  assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
  again = models.load_pretrained(out, dtype=jnp.bfloat16)
  for a, b in zip(
      jax.tree.leaves(models.split_model(model)[1]),
      jax.tree.leaves(models.split_model(again)[1]),
  ):
    assert a.dtype == b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(a, np.float32), np.asarray(b, np.float32)
    )
  np.testing.assert_allclose(
      _hf_logits(out, torch.bfloat16), _forward(model), atol=0.1
  )


def test_save_refuses_existing_folder_and_overwrites_atomically(
    loaded, tmp_path
):
  out = tmp_path / "model"
  out.mkdir()
  (out / "stale.txt").write_text("old")
  with pytest.raises(FileExistsError, match="overwrite=True"):
    models.save_pretrained(loaded["qwen2"], out)
  models.save_pretrained(loaded["qwen2"], out, overwrite=True)
  assert not (out / "stale.txt").exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_interrupted_save_leaves_no_complete_looking_folder(
    loaded, tmp_path, monkeypatch
):
  def fail(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(safetensors.numpy, "save_file", fail)
  with pytest.raises(OSError, match="disk full"):
    models.save_pretrained(loaded["qwen2"], tmp_path / "model")
  assert list(tmp_path.iterdir()) == []


def test_missing_tensor_is_named(copy_of):
  path = copy_of("qwen2")
  tensors = safetensors.numpy.load_file(path / "model.safetensors")
  del tensors["model.layers.1.self_attn.k_proj.bias"]
  safetensors.numpy.save_file(
      tensors, path / "model.safetensors", metadata={"format": "pt"}
  )
  with pytest.raises(
      ValueError, match=r"'model\.layers\.1\.self_attn\.k_proj\.bias'"
  ):
    models.load_pretrained(path)


def test_untied_config_without_lm_head_names_it(copy_of):
  path = copy_of("llama_linear_tied")
  config = json.loads((path / "config.json").read_text())
  config["tie_word_embeddings"] = False
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="'lm_head.weight' is missing"):
    models.load_pretrained(path)


def test_truncated_file_is_named(copy_of):
  path = copy_of("qwen3")
  file = path / "model.safetensors"
  file.write_bytes(file.read_bytes()[:100])
  with pytest.raises(ValueError, match="model.safetensors"):
    models.load_pretrained(path)


def test_missing_shard_is_named(loaded, tmp_path):
  out = tmp_path / "sharded"
  models.save_pretrained(loaded["qwen3"], out, max_shard_bytes=50_000)
  shard = sorted(out.glob("model-*.safetensors"))[1]
  shard.unlink()
  with pytest.raises(FileNotFoundError, match=shard.name):
    models.load_pretrained(out)


def test_no_weights_at_all(copy_of):
  path = copy_of("qwen3")
  (path / "model.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match="No model.safetensors"):
    models.load_pretrained(path)


def test_shape_mismatch_names_tensor_and_both_shapes(copy_of):
  path = copy_of("llama_gqa_llama3")
  config = json.loads((path / "config.json").read_text())
  config["intermediate_size"] = 80
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(
      ValueError,
      match=(
          r"'model\.layers\.0\.mlp\.(down|gate|up)_proj\.weight' has shape "
          r"\((96, 64|64, 96)\) .* expects \((80, 64|64, 80)\)"
      ),
  ):
    models.load_pretrained(path)


def test_unsupported_architecture_folder(copy_of):
  path = copy_of("qwen3")
  config = json.loads((path / "config.json").read_text())
  config["architectures"] = ["Qwen3ForSequenceClassification"]
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="Supported: LlamaForCausalLM"):
    models.load_pretrained(path)


def test_load_tokenizer(tmp_path):
  import tokenizers

  vocab = {"[PAD]": 0, "[UNK]": 1, "hello": 2, "world": 3}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "[UNK]"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]"
  ).save_pretrained(tmp_path)
  tok = models.load_tokenizer(tmp_path)
  assert tok("hello world there")["input_ids"] == [2, 3, 1]


def _edit_tensors(path, edit):
  """Rewrites `model.safetensors` of `path` through `edit(tensors)`."""
  tensors = safetensors.numpy.load_file(path / "model.safetensors")
  edit(tensors)
  safetensors.numpy.save_file(
      tensors, path / "model.safetensors", metadata={"format": "pt"}
  )


def test_unknown_tensors_are_named_in_a_warning(copy_of, loaded):
  path = copy_of("qwen2")
  _edit_tensors(
      path,
      lambda t: t.update(
          {f"model.extra_{i}.weight": np.zeros(3, np.float32) for i in range(7)}
      ),
  )
  with pytest.warns(
      UserWarning,
      match=(
          r"7 tensors in .*qwen2 are not used by the model and were ignored: "
          r"\['model\.extra_0\.weight', .*'model\.extra_4\.weight'\] and 2 more"
      ),
  ):
    model = models.load_pretrained(path)
  np.testing.assert_array_equal(_forward(model), _forward(loaded["qwen2"]))


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weights_are_refused_unless_allowed(copy_of, value):
  path = copy_of("qwen3")
  name = "model.layers.1.mlp.up_proj.weight"

  def poison(tensors):
    tensors[name][3, 5] = value

  _edit_tensors(path, poison)
  with pytest.raises(
      ValueError,
      match=(
          rf"'{re.escape(name)}' .* 1 non-finite value.*allow_non_finite=True"
      ),
  ):
    models.load_pretrained(path)
  model = models.load_pretrained(path, allow_non_finite=True)
  up_LxDxF = np.asarray(model.weights()["layers"]["up_proj"])
  assert np.isnan(up_LxDxF).sum() + np.isinf(up_LxDxF).sum() == 1
  assert not np.isfinite(up_LxDxF[1, 5, 3])  # HF [out, in] -> ours [in, out]


def test_overflow_in_the_load_dtype_is_refused(copy_of):
  path = copy_of("qwen2")

  def big(tensors):
    tensors["model.norm.weight"][0] = 1e5  # finite in float32, inf in float16

  _edit_tensors(path, big)
  models.load_pretrained(path)
  with pytest.raises(ValueError, match=r"'model\.norm\.weight' .*float16"):
    models.load_pretrained(path, dtype=jnp.float16)


def test_missing_folder_or_config_is_named(tmp_path, copy_of):
  missing = tmp_path / "no_such_model"
  for load in (models.load_pretrained, models.load_tokenizer):
    with pytest.raises(FileNotFoundError, match="no_such_model does not exist"):
      load(missing)
  with pytest.raises(FileNotFoundError, match=r"no config\.json in .*tmp"):
    models.load_pretrained(tmp_path)
  with pytest.raises(
      FileNotFoundError,
      match=r"no tokenizer\.json or tokenizer_config\.json in",
  ):
    models.load_tokenizer(tmp_path)
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text(json.dumps({"steps": 3}))
  with pytest.raises(ValueError, match=r"run/config\.json has no 'model_type'"):
    models.load_pretrained(run)
  (run / "config.json").write_text("{")
  with pytest.raises(ValueError, match=r"run/config\.json is not valid JSON"):
    models.load_pretrained(run)
  path = copy_of("qwen2")
  with pytest.raises(ValueError, match=r"model\.safetensors is a file, not"):
    models.load_pretrained(path / "model.safetensors")
