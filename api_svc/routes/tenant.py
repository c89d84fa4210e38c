"""`GET /v1/tenant` (who the key is, its limits and jobs) and `GET /v1/schema/job`."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter

from api_svc.access import Client, Tenant
from api_svc.views import TenantView
from common.state.tenants import TenantLimits
from common.wire.codec import json_schema
from common.wire.messages import Topic

router = APIRouter(prefix="/v1")


@router.get("/tenant", response_model=TenantView)
async def whoami(tenant: Tenant, client: Client) -> TenantView:
    limits = await client.store.tenants.limits(tenant) or TenantLimits()
    return TenantView(
        tenant=tenant,
        limits=msgspec.structs.asdict(limits),
        jobs=await client.store.jobs.of_tenant(tenant),
    )


@router.get("/schema/job")
async def job_schema(tenant: Tenant) -> dict[str, Any]:
    """The JSON Schema of a job spec (`tenant` may be left out: the key's is used)."""
    return json_schema(Topic.JOBS)
