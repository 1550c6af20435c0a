"""``task.environment=verifiers:...``: a small local ``verifiers.v1``
taskset played against the run's sampler through the endpoint, the
learner's episodes built from the ids the server sampled, a few smoke steps
trained on its rewards, and bad specs refused before the run."""

import json
import types

import jax
import numpy as np
import pytest

from logra_jax import cli
from logra_jax import configs
from logra_jax import envs
from logra_jax import serve
from logra_jax.data.tokenizer import char_tokenizer
from logra_jax.rl import trainer
from logra_jax.rollout.engine import Policy
from run_fixtures import make_policy

loaders = pytest.importorskip(
    "verifiers.v1.utils.loaders", reason="verifiers is not installed"
)

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)

TASKSET = """
import verifiers.v1 as vf


class Data(vf.TaskData):
  answer: str


class Exact(vf.Task[Data, vf.State, vf.TaskConfig]):

  @vf.reward(weight=1.0)
  async def exact(self, trace) -> float:
    return float((trace.last_reply or "").strip() == self.data.answer)

  @vf.reward(weight=0.5)
  async def short(self, trace) -> float:
    return float(len(trace.last_reply or "") <= 4)


class Sums(vf.Taskset[Exact, vf.TasksetConfig]):

  def load(self):
    yield Exact(Data(prompt="1+1=", answer="2"))


__all__ = ["Sums"]
"""


@pytest.fixture(scope="module")
def chat_policy_folder(tmp_path_factory):
  """The tiny policy whose tokenizer has a chat template."""
  folder = make_policy(tmp_path_factory.mktemp("policy") / "tiny")
  tokenizer = char_tokenizer()
  tokenizer.chat_template = TEMPLATE
  tokenizer.save_pretrained(folder)
  return folder


@pytest.fixture(scope="module")
def taskset_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("taskset") / "sums_taskset.py"
  path.write_text(TASKSET)
  return path


def test_episodes_are_the_ids_the_server_sampled(
    chat_policy_folder, taskset_file
):
  policy = Policy.load(chat_policy_folder)
  source = envs.load_environment(f"verifiers:{taskset_file}")
  drawn = []

  def sample(prompts, key, **settings):
    out = policy.sampler.sample(policy.params, prompts, key, **settings)
    drawn.append(([list(p) for p in prompts], out))
    return out

  examples = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in (1, 2, 3)]
  played = serve.play_verifiers(
      source,
      policy,
      sample,
      examples,
      jax.random.key(0),
      max_turns=1,
      max_new_tokens=6,
      temperature=1.0,
  )
  assert sum(len(prompts) for prompts, _ in drawn) == len(examples)
  for example, episode in zip(examples, played):
    assert episode.failures == 0 and len(episode.turns) == 1
    rendered = policy.tokenizer.apply_chat_template(
        [{"role": "user", "content": example["prompt"]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    expected = policy.tokenizer(rendered, add_special_tokens=False)
    assert episode.prompt_ids == expected["input_ids"]
    prompts, out = next(d for d in drawn if episode.prompt_ids in d[0])
    row = prompts.index(episode.prompt_ids)
    n = int(out.lengths[row])
    assert episode.turns[0] == np.asarray(out.tokens[row, :n]).tolist()
    np.testing.assert_array_equal(
        episode.logprobs[0], np.asarray(out.logprobs[row, :n])
    )
    text = policy.tokenizer.decode(episode.turns[0], skip_special_tokens=True)
    assert episode.answer == text
    reward = float(text.strip() == example["answer"]) + 0.5 * (len(text) <= 4)
    assert episode.reward == reward


def test_a_conversation_whose_prompt_was_re_rendered_fails():
  turn = serve.Completion([5, 6], [-1.0, -2.0], "stop")
  calls = [([1, 4], turn), ([1, 4, 5, 7, 9], turn)]
  episode = serve.episode_from_calls(calls, 3, [1])
  assert episode.failures == 1 and episode.turns == [[5, 6]]
  assert not episode.contexts


def test_a_verifiers_taskset_trains_for_smoke_steps(
    tmp_path, chat_policy_folder, taskset_file
):
  config = configs.apply_overrides(
      configs.get_preset("smoke"),
      [
          f"policy.path={chat_policy_folder}",
          "steps=2",
          "task.eval_size=4",
          "rollout.prompts_per_step=2",
          f"task.environment=verifiers:{taskset_file}",
      ],
  )
  summary = trainer.train(
      config, tmp_path / "run", progress=False, log=lambda s: None
  )
  assert summary["steps"] == 2 and summary["skipped_steps"] == 0
  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  for metrics in map(json.loads, lines):
    assert metrics["env/failures"] == 0
    assert metrics["env/turns_per_episode"] == 1.0
    assert 0.0 <= metrics["reward/environment"] <= 1.5


NO_TASKSET = "x = 1\n__all__ = ['x']\n"
RAISES = TASKSET.replace(
    "yield Exact(", 'raise OSError("no data"); yield Exact('
)
EMPTY = TASKSET.replace(
    '    yield Exact(Data(prompt="1+1=", answer="2"))', "    return []"
)


@pytest.mark.parametrize(
    "source, spec, message",
    [
        (None, "verifiers:", "must name a module"),
        (None, "verifiers:no_such_taskset_module", "does not import"),
        (None, "verifiers:missing.py", "not found"),
        (NO_TASKSET, "verifiers:{}", "the taskset does not load"),
        (RAISES, "verifiers:{}", "OSError: no data"),
        (EMPTY, "verifiers:{}", "has no task"),
        ("import nowhere_xyz\n", "verifiers:{}", "does not import"),
    ],
)
def test_the_cli_refuses_a_bad_verifiers_spec_before_the_run(
    tmp_path, capsys, source, spec, message
):
  path = tmp_path / "bad_taskset.py"
  if source is not None:
    path.write_text(source)
  out = tmp_path / "run"
  spec = spec.format(path)
  status = cli.main(
      [
          "train",
          "--preset",
          "smoke",
          "--set",
          f"task.environment={spec}",
          "--out",
          str(out),
      ]
  )
  err = capsys.readouterr().err
  assert status == 2, err
  assert message in err and spec in err
  assert len(err.strip().splitlines()) == 1
  assert not out.exists()


def test_the_chat_harness_is_what_verifiers_loads():
  harness = loaders.harness_class(serve.verifiers_env.register_harness())
  assert harness.__name__ == "ChatHarness" and not harness.NEEDS_CONTAINER


def test_a_policy_without_a_chat_template_is_refused(taskset_file):
  source = envs.load_environment(f"verifiers:{taskset_file}")
  policy = types.SimpleNamespace(chat=False)  # no chat template
  with pytest.raises(ValueError, match="chat template"):
    serve.play_verifiers(
        source, policy, None, [], None, max_turns=1, max_new_tokens=4
    )
