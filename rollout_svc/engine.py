"""vLLM's in-process async engine sampling every job's requests, each with its job's LoRA.

One `RolloutEngine` serves all jobs in one continuous batch: vLLM schedules requests for
different adapters side by side (up to `max_loras` distinct adapters per step), so a job's
request never waits for another job's batch. Token-in/token-out: the context arrives as
token ids and the completion leaves as token ids with the sampler's logprob of each one.
Its settings and vLLM's arguments: rollout_svc/engine_settings.py; the adapters it holds:
rollout_svc/loras.py; one turn's parameters and result: rollout_svc/sampling.py.

How vLLM runs here, its CPU quirks and our work-arounds: docs/architecture.md, "vLLM on CPU".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common.runtime.hardware import Hardware, Precision, detect, engine_precision, log_precision
from common.wire.adapters import AdapterRef
from common.wire.messages import ContextTooLongError, GenerationRequest, GenerationResult
from rollout_svc import cpu_lora
from rollout_svc.engine_settings import EngineSettings, engine_args
from rollout_svc.loras import NULL_ADAPTER_NAME, LoraSlots, write_null_adapter
from rollout_svc.sampling import result_of, sampling_params, turn_seed

if TYPE_CHECKING:
    from vllm import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)


class RolloutEngine:
    """vLLM's async engine with per-request LoRA adapters and utilisation counters."""

    def __init__(self, settings: EngineSettings) -> None:
        """Configure; nothing starts until `start()`."""
        self.settings = settings
        self.precision: Precision | None = None
        """What `settings.dtype` resolved to at `start()`, and why."""
        self.hardware: Hardware | None = None
        """What the engine computes on (its GPUs included), read at `start()`."""
        self._engine: AsyncLLM | None = None
        self._null_adapter_dir: Path | None = None
        self.loras = LoraSlots(lambda: self._engine, enabled=settings.enable_lora)
        self._request_seq = itertools.count()
        self._engine_request_ids: set[str] = set()
        self.start_seconds = 0.0
        """Wall time `start()` took, warm-up request included."""
        self.generated_tokens = 0
        """Completion tokens returned since start (the warm-up request excluded)."""
        self.prompt_tokens = 0
        """Context tokens of the finished requests: prefilled, or found in the prefix cache."""
        self.cached_prompt_tokens = 0
        """Of `prompt_tokens`, those the prefix cache held (not computed again)."""
        self.preemptions = 0
        """Times a finished request was preempted (its KV cache freed, recomputed later)."""
        self.completed_requests = 0
        self._in_flight = 0
        self._busy_seconds = 0.0
        self._busy_since = 0.0
        self._request_seconds = 0.0
        self._changed_at = 0.0
        self._idle = asyncio.Event()
        self._idle.set()

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        from vllm.lora.request import LoRARequest
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        model = str(self.settings.model)
        on_cpu = current_platform.is_cpu()
        if self.settings.enable_lora and on_cpu and not cpu_lora.plugin_enabled():
            # vLLM's own CPU LoRA path reads the "no adapter" sentinel -1 as the last slot.
            self._null_adapter_dir = write_null_adapter(
                Path(model), Path(tempfile.mkdtemp(prefix="marlaas-null-lora-"))
            )
        self.hardware = hardware = detect(gpus=not on_cpu)
        self.precision = engine_precision(self.settings.dtype, hardware, on_gpu=not on_cpu)
        log_precision("rollout engine", self.precision, hardware)
        args = engine_args(
            self.settings,
            dtype=self.precision.dtype,
            on_cpu=on_cpu,
            extra_lora_slots=int(self._null_adapter_dir is not None),
        )
        # In a thread: the constructor blocks until the engine process has loaded the model,
        # and the caller's event loop must go on (rollout_svc answers /healthz meanwhile).
        # Built outside the loop, AsyncLLM starts its output handler on the first request.
        self._engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        if self._null_adapter_dir is not None:
            null_lora = LoRARequest(
                lora_name=NULL_ADAPTER_NAME,
                lora_int_id=self.loras.next_id(),
                lora_path=str(self._null_adapter_dir),
            )
            self.loras.null_lora = null_lora
            await self._engine.add_lora(null_lora)
            await self._engine.pin_lora(null_lora.lora_int_id)  # never evicted
        await self._warm_up()
        self.start_seconds = time.monotonic() - started
        log.info("vLLM engine for %s ready in %.1f s", model, self.start_seconds)

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Abort requests in flight (their `generate` returns finish_reason "abort"), then
        shut the engine and its processes down."""
        if self._engine is not None and self._engine_request_ids:
            # Without this a pending generate() would wait forever on a dead engine.
            await self._engine.abort(list(self._engine_request_ids))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
        self.loras.clear()
        if self._null_adapter_dir is not None:
            shutil.rmtree(self._null_adapter_dir, ignore_errors=True)
            self._null_adapter_dir = None

    async def __aenter__(self) -> RolloutEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _warm_up(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=4, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
        )
        async for _ in self._require_engine().generate(
            TokensPrompt(prompt_token_ids=[0, 1, 2, 3]),
            params,
            request_id="warm-up",
            lora_request=self.loras.null_lora,
        ):
            pass

    # --- generation ---------------------------------------------------------------------

    async def generate(
        self, request: GenerationRequest, adapter: AdapterRef | None = None
    ) -> GenerationResult:
        """Sample one turn for `request` with `adapter` (None or version 0: the base model).

        Raises ContextTooLongError when the context fills `max_model_len`; a completion
        that reaches `max_model_len` ends early with finish_reason "length".
        """
        self._require_engine()
        context_len, max_model_len = len(request.context_token_ids), self.settings.max_model_len
        if not 0 < context_len < max_model_len:
            raise ContextTooLongError(
                f"request {request.request_id}: context of {context_len} tokens leaves no room "
                f"to generate within max_model_len={max_model_len}"
            )
        started = time.monotonic()
        final = await self._final_output(request, adapter)
        elapsed = time.monotonic() - started
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for request {request.request_id}")
        version = adapter.version if adapter is not None else 0
        result = result_of(request, final, version, elapsed)
        self._count(final, context_len, len(result.completion_token_ids))
        return result

    async def _final_output(
        self, request: GenerationRequest, adapter: AdapterRef | None
    ) -> RequestOutput | None:
        """Run `request` through the engine with `adapter`'s LoRA; vLLM's final output."""
        from vllm.inputs import TokensPrompt

        engine = self._require_engine()
        params = sampling_params(request.sampling, turn_seed(request))
        # Unique even when at-least-once delivery hands us the same request twice at once.
        engine_request_id = f"{request.request_id}#{next(self._request_seq)}"
        lora = self.loras.acquire(adapter)
        self._enter()
        self._engine_request_ids.add(engine_request_id)
        try:
            await self.loras.ensure_loaded(adapter, lora)
            final = None
            async for output in engine.generate(
                TokensPrompt(prompt_token_ids=list(request.context_token_ids)),
                params,
                request_id=engine_request_id,
                lora_request=lora,
            ):
                final = output
            return final
        finally:
            self._engine_request_ids.discard(engine_request_id)
            self._leave()
            await self.loras.release(adapter)

    def _count(self, final: RequestOutput, context_len: int, completion_len: int) -> None:
        metrics = final.metrics
        self.generated_tokens += completion_len
        self.prompt_tokens += context_len
        self.cached_prompt_tokens += final.num_cached_tokens or 0
        self.preemptions += getattr(metrics, "num_preemptions", 0) if metrics is not None else 0
        self.completed_requests += 1

    # --- adapters -----------------------------------------------------------------------

    async def load(self, adapter: AdapterRef) -> None:
        """Load `adapter` now, so its first request does not stall a batch step loading it."""
        lora = self.loras.acquire(adapter)
        try:
            await self.loras.ensure_loaded(adapter, lora)
        finally:
            await self.loras.release(adapter)

    async def retire(self, job_id: str, version: int) -> None:
        """Remove an adapter version from the engine once no request in flight uses it
        (rollout_svc/loras.py, `LoraSlots.retire`)."""
        await self.loras.retire(job_id, version)

    def lora_int_id(self, job_id: str, version: int) -> int | None:
        """The engine's LoRA id for an adapter version; None if unknown or retired."""
        return self.loras.lora_int_id(job_id, version)

    async def loaded_lora_ids(self) -> set[int]:
        """LoRA ids the engine holds now (its CPU cache may have evicted some)."""
        return set(await self._require_engine().list_loras())

    # --- utilisation --------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Started and not dead (vLLM marks the engine errored when its core process died)."""
        return self._engine is not None and not self._engine.errored

    @property
    def loaded_adapters(self) -> int:
        """Adapter versions registered with the engine and not retired (the null one aside)."""
        return len(self.loras)

    @property
    def in_flight(self) -> int:
        """Requests submitted to the engine and not finished yet."""
        return self._in_flight

    @property
    def busy_seconds(self) -> float:
        """Wall time during which at least one request was in the engine."""
        if self._in_flight:
            return self._busy_seconds + time.monotonic() - self._busy_since
        return self._busy_seconds

    @property
    def request_seconds(self) -> float:
        """Requests in the engine integrated over wall time: over `busy_seconds`, the mean
        number of requests it held while busy (its batch, as long as none waits)."""
        return self._request_seconds + self._in_flight * (time.monotonic() - self._changed_at)

    def _count_requests(self) -> None:
        now = time.monotonic()
        self._request_seconds += self._in_flight * (now - self._changed_at)
        self._changed_at = now

    def _enter(self) -> None:
        self._count_requests()
        if self._in_flight == 0:
            self._busy_since = time.monotonic()
            self._idle.clear()
        self._in_flight += 1

    def _leave(self) -> None:
        self._count_requests()
        self._in_flight -= 1
        if self._in_flight == 0:
            self._busy_seconds += time.monotonic() - self._busy_since
            self._idle.set()

    def _require_engine(self) -> AsyncLLM:
        if self._engine is None:
            raise RuntimeError("RolloutEngine is not started")
        return self._engine
