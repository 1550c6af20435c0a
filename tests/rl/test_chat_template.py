"""Prompts of an instruct checkpoint go through its chat template exactly as
transformers renders and tokenizes them."""

import shutil
from collections.abc import Mapping

import pytest
import transformers

from logra_jax import configs
from logra_jax.rl import setup
from logra_jax.rollout import engine as engine_lib

# A ChatML template of the shape SmolLM2-Instruct and Qwen2.5 ship.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != "
    "'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_folder(policy_folder, tmp_path_factory):
  folder = tmp_path_factory.mktemp("chat") / "policy"
  shutil.copytree(policy_folder, folder)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  tokenizer.chat_template = CHATML
  tokenizer.save_pretrained(folder)
  return folder


def _reference_ids(folder, messages):
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  out = tokenizer.apply_chat_template(
      messages, add_generation_prompt=True, tokenize=True
  )
  return list(out["input_ids"] if isinstance(out, Mapping) else out)


@pytest.mark.parametrize("system_prompt", [None, "Answer with a number."])
def test_chat_templated_prompt_equals_transformers(chat_folder, system_prompt):
  policy = engine_lib.Policy.load(
      chat_folder, chat_template="auto", system_prompt=system_prompt
  )
  messages = [{"role": "user", "content": "12+7-3="}]
  if system_prompt is not None:
    messages.insert(0, {"role": "system", "content": system_prompt})
  assert policy.chat
  assert policy.encode(["12+7-3="]) == [_reference_ids(chat_folder, messages)]
  text = policy.prompt_text("12+7-3=")
  assert text.endswith("<|im_start|>assistant\n")
  assert (system_prompt or "You are helpful.") in text


def test_no_template_without_one_or_when_turned_off(chat_folder, policy_folder):
  plain = transformers.AutoTokenizer.from_pretrained(policy_folder)
  expected = [plain("12+7-3=")["input_ids"]]
  assert (
      engine_lib.Policy.load(chat_folder, chat_template="none").encode(
          ["12+7-3="]
      )
      == expected
  )
  # The tiny policy's tokenizer has no chat template: "auto" leaves prompts as they are.
  policy = engine_lib.Policy.load(policy_folder, chat_template="auto")
  assert not policy.chat and policy.encode(["12+7-3="]) == expected


def test_the_task_template_shapes_the_prompt_before_the_chat_template():
  config = configs.load_config(
      "smoke",
      overrides=["task.template='Compute {prompt} Answer:'", "task.terms=2"],
  )
  task = setup.load_task(config)
  assert all(
      e["prompt"].startswith("Compute ")
      and e["prompt"].endswith("= Answer:")
      and e["prompt"].count("+") + e["prompt"].count("-") == 1
      for e in task.examples[:20]
  )


def test_a_system_prompt_without_a_chat_template_is_refused(
    chat_folder, policy_folder
):
  with pytest.raises(
      ValueError, match="task.system_prompt needs a chat template"
  ):
    engine_lib.Policy.load(policy_folder, system_prompt="Be brief.")
  with pytest.raises(ValueError, match="task.chat_template is 'none'"):
    engine_lib.Policy.load(
        chat_folder, chat_template="none", system_prompt="Be brief."
    )
