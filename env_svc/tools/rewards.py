"""Reward functions every tool environment can use: the final answer's number, and shaping
towards well-formed, useful calls.

A model that has never called a tool gets no reward from the answer alone until it does;
`tool_format` and `tool_use` give a small signal for calls that are well-formed and for calls
that returned a value. They read the episode's tool messages (what `tool_metrics` counts), so
they need no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from env_svc.envs.arithmetic import last_number
from env_svc.protocol import ChatMessage, Task, last_assistant_text
from env_svc.tools.calls import strip_tool_calls
from env_svc.tools.toolbox import tool_metrics


def final_number(completion: Sequence[ChatMessage]) -> Fraction | None:
    """The last number of the final turn, its tool calls removed (None: no number)."""
    return last_number(strip_tool_calls(last_assistant_text(completion)))


def tool_format(task: Task, completion: Sequence[ChatMessage]) -> float:
    """Share of tool calls that are well-formed (JSON, a known tool, fitting arguments); 0
    without any."""
    metrics = tool_metrics(completion)
    if not metrics["calls"]:
        return 0.0
    wrong = metrics["malformed"] + metrics["unknown_tool"] + metrics["bad_arguments"]
    return (metrics["calls"] - wrong) / metrics["calls"]


def tool_use(task: Task, completion: Sequence[ChatMessage]) -> float:
    """1 when some tool call returned a value (not an error)."""
    metrics = tool_metrics(completion)
    return float(metrics["calls"] > metrics["errors"])
