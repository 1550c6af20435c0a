"""The calculator environment: safe arithmetic, tool calls and answers."""

import pytest

from logra_jax import envs
from logra_jax.envs import calculator as calc


@pytest.mark.parametrize(
    "expression, value",
    [
        ("12345*678", "8369910"),
        (" (1 + 2) * -3 ", "-9"),
        ("7/2", "3.5"),
        ("8/4", "2"),
        ("17//5", "3"),
        ("17%5", "2"),
        ("2**10", "1024"),
        ("2**-2", "0.25"),
        ("99999999*99999999", str(99999999 * 99999999)),
    ],
)
def test_the_calculator_computes_arithmetic_exactly(expression, value):
  assert envs.calculate(expression) == value


@pytest.mark.parametrize(
    "expression, problem",
    [
        ("", "empty"),
        ("1+", "cannot parse"),
        ("__import__('os').system('true')", "Call is not arithmetic"),
        ("x + 1", "Name is not arithmetic"),
        ("[1, 2]", "List is not arithmetic"),
        ("'a' * 3", "Constant is not arithmetic"),
        ("True + 1", "Constant is not arithmetic"),
        ("1 if 1 else 2", "IfExp is not arithmetic"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("9" * (calc.MAX_DIGITS + 1), "more than"),
        ("10**60 * 10**10", "more than"),
        ("2**" + str(calc.MAX_EXPONENT + 1), "exponent above"),
        ("2**2**2**2**2", "exponent above"),
        ("1e300 * 1e300", "out of range"),
        ("(-8) ** 0.5", "not a real number"),
        ("1+" * calc.MAX_EXPRESSION_CHARS + "1", "longer than"),
    ],
)
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(
    expression, problem
):
  with pytest.raises(envs.CalculatorError, match=problem):
    envs.calculate(expression)


def test_a_tool_call_is_answered_with_its_result_and_the_episode_goes_on():
  result = envs.Calculator().step("let me compute <calc>123 * 456</calc>")
  assert result == envs.StepResult(
      [{"role": "tool", "content": "<result>56088</result>"}], tool_calls=1
  )


@pytest.mark.parametrize(
    "message, problem",
    [
        ("<calc>1 +</calc>", "cannot parse"),
        ("<calc>open('x')</calc>", "Call is not arithmetic"),
        ("<search>weather</search>", "unknown tool 'search'"),
        ("<calc>12*3", "malformed call"),
    ],
)
def test_a_bad_tool_call_is_a_counted_failure_told_to_the_model(
    message, problem
):
  result = envs.Calculator().step(message)
  assert not result.done and result.failed
  assert result.messages[0]["role"] == "tool"
  assert problem in result.messages[0]["content"]


def test_an_answer_ends_the_episode_with_the_text_the_verifier_scores():
  env = envs.Calculator()
  assert env.step("so it is <answer> 42 </answer>") == envs.StepResult(
      done=True, answer="42"
  )
  plain = env.step("42")  # the task's own format: the whole message
  assert plain.done and plain.answer is None and not plain.failed
