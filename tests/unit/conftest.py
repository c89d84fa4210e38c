"""Fixtures of the handler tests (tests/unit/test_handlers.py, test_faults.py): every
scenario on the in-memory bus and store, and on the real broker and Valkey."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from common.files.models import tiny_model
from env_svc.chat_template import ChatTokenizer
from tests.fakes import Backend, kafka_backend, memory_backend


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
def servers(request: pytest.FixtureRequest) -> tuple[str, str] | None:
    """None for the in-memory backend; the real broker's and Redis' addresses otherwise."""
    if request.param == "memory":
        return None
    stack = request.getfixturevalue("local_stack")
    return stack.kafka_bootstrap, stack.redis_url


@pytest.fixture
async def backend(servers: tuple[str, str] | None) -> AsyncIterator[Backend]:
    if servers is None:
        async with memory_backend() as found:
            yield found
    else:
        async with kafka_backend(*servers) as found:
            yield found


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return tiny_model()
