"""The tiny policy's warm start on calculator episodes: the demonstrations
are the tool-using episodes an RL run holds, the environment's tokens masked."""

import numpy as np

from logra_jax import configs
from logra_jax import envs
from logra_jax.data import tasks
from logra_jax.data.tokenizer import char_tokenizer
from logra_jax.rl import warm_start

TOKENIZER = char_tokenizer()


def test_demonstrations_call_the_tool_and_answer_with_its_result():
  examples = tasks.tiny_arithmetic_task(size=64, max_digits=5).examples
  tokens_NxT, mask_NxT = warm_start.tool_demonstrations(
      examples, TOKENIZER, warm_start.EPISODE_CONTEXT_TOKENS
  )
  assert tokens_NxT.shape[1] <= warm_start.EPISODE_CONTEXT_TOKENS
  for example, tokens, mask in zip(examples, tokens_NxT, mask_NxT):
    expression = example["prompt"].removesuffix("=")
    answer = example["answer"]
    assert envs.calculate(expression) == answer  # the tool answers the task
    assert TOKENIZER.decode(tokens[mask == 1]) == (
        f"<calc>{expression}</calc>{answer}{TOKENIZER.eos_token}"
    )
    # Prompt, then the environment's tokens between the two turns: context.
    assert TOKENIZER.decode(tokens[mask == 0], skip_special_tokens=True) == (
        f"{example['prompt']}\n<result>{answer}</result>\n"
    )
    # The model's tokens are two spans: the call, then the answer.
    starts = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)
    assert len(starts) == 2


def test_a_run_with_an_environment_has_its_own_context_and_cache_entry():
  policy = configs.PolicyConfig()
  examples = [{"prompt": "1+2=", "answer": "3"}]
  plain = warm_start.cache_folder(policy, examples, 0)
  assert warm_start.cache_folder(policy, examples, 0, "") == plain
  other = warm_start.cache_folder(policy, examples, 0, "my_env.py:f")
  calculator = warm_start.cache_folder(policy, examples, 0, "calculator")
  assert len({plain, other, calculator}) == 3
  assert warm_start.context_tokens("") == warm_start.CONTEXT_TOKENS
  assert warm_start.context_tokens("calculator") == 128
