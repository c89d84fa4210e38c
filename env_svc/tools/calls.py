"""Tool calls in a model's turn, in the Hermes/Qwen format ChatML-family models have seen:

    <tool_call>{"name": "calculator", "arguments": {"expression": "47 * 86"}}</tool_call>

One turn may hold several (the block's pattern: common/wire/toolcalls.py). The closing tag is
optional (a stop string or the token limit may cut it off). Every block is parsed or kept with
the reason it is malformed: the model is told why, and the count goes into the episode's tool
metrics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from common.wire.toolcalls import TOOL_CALL_BLOCK

MAX_CALL_CHARS = 4000
"""Longest call body parsed as JSON; a longer one is malformed (no parser time on it)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    """The tool named; "" when the call is malformed."""
    arguments: Any = field(default_factory=dict)
    """The arguments as written (checked against the tool's parameters later)."""
    malformed: str = ""
    """Why the block is not a call; "" for a well-formed one."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block in `text`, in order."""
    return [_parse(body.strip()) for body in TOOL_CALL_BLOCK.findall(text)]


def strip_tool_calls(text: str) -> str:
    """`text` without its tool-call blocks: what the turn says besides them."""
    return TOOL_CALL_BLOCK.sub("", text).strip()


def _parse(body: str) -> ToolCall:
    if len(body) > MAX_CALL_CHARS:
        return ToolCall("", malformed=f"tool call longer than {MAX_CALL_CHARS} characters")
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return ToolCall(
            "", malformed='tool call is not JSON like {"name": ..., "arguments": {...}}'
        )
    if not isinstance(payload, dict):
        return ToolCall("", malformed="tool call must be a JSON object")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", malformed='tool call has no "name"')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI style: the arguments as a JSON-encoded string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return ToolCall(name, malformed="arguments are not JSON")
    return ToolCall(name, arguments)
