"""Tests for logra_jax.data.tasks: reasoning-gym and file tasks, splits, errors."""

import json

import pandas as pd
import pytest

from logra_jax.data import tasks


@pytest.fixture(scope="module")
def tiny():
  return tasks.tiny_arithmetic_task(size=300, seed=0)


def test_tiny_task_prompts_are_short_and_verified(tiny):
  assert tiny.name == tasks.TINY_TASK and len(tiny) == 300
  for example in tiny.examples:
    prompt, answer = example["prompt"], example["answer"]
    assert prompt.endswith("=") and " " not in prompt
    assert 5 <= len(prompt) + len(answer) <= 13
    # The compact prompt evaluates to the answer, and reasoning-gym agrees.
    assert eval(prompt[:-1]) == int(answer)  # noqa: S307 -- digits and +/- only.
    assert tiny.score_answer(answer, example["entry"]) == 1.0
    assert tiny.score_answer(str(int(answer) + 1), example["entry"]) < 1.0
  assert (
      tiny.examples[3]["prompt"] == "5-9="
      and tiny.examples[3]["answer"] == "-4"
  )


def test_worked_answers(tiny):
  texts = tasks.worked_answers(tiny.examples[:3])
  assert texts == [e["prompt"] + e["answer"] for e in tiny.examples[:3]]
  assert tasks.worked_answers(
      [{"prompt": "Q: 1+1\nA:", "answer": "2"}], " "
  ) == ["Q: 1+1\nA: 2"]


def test_split_is_deterministic_and_disjoint(tiny):
  train, evals = tiny.split(eval_size=50, seed=3)
  train2, evals2 = tiny.split(eval_size=50, seed=3)
  assert train == train2 and evals == evals2
  eval_prompts = [e["prompt"] for e in evals]
  assert len(eval_prompts) == len(set(eval_prompts)) == 50
  assert not set(eval_prompts) & {e["prompt"] for e in train}
  # Nothing lost: every example is in train or has its prompt in eval.
  assert {e["prompt"] for e in tiny.examples} == set(eval_prompts) | {
      e["prompt"] for e in train
  }
  # The source repeats some prompts (1-digit sums), so disjointness is by text, not index.
  assert len({e["prompt"] for e in tiny.examples}) < len(tiny)
  _, evals_other = tiny.split(eval_size=50, seed=4)
  assert evals_other != evals
  with pytest.raises(ValueError, match="eval_size=0 must be in"):
    tiny.split(eval_size=0)


def test_validation_and_test_splits_are_disjoint_and_nested(tiny):
  """Validation and test are the held-out prompts of ``split`` (same seed,
  their sizes summed) in its order, so the train split is ``split``'s."""
  train, validation, test = tiny.splits(20, 30, seed=3)
  assert (train, validation + test) == tiny.split(eval_size=50, seed=3)
  prompts = lambda examples: {e["prompt"] for e in examples}
  assert len(prompts(validation)) == 20 and len(prompts(test)) == 30
  assert not prompts(validation) & prompts(test)
  assert not (prompts(validation) | prompts(test)) & prompts(train)
  assert tiny.distinct_prompts() == len(prompts(tiny.examples))
  # The default job's held-out set is split's, untouched by the new splits.
  assert tiny.split(eval_size=20, seed=3)[1] == validation
  with pytest.raises(ValueError, match="test_size=0 must both be >= 1"):
    tiny.splits(20, 0)


def test_reasoning_gym_task_by_name_and_config():
  task = tasks.reasoning_gym_task(
      "basic_arithmetic",
      size=5,
      seed=1,
      config={"min_terms": 2, "max_terms": 2},
      template="Compute {expression}.",
  )
  assert task.name == "basic_arithmetic" and len(task) == 5
  example = task.examples[0]
  assert (
      example["prompt"]
      == f"Compute {example['entry']['metadata']['expression']}."
  )
  assert task.score_answer(example["answer"], example["entry"]) == 1.0
  by_name = tasks.load_task(
      "basic_arithmetic", size=5, seed=1, config={"max_terms": 2}
  )
  assert (
      by_name.examples[0]["prompt"] == example["entry"]["question"]
  )  # default template.


