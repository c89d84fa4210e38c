"""`GET /v1/usage`: what the key's tenant's work cost, in total and per job, as JSON or, with
`?format=csv`, as CSV (common/state/usage.py counts it where the work happens)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from api_svc.access import Client, Tenant
from api_svc.views import JobUsage, UsageCounts, UsageView
from common.state.usage import usage_csv

router = APIRouter(prefix="/v1")


@router.get("/usage", response_model=UsageView)
async def usage(
    tenant: Tenant, client: Client, format: Literal["json", "csv"] = "json"
) -> UsageView | PlainTextResponse:
    found = await client.usage(tenant)
    if format == "csv":
        return PlainTextResponse(usage_csv(found.rows()), media_type="text/csv")
    return UsageView(
        tenant=tenant,
        total=UsageCounts.model_validate(found.total.as_map()),
        jobs=[
            JobUsage.model_validate({"job_id": job_id, **u.as_map()})
            for job_id, u in sorted(found.jobs.items())
        ],
    )
