"""MCP servers' tools for tool environments: one session per server per env_svc process.

The operator registers servers (`MARLAAS_MCP_SERVERS`, JSON: `{"units": {"command": "python",
"args": ["examples/mcp/units_server.py"], "env": {...}, "cwd": "..."}}`, stdio transport); a
job names the ones its environment uses (`mcp_servers` param) and never a command. env_svc
starts a server the first time a job needs it and keeps the session for the process's life
(a crashed server is started again at the next call), rather than a process per call.

The `mcp` SDK's client is async and its sessions live in anyio task groups, which must be
entered and left by one task; so the sessions run on a loop of their own, in a thread, and
env_svc's loop (or a worker thread building an environment) hands them calls. A tool appears
to the model as `<server>.<tool>`, with the server's own JSON schema, against which every
call's arguments are checked before it is sent.

Only stateless tools are supported: a server's state lives in the one replica's process that
called it, and an episode's next turn may be served by another replica (nothing keys the
server's state by episode).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import msgspec

from env_svc.tools.tool import Tool
from env_svc.tools.toolbox import ERROR

SERVERS_VAR = "MARLAAS_MCP_SERVERS"
START_TIMEOUT_S = 30.0
T = TypeVar("T")


class McpServer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    command: str
    args: list[str] = []
    env: dict[str, str] = {}
    cwd: str | None = None


class McpError(RuntimeError):
    """A registered server that cannot be started or listed (the job is rejected)."""


def registered_servers() -> dict[str, McpServer]:
    """The operator's servers, from `MARLAAS_MCP_SERVERS`."""
    raw = os.environ.get(SERVERS_VAR, "").strip()
    if not raw:
        return {}
    try:
        return msgspec.json.decode(raw, type=dict[str, McpServer])
    except msgspec.DecodeError as exc:
        raise McpError(f"{SERVERS_VAR} is not a map of servers: {exc}") from None


class McpHub:
    """This process's sessions, on their own loop thread."""

    def __init__(self, servers: dict[str, McpServer]) -> None:
        self.servers = servers
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp", daemon=True)
        self._thread.start()
        self._clients: dict[str, Any] = {}
        self._stops: dict[str, asyncio.Event] = {}
        self._lock = asyncio.Lock()  # used on the hub's loop only

    def tools(self, server: str, *, timeout_s: float = 10.0) -> list[Tool]:
        """The server's tools as the tool layer's (blocking: call it from a worker thread or
        synchronous code, never from an event loop)."""
        if server not in self.servers:
            known = ", ".join(sorted(self.servers)) or "none"
            raise McpError(f"unknown MCP server {server!r}; registered: {known}")
        listed = self._run(self._list(server)).result(START_TIMEOUT_S)
        return [
            Tool(
                name=f"{server}.{tool.name}",
                description=tool.description or "",
                parameters=dict(tool.input_schema),
                fn=self._caller(server, tool.name),
                timeout_s=timeout_s,
            )
            for tool in listed
        ]

    def close(self, timeout_s: float = 5.0) -> None:
        """End every session (its server process with it), waiting up to `timeout_s`, then
        the hub's loop (blocking: from a worker thread or synchronous code)."""
        try:
            self._run(self._close()).result(timeout_s)
        except TimeoutError:
            pass  # the servers see their stdin close when this process exits
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _close(self) -> None:
        for stop in self._stops.values():
            stop.set()
        serving = [t for t in asyncio.all_tasks() if t.get_name().startswith("mcp-")]
        await asyncio.gather(*serving, return_exceptions=True)

    def _caller(self, server: str, name: str) -> Any:
        async def call(**arguments: Any) -> str:
            return await asyncio.wrap_future(self._run(self._call(server, name, arguments)))

        call.__name__ = name
        return call

    def _run(self, work: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(work, self._loop)

    async def _list(self, server: str) -> list[Any]:
        client = await self._client(server)
        return list((await client.list_tools()).tools)

    async def _call(self, server: str, name: str, arguments: dict[str, Any]) -> str:
        client = await self._client(server)
        try:
            result = await client.call_tool(name, arguments)
        except Exception:
            self._drop(server)  # started again at the next call
            raise
        text = "\n".join(
            getattr(block, "text", json.dumps(block.model_dump())) for block in result.content
        )
        return f"{ERROR}{text}" if result.is_error else text

    async def _client(self, server: str) -> Any:
        async with self._lock:
            if server not in self._clients:
                ready: asyncio.Future[Any] = self._loop.create_future()
                self._stops[server] = asyncio.Event()
                self._loop.create_task(self._serve(server, ready), name=f"mcp-{server}")
                try:
                    self._clients[server] = await asyncio.wait_for(ready, START_TIMEOUT_S)
                except Exception as exc:
                    self._drop(server)
                    raise McpError(f"MCP server {server!r} did not start: {exc!r}") from exc
            return self._clients[server]

    async def _serve(self, server: str, ready: asyncio.Future[Any]) -> None:
        """Hold the server's session open (one task enters and leaves it) until stopped."""
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client

        spec = self.servers[server]
        parameters = StdioServerParameters(
            command=spec.command, args=spec.args, env=spec.env or None, cwd=spec.cwd
        )
        try:
            # A transport, not the parameters: mcp 2.0 (verifiers' pin) takes no parameters.
            async with Client(stdio_client(parameters)) as client:
                ready.set_result(client)
                await self._stops[server].wait()
        except Exception as exc:
            if not ready.done():
                ready.set_exception(exc)
        finally:
            self._clients.pop(server, None)

    def _drop(self, server: str) -> None:
        self._clients.pop(server, None)
        if (stop := self._stops.pop(server, None)) is not None:
            stop.set()


_HUB: McpHub | None = None
_HUB_LOCK = threading.Lock()


def close_mcp_hub() -> None:
    """End this process's sessions, if any were opened (at env_svc's stop)."""
    global _HUB
    with _HUB_LOCK:
        hub, _HUB = _HUB, None
    if hub is not None:
        hub.close()


def mcp_hub() -> McpHub:
    """This process's hub of the registered servers."""
    global _HUB
    with _HUB_LOCK:
        if _HUB is None:
            _HUB = McpHub(registered_servers())
        return _HUB
