"""What rollout_svc needs of its engine: `rollout_svc.engine.RolloutEngine` (vLLM), or a
deterministic stand-in (handler tests, the chaos and bench engines)."""

from __future__ import annotations

from typing import Protocol

from common.wire.adapters import AdapterRef
from common.wire.messages import GenerationRequest, GenerationResult


class GenerationEngine(Protocol):
    """Samples turns with a job's adapter; loads and retires adapter versions; counts."""

    @property
    def ready(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def loaded_adapters(self) -> int: ...

    @property
    def busy_seconds(self) -> float: ...

    @property
    def request_seconds(self) -> float: ...

    @property
    def generated_tokens(self) -> int: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def cached_prompt_tokens(self) -> int: ...

    @property
    def preemptions(self) -> int: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def generate(
        self, request: GenerationRequest, adapter: AdapterRef | None = None
    ) -> GenerationResult: ...

    async def load(self, adapter: AdapterRef) -> None: ...

    async def retire(self, job_id: str, version: int) -> None: ...
