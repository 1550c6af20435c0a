"""Tests for logra_jax.rl.rewards: shipped rewards and the guarded evaluator."""

import re
import threading
import time

import numpy as np
import pytest

from logra_jax.data import tasks
from logra_jax.rl import rewards


@pytest.fixture(scope="module")
def tiny():
  return tasks.tiny_arithmetic_task(size=40, seed=0)


def _columns(examples):
  return {
      "answer": [e["answer"] for e in examples],
      "entry": [e["entry"] for e in examples],
  }


def test_reasoning_gym_reward_uses_score_answer(tiny):
  examples = tiny.examples[:4]
  prompts = [e["prompt"] for e in examples]
  correct = [e["answer"] for e in examples]
  wrong = [str(int(a) + 1) for a in correct]
  for reward in (
      rewards.reasoning_gym_reward(tiny.score_answer),
      rewards.reasoning_gym_reward(),
  ):
    assert reward(prompts, correct, **_columns(examples)) == [1.0] * 4
    assert (
        reward(prompts, [f" {a} " for a in correct], **_columns(examples))
        == [1.0] * 4
    )
    assert all(s < 1.0 for s in reward(prompts, wrong, **_columns(examples)))
  # chain_sum's verifier gives partial credit when the answer is a substring: "1" + "16".
  answer = examples[0]["answer"]
  partial = rewards.reasoning_gym_reward(tiny.score_answer)(
      prompts[:1], ["1" + answer], entry=[examples[0]["entry"]]
  )
  assert partial == [pytest.approx(len(answer) / (len(answer) + 1))]


def test_reasoning_gym_reward_needs_entry_column():
  with pytest.raises(ValueError, match="needs the 'entry' column"):
    rewards.reasoning_gym_reward()(["p"], ["1"], answer=["1"])


def test_math_verify_equivalence():
  completions = ["The answer is $\\frac{84}{2}$.", "41", "no idea"]
  assert rewards.math_verify_equivalence(
      ["q"] * 3, completions, answer=["42"] * 3
  ) == [1.0, 0.0, 0.0]
  with pytest.raises(ValueError, match="cannot parse the reference"):
    rewards.math_verify_equivalence(["q"], ["1"], answer=[""])


def test_final_number_match_scores_the_answer_given_not_the_question_echoed(
    tiny,
):
  """math-verify accepts a completion that repeats the question's
  expression (it evaluates it); the last number written is the answer."""
  echoes = [
      "The final answer is 20 - 54 = 12.",
      "The final answer is 20 - 54 =",
  ]
  assert rewards.math_verify_equivalence(
      ["q"] * 2, echoes, answer=["-34"] * 2
  ) == [1.0, 1.0]
  assert rewards.final_number_match(["q"] * 2, echoes, answer=["-34"] * 2) == [
      0.0,
      0.0,
  ]
  right = [
      "-34",
      "The answer is -34.",
      "20 - 54 = -34",
      "-34.0",
      "so 20-54=-34",
  ]
  assert (
      rewards.final_number_match(["q"] * 5, right, answer=["-34"] * 5)
      == [1.0] * 5
  )
  assert (
      rewards.final_number_match(
          ["q"] * 3, ["34", "-34 or 35", "no idea"], answer=["-34"] * 3
      )
      == [0.0] * 3
  )
  # The task's own answers, as sentences, score 1.
  answers = [e["answer"] for e in tiny.examples[:8]]
  sentences = [f"The sum is {a}." for a in answers]
  assert (
      rewards.final_number_match(["q"] * 8, sentences, answer=answers)
      == [1.0] * 8
  )
  for bad in ("", "12 or 13", "x"):
    with pytest.raises(ValueError, match="needs one number as the answer"):
      rewards.final_number_match(["q"], ["1"], answer=[bad])


def test_math_verify_off_main_thread_through_evaluator():
  report = rewards.evaluate_rewards(
      [(rewards.math_verify_equivalence, 1.0)],
      ["q", "q"],
      ["$2^{10}$", "1000"],
      {"answer": ["1024", "1024"]},
      timeout_s=30,
  )
  np.testing.assert_array_equal(report.rewards, [1.0, 0.0])
  assert report.failures == {"math_verify_equivalence": 0}


