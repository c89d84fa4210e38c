"""`GET /console` (the page), `GET /console/static/{name}` (its style sheet and script) and
`GET /console/charts` (the curves of the key's tenant's jobs). Left out of the OpenAPI
schema: they are the console's, not the API's; the page's data comes from the `/v1` routes."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from api_svc.access import Client, Tenant, gate, records_of
from api_svc.web.curves import charted, console_charts
from api_svc.web.page import HEADERS, PAGE, asset
from marlaas.report.numbers import build_report

router = APIRouter(prefix="/console", include_in_schema=False)


@router.get("")
async def page() -> Response:
    return _served(PAGE)


@router.get("/static/{name}")
async def static_file(name: str) -> Response:
    return _served(name)


@router.get("/charts")
async def curves(tenant: Tenant, client: Client, request: Request) -> JSONResponse:
    """The reward, held-out accuracy and utilisation charts of the tenant's latest jobs."""
    records = await records_of(client, tenant)
    shown = charted(records)
    if not shown:
        return JSONResponse(console_charts(build_report([])), headers=HEADERS)
    done = gate(request).open_read(tenant)  # reads the jobs' events: one of the pooled readers
    try:
        report = await client.report_numbers(shown)
    finally:
        done()
    return JSONResponse(console_charts(report, left_out=len(records) - len(shown)), headers=HEADERS)


def _served(name: str) -> Response:
    found = asset(name)
    if found is None:
        raise HTTPException(404, f"no console file {name!r}")
    content, media_type = found
    return Response(content, media_type=media_type, headers=HEADERS)
