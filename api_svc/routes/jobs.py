"""Jobs: `POST /v1/jobs` (submit), `GET /v1/jobs`, `GET /v1/jobs/{job}` and
`POST /v1/jobs/{job}/{pause|resume|cancel}`."""

from __future__ import annotations

import json
import logging
import time

from fastapi import APIRouter, HTTPException, Request

from api_svc.access import (
    Client,
    Settings,
    Tenant,
    conflict_on,
    owned,
    records_of,
    registered,
    view_of,
)
from api_svc.views import CommandDone, JobView, Submitted
from common.state.tenants import QuotaError
from common.wire.codec import decode
from common.wire.jobspec import JobSpecError, admit, fresh_job_id
from common.wire.messages import JobAction, JobSpec, MessageDecodeError, Topic
from marlaas.client import EnvironmentNotServedError, refuse_unserved

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs")


@router.post("", status_code=202, response_model=Submitted)
async def submit(request: Request, tenant: Tenant, client: Client, settings: Settings) -> Submitted:
    spec = await _spec_of(request, tenant)
    limits = await client.store.tenants.limits(tenant)
    try:
        job = admit(spec, tenant=tenant, deployment=settings.deployment(), limits=limits)
    except JobSpecError as exc:
        raise HTTPException(422, str(exc)) from None
    if limits is not None:
        try:
            await client.store.jobs.check_quota(job.spec, limits)
        except QuotaError as exc:
            raise HTTPException(429, str(exc)) from None
    try:
        refuse_unserved([job.spec], await client.served_environments())
    except EnvironmentNotServedError as exc:
        raise HTTPException(422, str(exc)) from None
    # Taken: bound to anyone already, this tenant included (a resubmitted id).
    if not (await client.store.jobs.claim_id(job.job_id, tenant)).bound_now:
        raise HTTPException(409, f"job id {job.job_id!r} is taken; leave job_id out")
    await client.submit([job.spec])
    log.info("tenant %s submitted job %s", tenant, job.job_id)
    return Submitted(job_id=job.job_id, tenant=tenant)


@router.get("", response_model=list[JobView])
async def jobs(tenant: Tenant, client: Client) -> list[JobView]:
    return [await view_of(client, record) for record in await records_of(client, tenant)]


@router.get("/{job_id}", response_model=JobView)
async def job(job_id: str, tenant: Tenant, client: Client) -> JobView:
    record = await owned(client, job_id, tenant)
    if record is not None:
        return await view_of(client, record)
    if (reason := await client.store.jobs.rejection(job_id)) is not None:
        return JobView(job_id=job_id, tenant=tenant, status="rejected", reason=reason)
    return JobView(job_id=job_id, tenant=tenant, status="submitted")


@router.post("/{job_id}/{action}", response_model=CommandDone)
async def command(job_id: str, action: JobAction, tenant: Tenant, client: Client) -> CommandDone:
    record = await registered(client, job_id, tenant)
    status = await conflict_on(client.command(record, action, wait_s=30.0))
    return CommandDone(job_id=job_id, status=status)


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
        "job_id": body.get("job_id") or fresh_job_id(tenant),
        "submitted_at": time.time(),
    }
    try:
        spec = decode(Topic.JOBS, json.dumps(body).encode())
    except MessageDecodeError as exc:
        raise HTTPException(422, exc.reason) from None
    if not isinstance(spec, JobSpec):
        raise HTTPException(422, "not a job spec")
    return spec
