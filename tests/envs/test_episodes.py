"""Episodes played against a scripted sampler: turns, the environment's
tokens between them, their bounds, and failures counted, never raised."""

import dataclasses
import threading
import time

import numpy as np
import pytest

from logra_jax import envs
from logra_jax.data.tokenizer import char_tokenizer

TOKENIZER = char_tokenizer()
EOS = TOKENIZER.eos_token_id
RENDERER = envs.Renderer(TOKENIZER)


def ids(text):
  return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def scripted(turns, width=40):
  """A sampler whose episode ``i`` writes ``turns[i][j]`` at turn ``j``
  (an eos after a text ending in ``$``); records the histories it saw."""
  seen = []

  def sample_turn(histories, turn):
    seen.append([list(h) for h in histories])
    tokens = np.zeros((len(histories), width), np.int32)
    lengths = np.zeros(len(histories), np.int32)
    for i, script in enumerate(turns):
      text = script[turn] if turn < len(script) else "?"
      row = ids(text.rstrip("$")) + ([EOS] if text.endswith("$") else [])
      tokens[i, : len(row)], lengths[i] = row, len(row)
    logprobs = -np.arange(1, width + 1, dtype=np.float32)[None] / 10
    return tokens, np.repeat(logprobs, len(histories), 0), lengths

  return sample_turn, seen


def play(turns, factory=envs.Calculator, context=64, **bounds):
  sample_turn, seen = scripted(turns)
  config = envs.EpisodeConfig(factory, **bounds)
  examples = [{"prompt": "12*3="}] * len(turns)
  played = envs.run_episodes(
      config, examples, RENDERER, sample_turn, stop_ids=[EOS], context=context
  )
  return played, seen


def test_a_tool_call_turn_is_cut_at_its_tag_and_the_result_follows_it():
  (episode,), seen = play([["<calc>12*3</calc> junk", "36$"]], max_turns=3)
  prompt = TOKENIZER("12*3=")["input_ids"]
  result = ids("\n<result>36</result>\n")
  assert episode.prompt_ids == prompt
  assert episode.turns == [ids("<calc>12*3</calc>"), ids("36") + [EOS]]
  assert episode.contexts == [result]
  # The second turn followed exactly what was sampled, then the result.
  assert seen[1][0] == prompt + ids("<calc>12*3</calc>") + result
  assert len(seen) == 2  # the answer ended the episode before turn 3
  assert episode.logprobs[0] == pytest.approx(
      list(-np.arange(1, 18, dtype=np.float32) / 10)
  )
  assert (episode.answer, episode.tool_calls, episode.failures) == ("36", 1, 0)
  assert episode.done and not episode.truncated
  sequence, mask = envs.episode_sequence(episode)
  assert sequence == episode.turns[0] + result + episode.turns[1]
  assert mask == [1] * 17 + [0] * len(result) + [1] * 3


def test_episode_rows_hold_each_episode_in_one_row():
  played, _ = play([["<calc>12*3</calc>", "36$"], ["36$"]], max_turns=3)
  rows = envs.episode_rows(played, width=50, bucket=4)
  first, second = played
  sequence, model = envs.episode_sequence(first)
  assert rows.prompt_ids_ExP.shape == (2, 8)  # 6 prompt tokens, bucket 4
  np.testing.assert_array_equal(rows.prompt_ids_ExP[0, 2:], first.prompt_ids)
  assert rows.prompt_mask_ExP.sum(1).tolist() == [6, 6]
  assert rows.lengths_E.tolist() == [len(sequence), 3]
  np.testing.assert_array_equal(rows.tokens_ExT[0, : len(sequence)], sequence)
  np.testing.assert_array_equal(rows.mask_ExT[0, : len(sequence)], model)
  assert rows.mask_ExT[0, len(sequence) :].sum() == 0
  assert rows.context_mask_ExT.sum(1).tolist() == [len(sequence), 3]
  sampled = first.logprobs[0] + first.logprobs[1]
  scored = rows.mask_ExT[0] == 1
  np.testing.assert_allclose(rows.logprobs_ExT[0][scored], sampled)
  np.testing.assert_array_equal(rows.logprobs_ExT[0][~scored], 0.0)
  np.testing.assert_array_equal(rows.tokens_ExT[1, :3], second.turns[0])
  with pytest.raises(ValueError, match="exceeds width=10"):
    envs.episode_rows(played, width=10)


def test_episodes_stop_at_max_turns_and_at_the_token_budget():
  calls = ["<calc>1+1</calc>"] * 3
  (turns,), _ = play([calls], max_turns=2)
  assert len(turns.turns) == 2 and turns.truncated and turns.tool_calls == 2
  (budget,), _ = play([calls], max_turns=3, max_tokens=20)
  assert budget.truncated and len(budget.turns) == 1  # no room for a turn
  (cut,), _ = play([["<calc>1+1</calc>"]], max_turns=1, max_tokens=5)
  assert cut.turns == [ids("<calc")]  # the budget cuts the turn itself


def test_an_episode_ends_where_the_next_turn_would_not_fit_the_context():
  (episode,), seen = play([["<calc>1+1</calc>"] * 2], max_turns=2, context=30)
  assert episode.truncated and len(episode.turns) == 1 and len(seen) == 1