def test_exact_match_and_format():
  assert rewards.exact_match(
      ["q"] * 3, ["  1 2 ", "12", "1  2"], answer=["1 2"] * 3
  ) == [1.0, 0.0, 1.0]
  fmt = rewards.format_reward(r"<answer>.*</answer>", name="tags")
  assert fmt.__name__ == "tags"
  assert fmt(
      ["q"] * 3,
      ["<answer>4\n2</answer>", " <answer>1</answer> ", "4 <answer>1</answer>"],
  ) == [1.0, 1.0, 0.0]


def test_combine_rewards():
  combined = rewards.combine_rewards(
      [(rewards.exact_match, 1.0), (rewards.format_reward(r"-?\d+"), 0.5)]
  )
  got = combined(["q"] * 3, ["12", "13", "x"], answer=["12", "12", "12"])
  np.testing.assert_allclose(got, [1.5, 0.5, 0.0])
  with pytest.raises(ValueError, match="at least one"):
    rewards.combine_rewards([])


def _raise_on_seven(prompts, completions, **unused):
  del prompts, unused
  if completions[0] == "7":
    raise RuntimeError("bad sample")
  return [1.0]


def _sleep_on_seven(prompts, completions, **unused):
  del prompts, unused
  if completions[0] == "7":
    time.sleep(0.6)
  return [0.5]


def _nan_reward(prompts, completions, **unused):
  del prompts, unused
  return [float("nan")] if completions[0] == "7" else [2.0]


def test_evaluator_isolates_raising_hanging_and_nan_rewards():
  threads_before = threading.active_count()
  completions = ["1", "7", "3", "7"]
  start = time.perf_counter()
  report = rewards.evaluate_rewards(
      [
          (_raise_on_seven, 1.0),
          (_sleep_on_seven, 2.0),
          (_nan_reward, 0.5),
          (rewards.exact_match, 1.0),
      ],
      ["p"] * 4,
      completions,
      {"answer": ["1", "2", "3", "7"]},
      timeout_s=0.15,
  )
  elapsed = time.perf_counter() - start
  assert elapsed < 1.0  # two timeouts of 0.15 s, not two sleeps of 0.6 s.
  np.testing.assert_array_equal(
      report.per_function["_raise_on_seven"], [1, 0, 1, 0]
  )
  np.testing.assert_array_equal(
      report.per_function["_sleep_on_seven"], [0.5, 0, 0.5, 0]
  )
  np.testing.assert_array_equal(
      report.per_function["_nan_reward"], [2, 0, 2, 0]
  )
  np.testing.assert_array_equal(
      report.per_function["exact_match"], [1, 0, 1, 1]
  )
  # 1 + 2 * 0.5 + 0.5 * 2 + 1 on the good samples; only exact match on the last.
  np.testing.assert_allclose(report.rewards, [4.0, 0.0, 4.0, 1.0])
  assert report.failures == {
      "_raise_on_seven": 2,
      "_sleep_on_seven": 0,
      "_nan_reward": 2,
      "exact_match": 0,
  }
  assert report.timeouts == {
      "_raise_on_seven": 0,
      "_sleep_on_seven": 2,
      "_nan_reward": 0,
      "exact_match": 0,
  }
  assert "RuntimeError: bad sample" in report.first_errors["_raise_on_seven"]
  assert "sample 1" in report.first_errors["_sleep_on_seven"]
  assert "non-finite" in report.first_errors["_nan_reward"]
  assert "exact_match" not in report.first_errors
  metrics = report.metrics()
  assert metrics["reward_timeouts/_sleep_on_seven"] == 2.0
  assert metrics["reward/total"] == pytest.approx(9.0 / 4)
  # Abandoned workers exit once their sleep ends: no thread outlives the hung calls.
  deadline = time.monotonic() + 3.0
  while (
      threading.active_count() > threads_before and time.monotonic() < deadline
  ):
    time.sleep(0.05)
  assert threading.active_count() == threads_before


