"""`countdown`: reach a target from given numbers (Countdown, as in TinyZero).

"Using the numbers [3, 7, 2], write an expression that equals 23." The answer expression, in
`<answer>...</answer>` tags (else the reply's last line), is parsed with the safe evaluator;
it is correct when it uses only given numbers, each at most once, and equals the target.
Tasks are solvable by construction: the target is the value of a random expression over the
numbers, whose text is kept as `solution`.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Annotated, Literal

from msgspec import Meta

from env_svc.protocol import (
    ChatMessage,
    Environment,
    EnvParams,
    Reward,
    Task,
    Weight,
    last_assistant_text,
)
from env_svc.safe_eval import Evaluation, Number, SafeEvalError, evaluate

Operation = Literal["+", "-", "*", "/"]
ANSWER_OPERATORS = frozenset({"+", "-", "*", "/"})
"""Operators an answer may use: the classic four, no unary minus or powers."""

MAX_ATTEMPTS = 1000
"""Random expressions tried per task before the params are declared unworkable."""

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class CountdownParams(EnvParams, frozen=True):
    num_numbers: Annotated[int, Meta(ge=2, le=6)] = 3
    min_number: Annotated[int, Meta(ge=1, le=1000)] = 1
    max_number: Annotated[int, Meta(ge=1, le=1000)] = 10
    max_target: Annotated[int, Meta(ge=1, le=10**6)] = 100
    """Targets lie in 1..max_target."""
    operations: Annotated[tuple[Operation, ...], Meta(min_length=1)] = ("+", "-", "*", "/")
    """Operators the generated solution may use (answers may always use all four)."""
    format_weight: Weight = 0.1
    """Weight of "an expression that parses, inside <answer> tags"; 0 turns it off."""


class CountdownTask(Task, frozen=True):
    numbers: list[int]
    target: int
    solution: str
    """One expression that reaches the target (for inspection; never shown to the model)."""


class CountdownEnv(Environment[CountdownTask]):
    name = "countdown"
    params_type = CountdownParams
    task_type = CountdownTask
    params: CountdownParams

    def check_params(self) -> None:
        if self.params.min_number > self.params.max_number:
            raise self.bad_param("min_number", "must not exceed max_number")

    def make_rewards(self) -> list[Reward[CountdownTask]]:
        rewards = [Reward("correct", correct, 1.0)]
        if self.params.format_weight > 0:
            rewards.append(Reward("format", answer_format, self.params.format_weight))
        return rewards

    def sample_task(self, rng: random.Random) -> CountdownTask:
        p = self.params
        for _ in range(MAX_ATTEMPTS):
            numbers = [rng.randint(p.min_number, p.max_number) for _ in range(p.num_numbers)]
            built = _random_expression(numbers, p.operations, rng)
            if built is not None and 1 <= built[1] <= p.max_target:
                solution, target = built
                question = (
                    f"Using the numbers {numbers}, write an expression that equals {target}. "
                    "Use + - * / and parentheses; use each number at most once. "
                    "Put the expression in <answer></answer> tags, "
                    "for example <answer>(1 + 2) * 3</answer>."
                )
                return CountdownTask(
                    question=question, numbers=numbers, target=target, solution=solution
                )
        raise RuntimeError(f"countdown: no target in 1..{p.max_target} after {MAX_ATTEMPTS} tries")


def _random_expression(
    numbers: list[int], operations: Sequence[Operation], rng: random.Random
) -> tuple[str, int] | None:
    """Combine all `numbers` in a random order and tree; None if a step leaves the positive
    integers (the classic rules), so that every intermediate value is a whole number."""
    terms: list[tuple[str, int]] = [(str(n), n) for n in numbers]
    while len(terms) > 1:
        left = terms.pop(rng.randrange(len(terms)))
        right = terms.pop(rng.randrange(len(terms)))
        operation = rng.choice(operations)
        a, b = Fraction(left[1]), right[1]
        combined = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[operation]
        if combined <= 0 or combined.denominator != 1:
            return None
        terms.append((f"({left[0]} {operation} {right[0]})", int(combined)))
    text, value = terms[0]
    return (text[1:-1] if text.startswith("(") else text), value


def answer_text(reply: str) -> tuple[str, bool]:
    """The answer expression and whether it was in `<answer>` tags. Without tags, the last
    non-empty line. Anything after `=` is dropped, so "(1 + 2) * 3 = 9" reads as the left side."""
    tagged = _ANSWER.findall(reply)
    if tagged:
        text = tagged[-1]
    else:
        lines = [line for line in reply.splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    return text.split("=")[0].strip(), bool(tagged)


def parse_answer(reply: str) -> Evaluation | None:
    try:
        return evaluate(answer_text(reply)[0], operators=ANSWER_OPERATORS)
    except SafeEvalError:
        return None


def correct(task: CountdownTask, completion: Sequence[ChatMessage]) -> float:
    """1 when the answer uses only given numbers, each at most once, and equals the target."""
    parsed = parse_answer(last_assistant_text(completion))
    if parsed is None or parsed.value != task.target:
        return 0.0
    used, given = Counter(parsed.literals), Counter[Number](task.numbers)
    return float(all(count <= given[number] for number, count in used.items()))


def answer_format(task: CountdownTask, completion: Sequence[ChatMessage]) -> float:
    """1 when the reply has `<answer>` tags around an expression that parses."""
    reply = last_assistant_text(completion)
    return float(answer_text(reply)[1] and parse_answer(reply) is not None)
