"""MCP servers' tools (env_svc/mcp/): the example server (examples/mcp/units_server.py) over
stdio, as a job's environment sees it: listed in the prompt, called, checked, restarted."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from env_svc.mcp import hub
from env_svc.protocol import ChatMessage, EnvParamsError, Reward, Task
from env_svc.tools import ToolEnvironment, format_call, tool_metrics

SERVER = Path(__file__).parents[2] / "examples" / "mcp" / "units_server.py"


@pytest.fixture
def units_registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The operator registered the example server; a fresh hub per test."""
    servers = {"units": {"command": sys.executable, "args": [str(SERVER)]}}
    monkeypatch.setenv(hub.SERVERS_VAR, json.dumps(servers))
    hub._HUB = None
    yield
    if hub._HUB is not None:
        hub._HUB.close()
        hub._HUB = None


class Miles(ToolEnvironment[Task]):
    name = "miles"

    def sample_task(self, rng: random.Random) -> Task:
        return Task(question=f"How many km are {rng.randint(1, 9)} miles?")

    def make_rewards(self) -> list[Reward[Task]]:
        return [Reward("answered", answered)]


def answered(task: Task, completion: Sequence[ChatMessage]) -> float:
    return 1.0


def convert(**arguments: object) -> str:
    return format_call("units.convert", arguments)


def test_a_job_s_environment_calls_a_registered_server_s_tools(units_registered: None) -> None:
    env = Miles({"mcp_servers": ["units"]})
    state, messages = env.reset(env.task_for(0, 0))
    assert '"name": "units.convert"' in messages[0]["content"]  # its schema, from the server
    replies = env.step(
        state,
        convert(value=3, from_unit="mi", to_unit="km")
        + convert(value="three", from_unit="mi", to_unit="km")
        + convert(value=3, from_unit="mi", to_unit="parsec")
        + format_call("units.teleport", {}),
    ).messages
    said = [m["content"] for m in replies]
    assert said[0] == "4.82803"
    assert said[1] == "error: bad arguments: 'three' is not of type 'number' at ['value']"
    assert said[2].startswith("error: bad arguments: 'parsec' is not one of")
    assert said[3].startswith("error: unknown tool 'units.teleport'")
    assert tool_metrics(replies)["bad_arguments"] == 2


def test_a_tenant_names_only_servers_the_operator_registered(units_registered: None) -> None:
    with pytest.raises(EnvParamsError, match="unknown MCP server 'shell'; registered: units"):
        Miles({"mcp_servers": ["shell"]})


async def test_one_session_serves_many_calls_at_once_and_a_dead_server_comes_back(
    units_registered: None,
) -> None:
    env = await asyncio.to_thread(Miles, {"mcp_servers": ["units"]})
    tool = env.toolbox.tools["units.convert"]
    answers = await asyncio.gather(
        *(tool.fn(value=n, from_unit="km", to_unit="m") for n in range(1, 21))
    )
    assert answers == [f"{1000 * n:g}" for n in range(1, 21)]
    # The server process dies (killed, crashed): the next call fails, the one after works.
    session = hub.mcp_hub()._clients["units"]
    assert session is not None
    hub.mcp_hub()._drop("units")
    await asyncio.sleep(0.2)
    assert await tool.fn(value=1, from_unit="km", to_unit="m") == "1000"
