"""`POST /v1/jobs/{job}/sample`: a chat completion with the job's adapter, through a rollout
replica's chat endpoint (`MARLAAS_CHAT_URL`)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException

from api_svc.access import Client, Settings, Tenant, registered
from api_svc.views import SampleAnswer, SampleRequest
from common.chat import CHAT
from console.chat_client import ChatFailed, chat_completion

router = APIRouter(prefix="/v1/jobs")


@router.post("/{job_id}/sample", response_model=SampleAnswer)
async def sample(
    job_id: str, ask: SampleRequest, tenant: Tenant, client: Client, settings: Settings
) -> SampleAnswer:
    await registered(client, job_id, tenant)
    if not settings.chat_url:
        raise HTTPException(503, "no rollout chat endpoint configured (MARLAAS_CHAT_URL)")
    model = job_id if ask.version is None else f"{job_id}@v{ask.version}"
    token = settings.internal_token(CHAT)
    return await asyncio.to_thread(_chat, settings.chat_url, model, ask, token)


def _chat(base_url: str, model: str, ask: SampleRequest, token: str | None) -> SampleAnswer:
    try:
        answered, content = chat_completion(
            base_url,
            model,
            ask.prompt,
            max_tokens=ask.max_tokens,
            temperature=ask.temperature,
            token=token,
        )
    except ChatFailed as exc:
        raise HTTPException(exc.status or 502, str(exc)) from None
    return SampleAnswer(model=answered, content=content)
