"""`POST /v1/jobs/{job}/sample`: a chat completion with the job's adapter, through a rollout
replica's chat endpoint (`MARLAAS_CHAT_URL`)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from api_svc.access import Client, Settings, Tenant, gate, registered
from api_svc.views import SampleAnswer, SampleRequest
from marlaas import ChatFailed

router = APIRouter(prefix="/v1/jobs")


@router.post("/{job_id}/sample", response_model=SampleAnswer)
async def sample(
    job_id: str,
    ask: SampleRequest,
    tenant: Tenant,
    client: Client,
    settings: Settings,
    request: Request,
) -> SampleAnswer:
    """The answer, sampled as the job's tenant's work (the tenants' fair queue)."""
    await registered(client, job_id, tenant)
    if not settings.chat_url:
        raise HTTPException(503, "no rollout chat endpoint configured (MARLAAS_CHAT_URL)")
    close = gate(request).open_stream(tenant)  # a long call: one of the tenant's few at once
    try:
        answered, content = await client.sample(
            job_id,
            ask.prompt,
            version=ask.version,
            max_tokens=ask.max_tokens,
            temperature=ask.temperature,
            url=settings.chat_url,
        )
    except ChatFailed as exc:
        raise HTTPException(exc.status or 502, str(exc)) from None
    finally:
        close()
    return SampleAnswer(model=answered, content=content)
