"""Tiny random `transformers` checkpoints of each supported family."""

import dataclasses
import pathlib

from logra_jax import models
import numpy as np
import pytest
import torch
import transformers

torch.set_num_threads(1)

VOCAB = 101


def _hf_configs() -> dict[str, transformers.PretrainedConfig]:
  common = dict(
      vocab_size=VOCAB,
      hidden_size=64,
      intermediate_size=96,
      num_hidden_layers=2,
      max_position_embeddings=128,
      rms_norm_eps=1e-5,
      bos_token_id=None,
      eos_token_id=None,
      pad_token_id=None,
  )
  return {
      # GQA (4 heads over 2 kv heads) with Llama 3.1 frequency scaling; the
      # small original context puts frequencies in all three llama3 regions.
      "llama_gqa_llama3": transformers.LlamaConfig(
          num_attention_heads=4,
          num_key_value_heads=2,
          rope_parameters={
              "rope_type": "llama3",
              "rope_theta": 10000.0,
              "factor": 4.0,
              "low_freq_factor": 1.0,
              "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32,
          },
          **common,
      ),
      # Linear scaling, tied embeddings, q/k/v/o biases.
      "llama_linear_tied": transformers.LlamaConfig(
          num_attention_heads=4,
          num_key_value_heads=4,
          attention_bias=True,
          tie_word_embeddings=True,
          rope_parameters={
              "rope_type": "linear",
              "rope_theta": 10000.0,
              "factor": 2.0,
          },
          **common,
      ),
      # q/k/v biases, one kv head.
      "qwen2": transformers.Qwen2Config(
          num_attention_heads=4,
          num_key_value_heads=1,
          rope_parameters={"rope_type": "default", "rope_theta": 1e6},
          **common,
      ),
      # q/k RMSNorm and head_dim (24) != hidden / heads (16).
      "qwen3": transformers.Qwen3Config(
          num_attention_heads=4,
          num_key_value_heads=2,
          head_dim=24,
          rope_parameters={"rope_type": "default", "rope_theta": 1e6},
          **common,
      ),
  }


FAMILIES = tuple(_hf_configs())


@dataclasses.dataclass
class Checkpoint:
  path: pathlib.Path
  torch_model: transformers.PreTrainedModel

  def logits(self, ids, attention_mask=None, position_ids=None) -> np.ndarray:
    """Reference float32 logits from PyTorch."""
    kwargs = {}
    if attention_mask is not None:
      kwargs["attention_mask"] = torch.tensor(np.asarray(attention_mask))
    if position_ids is not None:
      kwargs["position_ids"] = torch.tensor(np.asarray(position_ids))
    with torch.no_grad():
      return self.torch_model(
          torch.tensor(np.asarray(ids)), **kwargs
      ).logits.numpy()


def build_checkpoint(
    name: str, path: pathlib.Path, seed: int = 0
) -> Checkpoint:
  """Random float32 HF model with weights large enough to make logits vary."""
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(
      _hf_configs()[name], dtype=torch.float32
  ).eval()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if "norm" in pname:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif pname.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  model.save_pretrained(path)
  return Checkpoint(path=path, torch_model=model)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
  """Each supported family's checkpoint name in turn."""
  return request.param


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Checkpoint]:
  """All families, built once per test process."""
  root = tmp_path_factory.mktemp("hf")
  return {name: build_checkpoint(name, root / name) for name in FAMILIES}


@pytest.fixture(scope="session")
def loaded(checkpoints) -> dict[str, models.Decoder]:
  """Our float32 models loaded from `checkpoints`."""
  return {
      name: models.load_pretrained(c.path) for name, c in checkpoints.items()
  }
