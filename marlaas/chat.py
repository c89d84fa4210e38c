"""One chat completion from a rollout replica's OpenAI-compatible endpoint
(rollout_svc/chat_api.py): what `Client.sample`, `marlaas sample` and the tenant API's
`sample` ask."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from common.wire.chat import JOB_HEADER


class ChatFailed(Exception):
    """The endpoint refused (`status`: its HTTP status) or could not be reached (0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def chat_completion(
    base_url: str,
    model: str,
    prompt: str,
    *,
    max_tokens: int,
    temperature: float,
    token: str | None,
    for_job: str = "",
) -> tuple[str, str]:
    """(the model that answered, its answer) to one user message; `token`: the replicas'
    internal credential (`SharedSettings.internal_token(CHAT)`; None on an open bus).
    `for_job`: the job whose tenant the request is made for (a tenant's `sample`): the
    replica admits it in the tenants' fair queue as that tenant's, not in the endpoint's
    few slots shared by everyone."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    answer = chat_request(base_url, body, token=token, for_job=for_job)
    return answer["model"], answer["choices"][0]["message"]["content"]


def chat_request(
    base_url: str,
    body: dict[str, Any],
    *,
    token: str | None,
    for_job: str = "",
    path: str = "chat/completions",
) -> dict[str, Any]:
    """The endpoint's answer to an OpenAI chat completions `body` (or, `path`
    "completions", a text completion's: what the tenant API forwards); ChatFailed names the
    model and why."""
    request = urllib.request.Request(
        f"{base_url.rstrip('/')}/{path}",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {token}"} if token else {}),
            **({JOB_HEADER: for_job} if for_job else {}),
        },
        method="POST",
    )
    model = body.get("model")
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:  # the caller's credential, not the asker's: a server fault
            raise ChatFailed(502, "the rollout endpoint refused the internal credential") from None
        raise ChatFailed(exc.code, f"{model}: {_error_text(exc)}") from None
    except urllib.error.URLError as exc:
        raise ChatFailed(0, f"{base_url} unreachable: {exc.reason}") from None
    except (TimeoutError, OSError, ValueError) as exc:  # cut off, or not JSON
        raise ChatFailed(504 if isinstance(exc, TimeoutError) else 502, f"{model}: {exc}") from None
    if not isinstance(answer, dict) or not answer.get("choices"):
        raise ChatFailed(502, f"{model}: the rollout endpoint answered no choices")
    return answer


def _error_text(exc: urllib.error.HTTPError) -> str:
    """The OpenAI error body's message, else the status's reason (a plain-text body)."""
    try:
        error = json.loads(exc.read() or b"{}").get("error", {})
    except (ValueError, OSError, AttributeError):
        return str(exc.reason)
    return str(error.get("message", exc.reason)) if isinstance(error, dict) else str(error)
