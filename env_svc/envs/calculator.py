"""`calculator`: multi-turn tool use on arithmetic the model cannot do in its head.

SmolLM2's chat template is plain ChatML with no `tools` support, so the environment writes the
tool's JSON schema into the system prompt itself and uses the Hermes/Qwen call format, which
ChatML-family models are most likely to have seen:

    <tool_call>{"name": "calculator", "arguments": {"expression": "47 * 86"}}</tool_call>

Each call is answered with a `{"role": "tool", "content": "4042"}` message (ChatML renders it
as `<|im_start|>tool`), whose tokens the trainer masks out. A turn without a tool call is the
final answer. The untrained model never emits tool calls (docs/architecture.md, "Facts
measured on this machine"), so besides the exact answer two shaped components reward
well-formed calls and calls that returned a value.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from msgspec import Meta

from env_svc.envs.arithmetic import last_number
from env_svc.protocol import (
    ChatMessage,
    Environment,
    EnvParams,
    EpisodeState,
    Operand,
    Reward,
    Task,
    Weight,
    last_assistant_text,
)
from env_svc.safe_eval import SafeEvalError, format_number, safe_eval

TOOL_NAME = "calculator"
TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and ( ).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 47 * 86"}},
            "required": ["expression"],
        },
    },
}
"""OpenAI-style schema, also usable as `tools=[TOOL_SCHEMA]` with templates that take tools."""

SYSTEM_PROMPT = (
    "You are a helpful assistant with a calculator tool.\n"
    f"<tools>\n{json.dumps(TOOL_SCHEMA)}\n</tools>\n"
    "To use it, reply with only:\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>\n'
    "The result comes back in a tool message. When you know the answer, reply with just "
    "the number."
)

DEMONSTRATION: list[ChatMessage] = [
    {"role": "user", "content": "What is 23 + 48? Answer with just the number."},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "23 + 48"}}'
        "</tool_call>",
    },
    {"role": "tool", "content": "71"},
    {"role": "assistant", "content": "71"},
]
"""One worked exchange shown before the task (param `demonstration`). Measured on the base
SmolLM2-135M-Instruct, two-digit sums (bench/calculator_prompt.py): with the system prompt
alone it wrote no tool call in 256 samples at temperature 1 and 16% of groups of 8 had a
correct sample; with this exchange 8 of 256 samples and 3 of 32 greedy replies made a
well-formed call, and 50% of groups had a correct sample for GRPO to reinforce."""

MAX_CALLS_PER_TURN = 4
"""Calls beyond this in one turn are answered with an error, not evaluated."""
MAX_CALL_CHARS = 1000
"""Longest tool-call body parsed as JSON."""

# The closing tag is optional: a stop string or the token limit may cut it off.
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

Operation = Literal["+", "-", "*"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    expression: str | None
    """The expression to evaluate; None when the call itself is malformed."""
    error: str = ""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block in a model turn, parsed or with the reason it is malformed."""
    return [_parse_call(body.strip()) for body in _TOOL_CALL.findall(text)]


def strip_tool_calls(text: str) -> str:
    return _TOOL_CALL.sub("", text).strip()


def run_tool(call: ToolCall) -> str:
    """The tool message's content: the value, or `error: ...` for the model to read."""
    if call.expression is None:
        return f"error: {call.error}"
    try:
        return format_number(safe_eval(call.expression))
    except SafeEvalError as exc:
        return f"error: {exc}"


class CalculatorParams(EnvParams, frozen=True):
    operations: Annotated[tuple[Operation, ...], Meta(min_length=1)] = ("*",)
    num_operands: Annotated[int, Meta(ge=2, le=6)] = 2
    """Operands per expression; more means more steps (e.g. `47 * 86 + 13`)."""
    min_operand: Operand = 10
    max_operand: Operand = 99
    max_turns: Annotated[int, Meta(ge=1, le=16)] = 3
    """Model turns per episode, tool calls and final answer together."""
    tool_format_weight: Weight = 0.1
    """Weight of the share of tool calls that are well-formed."""
    tool_use_weight: Weight = 0.1
    """Weight of "a tool call returned a value"."""
    demonstration: bool = True
    """Show one worked exchange (a tool call, its result, the answer) before the task."""


