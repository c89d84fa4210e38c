"""`marlaas sample JOB PROMPT`: ask a job's adapter, through a rollout replica's OpenAI-
compatible chat completions (rollout_svc/chat_api.py)."""

from __future__ import annotations

from typing import Any

import typer

from common.runtime.config import SharedSettings, load
from common.wire.chat import CHAT
from console.cli.support import one_line_errors, run, say, tenant_client
from marlaas.api_client import TenantClient
from marlaas.chat import ChatFailed, chat_completion


@one_line_errors
def sample(
    job: str = typer.Argument(..., help="The job id ('base': the base model)."),
    prompt: str = typer.Argument(..., help="The user message."),
    version: int | None = typer.Option(None, help="Adapter version (default: the latest)."),
    max_tokens: int = typer.Option(64, min=1, max=1024, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, min=0.0, help="0: greedy, as evaluations decode."),
    url: str = typer.Option(
        "", help="Chat completions base URL (default: MARLAAS_CHAT_URL, which `marlaas up` sets)."
    ),
) -> None:
    """Answer PROMPT with the job's adapter (the latest, or --version)."""
    if (api := tenant_client()) is not None:
        answer = run(_sample_via_api(api, job, prompt, version, max_tokens, temperature))
        say(f"[{answer['model']}] {answer['content']}")
        return
    settings = load(SharedSettings)
    base = (url or settings.chat_url).rstrip("/")
    if not base:
        raise ValueError(
            "no chat completions URL: start the stack with `marlaas up`, or give --url "
            "http://<rollout host>:<ROLLOUT_API_PORT>/v1"
        )
    model = job if version is None else f"{job}@v{version}"
    try:
        answered, content = chat_completion(
            base,
            model,
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            token=settings.internal_token(CHAT),
        )
    except ChatFailed as exc:
        raise ValueError(str(exc)) from None
    say(f"[{answered}] {content}")


async def _sample_via_api(
    api: TenantClient,
    job: str,
    prompt: str,
    version: int | None,
    max_tokens: int,
    temperature: float,
) -> dict[str, Any]:
    async with api:
        return await api.sample(
            job, prompt, version=version, max_tokens=max_tokens, temperature=temperature
        )


def register(app: typer.Typer) -> None:
    app.command()(sample)
