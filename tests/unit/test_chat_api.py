"""The chat endpoint's request checks (the endpoint itself runs on vLLM in
tests/integration/test_chat_api.py)."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_svc.chat_api import ChatAPI, ChatError, parse_model, sampling_of


def test_model_names() -> None:
    assert parse_model("acme-1") == ("acme-1", None)
    assert parse_model("acme-1@v3") == ("acme-1", 3)
    assert parse_model("base") == ("", 0)
    with pytest.raises(ChatError, match="a job id"):
        parse_model("@v2")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be in"),
        ({"max_tokens": "lots"}, "bad sampling parameter"),
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"stop": [1]}, "stop must be a string"),
        ({"stop": ["\n"] * 60_000}, "stop: must have 0-16 items, got 60000"),
        ({"stop": ["x" * 300]}, r"stop\[0\]: must have 1-256 characters"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"seed": True}, "seed must be an integer"),
        ({"seed": -1}, "seed must be an integer in"),
        ({"seed": 2**63}, "seed must be an integer in"),
    ],
)
def test_bad_sampling_is_a_clear_400(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ChatError, match=message) as raised:
        sampling_of(body)
    assert raised.value.status == 400


def test_defaults_decode_greedily() -> None:
    sampling = sampling_of({"stop": "\n"})
    assert (sampling.temperature, sampling.max_new_tokens, sampling.stop) == (0.0, 64, ["\n"])
    assert sampling.seed is None and sampling_of({"seed": 0}).seed == 0  # OpenAI's `seed`


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "model:"),
        ({"model": "j", "messages": []}, "messages:"),
        ({"model": "j", "messages": [{"role": "user"}]}, "messages:"),
        ({"model": "j", "messages": [{"content": "hi"}], "stream": True}, "stream"),
        ({"model": "j", "messages": [{"content": "hi"}], "n": 2}, "n: only 1"),
        ({"model": "j", "messages": [{"content": "x" * 40_000}]}, "at most 32768"),
    ],
)
async def test_bad_requests_are_refused_before_generation(
    body: dict[str, Any], message: str
) -> None:
    with pytest.raises(ChatError, match=message):
        await never_generating().complete(body)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "hi"}, "model:"),
        ({"model": "j"}, "prompt: one non-empty string"),
        ({"model": "j", "prompt": ["a", "b"]}, "prompt: one non-empty string"),
        ({"model": "j", "prompt": "x" * 40_000}, "at most 32768"),
        ({"model": "j", "prompt": "hi", "echo": True}, "echo, suffix and logprobs"),
        ({"model": "j", "prompt": "hi", "stream": True}, "stream"),
    ],
)
async def test_bad_text_completions_are_refused_before_generation(
    body: dict[str, Any], message: str
) -> None:
    with pytest.raises(ChatError, match=message):
        await never_generating().complete_text(body)


def never_generating() -> ChatAPI:
    """An endpoint whose engine fails the test if a request reaches it."""

    async def never(*_: Any) -> Any:
        raise AssertionError("generated")

    return ChatAPI(object(), never, list, host="127.0.0.1", port=0, token=None)