def test_reasoning_gym_errors():
  with pytest.raises(
      ValueError, match=r"unknown task 'chain_sums'.*Did you mean \['chain_sum'"
  ):
    tasks.load_task("chain_sums")
  with pytest.raises(ValueError, match=r"reasoning_gym.factory.DATASETS"):
    tasks.reasoning_gym_task("no_such_task")
  with pytest.raises(
      ValueError, match=r"unknown config fields \['max_term'\].*'max_terms'"
  ):
    tasks.reasoning_gym_task("chain_sum", config={"max_term": 3})
  with pytest.raises(ValueError, match="invalid config"):
    tasks.reasoning_gym_task(
        "chain_sum", config={"min_terms": 5, "max_terms": 2}
    )
  with pytest.raises(ValueError, match="empty dataset"):
    tasks.reasoning_gym_task("chain_sum", size=0)
  with pytest.raises(
      ValueError, match=r"uses field 'expr'.*available fields: \["
  ):
    tasks.reasoning_gym_task("chain_sum", size=2, template="{expr}=")
  for template in ("{0}", "{prompt.nope}", "{prompt[99]}", "{prompt:d}"):
    with pytest.raises(ValueError, match="cannot format 'chain_sum' items"):
      tasks.reasoning_gym_task("chain_sum", size=2, template=template)
  for options in ({"max_terms": "abc"}, {"max_terms": 2.5}):
    with pytest.raises(ValueError, match=r"invalid config .* for 'chain_sum'"):
      tasks.reasoning_gym_task("chain_sum", size=2, config=options)


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


GSM_ROWS = [
    {
        "question": "Tom has 3 apples and buys 4. How many?",
        "answer": "3 + 4 = 7\n#### 7",
        "level": 1,
    },
    {
        "question": "What is 6 times 7?",
        "answer": "6 * 7 = 42\n#### 42",
        "level": 2,
    },
]


def test_jsonl_task_with_gsm8k_answers(tmp_path):
  path = _write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
  task = tasks.load_task(
      str(path), template="Question: {question}\nAnswer:", answer_after="#### "
  )
  assert task.name == "gsm" and task.score_answer is None
  assert [e["prompt"] for e in task.examples] == [
      "Question: Tom has 3 apples and buys 4. How many?\nAnswer:",
      "Question: What is 6 times 7?\nAnswer:",
  ]
  assert [e["answer"] for e in task.examples] == ["7", "42"]
  assert [e["level"] for e in task.examples] == [1, 2]  # other columns kept.


def test_custom_columns_and_parquet(tmp_path):
  rows = [
      {"q": "2+2", "sol": "4", "topic": "add"},
      {"q": "3*3", "sol": "9", "topic": "mul"},
  ]
  jsonl = _write_jsonl(tmp_path / "custom.jsonl", rows)
  parquet = tmp_path / "custom.parquet"
  pd.DataFrame(rows).to_parquet(parquet)
  for path in (jsonl, parquet):
    task = tasks.file_task(
        path,
        prompt_column="q",
        answer_column="sol",
        template="[{topic}] {prompt} =",
        name="mine",
    )
    assert task.name == "mine"
    assert [(e["prompt"], e["answer"]) for e in task.examples] == [
        ("[add] 2+2 =", "4"),
        ("[mul] 3*3 =", "9"),
    ]


def test_file_task_errors(tmp_path):
  path = _write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
  with pytest.raises(
      ValueError,
      match=r"prompt_column='problem'.*available columns: \['question', 'answer', ",
  ):
    tasks.file_task(path, prompt_column="problem")
  with pytest.raises(ValueError, match=r"answer_column='solution'"):
    tasks.file_task(path, answer_column="solution")
  with pytest.raises(ValueError, match=r"uses field 'query'"):
    tasks.file_task(path, template="{query}")
  with pytest.raises(ValueError, match=r"no marker '####'"):
    tasks.file_task(
        _write_jsonl(
            tmp_path / "plain.jsonl", [{"question": "q", "answer": "1"}]
        ),
        answer_after="####",
    )
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  with pytest.raises(ValueError, match="empty dataset"):
    tasks.file_task(empty)
  empty_parquet = tmp_path / "empty.parquet"
  pd.DataFrame(
      {"question": pd.Series([], dtype=str), "answer": pd.Series([], dtype=str)}
  ).to_parquet(empty_parquet)
  with pytest.raises(ValueError, match="empty dataset"):
    tasks.file_task(empty_parquet)
  with pytest.raises(
      ValueError, match=r"extension among \['.json', '.jsonl', '.parquet'\]"
  ):
    tasks.file_task(tmp_path / "data.csv")
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    tasks.file_task(tmp_path / "missing.jsonl")


