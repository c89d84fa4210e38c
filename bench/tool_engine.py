"""A deterministic stand-in for the rollout engine, for bench/async_tools.py only
(`ROLLOUT_ENGINE=tool_engine:ToolCallingEngine`, bench/ on the Python path): it answers an
episode's first turn with a `lookup` tool call and every later turn with a short answer, at
once. The bench measures env_svc, so the engine must not be the bottleneck; everything else
(rollout_svc, the broker, Redis, env_svc, the trainer on the tiny model) is the real thing.
"""

from __future__ import annotations

import time
from pathlib import Path

from common.messages import GenerationRequest, GenerationResult, result_for
from rollout_svc.engine import AdapterRef

CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "k1"}}</tool_call>'


class ToolCallingEngine:
    ready = False

    def __init__(self, model: str | Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        eos = tokenizer.eos_token_id
        self._call = [*tokenizer.encode(CALL, add_special_tokens=False), eos]
        self._answer = [*tokenizer.encode("v-1", add_special_tokens=False), eos]
        self.in_flight = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.preemptions = 0
        self.busy_seconds = 0.0
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
        completion = self._call if request.turn == 0 else self._answer
        self.generated_tokens += len(completion)
        self.prompt_tokens += len(request.context_token_ids)
        self.busy_seconds += time.monotonic() - started
        return result_for(
            request,
            completion_token_ids=completion,
            logprobs=[-0.7] * len(completion),
            adapter_version=adapter.version if adapter else 0,
            finish_reason="stop",
        )

    async def load(self, adapter: AdapterRef) -> None:
        self.loaded[adapter.job_id] = adapter.version

    async def retire(self, job_id: str, version: int) -> None:
        if self.loaded.get(job_id) == version:
            del self.loaded[job_id]