def test_evaluator_counts_malformed_output_and_missing_column():
  def two_values(prompts, completions, **unused):
    return [1.0, 1.0]

  report = rewards.evaluate_rewards(
      [(two_values, 1.0), (rewards.reasoning_gym_reward(), 1.0)],
      ["p"],
      ["1"],
      {},
  )
  assert report.failures == {"two_values": 1, "reasoning_gym_score": 1}
  assert "list of one float" in report.first_errors["two_values"]
  assert (
      "needs the 'entry' column" in report.first_errors["reasoning_gym_score"]
  )


def test_evaluator_input_errors_and_names():
  with pytest.raises(ValueError, match="column 'answer' has 1 values for 2"):
    rewards.evaluate_rewards(
        [(rewards.exact_match, 1.0)], ["p", "p"], ["1", "2"], {"answer": ["1"]}
    )
  with pytest.raises(ValueError, match="at least one"):
    rewards.evaluate_rewards([], ["p"], ["1"])
  report = rewards.evaluate_rewards(
      [(rewards.exact_match, 1.0), (rewards.exact_match, 1.0)],
      ["p"],
      ["1"],
      {"answer": ["1"]},
  )
  assert list(report.per_function) == ["exact_match", "exact_match_2"]


@pytest.mark.parametrize(
    "weight", [float("nan"), float("inf"), 1e39, -1e300, "1", None]
)
def test_non_finite_or_non_number_weight_is_refused_naming_the_reward(weight):
  fmt = rewards.format_reward(r"\d+", name="digits")
  pairs = [(rewards.exact_match, 1.0), (fmt, weight)]
  with pytest.raises(
      ValueError,
      match=re.escape(
          "reward 'digits': weight must be a finite number within float32's "
          f"range (|w| <= 3.403e+38), got {weight!r}"
      ),
  ):
    rewards.combine_rewards(pairs)
  with pytest.raises(ValueError, match="reward 'digits': weight"):
    rewards.evaluate_rewards(pairs, ["q"], ["1"], {"answer": ["1"]})


def _constant(name, value):
  """A reward that scores every completion ``value``."""

  def reward(completions, **kwargs):
    return [value] * len(completions)

  reward.__name__ = name
  return reward


def test_rewards_beyond_float32_are_failures_naming_the_reward():
  """1e300 is finite in float64 but inf in float32, where rewards are used:
  that sample fails for its reward (scored 0), as does a weight x reward
  beyond float32; the others' scores stand."""
  huge, big = _constant("huge", 1e300), _constant("big", 1e20)
  report = rewards.evaluate_rewards(
      [(huge, 1.0), (big, 1e20), (rewards.exact_match, 1.0)],
      ["q", "q"],
      ["1", "2"],
      {"answer": ["1", "1"]},
  )
  np.testing.assert_array_equal(report.rewards, [1.0, 0.0])
  assert report.failures == {"huge": 2, "big": 2, "exact_match": 0}
  assert "non-finite reward 1e+300 in float32" in report.first_errors["huge"]
  assert "weight 1e+20 x reward 1e+20" in report.first_errors["big"]
  # Each finite, their sum not: refused naming the rewards.
  near = [(_constant("a", 3e38), 1.0), (_constant("b", 3e38), 1.0)]
  with pytest.raises(ValueError, match=r"sample 0: the weighted sum of "):
    rewards.evaluate_rewards(near, ["q"], ["1"])
  with pytest.raises(ValueError, match="reward huge returned values not "):
    rewards.check_reward_functions([(huge, 1.0)], EXAMPLES)


def test_negative_weights_are_penalties():
  report = rewards.evaluate_rewards(
      [(rewards.exact_match, 1.0), (rewards.format_reward(r"\d+"), -0.25)],
      ["q", "q"],
      ["1", "x"],
      {"answer": ["1", "1"]},
  )
  np.testing.assert_array_equal(report.rewards, [0.75, 0.0])


