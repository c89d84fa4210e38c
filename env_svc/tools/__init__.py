"""The tool layer: tools as documented functions, calls parsed and run, tool environments."""

from env_svc.tools.calls import ToolCall, parse_tool_calls, strip_tool_calls
from env_svc.tools.environment import (
    ToolEnvironment,
    ToolParams,
    format_call,
    hermes_system_prompt,
)
from env_svc.tools.tool import Tool, ToolArgumentsError, ToolDefinitionError
from env_svc.tools.toolbox import ToolBox, tool_metrics

__all__ = [
    "Tool",
    "ToolArgumentsError",
    "ToolBox",
    "ToolCall",
    "ToolDefinitionError",
    "ToolEnvironment",
    "ToolParams",
    "format_call",
    "hermes_system_prompt",
    "parse_tool_calls",
    "strip_tool_calls",
    "tool_metrics",
]
