"""OpenAI-compatible sampling with the tenant's own key: `POST /v1/chat/completions` and
`POST /v1/completions` (a raw prompt; both with `stream`, as server-sent events) and
`GET /v1/models`. Any OpenAI client works with
`base_url=<api>/v1` and `api_key=<the tenant's key>`.

`model` is one of the tenant's job ids (its latest adapter) or `<job>@v<N>` (version N; v0
is the base model); another tenant's job is answered as one that does not exist (404). The
body is a rollout replica's to judge (rollout_svc/chat_api.py: `messages`, `max_tokens`,
`temperature`, `top_p`, `stop`, `seed`): it is forwarded with the replicas' internal
credential and admitted as the tenant's work in the engine's fair queue, while the request
holds one of the tenant's few open streams here. The engine hands a turn over whole, so a
stream carries OpenAI's chunks in order (the role, the content in one piece, the finish
reason, then `usage` where `stream_options.include_usage` asks) and `[DONE]`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from api_svc.access import Client, Settings, Tenant, gate, records_of, registered
from common.runtime.config import SharedSettings
from marlaas import ChatFailed
from marlaas import Client as MarlaasClient

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(tenant: Tenant, client: Client) -> dict[str, Any]:
    """The tenant's jobs, each as its latest adapter (`<job>`) and as each version trained so
    far (`<job>@v<N>`)."""
    data = []
    for record in await records_of(client, tenant):
        job_id = record.spec.job_id
        pointer = await client.store.adapters.get(job_id)
        latest = pointer.version if pointer is not None else 0
        created = int(record.created_at)
        for model in [job_id, *(f"{job_id}@v{v}" for v in range(latest + 1))]:
            data.append(
                {
                    "id": model,
                    "object": "model",
                    "created": created,
                    "owned_by": tenant,
                    "root": record.spec.base_model,
                }
            )
    return {"object": "list", "data": data}


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    request: Request, tenant: Tenant, client: Client, settings: Settings
) -> JSONResponse | StreamingResponse:
    return await _forwarded(request, tenant, client, settings, "chat/completions")


@router.post("/completions", response_model=None)
async def completions(
    request: Request, tenant: Tenant, client: Client, settings: Settings
) -> JSONResponse | StreamingResponse:
    """A raw `prompt`'s completion (no chat template)."""
    return await _forwarded(request, tenant, client, settings, "completions")


async def _forwarded(
    request: Request, tenant: str, client: MarlaasClient, settings: SharedSettings, path: str
) -> JSONResponse | StreamingResponse:
    """The replica's answer to the body, once its model is found to be the tenant's job."""
    body = await _body_of(request)
    job_id = str(body["model"]).partition("@v")[0]
    await registered(client, job_id, tenant)
    if not settings.chat_url:
        raise HTTPException(503, "no rollout chat endpoint configured (MARLAAS_CHAT_URL)")
    stream = bool(body.pop("stream", False))
    options = body.pop("stream_options", None) or {}
    close = gate(request).open_stream(tenant)  # a long call: one of the tenant's few at once
    try:
        answer = await client.chat(body, for_job=job_id, url=settings.chat_url, path=path)
    except ChatFailed as exc:
        raise HTTPException(exc.status or 502, str(exc)) from None
    finally:
        close()
    if not stream:
        return JSONResponse(answer)
    usage = isinstance(options, dict) and bool(options.get("include_usage"))
    try:  # built before the 200 is sent: an answer missing a field is a 502, not a cut stream
        events = list(_events(answer, usage))
    except (KeyError, IndexError, TypeError) as exc:
        raise HTTPException(502, f"the rollout endpoint's answer lacks {exc}") from None
    return StreamingResponse(iter(events), media_type="text/event-stream")


async def _body_of(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise HTTPException(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise HTTPException(400, "the body must be a JSON object with a `model` (a job id)")
    return body


def _events(answer: dict[str, Any], usage: bool) -> Iterator[str]:
    """A whole completion as OpenAI's stream: `chat.completion.chunk` events (the role, the
    content, the finish) or one `text_completion` (the text and its finish)."""
    choice = answer["choices"][0]
    chat = answer.get("object") == "chat.completion"
    base = {
        "id": answer.get("id", ""),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": answer.get("created", int(time.time())),
        "model": answer.get("model", ""),
    }

    def event(part: dict[str, Any], finish: str | None = None) -> str:
        data = base | {"choices": [{"index": 0, **part, "finish_reason": finish}]}
        return f"data: {json.dumps(data)}\n\n"

    if chat:
        yield event({"delta": {"role": "assistant", "content": ""}})
        yield event({"delta": {"content": choice["message"]["content"]}})
        yield event({"delta": {}}, choice.get("finish_reason") or "stop")
    else:  # the text whole, with its finish (OpenAI's type takes no chunk without one)
        yield event(
            {"text": choice["text"], "logprobs": None}, choice.get("finish_reason") or "stop"
        )
    if usage and "usage" in answer:
        yield f"data: {json.dumps(base | {'choices': [], 'usage': answer['usage']})}\n\n"
    yield "data: [DONE]\n\n"