def test_unparseable_references_give_a_failure_fraction_and_a_warning():
  completions = ["1", "2", "3", "4"]
  report = rewards.evaluate_rewards(
      [(rewards.math_verify_equivalence, 1.0), (_raise_on_seven, 1.0)],
      ["q"] * 4,
      completions,
      {"answer": ["", "", "", "4"]},
      timeout_s=30,
  )
  assert report.failure_fraction == {
      "math_verify_equivalence": 0.75,
      "_raise_on_seven": 0.0,
  }
  metrics = report.metrics()
  assert metrics["reward_failure_fraction/math_verify_equivalence"] == 0.75
  assert metrics["reward_failure_fraction/_raise_on_seven"] == 0.0
  lines = []
  rewards.RewardFailureWarnings(lines.append)(report)
  assert len(lines) == 1
  assert lines[0].startswith(
      "warning: reward math_verify_equivalence failed on 3 of 4 samples (75%)"
  )
  assert "cannot parse the reference answer ''. Check" in lines[0]


def _report(failed, timed_out=0, n=8):
  """A report of one reward 'r' with `failed` failures of `n` samples."""
  return rewards.RewardReport(
      rewards=np.zeros(n, np.float32),
      per_function={"r": np.zeros(n)},
      failures={"r": failed},
      timeouts={"r": timed_out},
      first_errors={"r": "sample 0: boom"} if failed + timed_out else {},
  )


def test_failure_warnings_are_rate_limited_per_reward():
  lines = []
  warn = rewards.RewardFailureWarnings(lines.append, every=3)
  # Batches 1..8; half is not more than half; timeouts count as failures.
  for report in [
      _report(4),
      _report(5),
      _report(8),
      _report(3, 3),
      _report(7),
      _report(0),
      _report(8),
      _report(2, 4),
  ]:
    warn(report)
  # Warned on batch 2, then at most every 3 batches: on 5 and on 8.
  assert [line.split(" samples")[0][-6:] for line in lines] == [
      "5 of 8",
      "7 of 8",
      "6 of 8",
  ]
  assert "at most every 3 batches" in lines[0]
  assert "Since the last warning: 2 more batches" in lines[1]
  assert "Since the last warning: 1 more batch" in lines[2]
  assert all("sample 0: boom" in line for line in lines)
  other = rewards.RewardFailureWarnings(lines.append, every=3)
  other(_report(5))  # a new counter per instance: warns at once
  assert len(lines) == 4
  with pytest.raises(ValueError, match=r"threshold must be in \[0, 1\)"):
    rewards.RewardFailureWarnings(print, threshold=1.0)
  with pytest.raises(ValueError, match="every must be >= 1"):
    rewards.RewardFailureWarnings(print, every=0)


# --- Reward functions by path, with TRL's signature -----------------------------------------

TRL_STYLE = """\
import re

def brevity(completions, **kwargs):
  # TRL reward functions name only what they use and take the rest as **kwargs.
  return [1.0 if len(c) <= 3 else 0.0 for c in completions]

def uses_answer(prompts, completions, answer, **kwargs):
  return [float(c.strip() == a) for c, a in zip(completions, answer)]

def wrong_length(completions, **kwargs):
  return [1.0]

def raises(completions, **kwargs):
  raise KeyError("solution")

def not_numbers(completions, **kwargs):
  return ["yes" for _ in completions]

NOT_CALLABLE = 3
"""

EXAMPLES = [
    {"prompt": "1+1=", "answer": "2"},
    {"prompt": "2+2=", "answer": "4"},
    {"prompt": "3+3=", "answer": "6"},
]


@pytest.fixture
def reward_file(tmp_path):
  path = tmp_path / "my_rewards.py"
  path.write_text(TRL_STYLE)
  return path


def test_a_reward_from_a_file_path_scores_a_batch(reward_file):
  brevity = rewards.load_reward_function(f"{reward_file}:brevity")
  uses_answer = rewards.load_reward_function(f"{reward_file}:uses_answer")
  report = rewards.evaluate_rewards(
      [(brevity, 1.0), (uses_answer, 2.0)],
      ["1+1=", "2+2=", "3+3="],
      ["2", "five", " 6 "],
      {"answer": ["2", "4", "6"]},
  )
  np.testing.assert_array_equal(report.rewards, [3.0, 0.0, 3.0])
  assert report.failures == {"brevity": 0, "uses_answer": 0}
  rewards.check_reward_functions([(brevity, 1.0), (uses_answer, 1.0)], EXAMPLES)


