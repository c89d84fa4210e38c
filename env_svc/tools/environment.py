"""`ToolEnvironment`: an environment whose model may call tools before it answers.

A subclass declares its tools (plain or `async def` functions, or `Tool`s) and the words
around the tool list; the layer does the rest: the tool list (the chat template's `tools=`
where the template renders them in the Hermes/Qwen format, as Qwen's do; in the system prompt
in that format for templates that take no `tools=`, as SmolLM2's), parsing one or several calls per
turn, argument checks, running the calls at once with their time limits, the `tool`
messages (masked out of the loss by the episode driver), and the episode's end on a turn
without a call (the final answer) or at `max_turns` (or the job's token limit). Every
episode's reward also records, at weight 0, what its calls did (`tools.calls`,
`tools.errors`, `tools.malformed`, ...): the trainer's step events carry their means.

    class WordCount(ToolEnvironment[WordTask]):
        name = "word_count"
        task_type = WordTask
        tools = (count_words,)
        ...

docs/environments.md walks through a whole one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from common.wire.lifecycle import TOOL_METRICS
from env_svc.protocol import (
    ChatMessage,
    Environment,
    EnvParams,
    EpisodeState,
    Reward,
    Task,
    UnregisteredHereError,
)
from env_svc.tools.tool import Tool
from env_svc.tools.toolbox import ToolBox, tool_metrics

T = TypeVar("T", bound=Task)


def format_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as the model is asked to write it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': dict(arguments)})}</tool_call>"


def hermes_system_prompt(
    tools: Sequence[Tool], *, intro: str, example: tuple[str, Mapping[str, Any]], outro: str
) -> str:
    """The tool list and how to call them, in a system prompt (Hermes/Qwen format)."""
    listed = "\n".join(json.dumps(tool.schema()) for tool in tools)
    how = "To use it" if len(tools) == 1 else "To use one"
    return "\n".join(
        [
            intro,
            f"<tools>\n{listed}\n</tools>",
            f"{how}, reply with only:",
            format_call(*example),
            outro,
        ]
    )


class ToolParams(EnvParams, frozen=True):
    """Params every tool environment takes (its own params subclass these)."""

    mcp_servers: tuple[str, ...] = ()
    """MCP servers, of those the operator registered, whose tools the model may call too
    (as `<server>.<tool>`; env_svc/mcp/)."""


class ToolEnvironment(Environment[T]):
    """Subclasses set `tools`, `tools_intro`, `tools_example` and `tools_outro` (or override
    `make_tools` for tools that depend on params), and the task and rewards as any
    environment does; `demonstration` may show a worked exchange before the task. Params
    that subclass `ToolParams` add the tools of registered MCP servers (`mcp_servers`)."""

    params_type: ClassVar[type[EnvParams]] = ToolParams

    tools: ClassVar[Sequence[Tool | Callable[..., Any]]] = ()
    tools_intro: ClassVar[str] = "You are a helpful assistant with tools."
    tools_example: ClassVar[tuple[str, Mapping[str, Any]] | None] = None
    """A call shown in the system prompt: (tool name, arguments). Default: none shown."""
    tools_outro: ClassVar[str] = (
        "Each result comes back in a tool message. When you know the answer, reply with it."
    )
    max_calls_per_turn: ClassVar[int] = 4
    """Calls beyond this in one turn are answered with an error, not run."""

    def __init__(
        self, params: Mapping[str, Any] | None = None, *, data_dir: Path | None = None
    ) -> None:
        super().__init__(params, data_dir=data_dir)
        tools = [*self.make_tools(), *self._mcp_tools()]
        if not tools:
            raise self.bad_param("mcp_servers", "no tools: name a registered MCP server")
        self.toolbox = ToolBox(tools, max_calls_per_turn=self.max_calls_per_turn)
        self.rewards.append(Reward(TOOL_METRICS, _tool_metrics, 0.0))

    def make_tools(self) -> list[Tool | Callable[..., Any]]:
        return list(self.tools)

    @property
    def max_turns(self) -> int:
        """Model turns per episode, calls and the final answer together (3: a call, a second
        call or the answer, the answer)."""
        return 3

    def _mcp_tools(self) -> list[Tool]:
        from env_svc.mcp import McpError, mcp_hub

        tools: list[Tool] = []
        for server in getattr(self.params, "mcp_servers", ()):
            try:
                tools += mcp_hub().tools(server)
            except McpError as exc:
                if not mcp_hub().servers:  # none registered in this process
                    raise UnregisteredHereError(self.name, "mcp_servers", str(exc)) from None
                raise self.bad_param("mcp_servers", str(exc)) from None
        return tools

    def system_prompt(self) -> str:
        """The tools in the Hermes/Qwen format, between `tools_intro` and `tools_outro`; where
        the chat template renders the tools itself (`template_takes_tools`), only those words
        around them."""
        if self.template_takes_tools:
            return f"{self.tools_intro}\n{self.tools_outro}"
        tools = list(self.toolbox.tools.values())
        example = self.tools_example or (tools[0].name, {})
        return hermes_system_prompt(
            tools, intro=self.tools_intro, example=example, outro=self.tools_outro
        )

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.template_takes_tools:
            return None
        return [tool.schema() for tool in self.toolbox.tools.values()]

    def demonstration(self) -> list[ChatMessage]:
        """Messages shown between the system prompt and the task (a worked exchange)."""
        return []

    def initial_messages(self, task: T) -> list[ChatMessage]:
        return [
            {"role": "system", "content": self.system_prompt()},
            *self.demonstration(),
            {"role": "user", "content": task.question},
        ]

    async def respond(self, state: EpisodeState[T], action_text: str) -> list[ChatMessage] | None:
        return await self.toolbox.replies(action_text)


def _tool_metrics(task: Task, completion: Sequence[ChatMessage]) -> Mapping[str, float]:
    return tool_metrics(completion)
