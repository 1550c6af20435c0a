"""Inputs that need the policy's shapes or tokenizer are refused before the
run writes anything, trains a warm start or compiles (rl/preflight.py,
called by setup.check_inputs)."""

import pytest

from logra_jax import configs
from logra_jax.rl import preflight
from logra_jax.rl import setup
from logra_jax.rl import warm_start

SMOKE = configs.get_preset("smoke")


def _refused(overrides, match, tmp_path, error=ValueError):
  config = configs.apply_overrides(SMOKE, overrides)
  with pytest.raises(error, match=match):
    setup.check_inputs(config, tmp_path / "run", None, resume=False)
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["logra", "galore"])
def test_a_rank_larger_than_every_matrix_is_refused(name, tmp_path):
  """Every matrix would be kept dense: the low-rank optimizer would be dense
  Adam under another name. The message names the largest matrix and the
  largest rank that projects it."""
  _refused(
      [f"optimizer.name={name}", "optimizer.rank=65"],
      r"optimizer.rank=65 is larger than every matrix .* choose "
      r"optimizer.rank <= 64",
      tmp_path,
  )


def test_a_rank_larger_than_some_matrices_is_accepted(tmp_path):
  """The smoke policy's matrices are 64 x 32 (and the embeddings, dense by
  default): at rank 64 each is still projected (its rank clipped to 32)."""
  config = configs.apply_overrides(SMOKE, ["optimizer.rank=64"])
  setup.check_inputs(config, tmp_path / "run", None, resume=False)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["optimizer.lora_targets=[nope]"],
            r"optimizer.lora_targets=\['nope'\] .*: LoRA targets \['nope'\]",
        ),
        (
            ["optimizer.rank=33"],
            r"optimizer.rank=33: LoRA rank 33 exceeds the smaller side",
        ),
    ],
)
def test_lora_settings_the_policy_cannot_take_are_refused(
    overrides, match, tmp_path
):
  _refused(["optimizer.name=lora", *overrides], match, tmp_path)


def test_an_unwritable_warm_start_cache_is_refused_naming_the_field(tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("not a folder")
  _refused(
      [f"policy.cache_dir={blocker / 'cache'}"],
      r"policy.cache_dir=.* is not a folder the warm start can write to",
      tmp_path,
  )


def test_a_system_prompt_without_a_chat_template_is_refused(tmp_path):
  _refused(
      ["task.system_prompt=Be brief."],
      "task.system_prompt needs a chat template, but the tokenizer of the "
      "warm-started policy has none",
      tmp_path,
  )


def test_completions_must_fit_the_context_beside_the_longest_prompt(tmp_path):
  """The boundary exactly: the longest prompt's tokens plus
  rollout.max_new_tokens may fill the context, not one token more."""
  task = setup.load_task(SMOKE)
  tokenizer = preflight.policy_tokenizer(SMOKE)
  longest = max(len(tokenizer(e["prompt"])["input_ids"]) for e in task.examples)
  room = warm_start.CONTEXT_TOKENS - longest
  fits = configs.apply_overrides(SMOKE, [f"rollout.max_new_tokens={room}"])
  setup.check_inputs(fits, tmp_path / "fits", None, resume=False)
  _refused(
      [f"rollout.max_new_tokens={room + 1}"],
      f"longest prompt is {longest} tokens; with rollout.max_new_tokens="
      f"{room + 1} it does not fit the context of 64 tokens .* at most {room}",
      tmp_path,
  )