class Raising:

  def __init__(self, where):
    self.where = where

  def reset(self, example):
    if self.where == "reset":
      raise RuntimeError("down")
    if self.where == "reset messages":
      return [{"role": "user"}]  # no content
    return [{"role": "user", "content": example["prompt"]}]

  def step(self, model_message):
    if self.where == "step":
      raise RuntimeError("down")
    if self.where == "step messages":
      return envs.StepResult("a text, not messages")
    return "not a StepResult"


@pytest.mark.parametrize(
    "where", ["reset", "reset messages", "step", "step messages", "result"]
)
def test_an_environment_that_fails_is_a_counted_failed_episode(where):
  (episode,), _ = play([["36$"]], lambda: Raising(where), max_turns=2)
  assert episode.done and episode.failures == 1 and episode.timeouts == 0
  assert len(episode.turns) == (0 if where.startswith("reset") else 1)
  assert episode.answer == "" and episode.reward == 0.0


class Hanging:
  """Waits on ``release`` in ``reset`` or ``step`` (forever unless it is
  set), then changes what it was given and what it keeps."""

  def __init__(self, where, release):
    self.where, self.release = where, release

  def reset(self, example):
    if self.where == "reset":
      self.release.wait()
      example["prompt"] = "changed"
    self.opening = [{"role": "user", "content": example["prompt"]}]
    return self.opening

  def step(self, model_message):
    if self.where == "step":
      self.release.wait()
      self.opening.append({"role": "user", "content": "changed"})
    return envs.StepResult([{"role": "tool", "content": "1"}], reward=1.0)


@pytest.mark.parametrize("where", ["reset", "step"])
def test_an_environment_that_hangs_ends_its_episode_as_a_timeout(where):
  release = threading.Event()
  example = {"prompt": "12*3="}
  sample_turn, seen = scripted([["36$"], ["36$"]])
  config = envs.EpisodeConfig(
      lambda: Hanging(where, release), max_turns=2, timeout_s=0.2
  )
  began = time.monotonic()
  played = envs.run_episodes(
      config, [example] * 2, RENDERER, sample_turn, stop_ids=[EOS], context=64
  )
  # Each of the two episodes waited once for its limit, and no longer.
  assert 0.4 <= time.monotonic() - began < 30
  for episode in played:
    assert (episode.failures, episode.timeouts) == (1, 1)
    assert episode.done and episode.environment is None
    assert (episode.answer, episode.reward) == ("", 0.0)
    assert len(episode.turns) == (0 if where == "reset" else 1)
  assert len(seen) == (0 if where == "reset" else 1)
  before = [
      (e.conversation, e.turns, e.contexts, e.answer, e.reward) for e in played
  ]
  # The abandoned calls finish now and change what they hold; the episodes
  # and the example their group shares do not see it.
  release.set()
  time.sleep(0.2)
  after = [
      (e.conversation, e.turns, e.contexts, e.answer, e.reward) for e in played
  ]
  assert after == before and example == {"prompt": "12*3="}
  assert all(m["content"] != "changed" for e in played for m in e.conversation)


def test_an_environment_within_its_time_limit_plays_as_without_one():
  script = [["<calc>12*3</calc>", "36$"], ["36$"]]
  unbounded, _ = play(script, max_turns=3)
  bounded, _ = play(script, max_turns=3, timeout_s=30.0)
  drop = lambda played: [  # noqa: E731
      dataclasses.replace(e, environment=None) for e in played
  ]
  assert drop(bounded) == drop(unbounded)
  assert [e.timeouts for e in bounded] == [0, 0]


def test_a_bad_call_is_answered_and_counted_and_the_episode_goes_on():
  script = ["<sql>drop</sql>", "<calc>1/0</calc>", "<answer>7</answer>"]
  (episode,), _ = play([script], max_turns=3, context=200)
  assert (episode.failures, episode.tool_calls) == (2, 2)
  assert episode.answer == "7" and not episode.truncated
  assert "unknown tool" in TOKENIZER.decode(episode.contexts[0])


TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.mark.parametrize("stopped", [True, False])
def test_chat_episodes_are_the_template_rendered_turn_by_turn(stopped):
  """prompt + turn + environment tokens = transformers' rendering of the
  conversation with the tool's message, the next assistant turn opened,
  whether the turn ended with its stop token or was cut at its tag."""
  tokenizer = char_tokenizer()
  tokenizer.chat_template = TEMPLATE
  renderer = envs.Renderer(tokenizer, chat=True, system_prompt="Be brief.")
  conversation = renderer.opening([{"role": "user", "content": "12*3="}])
  call, tool = "<calc>12*3</calc>", [{"role": "tool", "content": "36"}]
  turn = ids(call) + ([EOS] if stopped else [])
  history = renderer.prompt_ids(conversation) + turn
  history += renderer.environment_ids(conversation, call, stopped, tool)
  expected = tokenizer.apply_chat_template(
      [*conversation, {"role": "assistant", "content": call}, *tool],
      tokenize=False,
      add_generation_prompt=True,
  )
  assert history == tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_a_template_that_rewrites_earlier_turns_fails_the_episode():
  tokenizer = char_tokenizer()
  tokenizer.chat_template = (  # shows only the last message
      "<{{ messages[-1]['role'] }}>{{ messages[-1]['content'] }}"
      "{% if add_generation_prompt %}<assistant>{% endif %}"
  )
  renderer = envs.Renderer(tokenizer, chat=True)
  with pytest.raises(ValueError, match="turn by turn"):
    renderer.environment_ids(
        [{"role": "user", "content": "1+1="}],
        "<calc>1+1</calc>",
        False,
        [{"role": "tool", "content": "2"}],
    )
