"""What a job leaves: `GET /v1/jobs/{job}/events` (`?follow=true`: NDJSON until it ends),
`GET /v1/jobs/{job}/export` (the adapter, .tar.gz) and `GET /v1/report` (.tar.gz)."""

from __future__ import annotations

import asyncio
import io
import tarfile
import tempfile
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

import msgspec
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import Response, StreamingResponse

from api_svc.access import Client, Tenant, api_key, conflict_on, gate, owned, registered

router = APIRouter(prefix="/v1")
KEY_RECHECK_S = 5.0
"""How often an open event stream checks that its key is still valid."""


@router.get("/jobs/{job_id}/events", response_model=None)
async def events(
    job_id: str, tenant: Tenant, client: Client, request: Request, follow: bool = False
) -> Response:
    job = await owned(client, job_id, tenant) or job_id  # bound, not registered yet: its id
    if not follow:
        found = [e for e in await client.events(job) if e.tenant == tenant]
        return Response(msgspec.json.encode(found), media_type="application/json")
    close = gate(request).open_stream(tenant)
    key = api_key(request)

    async def still_valid() -> bool:  # a revoked key's stream ends
        return await client.store.tenants.authenticate(key) == tenant

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for event in client.follow(job, allowed=still_valid, check_every_s=KEY_RECHECK_S):
                if event.tenant == tenant:
                    yield msgspec.json.encode(event) + b"\n"
        finally:
            close()

    stream = lines()
    # A client gone before the stream started never runs its `finally`: the slot is given
    # back when the stream is collected.
    weakref.finalize(stream, close)
    return StreamingResponse(stream, media_type="application/x-ndjson")


@router.get("/jobs/{job_id}/export", response_model=None)
async def export(
    job_id: str, tenant: Tenant, client: Client, version: int | None = None, best: bool = False
) -> Response:
    """The job's latest adapter, `version`, or (`best`) its best evaluated version."""
    record = await registered(client, job_id, tenant)
    with tempfile.TemporaryDirectory(prefix="marlaas-export-") as scratch:
        out = Path(scratch) / job_id
        exported = await conflict_on(client.export(record, out, version=version, best=best))
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


@router.get("/report", response_model=None)
async def report(
    tenant: Tenant, client: Client, job: Annotated[list[str] | None, Query()] = None
) -> Response:
    """The HTML report (+ CSV, JSON) of the named jobs, or of all the tenant's, as .tar.gz."""
    job_ids = job or await client.store.tenant_job_ids(tenant)
    records = [await registered(client, job_id, tenant) for job_id in job_ids]
    if not records:
        raise HTTPException(404, f"tenant {tenant!r} has no jobs to report on")
    with tempfile.TemporaryDirectory(prefix="marlaas-report-") as scratch:
        out = Path(scratch) / "report"
        await client.report(records, out)
        body = await asyncio.to_thread(_tar_gz, out, "report")
    return Response(body, media_type="application/gzip")


def _tar_gz(directory: Path, name: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(directory, arcname=name)
    return buffer.getvalue()
