"""api_svc/routes/openai_api.py: a whole completion as OpenAI's stream, read back with the
official client's own types."""

from __future__ import annotations

import json
from typing import Any

from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from api_svc.routes.openai_api import _events

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def read(events: list[str]) -> list[dict[str, Any]]:
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_a_chat_completion_streams_as_role_content_finish_then_usage() -> None:
    answer = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 7,
        "model": "acme-1@v2",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}
        ],
        "usage": USAGE,
    }
    chunks = [ChatCompletionChunk.model_validate(c) for c in read(list(_events(answer, True)))]
    assert [c.choices[0].delta.role for c in chunks[:1]] == ["assistant"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "4"
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, None, "stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 8
    assert {c.model for c in chunks} == {"acme-1@v2"}
    assert len(read(list(_events(answer, False)))) == 3  # no usage unless asked


def test_a_text_completion_streams_as_its_text_and_finish() -> None:
    answer = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 7,
        "model": "acme-1@v2",
        "choices": [{"index": 0, "text": " 4", "logprobs": None, "finish_reason": "length"}],
        "usage": USAGE,
    }
    chunks = [Completion.model_validate(c) for c in read(list(_events(answer, False)))]
    assert "".join(c.choices[0].text for c in chunks) == " 4"
    assert [c.choices[0].finish_reason for c in chunks] == ["length"]
