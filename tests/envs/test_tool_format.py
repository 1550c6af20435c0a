"""The calculator in a chat template's own tool format: the tool declared to
the template, calls parsed in its format, results rendered as the template
renders tool messages, and episodes equal to transformers' rendering."""

import json

import numpy as np
import pytest

from logra_jax import envs
from logra_jax.data.tokenizer import char_tokenizer
from logra_jax.envs import calculator as calc

# A small template of the shape Qwen2.5 ships: the tools' schemas and the
# <tool_call> format in the system turn, tool results in <tool_response>
# tags of a user turn (consecutive ones merged). The character tokenizer's
# <eos> ends a turn, as <|im_end|> does for Qwen2.5.
TOOL_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% else %}You are a helpful assistant.
{% endif %}
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><eos>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<eos>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}\
<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<eos>
{% endif %}
{%- elif not (loop.first and message.role == 'system') %}\
<|im_start|>{{ message.role }}
{{ message.content }}<eos>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOKENIZER = char_tokenizer()
TOKENIZER.chat_template = TOOL_TEMPLATE
EOS = TOKENIZER.eos_token_id
TOOLS = [calc.TOOL_SCHEMA]


def ids(text):
  return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def call(expression, name="calculator"):
  arguments = {"expression": expression}
  return (
      "<tool_call>\n"
      + json.dumps({"name": name, "arguments": arguments})
      + "\n</tool_call>"
  )


def rendered(messages, generation=True):
  text = TOKENIZER.apply_chat_template(
      messages, tools=TOOLS, tokenize=False, add_generation_prompt=generation
  )
  return ids(text)


def test_the_template_renders_the_tool_and_one_without_support_ignores_it():
  messages = [{"role": "user", "content": "12*3="}]
  text = TOKENIZER.decode(rendered(messages))
  assert '"name": "calculator"' in text and "<tool_call>" in text
  plain = char_tokenizer()
  plain.chat_template = (  # SmolLM2's shape: no tools
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
      "<eos>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
      "assistant\n{% endif %}"
  )
  renderer = envs.Renderer(plain, chat=True)
  assert renderer.prompt_ids(messages, TOOLS) == renderer.prompt_ids(messages)


def scripted(turns, width=120):
  """A sampler writing ``turns[j]`` at turn ``j`` (an eos after a text
  ending in ``$``); records the histories it saw."""
  seen = []

  def sample_turn(histories, turn):
    seen.append([list(h) for h in histories])
    text = turns[turn]
    row = ids(text.rstrip("$")) + ([EOS] if text.endswith("$") else [])
    tokens = np.zeros((len(histories), width), np.int32)
    tokens[:, : len(row)] = row
    lengths = np.full(len(histories), len(row), np.int32)
    return tokens, np.full(tokens.shape, -0.5, np.float32), lengths

  return sample_turn, seen


def test_a_tool_using_episode_is_the_templates_rendering_turn_by_turn():
  """Each turn follows exactly transformers' apply_chat_template(messages,
  tools=...) of the conversation so far, the model's calls as written and
  the tool's results as tool messages."""
  turns = [
      call("12345*678") + " and more",  # cut at </tool_call>
      call("8369910+1"),
      "<answer>8369911</answer>$",  # cut at </answer>: no eos
  ]
  sample_turn, seen = scripted(turns)
  renderer = envs.Renderer(TOKENIZER, chat=True, system_prompt="Be exact.")
  (episode,) = envs.run_episodes(
      envs.EpisodeConfig(envs.Calculator, max_turns=4),
      [{"prompt": "12345*678+1="}],
      renderer,
      sample_turn,
      stop_ids=[EOS],
      context=2000,
  )
  messages = [
      {"role": "system", "content": "Be exact."},
      {"role": "user", "content": "12345*678+1="},
  ]
  assert seen[0][0] == rendered(messages)
  for j, result in enumerate(["8369910", "8369911"]):
    messages += [
        {"role": "assistant", "content": call(["12345*678", "8369910+1"][j])},
        {"role": "tool", "content": result},
    ]
    assert seen[j + 1][0] == rendered(messages)
  assert episode.conversation == messages
  assert (episode.answer, episode.tool_calls, episode.failures) == (
      "8369911",
      2,
      0,
  )
  # The whole episode is the conversation rendered, up to the template's
  # closing of the last turn (<eos> and a newline).
  messages.append({"role": "assistant", "content": "<answer>8369911</answer>"})
  sequence, mask = envs.episode_sequence(episode)
  whole = episode.prompt_ids + sequence
  assert whole == rendered(messages, generation=False)[:-2]
  assert sum(mask) == sum(map(len, episode.turns))


@pytest.mark.parametrize(
    "body, problem",
    [
        ("not json", "malformed call: not JSON"),
        ("[1, 2]", 'malformed call: no "name"'),
        ('{"name": "calculator"}', 'no "expression" string'),
        ('{"name": "calculator", "arguments": "{"}', "arguments not JSON"),
        (
            '{"name": "calculator", "arguments": {"expression": 7}}',
            'no "expression" string',
        ),
        ('{"name": "search", "arguments": {}}', "unknown tool 'search'"),
    ],
)
def test_the_parser_refuses_malformed_and_unknown_calls(body, problem):
  with pytest.raises(envs.CalculatorError, match=problem) as caught:
    calc.parse_tool_call(body)
  result = envs.Calculator().step(f"<tool_call>{body}</tool_call>")
  assert result.failed and not result.done and result.tool_calls == 1
  assert result.messages == [
      {"role": "tool", "content": f"<error>{caught.value}</error>"}
  ]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "calculator", "arguments": {"expression": "6*7"}}',
        '{"name": "calculator", "arguments": "{\\"expression\\": \\"6*7\\"}"}',
    ],
)
def test_a_good_call_is_answered_with_the_bare_value(body):
  assert calc.parse_tool_call(body) == "6*7"
  result = envs.Calculator().step(f"text <tool_call>{body}</tool_call>")
  assert result == envs.StepResult(
      [{"role": "tool", "content": "42"}], tool_calls=1
  )


def test_an_unclosed_call_is_malformed_and_not_run():
  result = envs.Calculator().step("<tool_call>" + call("1+1")[11:-12])
  assert result.failed and result.tool_calls == 0
  assert "malformed call: no </tool_call>" in result.messages[0]["content"]
