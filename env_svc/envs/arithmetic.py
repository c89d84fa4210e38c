"""`arithmetic`: single-turn integer arithmetic, "What is 7 + 5? Answer with just the number."

The untrained SmolLM2 is rarely exactly right (docs/architecture.md, "Facts measured on this
machine": replies are chatty, the last number is right ~19% of the time with operands 1-9), so
correctness is judged on the last number of the reply ("7 + 5 = 12" counts) and a small format
component rewards a bare number.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Annotated, Literal

from msgspec import Meta

from env_svc.protocol import (
    ChatMessage,
    Environment,
    EnvParams,
    Operand,
    Reward,
    Task,
    Weight,
    last_assistant_text,
)

Operation = Literal["+", "-", "*", "/"]

# A number not glued to a preceding digit or dot, so "5-3" reads as 5 and 3, not 5 and -3.
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_JUST_A_NUMBER = re.compile(r"\s*-?\d+\.?\s*")


MAX_DIGITS = 100
"""Longer numbers are no answer to a task here (and Python refuses to convert those past
4,300 digits: the reward would fail instead of scoring 0)."""


def last_number(text: str) -> Fraction | None:
    """The last number written in `text` ("1,234" and "12.0" included), or None (also for
    a number of more than `MAX_DIGITS` digits)."""
    matches = _NUMBER.findall(text)
    if not matches or len(matches[-1]) > MAX_DIGITS:
        return None
    return Fraction(matches[-1].replace(",", ""))


def is_just_a_number(text: str) -> bool:
    return _JUST_A_NUMBER.fullmatch(text) is not None


class ArithmeticParams(EnvParams, frozen=True):
    operations: Annotated[tuple[Operation, ...], Meta(min_length=1)] = ("+",)
    """Operators to draw from; `/` always divides exactly."""
    min_operand: Operand = 1
    max_operand: Operand = 9
    format_weight: Weight = 0.1
    """Weight of the "reply is just the number" component; 0 turns it off."""


class ArithmeticTask(Task, frozen=True):
    left: int
    operation: Operation
    right: int
    answer: int


class ArithmeticEnv(Environment[ArithmeticTask]):
    name = "arithmetic"
    params_type = ArithmeticParams
    task_type = ArithmeticTask
    params: ArithmeticParams

    def check_params(self) -> None:
        if self.params.min_operand > self.params.max_operand:
            raise self.bad_param("min_operand", "must not exceed max_operand")
        if "/" in self.params.operations and self.params.max_operand < 1:
            raise self.bad_param("max_operand", "division needs a positive operand to divide by")

    def make_rewards(self) -> list[Reward[ArithmeticTask]]:
        rewards = [Reward("correct", correct, 1.0)]
        if self.params.format_weight > 0:
            rewards.append(Reward("format", just_the_number, self.params.format_weight))
        return rewards

    def sample_task(self, rng: random.Random) -> ArithmeticTask:
        lo, hi = self.params.min_operand, self.params.max_operand
        operation = rng.choice(self.params.operations)
        left, right = rng.randint(lo, hi), rng.randint(lo, hi)
        if operation == "/":
            right = rng.randint(max(lo, 1), hi)
            left, answer = left * right, left  # the quotient is the drawn operand: exact
        else:
            answer = {"+": left + right, "-": left - right, "*": left * right}[operation]
        question = f"What is {left} {operation} {right}? Answer with just the number."
        return ArithmeticTask(
            question=question, left=left, operation=operation, right=right, answer=answer
        )


def correct(task: ArithmeticTask, completion: Sequence[ChatMessage]) -> float:
    """1 when the reply's last number is the answer."""
    return float(last_number(last_assistant_text(completion)) == task.answer)


def just_the_number(task: ArithmeticTask, completion: Sequence[ChatMessage]) -> float:
    """1 when the reply is a bare integer, right or wrong."""
    return float(is_just_a_number(last_assistant_text(completion)))
