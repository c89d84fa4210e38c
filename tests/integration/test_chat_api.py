"""Try a job's model: the rollout service's OpenAI-compatible chat completions on vLLM's CPU
engine (tiny model, a random adapter), called with OpenAI's own client and `marlaas sample`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import pytest
import pytest_asyncio
from pydantic import SecretStr
from typer.testing import CliRunner

from common.files.models import tiny_model
from common.runtime.config import RolloutSettings, SharedSettings
from common.state.store import RedisStore
from common.wire.chat import CHAT
from common.wire.messages import EnvSettings, JobSpec, new_id
from console.cli.main import app
from env_svc.judge import Judge
from env_svc.protocol import ChatMessage, Reward, Task, ascore
from marlaas.chat import chat_completion
from rollout_svc.engine import RolloutEngine
from rollout_svc.engine_settings import EngineSettings
from rollout_svc.service import RolloutService
from tests.integration.test_rollout_engine import make_adapter

pytestmark = [pytest.mark.kafka, pytest.mark.asyncio(loop_scope="module")]
BUS_KEY = SecretStr("chat-test-bus-key")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(
    local_stack,
    tmp_path_factory: pytest.TempPathFactory,  # type: ignore[no-untyped-def]
) -> AsyncIterator[tuple[str, str, str]]:
    """A rollout service's engine and chat endpoint (no Kafka consumer: only chat), with a
    job whose v1 is a random adapter; also the endpoint's credential."""
    base = tiny_model()
    store = await RedisStore.connect(local_stack.redis_url)
    job_id = f"chat-{new_id()[:8]}"
    await store.jobs.register(
        JobSpec(
            job_id=job_id, tenant="acme", base_model=str(base), env=EnvSettings(name="arithmetic")
        ),
        status="paused",  # served for chat; no env_svc the session started issues its work
    )
    adapter = make_adapter(base, tmp_path_factory.mktemp("adapters") / "v1", seed=3)
    await store.adapters.publish(job_id, 1, adapter.resolve().as_uri(), 1)
    engine = RolloutEngine(EngineSettings(base, max_loras=2, max_cpu_loras=4, max_lora_rank=8))
    await engine.start()
    shared = SharedSettings(base_model=str(base), metrics_host="127.0.0.1", bus_key=BUS_KEY)
    service = RolloutService(
        shared,
        RolloutSettings(),
        engine,
        store=store,
    )
    chat = await service._start_chat(0)
    try:
        token = shared.internal_token(CHAT)
        assert token is not None
        yield chat.url, job_id, token
    finally:
        await chat.stop()
        await engine.stop()
        await store.close()


async def test_an_openai_client_talks_to_a_jobs_adapter(
    served: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from openai import AsyncOpenAI, AuthenticationError, NotFoundError

    url, job_id, token = served
    for wrong in ("unused", token[:-1]):  # only holders of the internal credential are served
        with pytest.raises(AuthenticationError, match="internal credential"):
            await AsyncOpenAI(base_url=url, api_key=wrong).models.list()
    client = AsyncOpenAI(base_url=url, api_key=token)  # OpenAI's key is the bearer token
    question: list[Any] = [{"role": "user", "content": "What is 2 + 3?"}]

    async def ask(model: str) -> tuple[str, str]:
        answer = await client.chat.completions.create(
            model=model,
            messages=question,
            max_tokens=12,  # type: ignore[arg-type]
        )
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        return answer.model, answer.choices[0].message.content or ""

    latest_model, adapted = await ask(job_id)
    assert latest_model == f"{job_id}@v1"  # the latest: read from Redis, not broadcast
    assert (await ask(f"{job_id}@v1"))[1] == adapted  # greedy: the same answer again
    _, base = await ask("base")
    assert (await ask(f"{job_id}@v0"))[1] == base != adapted  # v0 is the base model
    with pytest.raises(NotFoundError, match="unknown job"):
        await ask("no-such-job")
    with pytest.raises(NotFoundError, match="never published"):
        await ask(f"{job_id}@v7")
    listed = await client.models.list()
    assert "base" in [m.id for m in listed.data]

    # /v1/completions: a raw prompt, no chat template; greedy, so the same text twice, and
    # the adapter's differs from the base model's.
    async def complete(model: str) -> str:
        answer = await client.completions.create(model=model, prompt="2 + 3 =", max_tokens=8)
        assert answer.object == "text_completion" and answer.choices[0].finish_reason
        return answer.choices[0].text

    raw = await complete(job_id)
    assert raw == await complete(f"{job_id}@v1") != await complete("base")

    monkeypatch.setenv("MARLAAS_BUS_KEY", BUS_KEY.get_secret_value())  # the operator's

    def sample(*args: str) -> str:
        result = CliRunner().invoke(app, ["sample", *args, "--url", url, "--max-tokens", "12"])
        assert result.exit_code == 0, result.output
        return result.output.strip()

    said = await asyncio.to_thread(sample, job_id, "What is 2 + 3?")
    assert said == f"[{job_id}@v1] {adapted}"
    # A tenant's `sample` (the API) is made for its job: admitted in the tenants' fair queue
    # as its tenant's, not in the endpoint's few slots shared by everyone.
    for_job = partial(chat_completion, url, job_id, "What is 2 + 3?", max_tokens=12)
    answered = await asyncio.to_thread(for_job, temperature=0.0, token=token, for_job=job_id)
    assert answered == (f"{job_id}@v1", adapted)
    failed = await asyncio.to_thread(
        CliRunner().invoke, app, ["sample", "nope", "hi", "--url", url]
    )
    assert failed.exit_code == 1 and "unknown job 'nope'" in failed.output


async def test_a_judge_asks_the_rollout_service_s_base_model(
    served: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A judged reward's default endpoint is the stack's own chat endpoint (MARLAAS_CHAT_URL,
    the bus's credential): the real engine answers greedily, once per (question, answer); the
    tiny random model rarely writes a score, and then the episode gets the reason."""
    url, _, _ = served
    monkeypatch.setenv("MARLAAS_CHAT_URL", url)
    monkeypatch.setenv("MARLAAS_BUS_KEY", BUS_KEY.get_secret_value())
    judge = Judge("Is the answer right?", max_tokens=4)
    task = Task(question="What is 2 + 3?")
    said: list[ChatMessage] = [{"role": "assistant", "content": "5"}]
    first = await ascore([Reward("judged", judge)], task, said)
    again = await ascore([Reward("judged", judge)], task, said)
    assert first == again  # greedy: the same verdict
    assert first.error == "" or "judge gave no score" in first.error  # reached, answered
    assert judge.requests == (2 if first.error else 1)  # a score is cached, a failure not
