"""Try a job's model: OpenAI-compatible chat completions served by a rollout replica.

`POST /v1/chat/completions` with `model` = a job id (its latest adapter), `<job>@v<N>`
(adapter version N; `@v0` is the base model) or `base`; `messages` as OpenAI's; `max_tokens`,
`temperature` (default 0: greedy, as evaluations decode), `top_p` and `stop`. The prompt is
the base model's chat template over the messages; generation runs in the same engine, batched
with the jobs' rollouts. `POST /v1/completions` completes a raw `prompt` (no template).
`GET /v1/models` lists the jobs whose adapters this replica knows. Every request bears the
services' internal credential (the tenant API's, the operator's): a tenant samples through
the tenant API with its own key (api_svc/routes/openai_api.py), which checks the job is its.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from common.wire.chat import JOB_HEADER, MAX_PROMPT_CHARS, MAX_TOKENS
from common.wire.jobspec import bound_problems
from common.wire.messages import (
    MAX_SEED,
    GenerationRequest,
    GenerationResult,
    SamplingSettings,
    new_id,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024
_MODEL = re.compile(r"^(?P<job>[^@]+?)(?:@v(?P<version>\d+))?$")

Generate = Callable[[GenerationRequest, str, int | None, str], Awaitable[GenerationResult]]
"""(request, job id, adapter version or None for the latest, the job it is made for or "") ->
the sampled turn."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ChatError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_model(model: str) -> tuple[str, int | None]:
    """`job` -> (job, None: latest); `job@v3` -> (job, 3); `base` -> ("", 0)."""
    if model == "base":
        return "", 0
    match = _MODEL.match(model)
    if match is None:
        raise ChatError(400, f"model {model!r}: a job id, <job>@v<N> or 'base'")
    version = match.group("version")
    return match.group("job"), None if version is None else int(version)


def sampling_of(body: dict[str, Any]) -> SamplingSettings:
    try:
        given = body.get("max_tokens", body.get("max_completion_tokens"))
        max_tokens = 64 if given is None else int(given)
        temperature = float(body.get("temperature", 0.0))
        top_p = float(body.get("top_p", 1.0))
    except (TypeError, ValueError) as exc:
        raise ChatError(400, f"bad sampling parameter: {exc}") from None
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise ChatError(400, f"max_tokens must be in [1, {MAX_TOKENS}], got {max_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ChatError(400, "temperature must be >= 0 and top_p in (0, 1]")
    if not all(isinstance(s, str) for s in stop):
        raise ChatError(400, "stop must be a string or a list of strings")
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED
    ):
        raise ChatError(400, f"seed must be an integer in [0, {MAX_SEED}], got {seed!r}")
    sampling = SamplingSettings(
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_tokens,
        stop=list(stop),
        seed=seed,
    )
    if problems := bound_problems(sampling):  # a job's bounds: the stop list's above all
        raise ChatError(400, "; ".join(f"{field}: {what}" for field, what in problems))
    return sampling


