"""vLLM's in-process async engine sampling every job's requests, each with its job's LoRA.

One `RolloutEngine` serves all jobs in one continuous batch: vLLM schedules requests for
different adapters side by side (up to `max_loras` distinct adapters per step), so a job's
request never waits for another job's batch. Token-in/token-out: the context arrives as
token ids and the completion leaves as token ids with the sampler's logprob of each one.

How vLLM runs here, its CPU quirks and our work-arounds: docs/architecture.md, "vLLM on CPU".
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.runtime.hardware import Hardware, Precision, detect, engine_precision, log_precision
from common.wire.messages import (
    ContextTooLongError,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingSettings,
    result_for,
)
from rollout_svc import cpu_lora

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""`max_lora_rank` values vLLM accepts; an adapter's rank must not exceed the chosen one."""

_GIB = 1 << 30
CPU_KV_CACHE_GIB = 1.0
"""KV cache of a CPU engine when none is set: vLLM's CPU backend cannot size it itself."""
CPU_BLOCK_SIZE = 32
"""KV cache block of a CPU engine, in tokens (vLLM's CPU default: 128; its attention takes
multiples of 32). A group's G samples share one prompt, but the prefix cache only shares
whole blocks: with 128, each sample recomputed up to 127 tokens of the prompt's tail. For
16 samples of a 371-token prompt (SmolLM2, float32, AVX2 class): 1.97 s with 32 against
5.53 s with 128, and 0.95 s for one; decoding as fast with either (77 vs 76 tok/s at 16
sequences, 104 vs 106 at 64). bench/kv_blocks.py, results/kv-blocks-20261205-cpu2-avx2.json."""


@dataclass(frozen=True)
class AdapterRef:
    """One published version of one job's adapter: a PEFT directory on local disk."""

    job_id: str
    version: int
    """1, 2, ...; version 0 is the bare base model and needs no directory."""
    path: str

    @property
    def lora_name(self) -> str:
        return f"{self.job_id}@v{self.version}"


NULL_ADAPTER_NAME = "marlaas-base@v0"


