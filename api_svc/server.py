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

from api_svc.limits import AddressGate, BodyLimit, TenantGate
from api_svc.routes import jobs, openai_api, outputs, sample, tenant, usage
from api_svc.web import routes as web
from common.runtime.config import SharedSettings
from common.wire.codec import TOO_DEEP
from marlaas import Client, ReadersBusy

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
    max_reads: int = Field(default=2, ge=1)
    """Event reads, reports and exports a tenant may have running at once, per API replica
    (each holds one of the replica's `readers` or a scratch copy of an adapter); more: 429."""
    readers: int = Field(default=8, ge=1)
    """Kafka consumers the replica keeps for event reads and reports (no consumer group,
    nothing committed), each lent to one read at a time: at most that many run at once."""
    reader_wait_s: float = Field(default=5.0, gt=0)
    """How long a read waits for a free reader; then 503 with Retry-After."""
    anonymous_requests_per_s: float = Field(default=2.0, gt=0)
    """Sustained rate, per client address, of requests no valid key authenticates (no key,
    a refused key, the schema pages); more gets 429 before any key is looked up."""
    anonymous_burst: int = Field(default=20, ge=1)
    """Such requests an address may make at once before that rate applies."""
    forwarded_allow_ips: str = "127.0.0.1,::1"
    """Proxies trusted to name the client in X-Forwarded-For (comma-separated addresses or
    networks, "*" for any): the address the anonymous rate is kept for. Behind a balancer,
    name it; otherwise every client shares the balancer's address (valid keys are exempt)."""


def create_app(
    settings: SharedSettings,
    *,
    connect_timeout_s: float = 10.0,
    limits: ApiSettings | None = None,
) -> FastAPI:
    """The API over one operator-side client (opened for the app's lifetime), with the
    per-tenant limits of `limits` (api_svc/limits.py)."""
    limits = limits or ApiSettings()
    client = Client(
        settings,
        connect_timeout_s=connect_timeout_s,
        readers=limits.readers,
        reader_wait_s=limits.reader_wait_s,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with client:
            await client.start_producer()  # one for every submission and command
            yield

    app = FastAPI(
        title="MARLaaS tenant API",
        version="1",
        description="Submit, watch, control and export your RL jobs with your API key.",
        lifespan=lifespan,
    )
    app.state.client, app.state.settings = client, settings
    app.state.gate = TenantGate(
        limits.requests_per_s, limits.burst, limits.max_streams, limits.max_reads
    )
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(  # outermost: a flooding address is refused before anything else
        AddressGate, rate_per_s=limits.anonymous_requests_per_s, burst=limits.anonymous_burst
    )
    # `sample` before `jobs`, whose `/{job_id}/{action}` would take "sample" for an action.
    for module in (tenant, sample, jobs, outputs, openai_api, usage, web):
        app.include_router(module.router)
    app.add_exception_handler(HTTPException, _error)  # type: ignore[arg-type]
    app.add_exception_handler(RecursionError, _too_deep)
    app.add_exception_handler(ReadersBusy, _busy)
    return app


async def _error(_: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)


async def _too_deep(_: Request, __: Exception) -> JSONResponse:
    """A body whose JSON nests past the parser's stack (`[[[[...`): the client's error."""
    return JSONResponse({"error": f"the body is not usable JSON: {TOO_DEEP}"}, status_code=400)


async def _busy(_: Request, exc: Exception) -> JSONResponse:
    """Every reader of this replica is lent out: the server's limit, not the tenant's."""
    return JSONResponse({"error": str(exc)}, status_code=503, headers={"Retry-After": "1"})


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
        forwarded_allow_ips=api.forwarded_allow_ips,
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
