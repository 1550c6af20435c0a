"""The run's sampler behind a localhost HTTP endpoint: vLLM's token generate
endpoint (``verifiers``' train client) and OpenAI's chat completions, with
concurrent requests batched into one sampler call; ``verifiers.v1``
tasksets' episodes played against it."""

from logra_jax.serve.batching import Batcher
from logra_jax.serve.batching import Completion
from logra_jax.serve.batching import engine_sampler
from logra_jax.serve.batching import QueueFull
from logra_jax.serve.batching import SampleBatch
from logra_jax.serve.batching import Settings
from logra_jax.serve.requests import BadRequest
from logra_jax.serve.server import Limits
from logra_jax.serve.server import serve_policy
from logra_jax.serve.server import Server
from logra_jax.serve.verifiers_env import episode_from_calls
from logra_jax.serve.verifiers_env import play_verifiers

__all__ = [
    "Batcher",
    "Completion",
    "engine_sampler",
    "QueueFull",
    "SampleBatch",
    "Settings",
    "BadRequest",
    "Limits",
    "serve_policy",
    "Server",
    "episode_from_calls",
    "play_verifiers",
]