def test_prompt_batches_deterministic_and_full(tiny):
  train, _ = tiny.split(eval_size=10)
  first = [
      next(it)
      for it in [tasks.prompt_batches(train, 7, seed=1)]
      for _ in range(3)
  ]
  again = tasks.prompt_batches(train, 7, seed=1)
  assert [next(again) for _ in range(3)] == first
  assert all(len(b) == 7 for b in first)
  # Across an epoch boundary every example appears once per epoch.
  three = [{"prompt": str(i), "answer": str(i)} for i in range(3)]
  it = tasks.prompt_batches(three, 2, seed=0)
  seen = [e["prompt"] for _ in range(3) for e in next(it)]
  assert sorted(seen[:3]) == ["0", "1", "2"] and sorted(seen[3:]) == [
      "0",
      "1",
      "2",
  ]
  with pytest.raises(ValueError, match="batch_size must be >= 1"):
    next(tasks.prompt_batches(three, 0))


def test_malformed_jsonl_line_is_named(tmp_path):
  path = tmp_path / "broken.jsonl"
  path.write_text(
      '{"question": "1+1", "answer": "2"}\n'
      '{"question": "2+2", "answer": \n'
      '{"question": "3+3", "answer": "6"}\n'
  )
  with pytest.raises(
      ValueError, match=r"broken\.jsonl, line 2: not valid JSON"
  ):
    tasks.load_task(str(path))
  path.write_text('{"question": "1+1", "answer": "2"}\n\n[1, 2]\n')
  with pytest.raises(
      ValueError, match=r"broken\.jsonl, line 3: .*not a JSON object"
  ):
    tasks.load_task(str(path))


def test_malformed_json_document_is_named(tmp_path):
  path = tmp_path / "broken.json"
  path.write_text(
      '[\n  {"question": "1+1", "answer": "2"},\n  {"question": }\n]\n'
  )
  with pytest.raises(ValueError, match=r"broken\.json, line 3: not valid JSON"):
    tasks.file_task(path)
  # A JSON array of rows, and JSON lines in a .json file, both load.
  path.write_text(json.dumps(GSM_ROWS))
  assert len(tasks.file_task(path)) == 2
  _write_jsonl(path, GSM_ROWS)
  assert len(tasks.file_task(path)) == 2


def test_unreadable_files_are_named(tmp_path):
  junk = tmp_path / "junk.parquet"
  junk.write_bytes(b"\x00not parquet\xff" * 20)
  with pytest.raises(
      ValueError, match=r"cannot read .*junk\.parquet: ArrowInvalid"
  ):
    tasks.file_task(junk)
  binary = tmp_path / "binary.jsonl"
  binary.write_bytes(b'{"question": "\xff"}\n')
  with pytest.raises(ValueError, match=r"cannot read .*binary\.jsonl: Unicode"):
    tasks.file_task(binary)


@pytest.mark.parametrize("column", ["question", "answer"])
def test_null_or_missing_prompt_or_answer_names_the_row(tmp_path, column):
  rows = [dict(r) for r in GSM_ROWS] + [{"question": "q", "answer": "#### 1"}]
  rows[1][column] = None
  path = _write_jsonl(tmp_path / "nulls.jsonl", rows)
  with pytest.raises(
      ValueError,
      match=(rf"nulls\.jsonl, row 1: column {column!r} is null or missing"),
  ):
    tasks.file_task(path)
  del rows[1][column]  # absent from one row only: `datasets` fills null
  _write_jsonl(path, rows)
  with pytest.raises(ValueError, match=rf"row 1: column {column!r} is null"):
    tasks.file_task(path)


def test_rows_are_named_by_file_when_there_are_several(tmp_path):
  good = _write_jsonl(tmp_path / "good.jsonl", GSM_ROWS)
  bad = _write_jsonl(
      tmp_path / "bad.jsonl", [{"question": None, "answer": "1"}]
  )
  with pytest.raises(ValueError, match=r"bad\.jsonl, row 0: column 'question'"):
    tasks.file_task([good, bad])
  task = tasks.file_task([good, good], answer_after="#### ")
  assert [e["answer"] for e in task.examples] == ["7", "42", "7", "42"]
