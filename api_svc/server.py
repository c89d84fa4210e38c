"""The tenant API's app (its routes mounted over one operator-side client) and its server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from api_svc.limits import BodyLimit, TenantGate
from api_svc.routes import jobs, outputs, sample, tenant
from common.config import SharedSettings
from common.wire import TOO_DEEP
from console.client import MarlaasClient

log = logging.getLogger(__name__)


class ApiSettings(BaseSettings):
    """The tenant API server (`marlaas api`, `python -m api_svc`)."""

    model_config = SettingsConfigDict(env_prefix="MARLAAS_API_", extra="ignore")

    host: str = "127.0.0.1"
    """Address to listen on (compose: 0.0.0.0 inside the network)."""
    port: int = Field(default=8080, ge=0, le=65535)
    """Port; 0 picks a free one (logged, and written to stack.env by `marlaas up`)."""
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    """A request's body at most (a job spec is a few KiB); more is refused with 413."""
    requests_per_s: float = Field(default=20.0, gt=0)
    """Each tenant's sustained request rate, per API replica; more gets 429 + Retry-After."""
    burst: int = Field(default=40, ge=1)
    """Requests a tenant may make at once before the rate applies."""
    max_streams: int = Field(default=4, ge=1)
    """Long calls a tenant may have open at once, per API replica: event streams
    (`?follow=true`) and `sample`s (each holds a worker thread while the model answers)."""


def create_app(
    settings: SharedSettings,
    *,
    connect_timeout_s: float = 10.0,
    limits: ApiSettings | None = None,
) -> FastAPI:
    """The API over one operator-side client (opened for the app's lifetime), with the
    per-tenant limits of `limits` (api_svc/limits.py)."""
    limits = limits or ApiSettings()
    client = MarlaasClient(settings, connect_timeout_s=connect_timeout_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with client:
            yield

    app = FastAPI(
        title="MARLaaS tenant API",
        version="1",
        description="Submit, watch, control and export your RL jobs with your API key.",
        lifespan=lifespan,
    )
    app.state.client, app.state.settings = client, settings
    app.state.gate = TenantGate(limits.requests_per_s, limits.burst, limits.max_streams)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    # `sample` before `jobs`, whose `/{job_id}/{action}` would take "sample" for an action.
    for module in (tenant, sample, jobs, outputs):
        app.include_router(module.router)
    app.add_exception_handler(HTTPException, _error)  # type: ignore[arg-type]
    app.add_exception_handler(RecursionError, _too_deep)
    return app


async def _error(_: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)


async def _too_deep(_: Request, __: Exception) -> JSONResponse:
    """A body whose JSON nests past the parser's stack (`[[[[...`): the client's error."""
    return JSONResponse({"error": f"the body is not usable JSON: {TOO_DEEP}"}, status_code=400)


async def serve(
    settings: SharedSettings,
    api: ApiSettings,
    *,
    ready: Callable[[int], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until cancelled, signalled or `stop` is set; `ready(port)` once listening."""
    import uvicorn

    config = uvicorn.Config(
        create_app(settings, connect_timeout_s=settings.connect_timeout_s, limits=api),
        host=api.host,
        port=api.port,
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(), name="tenant-api")
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it (a port in use)
            return
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    log.info("tenant API on http://%s:%d/v1 (schema: /docs)", api.host, port)
    if ready is not None:
        ready(port)
    if stop is not None:
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        waiter.cancel()
    await task
