"""What a job leaves: `GET /v1/jobs/{job}/events` (`?follow=true`: NDJSON until it ends),
`GET /v1/jobs/{job}/episodes` (its latest finished episodes as text), `GET
/v1/jobs/{job}/export` (the adapter, .tar.gz) and `GET /v1/report` (.tar.gz).

Archives are written to an unnamed temporary file and streamed from it, never held in memory:
an adapter may be hundreds of MB. The file has no name, so it is gone once the response is
(sent, or its client gone), whatever happens to the request."""

from __future__ import annotations

import asyncio
import tarfile
import tempfile
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, Annotated

import msgspec
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import Response, StreamingResponse

from api_svc.access import Client, Tenant, api_key, conflict_on, gate, owned, registered
from marlaas.client import NoTokenizerError
from marlaas.episodes import EpisodeSample

router = APIRouter(prefix="/v1")
KEY_RECHECK_S = 5.0
"""How often an open event stream checks that its key is still valid."""


@router.get("/jobs/{job_id}/events", response_model=None)
async def events(
    job_id: str, tenant: Tenant, client: Client, request: Request, follow: bool = False
) -> Response:
    job = await owned(client, job_id, tenant) or job_id  # bound, not registered yet: its id
    if not follow:
        done = gate(request).open_read(tenant)
        try:
            found = [e for e in await client.events(job) if e.tenant == tenant]
        finally:
            done()
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


MAX_EPISODES = 10
"""Episodes one `episodes` call returns at most (each is clipped: marlaas/episodes.py)."""


@router.get("/jobs/{job_id}/episodes", response_model=list[EpisodeSample])
async def episodes(
    job_id: str,
    tenant: Tenant,
    client: Client,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=MAX_EPISODES)] = 5,
) -> list[EpisodeSample]:
    """The job's latest finished episodes, newest first: each turn's text (the prompt, what
    the model wrote with its tool calls, what came back), the reward and its components."""
    record = await owned(client, job_id, tenant)
    if record is None:
        return []  # bound to the tenant, not accepted yet: no episode
    done = gate(request).open_read(tenant)
    try:
        return await client.episodes(record, limit=limit)
    except NoTokenizerError as exc:
        raise HTTPException(503, f"{exc} (set MARLAAS_TOKENIZER_DIR)") from None
    finally:
        done()


@router.get("/jobs/{job_id}/export", response_model=None)
async def export(
    job_id: str,
    tenant: Tenant,
    client: Client,
    request: Request,
    version: int | None = None,
    best: bool = False,
) -> Response:
    """The job's latest adapter, `version`, or (`best`) its best evaluated version."""
    record = await registered(client, job_id, tenant)
    done = gate(request).open_read(tenant)
    try:
        with tempfile.TemporaryDirectory(prefix="marlaas-export-") as scratch:
            out = Path(scratch) / job_id
            exported = await conflict_on(client.export(record, out, version=version, best=best))
            name = f"{job_id}-v{exported.version}"
            archive = await asyncio.to_thread(_tar_gz, out, name)
    finally:
        done()
    return _streamed(
        archive,
        {
            "Content-Disposition": f'attachment; filename="{name}.tar.gz"',
            "X-Adapter-Version": str(exported.version),
        },
    )


@router.get("/report", response_model=None)
async def report(
    tenant: Tenant,
    client: Client,
    request: Request,
    job: Annotated[list[str] | None, Query()] = None,
) -> Response:
    """The HTML report (+ CSV, JSON) of the named jobs, or of all the tenant's, as .tar.gz."""
    job_ids = job or await client.store.jobs.of_tenant(tenant)
    records = [await registered(client, job_id, tenant) for job_id in job_ids]
    if not records:
        raise HTTPException(404, f"tenant {tenant!r} has no jobs to report on")
    done = gate(request).open_read(tenant)
    try:
        with tempfile.TemporaryDirectory(prefix="marlaas-report-") as scratch:
            out = Path(scratch) / "report"
            await client.report(records, out)
            archive = await asyncio.to_thread(_tar_gz, out, "report")
    finally:
        done()
    return _streamed(archive, {})


CHUNK_BYTES = 256 * 1024
"""What a streamed archive is read and sent in."""


def _tar_gz(directory: Path, name: str) -> IO[bytes]:
    """`directory` as a .tar.gz in an unnamed temporary file, rewound."""
    archive = tempfile.TemporaryFile(prefix="marlaas-archive-")
    try:
        with tarfile.open(fileobj=archive, mode="w:gz") as tar:
            tar.add(directory, arcname=name)
        archive.seek(0)
    except BaseException:
        archive.close()
        raise
    return archive


def _streamed(archive: IO[bytes], headers: dict[str, str]) -> StreamingResponse:
    size = archive.seek(0, 2)
    archive.seek(0)

    def chunks() -> Iterator[bytes]:  # run in a worker thread, a chunk at a time
        with archive:
            while chunk := archive.read(CHUNK_BYTES):
                yield chunk

    return StreamingResponse(
        chunks(),
        media_type="application/gzip",
        headers={**headers, "Content-Length": str(size)},
    )
