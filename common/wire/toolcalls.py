"""How a model's turn writes a tool call: the Hermes/Qwen format ChatML-family models have seen,

    <tool_call>{"name": "calculator", "arguments": {"expression": "47 * 86"}}</tool_call>

env_svc parses the calls of a turn with it (env_svc/tools/calls.py); the tenant API's episode
samples show them (marlaas/episodes.py). The closing tag is optional: a stop string or the
token limit may cut it off.
"""

from __future__ import annotations

import re

TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
"""One call block; group 1 is its body (JSON when well formed)."""
