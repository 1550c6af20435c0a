"""Flax NNX decoder (Llama / Qwen2 / Qwen3), HF I/O, sampler and log-probs."""

from logra_jax.models.cache import init_cache
from logra_jax.models.cache import KVCache
from logra_jax.models.config import ATTENTION
from logra_jax.models.config import attention_implementation
from logra_jax.models.config import DecoderConfig
from logra_jax.models.config import REMAT
from logra_jax.models.config import RopeScaling
from logra_jax.models.decoder import Decoder
from logra_jax.models.decoder import init_model
from logra_jax.models.decoder import logits_fn
from logra_jax.models.decoder import split_model
from logra_jax.models.hf_io import load_pretrained
from logra_jax.models.hf_io import load_tokenizer
from logra_jax.models.hf_io import read_decoder_config
from logra_jax.models.hf_io import save_pretrained
from logra_jax.models.logprobs import completion_hidden_states
from logra_jax.models.logprobs import token_logprobs
from logra_jax.models.sampling import pad_prompts
from logra_jax.models.sampling import SampleOutput
from logra_jax.models.sampling import Sampler
from logra_jax.models.sampling import sample_token
from logra_jax.models.sampling import SamplingParams
