"""`code_tasks`: questions a small model cannot answer in its head but can with one line of
Python, run in the sandbox (env_svc/sandbox/) through the `python` tool.

    What is the sum of the digits of 7**23? Answer with just the number.
    <tool_call>{"name": "python", "arguments": {"code": "print(sum(map(int, str(7**23))))"}}
    </tool_call>
    -> tool: 86 -> "86"

Kinds (param `kinds`): `digit_sum` (of a power with 10-40 digits), `count_primes` (below n),
`letter_count` (of a letter in a random string). As with `calculator`, one worked exchange
is shown before the task and two shaped components reward well-formed calls and calls that
printed a value, so GRPO has signal before the first correct answer.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta

from env_svc.envs.number_answer import NumberTask, number_answer_rewards
from env_svc.protocol import ChatMessage, Reward, Weight
from env_svc.sandbox import SandboxLimits, python_tool
from env_svc.tools import Tool, ToolEnvironment, format_call
from env_svc.tools.environment import ToolParams

Kind = Literal["digit_sum", "count_primes", "letter_count"]

DEMONSTRATION: list[ChatMessage] = [
    {
        "role": "user",
        "content": "What is the sum of the digits of 2**15? Answer with just the number.",
    },
    {
        "role": "assistant",
        "content": format_call("python", {"code": "print(sum(int(d) for d in str(2**15)))"}),
    },
    {"role": "tool", "content": "26"},
    {"role": "assistant", "content": "26"},
]


class CodeTasksParams(ToolParams, frozen=True):
    kinds: Annotated[tuple[Kind, ...], Meta(min_length=1)] = ("digit_sum",)
    max_turns: Annotated[int, Meta(ge=2, le=8)] = 2
    """Model turns per episode: a call and the answer."""
    tool_format_weight: Weight = 0.1
    tool_use_weight: Weight = 0.1
    cpu_s: Annotated[int, Meta(ge=1, le=30)] = 2
    """The sandbox's CPU limit per call."""
    wall_s: Annotated[float, Meta(ge=1, le=60)] = 5.0
    """The sandbox's wall-clock limit per call."""


class CodeTask(NumberTask, frozen=True):
    kind: Kind


class CodeTasksEnv(ToolEnvironment[CodeTask]):
    name = "code_tasks"
    params_type = CodeTasksParams
    task_type = CodeTask
    params: CodeTasksParams
    tools_intro = "You are a helpful assistant with a Python tool."
    tools_example: ClassVar[tuple[str, dict[str, Any]]] = ("python", {"code": "print(12 * 34)"})
    tools_outro = (
        "The tool runs the code and returns what it prints. When you know the answer, reply "
        "with just the number."
    )
    max_calls_per_turn = 2

    @property
    def max_turns(self) -> int:
        return self.params.max_turns

    def make_tools(self) -> list[Tool | Callable[..., Any]]:
        limits = SandboxLimits(cpu_s=self.params.cpu_s, wall_s=self.params.wall_s)
        return [python_tool(limits)]

    def make_rewards(self) -> list[Reward[CodeTask]]:
        return number_answer_rewards(self.params.tool_format_weight, self.params.tool_use_weight)

    def demonstration(self) -> list[ChatMessage]:
        return DEMONSTRATION

    def sample_task(self, rng: random.Random) -> CodeTask:
        kind = rng.choice(self.params.kinds)
        suffix = " Answer with just the number."
        if kind == "digit_sum":
            base, power = rng.randint(3, 9), rng.randint(12, 40)
            answer = sum(int(d) for d in str(base**power))
            question = f"What is the sum of the digits of {base}**{power}?"
        elif kind == "count_primes":
            below = rng.randint(100, 3000)
            answer = sum(_prime(n) for n in range(2, below))
            question = f"How many prime numbers are there below {below}?"
        else:
            letter = rng.choice("aeiou")
            text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(30, 50)))
            answer = text.count(letter)
            question = f"How many times does the letter '{letter}' appear in '{text}'?"
        return CodeTask(question=question + suffix, kind=kind, answer=answer)


def _prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))