class CalculatorTask(Task, frozen=True):
    expression: str
    answer: int


class CalculatorEnv(Environment[CalculatorTask]):
    name = "calculator"
    params_type = CalculatorParams
    task_type = CalculatorTask
    params: CalculatorParams

    @property
    def max_turns(self) -> int:
        return self.params.max_turns

    def check_params(self) -> None:
        if self.params.min_operand > self.params.max_operand:
            raise self.bad_param("min_operand", "must not exceed max_operand")

    def make_rewards(self) -> list[Reward[CalculatorTask]]:
        return [
            Reward("correct", correct, 1.0),
            Reward("tool_format", tool_format, self.params.tool_format_weight),
            Reward("tool_use", tool_use, self.params.tool_use_weight),
        ]

    def sample_task(self, rng: random.Random) -> CalculatorTask:
        p = self.params
        terms = [str(rng.randint(p.min_operand, p.max_operand))]
        for _ in range(p.num_operands - 1):
            terms += [rng.choice(p.operations), str(rng.randint(p.min_operand, p.max_operand))]
        expression = " ".join(terms)
        answer = safe_eval(expression, max_length=200, max_magnitude=10**40)
        question = f"What is {expression}? Answer with just the number."
        return CalculatorTask(question=question, expression=expression, answer=int(answer))

    def initial_messages(self, task: CalculatorTask) -> list[ChatMessage]:
        shown = DEMONSTRATION if self.params.demonstration else []
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            *shown,
            {"role": "user", "content": task.question},
        ]

    def respond(
        self, state: EpisodeState[CalculatorTask], action_text: str
    ) -> list[ChatMessage] | None:
        calls = parse_tool_calls(action_text)
        if not calls:
            return None
        replies: list[ChatMessage] = []
        for number, call in enumerate(calls):
            if number >= MAX_CALLS_PER_TURN:
                call = ToolCall(None, f"at most {MAX_CALLS_PER_TURN} calls per turn")
            replies.append({"role": "tool", "content": run_tool(call)})
        return replies


def _parse_call(body: str) -> ToolCall:
    if len(body) > MAX_CALL_CHARS:
        return ToolCall(None, f"tool call longer than {MAX_CALL_CHARS} characters")
    try:
        payload = json.loads(body)
    except ValueError:
        return ToolCall(None, 'tool call is not JSON like {"name": ..., "arguments": {...}}')
    if not isinstance(payload, dict):
        return ToolCall(None, "tool call must be a JSON object")
    if payload.get("name") != TOOL_NAME:
        return ToolCall(None, f"unknown tool {payload.get('name')!r}; the tool is {TOOL_NAME!r}")
    arguments = payload.get("arguments")
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON-encoded string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if isinstance(expression, int | float) and not isinstance(expression, bool):
        expression = str(expression)
    if not isinstance(expression, str):
        return ToolCall(None, 'arguments must be {"expression": "<arithmetic>"}')
    return ToolCall(expression)


def _model_turns(completion: Sequence[ChatMessage]) -> list[str]:
    return [message["content"] for message in completion if message["role"] == "assistant"]


def correct(task: CalculatorTask, completion: Sequence[ChatMessage]) -> float:
    """1 when the last number of the final turn (tool calls removed) is the answer."""
    return float(last_number(strip_tool_calls(last_assistant_text(completion))) == task.answer)


def tool_format(task: CalculatorTask, completion: Sequence[ChatMessage]) -> float:
    """Share of `<tool_call>` blocks that are well-formed calls; 0 without any."""
    calls = [call for turn in _model_turns(completion) for call in parse_tool_calls(turn)]
    if not calls:
        return 0.0
    return sum(call.expression is not None for call in calls) / len(calls)


def tool_use(task: CalculatorTask, completion: Sequence[ChatMessage]) -> float:
    """1 when some tool call returned a value (not an error)."""
    calls = [
        call
        for turn in _model_turns(completion)
        for call in parse_tool_calls(turn)[:MAX_CALLS_PER_TURN]
    ]
    return float(any(not run_tool(call).startswith("error:") for call in calls))