def write_null_adapter(model_dir: Path, out_dir: Path) -> Path:
    """A PEFT LoRA of rank 1 on layer 0's q_proj whose weights are zero: the base model.

    Assumes Llama-style module names (`model.layers.N.self_attn.q_proj`), as SmolLM2 has.
    """
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden_size = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden_size // config["num_attention_heads"]
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.zeros(1, hidden_size),
            f"{prefix}.lora_B.weight": torch.zeros(config["num_attention_heads"] * head_dim, 1),
        },
        str(out_dir / "adapter_model.safetensors"),
    )
    adapter_config = {
        "peft_type": "LORA",
        "r": 1,
        "lora_alpha": 1,
        "target_modules": ["q_proj"],
        "bias": "none",
        "base_model_name_or_path": str(model_dir),
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out_dir


@dataclass
class _LoadedAdapter:
    """Engine-side bookkeeping of one adapter version: its LoRA id and who is using it."""

    ref: AdapterRef
    lora_int_id: int
    in_flight: int = 0
    retiring: bool = False
    """Remove from the engine as soon as `in_flight` drops to 0."""
    loaded: bool = False
    """The engine accepted it (`add_lora`): requests with it cannot fail its loading."""
    loading: asyncio.Lock = field(default_factory=asyncio.Lock)


class AdapterUnavailableError(RuntimeError):
    """An adapter version the engine cannot load (files missing or unreadable): its request
    fails alone. Handed to vLLM with the request instead, the load would fail inside the
    engine's step and kill the engine, and with it every tenant's requests."""


class RolloutEngine:
    """vLLM's async engine with per-request LoRA adapters and utilisation counters."""

    def __init__(
        self,
        model: str | Path,
        *,
        enable_lora: bool = True,
        max_loras: int = 4,
        max_cpu_loras: int | None = None,
        max_lora_rank: int = 16,
        lora_target_modules: Sequence[str] | None = None,
        max_model_len: int = 1024,
        max_num_seqs: int | None = None,
        kv_cache_gib: float | None = None,
        gpu_memory_utilization: float = 0.85,
        dtype: str = "auto",
        enforce_eager: bool | None = None,
        logprobs_mode: str = "raw_logprobs",
        seed: int = 0,
    ) -> None:
        """Configure; nothing starts until `start()`.

        `enable_lora` False serves the base model only (every request must be version 0).
        `max_loras`: distinct adapters in one batch step; `max_cpu_loras`: adapters kept
        loaded (least recently used ones are evicted and reloaded from their path on next
        use; default `max_loras`). `lora_target_modules`: the modules (PEFT names) that get
        LoRA slots; None lets vLLM give every supported linear layer one, which costs compute
        on layers no adapter targets. `kv_cache_gib`: KV cache size; None: 1 GiB on a CPU, and
        on a GPU what `gpu_memory_utilization` leaves. `enforce_eager` None: eager on a CPU,
        CUDA graphs on a GPU. `dtype`: `auto` (bf16 where the hardware runs it natively, else
        float32 on a CPU and float16 on a GPU, common/runtime/hardware.py) or a dtype.
        `logprobs_mode`: `raw_logprobs` returns the model's log-softmax before temperature/top-p,
        the quantity the trainer recomputes;
        `processed_logprobs` returns the distribution actually sampled from.
        """
        if max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {VLLM_LORA_RANKS}, not {max_lora_rank}")
        self.model = str(model)
        self.enable_lora = enable_lora
        self.max_loras = max_loras
        self.lora_target_modules = (
            None if lora_target_modules is None else list(lora_target_modules)
        )
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.kv_cache_gib = kv_cache_gib
        self.gpu_memory_utilization = gpu_memory_utilization
        self.dtype = dtype
        self.precision: Precision | None = None
        """What `dtype` resolved to at `start()`, and why."""
        self.hardware: Hardware | None = None
        """What the engine computes on (its GPUs included), read at `start()`."""
        self.enforce_eager = enforce_eager
        self.logprobs_mode = logprobs_mode
        self.seed = seed

        self._engine: AsyncLLM | None = None
        self._null_adapter_dir: Path | None = None
        self._null_lora: LoRARequest | None = None
        """What base-model requests carry: the null adapter on CPU when the stacked LoRA plugin
        is left out, None otherwise."""
        self._adapters: dict[tuple[str, int], _LoadedAdapter] = {}
        self._lora_ids = itertools.count(1)  # vLLM rejects id 0
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
        self._idle = asyncio.Event()
        self._idle.set()

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.lora.request import LoRARequest
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        extra_slots = 0
        if self.enable_lora and current_platform.is_cpu() and not cpu_lora.plugin_enabled():
            # vLLM's own CPU LoRA path reads the "no adapter" sentinel -1 as the last slot.
            self._null_adapter_dir = write_null_adapter(
                Path(self.model), Path(tempfile.mkdtemp(prefix="marlaas-null-lora-"))
            )
            extra_slots = 1
        on_cpu = current_platform.is_cpu()
        self.hardware = hardware = detect(gpus=not on_cpu)
        self.precision = precision = engine_precision(self.dtype, hardware, on_gpu=not on_cpu)
        log_precision("rollout engine", precision, hardware)
        kv_cache_gib = self.kv_cache_gib or (CPU_KV_CACHE_GIB if on_cpu else None)
        args = AsyncEngineArgs(
            model=self.model,
            dtype=precision.dtype,
            enforce_eager=on_cpu if self.enforce_eager is None else self.enforce_eager,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_lora=self.enable_lora,
            max_loras=self.max_loras + extra_slots,
            max_cpu_loras=(
                None if self.max_cpu_loras is None else self.max_cpu_loras + extra_slots
            ),
            max_lora_rank=self.max_lora_rank,  # type: ignore[arg-type]
            lora_target_modules=self.lora_target_modules,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * _GIB),
            block_size=CPU_BLOCK_SIZE if on_cpu else None,
            logprobs_mode=self.logprobs_mode,  # type: ignore[arg-type]
            seed=self.seed,
            # Per-request stats carry the engine's queued/scheduled timestamps (queue_s).
            disable_log_stats=False,
        )
        # In a thread: the constructor blocks until the engine process has loaded the model,
        # and the caller's event loop must go on (rollout_svc answers /healthz meanwhile).
        # Built outside the loop, AsyncLLM starts its output handler on the first request.
        self._engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        if self._null_adapter_dir is not None:
            self._null_lora = LoRARequest(
                lora_name=NULL_ADAPTER_NAME,
                lora_int_id=next(self._lora_ids),
                lora_path=str(self._null_adapter_dir),
            )
            await self._engine.add_lora(self._null_lora)
            await self._engine.pin_lora(self._null_lora.lora_int_id)  # never evicted
        await self._warm_up()
        self.start_seconds = time.monotonic() - started
        log.info("vLLM engine for %s ready in %.1f s", self.model, self.start_seconds)

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
        self._adapters.clear()
        self._null_lora = None
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
            lora_request=self._null_lora,
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
        from vllm.inputs import TokensPrompt

        engine = self._require_engine()
        context_len = len(request.context_token_ids)
        if not 0 < context_len < self.max_model_len:
            raise ContextTooLongError(
                f"request {request.request_id}: context of {context_len} tokens leaves no room "
                f"to generate within max_model_len={self.max_model_len}"
            )
        params = self._sampling_params(request.sampling, turn_seed(request))
        # Unique even when at-least-once delivery hands us the same request twice at once.
        engine_request_id = f"{request.request_id}#{next(self._request_seq)}"
        lora = self._acquire(adapter)
        self._enter()
        self._engine_request_ids.add(engine_request_id)
        started = time.monotonic()
        try:
            await self._ensure_loaded(adapter, lora)
            final = None
            async for output in engine.generate(
                TokensPrompt(prompt_token_ids=list(request.context_token_ids)),
                params,
                request_id=engine_request_id,
                lora_request=lora,
            ):
                final = output
        finally:
            self._engine_request_ids.discard(engine_request_id)
            self._leave()
            await self._release(adapter)
        elapsed = time.monotonic() - started
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for request {request.request_id}")

        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
            raise RuntimeError(f"vLLM returned no logprob per token for {request.request_id}")
        # With logprobs=0 each position holds exactly the sampled token's entry.
        logprobs: list[float] = []
        for position, token_id in zip(completion.logprobs, token_ids, strict=True):
            if position is None or token_id not in position:
                raise RuntimeError(f"vLLM left out a sampled token's logprob: {request.request_id}")
            logprobs.append(float(position[token_id].logprob))
        metrics = final.metrics
        queue_s = 0.0
        if metrics is not None and getattr(metrics, "scheduled_ts", 0.0) > 0.0:
            queue_s = max(0.0, metrics.scheduled_ts - metrics.queued_ts)
        self.generated_tokens += len(token_ids)
        self.prompt_tokens += context_len
        self.cached_prompt_tokens += final.num_cached_tokens or 0
        self.preemptions += getattr(metrics, "num_preemptions", 0) if metrics is not None else 0
        self.completed_requests += 1
        return result_for(
            request,
            completion_token_ids=token_ids,
            logprobs=logprobs,
            adapter_version=adapter.version if adapter is not None else 0,
            finish_reason=_finish_reason(completion.finish_reason),
            queue_s=queue_s,
            generate_s=max(0.0, elapsed - queue_s),
        )

    def _sampling_params(self, sampling: SamplingSettings, seed: int | None) -> SamplingParams:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=seed,
            max_tokens=sampling.max_new_tokens,
            stop=list(sampling.stop) or None,
            logprobs=0,  # the sampled token's logprob only
            # Stop strings need text; without them skip detokenising (CPU in this process).
            detokenize=bool(sampling.stop),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    # --- adapters -----------------------------------------------------------------------

    async def load(self, adapter: AdapterRef) -> None:
        """Load `adapter` now, so its first request does not stall a batch step loading it."""
        lora = self._acquire(adapter)
        try:
            await self._ensure_loaded(adapter, lora)
        finally:
            await self._release(adapter)

    async def _ensure_loaded(self, adapter: AdapterRef | None, lora: LoRARequest | None) -> None:
        """Have the engine load an adapter version once, before any request uses it; raise
        AdapterUnavailableError when it cannot (and try again with the next request)."""
        entry = self._adapters.get((adapter.job_id, adapter.version)) if adapter else None
        if adapter is None or lora is None or entry is None or entry.loaded:
            return
        async with entry.loading:
            if entry.loaded:
                return
            if not (Path(adapter.path) / "adapter_config.json").is_file():
                raise AdapterUnavailableError(
                    f"adapter {adapter.lora_name}: no adapter_config.json in {adapter.path}"
                )
            try:
                await self._require_engine().add_lora(lora)
            except Exception as exc:
                raise AdapterUnavailableError(
                    f"adapter {adapter.lora_name} not loaded from {adapter.path}: {exc}"
                ) from exc
            entry.loaded = True

    async def retire(self, job_id: str, version: int) -> None:
        """Remove an adapter version from the engine once no request in flight uses it.

        Requests that arrive for it before then still run with it; a request after the
        removal loads it again from its path under a new LoRA id.
        """
        entry = self._adapters.get((job_id, version))
        if entry is None:
            return
        entry.retiring = True
        if entry.in_flight == 0:
            await self._remove(entry)

    def lora_int_id(self, job_id: str, version: int) -> int | None:
        """The engine's LoRA id for an adapter version; None if unknown or retired."""
        entry = self._adapters.get((job_id, version))
        return entry.lora_int_id if entry is not None else None

    async def loaded_lora_ids(self) -> set[int]:
        """LoRA ids the engine holds now (its CPU cache may have evicted some)."""
        return set(await self._require_engine().list_loras())

    def _acquire(self, adapter: AdapterRef | None) -> LoRARequest | None:
        from vllm.lora.request import LoRARequest

        if adapter is None or adapter.version == 0:
            return self._null_lora
        if not self.enable_lora:
            raise ValueError(f"adapter {adapter.lora_name} requested from an engine without LoRA")
        key = (adapter.job_id, adapter.version)
        entry = self._adapters.get(key)
        if entry is None:
            entry = _LoadedAdapter(adapter, next(self._lora_ids))
            self._adapters[key] = entry
        elif entry.ref.path != adapter.path:
            raise ValueError(
                f"adapter {adapter.lora_name} is already registered from {entry.ref.path}, "
                f"not {adapter.path}: a published version must not change"
            )
        entry.in_flight += 1
        return LoRARequest(
            lora_name=adapter.lora_name, lora_int_id=entry.lora_int_id, lora_path=adapter.path
        )

    async def _release(self, adapter: AdapterRef | None) -> None:
        if adapter is None or adapter.version == 0:
            return
        entry = self._adapters.get((adapter.job_id, adapter.version))
        if entry is None:
            return
        entry.in_flight -= 1
        if entry.retiring and entry.in_flight == 0:
            await self._remove(entry)

    async def _remove(self, entry: _LoadedAdapter) -> None:
        # Forget it before awaiting: a request arriving meanwhile gets a fresh LoRA id.
        del self._adapters[(entry.ref.job_id, entry.ref.version)]
        if self._engine is not None:
            removed = await self._engine.remove_lora(entry.lora_int_id)
            log.info("retired adapter %s (removed from engine: %s)", entry.ref.lora_name, removed)

    # --- utilisation --------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Started and not dead (vLLM marks the engine errored when its core process died)."""
        return self._engine is not None and not self._engine.errored

    @property
    def loaded_adapters(self) -> int:
        """Adapter versions registered with the engine and not retired (the null one aside)."""
        return len(self._adapters)

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

    def _enter(self) -> None:
        if self._in_flight == 0:
            self._busy_since = time.monotonic()
            self._idle.clear()
        self._in_flight += 1

    def _leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._busy_seconds += time.monotonic() - self._busy_since
            self._idle.set()

    def _require_engine(self) -> AsyncLLM:
        if self._engine is None:
            raise RuntimeError("RolloutEngine is not started")
        return self._engine


def turn_seed(request: GenerationRequest) -> int | None:
    """The sampler's seed for one turn: None when the job's sampling is unseeded, else one
    of 2^63 named by the job's seed, the group's place in the job (its id without the job's:
    `g<index>`), the sample and the turn. The job id stays out, so the same spec submitted
    again under another id draws the same."""
    seed = request.sampling.seed
    if seed is None:
        return None
    group = request.group_id.removeprefix(f"{request.job_id}/")
    name = f"{seed}:{group}:{request.sample_index}:{request.turn}".encode()
    return int.from_bytes(hashlib.sha256(name).digest()[:8], "big") >> 1


def _finish_reason(vllm_reason: str | None) -> FinishReason:
    """vLLM's "stop" (EOS, stop string) and "length" pass; anything else is an abort."""
    if vllm_reason in ("stop", "length"):
        return vllm_reason  # type: ignore[return-value]
    return "abort"
