"""`calculator`: multi-turn tool use on arithmetic the model cannot do in its head.

Built on the tool layer (env_svc/tools/): the tool is the documented function `calculator`,
and the layer writes its schema into the system prompt (SmolLM2's chat template is plain
ChatML with no `tools` support) in the Hermes/Qwen call format, which ChatML-family models
are most likely to have seen:

    <tool_call>{"name": "calculator", "arguments": {"expression": "47 * 86"}}</tool_call>

Each call is answered with a `{"role": "tool", "content": "4042"}` message (ChatML renders it
as `<|im_start|>tool`), whose tokens the trainer masks out. A turn without a tool call is the
final answer. The untrained model never emits tool calls (docs/architecture.md, "Facts
measured on this machine"), so besides the exact answer two shaped components reward
well-formed calls and calls that returned a value. The prompt is the one this environment had
before the tool layer, byte for byte (tests/unit/test_tools.py), so it learns as it did.
"""

from __future__ import annotations

import random
from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta

from env_svc.envs.number_answer import NumberTask, number_answer_rewards
from env_svc.protocol import ChatMessage, EnvParams, Operand, Reward, Weight
from env_svc.safe_eval import SafeEvalError, format_number, safe_eval
from env_svc.tools import Tool, ToolEnvironment
from env_svc.tools.toolbox import ERROR

TOOL_NAME = "calculator"


def calculator(expression: str | float) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and ( )."""
    try:
        return format_number(safe_eval(str(expression)))
    except SafeEvalError as exc:
        return f"{ERROR}{exc}"


CALCULATOR = Tool.of(
    calculator,
    # As shown before the tool layer (the signature's schema would also admit a number).
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 47 * 86"}},
        "required": ["expression"],
    },
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

Operation = Literal["+", "-", "*"]


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


class CalculatorTask(NumberTask, frozen=True):
    expression: str


class CalculatorEnv(ToolEnvironment[CalculatorTask]):
    name = "calculator"
    params_type = CalculatorParams
    task_type = CalculatorTask
    params: CalculatorParams
    tools = (CALCULATOR,)
    tools_intro = "You are a helpful assistant with a calculator tool."
    tools_example: ClassVar[tuple[str, dict[str, Any]]] = (TOOL_NAME, {"expression": "12 * 34"})
    tools_outro = (
        "The result comes back in a tool message. When you know the answer, reply with just "
        "the number."
    )
    max_calls_per_turn = MAX_CALLS_PER_TURN

    @property
    def max_turns(self) -> int:
        return self.params.max_turns

    def check_params(self) -> None:
        if self.params.min_operand > self.params.max_operand:
            raise self.bad_param("min_operand", "must not exceed max_operand")

    def make_rewards(self) -> list[Reward[CalculatorTask]]:
        return number_answer_rewards(self.params.tool_format_weight, self.params.tool_use_weight)

    def sample_task(self, rng: random.Random) -> CalculatorTask:
        p = self.params
        terms = [str(rng.randint(p.min_operand, p.max_operand))]
        for _ in range(p.num_operands - 1):
            terms += [rng.choice(p.operations), str(rng.randint(p.min_operand, p.max_operand))]
        expression = " ".join(terms)
        answer = safe_eval(expression, max_length=200, max_magnitude=10**40)
        question = f"What is {expression}? Answer with just the number."
        return CalculatorTask(question=question, expression=expression, answer=int(answer))

    def demonstration(self) -> list[ChatMessage]:
        return DEMONSTRATION if self.params.demonstration else []
