"""`POST /v1/jobs/{job}/sample`: a chat completion with the job's adapter, through a rollout
replica's chat endpoint (`MARLAAS_CHAT_URL`)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException, Request

from api_svc.access import Client, Settings, Tenant, gate, registered
from api_svc.views import SampleAnswer, SampleRequest
from common.wire.chat import CHAT
from console.chat_client import ChatFailed, chat_completion

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
    await registered(client, job_id, tenant)
    if not settings.chat_url:
        raise HTTPException(503, "no rollout chat endpoint configured (MARLAAS_CHAT_URL)")
    model = job_id if ask.version is None else f"{job_id}@v{ask.version}"
    token = settings.internal_token(CHAT)
    close = gate(request).open_stream(tenant)  # a long call: one of the tenant's few at once
    try:
        return await asyncio.to_thread(_chat, settings.chat_url, model, job_id, ask, token)
    finally:
        close()


def _chat(
    base_url: str, model: str, job_id: str, ask: SampleRequest, token: str | None
) -> SampleAnswer:
    """The answer, sampled as the job's tenant's work (the tenants' fair queue)."""
    try:
        answered, content = chat_completion(
            base_url,
            model,
            ask.prompt,
            max_tokens=ask.max_tokens,
            temperature=ask.temperature,
            token=token,
            for_job=job_id,
        )
    except ChatFailed as exc:
        raise HTTPException(exc.status or 502, str(exc)) from None
    return SampleAnswer(model=answered, content=content)
