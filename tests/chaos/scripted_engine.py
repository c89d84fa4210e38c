"""A deterministic stand-in for the vLLM engine, for the chaos run only (`ROLLOUT_ENGINE=
tests.chaos.scripted_engine:ScriptedEngine`): it answers every request at once with one of six short
replies chosen by a hash of the request id (half right for the `chaos` environment), so
a chaos run spends its time on crashes and recoveries, not on sampling. Everything around it
(rollout_svc, the broker, Redis, env_svc, the trainer on the tiny model) is the real thing;
the real engine is covered by tests/integration/test_rollout_engine.py and the pipeline test.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

from common.wire.adapters import AdapterRef
from common.wire.messages import GenerationRequest, GenerationResult, result_for


class ScriptedEngine:
    ready = False

    replies: tuple[str, ...] = ("1", "1.", "It is 1", "2", "I think 2", "two")
    """What it writes, each closed by the eos token."""

    def __init__(self, model: str | Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = tokenizer = AutoTokenizer.from_pretrained(model)
        self._replies = [
            [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
            for text in self.replies
        ]
        self.in_flight = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # no prefix cache
        self.preemptions = 0
        self.busy_seconds = 0.0
        self.request_seconds = 0.0
        self.loaded: dict[str, int] = {}

    @property
    def loaded_adapters(self) -> int:
        return len(self.loaded)

    async def start(self) -> None:
        self.ready = True

    async def stop(self) -> None:
        self.ready = False

    async def generate(
        self, request: GenerationRequest, adapter: AdapterRef | None = None
    ) -> GenerationResult:
        started = time.monotonic()
        self.in_flight += 1
        try:
            await asyncio.sleep(0.005)
        finally:
            self.in_flight -= 1
        completion = self.reply_to(request)[: request.sampling.max_new_tokens]
        self.generated_tokens += len(completion)
        self.prompt_tokens += len(request.context_token_ids)
        self.busy_seconds += time.monotonic() - started
        self.request_seconds += time.monotonic() - started
        return result_for(
            request,
            completion_token_ids=completion,
            logprobs=[-0.7] * len(completion),
            adapter_version=adapter.version if adapter else 0,
            finish_reason="stop",
        )

    def reply_to(self, request: GenerationRequest) -> list[int]:
        """One of `replies`, by a hash of the request id (a replayed request gets the same)."""
        digest = hashlib.sha256(request.request_id.encode()).digest()
        return self._replies[digest[0] % len(self._replies)]

    async def load(self, adapter: AdapterRef) -> None:
        self.loaded[adapter.job_id] = adapter.version

    async def retire(self, job_id: str, version: int) -> None:
        if self.loaded.get(job_id) == version:
            del self.loaded[job_id]
