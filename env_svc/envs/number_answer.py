"""What the tool environments whose answer is a whole number share (`calculator`,
`code_tasks`): the task's `answer`, and their rewards: the exact answer at weight 1, plus the
shaping towards calls that are well-formed and calls that return a value
(env_svc/tools/rewards.py), which gives GRPO a signal before the first correct answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from env_svc.protocol import ChatMessage, Reward, Task
from env_svc.tools.rewards import final_number, tool_format, tool_use


class NumberTask(Task, frozen=True):
    answer: int


N = TypeVar("N", bound=NumberTask)


def correct(task: NumberTask, completion: Sequence[ChatMessage]) -> float:
    """1 when the last number of the final turn (tool calls removed) is the answer."""
    return float(final_number(completion) == task.answer)


def number_answer_rewards(tool_format_weight: float, tool_use_weight: float) -> list[Reward[N]]:
    """`correct` at weight 1, `tool_format` and `tool_use` at the params' weights."""
    return [
        Reward("correct", correct, 1.0),
        Reward("tool_format", tool_format, tool_format_weight),
        Reward("tool_use", tool_use, tool_use_weight),
    ]
