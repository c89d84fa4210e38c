"""Runs a turn's tool calls: look-up, argument checks, all calls at once, each in its limit.

Every call gets one `tool` message, in the order of the calls: the tool's answer, or
`error: ...` saying what went wrong, for the model to read and do better. Nothing a call does
ends the episode or reaches env_svc: a tool that raises, hangs past its `timeout_s` or is
called with bad arguments is answered like any other. `async def` tools are awaited (and
cancelled at their limit); plain ones run in worker threads (the event loop's default
executor: env_svc sets it to its environment workers), abandoned at their limit.

The errors' texts start with fixed words (`ERROR_KINDS`), so what a finished episode's
tool messages say is also what its metrics count (`tool_metrics`): the state that travels
between replicas needs nothing more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from env_svc.protocol import ChatMessage
from env_svc.tools.calls import ToolCall, parse_tool_calls
from env_svc.tools.tool import Tool, ToolArgumentsError, reply_text

ERROR = "error: "
MAX_REPLY_CHARS = 8000
"""A tool's answer is cut to this many characters (the model's context is short)."""
ERROR_KINDS: dict[str, str] = {
    "malformed": f"{ERROR}malformed tool call: ",
    "unknown_tool": f"{ERROR}unknown tool ",
    "bad_arguments": f"{ERROR}bad arguments: ",
    "timeout": f"{ERROR}no answer after ",
    "over_limit": f"{ERROR}at most ",
}
"""How each kind of failed call's message begins; any other `error: ` is the tool's own."""


class ToolBox:
    """The tools of an environment, by name."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]], *, max_calls_per_turn: int):
        self.tools = {tool.name: tool for tool in map(_as_tool, tools)}
        if not self.tools:
            raise ValueError("a tool box needs at least one tool")
        self.max_calls_per_turn = max_calls_per_turn

    async def replies(self, text: str) -> list[ChatMessage] | None:
        """The tool messages answering the calls in a model's turn; None when it has none
        (the turn is a final answer)."""
        calls = parse_tool_calls(text)
        if not calls:
            return None
        answers = await asyncio.gather(
            *(
                self.call(call)
                if number < self.max_calls_per_turn
                else _said(f"{ERROR_KINDS['over_limit']}{self.max_calls_per_turn} calls per turn")
                for number, call in enumerate(calls)
            )
        )
        return [{"role": "tool", "content": answer} for answer in answers]

    async def call(self, call: ToolCall) -> str:
        """The text of the tool message answering `call`."""
        if call.malformed:
            return f"{ERROR_KINDS['malformed']}{call.malformed}"
        tool = self.tools.get(call.name)
        if tool is None:
            names = ", ".join(sorted(self.tools))
            return f"{ERROR_KINDS['unknown_tool']}{call.name[:100]!r}; the tools are: {names}"
        try:
            arguments = tool.arguments(call.arguments)
        except ToolArgumentsError as exc:
            return f"{ERROR}{exc}"
        try:
            async with asyncio.timeout(tool.timeout_s):
                if tool.awaits:
                    value = await tool.fn(**arguments)
                else:
                    value = await asyncio.to_thread(tool.fn, **arguments)
        except TimeoutError:
            return f"{ERROR_KINDS['timeout']}{tool.timeout_s:g}s"
        except Exception as exc:
            return f"{ERROR}{type(exc).__name__}: {exc}"[:MAX_REPLY_CHARS]
        return reply_text(value)[:MAX_REPLY_CHARS]


def tool_metrics(completion: Sequence[ChatMessage]) -> dict[str, float]:
    """What an episode's tool messages say: calls, errors, and errors of each kind."""
    replies = [m["content"] for m in completion if m["role"] == "tool"]
    errors = [reply for reply in replies if reply.startswith(ERROR)]
    metrics = {"calls": float(len(replies)), "errors": float(len(errors))}
    for kind, start in ERROR_KINDS.items():
        metrics[kind] = float(sum(error.startswith(start) for error in errors))
    metrics["tool_error"] = metrics["errors"] - sum(metrics[kind] for kind in ERROR_KINDS)
    return metrics


async def _said(text: str) -> str:
    return text


def _as_tool(tool: Tool | Callable[..., Any]) -> Tool:
    return tool if isinstance(tool, Tool) else Tool.of(tool)
