"""Data: tasks (reasoning-gym, local files, the tiny default), tokenizer, batching."""

from logra_jax.data.batching import PromptBatch
from logra_jax.data.batching import SFTBatch
from logra_jax.data.batching import decode_completions
from logra_jax.data.batching import encode_prompts
from logra_jax.data.batching import encode_sft
from logra_jax.data.tasks import TINY_TASK
from logra_jax.data.tasks import Task
from logra_jax.data.tasks import file_task
from logra_jax.data.tasks import load_task
from logra_jax.data.tasks import prompt_batches
from logra_jax.data.tasks import reasoning_gym_task
from logra_jax.data.tasks import tiny_arithmetic_task
from logra_jax.data.tasks import worked_answers
from logra_jax.data.tokenizer import char_tokenizer
