"""`http_lookup`: a tool environment whose tool is a remote API reached over HTTP.

The model asks an inventory service how many units of a product are in stock with the
`lookup` tool, in the calculator's turn format (env_svc/envs/calculator.py: a Hermes
`<tool_call>`, the result in a tool message, then the bare number), and replies with the
number. The tool is an `async def` that GETs `$HTTP_LOOKUP_URL/stock?key=...` with httpx; the
service stands for a remote API or a sandbox that takes real time to answer. The module owns
both sides of that contract: the tool, and the service (`serve`, started by bench/agentic.py
in a process of its own), which answers after a set latency:

    python examples/envs/http_lookup.py --port 8765 --latency-s 1     # the service
    HTTP_LOOKUP_URL=http://127.0.0.1:8765 \\
    MARLAAS_ENVIRONMENTS=http_lookup=http_lookup:HttpLookupEnv         # env_svc, this folder
                                                                       # on its Python path

The stock of a product is a fixed function of its code (`stock_of`), so env_svc scores an
answer without asking the service; only a call returns it to the model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import string
import weakref
import zlib
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

import httpx
from msgspec import Meta

from env_svc.envs.number_answer import NumberTask, number_answer_rewards
from env_svc.protocol import ChatMessage, Reward, Weight
from env_svc.tools import Tool, ToolEnvironment, format_call
from env_svc.tools.environment import ToolParams
from env_svc.tools.toolbox import ERROR

URL_VAR = "HTTP_LOOKUP_URL"
"""The service's base URL, set by the operator for env_svc (not a job param: a tenant must not
point env_svc at an address of its choice)."""
STOCK_PATH = "/stock"
HEALTH_PATH = "/health"
"""Answers at once: the service is up."""
MAX_CONNECTIONS = 512
"""Calls open at once to the service per event loop; hundreds of episodes may wait on it."""


def stock_of(key: str) -> int:
    """Units in stock of product `key`: 100-999, a fixed function of the code."""
    return 100 + zlib.crc32(key.encode()) % 900


DEMO_KEY = "AB-1234"
DEMONSTRATION: list[ChatMessage] = [
    {
        "role": "user",
        "content": f"How many units of product {DEMO_KEY} are in stock? Answer with just the "
        "number.",
    },
    {"role": "assistant", "content": format_call("lookup", {"key": DEMO_KEY})},
    {"role": "tool", "content": str(stock_of(DEMO_KEY))},
    {"role": "assistant", "content": str(stock_of(DEMO_KEY))},
]
"""One worked exchange before the task, as the demo's calculator shows one: the base model
reinforced by RL only does what it samples."""

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
    weakref.WeakKeyDictionary()
)


def _http(timeout_s: float) -> httpx.AsyncClient:
    """One pooled client per event loop (env_svc's; `finish` runs a checker's on a loop of its
    own), so calls reuse their connections."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=64)
        # trust_env off: a proxy set for the host must not carry loopback calls.
        client = httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False)
        _clients[loop] = client
    return client


def lookup_tool(timeout_s: float) -> Tool:
    """The `lookup` tool, calling the service at `$HTTP_LOOKUP_URL`, within `timeout_s`."""

    async def lookup(key: str) -> str:
        """Ask the inventory service how many units of a product are in stock."""
        base_url = os.environ.get(URL_VAR)
        if not base_url:
            return f"{ERROR}the inventory service is not configured ({URL_VAR})"
        response = await _http(timeout_s).get(f"{base_url}{STOCK_PATH}", params={"key": key})
        if response.status_code != httpx.codes.OK:
            return f"{ERROR}the inventory service answered {response.status_code}"
        return response.text

    return Tool.of(lookup, timeout_s=timeout_s)


class HttpLookupParams(ToolParams, frozen=True):
    max_turns: Annotated[int, Meta(ge=2, le=8)] = 2
    """Model turns per episode: a call and the answer."""
    timeout_s: Annotated[float, Meta(gt=0, le=60)] = 30.0
    """A call's time limit, the service's latency included."""
    tool_format_weight: Weight = 0.1
    tool_use_weight: Weight = 0.1


class StockTask(NumberTask, frozen=True):
    key: str


class HttpLookupEnv(ToolEnvironment[StockTask]):
    name = "http_lookup"
    params_type = HttpLookupParams
    task_type = StockTask
    params: HttpLookupParams
    tools_intro = "You are a helpful assistant with an inventory lookup tool."
    tools_example: ClassVar[tuple[str, dict[str, Any]]] = ("lookup", {"key": "XY-9876"})
    tools_outro = (
        "The result comes back in a tool message. When you know the answer, reply with just "
        "the number."
    )
    max_calls_per_turn = 2

    @property
    def max_turns(self) -> int:
        return self.params.max_turns

    def make_tools(self) -> list[Tool | Callable[..., Any]]:
        return [lookup_tool(self.params.timeout_s)]

    def make_rewards(self) -> list[Reward[StockTask]]:
        return number_answer_rewards(self.params.tool_format_weight, self.params.tool_use_weight)

    def demonstration(self) -> list[ChatMessage]:
        return DEMONSTRATION

    def sample_task(self, rng: random.Random) -> StockTask:
        key = "".join(rng.choices(string.ascii_uppercase, k=2)) + f"-{rng.randint(1000, 9999)}"
        question = f"How many units of product {key} are in stock? Answer with just the number."
        return StockTask(question=question, key=key, answer=stock_of(key))


def serve(port: int, latency_s: float) -> None:
    """The inventory service on the loopback: `GET /stock?key=...` answers the stock after
    `latency_s`, every request on its own; `GET /health` at once."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def stock(request: Request) -> PlainTextResponse:
        await asyncio.sleep(latency_s)
        return PlainTextResponse(str(stock_of(request.query_params.get("key", ""))))

    async def health(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(STOCK_PATH, stock), Route(HEALTH_PATH, health)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the inventory service of `http_lookup`")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--latency-s", type=float, default=1.0, help="each answer's delay")
    arguments = parser.parse_args()
    serve(arguments.port, arguments.latency_s)
