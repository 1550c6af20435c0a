"""Multi-turn environments: the interface, the shipped ``calculator``, their
loading by name or path, and episodes as the learner's tokens."""

from logra_jax.envs.base import Environment
from logra_jax.envs.base import Message
from logra_jax.envs.base import StepResult
from logra_jax.envs.calculator import calculate
from logra_jax.envs.calculator import Calculator
from logra_jax.envs.calculator import CalculatorError
from logra_jax.envs.calculator import parse_tool_call
from logra_jax.envs.episodes import Episode
from logra_jax.envs.episodes import episode_sequence
from logra_jax.envs.episodes import EpisodeConfig
from logra_jax.envs.episodes import Renderer
from logra_jax.envs.episodes import run_episodes
from logra_jax.envs.episodes import episode_rows
from logra_jax.envs.episodes import EpisodeRows
from logra_jax.envs.loading import load_environment
from logra_jax.envs.loading import SHIPPED
from logra_jax.envs.verifiers_source import VerifiersTaskset

__all__ = [
    "Environment",
    "Message",
    "StepResult",
    "calculate",
    "Calculator",
    "CalculatorError",
    "parse_tool_call",
    "Episode",
    "episode_sequence",
    "EpisodeConfig",
    "Renderer",
    "run_episodes",
    "episode_rows",
    "EpisodeRows",
    "load_environment",
    "SHIPPED",
    "VerifiersTaskset",
]