class ChatAPI:
    """The HTTP server; `generate` samples with the named adapter, `models` lists job ids."""

    def __init__(
        self,
        tokenizer: Any,
        generate: Generate,
        models: Callable[[], Sequence[str]],
        *,
        host: str,
        port: int,
        token: str | None,
    ) -> None:
        """`token`: the credential every request must bear (`Authorization: Bearer`), derived
        from the bus key (common/security/signing.py); None only on an open bus."""
        self._tokenizer, self._generate, self._models = tokenizer, generate, models
        self._host, self._port = host, port
        self._token = token
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._authorized])
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/v1/completions", self._text_completions)
        app.router.add_get("/v1/models", self._list_models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        addresses = self._runner.addresses
        port = int(addresses[0][1]) if addresses else self._port
        self.url = f"http://{'127.0.0.1' if self._host == '0.0.0.0' else self._host}:{port}/v1"
        log.info("chat completions on %s", self.url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _authorized(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Only holders of the internal credential (the tenant API, the operator) are served:
        a tenant reaches a job's adapter through the API, which checks that the job is its."""
        if self._token is not None:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, self._token):
                error = {"message": "the internal credential is required", "code": 401}
                return web.json_response({"error": error}, status=401)
        return await handler(request)

    async def _list_models(self, _: web.Request) -> web.Response:
        models = ["base", *sorted(self._models())]
        data = [{"id": m, "object": "model", "owned_by": "marlaas"} for m in models]
        return web.json_response({"object": "list", "data": data})

    async def _completions(self, request: web.Request) -> web.Response:
        return await self._answer(request, self.complete)

    async def _text_completions(self, request: web.Request) -> web.Response:
        return await self._answer(request, self.complete_text)

    async def _answer(
        self, request: web.Request, complete: Callable[..., Awaitable[dict[str, Any]]]
    ) -> web.Response:
        try:
            try:
                body = await request.json()
            except json.JSONDecodeError as exc:
                raise ChatError(400, f"the body is not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise ChatError(400, "the body must be a JSON object")
            for_job = request.headers.get(JOB_HEADER, "")
            return web.json_response(await complete(body, for_job=for_job))
        except ChatError as exc:
            error = {"message": str(exc), "type": "invalid_request_error", "code": exc.status}
            return web.json_response({"error": error}, status=exc.status)

    async def complete(self, body: dict[str, Any], *, for_job: str = "") -> dict[str, Any]:
        """One chat completion; `for_job`: the job it is made for (a judged reward's, header
        `X-Marlaas-Job`), whose tenant's share of the engine it is admitted in."""
        model, messages = checked_request(body)
        text = self._tokenizer.apply_chat_template(
            [{"role": m.get("role", "user"), "content": m["content"]} for m in messages],
            tokenize=False,
            add_generation_prompt=True,
        )
        # The template writes its special tokens as text; nothing may be added around them.
        prompt_ids = list(self._tokenizer.encode(text, add_special_tokens=False))
        call, served, answer, result = await self._sample(model, prompt_ids, body, for_job)
        return completion_body(f"chatcmpl-{call}", served, answer, len(prompt_ids), result)

    async def complete_text(self, body: dict[str, Any], *, for_job: str = "") -> dict[str, Any]:
        """One completion of a raw `prompt` (`/v1/completions`: no chat template; the
        tokenizer's own special tokens, a BOS where the model has one)."""
        model, prompt = checked_text_request(body)
        prompt_ids = list(self._tokenizer.encode(prompt))
        call, served, answer, result = await self._sample(model, prompt_ids, body, for_job)
        return text_completion_body(f"cmpl-{call}", served, answer, len(prompt_ids), result)

    async def _sample(
        self, model: str, prompt_ids: list[int], body: dict[str, Any], for_job: str
    ) -> tuple[str, str, str, GenerationResult]:
        """(the call's id, the model that answered, its text, the sampled turn)."""
        job_id, version = parse_model(model)
        sampling = sampling_of(body)
        call = new_id()
        request = GenerationRequest(
            request_id=f"chat-{call}",
            job_id=job_id or "base",
            episode_id=f"chat-{call}",
            group_id="chat",
            sample_index=0,
            turn=0,
            context_token_ids=prompt_ids,
            sampling=sampling,
            pinned_adapter_version=-1 if version is None else version,
        )
        try:
            result = await self._generate(request, job_id, version, for_job)
        except LookupError as exc:
            raise ChatError(404, str(exc)) from None
        except ValueError as exc:  # e.g. a context longer than the engine takes
            raise ChatError(400, str(exc)) from None
        text = self._tokenizer.decode(result.completion_token_ids, skip_special_tokens=True)
        latest = version is None and job_id
        served = f"{job_id}@v{result.adapter_version}" if latest else model
        return call, served, text, result


def checked_model(body: dict[str, Any]) -> str:
    """The body's model, after the checks every request passes."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ChatError(400, "model: a job id, <job>@v<N> or 'base'")
    if body.get("stream"):
        raise ChatError(400, "stream: not supported here (the tenant API streams)")
    if body.get("n", 1) != 1:
        raise ChatError(400, "n: only 1")
    return model


def checked_text_request(body: dict[str, Any]) -> tuple[str, str]:
    """The body's model and prompt (one string), or a ChatError saying what is wrong."""
    model = checked_model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ChatError(400, "prompt: one non-empty string")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ChatError(413, f"prompt: {len(prompt)} characters; at most {MAX_PROMPT_CHARS}")
    if body.get("echo") or body.get("suffix") or body.get("logprobs"):
        raise ChatError(400, "echo, suffix and logprobs: not supported")
    return model, prompt


def checked_request(body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The body's model and messages, or a ChatError saying what is wrong with the request."""
    model = checked_model(body)
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
    ):
        raise ChatError(400, "messages: a non-empty list of {role, content}")
    if (chars := sum(len(m["content"]) for m in messages)) > MAX_PROMPT_CHARS:
        raise ChatError(413, f"messages: {chars} characters; at most {MAX_PROMPT_CHARS}")
    return model, messages


def completion_body(
    completion_id: str, model: str, text: str, prompt_tokens: int, result: GenerationResult
) -> dict[str, Any]:
    """OpenAI's `chat.completion` object for one sampled turn."""
    completion_tokens = len(result.completion_token_ids)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": result.finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def text_completion_body(
    completion_id: str, model: str, text: str, prompt_tokens: int, result: GenerationResult
) -> dict[str, Any]:
    """OpenAI's `text_completion` object for one sampled turn."""
    chat = completion_body(completion_id, model, text, prompt_tokens, result)
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": result.finish_reason}
    return chat | {"object": "text_completion", "choices": [choice]}
