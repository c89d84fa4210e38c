"""`marlaas sample JOB PROMPT`: ask a job's adapter, through a rollout replica's OpenAI-
compatible chat completions (rollout_svc/chat_api.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import typer

from common.config import SharedSettings, load
from console.cli_support import one_line_errors, say


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
    base = (url or load(SharedSettings).chat_url).rstrip("/")
    if not base:
        raise ValueError(
            "no chat completions URL: start the stack with `marlaas up`, or give --url "
            "http://<rollout host>:<ROLLOUT_API_PORT>/v1"
        )
    model = job if version is None else f"{job}@v{version}"
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": temperature,
    }  # fmt: skip
    request = urllib.request.Request(
        f"{base}/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = json.loads(exc.read() or b"{}").get("error", {}).get("message", exc.reason)
        raise ValueError(f"{model}: {detail}") from None
    except urllib.error.URLError as exc:
        raise ValueError(f"{base} unreachable: {exc.reason}") from None
    say(f"[{answer['model']}] {answer['choices'][0]['message']['content']}")


def register(app: typer.Typer) -> None:
    app.command()(sample)