def test_a_reward_from_an_import_path():
  fn = rewards.load_reward_function("logra_jax.rl.rewards:exact_match")
  assert fn is rewards.exact_match
  assert fn(prompts=["q"], completions=["12"], answer=["12"]) == [1.0]


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("{file}:missing", ValueError, "has no attribute 'missing'"),
        (
            "{file}:NOT_CALLABLE",
            ValueError,
            "NOT_CALLABLE is a int, not a function",
        ),
        (
            "{dir}/absent.py:f",
            FileNotFoundError,
            "file {dir}/absent.py not found",
        ),
        (
            "{dir}/broken.py:f",
            ValueError,
            "{dir}/broken.py does not import: SyntaxError",
        ),
        (
            "no_such_module_xyz:f",
            ValueError,
            "no_such_module_xyz does not import: ModuleNotFoundError",
        ),
        ("brevity", ValueError, "must look like package.module:function"),
    ],
)
def test_a_reward_that_does_not_load_is_named(
    reward_file, spec, error, message
):
  (reward_file.parent / "broken.py").write_text("def f(:\n")
  fill = dict(file=reward_file, dir=reward_file.parent)
  with pytest.raises(error) as info:
    rewards.load_reward_function(spec.format(**fill))
  assert message.format(**fill) in str(info.value)


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "wrong_length",
            "reward wrong_length returned 1 values for 3 completions",
        ),
        (
            "raises",
            "reward raises(completions, **kwargs) failed on the task's reference "
            "answers: KeyError: 'solution'; a reward takes (prompts, completions, **columns) "
            "as keywords, the columns being ['answer']",
        ),
        (
            "not_numbers",
            "reward not_numbers returned ['yes', 'yes', 'yes'], not numbers",
        ),
    ],
)
def test_a_bad_reward_is_refused_before_a_run(reward_file, name, message):
  fn = rewards.load_reward_function(f"{reward_file}:{name}")
  with pytest.raises(ValueError) as info:
    rewards.check_reward_functions([(fn, 1.0)], EXAMPLES)
  assert message in str(info.value)


def test_a_reward_that_hangs_on_the_check_is_refused():
  release = threading.Event()

  def hangs(completions, **kwargs):
    release.wait(30)
    return [0.0] * len(completions)

  with pytest.raises(
      ValueError, match="reward hangs returned nothing within 0.2 s"
  ):
    rewards.check_reward_functions([(hangs, 1.0)], EXAMPLES, timeout_s=0.2)
  release.set()


def test_a_reward_returning_numpy_arrays_scores_as_a_list_would():
  def array_reward(completions, **kwargs):
    return np.array([float(c == "2") for c in completions])

  rewards.check_reward_functions([(array_reward, 1.0)], EXAMPLES)
  report = rewards.evaluate_rewards(
      [(array_reward, 1.0)], ["q", "q"], ["2", "3"], {}
  )
  np.testing.assert_array_equal(report.rewards, [1.0, 0.0])
  assert report.failures == {"array_reward": 0}


def test_a_reward_named_total_does_not_hide_the_total():
  def total(completions, **kwargs):
    return [1.0] * len(completions)

  metrics = rewards.evaluate_rewards([(total, 0.5)], ["q"], ["a"]).metrics()
  assert metrics["reward/total"] == 0.5 and metrics["reward/total_2"] == 1.0


def test_a_reward_that_edits_its_columns_changes_nothing_for_the_others():
  entries = [{"answer": "2"}, {"answer": "3"}]
  columns = {"answer": ["2", "3"], "entry": entries}

  def vandal(completions, answer, entry, **kwargs):
    for row in entry:
      row["answer"] = "wrong"
    answer[:] = ["wrong"] * len(answer)
    return [0.0] * len(completions)

  def exact(completions, answer, entry, **kwargs):
    return [
        float(c == a == e["answer"])
        for c, a, e in zip(completions, answer, entry)
    ]

  report = rewards.evaluate_rewards(
      [(vandal, 1.0), (exact, 1.0)], ["q", "q"], ["2", "3"], columns
  )
  np.testing.assert_array_equal(report.per_function["exact"], [1.0, 1.0])
  assert entries == [{"answer": "2"}, {"answer": "3"}]
  assert columns["answer"] == ["2", "3"]
