"""The tenant API: what a tenant does with MARLaaS, over HTTP, with an API key.

Tenants never hold Kafka or Redis credentials. They present `Authorization: Bearer <key>`
(`marlaas tenants add NAME` issues one); the API finds the tenant from the key
(common/tenants.py), and every job command and read checks that the job is that tenant's:
another tenant's job is answered exactly like one that does not exist (404), so a key
reveals nothing of other tenants. Submissions are stamped with the key's tenant, bound to it
(`owner:{job}`) before they are produced to `marlaas.jobs`, and checked against the tenant's
limits; env_svc checks the limits again, atomically, where the job is accepted. The API
talks to Kafka and Redis with its own credentials (common/access.py, principal `api`).

    marlaas api                  # serves on MARLAAS_API_HOST:MARLAAS_API_PORT
    GET  /docs, /openapi.json    # the schema (FastAPI)

Endpoints (all under /v1, all authenticated): `GET tenant`, `GET jobs`, `POST jobs`,
`GET jobs/{job}`, `POST jobs/{job}/{pause|resume|cancel}`, `GET jobs/{job}/events`
(`?follow=true`: NDJSON until the job ends), `GET jobs/{job}/export` (the adapter as a
.tar.gz PEFT directory), `GET report?job=...` (.tar.gz of the HTML report),
`POST jobs/{job}/sample` (a chat completion with the job's adapter).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.config import SharedSettings, load
from common.jobspec import JobSpecError, validate_job
from common.lifecycle import TERMINAL_STATES
from common.messages import JobAction, JobSpec, MessageDecodeError, Topic, new_id
from common.store import JobRecord
from common.tenants import TenantLimits, count_problem, samples_in_flight
from common.wire import decode, json_schema
from console.chat_client import ChatFailed, chat_completion
from console.client import JobStateError, MarlaasClient

log = logging.getLogger(__name__)

T = TypeVar("T")


class ApiSettings(BaseSettings):
    """The tenant API server (`marlaas api`)."""

    model_config = SettingsConfigDict(env_prefix="MARLAAS_API_", extra="ignore")

    host: str = "127.0.0.1"
    """Address to listen on (compose: 0.0.0.0 inside the network)."""
    port: int = Field(default=8080, ge=0, le=65535)
    """Port; 0 picks a free one (logged, and written to stack.env by `marlaas up`)."""


class TenantView(BaseModel):
    tenant: str
    limits: dict[str, int]
    jobs: list[str]


class JobView(BaseModel):
    job_id: str
    tenant: str
    status: str
    """`submitted` until env_svc has accepted (or rejected) it, then its lifecycle state."""
    reason: str = ""
    version: int = 0
    """The newest trained adapter version (the job's step)."""
    env: str = ""
    max_steps: int = 0
    samples_in_flight: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0


class Submitted(BaseModel):
    job_id: str
    tenant: str


class CommandDone(BaseModel):
    job_id: str
    status: str


class SampleRequest(BaseModel):
    prompt: str
    version: int | None = None
    max_tokens: int = Field(default=64, ge=1, le=1024)
    temperature: float = Field(default=0.0, ge=0.0)


class SampleAnswer(BaseModel):
    model: str
    content: str


async def _tenant_of(request: Request) -> str:
    """The tenant of the request's API key; 401 without a valid one."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("no API key: send `Authorization: Bearer <key>`")
    client: MarlaasClient = request.app.state.client
    tenant = await client.store.tenants.authenticate(token.strip())
    if tenant is None:
        raise _unauthorized("API key not valid (unknown, revoked, or its tenant revoked)")
    return tenant


Tenant = Annotated[str, Depends(_tenant_of)]


def create_app(settings: SharedSettings, *, connect_timeout_s: float = 10.0) -> FastAPI:
    """The API over one operator-side client (opened for the app's lifetime)."""
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
    app.state.client = client

    async def owned(job_id: str, tenant: str) -> JobRecord | None:
        """The tenant's job (None: bound to it but not registered yet); 404 otherwise."""
        if await client.store.owner(job_id) != tenant:
            raise HTTPException(404, f"no job {job_id!r} of tenant {tenant!r}")
        record = await client.store.job(job_id)
        if record is not None and record.spec.tenant != tenant:  # registered by the operator
            raise HTTPException(404, f"no job {job_id!r} of tenant {tenant!r}")
        return record

    async def registered(job_id: str, tenant: str) -> JobRecord:
        if (record := await owned(job_id, tenant)) is None:
            raise HTTPException(409, f"job {job_id!r} is not accepted yet (or was rejected)")
        return record

    async def view_of(record: JobRecord) -> JobView:
        pointer = await client.store.adapter(record.spec.job_id)
        return _view(record, pointer.version if pointer else 0)

    @app.get("/v1/tenant", response_model=TenantView)
    async def whoami(tenant: Tenant) -> TenantView:
        limits = await client.store.tenants.limits(tenant) or TenantLimits()
        return TenantView(
            tenant=tenant,
            limits=msgspec.structs.asdict(limits),
            jobs=await client.store.tenant_job_ids(tenant),
        )

    @app.get("/v1/schema/job")
    async def job_schema(tenant: Tenant) -> dict[str, Any]:
        """The JSON Schema of a job spec (`tenant` may be left out: the key's is used)."""
        return json_schema(Topic.JOBS)

    @app.post("/v1/jobs", status_code=202, response_model=Submitted)
    async def submit(request: Request, tenant: Tenant) -> Submitted:
        spec = await _spec_of(request, tenant)
        limits = await client.store.tenants.limits(tenant)
        try:
            validate_job(
                spec,
                base_model=settings.base_model,
                max_lora_rank=settings.max_lora_rank,
                lora_target_modules=settings.lora_target_modules,
                limits=limits,
            )
        except JobSpecError as exc:
            raise HTTPException(422, str(exc)) from None
        if limits is not None:
            live = [
                record
                for job_id in await client.store.tenant_job_ids(tenant)
                if (record := await client.store.job(job_id)) is not None
                and record.status not in TERMINAL_STATES
            ]
            busy = sum(samples_in_flight(r.spec) for r in live)
            if (problem := count_problem(spec, limits, len(live), busy)) is not None:
                raise HTTPException(429, problem)
        # Taken: bound to anyone already, this tenant included (a resubmitted id).
        if await client.store.owner(spec.job_id) is not None or (
            await client.store.bind_owner(spec.job_id, tenant) != tenant
        ):
            raise HTTPException(409, f"job id {spec.job_id!r} is taken; leave job_id out")
        await client.submit([spec])
        log.info("tenant %s submitted job %s", tenant, spec.job_id)
        return Submitted(job_id=spec.job_id, tenant=tenant)

    @app.get("/v1/jobs", response_model=list[JobView])
    async def jobs(tenant: Tenant) -> list[JobView]:
        views = []
        for job_id in await client.store.tenant_job_ids(tenant):
            if (record := await client.store.job(job_id)) is not None:
                views.append(await view_of(record))
        return views

    @app.get("/v1/jobs/{job_id}", response_model=JobView)
    async def job(job_id: str, tenant: Tenant) -> JobView:
        record = await owned(job_id, tenant)
        if record is not None:
            return await view_of(record)
        if (reason := await client.store.rejection(job_id)) is not None:
            return JobView(job_id=job_id, tenant=tenant, status="rejected", reason=reason)
        return JobView(job_id=job_id, tenant=tenant, status="submitted")

    # Before `{action}`, which would take "sample" for an action.
    @app.post("/v1/jobs/{job_id}/sample", response_model=SampleAnswer)
    async def sample(job_id: str, ask: SampleRequest, tenant: Tenant) -> SampleAnswer:
        await registered(job_id, tenant)
        if not settings.chat_url:
            raise HTTPException(503, "no rollout chat endpoint configured (MARLAAS_CHAT_URL)")
        model = job_id if ask.version is None else f"{job_id}@v{ask.version}"
        return await asyncio.to_thread(_chat, settings.chat_url, model, ask)

    @app.post("/v1/jobs/{job_id}/{action}", response_model=CommandDone)
    async def command(job_id: str, action: JobAction, tenant: Tenant) -> CommandDone:
        await registered(job_id, tenant)
        status = await _conflict_on(client.command(job_id, action, wait_s=30.0))
        return CommandDone(job_id=job_id, status=status)

    @app.get("/v1/jobs/{job_id}/events", response_model=None)
    async def events(job_id: str, tenant: Tenant, follow: bool = False) -> Response:
        await owned(job_id, tenant)
        if not follow:
            found = [e for e in await client.events(job_id) if e.tenant == tenant]
            return Response(msgspec.json.encode(found), media_type="application/json")

        async def lines() -> AsyncIterator[bytes]:
            async for event in client.follow(job_id):
                if event.tenant == tenant:
                    yield msgspec.json.encode(event) + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/v1/jobs/{job_id}/export", response_model=None)
    async def export(job_id: str, tenant: Tenant, version: int | None = None) -> Response:
        await registered(job_id, tenant)
        with tempfile.TemporaryDirectory(prefix="marlaas-export-") as scratch:
            out = Path(scratch) / job_id
            exported = await _conflict_on(client.export(job_id, out, version=version))
            name = f"{job_id}-v{exported.version}"
            body = await asyncio.to_thread(_tar_gz, out, name)
        return Response(
            body,
            media_type="application/gzip",
            headers={
                "Content-Disposition": f'attachment; filename="{name}.tar.gz"',
                "X-Adapter-Version": str(exported.version),
            },
        )

    @app.get("/v1/report", response_model=None)
    async def report(tenant: Tenant, job: Annotated[list[str] | None, Query()] = None) -> Response:
        """The HTML report (+ CSV, JSON) of the named jobs, or of all the tenant's, as .tar.gz."""
        job_ids = job or await client.store.tenant_job_ids(tenant)
        for job_id in job_ids:
            await registered(job_id, tenant)
        if not job_ids:
            raise HTTPException(404, f"tenant {tenant!r} has no jobs to report on")
        with tempfile.TemporaryDirectory(prefix="marlaas-report-") as scratch:
            out = Path(scratch) / "report"
            await client.report(job_ids, out)
            body = await asyncio.to_thread(_tar_gz, out, "report")
        return Response(body, media_type="application/gzip")

    @app.exception_handler(HTTPException)
    async def _error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    return app


async def _spec_of(request: Request, tenant: str) -> JobSpec:
    """The posted job spec, stamped with the key's tenant (another tenant named: 403)."""
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise HTTPException(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPException(400, "the body must be a JSON object: a job spec")
    named = body.get("tenant")
    if named not in (None, "", tenant):
        raise HTTPException(403, f"this key is tenant {tenant!r}'s; the spec names {named!r}")
    body = {
        **body,
        "kind": "job_spec",
        "tenant": tenant,
        "job_id": body.get("job_id") or f"{tenant}-{new_id()[:12]}",
        "submitted_at": time.time(),
    }
    try:
        spec = decode(Topic.JOBS, json.dumps(body).encode())
    except MessageDecodeError as exc:
        raise HTTPException(422, exc.reason) from None
    if not isinstance(spec, JobSpec):
        raise HTTPException(422, "not a job spec")
    return spec


def _view(record: JobRecord, version: int) -> JobView:
    spec = record.spec
    return JobView(
        job_id=spec.job_id,
        tenant=spec.tenant,
        status=record.status,
        reason=record.reason,
        version=version,
        env=spec.env.name,
        max_steps=spec.rl.max_steps,
        samples_in_flight=samples_in_flight(spec),
        created_at=record.created_at,
        updated_at=record.updated_at,
    )


async def _conflict_on(call: Awaitable[T]) -> T:
    """A command that does not apply to the job's state, or an export with nothing to
    export, is the caller's 409, with the reason."""
    try:
        return await call
    except (JobStateError, FileNotFoundError, ValueError) as exc:
        raise HTTPException(409, str(exc)) from None
    except TimeoutError as exc:
        raise HTTPException(504, str(exc)) from None


def _tar_gz(directory: Path, name: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(directory, arcname=name)
    return buffer.getvalue()


def _chat(base_url: str, model: str, ask: SampleRequest) -> SampleAnswer:
    try:
        answered, content = chat_completion(
            base_url, model, ask.prompt, max_tokens=ask.max_tokens, temperature=ask.temperature
        )
    except ChatFailed as exc:
        raise HTTPException(exc.status or 502, str(exc)) from None
    return SampleAnswer(model=answered, content=content)


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(401, message, headers={"WWW-Authenticate": "Bearer"})


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
        create_app(settings, connect_timeout_s=settings.connect_timeout_s),
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


def main() -> None:
    """`python -m console.api`: what `marlaas api` and the stack run."""
    from common.logs import setup_logging

    settings = load(SharedSettings)
    setup_logging(settings.log_level, settings.log_format)
    asyncio.run(serve(settings, load(ApiSettings)))


if __name__ == "__main__":
    main()
