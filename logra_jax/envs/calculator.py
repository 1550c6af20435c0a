"""The shipped ``calculator`` environment: arithmetic with a calculator tool.

The model calls the tool in one of two formats:

- its chat template's own, where the template renders a ``tools=``
  argument (Qwen2.5's and Hermes' ``<tool_call>{"name": "calculator",
  "arguments": {"expression": "..."}}</tool_call>``): the environment
  declares the tool's JSON schema (:data:`TOOL_SCHEMA`, its ``tools``), the
  episode's messages are rendered with it, and the result comes back as a
  ``tool`` message holding the bare value, which the template renders (in
  ``<tool_response>`` tags for Qwen2.5);
- ``<calc>EXPRESSION</calc>`` otherwise (a template without tool support,
  such as SmolLM2's, which ignores ``tools``, or no template): the
  environment answers with a ``tool`` message holding
  ``<result>VALUE</result>``.

A malformed call, or one naming another tool (``<foo>...</foo>``, or
another ``"name"`` in a ``<tool_call>``), is answered with an error text
and the model's next turn follows. A turn without a tool call is the
model's answer and ends the episode: the text between ``<answer>`` and
``</answer>`` if it writes them, else its whole message, scored by the
run's reward functions (the task's verifier by default).

Evaluation is safe: the expression is parsed with :mod:`ast` and only
integer and float literals, the operators above and unary signs are
evaluated; the expression's length, its literals, exponents and results
are bounded, so no call can take long or build a huge number.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from typing import Any, Mapping

from logra_jax.envs.base import Message
from logra_jax.envs.base import StepResult

TOOL = "calc"
# The tool as a chat template's ``tools=`` argument declares it (OpenAI's
# function format, which transformers' ``apply_chat_template`` takes).
TOOL_NAME = "calculator"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Evaluates an arithmetic expression exactly: numbers, "
            "+ - * / // % ** and parentheses."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "the expression, e.g. 12345 * 678",
                }
            },
            "required": ["expression"],
        },
    },
}
TOOL_CALL = "tool_call"  # the template format's tag
# Bounds of one call: characters of the expression, digits of a literal or
# a result, and the largest exponent.
MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 64
MAX_EXPONENT = 64

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CALL = re.compile(r"<([A-Za-z_][\w-]*)>(.*?)</\1>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class CalculatorError(ValueError):
  """An expression the calculator refuses (the message says why)."""


def _bounded(value: int | float) -> int | float:
  """``value`` if it is real, finite and has at most :data:`MAX_DIGITS`
  digits."""
  if not isinstance(value, (int, float)):  # (-8) ** 0.5 is complex
    raise CalculatorError("result is not a real number")
  if isinstance(value, float):
    if not math.isfinite(value) or abs(value) >= 10.0**MAX_DIGITS:
      raise CalculatorError("result out of range")
  elif abs(value) >= 10**MAX_DIGITS:
    raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
  return value


def _evaluate(node: ast.AST) -> int | float:
  if isinstance(node, ast.Expression):
    return _evaluate(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return _bounded(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_evaluate(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
      raise CalculatorError(f"exponent above {MAX_EXPONENT}")
    try:
      return _bounded(_BINARY[type(node.op)](left, right))
    except ZeroDivisionError:
      raise CalculatorError("division by zero") from None
    except OverflowError:
      raise CalculatorError("result out of range") from None
  raise CalculatorError(f"{type(node).__name__} is not arithmetic")


def calculate(expression: str) -> str:
  """The value of an arithmetic expression, as text.

  .. math::
    \\text{value} = \\text{eval}_{+,-,\\times,/,//,\\%,**}(\\text{expression})

  with integer results kept exact and a float that is a whole number shown
  as an integer.

  Args:
    expression: integers or decimals, ``+ - * / // % **``, parentheses;
      at most :data:`MAX_EXPRESSION_CHARS` characters.

  Returns:
    The value, e.g. ``"8369910"``.

  Raises:
    CalculatorError: anything else (names, calls, a literal or result of
      more than :data:`MAX_DIGITS` digits, an exponent above
      :data:`MAX_EXPONENT`, division by zero, a syntax error).

  Example:
    >>> calculate("12345*678")
    '8369910'
    >>> calculate("7/2"), calculate("-(3**4)")
    ('3.5', '-81')
  """
  text = expression.strip()
  if not text:
    raise CalculatorError("empty expression")
  if len(text) > MAX_EXPRESSION_CHARS:
    raise CalculatorError(
        f"expression longer than {MAX_EXPRESSION_CHARS} characters"
    )
  try:
    tree = ast.parse(text, mode="eval")
  except (SyntaxError, ValueError):
    raise CalculatorError(f"cannot parse {text!r}") from None
  try:
    value = _evaluate(tree)
  except RecursionError:
    raise CalculatorError("expression nested too deeply") from None
  if isinstance(value, float) and value.is_integer():
    return str(int(value))
  return str(value)


def parse_tool_call(body: str) -> str:
  """The expression of a calculator call in the chat template's format.

  ``body`` is the text between ``<tool_call>`` and ``</tool_call>``: a JSON
  object ``{"name": "calculator", "arguments": {"expression": "..."}}``
  (``arguments`` may also be that object as a JSON string, as OpenAI's
  format writes it).

  Args:
    body: the call's text.

  Returns:
    The expression.

  Raises:
    CalculatorError: a body that is not such an object (malformed), or a
      call of another tool (unknown tool).

  Example:
    >>> parse_tool_call('{"name": "calculator", '
    ...                 '"arguments": {"expression": "2*21"}}')
    '2*21'
    >>> try:
    ...   parse_tool_call('{"name": "search", "arguments": {}}')
    ... except CalculatorError as error:
    ...   print(error)
    unknown tool 'search'; use calculator
  """
  try:
    call = json.loads(body)
  except ValueError:
    raise CalculatorError("malformed call: not JSON") from None
  if not isinstance(call, dict) or not isinstance(call.get("name"), str):
    raise CalculatorError('malformed call: no "name"')
  if call["name"] != TOOL_NAME:
    raise CalculatorError(f"unknown tool {call['name']!r}; use {TOOL_NAME}")
  arguments = call.get("arguments")
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments)
    except ValueError:
      raise CalculatorError("malformed call: arguments not JSON") from None
  expression = (
      arguments.get("expression") if isinstance(arguments, dict) else None
  )
  if not isinstance(expression, str):
    raise CalculatorError('malformed call: no "expression" string')
  return expression


class Calculator:
  """An episode of arithmetic with the calculator tool (module docstring).

  Example:
    >>> env = Calculator()
    >>> env.reset({"prompt": "12345*678="})
    [{'role': 'user', 'content': '12345*678='}]
    >>> env.step("<calc>12345*678</calc>").messages
    [{'role': 'tool', 'content': '<result>8369910</result>'}]
    >>> env.step('<tool_call>{"name": "calculator", '
    ...          '"arguments": {"expression": "12345*678"}}</tool_call>'
    ...          ).messages
    [{'role': 'tool', 'content': '8369910'}]
    >>> env.step("<answer>8369910</answer>").answer
    '8369910'
  """

  stop_strings = (f"</{TOOL}>", f"</{TOOL_CALL}>", "</answer>")
  tools = (TOOL_SCHEMA,)

  def reset(self, example: Mapping[str, Any]) -> list[Message]:
    """The task's prompt as the user's message."""
    return [{"role": "user", "content": str(example["prompt"])}]

  def step(self, model_message: str) -> StepResult:
    """Runs the turn's first tool call, or ends the episode on an answer."""
    answer = _ANSWER.search(model_message)
    call = _CALL.search(model_message)
    if answer is not None and (call is None or call.group(1) == "answer"):
      return StepResult(done=True, answer=answer.group(1).strip())
    if call is None:
      for tag in (TOOL, TOOL_CALL):
        if f"<{tag}>" in model_message:
          return _tool_error(f"malformed call: no </{tag}>", calls=0)
      return StepResult(done=True)
    if call.group(1) == TOOL_CALL:
      try:
        value = calculate(parse_tool_call(call.group(2)))
      except CalculatorError as error:
        return _tool_error(str(error))
      return StepResult(_tool(value), tool_calls=1)
    if call.group(1) != TOOL:
      return _tool_error(f"unknown tool {call.group(1)!r}; use <{TOOL}>")
    try:
      value = calculate(call.group(2))
    except CalculatorError as error:
      return _tool_error(str(error))
    return StepResult(_tool(f"<result>{value}</result>"), tool_calls=1)


def _tool(content: str) -> list[Message]:
  return [{"role": "tool", "content": content}]


def _tool_error(problem: str, calls: int = 1) -> StepResult:
  return StepResult(
      _tool(f"<error>{problem}</error>"), tool_calls=calls, failed=True
  )


def calculator() -> Calculator:
  """The factory of the shipped ``task.environment=calculator``.

  Example:
    >>> calculator().step("<calc>2**10</calc>").messages[0]["content"]
    '<result>1024</result>'
  """
  return Calculator()
